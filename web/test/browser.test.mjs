// The browser host, for real: the guest component transpiled with jco from the very .wasm the
// native host runs, in Debian's Chromium (headless, SwiftShader WebGPU, JSPI), driven with
// playwright-core over a page served by server.mjs on 127.0.0.1.
//
// - the .wasm jco transpiled has the sha256 of target/guest/wasm32-wasip2/release/wisp_guest.wasm
//   (checked on the file and again in the page, on the bytes it was served);
// - the golden teacher-forcing check of tests/golden/README.md passes in the page on `capital`,
//   `count` and `unicode`, with the GPU off (every reference step) and on (the first
//   GPU_ON_STEPS steps: SwiftShader runs the 262144-row output projection in about a second a
//   token, so the whole continuation would take minutes);
// - the page streams tokens with their stats (screenshots in web/test-output/);
// - a lost device: the guest carries on on the CPU with the same tokens;
// - without WebGPU, or without JSPI, the page says so and runs on the CPU.
//
// Missing Chromium, WebGPU adapter or model is a skip locally and a failure under CI=true.
// Environment: CHROMIUM (default /usr/bin/chromium), WISP_CACHE (where the model is),
// WISP_GUEST_WASM (the component), GPU_ON_STEPS.

import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { chromium } from 'playwright-core';
import { ASYNC_IMPORTS, build, DIST, GUEST_WASM, sha256, transpile, WEB } from '../build.mjs';
import { CHROMIUM, CI, FLAGS, recordConsole, whyNoGuestInChromium } from '../chromium.mjs';
import { modelPath, serve } from '../server.mjs';

const CASES = ['capital', 'count', 'unicode'];
const GPU_ON_STEPS = Number(process.env.GPU_ON_STEPS || 6);
const OUT = join(WEB, 'test-output');
const MINUTE = 60_000;

/** Skips locally; fails under CI=true. */
function unavailable(t, why) {
  if (CI) assert.fail(`${why}, and CI=true requires it`);
  t.skip(why);
}

const started = Date.now();
const elapsed = () => `${((Date.now() - started) / 1000).toFixed(1)} s`;

test('the component jco transpiled is byte for byte the native host\'s guest', { timeout: 2 * MINUTE }, (t) => {
  if (!existsSync(GUEST_WASM)) return unavailable(t, `${GUEST_WASM} is missing (cargo build --release -p wisp)`);
  const want = sha256(readFileSync(GUEST_WASM));
  // build() fails when jco did not wrap a named async import or export (see checkJspi).
  const m = build({ quiet: true });
  assert.equal(m.sha256, want, 'the manifest names another component');
  assert.equal(sha256(readFileSync(join(DIST, 'wisp_guest.wasm'))), want, 'dist/wisp_guest.wasm differs');
  for (const [file, sum] of Object.entries(m.outputs)) {
    assert.equal(sha256(readFileSync(join(DIST, file))), sum, `dist/${file} is not what jco wrote`);
  }
  t.diagnostic(`sha256 ${want} (${m.bytes} bytes), jco ${m.jco}; ${elapsed()}`);
});

test('a gpu import left out of --async-imports fails the build', { timeout: 2 * MINUTE }, (t) => {
  if (!existsSync(GUEST_WASM)) return unavailable(t, `${GUEST_WASM} is missing (cargo build --release -p wisp)`);
  // jco ignores the missing name without a word; the guest would then get a promise for a run's
  // outputs.
  const out = mkdtempSync(join(tmpdir(), 'wisp-jco-'));
  try {
    const asyncImports = ASYNC_IMPORTS.filter((n) => !n.endsWith('#[method]program.run'));
    assert.throws(() => transpile(GUEST_WASM, out, { jspi: true, asyncImports }), /wisp:llm\/gpu@\d+\.\d+\.\d+#run is not marked async/);
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});

const small = (x) => (x !== 0 && Math.abs(x) < 1e-3 ? x.toExponential(1) : x.toFixed(4));

describe('in Chromium with WebGPU and JSPI', () => {
  let server;
  let url;
  let browser;
  let page;
  let skip = null;
  // Why the GPU-on parts cannot run (no adapter), when they cannot.
  let noGpu = null;
  const console_ = [];

  before(async () => {
    mkdirSync(OUT, { recursive: true });
    skip = whyNoGuestInChromium();
    if (skip) return;
    ({ server, url } = await serve({ port: 0 }));
    browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS });
    page = await browser.newPage({ viewport: { width: 1100, height: 900 } });
    recordConsole(page, console_);
  });

  after(async () => {
    await browser?.close();
    server?.close();
    writeFileSync(join(OUT, 'console.log'), console_.join('\n') + '\n');
  });

  /** Runs `f` in the page (a function source taking one argument). */
  const inPage = (f, arg) => page.evaluate(f, arg);

  test('the page starts the guest with JSPI and a WebGPU adapter, from the same .wasm', { timeout: 2 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    await page.goto(`${url}/web/lab.html`);
    const env = await inPage(() => window.wisp.ready);
    t.diagnostic(`JSPI ${env.jspi}, WebGPU ${env.webgpu ? env.device.name : env.gpuWhy}; ${elapsed()}`);
    assert.ok(env.jspi, 'no JSPI in this Chromium');
    assert.equal(env.variant, 'jspi');
    assert.equal(env.sha256, sha256(readFileSync(GUEST_WASM)), 'the page was served another component');
    if (!existsSync(modelPath())) return unavailable(t, `no model at ${modelPath()} (wisp fetch)`);
    const load = await inPage(() => window.wisp.loadDefault('off'));
    assert.equal(load.architecture, 'gemma3');
    if (!env.webgpu) {
      noGpu = `no WebGPU adapter: ${env.gpuWhy}`;
      return unavailable(t, noGpu);
    }
  });

  const checkGolden = (t, r) => {
    for (const o of r.outcomes) {
      const line = `${r.gpu === 'on' ? 'GPU on ' : 'GPU off'} ${o.name.padEnd(8)} ${o.steps} steps: argmax ${o.argmaxChecked - o.argmaxMismatches.length}/${o.argmaxChecked}, ` +
        `max |d top5| ${small(o.maxTop5Diff)}, RMSE ${o.rmse === null ? '-' : small(o.rmse)}, ` +
        `GPU calls ${o.stats.gpuCalls}, CPU matmuls ${o.stats.cpuMatmuls}, ${(o.ms / 1000).toFixed(1)} s`;
      t.diagnostic(line);
      assert.ok(o.judged, `${o.name}: no reference steps`);
      assert.deepEqual(o.argmaxMismatches, [], `${o.name}: argmax differs at steps ${o.argmaxMismatches}`);
      assert.ok(o.maxTop5Diff <= 1.5, `${o.name}: a top-5 logit is off by ${o.maxTop5Diff}`);
      assert.ok(o.rmse !== null && o.rmse <= 0.6, `${o.name}: RMSE ${o.rmse}`);
      assert.ok(o.pass);
      assert.equal(o.stats.gpuFallbacks, 0, `${o.name}: GPU calls fell back to the CPU`);
    }
  };

  test('golden teacher forcing with the GPU off', { timeout: 5 * MINUTE }, async (t) => {
    if (skip || !existsSync(modelPath())) return unavailable(t, skip ?? `no model at ${modelPath()}`);
    const r = await inPage((cases) => window.wisp.golden({ gpu: 'off', cases }), CASES);
    checkGolden(t, r);
    for (const o of r.outcomes) assert.equal(o.stats.gpuCalls, 0, `${o.name}: GPU off, yet GPU calls`);
    t.diagnostic(elapsed());
  });

  test(`golden teacher forcing with the GPU on (first ${GPU_ON_STEPS} steps)`, { timeout: 10 * MINUTE }, async (t) => {
    if (skip || noGpu || !existsSync(modelPath())) return unavailable(t, skip ?? noGpu ?? `no model at ${modelPath()}`);
    const r = await inPage(([cases, maxSteps]) => window.wisp.golden({ gpu: 'on', cases, maxSteps }), [CASES, GPU_ON_STEPS]);
    if (!r.device) return unavailable(t, 'the guest saw no device');
    t.diagnostic(`device ${r.device}, ${r.load.gpuWeights} weights uploaded in ${(r.load.ms / 1000).toFixed(1)} s`);
    assert.ok(r.load.gpuWeights > 0, 'no weight went to the device');
    checkGolden(t, r);
    for (const o of r.outcomes) {
      assert.ok(o.stats.gpuCalls > 0, `${o.name}: GPU on, yet no GPU call`);
      assert.equal(o.stats.cpuMatmuls, 0, `${o.name}: GPU on, yet matmuls on the CPU`);
    }
    // The whole passes ran as runs of the model's program on the browser host.
    t.diagnostic(`${r.programRuns} program runs`);
    assert.ok(r.programRuns >= r.outcomes.length, `only ${r.programRuns} program runs for ${r.outcomes.length} cases`);
    t.diagnostic(elapsed());
  });

  test('the page streams tokens with tokens/s, the prefill/decode split and where matmuls ran', { timeout: 5 * MINUTE }, async (t) => {
    if (skip || !existsSync(modelPath())) return unavailable(t, skip ?? `no model at ${modelPath()}`);
    await page.selectOption('#gpu-mode', 'off');
    await page.waitForFunction(() => !document.getElementById('generate').disabled, null, { timeout: MINUTE });
    await page.fill('#prompt', 'Once upon a time, there was a little');
    await page.fill('#max-tokens', '24');
    await page.click('#generate');
    // Mid-stream: some tokens shown, generation still going.
    await page.waitForFunction(() => Number(document.getElementById('output').dataset.tokens || 0) >= 3, null, { timeout: MINUTE });
    const mid = await page.screenshot({ path: join(OUT, 'streaming.png') });
    const midText = await page.textContent('#output .generated');
    await page.waitForFunction(() => document.getElementById('output').dataset.done === 'true', null, { timeout: 3 * MINUTE });
    const end = await page.screenshot({ path: join(OUT, 'done.png'), fullPage: true });
    const text = await page.textContent('#output .generated');
    const log = await inPage(() => window.wisp.streamLog());
    const headline = await page.textContent('#headline');
    const prefill = await page.textContent('#stat-prefill');
    const decode = await page.textContent('#stat-decode');
    const where = await page.textContent('#stat-where');
    t.diagnostic(`"${text.trim()}" | ${headline} | prefill ${prefill} | decode ${decode} | ${where}`);
    assert.ok(mid.length > 10_000 && end.length > 10_000, 'a screenshot is blank');
    assert.notDeepEqual(mid, end, 'the page did not change while it streamed');
    assert.ok(midText.length > 0 && midText.length < text.length, 'no partial text mid-stream');
    assert.ok(log.length >= 3, `only ${log.length} tokens streamed`);
    for (let i = 1; i < log.length; i++) {
      assert.ok(log[i].at > log[i - 1].at && log[i].chars >= log[i - 1].chars, 'tokens arrived out of order');
    }
    assert.match(headline, /\d tokens\/s/);
    assert.match(prefill, /^\d+ tokens in \d+ ms \([\d.]+ tokens\/s\)$/);
    assert.match(decode, /^\d+ tokens in \d+ ms \([\d.]+ tokens\/s\)$/);
    assert.match(where, /^CPU: \d+ matmuls, [\d.]+ GFLOP · GPU: none$/);

    if (noGpu) return unavailable(t, noGpu);
    // The same with the GPU on, a few tokens (SwiftShader is slow): the stats say where.
    await page.selectOption('#gpu-mode', 'on');
    await page.waitForFunction(() => /GPU mode on$/.test(document.getElementById('stat-device').textContent), null, { timeout: 2 * MINUTE });
    await page.fill('#max-tokens', '3');
    await page.click('#generate');
    await page.waitForFunction(() => document.getElementById('output').dataset.done === 'true', null, { timeout: 3 * MINUTE });
    await page.screenshot({ path: join(OUT, 'gpu-on.png'), fullPage: true });
    const whereOn = await page.textContent('#stat-where');
    t.diagnostic(`GPU on: "${(await page.textContent('#output .generated')).trim()}" | ${await page.textContent('#stat-decode')} | ${whereOn} | ${await page.textContent('#stat-device')}`);
    assert.match(whereOn, /^CPU: 0 matmuls, 0\.00 GFLOP · GPU: \d+ calls, [\d.]+ GFLOP in \d+ ms$/);

    // A lost device: with the GPU on it held the only copy of the weights, so the next call is a
    // typed error that says to load the model again; loaded again on the CPU, the same tokens.
    const before_ = (await page.textContent('#output .generated')).trim();
    const lost = await inPage(async () => {
      window.wisp.simulateDeviceLoss();
      return window.wisp.generate({ maxTokens: 3 }).then(() => null, (e) => e.message);
    });
    t.diagnostic(`after a device loss: ${lost}`);
    assert.match(lost ?? '', /^io: the device that holds the model's weights was lost .*load the model again$/);
    await page.selectOption('#gpu-mode', 'off');
    await page.waitForFunction(() => /GPU mode off$|^none/.test(document.getElementById('stat-device').textContent), null, { timeout: 2 * MINUTE });
    const again = await inPage(() => window.wisp.generate({ maxTokens: 3 }));
    assert.equal(again.text.trim(), before_, 'other tokens on the CPU than on the device');
    t.diagnostic(`screenshots in ${OUT}; ${elapsed()}`);
  });

  test('generate follows a JSON schema, a regex and a grammar; a bad one is a typed error', { timeout: 5 * MINUTE }, async (t) => {
    if (skip || !existsSync(modelPath())) return unavailable(t, skip ?? `no model at ${modelPath()}`);
    const greedy = { temperature: 0, topK: 0, topP: 1, minP: 0, repeatPenalty: 1, repeatLastN: 64, seed: 0n };
    const schema = {
      type: 'object',
      properties: { name: { type: 'string', maxLength: 20 }, age: { type: 'integer', minimum: 0, maximum: 150 } },
      required: ['name', 'age'],
      additionalProperties: false,
    };
    const r = await inPage(([schema, greedy]) => window.wisp.generate({
      prompt: 'Describe Alice, a 30 year old engineer, as JSON:', maxTokens: 64, sampling: greedy, constraint: { jsonSchema: schema },
    }), [schema, greedy]);
    t.diagnostic(`JSON schema: ${r.text} (${r.finish}, ${r.tokens} tokens)`);
    assert.equal(r.finish, 'stop');
    const v = JSON.parse(r.text);
    assert.deepEqual(Object.keys(v), ['name', 'age']);
    assert.ok(typeof v.name === 'string' && v.name.length <= 20 && Number.isInteger(v.age) && v.age >= 0 && v.age <= 150, r.text);

    const re = await inPage((greedy) => window.wisp.generate({
      prompt: 'Her phone number is', maxTokens: 20, sampling: greedy, constraint: { regex: '[0-9]{3}-[0-9]{4}' },
    }), greedy);
    assert.match(re.text, /^[0-9]{3}-[0-9]{4}$/);
    assert.equal(re.finish, 'stop');
    const lark = await inPage((greedy) => window.wisp.generate({
      prompt: 'Is water wet? Answer:', maxTokens: 8, sampling: greedy, constraint: { grammar: 'start: " " ("yes" | "no")' },
    }), greedy);
    assert.match(lark.text, /^ (yes|no)$/);
    // No text matches: the generation ends at once, with its own reason.
    const dead = await inPage((greedy) => window.wisp.generate({
      prompt: 'Hello', maxTokens: 8, sampling: greedy, constraint: { regex: '[^\\s\\S]' },
    }), greedy);
    assert.deepEqual([dead.text, dead.finish], ['', 'constraint']);
    // A schema that does not compile: the guest's typed error, and the page goes on.
    const bad = await inPage(() => window.wisp.generate({
      prompt: 'Hello', maxTokens: 4, constraint: { jsonSchema: { type: 'integer', minimum: 5, maximum: 3 } },
    }).then(() => 'resolved', (e) => e.message));
    assert.match(bad, /invalid-constraint.*does not compile/);
    const after = await inPage((greedy) => window.wisp.generate({ prompt: 'Hello', maxTokens: 2, sampling: greedy }), greedy);
    assert.equal(after.tokens, 2);
    t.diagnostic(elapsed());
  });

  test('without JSPI the page says so and runs on the CPU', { timeout: 3 * MINUTE }, async (t) => {
    if (skip || !existsSync(modelPath())) return unavailable(t, skip ?? `no model at ${modelPath()}`);
    const p = await browser.newPage();
    try {
      await p.goto(`${url}/web/lab.html?jspi=off`);
      const env = await p.evaluate(() => window.wisp.ready);
      assert.equal(env.variant, 'sync');
      assert.match(await p.textContent('#env-jspi'), /^JSPI: no\./);
      const load = await p.evaluate(() => window.wisp.loadDefault('on'));
      assert.equal(load.device, null, 'gpu.available() must be none');
      const r = await p.evaluate(() => window.wisp.generate({ prompt: 'The capital of France is', maxTokens: 4 }));
      assert.ok(r.tokens > 0);
      assert.equal(r.stats.gpuCalls, 0);
      assert.match(await p.textContent('#stat-device'), /^none: the guest runs on its CPU kernels/);
    } finally {
      await p.close();
    }
    t.diagnostic(elapsed());
  });

  test('without a WebGPU adapter the page says so and runs on the CPU', { timeout: 3 * MINUTE }, async (t) => {
    if (skip || !existsSync(modelPath())) return unavailable(t, skip ?? `no model at ${modelPath()}`);
    // The same Chromium without --enable-unsafe-webgpu: navigator.gpu is there, no adapter.
    const plain = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS.filter((f) => f !== '--enable-unsafe-webgpu') });
    try {
      const p = await plain.newPage();
      await p.goto(`${url}/web/lab.html`);
      const env = await p.evaluate(() => window.wisp.ready);
      assert.equal(env.webgpu, false);
      assert.match(await p.textContent('#env-gpu'), /^WebGPU: not used \(.+\)\. The guest runs its matrix products on the CPU\.$/);
      // The model picked with the file input this time, with the GPU on: there is none.
      await p.selectOption('#gpu-mode', 'on');
      await p.setInputFiles('#file', modelPath());
      await p.waitForFunction(() => /parameters, .* loaded in/.test(document.getElementById('model-status').textContent), null, { timeout: MINUTE });
      assert.match(await p.textContent('#stat-device'), /^none: the guest runs on its CPU kernels/);
      const r = await p.evaluate(() => window.wisp.generate({ prompt: 'The capital of France is', maxTokens: 4 }));
      assert.ok(r.tokens > 0);
      assert.equal(r.stats.gpuCalls, 0);
      t.diagnostic(`${env.gpuWhy}; ${elapsed()}`);
    } finally {
      await plain.close();
    }
  });
});
