// Structured outputs end to end (issue #21) on the real disaggregated cluster:
// router_main + 1 prefill_main + 1 decode_main (tiny checkpoint, random weights:
// the model never writes JSON by itself) + gateway_main, driven by the official
// `openai` npm client; outputs are checked by independent validators (ajv for
// JSON Schema, JavaScript's RegExp for regexes):
//   1. the grammar helper's schema corpus (engine/grammar/testdata), each schema
//      once, rotating chat/completions x greedy/temperature 1 x streaming/not:
//      every output that ends with "stop" parses and validates (and most do);
//   2. regex and choice (structured_outputs, guided_*): outputs match;
//   3. tool_choice naming a function: arguments parse and validate;
//   4. a constraint that cannot finish within max_tokens ends "length";
//      thinking on with a constraint ends "length" too when the reasoning never
//      closes (the random model never writes <|close|>);
//   5. an unsupported feature or a bad regex is a 400 naming it.
//
// env: ROUTER_BIN, PREFILL_BIN, DECODE_BIN, GATEWAY_BIN, MODEL_DIR, CORPUS,
//      TANDEM_NODE_MODULES
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
const require = createRequire(path.join(nodeModules, 'noop.js'));
const openaiModule = require('openai');
const OpenAI = openaiModule.OpenAI ?? openaiModule.default ?? openaiModule;

const t0 = Date.now();
const elapsed = () => `${((Date.now() - t0) / 1000).toFixed(1)} s`;
const children = [];
function killAll() {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
}
process.on('exit', killAll);
function dumpLogs() {
  for (const c of children) console.error(`--- ${c.name} (last 30 lines)\n${c.logs.slice(-30).join('\n')}`);
}
function fail(message) {
  console.error(`FAIL: ${message}`);
  dumpLogs();
  killAll();
  process.exit(1);
}
const watchdog = setTimeout(() => fail('timed out after 240 s'), 240_000);

// Spawns a process; JSON log lines (either stream) go to `onJson`.
let stopping = false;
function start(name, bin, args, onJson = () => {}) {
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
function loggedValue(name, bin, args, msg, field, onJson = () => {}, ms = 30_000) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`${name} did not log "${msg}"`)), ms);
    const child = start(name, bin, args, (e) => {
      if (e.msg === msg && e[field] !== undefined) { clearTimeout(t); resolve({ child, value: e }); }
      onJson(e);
    });
  });
}

// Polls `fn` until it returns a truthy value; throws after `ms`.
async function poll(what, fn, ms = 20_000) {
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
async function metric(port, name, labels = '') {
  const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
  const key = labels ? `${name}{${labels}}` : name;
  for (const line of text.split('\n')) {
    if (line.startsWith(`${key} `)) return Number(line.slice(key.length + 1));
  }
  return undefined;
}

const MODEL_DIR = process.env.MODEL_DIR;
// The router logs every Generate's prompt size at debug level.
const routerPrompts = new Map();
let router, routerPort, routerMetrics;
try {
  const r = await loggedValue('router', process.env.ROUTER_BIN, [
    `--model=${MODEL_DIR}`, '--port=0', '--metrics_port=0', '--heartbeat_interval_s=0.2',
    '--heartbeat_timeout_s=30', '--log_format=json', '--log_level=debug',
  ], 'router serving', 'grpc_port', (e) => {
    if (e.msg === 'generate' && e.request_id !== undefined) routerPrompts.set(e.request_id, e.prompt_tokens);
  });
  router = r.child;
  routerPort = r.value.grpc_port;
  routerMetrics = r.value.metrics_port;
} catch (err) {
  fail(err.message);
}

const workerPorts = {};
await Promise.all(['prefill', 'decode'].map(async (role) => {
  const bin = role === 'prefill' ? process.env.PREFILL_BIN : process.env.DECODE_BIN;
  try {
    const w = await loggedValue(role, bin, [
      `--model=${MODEL_DIR}`, `--worker_id=${role}-0`, `--router=127.0.0.1:${routerPort}`,
      '--port=0', '--metrics_port=0', '--max_num_seqs=8', '--max_model_len=1024', '--kv_cache_memory=128MiB',
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

const API_KEY = 'cluster-key';
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
const decodeMetrics = workerPorts.decode;

// The prompt size the router saw for the gateway's request `id` (its router
// request ids are `<id>-<choice>`). The router's log reaches this process through a
// pipe that may be read after the HTTP response: wait for the line, with a deadline.
async function routerPromptTokens(id) {
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

async function expectApiError(promise, status, code, param) {
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

async function decodeIdle() {
  const used = await metric(decodeMetrics, 'tandem_worker_kv_cache_blocks', 'state="used"');
  const reservations = await metric(decodeMetrics, 'tandem_worker_reservations');
  const running = await metric(decodeMetrics, 'tandem_worker_running_requests');
  return used === 0 && reservations === 0 && running === 0;
}

const Ajv2020 = require('ajv/dist/2020').default ?? require('ajv/dist/2020');
const addFormatsModule = require('ajv-formats');
const addFormats = addFormatsModule.default ?? addFormatsModule;
const ajv = new Ajv2020({ strict: false, allErrors: true, validateFormats: true });
addFormats(ajv);

const tests = [];
const test = (name, fn) => tests.push({ name, fn });
const NO_THINK = { thinking: false };

// Runs `fns` with at most `width` in flight.
async function pool(fns, width) {
  const out = new Array(fns.length);
  let next = 0;
  await Promise.all(Array.from({ length: width }, async () => {
    while (next < fns.length) {
      const i = next++;
      out[i] = await fns[i]();
    }
  }));
  return out;
}

// One generation: { text, finish } for chat or completions, streamed or not.
async function generate({ chat, stream, temperature, seed, body, max_tokens = 200 }) {
  const common = { model: MODEL, max_tokens, temperature, seed, ...body };
  if (chat) {
    const req = { ...common, messages: [{ role: 'user', content: 'Answer.' }], ...NO_THINK };
    if (!stream) {
      const r = await client.chat.completions.create(req);
      return { text: r.choices[0].message.content ?? '', finish: r.choices[0].finish_reason, message: r.choices[0].message };
    }
    let text = '';
    let finish = null;
    for await (const c of await client.chat.completions.create({ ...req, stream: true })) {
      for (const ch of c.choices) {
        text += ch.delta?.content ?? '';
        finish = ch.finish_reason ?? finish;
      }
    }
    return { text, finish };
  }
  const req = { ...common, prompt: 'Answer:' };
  if (!stream) {
    const r = await client.completions.create(req);
    return { text: r.choices[0].text, finish: r.choices[0].finish_reason };
  }
  let text = '';
  let finish = null;
  for await (const c of await client.completions.create({ ...req, stream: true })) {
    for (const ch of c.choices) {
      text += ch.text ?? '';
      finish = ch.finish_reason ?? finish;
    }
  }
  return { text, finish };
}

test('schema corpus: every finished output parses and validates', async () => {
  const corpus = fs.readFileSync(process.env.CORPUS, 'utf8').split('\n').filter((l) => l.trim())
    .map((l) => JSON.parse(l));
  assert.ok(corpus.length >= 200, `corpus of ${corpus.length}`);
  const modes = [
    { chat: true, stream: false, temperature: 0 },
    { chat: true, stream: true, temperature: 1 },
    { chat: false, stream: true, temperature: 0 },
    { chat: false, stream: false, temperature: 1 },
  ];
  const results = await pool(corpus.map((c, i) => async () => {
    const mode = modes[i % modes.length];
    // json_schema on chat (response_format), guided_json / structured_outputs on completions.
    const body = mode.chat
      ? { response_format: { type: 'json_schema', json_schema: { name: 's', strict: true, schema: c.schema } } }
      : (i % 8 < 4 ? { guided_json: c.schema } : { structured_outputs: { json: c.schema } });
    try {
      const r = await generate({ ...mode, seed: i, body });
      return { c, mode, ...r };
    } catch (err) {
      return { c, mode, error: String(err) };
    }
  }), 8);
  let stopped = 0;
  const bad = [];
  for (const r of results) {
    if (r.error) { bad.push(`${r.c.name}: ${r.error}`); continue; }
    if (r.finish !== 'stop') { assert.equal(r.finish, 'length', r.c.name); continue; }
    stopped++;
    let v;
    try { v = JSON.parse(r.text); } catch { bad.push(`${r.c.name}: not JSON: ${r.text.slice(0, 200)}`); continue; }
    const validate = ajv.compile(r.c.schema);
    if (!validate(v)) bad.push(`${r.c.name}: ${ajv.errorsText(validate.errors)}: ${r.text.slice(0, 200)}`);
  }
  console.log(`corpus: ${results.length} schemas, ${stopped} ended with stop, ${results.length - stopped - bad.filter((b) => b.includes('Error')).length} ended by length, ${bad.length} bad`);
  assert.deepEqual(bad, []);
  assert.ok(stopped >= results.length * 0.8, `only ${stopped} of ${results.length} finished`);
});

test('regex and choice outputs match', async () => {
  const cases = [
    { body: { structured_outputs: { regex: '[A-Z][a-z]{2,6} [0-9]{2,4}' } }, re: /^[A-Z][a-z]{2,6} [0-9]{2,4}$/ },
    { body: { guided_regex: '(cat|dog)s? ?=[0-9]{1,4}' }, re: /^(cat|dog)s? ?=[0-9]{1,4}$/ },
    { body: { guided_regex: '[0-9]{4}-[0-9]{2}-[0-9]{2}' }, re: /^[0-9]{4}-[0-9]{2}-[0-9]{2}$/ },
    { body: { structured_outputs: { choice: ['alpha', 'beta', 'γάμμα'] } }, choices: ['alpha', 'beta', 'γάμμα'] },
    { body: { guided_choice: ['yes', 'no', 'maybe later'] }, choices: ['yes', 'no', 'maybe later'] },
  ];
  const runs = [];
  for (const [k, c] of cases.entries()) {
    for (const chat of [true, false]) {
      for (const stream of [false, true]) {
        runs.push(async () => ({ c, r: await generate({ chat, stream, temperature: (k + (stream ? 1 : 0)) % 2, seed: k, body: c.body, max_tokens: 60 }) }));
      }
    }
  }
  for (const { c, r } of await pool(runs, 8)) {
    assert.equal(r.finish, 'stop', JSON.stringify(r));
    if (c.re) assert.match(r.text, c.re);
    else assert.ok(c.choices.includes(r.text), r.text);
  }
});

test('tool_choice naming a function: arguments parse and validate', async () => {
  const parameters = {
    type: 'object',
    properties: { city: { type: 'string', minLength: 1, maxLength: 12 }, days: { type: 'integer', minimum: 1, maximum: 7 },
      unit: { enum: ['c', 'f'] } },
    required: ['city', 'days'], additionalProperties: false,
  };
  const tools = [
    { type: 'function', function: { name: 'get_weather', parameters } },
    { type: 'function', function: { name: 'noop', parameters: { type: 'object', properties: {} } } },
  ];
  const validate = ajv.compile(parameters);
  for (const temperature of [0, 1]) {
    for (const stream of [false, true]) {
      const req = { model: MODEL, messages: [{ role: 'user', content: 'Weather?' }], tools, max_tokens: 200,
        temperature, seed: 3, tool_choice: { type: 'function', function: { name: 'get_weather' } }, ...NO_THINK };
      let calls;
      let finish;
      if (!stream) {
        const r = await client.chat.completions.create(req);
        calls = r.choices[0].message.tool_calls;
        finish = r.choices[0].finish_reason;
      } else {
        const acc = [];
        for await (const c of await client.chat.completions.create({ ...req, stream: true })) {
          for (const ch of c.choices) {
            finish = ch.finish_reason ?? finish;
            for (const tc of ch.delta?.tool_calls ?? []) {
              acc[tc.index] ??= { function: { name: '', arguments: '' } };
              acc[tc.index].function.name += tc.function?.name ?? '';
              acc[tc.index].function.arguments += tc.function?.arguments ?? '';
            }
          }
        }
        calls = acc;
      }
      assert.equal(finish, 'tool_calls');
      assert.equal(calls.length, 1);
      assert.equal(calls[0].function.name, 'get_weather');
      const args = JSON.parse(calls[0].function.arguments);
      assert.ok(validate(args), `${calls[0].function.arguments}: ${ajv.errorsText(validate.errors)}`);
    }
  }
});

test('a constraint that cannot finish ends with length', async () => {
  const r = await generate({ chat: false, stream: false, temperature: 0, body: { guided_regex: 'a{50}' }, max_tokens: 8 });
  assert.equal(r.finish, 'length');
  assert.match(r.text, /^a+$/);
  // Thinking on: the reasoning is free and this model never closes it.
  const t = await client.chat.completions.create({ model: MODEL, max_tokens: 16, temperature: 0,
    messages: [{ role: 'user', content: 'x' }], thinking: true, response_format: { type: 'json_object' } });
  assert.equal(t.choices[0].finish_reason, 'length');
});

test('unsupported features and bad grammars are 400s naming them', async () => {
  const e1 = await expectApiError(client.completions.create({ model: MODEL, prompt: 'x', max_tokens: 4,
    guided_regex: '(unclosed' }), 400);
  assert.match(e1.message, /regex/);
  await expectApiError(client.completions.create({ model: MODEL, prompt: 'x', max_tokens: 4,
    guided_regex: 'a', guided_choice: ['b'] }), 400, undefined, 'guided_choice');
  await expectApiError(client.completions.create({ model: MODEL, prompt: 'x', max_tokens: 4,
    guided_regex: 'a', ignore_eos: true }), 400, undefined, 'ignore_eos');
  const e2 = await expectApiError(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'x' }],
    max_tokens: 4, response_format: { type: 'json_schema', json_schema: { name: 'n', schema: { type: 'object', not: {} } } } }), 400);
  assert.match(e2.message, /not/);
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'x' }],
    max_tokens: 4, response_format: { type: 'json_schema', json_schema: { name: 'n' } } }), 400);
});

let failed = 0;
for (const t of tests) {
  const s = Date.now();
  try {
    await t.fn();
    console.log(`PASS ${t.name} (${((Date.now() - s) / 1000).toFixed(2)} s)`);
  } catch (err) {
    failed++;
    console.error(`FAIL ${t.name}: ${err.stack ?? err}`);
  }
}
try {
  await poll('decode worker idle at the end', decodeIdle, 20_000);
} catch (err) {
  failed++;
  console.error(`FAIL ${err.message}`);
}
stopping = true;
clearTimeout(watchdog);
if (failed) fail(`${failed} check(s) failed`);
killAll();
console.log(`PASS: ${tests.length} structured-output checks in ${elapsed()}`);
process.exit(0);
