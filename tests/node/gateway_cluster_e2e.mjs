// End to end on the real disaggregated cluster: router_main + 1 prefill_main +
// 1 decode_main (tiny checkpoint) + gateway_main, every port picked by the
// kernel on 127.0.0.1, driven by the official `openai` npm client (pinned in
// tools/node). Checks against the real model:
//   1. chat, greedy: non-streaming and streaming give the same text; usage
//      prompt_tokens equals the count the router logged for the request and
//      completion_tokens equals max_tokens when finish_reason is "length";
//   2. completions: the same seed twice gives the same text;
//   3. an abort mid-stream frees the decode worker's KV blocks, landing
//      blocks and reservations, and the gateway counts a 499;
//   4. a prompt longer than the served context (the workers' limit) is a 400
//      context_length_exceeded;
//   5. /health is 200;
//   6. a chat message with a PNG data URL: 200, usage counts the image tokens,
//      the same image gives the same greedy text, another image another.
// Every wait is bounded; every child is killed at the end, pass or fail.
//
// env: ROUTER_BIN, PREFILL_BIN, DECODE_BIN, GATEWAY_BIN, MODEL_DIR,
//      TANDEM_NODE_MODULES
import assert from 'node:assert/strict';

import {
  API_KEY,
  OpenAI,
  decodeIdle,
  elapsed,
  expectApiError,
  fail,
  finish,
  killAll,
  metric,
  poll,
  routerPromptTokens,
  routerPrompts,
  startCluster,
} from './cluster_harness.mjs';

const { client, MODEL, base, gateway, gatewayPort, routerMetrics, decodeMetrics } = await startCluster({
  timeoutMs: 150_000,
});

const tests = [];
const test = (name, fn) => tests.push({ name, fn });

test('health is 200', async () => {
  const h = await fetch(`${base}/health`);
  assert.equal(h.status, 200);
  assert.deepEqual(await h.json(), { status: 'ok' });
});

test('chat greedy: streaming equals non-streaming; usage matches the router', async () => {
  const MAX = 12;
  const req = {
    model: MODEL, temperature: 0, max_tokens: MAX,
    messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Name three colours.' }],
  };
  const r = await client.chat.completions.create(req);
  assert.equal(r.object, 'chat.completion');
  const choice = r.choices[0];
  assert.ok(['length', 'stop'].includes(choice.finish_reason), choice.finish_reason);
  if (choice.finish_reason === 'length') assert.equal(r.usage.completion_tokens, MAX);
  else assert.ok(r.usage.completion_tokens > 0 && r.usage.completion_tokens <= MAX);
  const routerPrompt = await routerPromptTokens(r.id);
  assert.ok(routerPrompt > 0);
  assert.equal(r.usage.prompt_tokens, routerPrompt);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  const text = (choice.message.reasoning_content ?? '') + '|' + (choice.message.content ?? '');
  console.log(`  greedy: finish=${choice.finish_reason} usage=${JSON.stringify(r.usage)} text=${JSON.stringify(text)}`);

  const stream = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
  let content = '', reasoning = '', finish = null, usage = null, id = null;
  for await (const chunk of stream) {
    id = chunk.id;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      content += c.delta.content ?? '';
      reasoning += c.delta.reasoning_content ?? '';
      finish = c.finish_reason ?? finish;
    }
  }
  assert.equal(reasoning + '|' + content, text);
  assert.equal(finish, choice.finish_reason);
  assert.ok(usage, 'usage chunk');
  // The same prompt twice: the second may hit the prefix cache (cached_tokens),
  // every other count is the same.
  const { prompt_tokens_details: streamed, ...streamedRest } = usage;
  const { prompt_tokens_details: first, ...firstRest } = r.usage;
  assert.deepEqual(streamedRest, firstRest);
  for (const d of [first, streamed]) {
    assert.ok(Number.isInteger(d.cached_tokens) && d.cached_tokens >= 0 &&
              d.cached_tokens < usage.prompt_tokens,
              `cached_tokens ${d.cached_tokens} of ${usage.prompt_tokens}`);
  }
  assert.equal(await routerPromptTokens(id), routerPrompt);
});

// Two 56x56 PNGs (one red, one blue): 4 image tokens each (a 4x4 patch grid).
const RED_PNG = 'iVBORw0KGgoAAAANSUhEUgAAADgAAAA4CAIAAAAn5KxJAAAAWUlEQVR4nO3OUQkAIQBAMTWI/aMYywr38UAOtgSbZ+/xB+t14CvRmmhNtCZaE62J1kRrojXRmmhNtCZaE62J1kRrojXRmmhNtCZaE62J1kRrojXRmmhNtHYByF0BdOurBQ4AAAAASUVORK5CYII=';
const BLUE_PNG = 'iVBORw0KGgoAAAANSUhEUgAAADgAAAA4CAIAAAAn5KxJAAAAWUlEQVR4nO3OUQkAIQBAMTWI/aMYywr38UAOtgSbe5/xB+t14CvRmmhNtCZaE62J1kRrojXRmmhNtCZaE62J1kRrojXRmmhNtCZaE62J1kRrojXRmmhNtHYBxwkBdIX+mIUAAAAASUVORK5CYII=';

test('chat with an image (data URL): the prefill worker runs the vision tower', async () => {
  const ask = async (png) => {
    const r = await client.chat.completions.create({
      model: MODEL, temperature: 0, max_tokens: 6,
      messages: [{ role: 'user', content: [
        { type: 'image_url', image_url: { url: `data:image/png;base64,${png}` } },
        { type: 'text', text: 'What colour is this?' }] }],
    });
    const m = r.choices[0].message;
    return { r, text: (m.reasoning_content ?? '') + '|' + (m.content ?? '') };
  };
  const plain = await client.chat.completions.create({
    model: MODEL, temperature: 0, max_tokens: 1,
    messages: [{ role: 'user', content: 'What colour is this?' }],
  });
  const red = await ask(RED_PNG);
  assert.equal(red.r.object, 'chat.completion');
  assert.equal(red.r.usage.completion_tokens, 6);
  // The image's 4 <|media_pad|> tokens and its begin/size/content/end markup.
  assert.equal(red.r.usage.prompt_tokens, await routerPromptTokens(red.r.id));
  assert.ok(red.r.usage.prompt_tokens >= plain.usage.prompt_tokens + 4 + 3,
            `${red.r.usage.prompt_tokens} vs ${plain.usage.prompt_tokens} without the image`);
  const again = await ask(RED_PNG);
  assert.equal(again.text, red.text);
  const blue = await ask(BLUE_PNG);
  assert.notEqual(blue.text, red.text);
  console.log(`  image: usage=${JSON.stringify(red.r.usage)} red=${JSON.stringify(red.text)} blue=${JSON.stringify(blue.text)}`);
});

test('completions: the same seed twice gives the same text', async () => {
  const req = { model: MODEL, prompt: 'Once upon a time', max_tokens: 10, temperature: 1, seed: 1234 };
  const a = await client.completions.create(req);
  const b = await client.completions.create(req);
  assert.equal(a.object, 'text_completion');
  assert.equal(a.usage.prompt_tokens, await routerPromptTokens(a.id));
  assert.ok(a.choices[0].text.length > 0);
  assert.equal(b.choices[0].text, a.choices[0].text);
  assert.equal(b.usage.completion_tokens, a.usage.completion_tokens);
  if (a.choices[0].finish_reason === 'length') assert.equal(a.usage.completion_tokens, 10);
  // Sampling does depend on the seed: some other seed changes the text.
  const others = [];
  for (const seed of [1, 2, 3]) others.push((await client.completions.create({ ...req, seed })).choices[0].text);
  assert.ok(others.some((t) => t !== a.choices[0].text), `seeds 1..3 all gave ${a.choices[0].text}`);
});

test('abort mid-stream frees the decode worker and counts a 499', async () => {
  const status499 = async () =>
    (await metric(gatewayPort, 'tandem_gateway_requests_total', 'endpoint="chat_completions",status="499"')) ?? 0;
  const before499 = await status499();
  const controller = new AbortController();
  const stream = await client.chat.completions.create({
    model: MODEL, temperature: 0.7, seed: 7, max_tokens: 900,
    messages: [{ role: 'user', content: 'Write a very long story.' }], stream: true,
  }, { signal: controller.signal });
  let n = 0;
  let sawUsedBlocks = false;
  let finished = false;
  try {
    for await (const chunk of stream) {
      if (chunk.choices.some((c) => c.finish_reason)) finished = true;
      // After a few chunks, abort as soon as the decode worker's /metrics show
      // the live request holding KV blocks (its gauges update asynchronously).
      if (++n >= 3 && !controller.signal.aborted) {
        sawUsedBlocks = (await metric(decodeMetrics, 'tandem_worker_kv_cache_blocks', 'state="used"')) > 0;
        if (sawUsedBlocks) controller.abort();
      }
    }
  } catch (err) {
    // The client either ends the iteration quietly or throws its abort error.
    assert.ok(err instanceof OpenAI.APIUserAbortError || err.name === 'AbortError', `abort error: ${err}`);
  }
  assert.ok(n >= 3, `chunks before the abort: ${n}`);
  console.log(`  aborted after ${n} chunks`);
  assert.ok(!finished, 'the stream finished before the abort');
  assert.ok(controller.signal.aborted);
  assert.ok(sawUsedBlocks, 'the decode worker held KV blocks mid-stream');
  await poll('decode worker idle (used KV blocks, reservations, running = 0)', decodeIdle, 20_000);
  assert.equal(await metric(decodeMetrics, 'tandem_worker_landing_blocks', 'state="used"') ?? 0, 0);
  await poll('gateway 499 counter', async () => (await status499()) === before499 + 1, 10_000);
  await poll('gateway active streams 0', async () => (await metric(gatewayPort, 'tandem_gateway_active_streams')) === 0, 10_000);
  // The worker serves the next request normally.
  const r = await client.chat.completions.create({ model: MODEL, temperature: 0, max_tokens: 4, messages: [{ role: 'user', content: 'Hi' }] });
  assert.ok(r.usage.completion_tokens > 0);
});

test('a prompt longer than the model context is 400 context_length_exceeded', async () => {
  const requestsBefore = routerPrompts.size;
  const maxLen = (await (await fetch(`${base}/v1/models`, { headers: { authorization: `Bearer ${API_KEY}` } })).json()).data[0].max_model_len;
  // The workers run with --max_model_len=1024, below the tiny checkpoint's
  // max_position_embeddings (1048576): the router serves the smaller limit.
  assert.equal(maxLen, 1024);
  const long = 'word '.repeat(maxLen + 100);
  const e = await expectApiError(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: long }] }),
    400, 'context_length_exceeded', 'messages');
  assert.match(e.message, /maximum context length is 1024 tokens/);
  await expectApiError(client.completions.create({ model: MODEL, prompt: long }), 400, 'context_length_exceeded', 'prompt');
  // prompt + max_tokens over the context is refused the same way.
  await expectApiError(client.completions.create({ model: MODEL, prompt: 'Hi', max_tokens: maxLen }),
    400, 'context_length_exceeded', 'prompt');
  // Refused by the gateway, before reaching the router: once a later valid
  // request's log line has arrived (lines arrive in order), it is the only new one.
  const ok = await client.completions.create({ model: MODEL, prompt: 'Hi', max_tokens: 1 });
  await routerPromptTokens(ok.id);
  assert.equal(routerPrompts.size, requestsBefore + 1);
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
// Every KV block is free at the end.
try {
  await poll('decode worker idle at the end', decodeIdle, 20_000);
} catch (err) {
  failed++;
  console.error(`FAIL ${err.message}`);
}

finish();
gateway.kill('SIGTERM');
const g = await Promise.race([gateway.exited, new Promise((r) => setTimeout(() => r({ code: 'timeout' }), 15_000))]);
if (g.code !== 0) { failed++; console.error(`FAIL gateway did not exit cleanly on SIGTERM: ${JSON.stringify(g)}`); }
if (failed) fail(`${failed} check(s) failed`);
killAll();
console.log(`PASS: ${tests.length} gateway-on-cluster checks in ${elapsed()}`);
process.exit(0);
