// Transpiles the guest component for the browser with jco, from the very bytes the native host
// runs (`target/guest/wasm32-wasip2/release/wisp_guest.wasm`, under $CARGO_TARGET_DIR when that is
// set, or $WISP_GUEST_WASM), and the conformance kit of the `gpu` interface beside it
// (`wisp_conformance.wasm` from the same build, or $WISP_CONFORMANCE_WASM).
//
// Output, in web/dist/ (not committed: it follows the guest):
//   wisp_guest.wasm  the component, copied byte for byte; jco transpiles this copy
//   jspi/            jco --async-mode jspi: the gpu imports suspend the guest (WebGPU is async)
//   sync/            jco without async: for browsers without JSPI, where the guest gets no device
//   conformance/     the kit: wisp_conformance.wasm (copied) and jspi/ (its JSPI transpilation,
//                    `run-suite` async); absent, with the reason in guest.json, without the file
//   shim/            @bytecodealliance/preview2-shim's browser build (the WASI the guest imports),
//                    copied so that the package's modules import nothing by a bare name
//   shaders/         the WGSL of ../shaders, which the WebGPU host compiles at run time
//   guest.json       sha256 and size of the component(s), the jco flags, sha256 of every output
//
// `node build.mjs [--quiet]` builds; `import { build } from './build.mjs'` does the same from a test.

import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { cpSync, existsSync, mkdirSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

export const WEB = dirname(fileURLToPath(import.meta.url));
export const ROOT = resolve(WEB, '..');
export const DIST = join(WEB, 'dist');
// Where host/build.rs has cargo build the guest: `<target dir>/guest/...`, the target dir being
// $CARGO_TARGET_DIR (relative to the workspace) or target/.
const TARGET = process.env.CARGO_TARGET_DIR ? resolve(ROOT, process.env.CARGO_TARGET_DIR) : join(ROOT, 'target');
export const GUEST_WASM = process.env.WISP_GUEST_WASM
  ? resolve(process.env.WISP_GUEST_WASM)
  : join(TARGET, 'guest/wasm32-wasip2/release/wisp_guest.wasm');
// The conformance kit (world `conformance` of wit/conformance.wit), built by the same host/build.rs.
export const KIT_WASM = process.env.WISP_CONFORMANCE_WASM
  ? resolve(process.env.WISP_CONFORMANCE_WASM)
  : join(TARGET, 'guest/wasm32-wasip2/release/wisp_conformance.wasm');

const GPU = 'wisp:llm/gpu@0.11.0';
const ENGINE = 'wisp:llm/engine@0.11.0';

// The gpu imports that return promises (WebGPU's error scopes, pipeline creation and readback
// are async). jco matches these names exactly; a name it does not find is ignored without a
// word, and the guest then receives a pending promise where it expects a value. `checkJspi`
// below fails the build when one the guest imports is not wrapped (the guest imports no
// `upload`: it uploads with allocate + write-rows).
export const ASYNC_IMPORTS = [
  `${GPU}#allocate`,
  `${GPU}#upload`,
  `${GPU}#create-kv-cache`,
  `${GPU}#[method]weight.write-rows`,
  `${GPU}#create-program`,
  `${GPU}#[method]program.run`,
];
// The engine exports that can reach an async import: loading (uploads and the dispatch
// calibration) and everything that runs a forward pass (feed, and next/logits/top, which run
// the pending token's pass; embed). The others stay synchronous.
export const ASYNC_EXPORTS = [
  `${ENGINE}#[static]model.open`,
  `${ENGINE}#[static]model.from-bytes`,
  `${ENGINE}#[method]session.feed`,
  `${ENGINE}#[method]session.next`,
  `${ENGINE}#[method]session.logits`,
  `${ENGINE}#[method]session.top`,
  `${ENGINE}#[method]model.embed`,
];
// The kit's one export: every case of the kit runs inside it, and most reach an async import.
// The kit imports the same gpu functions as the guest, `upload` included: ASYNC_IMPORTS serve.
export const KIT_ASYNC_EXPORTS = ['run-suite'];
// The gpu functions that answer at once (the device is opened before the guest starts).
const SYNC_IMPORTS = new Set(['available', 'rows', 'cols', 'format', 'slots', 'width', 'ops']);

export function sha256(bytes) {
  return createHash('sha256').update(bytes).digest('hex');
}

function jco(args) {
  const bin = join(WEB, 'node_modules/@bytecodealliance/jco/dist/jco.js');
  execFileSync(process.execPath, [bin, ...args], { cwd: WEB, stdio: ['ignore', 'ignore', 'inherit'] });
}

function jcoVersion() {
  return JSON.parse(readFileSync(join(WEB, 'node_modules/@bytecodealliance/jco/package.json'), 'utf8')).version;
}

// jco 1.35 emits `[static]` async exports as plain functions whose body awaits (a syntax error;
// `[method]` exports get `async function`). Marks those functions async, and checks that it did.
function fixStaticAsyncExports(js) {
  let fixed = 0;
  const out = js.replace(/^([ \t]*)(\w+)\.(\w+) = function (\w+)\(/gm, (all, indent, cls, name, fname, offset) => {
    const body = js.slice(offset, js.indexOf(`\n${indent}};`, offset));
    if (!/\bawait\b/.test(body)) return all;
    fixed += 1;
    return `${indent}${cls}.${name} = async function ${fname}(`;
  });
  return { js: out, fixed };
}

// The generated JS must wrap every gpu import the component uses in WebAssembly.Suspending (jco
// marks the host function `manuallyAsync`) where gpu.js answers with a promise (ASYNC_IMPORTS,
// whatever jco was asked for), and every export of `asyncExports` in WebAssembly.promising.
// Returns what is wrong.
export function checkJspi(js, { asyncExports = ASYNC_EXPORTS } = {}) {
  const problems = [];
  const imported = new Map();
  for (const m of js.matchAll(/^[ \t]*(_trampoline\d+)\.fnName = '([^']+)';(\n[ \t]*\1\.manuallyAsync = true;)?/gm)) {
    imported.set(m[2], Boolean(m[3]));
  }
  const camel = (name) => name.replace(/^\[method\]\w+\./, '').replace(/-(\w)/g, (_, c) => c.toUpperCase());
  const wanted = new Set(ASYNC_IMPORTS.map((n) => `${n.split('#')[0]}#${camel(n.split('#')[1])}`));
  for (const [name, async] of imported) {
    if (!name.startsWith(`${GPU}#`)) continue;
    if (wanted.has(name) && !async) problems.push(`async import ${name} is not marked async`);
    if (!wanted.has(name) && !SYNC_IMPORTS.has(name.split('#')[1])) {
      problems.push(`the guest imports ${name}, which is in neither ASYNC_IMPORTS nor SYNC_IMPORTS`);
    }
  }
  if (![...imported.keys()].some((n) => n === `${GPU}#createProgram`)) problems.push(`no trampoline for ${GPU}#createProgram was found`);
  for (const name of asyncExports) {
    if (!js.includes(`= WebAssembly.promising(exports1['${name}'])`)) problems.push(`async export ${name} is not promising`);
  }
  if (fixStaticAsyncExports(js).fixed > 0) problems.push('a non-async function awaits');
  return problems;
}

/**
 * Runs jco on `wasm` into `out` (`out/NAME.js` and its core modules): with `jspi`, in JSPI mode
 * with the given async imports and exports, the static exports made async and the output
 * checked (a throw lists what is missing). Returns how many static exports were fixed.
 */
export function transpile(wasm, out, { jspi, name = 'wisp_guest', asyncImports = ASYNC_IMPORTS, asyncExports = ASYNC_EXPORTS }) {
  const args = ['transpile', wasm, '-o', out, '--name', name, '--instantiation', 'async', '--no-typescript', '--quiet'];
  if (!jspi) {
    jco(args);
    return { fixed: 0 };
  }
  jco([...args, '--async-mode', 'jspi', '--async-imports', ...asyncImports, '--async-exports', ...asyncExports]);
  const file = join(out, `${name}.js`);
  const { js, fixed } = fixStaticAsyncExports(readFileSync(file, 'utf8'));
  writeFileSync(file, js);
  const problems = checkJspi(js, { asyncExports });
  if (problems.length) throw new Error(`jco's JSPI output is not what the browser host needs:\n  ${problems.join('\n  ')}`);
  return { fixed };
}

function filesUnder(dir) {
  const out = [];
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) out.push(...filesUnder(p));
    else out.push(p);
  }
  return out;
}

/**
 * Copies the kit into dist/conformance and transpiles it for JSPI (a browser without JSPI cannot
 * wait for WebGPU, so the kit has no other variant). Returns the kit's part of the manifest.
 */
function buildKit(kit) {
  if (!existsSync(kit)) {
    return { source: relative(ROOT, kit), missing: `${kit} is missing: build it first (cargo build --release -p wisp)` };
  }
  const bytes = readFileSync(kit);
  const dir = join(DIST, 'conformance');
  mkdirSync(dir, { recursive: true });
  const copy = join(dir, 'wisp_conformance.wasm');
  writeFileSync(copy, bytes);
  transpile(copy, join(dir, 'jspi'), { jspi: true, name: 'wisp_conformance', asyncExports: KIT_ASYNC_EXPORTS });
  return {
    source: relative(ROOT, kit),
    sha256: sha256(bytes),
    bytes: bytes.length,
    jspi: { asyncImports: ASYNC_IMPORTS, asyncExports: KIT_ASYNC_EXPORTS },
  };
}

/**
 * What the transpiled guest needs at run time besides itself, copied into dist/: the WASI shim's
 * browser build (its own files import each other by relative paths only) and the shaders.
 */
function copyRuntime() {
  const shim = join(WEB, 'node_modules/@bytecodealliance/preview2-shim');
  mkdirSync(join(DIST, 'shim'), { recursive: true });
  for (const f of readdirSync(join(shim, 'dist/browser')).filter((f) => f.endsWith('.js'))) {
    cpSync(join(shim, 'dist/browser', f), join(DIST, 'shim', f));
  }
  cpSync(join(shim, 'LICENSE'), join(DIST, 'shim', 'LICENSE'));
  mkdirSync(join(DIST, 'shaders'), { recursive: true });
  for (const f of readdirSync(join(ROOT, 'shaders')).filter((f) => f.endsWith('.wgsl'))) {
    cpSync(join(ROOT, 'shaders', f), join(DIST, 'shaders', f));
  }
}

/**
 * Transpiles the guest and the conformance kit into web/dist and returns the manifest written to
 * dist/guest.json (`conformance.missing` says why the kit is not there, when it is not).
 */
export function build({ wasm = GUEST_WASM, kit = KIT_WASM, quiet = false } = {}) {
  if (!existsSync(wasm)) {
    throw new Error(`${wasm} is missing: build the guest first (cargo build --release -p wisp)`);
  }
  const bytes = readFileSync(wasm);
  rmSync(DIST, { recursive: true, force: true });
  mkdirSync(DIST, { recursive: true });
  const copy = join(DIST, 'wisp_guest.wasm');
  writeFileSync(copy, bytes);

  const { fixed } = transpile(copy, join(DIST, 'jspi'), { jspi: true });
  transpile(copy, join(DIST, 'sync'), { jspi: false });
  const conformance = buildKit(kit);
  copyRuntime();

  const outputs = {};
  for (const f of filesUnder(DIST).sort()) {
    if (f.endsWith('guest.json')) continue;
    outputs[relative(DIST, f)] = sha256(readFileSync(f));
  }
  const manifest = {
    source: relative(ROOT, wasm),
    sha256: sha256(bytes),
    bytes: bytes.length,
    jco: jcoVersion(),
    jspi: { asyncImports: ASYNC_IMPORTS, asyncExports: ASYNC_EXPORTS, staticExportsMadeAsync: fixed },
    conformance,
    outputs,
  };
  writeFileSync(join(DIST, 'guest.json'), JSON.stringify(manifest, null, 2) + '\n');
  if (!quiet) {
    console.log(`transpiled ${manifest.source} (${bytes.length} bytes, sha256 ${manifest.sha256}) with jco ${manifest.jco} into ${relative(ROOT, DIST)}/{jspi,sync}`);
    if (conformance.missing) console.log(`not transpiled: the conformance kit (${conformance.missing})`);
    else console.log(`transpiled ${conformance.source} (${conformance.bytes} bytes, sha256 ${conformance.sha256}) into ${relative(ROOT, DIST)}/conformance/jspi`);
  }
  return manifest;
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  try {
    build({ quiet: process.argv.includes('--quiet') });
  } catch (e) {
    console.error(`build: ${e.message}`);
    process.exit(1);
  }
}
