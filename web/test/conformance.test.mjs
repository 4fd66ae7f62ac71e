// The conformance kit of the `gpu` interface against the browser host: the kit's component (the
// bytes `wisp conformance` runs against the native host), transpiled with jco for JSPI by
// build.mjs, run in Debian's Chromium (headless, WebGPU on SwiftShader) against web/src/gpu.js.
//
// - the kit jco transpiled is byte for byte target/guest/wasm32-wasip2/release/wisp_conformance.wasm,
//   and a gpu import the kit uses left out of --async-imports fails its build;
// - in the page, every case of the kit runs on the WebGPU device and none fails (a skip must say
//   why); the cases are those the native kit runs ($WISP_KIT_CASES, set by tests/tests/browser.rs
//   from the native run, or else the kit's own list from a run without a device);
// - each deliberately broken host of web/src/broken-gpu.js makes the kit fail, on the cases that
//   check what it breaks, with a message that says what went wrong.
//
// Missing Chromium, the kit, JSPI or a WebGPU adapter is a skip locally and a failure under CI=true.
// Environment: CHROMIUM, WISP_CONFORMANCE_WASM (the kit), KIT_SEED (default 1), WISP_KIT_CASES.

import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { chromium } from 'playwright-core';
import { ASYNC_IMPORTS, build, DIST, KIT_ASYNC_EXPORTS, KIT_WASM, sha256, transpile, WEB } from '../build.mjs';
import { CHROMIUM, CI, FLAGS, recordConsole } from '../chromium.mjs';
import { serve } from '../server.mjs';

const SEED = Number(process.env.KIT_SEED || 1);
const OUT = join(WEB, 'test-output');
const MINUTE = 60_000;
const KIT_JS = join(DIST, 'conformance/jspi/wisp_conformance.js');
const MISSING_KIT = `${KIT_WASM} is missing (cargo build --release -p wisp)`;

/** Skips locally; fails under CI=true. */
function unavailable(t, why) {
  if (CI) assert.fail(`${why}, and CI=true requires it`);
  t.skip(why);
}

/** Prints a table line by line (node's reporter keeps diagnostics on one line each). */
function show(t, text) {
  for (const line of text.split('\n')) t.diagnostic(line);
}

test('the kit jco transpiled is byte for byte the native host\'s kit', { timeout: 2 * MINUTE }, (t) => {
  if (!existsSync(KIT_WASM)) return unavailable(t, MISSING_KIT);
  const want = sha256(readFileSync(KIT_WASM));
  // Built by browser.test.mjs already when both run; rebuilt when it is stale or absent.
  let m = existsSync(join(DIST, 'guest.json')) ? JSON.parse(readFileSync(join(DIST, 'guest.json'), 'utf8')) : null;
  if (m?.conformance?.sha256 !== want) m = build({ quiet: true });
  assert.equal(m.conformance.sha256, want, `the manifest names another kit: ${JSON.stringify(m.conformance)}`);
  assert.deepEqual(m.conformance.jspi.asyncExports, KIT_ASYNC_EXPORTS);
  assert.equal(sha256(readFileSync(join(DIST, 'conformance/wisp_conformance.wasm'))), want, 'dist/conformance/wisp_conformance.wasm differs');
  assert.match(readFileSync(KIT_JS, 'utf8'), /= WebAssembly\.promising\(exports1\['run-suite'\]\)/);
  t.diagnostic(`kit sha256 ${want} (${m.conformance.bytes} bytes), jco ${m.jco}`);
});

test('a gpu import the kit uses left out of --async-imports fails its build', { timeout: 2 * MINUTE }, (t) => {
  if (!existsSync(KIT_WASM)) return unavailable(t, MISSING_KIT);
  // The kit calls `upload` (the guest does not): without it, jco would hand the kit a promise.
  const out = mkdtempSync(join(tmpdir(), 'wisp-kit-jco-'));
  try {
    const asyncImports = ASYNC_IMPORTS.filter((n) => !n.endsWith('#upload'));
    const opts = { jspi: true, name: 'wisp_conformance', asyncExports: KIT_ASYNC_EXPORTS };
    assert.throws(() => transpile(KIT_WASM, out, { ...opts, asyncImports }), /async import wisp:llm\/gpu@\d+\.\d+\.\d+#upload is not marked async/);
    assert.throws(() => transpile(KIT_WASM, out, { ...opts, asyncExports: ['run-suite-typo'] }), /async export run-suite-typo is not promising/);
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});

describe('the kit in Chromium against the WebGPU host', () => {
  let server;
  let url;
  let browser;
  let page;
  let skip = null;
  // Why the device parts cannot run, when they cannot.
  let noGpu = null;
  const console_ = [];

  before(async () => {
    mkdirSync(OUT, { recursive: true });
    if (!existsSync(KIT_WASM)) {
      skip = MISSING_KIT;
      return;
    }
    if (!existsSync(KIT_JS)) build({ quiet: true });
    if (!existsSync(CHROMIUM)) {
      skip = `no Chromium at ${CHROMIUM} (apt-get install chromium)`;
      return;
    }
    ({ server, url } = await serve({ port: 0 }));
    browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS });
    page = await browser.newPage({ viewport: { width: 1100, height: 1200 } });
    recordConsole(page, console_);
    await page.goto(`${url}/web/conformance.html?run=no`);
    const env = await page.evaluate(() => window.kit.ready);
    if (env.manifest.missing) skip = env.manifest.missing;
    else if (!env.jspi) skip = 'no JSPI in this Chromium';
    else if (!env.webgpu) noGpu = 'no navigator.gpu in this Chromium';
  });

  after(async () => {
    await browser?.close();
    server?.close();
    writeFileSync(join(OUT, 'conformance-console.log'), console_.join('\n') + '\n');
  });

  /** The case names the native kit runs (tests/tests/browser.rs passes them), else the kit's own
   *  list: a run without a device names every case (skipped), plus `no-device` in place. */
  async function expectedCases() {
    if (process.env.WISP_KIT_CASES) return { from: 'the native kit', names: process.env.WISP_KIT_CASES.split(',') };
    const r = await page.evaluate((seed) => window.kit.run({ seed, webgpu: false }), SEED);
    return { from: 'the kit without a device', names: r.results.map((c) => c.name).filter((n) => n !== 'no-device') };
  }

  test('every case of the kit passes on the browser host\'s WebGPU device', { timeout: 5 * MINUTE }, async (t) => {
    if (skip) return unavailable(t, skip);
    if (noGpu) return unavailable(t, noGpu);
    const r = await page.evaluate((seed) => window.kit.run({ seed }), SEED);
    if (!r.device) return unavailable(t, `no WebGPU adapter: ${r.why}`);
    await page.screenshot({ path: join(OUT, 'conformance.png'), fullPage: true });
    t.diagnostic(`device: ${r.device}; seed ${SEED} (KIT_SEED=${SEED} repeats these calls)`);
    show(t, r.table);
    const failed = r.results.filter((c) => c.failed);
    assert.deepEqual(failed.map((c) => `${c.name}: ${c.message}`), [], 'cases failed on the browser host');
    for (const c of r.results.filter((x) => x.skipped)) assert.ok(c.message.trim(), `${c.name} was skipped without a word`);
    const { from, names } = await expectedCases();
    assert.deepEqual(r.results.map((c) => c.name), names, `the browser run's cases are not those of ${from}`);
    for (const f of ['f32', 'bf16', 'q8x32', 'q8x16', 'q4x32']) {
      const c = r.results.find((x) => x.name === `matmul-${f}`);
      assert.ok(c?.passed, `matmul-${f} did not pass: ${c?.message}`);
      assert.ok(c.maxError > 0, `matmul-${f} compared no product`);
    }
    // The browser host offers kv-caches and programs (the same shaders): they must pass, not
    // skip; no case of the kit skips on a device.
    const offered = ['program-ops', 'program-top-k', 'program-attention', 'program-decoder', 'program-lifetimes', 'hostile-programs', 'hostile-program-runs', 'hostile-kv-cache'];
    assert.deepEqual(r.results.filter((c) => c.skipped).map((c) => `${c.name}: ${c.message}`), [], 'cases skipped on the browser host');
    for (const name of offered) {
      const c = r.results.find((x) => x.name === name);
      assert.ok(c?.passed, `${name} did not pass on the browser host: ${c?.message}`);
      // (top-k and the lifetimes case compare exactly: no error to report.)
      const exact = ['program-top-k', 'program-lifetimes'];
      if (!name.startsWith('hostile') && !exact.includes(name)) assert.ok(c.maxError > 0, `${name} compared nothing`);
    }
    assert.ok(r.results.find((x) => x.name === 'host-usage-after-kit').passed);
    t.diagnostic(`${r.results.length} cases, as many as ${from}`);
  });

  // What each broken host must fail, and what the message of the first of those must say.
  const MUST_FAIL = {
    'perturbed-products': {
      cases: ['matmul-f32', 'matmul-bf16', 'matmul-q8x32', 'matmul-q8x16', 'matmul-q4x32', 'matmul-batch', 'write-rows-chunked'],
      message: /y\[\d+, \d+\] is .* where the reference is .*tolerance/,
      pass: ['hostile-x-length', 'hostile-upload-lengths', 'limit-weight-bytes'],
    },
    'lenient-inputs': {
      cases: ['hostile-x-length'],
      message: /was accepted; want invalid-argument/,
      pass: ['matmul-f32', 'matmul-q4x32', 'hostile-upload-lengths'],
    },
  };

  for (const [name, want] of Object.entries(MUST_FAIL)) {
    test(`a deliberately broken browser host fails the kit: ${name}`, { timeout: 5 * MINUTE }, async (t) => {
      if (skip) return unavailable(t, skip);
      if (noGpu) return unavailable(t, noGpu);
      const r = await page.evaluate(([seed, broken]) => window.kit.run({ seed, broken }), [SEED, name]);
      if (!r.device) return unavailable(t, `no WebGPU adapter: ${r.why}`);
      const what = await page.evaluate((n) => window.kit.broken[n], name);
      t.diagnostic(`broken host: ${what}`);
      show(t, r.table);
      const failed = r.results.filter((c) => c.failed).map((c) => c.name);
      for (const c of want.cases) assert.ok(failed.includes(c), `${c} should fail against ${name}; failed: ${failed.join(', ')}`);
      const first = r.results.find((c) => c.name === want.cases[0]);
      assert.match(first.message, want.message);
      for (const c of want.pass) assert.ok(r.results.find((x) => x.name === c)?.passed, `${c} should still pass against ${name}`);
    });
  }
});
