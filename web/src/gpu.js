// The `wisp:llm/gpu` imports for one guest instance: the browser's counterpart of
// host/src/gpu/mod.rs. Everything the guest sends is checked here (handles, lengths, the
// device's limits, the instance's budget of bytes and handles; programs and their runs with
// program.js) before webgpu.js does the device work. Nothing the guest sends can throw: every
// result is `{ tag: 'ok' | 'err' }` with the WIT error variant, and a lost device makes every
// later call `device-lost`.
//
// `createGpu(opened)` (opened by `openDevice`) gives the import object over WebGPU;
// `createGpu(null, why)` the one of a host without a device (`available` is none, every call
// `unavailable`), synchronous so that it also serves a guest transpiled without JSPI. The
// conformance kit (conformance.js) runs against the same import object.

import { checkBatch, checkProgram, MAX_CACHES, MAX_SEQUENCES } from './program.js';
import { dataBytes, destroyWeight, FORMATS, GpuError, scaleCount, WebGpuBackend } from './webgpu.js';

export { openDevice } from './webgpu.js';

/** What one instance may hold, as the native host's `Budget::default()`. */
export const BUDGET = { bytes: 8n << 30n, handles: 4096 };

const ok = (val) => ({ tag: 'ok', val });
const err = (tag, message) => ({ tag: 'err', val: { tag, val: message } });
const invalid = (m) => err('invalid-argument', m);
const oom = (m) => err('out-of-memory', m);

/**
 * The import object of `wisp:llm/gpu` for one guest instance, over the device `openDevice`
 * opened, or without a device when `opened` has none (`why` says why); `budget` replaces
 * `BUDGET` (the conformance kit asks for a smaller one, that it can fill). Also returns the
 * instance's usage, the device's info, and a way to lose the device on purpose (for tests).
 */
export function createGpu(opened, why = 'this host has no GPU', { budget: limits = BUDGET } = {}) {
  if (!opened?.device) return noDevice(why);
  const backend = new WebGpuBackend(opened.device, opened.adapter, opened.shader, opened.lanes, opened.attention, opened.maxBindingBytes);
  const state = { usedBytes: 0n, usedHandles: 0, lost: null, programRuns: 0 };
  const handles = new WeakSet();
  const cacheHandles = new WeakSet();

  // A device error reported as the guest sees it; a loss sticks.
  const failure = (e) => {
    if (e instanceof GpuError) {
      if (e.tag === 'device-lost') state.lost = e.message;
      return err(e.tag, e.message);
    }
    return err('unavailable', `the device failed: ${e?.message ?? e}`);
  };

  // The `out-of-memory` error when one more handle of `bytes` would pass the instance's budget
  // (host/src/gpu/mod.rs's `budget_allows`), else null.
  const overBudget = (bytes) => {
    if (state.usedHandles >= limits.handles) return oom(`this instance holds its budget of ${limits.handles} handles`);
    if (state.usedBytes + bytes > limits.bytes) {
      return oom(`${bytes} more bytes exceed this instance's budget (${state.usedBytes} of ${limits.bytes} used)`);
    }
    return null;
  };

  const ready = () => {
    if (state.lost) return err('device-lost', state.lost);
    if (backend?.lost) {
      state.lost = backend.lost;
      return err('device-lost', state.lost);
    }
    return null;
  };

  class Weight {
    #w;
    #bytes;
    constructor(w, bytes) {
      this.#w = w;
      this.#bytes = bytes;
      handles.add(this);
    }

    static inner(weight) {
      return handles.has(weight) ? weight.#w : null;
    }

    rows() {
      return this.#w?.nOut ?? 0;
    }

    cols() {
      return this.#w?.nIn ?? 0;
    }

    format() {
      return this.#w?.format ?? 'f32';
    }

    async writeRows(firstRow, data, scales) {
      const bad = ready();
      if (bad) return bad;
      const w = this.#w;
      if (!w) return invalid('the weight was dropped');
      const rowData = w.rowBytes;
      if (data.length === 0 || data.length % rowData !== 0) {
        return invalid(`${data.length} bytes of data is not a whole number of ${rowData}-byte rows`);
      }
      const rows = data.length / rowData;
      if (scales.length !== rows * w.scaleRow) {
        return invalid(`${rows} rows of ${w.format} need ${rows * w.scaleRow} scales, got ${scales.length}`);
      }
      if (firstRow + rows > w.nOut) {
        return invalid(`rows ${firstRow}..${firstRow + rows} are past the weight's ${w.nOut} rows`);
      }
      try {
        await backend.writeRows(w, firstRow, data, scales);
        if (w.vector) w.vector.set(new Float32Array(data.slice().buffer));
        return ok(undefined);
      } catch (e) {
        return failure(e);
      }
    }

    [Symbol.dispose]() {
      if (!this.#w) return;
      destroyWeight(this.#w);
      this.#w = null;
      state.usedBytes -= this.#bytes;
      state.usedHandles -= 1;
    }
  }

  function available() {
    if (state.lost || backend.lost) return undefined;
    const i = backend.info;
    return {
      name: i.name,
      backend: i.backend,
      deviceType: i.deviceType,
      maxWeightBytes: BigInt(i.maxWeightBytes),
      maxActivationElements: BigInt(i.maxActivationElements),
      budgetBytes: limits.bytes - state.usedBytes,
      budgetHandles: limits.handles - state.usedHandles,
    };
  }

  async function allocate(format, nOut, nIn) {
    const bad = ready();
    if (bad) return bad;
    const f = FORMATS[format];
    if (!f) return invalid(`unknown format ${format}`);
    if (nOut === 0 || nIn === 0) return invalid(`empty weight [${nOut}, ${nIn}]`);
    if (BigInt(nIn) % f.block !== 0n) return invalid(`n-in ${nIn} is not a multiple of ${format}'s block of ${f.block}`);
    const n = BigInt(nOut) * BigInt(nIn);
    const data = dataBytes(format, n);
    if (data >= 1n << 64n) return invalid('weight size overflows');
    const bytes = data + 4n * scaleCount(format, n);
    if (data > BigInt(backend.info.maxWeightBytes)) {
      return oom(`a weight of ${data} bytes exceeds the device's limit of ${backend.info.maxWeightBytes}`);
    }
    const over = overBudget(bytes);
    if (over) return over;
    try {
      const w = await backend.create(format, nOut, nIn);
      state.usedBytes += bytes;
      state.usedHandles += 1;
      return ok(new Weight(w, bytes));
    } catch (e) {
      return failure(e);
    }
  }

  async function upload(format, nOut, nIn, data, scales) {
    const f = FORMATS[format];
    if (f) {
      const n = BigInt(nOut) * BigInt(nIn);
      const want = dataBytes(format, n);
      const wantScales = scaleCount(format, n);
      if (BigInt(data.length) !== want || BigInt(scales.length) !== wantScales) {
        return invalid(`a ${format} weight [${nOut}, ${nIn}] needs ${want} bytes and ${wantScales} scales, got ${data.length} and ${scales.length}`);
      }
    }
    const a = await allocate(format, nOut, nIn);
    if (a.tag === 'err') return a;
    const w = await a.val.writeRows(0, data, scales);
    if (w.tag === 'err') {
      a.val[Symbol.dispose]();
      return w;
    }
    return a;
  }

  class KvCache {
    #c;
    #bytes;
    constructor(c, bytes) {
      this.#c = c;
      this.#bytes = bytes;
      cacheHandles.add(this);
    }

    static inner(cache) {
      return cacheHandles.has(cache) ? cache.#c : null;
    }

    slots() {
      return this.#c?.slots ?? 0;
    }

    width() {
      return this.#c?.width ?? 0;
    }

    [Symbol.dispose]() {
      if (!this.#c) return;
      this.#c.k.destroy();
      this.#c.v.destroy();
      this.#c = null;
      state.usedBytes -= this.#bytes;
      state.usedHandles -= 1;
    }
  }

  async function createKvCache(slots, width) {
    const bad = ready();
    if (bad) return bad;
    if (slots === 0 || width === 0) return invalid(`empty kv-cache of ${slots} slots of ${width} values`);
    const half = BigInt(slots) * BigInt(width) * 4n;
    if (half > BigInt(backend.info.maxWeightBytes)) {
      return oom(`a kv-cache of ${half} bytes a half exceeds the device's limit of ${backend.info.maxWeightBytes}`);
    }
    const over = overBudget(2n * half);
    if (over) return over;
    try {
      const c = await backend.createCache(slots, width);
      state.usedBytes += 2n * half;
      state.usedHandles += 1;
      return ok(new KvCache(c, 2n * half));
    } catch (e) {
      return failure(e);
    }
  }

  // Programs (wit/gpu.wit's `program`): checked when made (program.js), run on the device
  // (webgpu.js's `runProgram`), each run's batch checked first.
  const programs = new WeakSet();
  class Program {
    #p;
    #weights;
    constructor(p, weights) {
      this.#p = p;
      this.#weights = weights;
      programs.add(this);
    }

    async run(inputs, batch) {
      const bad = ready();
      if (bad) return bad;
      const p = this.#p;
      if (!p || !programs.has(this)) return invalid('not a live program handle of this instance');
      const runs = [];
      for (let s = 0; s < Math.min(batch.length, MAX_SEQUENCES + 1); s++) {
        const q = batch[s];
        const caches = [];
        for (let c = 0; c < Math.min(q.caches.length, MAX_CACHES + 1); c++) {
          const k = KvCache.inner(q.caches[c]);
          if (!k) return invalid(`sequence ${s}: cache ${c} is not a live kv-cache handle of this instance`);
          caches.push(k);
        }
        runs.push({ rows: q.rows, start: q.start, caches });
      }
      if (batch.length > MAX_SEQUENCES) return invalid(`a batch of ${batch.length} sequences: 1 to ${MAX_SEQUENCES}`);
      const weights = this.#weights.map((h) => Weight.inner(h));
      const dropped = weights.findIndex((w) => !w);
      if (dropped >= 0) return invalid(`weight ${dropped} of the program was dropped`);
      const refused = checkBatch(p, inputs, runs, backend.info.maxActivationElements);
      if (refused) return err(refused[0], refused[1]);
      try {
        const outputs = await backend.runProgram(p, weights, inputs, runs);
        state.programRuns += 1;
        return ok(outputs);
      } catch (e) {
        return failure(e);
      }
    }

    ops() {
      return this.#p?.ops.length ?? 0;
    }

    [Symbol.dispose]() {
      if (!this.#p) return;
      this.#p = null;
      this.#weights = null;
      state.usedHandles -= 1;
    }
  }

  async function createProgram(weights, caches, ops) {
    const bad = ready();
    if (bad) return bad;
    if (weights.length > limits.handles) return invalid(`${weights.length} weights exceed the limit of ${limits.handles} a program`);
    const refs = [];
    for (let i = 0; i < weights.length; i++) {
      const w = Weight.inner(weights[i]);
      if (!w) return invalid(`weight ${i}: not a live weight handle of this instance`);
      refs.push({ nOut: w.nOut, nIn: w.nIn, format: w.format });
    }
    let p;
    try {
      p = checkProgram(ops, refs, caches);
    } catch (why) {
      return invalid(String(why));
    }
    const over = overBudget(0n);
    if (over) return over;
    try {
      await backend.prepareProgram(p, refs);
    } catch (e) {
      return failure(e);
    }
    state.usedHandles += 1;
    return ok(new Program(p, [...weights]));
  }

  return {
    imports: { Weight, KvCache, Program, available, upload, allocate, createKvCache, createProgram },
    /** Bytes and handles this instance holds on the device. */
    usage: () => ({ bytes: Number(state.usedBytes), handles: state.usedHandles }),
    /** Program runs that succeeded on this instance's device. */
    programRuns: () => state.programRuns,
    info: backend.info,
    why: null,
    simulateDeviceLoss: () => backend.simulateDeviceLoss(),
  };
}

/** The imports of a host without a device: synchronous, so that they also serve a guest
 *  transpiled without JSPI. */
function noDevice(why) {
  const unavailable = () => err('unavailable', why);
  class Weight {
    rows() { return 0; }
    cols() { return 0; }
    format() { return 'f32'; }
    writeRows() { return unavailable(); }
    [Symbol.dispose]() {}
  }
  return {
    imports: {
      Weight,
      available: () => undefined,
      upload: unavailable,
      allocate: unavailable,
      KvCache: class {
        slots() { return 0; }
        width() { return 0; }
        [Symbol.dispose]() {}
      },
      createKvCache: unavailable,
      Program: class {
        run() { return unavailable(); }
        ops() { return 0; }
        [Symbol.dispose]() {}
      },
      createProgram: unavailable,
    },
    usage: () => ({ bytes: 0, handles: 0 }),
    programRuns: () => 0,
    info: null,
    why,
    simulateDeviceLoss: () => {},
  };
}
