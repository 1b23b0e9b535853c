// The real disaggregated cluster for the Node end-to-end tests: router_main +
// 1 prefill_main + 1 decode_main (tiny checkpoint) + gateway_main, every port
// picked by the kernel on 127.0.0.1, and the official `openai` npm client
// (pinned in tools/node) pointed at the gateway. Shared by
// gateway_cluster_e2e.mjs and gateway_structured_e2e.mjs. Every wait is
// bounded (startCluster's watchdog fails the run); finish() stops the watchdog
// and kills every child.
//
// env: ROUTER_BIN, PREFILL_BIN, DECODE_BIN, GATEWAY_BIN, MODEL_DIR,
//      TANDEM_NODE_MODULES
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';

const nodeModules = process.env.TANDEM_NODE_MODULES;
if (!nodeModules || !fs.existsSync(path.join(nodeModules, 'openai', 'package.json'))) {
  console.error(`FAIL: the openai npm package is missing (${nodeModules}/openai); run ./tandem setup`);
  process.exit(1);
}
export const require = createRequire(path.join(nodeModules, 'noop.js'));
const openaiModule = require('openai');
export const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;

const t0 = Date.now();
export const elapsed = () => `${((Date.now() - t0) / 1000).toFixed(1)} s`;
const children = [];
export function killAll() {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
}
process.on('exit', killAll);
function dumpLogs() {
  for (const c of children) console.error(`--- ${c.name} (last 30 lines)\n${c.logs.slice(-30).join('\n')}`);
}
export function fail(message) {
  console.error(`FAIL: ${message}`);
  dumpLogs();
  killAll();
  process.exit(1);
}
let watchdog;

// Spawns a process; JSON log lines (either stream) go to `onJson`.
let stopping = false;
export function start(name, bin, args, onJson = () => {}) {
  const child = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  child.name = name;
  child.logs = [];
  children.push(child);
  for (const s of [child.stdout, child.stderr]) {
    readline.createInterface({ input: s }).on('line', (line) => {
      child.logs.push(line);
      if (!line.startsWith('{')) return;
      let e;
      try { e = JSON.parse(line); } catch { return; }
      onJson(e);
    });
  }
  child.exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  child.exited.then((r) => stopping || fail(`${name} exited early: ${JSON.stringify(r)}`));
  return child;
}

// Resolves with `field` of the first log line whose msg is `msg` (bounded).
export function loggedValue(name, bin, args, msg, field, onJson = () => {}, ms = 30_000) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`${name} did not log "${msg}"`)), ms);
    const child = start(name, bin, args, (e) => {
      if (e.msg === msg && e[field] !== undefined) { clearTimeout(t); resolve({ child, value: e }); }
      onJson(e);
    });
  });
}

// Polls `fn` until it returns a truthy value; throws after `ms`.
export async function poll(what, fn, ms = 20_000) {
  const end = Date.now() + ms;
  let last;
  while (Date.now() < end) {
    try {
      last = await fn();
      if (last) return last;
    } catch (err) {
      last = err;
    }
    await new Promise((r) => setTimeout(r, 25));
  }
  throw new Error(`timed out waiting for ${what} (last: ${last})`);
}

// One sample of a Prometheus text metric (exact label set), or undefined.
export async function metric(port, name, labels = '') {
  const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
  const key = labels ? `${name}{${labels}}` : name;
  for (const line of text.split('\n')) {
    if (line.startsWith(`${key} `)) return Number(line.slice(key.length + 1));
  }
  return undefined;
}


const MODEL_DIR = process.env.MODEL_DIR;
export const API_KEY = 'cluster-key';
// The router logs every Generate's prompt size at debug level.
export const routerPrompts = new Map();
export const workerPorts = {};
let routerMetrics;
let decodeMetrics;

// Starts the cluster; resolves with what the tests use. `timeoutMs` bounds
// the whole run.
export async function startCluster({ timeoutMs, maxNumSeqs = 4, kvCacheMemory = '64MiB' }) {
  watchdog = setTimeout(() => fail(`timed out after ${timeoutMs / 1000} s`), timeoutMs);
  // The router logs every Generate's prompt size at debug level.
  let router, routerPort;
  try {
    const r = await loggedValue('router', process.env.ROUTER_BIN, [
      `--model=${MODEL_DIR}`, '--port=0', '--metrics_port=0', '--heartbeat_interval_s=0.2',
      '--heartbeat_timeout_s=30', '--log_format=json', '--log_level=debug',
      // Every request disaggregated: the tests' prompts are below the router's
      // default --colocate_below_tokens (1000), and the prefill worker is
      // what runs the vision tower and the prompt.
      '--colocate_below_tokens=0',
    ], 'router serving', 'grpc_port', (e) => {
      if (e.msg === 'generate' && e.request_id !== undefined) routerPrompts.set(e.request_id, e.prompt_tokens);
    });
    router = r.child;
    routerPort = r.value.grpc_port;
    routerMetrics = r.value.metrics_port;
  } catch (err) {
    fail(err.message);
  }

  await Promise.all(['prefill', 'decode'].map(async (role) => {
    const bin = role === 'prefill' ? process.env.PREFILL_BIN : process.env.DECODE_BIN;
    try {
      const w = await loggedValue(role, bin, [
        `--model=${MODEL_DIR}`, `--worker_id=${role}-0`, `--router=127.0.0.1:${routerPort}`,
        '--port=0', '--metrics_port=0', `--max_num_seqs=${maxNumSeqs}`, '--max_model_len=1024', `--kv_cache_memory=${kvCacheMemory}`,
        '--log_format=json',
      ], 'worker serving', 'metrics_port');
      workerPorts[role] = w.value.metrics_port;
    } catch (err) {
      fail(err.message);
    }
  }));
  for (const role of ['prefill', 'decode']) {
    try {
      await poll(`${role} registration`, async () =>
        (await metric(routerMetrics, 'tandem_router_workers', `role="${role}"`)) === 1, 30_000);
    } catch (err) {
      fail(err.message);
    }
  }

  let gateway, gatewayPort;
  try {
    const g = await loggedValue('gateway', process.env.GATEWAY_BIN, [
      `--model=${MODEL_DIR}`, `--router=127.0.0.1:${routerPort}`, '--port=0',
      `--api_key=${API_KEY}`, '--io_threads=2', '--log_format=json',
    ], 'gateway serving', 'port');
    gateway = g.child;
    gatewayPort = g.value.port;
  } catch (err) {
    fail(err.message);
  }
  console.log(`cluster up in ${elapsed()}`);

  const base = `http://127.0.0.1:${gatewayPort}`;
  const client = new OpenAI({ apiKey: API_KEY, baseURL: `${base}/v1`, maxRetries: 0, timeout: 60_000 });
  const models = await client.models.list();
  const MODEL = models.data[0].id;
  decodeMetrics = workerPorts.decode;
  return { client, MODEL, base, gateway, gatewayPort, routerMetrics, decodeMetrics };
}

// Ends the run: no more early-exit failures, no watchdog, no children.
export function finish() {
  stopping = true;
  clearTimeout(watchdog);
}

// The prompt size the router saw for the gateway's request `id` (its router
// request ids are `<id>-<choice>`). The router's log reaches this process through a
// pipe that may be read after the HTTP response: wait for the line, with a deadline.
export async function routerPromptTokens(id) {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const ids = [...routerPrompts.keys()].filter((k) => k === id || k.startsWith(`${id}-`));
    if (ids.length > 0 || Date.now() > deadline) {
      assert.equal(ids.length, 1, `router requests for ${id}: ${ids}`);
      return routerPrompts.get(ids[0]);
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}

export async function expectApiError(promise, status, code, param) {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof OpenAI.APIError, `expected APIError, got ${err}`);
    assert.equal(err.status, status, `status: ${err.message}`);
    if (code !== undefined) assert.equal(err.code ?? null, code, `code: ${err.message}`);
    if (param !== undefined) assert.equal(err.param ?? null, param, `param: ${err.message}`);
    return err;
  }
  throw new Error(`expected HTTP ${status}, the call succeeded`);
}

export async function decodeIdle() {
  const used = await metric(decodeMetrics, 'tandem_worker_kv_cache_blocks', 'state="used"');
  const reservations = await metric(decodeMetrics, 'tandem_worker_reservations');
  const running = await metric(decodeMetrics, 'tandem_worker_running_requests');
  return used === 0 && reservations === 0 && running === 0;
}
