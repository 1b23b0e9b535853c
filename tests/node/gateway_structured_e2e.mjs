// Structured outputs end to end (issue #21) on the real disaggregated cluster:
// router_main + 1 prefill_main + 1 decode_main (tiny checkpoint, random weights:
// the model never writes JSON by itself) + gateway_main, driven by the official
// `openai` npm client; outputs are checked by independent validators (ajv for
// JSON Schema, JavaScript's RegExp for regexes):
//   1. the grammar helper's schema corpus (engine/grammar/testdata), each schema
//      once, rotating chat/completions x greedy/temperature 1 x streaming/not:
//      every output that ends with "stop" parses and validates (and most do);
//   2. regex and choice (structured_outputs, guided_*): outputs match;
//   3. tool_choice naming a function: arguments parse and validate; "required"
//      with several tools: one or more calls, each naming one of the tools,
//      its arguments valid against that tool's parameters;
//   4. a constraint that cannot finish within max_tokens ends "length";
//      thinking on with a constraint ends "length" too when the reasoning never
//      closes (the random model never writes <|close|>);
//   5. an unsupported feature or a bad regex is a 400 naming it.
//
// env: ROUTER_BIN, PREFILL_BIN, DECODE_BIN, GATEWAY_BIN, MODEL_DIR, CORPUS,
//      TANDEM_NODE_MODULES
//      TANDEM_NODE_MODULES
import assert from 'node:assert/strict';
import fs from 'node:fs';

import {
  decodeIdle,
  elapsed,
  expectApiError,
  fail,
  finish,
  killAll,
  poll,
  require,
  startCluster,
} from './cluster_harness.mjs';

const { client, MODEL, base, gateway, gatewayPort, routerMetrics, decodeMetrics } = await startCluster({
  timeoutMs: 240_000,
  maxNumSeqs: 8,
  kvCacheMemory: '128MiB',
});

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

test('tool_choice "required" with several tools: every call names one and validates', async () => {
  const schemas = {
    get_weather: {
      type: 'object',
      properties: { city: { type: 'string', minLength: 1, maxLength: 8 }, unit: { enum: ['c', 'f'] } },
      required: ['city', 'unit'], additionalProperties: false,
    },
    add: {
      type: 'object',
      properties: { a: { type: 'integer', minimum: 0, maximum: 99 }, b: { type: 'number', minimum: -5, maximum: 5 } },
      required: ['a'],
    },
    noop: { type: 'object', properties: {} },
  };
  const tools = Object.entries(schemas).map(([name, parameters]) => ({ type: 'function', function: { name, parameters } }));
  const validators = Object.fromEntries(Object.entries(schemas).map(([n, s]) => [n, ajv.compile(s)]));
  for (const temperature of [0, 1]) {
    for (const stream of [false, true]) {
      const req = { model: MODEL, messages: [{ role: 'user', content: 'Do things.' }], tools, max_tokens: 700,
        temperature, seed: 11, tool_choice: 'required', ...NO_THINK };
      let calls;
      let finish;
      if (!stream) {
        const r = await client.chat.completions.create(req);
        calls = r.choices[0].message.tool_calls;
        finish = r.choices[0].finish_reason;
        assert.equal(r.choices[0].message.content, null);
      } else {
        const acc = [];
        for await (const c of await client.chat.completions.create({ ...req, stream: true })) {
          for (const ch of c.choices) {
            finish = ch.finish_reason ?? finish;
            assert.ok(!ch.delta?.content, `content ${ch.delta?.content}`);
            for (const tc of ch.delta?.tool_calls ?? []) {
              acc[tc.index] ??= { function: { name: '', arguments: '' } };
              acc[tc.index].function.name += tc.function?.name ?? '';
              acc[tc.index].function.arguments += tc.function?.arguments ?? '';
            }
          }
        }
        calls = acc;
      }
      const where = `temperature ${temperature} stream ${stream}`;
      assert.equal(finish, 'tool_calls', where);
      assert.ok(calls.length >= 1 && calls.length <= 8, `${where}: ${calls.length} calls`);
      for (const call of calls) {
        const validate = validators[call.function.name];
        assert.ok(validate, `${where}: undeclared tool ${call.function.name}`);
        const args = JSON.parse(call.function.arguments);
        assert.ok(validate(args), `${where}: ${call.function.name}(${call.function.arguments}): ${ajv.errorsText(validate.errors)}`);
      }
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
finish();
if (failed) fail(`${failed} check(s) failed`);
killAll();
console.log(`PASS: ${tests.length} structured-output checks in ${elapsed()}`);
process.exit(0);
