// End to end: gateway_main in front of the scripted test router, driven by
// the official `openai` npm client (pinned in tools/node). Every check
// asserts; the first failure ends the run with exit code 1.
//
// env: GATEWAY_BIN, ROUTER_BIN, TOKENIZER_DIR, TANDEM_NODE_MODULES
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

const children = [];
function fail(message) {
  console.error(`FAIL: ${message}`);
  for (const c of children) c.kill('SIGKILL');
  process.exit(1);
}
const watchdog = setTimeout(() => fail('timed out after 240 s'), 240_000);

// Spawns a process; `onLine(stream, line)` sees each line of stdout/stderr.
function start(bin, args, onLine) {
  const child = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(child);
  child.logs = [];
  for (const [name, s] of [['stdout', child.stdout], ['stderr', child.stderr]]) {
    readline.createInterface({ input: s }).on('line', (line) => {
      child.logs.push(line);
      onLine(name, line);
    });
  }
  child.exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  return child;
}

// Router fixture events (JSON lines on stdout) and waiters on them.
const events = [];
const waiters = [];
function onRouterEvent(e) {
  events.push(e);
  for (const w of [...waiters]) {
    if (w.pred(e)) {
      waiters.splice(waiters.indexOf(w), 1);
      w.resolve(e);
    }
  }
}
function waitForEvent(pred, what, ms = 20_000) {
  const found = events.find(pred);
  if (found) return Promise.resolve(found);
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`no router event: ${what}`)), ms);
    waiters.push({ pred, resolve: (e) => { clearTimeout(t); resolve(e); } });
  });
}

const tokenizerDir = process.env.TOKENIZER_DIR;
let routerPort;
const routerReady = new Promise((resolve) => {
  const router = start(process.env.ROUTER_BIN, [`--model=${tokenizerDir}`, '--port=0'], (stream, line) => {
    if (stream !== 'stdout') return;
    const e = JSON.parse(line);
    if (e.event === 'listening') resolve(e.port);
    else onRouterEvent(e);
  });
  router.exited.then((r) => { if (routerPort === undefined) fail(`router exited early: ${JSON.stringify(r)}\n${router.logs.join('\n')}`); });
});
routerPort = await routerReady;

const API_KEY = 'test-key';
let stopping = false;
let gateway;
const gatewayPort = await new Promise((resolve) => {
  gateway = start(process.env.GATEWAY_BIN, [
    `--model=${tokenizerDir}`, `--router=127.0.0.1:${routerPort}`, '--port=0',
    `--api_key=${API_KEY}`, '--io_threads=2', '--log_format=json', '--max_body_bytes=1048576',
    '--shutdown_grace_s=1',
  ], (stream, line) => {
    if (stream !== 'stderr' || !line.startsWith('{')) return;
    const e = JSON.parse(line);
    if (e.msg === 'gateway serving') resolve(e.port);
  });
  gateway.exited.then((r) => stopping || fail(`gateway exited early: ${JSON.stringify(r)}\n${gateway.logs.join('\n')}`));
});
const base = `http://127.0.0.1:${gatewayPort}`;
const client = new OpenAI({ apiKey: API_KEY, baseURL: `${base}/v1`, maxRetries: 0, timeout: 30_000 });
const MODEL = 'kimi-k3';
const GREETING = 'Hello! The quick brown fox jumps over the lazy dog.';

async function sentTokens(responseId, n = 1) {
  let total = 0;
  for (let i = 0; i < n; i++) {
    const done = await waitForEvent((e) => e.event === 'done' && e.request_id === `${responseId}-${i}`, `done ${responseId}-${i}`);
    total += done.sent;
  }
  return total;
}

async function expectApiError(promise, status, code, param) {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof OpenAI.APIError, `expected APIError, got ${err}`);
    assert.equal(err.status, status, `status: ${err.message}`);
    if (code !== undefined) assert.equal(err.code ?? null, code, `code: ${err.message}`);
    if (param !== undefined) assert.equal(err.param ?? null, param, `param: ${err.message}`);
    assert.equal(typeof err.error?.message, 'string');
    return err;
  }
  throw new Error(`expected HTTP ${status}, the call succeeded`);
}

const tests = [];
const test = (name, fn) => tests.push({ name, fn });

test('health and models', async () => {
  const h = await fetch(`${base}/health`);
  assert.equal(h.status, 200);
  assert.deepEqual(await h.json(), { status: 'ok' });
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  assert.equal(models.data[0].object, 'model');
});

test('chat: reasoning on, usage matches the router', async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }] });
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, GREETING);
  assert.equal(r.choices[0].message.reasoning_content, 'The user wants an answer.');
  assert.equal(r.choices[0].finish_reason, 'stop');
  const gen = await waitForEvent((e) => e.event === 'generate' && e.request_id === `${r.id}-0`, 'generate');
  assert.equal(r.usage.prompt_tokens, gen.prompt_tokens);
  assert.equal(r.usage.completion_tokens, await sentTokens(r.id));
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test('chat: multi-part content, sampling fields forwarded', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, temperature: 0.25, top_p: 0.5, presence_penalty: 0.5, frequency_penalty: -0.5, user: 'u',
    messages: [{ role: 'system', content: 'Be brief.' },
               { role: 'user', content: [{ type: 'text', text: 'Hello ' }, { type: 'text', text: 'there' }] }],
  });
  const gen = await waitForEvent((e) => e.event === 'generate' && e.request_id === `${r.id}-0`, 'generate');
  assert.equal(gen.temperature, 0.25);
  assert.equal(gen.top_p, 0.5);
  assert.equal(gen.presence_penalty, 0.5);
  assert.equal(gen.frequency_penalty, -0.5);
});

test('chat: reasoning off (chat_template_kwargs and reasoning_effort)', async () => {
  for (const extra of [{ chat_template_kwargs: { thinking: false } }, { reasoning_effort: 'minimal' }]) {
    const r = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], ...extra });
    assert.equal(r.choices[0].message.content, GREETING);
    assert.equal(r.choices[0].message.reasoning_content ?? null, null);
  }
});

test('chat: streaming with usage equals the whole response', async () => {
  const stream = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Hi' }], stream: true, stream_options: { include_usage: true },
  });
  let content = '', reasoning = '', finish = null, usage = null, first = null, id = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    id = chunk.id;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (first === null) first = c.delta;
      content += c.delta.content ?? '';
      reasoning += c.delta.reasoning_content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(first.role, 'assistant');
  assert.equal(content, GREETING);
  assert.equal(reasoning, 'The user wants an answer.');
  assert.equal(finish, 'stop');
  assert.ok(usage, 'usage chunk');
  assert.equal(usage.completion_tokens, await sentTokens(id));
});

test('chat: n > 1 with seed gives distinct, repeatable choices', async () => {
  const req = { model: MODEL, messages: [{ role: 'user', content: 'Hi' }], n: 3, seed: 5 };
  const a = await client.chat.completions.create(req);
  const b = await client.chat.completions.create(req);
  assert.equal(a.choices.length, 3);
  assert.deepEqual(a.choices.map((c) => c.index), [0, 1, 2]);
  const texts = a.choices.map((c) => c.message.content);
  assert.equal(new Set(texts).size, 3);
  assert.equal(texts[0], `Hello! The quick brown fox jumps over the lazy dog. seed=5`);
  assert.deepEqual(b.choices.map((c) => c.message.content), texts);
  assert.equal(a.usage.completion_tokens, await sentTokens(a.id, 3));
});

test('chat: stop sequences (string and array, streaming)', async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], stop: 'lazy' });
  assert.equal(r.choices[0].message.content, 'Hello! The quick brown fox jumps over the ');
  assert.equal(r.choices[0].finish_reason, 'stop');
  const stream = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], stop: ['xyz', 'brown'], stream: true });
  let content = '', finish = null;
  for await (const chunk of stream) for (const c of chunk.choices) { content += c.delta.content ?? ''; finish = c.finish_reason ?? finish; }
  assert.equal(content, 'Hello! The quick ');
  assert.equal(finish, 'stop');
});

test('chat: max_tokens gives finish_reason length', async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 3 });
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 3);
});

test('chat: logprobs and top_logprobs', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Hi' }], logprobs: true, top_logprobs: 2,
    chat_template_kwargs: { thinking: false },
  });
  const lp = r.choices[0].logprobs.content;
  assert.equal(lp.length, r.usage.completion_tokens);
  for (const [k, e] of lp.entries()) {
    assert.equal(typeof e.token, 'string');
    assert.ok(Array.isArray(e.bytes));
    assert.ok(Math.abs(e.logprob - (-0.5 - 0.1 * (k % 7))) < 1e-5);
    assert.equal(e.top_logprobs.length, 2);
    assert.equal(e.top_logprobs[0].token, e.token);
  }
  // The bytes of the content tokens spell the content.
  const bytes = Buffer.from(lp.flatMap((e) => e.bytes)).toString('utf8');
  assert.ok(bytes.startsWith(GREETING), bytes);
});

test('chat: tools round trip (whole and streamed)', async () => {
  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
  const messages = [{ role: 'user', content: 'Weather in Paris? #tool' }];
  const r = await client.chat.completions.create({ model: MODEL, messages, tools, tool_choice: 'auto' });
  const choice = r.choices[0];
  assert.equal(choice.finish_reason, 'tool_calls');
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris' });
  assert.match(call.id, /^call_/);

  const stream = await client.chat.completions.create({ model: MODEL, messages, tools, tool_choice: 'required', stream: true });
  const calls = [];
  let finish = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      finish = c.finish_reason ?? finish;
      for (const t of c.delta.tool_calls ?? []) {
        calls[t.index] ??= { id: '', name: '', arguments: '' };
        if (t.id) calls[t.index].id = t.id;
        if (t.function?.name) calls[t.index].name = t.function.name;
        calls[t.index].arguments += t.function?.arguments ?? '';
      }
    }
  }
  assert.equal(finish, 'tool_calls');
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, 'get_weather');
  assert.deepEqual(JSON.parse(calls[0].arguments), { city: 'Paris' });

  const followUp = await client.chat.completions.create({
    model: MODEL, tools,
    messages: [...messages, choice.message, { role: 'tool', tool_call_id: call.id, content: '{"sky":"sunny"}' }],
  });
  assert.equal(followUp.choices[0].message.content, 'The weather in Paris is sunny.');
  assert.equal(followUp.choices[0].finish_reason, 'stop');
});

// lm-evaluation-harness's loglikelihood request, through the official client:
// echo + logprobs 1 + max_tokens 1 gives the prompt's tokens first (the first
// with a null logprob) and the text prompt + output; logit_bias passes.
test('completions: echo with logprobs, logit_bias', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: 'Say something', max_tokens: 1, echo: true, logprobs: 1, logit_bias: { '15': -100 } });
  const c = r.choices[0];
  assert.ok(c.text.startsWith('Say something'), c.text);
  assert.equal(c.logprobs.token_logprobs[0], null);
  assert.equal(c.logprobs.top_logprobs[0], null);
  assert.ok(c.logprobs.tokens.length >= 3);
  assert.equal(c.logprobs.tokens.join(''), c.text);
  for (const lp of c.logprobs.token_logprobs.slice(1)) assert.equal(typeof lp, 'number');
});

// Echo without generation (max_tokens 0): the prompt scored, nothing generated.
test('completions: echo with max_tokens 0 scores the prompt only', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: 'Say something', max_tokens: 0, echo: true, logprobs: 1 });
  const c = r.choices[0];
  assert.equal(c.text, 'Say something');
  assert.equal(c.finish_reason, 'length');
  assert.equal(c.logprobs.tokens.join(''), 'Say something');
  assert.equal(c.logprobs.token_logprobs[0], null);
  assert.equal(r.usage.completion_tokens, 0);
  await assert.rejects(
    client.completions.create({ model: MODEL, prompt: 'Say something', max_tokens: 0 }),
    (e) => e.status === 400 && e.param === 'max_tokens');
});

test('completions: text, token prompt, streaming, n', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: 'Tell me', max_tokens: 100 });
  assert.match(r.id, /^cmpl-/);
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, ' The quick brown fox jumps over the lazy dog. The end.');
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.usage.completion_tokens, await sentTokens(r.id));

  const ids = [9906, 11, 1917, 0];
  const t = await client.completions.create({ model: MODEL, prompt: ids, logprobs: 1, seed: 3 });
  assert.equal(t.usage.prompt_tokens, ids.length);
  assert.equal(t.choices[0].logprobs.tokens.length, t.usage.completion_tokens);
  assert.equal(t.choices[0].logprobs.token_logprobs.length, t.usage.completion_tokens);

  const stream = await client.completions.create({ model: MODEL, prompt: 'Tell me', stream: true, n: 2, seed: 9, stop: ['The end'] });
  const texts = ['', ''];
  for await (const chunk of stream) for (const c of chunk.choices) texts[c.index] += c.text;
  assert.equal(texts[0], ' The quick brown fox jumps over the lazy dog. seed=9 ');
  assert.notEqual(texts[1], texts[0]);
});

test('abort mid-stream cancels the router call', async () => {
  const stream = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Go #tokens:100000000' }], stream: true,
  });
  let id = null, n = 0;
  for await (const chunk of stream) {
    id = chunk.id;
    if (++n >= 5) break;  // breaking out aborts the HTTP request
  }
  stream.controller.abort();
  await waitForEvent((e) => e.event === 'cancelled' && e.request_id === `${id}-0`, `cancelled ${id}`);
  const done = await waitForEvent((e) => e.event === 'done' && e.request_id === `${id}-0`, `done ${id}`);
  assert.ok(done.sent < 100000000);
});

test('errors: auth, JSON, types, ranges, context, model, overload', async () => {
  const body = JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }] });
  let res = await fetch(`${base}/v1/chat/completions`, { method: 'POST', body, headers: { 'content-type': 'application/json' } });
  assert.equal(res.status, 401);
  assert.equal((await res.json()).error.code, 'invalid_api_key');
  const wrongKey = new OpenAI({ apiKey: 'nope', baseURL: `${base}/v1`, maxRetries: 0 });
  await expectApiError(wrongKey.chat.completions.create(JSON.parse(body)), 401, 'invalid_api_key');

  res = await fetch(`${base}/v1/chat/completions`, { method: 'POST', body: '{"model": ', headers: { authorization: `Bearer ${API_KEY}` } });
  assert.equal(res.status, 400);
  const malformed = await res.json();
  assert.equal(malformed.error.type, 'invalid_request_error');
  assert.deepEqual(Object.keys(malformed.error).sort(), ['code', 'message', 'param', 'type']);

  const msgs = [{ role: 'user', content: 'Hi' }];
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: msgs, temperature: 'hot' }), 400, null, 'temperature');
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: 'Hi' }), 400, null, 'messages');
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: msgs, top_p: 5 }), 400, null, 'top_p');
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: msgs, n: 0 }), 400, null, 'n');
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: msgs, max_tokens: 5000 }), 400, 'context_length_exceeded', 'messages');
  await expectApiError(client.completions.create({ model: MODEL, prompt: 'word '.repeat(5000) }), 400, 'context_length_exceeded', 'prompt');
  await expectApiError(client.chat.completions.create({ model: 'gpt-nope', messages: msgs }), 404, 'model_not_found', 'model');
  await expectApiError(client.completions.create({ model: MODEL, prompt: 'x', suffix: 'y' }), 400, null, 'suffix');
  await expectApiError(client.completions.create({ model: MODEL, prompt: 'x', logit_bias: { '7': 101 } }), 400, null, 'logit_bias');

  const e429 = await expectApiError(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: '#error:RESOURCE_EXHAUSTED' }] }), 429, 'rate_limit_exceeded');
  assert.equal(e429.headers['retry-after'], '1');
  const e503 = await expectApiError(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: '#error:UNAVAILABLE' }] }), 503, 'service_unavailable');
  assert.equal(e503.headers['retry-after'], '1');
  await expectApiError(client.chat.completions.create({ model: MODEL, stream: true, messages: [{ role: 'user', content: '#error:RESOURCE_EXHAUSTED' }] }), 429);
  await expectApiError(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: '#error:INVALID_ARGUMENT' }] }), 400);

  // A failure after the stream started arrives as an error event.
  const stream = await client.chat.completions.create({ model: MODEL, stream: true, messages: [{ role: 'user', content: '#fail_midway' }] });
  await assert.rejects(async () => { for await (const _ of stream) { /* drain */ } }, (err) => /scripted failure/.test(err.message));

  res = await fetch(`${base}/v1/chat/completions`, { method: 'POST', body: 'x'.repeat(2 << 20), headers: { authorization: `Bearer ${API_KEY}` } });
  assert.equal(res.status, 413);
  assert.equal((await res.json()).error.code, 'request_too_large');
  res = await fetch(`${base}/v1/models`, { method: 'DELETE', headers: { authorization: `Bearer ${API_KEY}` } });
  assert.equal(res.status, 405);
});

test('metrics count requests by endpoint and status', async () => {
  const text = await (await fetch(`${base}/metrics`)).text();
  assert.match(text, /tandem_gateway_requests_total\{endpoint="chat_completions",status="200"\} \d+/);
  assert.match(text, /tandem_gateway_requests_total\{endpoint="chat_completions",status="429"\} 2/);
  assert.match(text, /tandem_gateway_request_duration_seconds_bucket/);
  assert.match(text, /tandem_gateway_active_streams 0/);
});

let failed = 0;
for (const t of tests) {
  try {
    await t.fn();
    console.log(`PASS ${t.name}`);
  } catch (err) {
    failed++;
    console.error(`FAIL ${t.name}: ${err.stack ?? err}`);
  }
}

// Shutdown with a stream in flight (on a router session): SIGTERM stops new
// work, the running stream is cancelled upstream after --shutdown_grace_s, the
// client's stream ends, and the gateway exits 0.
stopping = true;
let liveId = null, liveChunks = 0;
try {
  const live = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Go #tokens:100000000' }], stream: true,
  });
  const drained = (async () => {
    try {
      for await (const chunk of live) {
        liveId = chunk.id;
        if (++liveChunks === 3) gateway.kill('SIGTERM');
      }
    } catch (err) { /* the stream may end with an error: either is an end */ }
    return 'ended';
  })();
  const ended = await Promise.race([drained, new Promise((r) => setTimeout(() => r('timeout'), 20_000))]);
  assert.equal(ended, 'ended', 'the stream in flight did not end after SIGTERM');
  assert.ok(liveChunks >= 3, `chunks before SIGTERM: ${liveChunks}`);
  await waitForEvent((e) => e.event === 'cancelled' && e.request_id === `${liveId}-0`, `cancelled ${liveId}`);
  console.log('PASS shutdown with a stream in flight cancels it upstream');
} catch (err) {
  failed++;
  console.error(`FAIL shutdown with a stream in flight: ${err.stack ?? err}`);
  gateway.kill('SIGTERM');
}
const g = await Promise.race([gateway.exited, new Promise((r) => setTimeout(() => r({ code: 'timeout' }), 20_000))]);
if (g.code !== 0) { failed++; console.error(`FAIL gateway did not exit cleanly on SIGTERM: ${JSON.stringify(g)}`); }
children[0].kill('SIGTERM');
clearTimeout(watchdog);
if (failed) {
  console.error(`gateway log:\n${gateway.logs.slice(-40).join('\n')}`);
  fail(`${failed} test(s) failed`);
}
console.log(`PASS: ${tests.length} gateway end-to-end tests`);
process.exit(0);
