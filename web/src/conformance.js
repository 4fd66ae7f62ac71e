// The conformance kit of the `gpu` interface (world `conformance` of wit/conformance.wit) against
// the browser host: the kit's component, the same bytes `wisp conformance` runs against the native
// host, transpiled by build.mjs into dist/conformance/jspi, with the WASI of preview2-shim and the
// `wisp:llm/gpu` imports of gpu.js over WebGPU.
//
// `runKit` opens a device and runs the kit against gpu.js; `runSuite` runs it against any import
// object of `wisp:llm/gpu` (another browser host's, or a deliberately broken one: broken-gpu.js).
// conformance.html shows the table; web/test/conformance.test.mjs holds it to the contract.

import { createGpu, openDevice } from './gpu.js';
import { coreModule, manifest, wasiImports } from './wisp.js';

const SHADER = new URL('../dist/shaders/matmul.wgsl', import.meta.url);
const VARIANT = 'conformance/jspi';

/** The budget the kit gets, as `wisp conformance` gives it (`conformance::budget()`): small enough
 *  for the `budget-bytes` case to fill (it skips above 256 MiB). */
export const KIT_BUDGET = { bytes: 64n << 20n, handles: 4096 };

/** The kit's part of dist/guest.json: its source, sha256 and jco flags (`missing` when build.mjs
 *  found no kit to transpile). */
export async function kitManifest() {
  return (await manifest()).conformance ?? { missing: 'dist/guest.json names no conformance kit (run `npm run build` in web/)' };
}

/** One case's outcome, as the kit returns it, with `micros` a Number; `failed` neither passed nor skipped. */
function plain(r) {
  return {
    name: r.name,
    passed: r.passed,
    skipped: r.skipped,
    failed: !r.passed && !r.skipped,
    maxError: r.maxError,
    micros: Number(r.micros),
    message: r.message,
  };
}

/**
 * Instantiates the kit with `imports` as `wisp:llm/gpu` and runs `run-suite(seed)`. With `usage`
 * (a function returning the host's `{ bytes, handles }`), adds the case the native runner adds,
 * `host-usage-after-kit`: once the kit has dropped every weight, the host holds none.
 * Needs JSPI: the kit waits for the async gpu imports.
 */
export async function runSuite({ seed, imports, usage }) {
  const { instantiate } = await import(new URL(`../dist/${VARIANT}/wisp_conformance.js`, import.meta.url).href);
  const kit = await instantiate((name) => coreModule(VARIANT, name), { ...wasiImports(), 'wisp:llm/gpu': imports });
  const results = (await kit.runSuite(BigInt(seed))).map(plain);
  if (usage) {
    const { bytes, handles } = usage();
    const clean = bytes === 0 && handles === 0;
    results.push({
      name: 'host-usage-after-kit',
      passed: clean,
      skipped: false,
      failed: !clean,
      maxError: 0,
      micros: 0,
      message: clean
        ? 'the host holds no weights once the kit\'s are dropped'
        : `the host still holds ${bytes} bytes in ${handles} weights after the kit dropped all of its own`,
    });
  }
  return results;
}

/**
 * Runs the kit against gpu.js over a WebGPU device of its own (with `KIT_BUDGET`), or against
 * the host without a device when `webgpu` is false or there is no adapter (the device cases are
 * then skipped). `wrap` may replace the import object (see broken-gpu.js). Resolves to
 * `{ seed, device, why, results }`; `device` is null and `why` says why without one.
 */
export async function runKit({ seed = 1, webgpu = true, lanes, wrap = (imports) => imports } = {}) {
  if (typeof WebAssembly.Suspending !== 'function' || typeof WebAssembly.promising !== 'function') {
    throw new Error('this browser has no JSPI (WebAssembly.Suspending): the kit cannot wait for WebGPU');
  }
  const opened = webgpu ? await openDevice(SHADER, { lanes }) : { why: 'WebGPU turned off' };
  const gpu = createGpu(opened.device ? opened : null, opened.why ?? 'no device', { budget: KIT_BUDGET });
  const results = await runSuite({ seed, imports: wrap(gpu.imports), usage: gpu.usage });
  opened.device?.destroy();
  return { seed, device: gpu.info ? `${gpu.info.name} (${gpu.info.deviceType})` : null, why: gpu.why, results };
}

/** `results` as a text table, one line a case, then the messages of the cases that did not pass
 *  (of every case with `verbose`), as `wisp conformance` prints it. */
export function table(results, { verbose = false } = {}) {
  const verdict = (r) => (r.passed ? 'pass' : r.skipped ? 'skip' : 'FAIL');
  const lines = [`${'case'.padEnd(28)} ${'result'.padEnd(6)} ${'max error'.padStart(10)} ${'time'.padStart(10)}`];
  for (const r of results) {
    const err = r.maxError > 0 ? r.maxError.toExponential(2) : '-';
    lines.push(`${r.name.padEnd(28)} ${verdict(r).padEnd(6)} ${err.padStart(10)} ${`${(r.micros / 1000).toFixed(1)} ms`.padStart(10)}`);
  }
  const count = (f) => results.filter(f).length;
  lines.push('', `${count((r) => r.passed)} passed, ${count((r) => r.failed)} failed, ${count((r) => r.skipped)} skipped`);
  const notes = results.filter((r) => verbose || !r.passed);
  if (notes.length) lines.push('');
  for (const r of notes) lines.push(`${verdict(r)} ${r.name}: ${r.message}`);
  return lines.join('\n');
}
