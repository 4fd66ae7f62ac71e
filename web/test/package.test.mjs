// The package a web developer ships (src/index.js and its worker), in Debian's Chromium:
//
// - a streamed chat completion through the API equals the native host's greedy text for the same
//   messages (Qwen2.5-Coder-0.5B-Instruct, its own chat template), and a text completion the
//   native one (the default Gemma); the usage counts are the native prompt's and steps';
// - cancelling mid-stream (AbortSignal, or leaving the loop) stops the generation, and the engine
//   goes on;
// - embeddings (`engine.embeddings.create`, floats and base64) are the native library's vectors,
//   to the bit, with its token counts;
// - a reload loads the model from Cache Storage: no request for the weights (the page's network
//   events, the server's count); listing and deleting cached models; a sha256 that does not match
//   is refused;
// - the page's main thread stays free while a 512-token prompt is prefilled in the worker (no
//   long task above 200 ms, seen by a PerformanceObserver that is shown to see one);
// - the fallbacks: no JSPI, no WebGPU adapter (a notice, and the CPU); the GPU in the worker;
// - with `gpu: 'on'` the guest reads the model a piece at a time and its weights go to WebGPU:
//   the guest's memory after the load is under half the model's size (the same greedy text),
//   also where a binding is capped at 32 MiB and the output projection is held in parts;
// - bad requests are typed errors;
// - the chat demo runs on the API;
// - `npm pack` of web/ installs (offline) into an empty project whose one-file page streams a
//   completion, and the declarations type-check a use of the API.
//
// The native texts come from the cargo test (tests/tests/browser.rs) in $WISP_NATIVE_TEXTS.
// What cannot run is a skip locally and a failure under CI=true.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { chromium } from 'playwright-core';
import { GUEST_WASM, sha256, WEB } from '../build.mjs';
import { CHROMIUM, CI, FLAGS, recordConsole, whyNoGuestInChromium } from '../chromium.mjs';
import { modelPath, serve } from '../server.mjs';

const MINUTE = 60_000;
const OUT = join(WEB, 'test-output');
const QWEN = 'qwen2.5-coder-0.5b-instruct-q4_k_m.gguf';
const NATIVE = process.env.WISP_NATIVE_TEXTS ? JSON.parse(process.env.WISP_NATIVE_TEXTS) : null;

function unavailable(t, why) {
  if (CI) assert.fail(`${why}, and CI=true requires it`);
  t.skip(why);
}

const started = Date.now();
const elapsed = () => `${((Date.now() - started) / 1000).toFixed(1)} s`;

describe('the package in Chromium', () => {
  let server;
  let url;
  let hits;
  let browser;
  let context;
  let page;
  let skip = null;
  const requests = [];
  const console_ = [];

  before(async () => {
    mkdirSync(OUT, { recursive: true });
    skip = whyNoGuestInChromium();
    if (skip) return;
    ({ server, url, hits } = await serve({ port: 0 }));
    if (!existsSync(modelPath())) {
      skip = `no model at ${modelPath()} (wisp fetch)`;
      return;
    }
    browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS });
    context = await browser.newContext({ viewport: { width: 1100, height: 900 } });
    // The worker's requests are the context's too.
    context.on('request', (r) => requests.push(new URL(r.url()).pathname));
    page = await context.newPage();
    recordConsole(page, console_);
    await page.goto(`${url}/web/index.html`);
  });

  after(async () => {
    await browser?.close();
    server?.close();
    writeFileSync(join(OUT, 'package-console.log'), console_.join('\n') + '\n');
  });

  /** Runs `f(api, arg)` in the page, `api` being the package's module. */
  const withApi = (f, arg) =>
    page.evaluate(async ([src, arg]) => {
      const api = await import('/web/src/index.js');
      return (0, eval)(`(${src})`)(api, arg);
    }, [f.toString(), arg]);

  test('a reload loads the model from the browser cache, with no request for the weights', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    const fileSha = sha256(readFileSync(modelPath()));
    const first = await withApi(async (api) => {
      for (const m of await api.listCachedModels()) await api.deleteCachedModel(m.sha256);
      const phases = new Set();
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off', onProgress: (p) => phases.add(p.phase) });
      const m = engine.model;
      engine.unload();
      return { model: m, phases: [...phases], cached: await api.listCachedModels() };
    });
    assert.equal(first.model.fromCache, false);
    assert.deepEqual(first.phases, ['download', 'load']);
    assert.equal(first.model.sha256, fileSha);
    assert.equal(first.cached.length, 1);
    assert.equal(first.cached[0].sha256, fileSha);
    assert.equal(first.cached[0].bytes, readFileSync(modelPath()).length);
    const before = hits.get('/model/default.gguf') ?? 0;
    assert.ok(before >= 1 && requests.includes('/model/default.gguf'), 'the first load did not download');

    await page.reload();
    requests.length = 0;
    const second = await withApi(async (api) => {
      const phases = new Set();
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off', onProgress: (p) => phases.add(p.phase) });
      const r = await engine.completions.create({ prompt: 'The capital of France is', max_tokens: 3, temperature: 0 });
      engine.unload();
      return { model: engine.model, phases: [...phases], text: r.choices[0].text };
    });
    t.diagnostic(`after the reload: from the cache ${second.model.fromCache}, phases ${second.phases}, "${second.text}"`);
    assert.equal(second.model.fromCache, true);
    assert.deepEqual(second.phases, ['cache', 'load']);
    assert.equal(second.model.sha256, fileSha);
    assert.ok(!requests.some((p) => p.startsWith('/model/')), `requests after the reload: ${requests.join(', ')}`);
    assert.equal(hits.get('/model/default.gguf'), before, 'the server was asked for the weights again');
    assert.ok(second.text.length > 0);

    // By sha256 alone (any URL), and a sha256 that does not match what a URL gives.
    const pinned = await withApi(async (api, sha) => {
      const engine = await api.createEngine({ model: { url: '/model/not-there.gguf', sha256: sha }, gpu: 'off' });
      engine.unload();
      const wrong = await api.createEngine({ model: { url: '/model/default.gguf', sha256: '0'.repeat(64) }, gpu: 'off' })
        .then(() => 'loaded', (e) => `${e.name} ${e.code}: ${e.message}`);
      return { fromCache: engine.model.fromCache, wrong };
    }, fileSha);
    assert.equal(pinned.fromCache, true);
    assert.match(pinned.wrong, /^WispError model_mismatch: .* has sha256 [0-9a-f]{64}, not the 0{64} asked for$/);

    // Deleting forgets the file and its URL: the next load downloads.
    const deleted = await withApi(async (api, sha) => {
      const gone = await api.deleteCachedModel(sha);
      const again = await api.deleteCachedModel(sha);
      const list = await api.listCachedModels();
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off' });
      engine.unload();
      const bad = await api.deleteCachedModel('nope').then(() => 'deleted', (e) => e.name);
      return { gone, again, list, fromCache: engine.model.fromCache, bad };
    }, fileSha);
    assert.deepEqual([deleted.gone, deleted.again, deleted.list, deleted.fromCache, deleted.bad], [true, false, [], false, 'TypeError']);
    t.diagnostic(elapsed());
  });

  test('a streamed chat completion equals the native host\'s greedy text (Qwen2.5-Coder-0.5B-Instruct)', { timeout: 8 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    if (!NATIVE) return unavailable(t, 'no native texts ($WISP_NATIVE_TEXTS: run through cargo test --test browser)');
    if (!existsSync(modelPath(QWEN))) return unavailable(t, `no model at ${modelPath(QWEN)} (wisp fetch qwen2.5-coder-0.5b)`);
    const { chat } = NATIVE;
    const r = await withApi(async (api, chat) => {
      const engine = await api.createEngine({ model: `/model/${chat.model}`, gpu: 'off' });
      const stream = await engine.chat.completions.create({
        messages: chat.messages, stream: true, max_tokens: chat.max_tokens, temperature: 0, stream_options: { include_usage: true },
      });
      const chunks = [];
      for await (const c of stream) chunks.push(c);
      engine.unload();
      return { chunks, model: engine.model };
    }, chat);
    const { chunks } = r;
    const text = chunks.map((c) => c.choices[0]?.delta?.content ?? '').join('');
    t.diagnostic(`native: ${JSON.stringify(chat.text)}\nbrowser: ${JSON.stringify(text)} (${chunks.length} chunks, template ${r.model.chatTemplate})`);
    assert.equal(text, chat.text);
    assert.equal(r.model.architecture, 'qwen2');
    const ids = new Set(chunks.map((c) => c.id));
    assert.equal(ids.size, 1);
    assert.ok(chunks.every((c) => c.object === 'chat.completion.chunk' && c.model === chat.model));
    assert.deepEqual(chunks[0].choices[0].delta, { role: 'assistant', content: '' });
    assert.ok(chunks.length >= 4, 'not streamed');
    const last = chunks.at(-2);
    assert.equal(last.choices[0].finish_reason, chat.finish);
    const usage = chunks.at(-1);
    assert.deepEqual(usage.choices, []);
    assert.deepEqual(usage.usage, { prompt_tokens: chat.prompt_tokens, completion_tokens: chat.steps, total_tokens: chat.prompt_tokens + chat.steps });
    assert.ok(usage.wisp.decode_tokens > 0 && usage.wisp.cpu_matmuls > 0 && usage.wisp.gpu_calls === 0);

    // A text completion with the default Gemma, not streamed: the native text too.
    const { completion } = NATIVE;
    const c = await withApi(async (api, completion) => {
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off' });
      const r = await engine.completions.create({ prompt: completion.prompt, max_tokens: completion.max_tokens, temperature: 0 });
      engine.unload();
      return r;
    }, completion);
    t.diagnostic(`completion: ${JSON.stringify(c.choices[0].text)}`);
    assert.equal(c.object, 'text_completion');
    assert.equal(c.choices[0].text, completion.text);
    assert.equal(c.choices[0].finish_reason, completion.finish);
    assert.deepEqual(c.usage, { prompt_tokens: completion.prompt_tokens, completion_tokens: completion.steps, total_tokens: completion.prompt_tokens + completion.steps });
    t.diagnostic(elapsed());
  });

  test('embeddings through the API are the library\'s, to the bit (Qwen2.5-Coder-0.5B-Instruct)', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    if (!NATIVE) return unavailable(t, 'no native texts ($WISP_NATIVE_TEXTS: run through cargo test --test browser)');
    const { embeddings } = NATIVE;
    if (!existsSync(modelPath(embeddings.model))) return unavailable(t, `no model at ${modelPath(embeddings.model)} (wisp fetch qwen2.5-coder-0.5b)`);
    const r = await withApi(async (api, e) => {
      const engine = await api.createEngine({ model: `/model/${e.model}`, gpu: 'off' });
      const floats = await engine.embeddings.create({ input: e.texts });
      const b64 = await engine.embeddings.create({ input: e.texts, encoding_format: 'base64' });
      const one = await engine.embeddings.create({ input: e.texts[0] });
      const bad = await engine.embeddings.create({ input: [] }).then(() => null, (err) => ({ code: err.code, param: err.param }));
      engine.unload();
      return { floats, b64, one, bad };
    }, embeddings);
    const { floats, b64, one, bad } = r;
    assert.equal(floats.object, 'list');
    assert.equal(floats.model, embeddings.model);
    assert.deepEqual(floats.usage, { prompt_tokens: embeddings.prompt_tokens, total_tokens: embeddings.prompt_tokens });
    assert.equal(floats.data.length, embeddings.texts.length);
    floats.data.forEach((d, i) => {
      assert.equal(d.index, i);
      // The library's f32 values went through JSON as the shortest decimal that reads back as them.
      assert.deepEqual(d.embedding.map(Math.fround), embeddings.vectors[i].map(Math.fround), `vector ${i}`);
      const bytes = Buffer.from(b64.data[i].embedding, 'base64');
      const decoded = Array.from({ length: bytes.length / 4 }, (_, k) => bytes.readFloatLE(4 * k));
      assert.deepEqual(decoded, d.embedding, `base64 vector ${i}`);
    });
    assert.deepEqual(one.data[0].embedding, floats.data[0].embedding);
    assert.deepEqual(bad, { code: 'invalid_request_error', param: 'input' });
    t.diagnostic(`${floats.data.length} vectors of ${floats.data[0].embedding.length}, ${elapsed()}`);
  });

  test('cancelling mid-stream stops the generation; the engine goes on', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    const r = await withApi(async (api) => {
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off' });
      const body = { prompt: 'Once upon a time', max_tokens: 500, temperature: 0, stream: true };
      // An AbortSignal, fired after three chunks.
      const ac = new AbortController();
      const stream = await engine.completions.create(body, { signal: ac.signal });
      let n = 0;
      let caught = null;
      const t0 = performance.now();
      try {
        for await (const c of stream) {
          n += 1;
          if (n === 3) ac.abort();
        }
      } catch (e) {
        caught = e.name;
      }
      const abortMs = performance.now() - t0;
      // Leaving the loop stops it too: the next request does not wait for 500 tokens.
      const s2 = await engine.completions.create(body);
      let m = 0;
      for await (const c of s2) if (++m === 2) break;
      const t1 = performance.now();
      const after = await engine.completions.create({ prompt: 'Hello', max_tokens: 2, temperature: 0 });
      const afterMs = performance.now() - t1;
      // A signal aborted before the call.
      const early = await engine.completions.create(body, { signal: AbortSignal.abort() }).then(() => 'started', (e) => e.name);
      engine.unload();
      return { n, caught, abortMs, m, after: after.usage.completion_tokens, afterMs, early, rate: after.wisp.decode_tokens_per_s };
    });
    t.diagnostic(JSON.stringify(r));
    assert.equal(r.caught, 'AbortError');
    assert.ok(r.n >= 3 && r.n <= 6, `${r.n} chunks after an abort at 3`);
    assert.equal(r.after, 2);
    // 500 tokens would take many seconds; the request after the broken loop waits for none of them.
    assert.ok(r.afterMs < 5000, `the next request took ${r.afterMs} ms`);
    assert.equal(r.early, 'AbortError');
  });

  test('the main thread stays free while a 512-token prompt is prefilled', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    const r = await withApi(async (api) => {
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off' });
      const longTasks = [];
      const observer = new PerformanceObserver((list) => longTasks.push(...list.getEntries().map((e) => e.duration)));
      observer.observe({ type: 'longtask' });
      const settle = () => new Promise((resolve) => setTimeout(resolve, 100));
      // The observer sees a long task: 300 ms of work on this thread.
      const t0 = performance.now();
      while (performance.now() - t0 < 300);
      await settle();
      const seen = [...longTasks];
      longTasks.length = 0;
      const words = 'the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near old rivers';
      const prompt = Array.from({ length: 40 }, (_, i) => `${i}: ${words}.`).join(' ');
      const frames = [];
      let ticking = true;
      const tick = (ts) => { frames.push(ts); if (ticking) requestAnimationFrame(tick); };
      requestAnimationFrame(tick);
      const res = await engine.completions.create({ prompt, max_tokens: 1, temperature: 0 });
      ticking = false;
      await settle();
      observer.disconnect();
      engine.unload();
      return { seen, during: longTasks, usage: res.usage, wisp: res.wisp, frames: frames.length };
    });
    t.diagnostic(`a 300 ms task seen as ${r.seen.map((d) => d.toFixed(0)).join(', ')} ms; prefill of ${r.usage.prompt_tokens} tokens in ${r.wisp.prefill_ms.toFixed(0)} ms; long tasks during it: [${r.during.map((d) => d.toFixed(0)).join(', ')}]; ${r.frames} frames`);
    assert.ok(r.seen.some((d) => d >= 250), 'the observer did not see the deliberate long task');
    assert.ok(r.usage.prompt_tokens >= 512, `the prompt is only ${r.usage.prompt_tokens} tokens`);
    assert.ok(r.wisp.prefill_ms > 1000, 'the prefill was too short to show anything');
    assert.deepEqual(r.during.filter((d) => d > 200), [], 'long tasks on the main thread during the prefill');
  });

  test('the fallbacks: no JSPI or no WebGPU gives a notice and the CPU; the GPU in the worker', { timeout: 6 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    const run = (options) =>
      withApi(async (api, options) => {
        const engine = await api.createEngine({ model: '/model/default.gguf', ...options });
        const r = await engine.completions.create({ prompt: 'The capital of France is', max_tokens: 3, temperature: 0 });
        engine.unload();
        return { env: engine.env, model: engine.model, text: r.choices[0].text, wisp: r.wisp };
      }, options);
    const noJspi = await run({ jspi: false, gpu: 'on' });
    t.diagnostic(`no JSPI: ${noJspi.env.notices.join('; ')}`);
    assert.equal(noJspi.env.variant, 'sync');
    assert.equal(noJspi.env.jspi, false);
    assert.match(noJspi.env.notices[0], /JSPI.*the model runs on the CPU$/);
    assert.equal(noJspi.model.device, null);
    assert.equal(noJspi.wisp.gpu_calls, 0);
    const cpu = await run({ gpu: 'off' });
    assert.equal(noJspi.text, cpu.text, 'the sync guest generates other text');
    const noGpu = await run({ webgpu: false, gpu: 'on' });
    assert.match(noGpu.env.notices[0], /WebGPU turned off.*the model runs on the CPU$/);
    assert.equal(noGpu.wisp.gpu_calls, 0);

    // A browser with no WebGPU adapter (no --enable-unsafe-webgpu): the notice says so.
    const plain = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS.filter((f) => f !== '--enable-unsafe-webgpu') });
    try {
      const p = await plain.newPage();
      await p.goto(`${url}/web/index.html`);
      const r = await p.evaluate(async () => {
        const api = await import('/web/src/index.js');
        const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'on' });
        const r = await engine.completions.create({ prompt: 'Hello', max_tokens: 2, temperature: 0 });
        engine.unload();
        return { env: engine.env, gpuCalls: r.wisp.gpu_calls };
      });
      t.diagnostic(`no adapter: ${r.env.notices.join('; ')}`);
      assert.equal(r.env.webgpu, false);
      assert.match(r.env.notices[0], /the model runs on the CPU$/);
      assert.equal(r.gpuCalls, 0);
    } finally {
      await plain.close();
    }

    // JSPI and WebGPU inside the worker: the products go to the device.
    const gpu = await run({ gpu: 'on' });
    if (!gpu.env.webgpu) return unavailable(t, `no WebGPU adapter in the worker: ${gpu.env.notices.join('; ')}`);
    t.diagnostic(`GPU on in the worker: ${gpu.model.device.name}, ${gpu.model.gpuWeights} weights, ${gpu.wisp.gpu_calls} GPU calls, "${gpu.text}"`);
    assert.equal(gpu.env.variant, 'jspi');
    assert.deepEqual(gpu.env.notices, []);
    assert.ok(gpu.model.gpuWeights > 0 && gpu.wisp.gpu_calls > 0 && gpu.wisp.cpu_matmuls === 0);
    t.diagnostic(elapsed());
  });

  test('the model goes to WebGPU a piece at a time: the guest\'s memory stays below the model\'s size', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    const run = (options) =>
      withApi(async (api, options) => {
        const engine = await api.createEngine({ model: '/model/default.gguf', ...options });
        const r = await engine.completions.create({ prompt: 'The capital of France is', max_tokens: 8, temperature: 0 });
        engine.unload();
        return { env: engine.env, model: engine.model, text: r.choices[0].text, wisp: r.wisp };
      }, options);
    const on = await run({ gpu: 'on' });
    if (!on.env.webgpu) return unavailable(t, `no WebGPU adapter in the worker: ${on.env.notices.join('; ')}`);
    const off = await run({ gpu: 'off' });
    // A device whose binding is 32 MiB (WebGPU's default is 128): Gemma's output projection
    // (the embedding, 262,144 rows) is held in parts there, and still nothing stays in the guest.
    const parts = await run({ gpu: 'on', maxBindingBytes: 32 << 20 });
    const mib = (n) => `${(n / 2 ** 20).toFixed(0)} MiB`;
    t.diagnostic(`a ${mib(on.model.bytes)} model: the guest's memory ${mib(on.model.guestMemoryBytes)} with its ${on.model.gpuWeights} weights on ${on.model.device.name} (${mib(parts.model.guestMemoryBytes)} with 32 MiB bindings), ${mib(off.model.guestMemoryBytes)} on its own CPU; "${on.text}" / "${parts.text}" / "${off.text}"`);
    for (const [what, r] of [['on', on], ['32 MiB bindings', parts]]) {
      // The guest holds the tokenizer, the recipe and the pieces it reads, not the weights.
      assert.ok(r.model.guestMemoryBytes < r.model.bytes / 2, `${what}: the guest's memory is ${r.model.guestMemoryBytes} bytes for a model of ${r.model.bytes}`);
      assert.ok(r.model.gpuWeights > 0 && r.wisp.gpu_calls > 0 && r.wisp.cpu_matmuls === 0, `${what}: ${JSON.stringify(r.wisp)}`);
      assert.equal(r.text, off.text, `${what}: the device generates other text than the guest\'s CPU`);
    }
    assert.ok(off.model.guestMemoryBytes > on.model.bytes / 2, 'the CPU run does not hold the weights in the guest');
    // The later loads read the file from Cache Storage a piece at a time.
    assert.ok(off.model.fromCache && parts.model.fromCache, 'a load after the first did not come from the cache');
  });

  test('bad requests are typed errors, and the engine goes on', { timeout: 3 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    const r = await withApi(async (api) => {
      const err = (p) => p.then(() => 'resolved', (e) => `${e.name} ${e.code} ${e.param ?? '-'} | ${e.message}`);
      const load = {
        missing: await err(api.createEngine({ model: '/model/no-such-model.gguf' })),
        notGguf: await err(api.createEngine({ model: '/web/index.html' })),
        badGpu: await err(api.createEngine({ model: '/model/default.gguf', gpu: 'always' })),
      };
      // A file that is no model is not kept.
      load.cachedUrls = (await api.listCachedModels()).map((m) => new URL(m.url).pathname);
      const engine = await api.createEngine({ model: '/model/default.gguf', gpu: 'off', contextSize: 64 });
      const out = {
        noMessages: await err(engine.chat.completions.create({ messages: [] })),
        badRole: await err(engine.chat.completions.create({ messages: [{ content: 'x' }] })),
        temperature: await err(engine.completions.create({ prompt: 'x', temperature: 3 })),
        maxTokens: await err(engine.completions.create({ prompt: 'x', max_tokens: 0 })),
        stops: await err(engine.completions.create({ prompt: 'x', stop: ['a', 'b', 'c', 'd', 'e'] })),
        penalty: await err(engine.completions.create({ prompt: 'x', frequency_penalty: 1 })),
        image: await err(engine.chat.completions.create({ messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] })),
        tooLong: await err(engine.completions.create({ prompt: 'word '.repeat(200) })),
        schema: await err(engine.completions.create({ prompt: 'x', response_format: { type: 'json_schema', json_schema: { name: 'n', schema: { type: 'integer', minimum: 5, maximum: 3 } } } })),
        two: await err(engine.completions.create({ prompt: 'x', regex: 'a', grammar: 'start: "a"' })),
      };
      const stopped = await engine.completions.create({ prompt: 'one, two, three, four,', max_tokens: 20, temperature: 0, stop: [' six'] });
      const json = await engine.chat.completions.create({
        messages: [{ role: 'user', content: 'Give a JSON object with a name.' }], max_tokens: 40, temperature: 0,
        response_format: { type: 'json_schema', json_schema: { name: 'p', schema: { type: 'object', properties: { name: { type: 'string', maxLength: 12 } }, required: ['name'], additionalProperties: false } } },
      });
      engine.unload();
      return { load, out, stopped: stopped.choices[0], json: json.choices[0] };
    });
    t.diagnostic(JSON.stringify(r, null, 1));
    assert.match(r.load.missing, /^WispError model_not_found - \| .*\/model\/no-such-model\.gguf: HTTP 404$/);
    assert.match(r.load.notGguf, /^WispError invalid-model - \| invalid-model: /);
    assert.ok(!r.load.cachedUrls.includes('/web/index.html'), `cached: ${r.load.cachedUrls}`);
    assert.match(r.load.badGpu, /^TypeError undefined - \| gpu: one of auto, on, off$/);
    const { out } = r;
    assert.match(out.noMessages, /^WispError invalid_request_error messages \| messages: a non-empty list/);
    assert.match(out.badRole, /^WispError invalid_request_error messages\[0\]\.role \| messages\[0\]\.role: a string/);
    assert.match(out.temperature, /^WispError invalid_request_error temperature \| temperature: a number from 0 to 2, not 3$/);
    assert.match(out.maxTokens, /^WispError invalid_request_error max_tokens \| max_tokens: a number from 1 to \d+, not 0$/);
    assert.match(out.stops, /^WispError invalid_request_error stop \| stop: at most 4 stop sequences$/);
    assert.match(out.penalty, /^WispError invalid_request_error frequency_penalty \| .*not supported/);
    assert.match(out.image, /^WispError invalid_request_error messages\[0\]\.content\[0\] \| .*only text parts/);
    assert.match(out.tooLong, /^WispError context_length_exceeded prompt \| the prompt is \d+ tokens, and this engine's context holds 64/);
    assert.match(out.schema, /^WispError invalid-constraint - \| invalid-constraint: .*does not compile/);
    assert.match(out.two, /^WispError invalid_request_error response_format \| response_format: at most one/);
    assert.ok(!r.stopped.text.includes(' six') && r.stopped.finish_reason === 'stop', JSON.stringify(r.stopped));
    assert.equal(r.json.finish_reason, 'stop');
    assert.deepEqual(Object.keys(JSON.parse(r.json.message.content)), ['name']);
  });

  test('the chat demo runs on the API', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    await page.goto(`${url}/web/index.html?model=default&gpu=off`);
    const loaded = await page.evaluate(() => window.demo.loaded());
    assert.equal(loaded.model.architecture, 'gemma3');
    await page.fill('#temperature', '0');
    await page.fill('#max-tokens', '12');
    const reply = await page.evaluate(() => window.demo.send('Name a colour.'));
    await page.screenshot({ path: join(OUT, 'demo.png'), fullPage: true });
    const headline = await page.textContent('#headline');
    const stats = await page.textContent('#stats');
    t.diagnostic(`"${reply.text}" (${reply.finish}) | ${headline} | ${stats} | ${await page.textContent('#status')}`);
    assert.ok(reply.text.length > 0 && ['stop', 'length'].includes(reply.finish));
    assert.equal(await page.textContent('#chat .msg.assistant'), reply.text);
    assert.match(headline, /^[\d.]+ tokens\/s$/);
    assert.match(stats, /^prefill \d+ tokens in \d+ ms \([\d.]+ tokens\/s\) · decode \d+ tokens in \d+ ms · CPU: \d+ matmuls · GPU: none$/);
    assert.match(await page.textContent('#status'), /gemma3, 268M parameters, (from the cache|downloaded), loaded in/);
    assert.ok((await page.$$('#cached tr')).length >= 1, 'the cached models are not listed');
  });
});

test('npm pack of web/ installs into an empty project whose one-file page streams a completion', { timeout: 10 * MINUTE }, async (t) => {
  if (!existsSync(GUEST_WASM)) return unavailable(t, `${GUEST_WASM} is missing`);
  if (!existsSync(CHROMIUM)) return unavailable(t, `no Chromium at ${CHROMIUM}`);
  if (!existsSync(modelPath())) return unavailable(t, `no model at ${modelPath()}`);
  if (!NATIVE) return unavailable(t, 'no native texts ($WISP_NATIVE_TEXTS: run through cargo test --test browser)');
  const dir = mkdtempSync(join(tmpdir(), 'wisp-pack-'));
  let browser;
  let server;
  try {
    // `npm pack` builds dist/ first (prepack).
    const packed = JSON.parse(execFileSync('npm', ['pack', '--json', '--pack-destination', dir], { cwd: WEB, encoding: 'utf8', stdio: ['ignore', 'pipe', 'inherit'] }));
    const { filename, files, size, unpackedSize } = packed[0];
    t.diagnostic(`${filename}: ${files.length} files, ${(size / 2 ** 20).toFixed(1)} MiB packed, ${(unpackedSize / 2 ** 20).toFixed(1)} MiB unpacked`);
    const paths = files.map((f) => f.path);
    for (const want of ['package.json', 'README.md', 'src/index.js', 'src/index.d.ts', 'src/worker.js', 'dist/jspi/wisp_guest.js', 'dist/sync/wisp_guest.js', 'dist/shim/index.js', 'dist/shaders/matmul.wgsl', 'dist/guest.json']) {
      assert.ok(paths.includes(want), `the package lacks ${want}`);
    }
    assert.ok(!paths.some((p) => p.startsWith('test/') || p.startsWith('node_modules/') || p.startsWith('dist/conformance/')), 'the package holds tests or the kit');
    const app = join(dir, 'app');
    mkdirSync(app);
    writeFileSync(join(app, 'package.json'), JSON.stringify({ name: 'app', private: true, type: 'module' }));
    // No network: the package needs nothing else.
    execFileSync('npm', ['install', '--offline', '--no-audit', '--no-fund', join(dir, filename)], { cwd: app, stdio: ['ignore', 'ignore', 'inherit'] });
    const installed = JSON.parse(readFileSync(join(app, 'node_modules/wisp-web/package.json'), 'utf8'));
    assert.deepEqual(Object.keys(installed.dependencies ?? {}), []);
    assert.equal(sha256(readFileSync(GUEST_WASM)), JSON.parse(readFileSync(join(app, 'node_modules/wisp-web/dist/guest.json'), 'utf8')).sha256);
    assert.deepEqual(readdirSync(join(app, 'node_modules')).filter((n) => !n.startsWith('.')), ['wisp-web']);

    // The declarations, used as a TypeScript developer would.
    writeFileSync(join(app, 'use.ts'), [
      "import { createEngine, listCachedModels, type ChatCompletionChunk } from 'wisp-web';",
      "const engine = await createEngine({ model: { url: '/m.gguf' }, gpu: 'auto', onProgress: (p) => console.log(p.phase, p.loaded) });",
      "const stream = await engine.chat.completions.create({ messages: [{ role: 'user', content: 'hi' }], stream: true, max_tokens: 8 }, { signal: new AbortController().signal });",
      'for await (const chunk of stream) { const c: ChatCompletionChunk = chunk; console.log(c.choices[0]?.delta.content ?? \'\'); }',
      "const whole = await engine.completions.create({ prompt: 'x', max_tokens: 2 });",
      'const n: number = whole.usage.completion_tokens + (await listCachedModels()).length;',
      'console.log(n, whole.choices[0].text, engine.model.sha256, engine.env.notices);',
      '',
    ].join('\n'));
    writeFileSync(join(app, 'wrong.ts'), "import { createEngine } from 'wisp-web';\nconst e = await createEngine({ model: '/m.gguf' });\nawait e.completions.create({ prompt: 1 });\n");
    const tsc = (file) => {
      try {
        execFileSync(process.execPath, [join(WEB, 'node_modules/typescript/bin/tsc'), '--noEmit', '--strict', '--target', 'es2022', '--module', 'es2022', '--moduleResolution', 'bundler', '--lib', 'es2022,dom', file], { cwd: app, encoding: 'utf8' });
        return 'ok';
      } catch (e) {
        return e.stdout;
      }
    };
    assert.equal(tsc('use.ts'), 'ok');
    assert.match(tsc('wrong.ts'), /^wrong\.ts\(3,\d+\): error TS\d+: [\s\S]*Type 'number' is not assignable to type 'string'/);

    // The one-file page: an import map names the package.
    const { completion } = NATIVE;
    writeFileSync(join(app, 'index.html'), `<!doctype html>
<meta charset="utf-8"><title>app</title>
<script type="importmap">{ "imports": { "wisp-web": "./node_modules/wisp-web/src/index.js" } }</script>
<pre id="out"></pre>
<script type="module">
  import { createEngine } from 'wisp-web';
  const engine = await createEngine({ model: '/model/default.gguf', gpu: 'off' });
  const stream = await engine.completions.create({ prompt: ${JSON.stringify(completion.prompt)}, max_tokens: ${completion.max_tokens}, temperature: 0, stream: true });
  let chunks = 0;
  for await (const chunk of stream) {
    document.getElementById('out').textContent += chunk.choices[0].text;
    chunks += 1;
  }
  document.body.dataset.chunks = chunks;
  document.title = 'done';
</script>
`);
    ({ server } = await serve({ port: 0, root: app }));
    const url = `http://127.0.0.1:${server.address().port}`;
    browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS });
    const p = await browser.newPage();
    const errors = [];
    p.on('pageerror', (e) => errors.push(e.message));
    await p.goto(`${url}/index.html`);
    await p.waitForFunction(() => document.title === 'done', null, { timeout: 5 * MINUTE }).catch(() => {});
    assert.deepEqual(errors, []);
    const text = await p.textContent('#out');
    const chunks = Number(await p.getAttribute('body', 'data-chunks'));
    t.diagnostic(`the page streamed ${JSON.stringify(text)} in ${chunks} chunks`);
    assert.equal(text, completion.text);
    assert.ok(chunks >= 3);
  } finally {
    await browser?.close();
    server?.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
