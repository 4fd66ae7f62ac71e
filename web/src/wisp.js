// Loads the wisp guest component in the page: the jco transpilation of the very .wasm the native
// host runs (web/dist, made by build.mjs), the WASI it needs from @bytecodealliance/preview2-shim,
// and the `wisp:llm/gpu` imports over WebGPU (gpu.js).
//
// With JSPI (WebAssembly.Suspending / WebAssembly.promising) the guest is the `jspi`
// transpilation and its gpu imports may await WebGPU. Without JSPI, or without a WebGPU adapter,
// the guest still runs, on its own CPU kernels: `gpu.available()` answers none.

import * as shim from '../dist/shim/index.js';
import { createGpu, openDevice } from './gpu.js';

const DIST = new URL('../dist/', import.meta.url);
const SHADER = new URL('../dist/shaders/matmul.wgsl', import.meta.url);

/** What this browser offers: JSPI, WebGPU (and why not). `jspi` and `webgpu` false turn either
 *  off, for tests and for comparison (`?jspi=off`, `?webgpu=off` on the page); `lanes` is
 *  passed to `openDevice`, and `maxBindingBytes` (a cap on one binding, for tests). */
export async function probe({ jspi = true, webgpu = true, lanes, maxBindingBytes } = {}) {
  const hasJspi = typeof WebAssembly.Suspending === 'function' && typeof WebAssembly.promising === 'function';
  const env = { jspi: hasJspi && jspi, jspiWhy: null, gpu: null, gpuWhy: null };
  if (!hasJspi) env.jspiWhy = 'this browser has no JSPI (WebAssembly.Suspending): the guest cannot wait for WebGPU';
  else if (!jspi) env.jspiWhy = 'JSPI turned off (?jspi=off)';
  if (!env.jspi) {
    env.gpuWhy = `no WebGPU for the guest: ${env.jspiWhy}`;
    return env;
  }
  if (!webgpu) {
    env.gpuWhy = 'WebGPU turned off (?webgpu=off)';
    return env;
  }
  const opened = await openDevice(SHADER, { lanes, maxBindingBytes });
  if (opened.device) env.gpu = opened;
  else env.gpuWhy = opened.why;
  return env;
}

/** The component's manifest (sha256 of the .wasm jco transpiled, jco version and flags). */
export async function manifest() {
  const res = await fetch(new URL('guest.json', DIST));
  if (!res.ok) throw new Error(`web/dist/guest.json: HTTP ${res.status} (run \`npm run build\` in web/)`);
  return res.json();
}

/** sha256 of the component file the page was given, computed in the page. */
export async function componentSha256() {
  const res = await fetch(new URL('wisp_guest.wasm', DIST));
  if (!res.ok) throw new Error(`web/dist/wisp_guest.wasm: HTTP ${res.status}`);
  const digest = await crypto.subtle.digest('SHA-256', await res.arrayBuffer());
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, '0')).join('');
}

/** The WASI imports of a component, from @bytecodealliance/preview2-shim's browser build. */
export function wasiImports() {
  const { cli, clocks, filesystem, io, random } = shim;
  return {
    'wasi:cli/environment': cli.environment,
    'wasi:cli/exit': cli.exit,
    'wasi:cli/stderr': cli.stderr,
    'wasi:cli/stdin': cli.stdin,
    'wasi:cli/stdout': cli.stdout,
    'wasi:cli/terminal-input': cli.terminalInput,
    'wasi:cli/terminal-output': cli.terminalOutput,
    'wasi:cli/terminal-stderr': cli.terminalStderr,
    'wasi:cli/terminal-stdin': cli.terminalStdin,
    'wasi:cli/terminal-stdout': cli.terminalStdout,
    'wasi:clocks/monotonic-clock': clocks.monotonicClock,
    'wasi:clocks/wall-clock': clocks.wallClock,
    'wasi:filesystem/preopens': filesystem.preopens,
    'wasi:filesystem/types': filesystem.types,
    'wasi:io/error': io.error,
    'wasi:io/poll': io.poll,
    'wasi:io/streams': io.streams,
    'wasi:random/insecure-seed': random.insecureSeed,
    'wasi:random/random': random.random,
  };
}

// The model file the guest reads, a piece at a time, through WASI: one preopened directory whose
// `model.gguf` is the bytes the page fetched, or a file in Cache Storage read as the guest asks
// (`cache.js`'s `cachedModel` in a worker): never the guest's memory. The guest copies only the
// pieces it reads; where the model's weights go to the WebGPU device, its memory stays far below
// the model's size.
const MODEL_DIR = '/wisp-model';
const modelDir = { dir: {} };
let modelDirAdded = false;

/** Makes `file` (bytes, or an object with `byteLength` and `slice(from, to)`) the file the
 *  guest opens at the path returned. */
export function modelFile(file) {
  if (!modelDirAdded) {
    shim.filesystem._addPreopen(MODEL_DIR, modelDir);
    modelDirAdded = true;
  }
  modelDir.dir['model.gguf'] = { source: file };
  return `${MODEL_DIR}/model.gguf`;
}

const modules = new Map();

/** A core module of a transpilation in dist/ (`variant` is its folder), compiled once. */
export function coreModule(variant, name) {
  const url = new URL(`${variant}/${name}`, DIST);
  if (!modules.has(url.href)) modules.set(url.href, WebAssembly.compileStreaming(fetch(url)));
  return modules.get(url.href);
}

/**
 * Instantiates the guest. Resolves to `{ engine, gpu, variant, memoryBytes }`: `engine` is the
 * component's `wisp:llm/engine` export (Model, Session), `gpu` what `createGpu` made for it,
 * `memoryBytes()` the size of the guest's linear memory now.
 */
export async function instantiate(env) {
  const variant = env.jspi ? 'jspi' : 'sync';
  const { instantiate: inst } = await import(new URL(`${variant}/wisp_guest.js`, DIST).href);
  const gpu = createGpu(env.gpu, env.gpuWhy ?? 'this host has no GPU');
  const imports = { ...wasiImports(), 'wisp:llm/gpu': gpu.imports };
  // The guest's memory is the one its core modules export (the others import it).
  const memories = [];
  const instantiateCore = async (module, imports) => {
    const instance = await WebAssembly.instantiate(module, imports);
    if (instance.exports.memory instanceof WebAssembly.Memory) memories.push(instance.exports.memory);
    return instance;
  };
  const root = await inst((name) => coreModule(variant, name), imports, instantiateCore);
  const memoryBytes = () => memories.reduce((n, m) => n + m.buffer.byteLength, 0);
  return { engine: root.engine, gpu, variant, memoryBytes };
}

/** An engine error (a ComponentError carrying the WIT `error` variant) as one line. */
export function describeError(e) {
  const p = e?.payload;
  if (p && typeof p === 'object' && 'tag' in p) return `${p.tag}: ${p.val}`;
  return e?.message ?? String(e);
}

/** Session stats with numbers instead of BigInts. */
export function stats(session) {
  const s = session.stats();
  return Object.fromEntries(Object.entries(s).map(([k, v]) => [k, Number(v)]));
}

/** The guest's calls must not interleave (a suspended call would be re-entered): one at a time. */
export class Serial {
  #tail = Promise.resolve();
  run(f) {
    const next = this.#tail.then(f, f);
    this.#tail = next.catch(() => {});
    return next;
  }
}
