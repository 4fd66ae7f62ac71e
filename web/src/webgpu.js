// Device work on WebGPU for the `wisp:llm/gpu` imports: the browser's counterpart of
// host/src/gpu/wgpu.rs, running the same shaders/matmul.wgsl (fetched at run time) with the same
// bind group layout, override constants (FORMAT, LANES_K), entry points and dispatch plan, and
// the same shaders/attention.wgsl for the `attention` op. `runProgram` records a whole run of a
// program in one command buffer, as host/src/gpu/wgpu/programs.rs does (without joint
// products); a program it cannot record runs op by op (program.js's `interpret`) over
// `product`, `writeCache` and `attend`.
//
// Weights live in storage buffers in their upload format (the shader decodes them); f32 and
// bf16 rows are padded with zeros to whole shader steps, and so are the rows of x. Values,
// inputs, outputs, staging and parameter buffers are kept and grown across runs. Every piece of
// device work runs inside error scopes: a validation or out-of-memory error becomes a
// `GpuError`; a lost device makes every later call `device-lost`. Arguments are checked by
// gpu.js and program.js before they get here.

import { attentionOver, hasNormWeight, interpret, topK } from './program.js';

/** Invocations in a workgroup (WG in the shader). */
const WORKGROUP = 64;
/** Rows of x at which `gemm` (4 rows of x per invocation) takes over from `gemv`. */
const GEMM_MIN_T = 4;
/** Weight rows an invocation of `gemm` computes (8 in the shader), and of `gemv` (4). */
const GEMM_ROWS = 8;
const GEMV_ROWS = 4;
/** Multiply-adds one dispatch may cover, so that no single dispatch runs for long. */
const DISPATCH_MACS = 2 ** 28;
/** Bytes of one `writeBuffer` of weights. */
const WRITE_CHUNK = 64 << 20;
/** Size of `Params` in the shader, and of `Shape` in attention.wgsl. */
const PARAMS_BYTES = 32;
/** matmul.wgsl's `Params`, field by field in order (layout_checks holds it to the Rust struct). */
const PARAMS_FIELDS = ['nIn', 'nOut', 't', 'rowQuads', 'scaleRow', 'rowBase', 'tBase', 'xStride'];
const T_FIELD = PARAMS_FIELDS.indexOf('t');
const T_BASE_FIELD = PARAMS_FIELDS.indexOf('tBase');
/** A dispatch's parameters from their names (a field not named is 0). */
const paramsOf = (named) => PARAMS_FIELDS.map((f) => named[f] ?? 0);
const SHAPE_BYTES = 64;
// The most parts a weight past one binding is held in: the device's maxWeightBytes is that many
// bindings (as host/src/gpu/wgpu.rs's MAX_WEIGHT_PARTS).
const MAX_WEIGHT_PARTS = 64;
// matmul.wgsl's X_ACT (how a product reads x: 0 as it is; 1, 2 act(gate) * up, GELU or SiLU).
// This host's programs use `none` alone; layout_checks holds the spellings to the native
// host's all the same.
const X_ACT = { none: 0, gelu_tanh: 1, silu: 2 };
/** elementwise_rows's op codes (OP_* in the shader; programs.rs's too). */
const OP_ADD = 0;
const OP_MUL = 1;
const OP_SCALE = 2;
const OP_BIAS = 3;
const OP_GELU_TANH = 4;
const OP_SILU = 5;
const OP_SOFTCAP = 6;
/** rms_norm_runs's flags (NORM_OP_* in the shader). */
const NORM_OP_WEIGHT = 1;
const NORM_OP_ADD = 2;
const NORM_OP_ROTATE = 4;
const NORM_OP_PAIRS = 8;
// The native recorder's fusion of a norm, the add after it and the norm after that (this host
// fuses pairs alone); layout_checks holds the spelling all the same.
const NORM_OP_NEXT = 16;

/** The upload formats of `wit/gpu.wit`: FORMAT in the shader, elements per scale block. */
export const FORMATS = {
  f32: { id: 0, block: 1n },
  bf16: { id: 1, block: 1n },
  q8x32: { id: 2, block: 32n },
  q8x16: { id: 3, block: 16n },
  q4x32: { id: 4, block: 32n },
};

/** Bytes of `data` for `n` elements (a BigInt). */
export function dataBytes(format, n) {
  switch (format) {
    case 'f32': return n * 4n;
    case 'bf16': return n * 2n;
    case 'q8x32': case 'q8x16': return n;
    default: return n / 2n;
  }
}

/** f32 values in `scales` for `n` elements. */
export function scaleCount(format, n) {
  switch (format) {
    case 'q8x32': return n / 32n;
    case 'q8x16': case 'q4x32': return n / 16n;
    default: return 0n;
  }
}

/** Frees a weight's buffers (each part's, for a weight held in parts). */
export function destroyWeight(w) {
  w.data?.destroy();
  w.scales?.destroy();
  for (const p of w.parts ?? []) destroyWeight(p.w);
}

/** A device failure, tagged as the WIT `gpu.error` case it becomes. */
export class GpuError extends Error {
  constructor(tag, message) {
    super(message);
    this.tag = tag;
  }
}

const alignUp = (n, a) => Math.ceil(n / a) * a;
/** The bits of `f` as an f32, for a u32 parameter the shader bitcasts back. */
const f32Bits = (f) => new Uint32Array(new Float32Array([f]).buffer)[0];

/** What each op of program `p` fuses with the next, as host/src/gpu/wgpu/programs.rs's
 *  `fusions` says (the host's business, not the contract's): an rms-norm whose value only the
 *  next op reads, when that op adds it to another value (`{ add: other }`) or turns its heads
 *  (`{ table, pairs }`), is one `rms_norm_runs` (NORM_OP_ADD, NORM_OP_ROTATE); null otherwise. */
function programFusions(p) {
  return p.ops.map((op, i) => {
    const next = p.ops[i + 1];
    if (op.tag !== 'rms-norm' || !next || p.lastUse[i] !== i + 1) return null;
    const v = next.val;
    if ((next.tag === 'add') && ((v[0] === i) !== (v[1] === i))) return { add: v[0] === i ? v[1] : v[0] };
    // (Not where the table is the norm's own value: the fused kernel never makes that.)
    if (next.tag === 'rotate' && v.x === i && v.table !== i && v.headDim === op.val.group) return { table: v.table, pairs: v.rotation === 'pairs' };
    return null;
  });
}

/** The slot of each value of program `p` (-1 for ops that make none) and the bytes of each
 *  slot (`size(i)` the bytes of value i, each slot a multiple of 16), as
 *  host/src/gpu/wgpu/programs.rs's `layout` gives them without joint products: the inputs
 *  first, each in a slot of its own (they are written before anything runs), then each other
 *  value in the first slot whose value has had its last reader before it. */
function programSlots(p, fuse, size) {
  const slot = new Array(p.ops.length).fill(-1);
  const held = [];
  const inputs = [];
  const others = [];
  p.ops.forEach((op, i) => {
    // The value of a fused pair is born at its first op: it never takes that op's operand's slot.
    if (op.tag === 'input') inputs.push([0, i]);
    else if (p.shapes[i]) others.push([i > 0 && fuse[i - 1] ? i - 1 : i, i]);
  });
  for (const [born, i] of [...inputs, ...others]) {
    const bytes = alignUp(Math.max(size(i), 16), 16);
    const s = held.findIndex((h) => h.until < born);
    if (s >= 0) {
      held[s] = { bytes: Math.max(held[s].bytes, bytes), until: p.lastUse[i] };
      slot[i] = s;
    } else {
      held.push({ bytes, until: p.lastUse[i] });
      slot[i] = held.length - 1;
    }
  }
  return { slot, bytes: held.map((h) => h.bytes) };
}
// A dispatch's pipeline in a `pipelinesFor` map: its kernel and format.
const pipelineKey = (d) => `${d.kernel} ${d.format}`;

/** What the adapter is, for `device-info` and the choice of LANES_K. */
export function describeAdapter(adapter) {
  const info = adapter.info || {};
  const name = [info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(' ') || 'WebGPU adapter';
  // WebGPU does not say what kind of device it is; a fallback adapter (SwiftShader) runs on the
  // CPU. Other adapters are "other": the guest's policy measures them anyway.
  const cpu = Boolean(info.isFallbackAdapter) || /swiftshader|llvmpipe|lavapipe/i.test(name);
  return { name, deviceType: cpu ? 'cpu' : 'other' };
}

/**
 * Opens a WebGPU device with the adapter's own limits for buffers (the defaults would cap a
 * storage binding at 128 MiB). Resolves to `{ device, adapter, shader, lanes }`, or `{ why }`
 * when there is no usable device. `lanes` (a power of two up to 64) sets LANES_K of `gemv`
 * instead of the choice by device type.
 */
export async function openDevice(shaderUrl, { lanes, maxBindingBytes } = {}) {
  if (lanes !== undefined && !(Number.isInteger(lanes) && lanes >= 1 && lanes <= WORKGROUP && (lanes & (lanes - 1)) === 0)) {
    return { why: `${lanes} lanes a row: not a power of two up to ${WORKGROUP}` };
  }
  if (maxBindingBytes !== undefined && !(Number.isInteger(maxBindingBytes) && maxBindingBytes >= 1 << 16)) {
    return { why: `a binding of ${maxBindingBytes} bytes: not a whole number of at least 65536` };
  }
  if (!globalThis.navigator?.gpu) return { why: 'this browser has no WebGPU (navigator.gpu is missing)' };
  let adapter;
  try {
    adapter = await navigator.gpu.requestAdapter();
  } catch (e) {
    return { why: `requestAdapter failed: ${e.message}` };
  }
  if (!adapter) return { why: 'WebGPU found no adapter' };
  const l = adapter.limits;
  if (l.maxStorageBuffersPerShaderStage < 4 || l.maxComputeInvocationsPerWorkgroup < WORKGROUP || l.maxComputeWorkgroupSizeX < WORKGROUP) {
    return { why: 'the WebGPU adapter cannot run the matmul shader (limits)' };
  }
  let device;
  try {
    device = await adapter.requestDevice({
      label: 'wisp',
      requiredLimits: {
        maxStorageBufferBindingSize: l.maxStorageBufferBindingSize,
        maxBufferSize: l.maxBufferSize,
        maxStorageBuffersPerShaderStage: 4,
      },
    });
  } catch (e) {
    return { why: `requestDevice failed: ${e.message}` };
  }
  const res = await fetch(shaderUrl);
  if (!res.ok) return { why: `fetching ${shaderUrl}: HTTP ${res.status}` };
  const shader = await res.text();
  // attention.wgsl beside it; without it the host still runs programs without attention (one
  // with an `attention` op is `unavailable`, and the guest attends on its CPU).
  const attentionUrl = new URL('attention.wgsl', new URL(shaderUrl, globalThis.location?.href));
  const attention = await fetch(attentionUrl).then((r) => (r.ok ? r.text() : null), () => null);
  return { device, adapter, shader, lanes, attention, maxBindingBytes };
}

/** The WebGPU work behind the imports, on one device. */
export class WebGpuBackend {
  constructor(device, adapter, shader, lanes, attentionShader = null, maxBindingBytes = Infinity) {
    this.device = device;
    this.limits = device.limits;
    const { name, deviceType } = describeAdapter(adapter);
    this.lost = null;
    this.uncaptured = null;
    device.lost.then((info) => { this.lost ??= `${info.reason}: ${info.message}`; });
    device.addEventListener('uncapturederror', (e) => { this.uncaptured = e.error.message; });
    const maxBinding = Math.min(this.limits.maxStorageBufferBindingSize, this.limits.maxBufferSize, maxBindingBytes) & ~3;
    // The most bytes one binding (a part of a weight, a value, a cache half) may span; a weight
    // past it is held in parts of whole rows (`create`).
    this.maxBinding = maxBinding;
    this.info = {
      name,
      backend: 'webgpu',
      deviceType,
      maxWeightBytes: maxBinding * MAX_WEIGHT_PARTS,
      maxActivationElements: Math.floor(maxBinding / 4),
    };
    // A CPU device runs an invocation per SIMD lane: one row each is best there, and keeps the
    // barrier out (on SwiftShader 1 lane is 1.8x faster than 8 and 4x faster than 32). A GPU
    // shares a row among a warp's worth, for coalesced reads. `lanes` overrides the choice.
    this.lanesK = lanes || (deviceType === 'cpu' ? 1 : 32);
    this.shader = shader;
    this.attentionShader = attentionShader;
    this.attentionPipeline = null;
    this.module = null;
    this.pipelines = new Map();
    this.scratch = {};
    this.storageAlign = Math.max(this.limits.minStorageBufferOffsetAlignment, 4);
    this.paramsStride = alignUp(PARAMS_BYTES, Math.max(this.limits.minUniformBufferOffsetAlignment, 4));

    const storage = (binding, readOnly, min) => ({
      binding,
      visibility: GPUShaderStage.COMPUTE,
      buffer: { type: readOnly ? 'read-only-storage' : 'storage', minBindingSize: min },
    });
    this.bindLayout = device.createBindGroupLayout({
      label: 'matmul',
      entries: [
        { binding: 0, visibility: GPUShaderStage.COMPUTE, buffer: { type: 'uniform', hasDynamicOffset: true, minBindingSize: PARAMS_BYTES } },
        storage(1, true, 16),
        storage(2, true, 4),
        storage(3, true, 16),
        storage(4, false, 4),
      ],
    });
    this.pipelineLayout = device.createPipelineLayout({ label: 'matmul', bindGroupLayouts: [this.bindLayout] });
    this.placeholder = device.createBuffer({ label: 'scales placeholder', size: 4, usage: GPUBufferUsage.STORAGE });
  }

  live() {
    if (this.lost) throw new GpuError('device-lost', this.lost);
  }

  pushScopes() {
    this.device.pushErrorScope('internal');
    this.device.pushErrorScope('out-of-memory');
    this.device.pushErrorScope('validation');
  }

  /** Runs `work` (which may be async) inside error scopes: resolves to its result, or throws the
   *  first error the scopes caught, or the one `work` threw (the scopes are popped either way). */
  async scoped(work) {
    this.pushScopes();
    let result;
    try {
      result = await work();
    } catch (e) {
      await this.finish().catch(() => {});
      throw e instanceof GpuError ? e : new GpuError('unavailable', `the device refused the work: ${e.message}`);
    }
    await this.finish();
    return result;
  }

  /** Pops the scopes (innermost first) and throws the first error they caught, a loss in the
   *  meantime, or an uncaptured error. */
  async finish() {
    let first = null;
    for (let i = 0; i < 3; i++) {
      let e = null;
      try {
        e = await this.device.popErrorScope();
      } catch (x) {
        e = x;
      }
      first ??= e;
    }
    this.live();
    if (first) {
      if (typeof GPUOutOfMemoryError !== 'undefined' && first instanceof GPUOutOfMemoryError) {
        throw new GpuError('out-of-memory', 'the device is out of memory');
      }
      throw new GpuError('unavailable', `the device refused the work: ${first.message}`);
    }
    if (this.uncaptured) {
      const m = this.uncaptured;
      this.uncaptured = null;
      throw new GpuError('unavailable', `the device refused the work: ${m}`);
    }
  }

  /** The pipeline of `kernel` for weights in `format` (products read x as it is). */
  async pipeline(kernel, format) {
    const key = `${kernel} ${format}`;
    const cached = this.pipelines.get(key);
    if (cached) return cached;
    let pipeline;
    try {
      pipeline = await this.scoped(() => {
        this.module ??= this.device.createShaderModule({ label: 'matmul.wgsl', code: this.shader });
        return this.device.createComputePipelineAsync({
          label: `matmul ${kernel} ${format}`,
          layout: this.pipelineLayout,
          compute: {
            module: this.module,
            entryPoint: kernel,
            constants: {
              FORMAT: FORMATS[format].id,
              LANES_K: this.lanesK,
              X_ACT: X_ACT.none,
              X_ALIGN: Math.max(this.storageAlign, 16) / 4,
            },
          },
        });
      });
    } catch (e) {
      // A module that failed to build is not kept either.
      this.module = null;
      throw e;
    }
    this.pipelines.set(key, pipeline);
    return pipeline;
  }

  /** A buffer of at least `size` bytes in scratch slot `slot`, grown to a power of two. */
  ensure(slot, size, usage) {
    const b = this.scratch[slot];
    if (b && b.size >= size) return b;
    b?.destroy();
    const cap = this.limits.maxBufferSize;
    const grown = Math.max(size, Math.min(cap, 2 ** Math.ceil(Math.log2(Math.max(size, 4)))));
    const nb = this.device.createBuffer({ label: slot, size: alignUp(grown, 4), usage });
    this.scratch[slot] = nb;
    return nb;
  }

  dropScratch() {
    for (const b of Object.values(this.scratch)) b?.destroy();
    this.scratch = {};
  }

  async create(format, nOut, nIn) {
    this.live();
    const rowBytes = Number(dataBytes(format, BigInt(nIn)));
    // A row is a whole number of shader steps: 8 elements for f32 and bf16 (32 and 16 bytes),
    // a multiple of 16 bytes already for the block formats.
    const step = format === 'f32' ? 32 : 16;
    const rowQuads = (Math.ceil(rowBytes / step) * step) / 16;
    const size = rowQuads * 16 * nOut;
    const scaleRow = Number(scaleCount(format, BigInt(nIn)));
    const scaleBytes = scaleRow * 4 * nOut;
    // Past one binding, the rows go in parts of what one binding holds.
    const perPart = Math.floor(this.maxBinding / Math.max(rowQuads * 16, scaleRow * 4, 1));
    const max = perPart > 0 ? this.info.maxWeightBytes : this.maxBinding;
    if (size > max || scaleBytes > max) {
      throw new GpuError('out-of-memory', `a ${format} weight [${nOut}, ${nIn}] needs a buffer of ${size} bytes; the device's limit is ${max}`);
    }
    if (Math.max(size, scaleBytes) > this.maxBinding) return this.createParts(format, nOut, nIn, perPart);
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST;
    let data = null;
    let scales = null;
    try {
      await this.scoped(() => {
        data = this.device.createBuffer({ label: 'weights', size, usage });
        if (scaleBytes > 0) scales = this.device.createBuffer({ label: 'scales', size: scaleBytes, usage });
      });
    } catch (e) {
      data?.destroy();
      scales?.destroy();
      throw e;
    }
    // An f32 vector's values (zeros until written) for programs run op by op (biases, norms).
    const vector = format === 'f32' && nOut === 1 ? new Float32Array(nIn) : undefined;
    return { format, nOut, nIn, rowBytes, rowQuads, scaleRow, data, scales, vector };
  }

  /** A weight [nOut, nIn] of `perPart` rows a part (the last holds the rest): `parts` of
   *  `{ w, first }`, each a weight of its own; nothing is left where one fails. */
  async createParts(format, nOut, nIn, perPart) {
    const parts = [];
    try {
      for (let first = 0; first < nOut; first += perPart) parts.push({ w: await this.create(format, Math.min(perPart, nOut - first), nIn), first });
    } catch (e) {
      for (const p of parts) destroyWeight(p.w);
      throw e;
    }
    const { rowBytes, rowQuads, scaleRow } = parts[0].w;
    return { format, nOut, nIn, rowBytes, rowQuads, scaleRow, data: null, scales: null, parts };
  }

  async writeRows(w, firstRow, data, scales) {
    this.live();
    const rows = data.length / w.rowBytes;
    if (w.parts) {
      // Each part's share of the rows.
      for (const [i, { w: part, first }] of w.parts.entries()) {
        const stop = w.parts[i + 1]?.first ?? w.nOut;
        const lo = Math.max(first, firstRow);
        const hi = Math.min(stop, firstRow + rows);
        if (lo >= hi) continue;
        const [a, b] = [lo - firstRow, hi - firstRow];
        await this.writeRows(part, lo - first, data.subarray(a * w.rowBytes, b * w.rowBytes), scales.subarray(a * w.scaleRow, b * w.scaleRow));
      }
      return;
    }
    const stride = w.rowQuads * 16;
    const perChunk = Math.max(1, Math.floor(WRITE_CHUNK / stride));
    await this.scoped(() => {
      for (let r = 0; r < rows; r += perChunk) {
        const n = Math.min(perChunk, rows - r);
        const src = data.subarray(r * w.rowBytes, (r + n) * w.rowBytes);
        let bytes = src;
        if (stride !== w.rowBytes) {
          // Rows that are not whole steps (f32, bf16) are padded with zeros.
          bytes = new Uint8Array(n * stride);
          for (let i = 0; i < n; i++) bytes.set(src.subarray(i * w.rowBytes, (i + 1) * w.rowBytes), i * stride);
        }
        this.device.queue.writeBuffer(w.data, (firstRow + r) * stride, bytes);
        if (w.scales) {
          const s = scales.subarray(r * w.scaleRow, (r + n) * w.scaleRow);
          this.device.queue.writeBuffer(w.scales, (firstRow + r) * w.scaleRow * 4, s);
        }
      }
    });
  }

  /** The dispatches of one job: `gemv` for small t, `gemm` otherwise; split so that no
   *  dispatch exceeds the workgroups per dimension or DISPATCH_MACS. */
  plan(job, w, t, xQuads, out) {
    const [kernel, rowsPerGroup, tPerGroup] = t < GEMM_MIN_T
      ? ['gemv', (GEMV_ROWS * WORKGROUP) / this.lanesK, 1]
      : ['gemm', GEMM_ROWS * WORKGROUP, 4];
    const maxDim = Math.max(1, this.limits.maxComputeWorkgroupsPerDimension);
    const gxTotal = Math.ceil(w.nOut / rowsPerGroup);
    const gyTotal = Math.ceil(t / tPerGroup);
    const macsPerGroup = rowsPerGroup * tPerGroup * w.nIn;
    const budget = Math.max(1, Math.floor(DISPATCH_MACS / macsPerGroup));
    const gx = Math.max(1, Math.min(gxTotal, maxDim, budget));
    const gy = Math.min(gyTotal, maxDim, Math.max(1, Math.floor(budget / gx)));
    for (let y0 = 0; y0 < gyTotal; y0 += gy) {
      const ny = Math.min(gy, gyTotal - y0);
      for (let x0 = 0; x0 < gxTotal; x0 += gx) {
        const nx = Math.min(gx, gxTotal - x0);
        const params = paramsOf({ nIn: w.nIn, nOut: w.nOut, t, rowQuads: w.rowQuads, scaleRow: w.scaleRow, rowBase: x0 * rowsPerGroup, tBase: y0 * tPerGroup, xStride: xQuads });
        out.push({ job, kernel, format: w.format, params, groups: [nx, ny] });
      }
    }
  }

  /** `y[t, n-out] = x[t, n-in] @ W^T` for one weight: a product of a program run op by op
   *  (`interpret`). x written once (rows padded with zeros to whole shader steps of 8), one
   *  submission, one readback. */
  async product(x, t, w) {
    this.live();
    if (w.parts) {
      // Each part's product, its columns placed in the whole's.
      const y = new Float32Array(t * w.nOut);
      for (const { w: part, first } of w.parts) {
        const got = await this.product(x, t, part);
        for (let r = 0; r < t; r++) y.set(got.subarray(r * part.nOut, (r + 1) * part.nOut), r * w.nOut + first);
      }
      return y;
    }
    const xElems = Math.ceil(w.nIn / 8) * 8;
    const xBytes = t * xElems * 4;
    const outBytes = t * w.nOut * 4;
    if (xBytes > this.maxBinding || outBytes > this.maxBinding) {
      throw new GpuError('out-of-memory', `a product over [${t}, ${w.nIn}] needs buffers past the device's limit`);
    }
    await this.writeInput(x, t, w.nIn, xElems);
    const [output] = await this.buffers([['output', outBytes, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC]]);
    const dispatches = [];
    this.plan(0, w, t, xElems / 4, dispatches);
    const step = { weights: w.data, scales: w.scales || this.placeholder, input: [this.scratch.input, xBytes], output: [output, 0, outBytes] };
    const [y] = await this.submit([step], dispatches, output, [[0, t * w.nOut]]);
    return y;
  }

  /** Writes x[t, nIn] to the input buffer, each row padded with zeros to xElems. */
  async writeInput(x, t, nIn, xElems) {
    try {
      await this.scoped(() => {
        const input = this.ensure('input', t * xElems * 4, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST);
        if (xElems === nIn) {
          this.device.queue.writeBuffer(input, 0, x);
        } else {
          const padded = new Float32Array(t * xElems);
          for (let r = 0; r < t; r++) padded.set(x.subarray(r * nIn, (r + 1) * nIn), r * xElems);
          this.device.queue.writeBuffer(input, 0, padded);
        }
      });
    } catch (e) {
      this.dropScratch();
      throw e;
    }
  }

  /** Scratch buffers of at least the given sizes, made inside error scopes. */
  async buffers(sizes) {
    try {
      return await this.scoped(() => sizes.map(([slot, size, usage]) => this.ensure(slot, size, usage)));
    } catch (e) {
      this.dropScratch();
      throw e;
    }
  }

  /** The pipeline of each dispatch's kernel and format, by `${kernel} ${format}`. */
  async pipelinesFor(dispatches) {
    const pipelines = new Map();
    for (const d of dispatches) {
      const key = pipelineKey(d);
      if (!pipelines.has(key)) pipelines.set(key, await this.pipeline(d.kernel, d.format));
    }
    return pipelines;
  }

  /** Writes each dispatch's parameters (a `paramsStride` each) into the scratch buffer `slot`
   *  and makes a bind group of matmul.wgsl's layout for each step: `weights`, `scales` (a
   *  buffer, or [buffer, bytes]), `input` ([buffer, bytes]) and `output` ([buffer, offset,
   *  bytes]). Inside error scopes. */
  matmulGroups(slot, dispatches, steps) {
    const paramsBytes = this.paramsStride * dispatches.length;
    const paramsBuf = this.ensure(slot, paramsBytes, GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST);
    const params = new Uint32Array(paramsBytes / 4);
    dispatches.forEach((d, i) => params.set(d.params, (i * this.paramsStride) / 4));
    this.device.queue.writeBuffer(paramsBuf, 0, params);
    return steps.map((st) => this.device.createBindGroup({
      label: 'matmul',
      layout: this.bindLayout,
      entries: [
        { binding: 0, resource: { buffer: paramsBuf, offset: 0, size: PARAMS_BYTES } },
        { binding: 1, resource: { buffer: st.weights } },
        { binding: 2, resource: Array.isArray(st.scales) ? { buffer: st.scales[0], size: st.scales[1] } : { buffer: st.scales } },
        { binding: 3, resource: { buffer: st.input[0], size: st.input[1] } },
        { binding: 4, resource: { buffer: st.output[0], offset: st.output[1], size: st.output[2] } },
      ],
    }));
  }

  /** Records `dispatches` (each with step d.job's bind group) in one compute pass, copies
   *  `output` to the staging buffer and reads back each `[byte offset, values]` of `reads`. */
  async submit(steps, dispatches, output, reads) {
    const outBytes = Math.max(...reads.map(([o, n]) => o + 4 * n));
    const pipelines = await this.pipelinesFor(dispatches);

    try {
      return await this.scoped(async () => {
        const usage = GPUBufferUsage;
        const staging = this.ensure('staging', outBytes, usage.MAP_READ | usage.COPY_DST);
        const groups = this.matmulGroups('params', dispatches, steps);
        const encoder = this.device.createCommandEncoder({ label: 'matmul' });
        const pass = encoder.beginComputePass({ label: 'matmul' });
        dispatches.forEach((d, i) => {
          pass.setPipeline(pipelines.get(pipelineKey(d)));
          pass.setBindGroup(0, groups[d.job], [i * this.paramsStride]);
          pass.dispatchWorkgroups(d.groups[0], d.groups[1], 1);
        });
        pass.end();
        encoder.copyBufferToBuffer(output, 0, staging, 0, outBytes);
        this.device.queue.submit([encoder.finish()]);

        return this.readBack(staging, outBytes, reads);
      });
    } catch (e) {
      // Start the next call from fresh buffers: these may be left invalid.
      this.dropScratch();
      throw e;
    }
  }

  /** shaders/attention.wgsl's pipeline and bind group layout, built on first use. */
  async attentionKernel() {
    if (this.attentionPipeline) return this.attentionPipeline;
    if (!this.attentionShader) throw new GpuError('unavailable', 'this host could not load shaders/attention.wgsl');
    const entry = (binding, type, hasDynamicOffset = false) => ({ binding, visibility: GPUShaderStage.COMPUTE, buffer: { type, hasDynamicOffset } });
    this.attentionPipeline = await this.scoped(async () => {
      const layout = this.device.createBindGroupLayout({
        label: 'attention',
        entries: [entry(0, 'uniform', true), entry(1, 'read-only-storage'), entry(2, 'read-only-storage'), entry(3, 'read-only-storage'), entry(4, 'storage')],
      });
      const module = this.device.createShaderModule({ label: 'attention.wgsl', code: this.attentionShader });
      const pipelineLayout = this.device.createPipelineLayout({ label: 'attention', bindGroupLayouts: [layout] });
      const entryPoint = (name) => this.device.createComputePipelineAsync({
        label: name,
        layout: pipelineLayout,
        compute: { module, entryPoint: name },
      });
      const [pipeline, merge] = await Promise.all([entryPoint('attend'), entryPoint('attend_merge')]);
      return { layout, pipeline, merge };
    });
    return this.attentionPipeline;
  }

  /** A zeroed `kv-cache` of `slots` rows of `width` values: `{ slots, width, k, v }`. */
  async createCache(slots, width) {
    this.live();
    const size = slots * width * 4;
    if (size > this.maxBinding) throw new GpuError('out-of-memory', `a kv-cache half of ${size} bytes does not fit the device`);
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST;
    let k = null;
    let v = null;
    try {
      await this.scoped(() => {
        k = this.device.createBuffer({ label: 'kv-cache keys', size, usage });
        v = this.device.createBuffer({ label: 'kv-cache values', size, usage });
      });
    } catch (e) {
      k?.destroy();
      v?.destroy();
      throw e;
    }
    return { slots, width, k, v };
  }

  /** The dispatches of attention of shape `s` over a ring of `slots` rows whose key 0 is row
   *  `firstSlot`, `qLen` query values: the queries split over dispatches and the keys into runs
   *  as host/src/gpu/wgpu/attention.rs's `attention_plan` does. */
  attentionPlan(qLen, s, firstSlot, slots) {
    const qBytes = qLen * 4;
    if (qBytes > this.maxBinding) throw new GpuError('out-of-memory', `${qLen} queries do not fit the device`);
    const maxDim = Math.max(1, this.limits.maxComputeWorkgroupsPerDimension);
    if (s.nHead > maxDim) throw new GpuError('out-of-memory', `${s.nHead} heads exceed the device's ${maxDim} workgroups`);
    const macs = 2 * s.nHead * s.nKeys * s.headDim;
    const perDispatch = Math.max(1, Math.min(maxDim, Math.floor(DISPATCH_MACS / Math.max(macs, 1))));
    const dispatches = Math.ceil(s.t / perDispatch);
    // Each query's keys in runs of whole units of 16, enough for about 1024 workgroups, at
    // most 64 runs (as `splits_for` in host/src/gpu/wgpu/attention.rs); with more than one,
    // partials follow the outputs in `out` and `attend_merge` combines them.
    const chunks = Math.max(1, Math.ceil(s.nKeys / 16));
    const want = Math.min(64, Math.max(1, Math.floor(1024 / Math.max(1, s.t * s.nHead))));
    const splitLen = Math.ceil(chunks / Math.min(want, chunks)) * 16;
    const splits = Math.max(1, Math.ceil(s.nKeys / splitLen));
    const outBytes = qBytes + (splits > 1 ? 4 * s.t * s.nHead * splits * (s.headDim + 2) : 0);
    if (outBytes > this.maxBinding) throw new GpuError('out-of-memory', `attention's partial sums of ${outBytes} bytes do not fit the device`);
    const stride = alignUp(SHAPE_BYTES, Math.max(this.limits.minUniformBufferOffsetAlignment, 4));
    const shapes = new ArrayBuffer(stride * dispatches);
    for (let d = 0; d < dispatches; d++) {
      const u = new Uint32Array(shapes, d * stride, SHAPE_BYTES / 4);
      u.set([s.t, s.nKeys, s.nHead, s.nHeadKv, s.headDim, s.window, 0, d * perDispatch, firstSlot, slots, splits, splitLen]);
      new Float32Array(shapes, d * stride + 24, 1)[0] = s.scale;
      new Float32Array(shapes, d * stride + 48, 1)[0] = s.softcap ?? 0;
    }
    return { shapes, stride, perDispatch, dispatches, splits, t: s.t, nHead: s.nHead, qBytes, outBytes };
  }

  /** Records `plan`'s dispatches in `pass`, its parameters at byte `at` of the group's
   *  parameter buffer. */
  recordAttention(pass, plan, kernels, group, at) {
    const { pipeline, merge } = kernels;
    for (const [p, z] of plan.splits > 1 ? [[pipeline, plan.splits], [merge, 1]] : [[pipeline, 1]]) {
      pass.setPipeline(p);
      for (let d = 0; d < plan.dispatches; d++) {
        pass.setBindGroup(0, group, [at + d * plan.stride]);
        pass.dispatchWorkgroups(plan.nHead, Math.min(plan.perDispatch, plan.t - d * plan.perDispatch), z);
      }
    }
  }

  /** An attention bind group: parameters from byte 0 of `params`, then q, the keys and values
   *  of kv-cache `c`, and the output, sized by `plan`. */
  attentionGroup(layout, plan, params, qb, c, out) {
    const kvBytes = c.slots * c.width * 4;
    return this.device.createBindGroup({
      label: 'attention',
      layout,
      entries: [
        { binding: 0, resource: { buffer: params, offset: 0, size: SHAPE_BYTES } },
        { binding: 1, resource: { buffer: qb, offset: 0, size: plan.qBytes } },
        { binding: 2, resource: { buffer: c.k, offset: 0, size: kvBytes } },
        { binding: 3, resource: { buffer: c.v, offset: 0, size: kvBytes } },
        { binding: 4, resource: { buffer: out, offset: 0, size: plan.outBytes } },
      ],
    });
  }

  /** shaders/attention.wgsl over `q` and kv-cache `c`, an attention op of a program run op by
   *  op (`interpret`): one workgroup a (head, query), key j (of `s.nKeys`) in the ring's row
   *  (firstKey + j) % slots; the queries split over dispatches as
   *  host/src/gpu/wgpu/attention.rs does, one submission, one readback. */
  async attend(q, c, firstKey, s) {
    this.live();
    const plan = this.attentionPlan(q.length, s, firstKey % c.slots, c.slots);
    const kernels = await this.attentionKernel();
    try {
      return await this.scoped(async () => {
        const usage = GPUBufferUsage;
        const qb = this.ensure('attention q', plan.qBytes, usage.STORAGE | usage.COPY_DST);
        this.device.queue.writeBuffer(qb, 0, q);
        const out = this.ensure('attention out', plan.outBytes, usage.STORAGE | usage.COPY_SRC);
        const staging = this.ensure('attention staging', plan.qBytes, usage.MAP_READ | usage.COPY_DST);
        const params = this.ensure('attention params', plan.shapes.byteLength, usage.UNIFORM | usage.COPY_DST);
        this.device.queue.writeBuffer(params, 0, plan.shapes);
        const group = this.attentionGroup(kernels.layout, plan, params, qb, c, out);
        const encoder = this.device.createCommandEncoder({ label: 'attention' });
        const pass = encoder.beginComputePass({ label: 'attention' });
        this.recordAttention(pass, plan, kernels, group, 0);
        pass.end();
        encoder.copyBufferToBuffer(out, 0, staging, 0, plan.qBytes);
        this.device.queue.submit([encoder.finish()]);
        const [result] = await this.readBack(staging, plan.qBytes, [[0, q.length]]);
        return result;
      });
    } catch (e) {
      this.dropScratch();
      throw e;
    }
  }

  /** The dispatches (split by rows past the workgroups a dimension) of a small kernel of
   *  matmul.wgsl over the `t` rows of `params` (in PARAMS_FIELDS order), `groupsX` workgroups a
   *  row, with step `job`'s bind group. */
  rows(kernel, job, params, groupsX, out) {
    const maxDim = Math.max(1, this.limits.maxComputeWorkgroupsPerDimension);
    const t = params[T_FIELD];
    for (let r0 = 0; r0 < t; r0 += maxDim) {
      const p = params.slice();
      p[T_BASE_FIELD] = r0;
      out.push({ job, kernel, format: 'f32', params: p, groups: [groupsX, Math.min(maxDim, t - r0)] });
    }
  }

  /** A command encoder holding `commands` in order: `{ copy: [src, from, dst, to, bytes] }`,
   *  `{ kernels: [first, end] }` (dispatches of matmul.wgsl, each with its step's bind group
   *  from `groups` and its parameters at its index), or `{ attention: i }` (`attend(pass, i)`
   *  records it), in compute passes between the copies. */
  encode(label, commands, dispatches, pipelines, groups, attend) {
    const encoder = this.device.createCommandEncoder({ label });
    let pass = null;
    const open = () => (pass ??= encoder.beginComputePass({ label }));
    for (const c of commands) {
      if (c.copy) {
        pass?.end();
        pass = null;
        const [src, from, dst, to, n] = c.copy;
        encoder.copyBufferToBuffer(src, from, dst, to, n);
      } else if (c.kernels) {
        const p = open();
        for (let i = c.kernels[0]; i < c.kernels[1]; i++) {
          const d = dispatches[i];
          p.setPipeline(pipelines.get(pipelineKey(d)));
          p.setBindGroup(0, groups[d.job], [i * this.paramsStride]);
          p.dispatchWorkgroups(d.groups[0], d.groups[1], 1);
        }
      } else {
        attend(open(), c.attention);
      }
    }
    pass?.end();
    return encoder;
  }

  /** Writes rows of keys and values to a kv-cache's ring from position `first` (two runs where
   *  it wraps). */
  async writeCache(c, first, k, v) {
    this.live();
    const rows = k.length / c.width;
    const start = first % c.slots;
    const head = Math.min(rows, c.slots - start);
    await this.scoped(() => {
      for (const [buf, data] of [[c.k, k], [c.v, v]]) {
        if (head > 0) this.device.queue.writeBuffer(buf, start * c.width * 4, data.subarray(0, head * c.width));
        if (rows > head) this.device.queue.writeBuffer(buf, 0, data.subarray(head * c.width));
      }
    });
  }

  /** Builds the pipelines a run of program `p` (checked, its weights `refs`) can use, so that
   *  its first run does not wait for them. */
  async prepareProgram(p, refs) {
    const wanted = new Set(['elementwise_rows f32', 'rms_norm_runs f32', 'rotate_rows f32', 'copy_rows f32', 'place_columns f32']);
    for (const op of p.ops) {
      if (op.tag === 'matmul') for (const kernel of ['gemv', 'gemm']) wanted.add(`${kernel} ${refs[op.val.weight].format}`);
    }
    for (const key of wanted) {
      const [kernel, format] = key.split(' ');
      await this.pipeline(kernel, format);
    }
    if (p.ops.some((op) => op.tag === 'attention')) await this.attentionKernel();
  }

  /** Whether `runProgram` records `p` on the device: every product's x has rows of whole steps
   *  (a multiple of 8 values), and each row of every kernel fits the device's workgroups. */
  recordsProgram(p) {
    const maxDim = Math.max(1, this.limits.maxComputeWorkgroupsPerDimension);
    const width = (a) => p.shapes[a]?.width ?? 0;
    return p.ops.every((op, i) => {
      if (Math.ceil(Math.max(width(i), op.tag === 'cache-write' ? width(op.val.k) : 0) / WORKGROUP) > maxDim) return false;
      if (op.tag === 'matmul') return width(op.val.x) % 8 === 0;
      if (op.tag === 'rms-norm') return width(i) / op.val.group <= maxDim;
      return true;
    });
  }

  /**
   * Runs checked program `p` (program.js) over a checked batch (each sequence's caches
   * resolved), its weights `weights`: the whole run in one command buffer, one readback of its
   * outputs. Each value lives in a slot (a buffer kept across runs): the inputs each in their
   * own, any other value in the first slot whose value has had its last reader. Products are
   * `gemv` or `gemm` (`plan`), attention attention.wgsl over each sequence's cache (a batch of
   * several sequences copies each one's queries to a buffer of their own and its outputs back),
   * cache writes and last rows `copy_rows`, the rest the small kernels of matmul.wgsl; top-k is
   * taken here from the row read back. A program `recordsProgram` refuses runs op by op
   * (program.js's `interpret`, over `product`, `writeCache` and `attend`).
   */
  async runProgram(p, weights, inputs, batch) {
    this.live();
    if (!this.recordsProgram(p)) {
      const device = {
        matmul: (x, t, w) => this.product(x, t, weights[w]),
        writeCache: (c, first, k, v) => this.writeCache(c, first, k, v),
        attend: (q, c, first, s) => this.attend(q, c, first, s),
      };
      return interpret(p, device, weights.map((w) => w.vector), inputs, batch);
    }
    const total = batch.reduce((n, q) => n + q.rows, 0);
    const rowsOf = (a) => (p.shapes[a]?.rows === 'sequence' ? batch.length : total);
    const width = (a) => p.shapes[a]?.width ?? 0;
    const bytesOf = (a) => 4 * rowsOf(a) * width(a);
    const max = this.maxBinding;
    const single = batch.length === 1;
    // Each part's product of a weight held in parts, before its columns are placed.
    let splitBytes = 16;
    p.ops.forEach((op) => {
      if (op.tag !== 'matmul') return;
      for (const { w } of weights[op.val.weight].parts ?? []) splitBytes = Math.max(splitBytes, alignUp(4 * rowsOf(op.val.x) * w.nOut, 16));
    });

    // Attention's plans: one a sequence. With one sequence the partial sums follow the outputs
    // in the value's slot; with several, in the scratch output.
    const plans = [];
    const extra = new Array(p.ops.length).fill(0);
    let qScratch = 16;
    let outScratch = 16;
    p.ops.forEach((op, i) => {
      if (op.tag !== 'attention') return;
      const v = op.val;
      const w = width(v.q);
      for (const q of batch) {
        const c = q.caches[v.cache];
        const { first, shape } = attentionOver(q, v);
        const plan = this.attentionPlan(q.rows * w, shape, first % c.slots, c.slots);
        plans.push(plan);
        if (single) extra[i] = plan.outBytes - plan.qBytes;
        qScratch = Math.max(qScratch, plan.qBytes);
        outScratch = Math.max(outScratch, plan.outBytes);
      }
    });
    const fuse = programFusions(p);
    const slots = programSlots(p, fuse, (i) => bytesOf(i) + extra[i]);
    let outBytes = 0;
    for (const op of p.ops) if (op.tag === 'output' || op.tag === 'top-k') outBytes += bytesOf(op.tag === 'output' ? op.val : op.val.x);
    if ([...slots.bytes, outBytes, qScratch, outScratch, splitBytes].some((b) => b > max)) {
      throw new GpuError('out-of-memory', `a run of ${total} rows needs buffers past the device's limit of ${max} bytes`);
    }
    const kernels = plans.length ? await this.attentionKernel() : null;
    const usage = GPUBufferUsage;
    const valueUsage = usage.STORAGE | usage.COPY_SRC | usage.COPY_DST;
    const held = await this.buffers([
      ...slots.bytes.map((b, s) => [`program values ${s}`, b, valueUsage]),
      ['program staging', outBytes, usage.MAP_READ | usage.COPY_DST],
      ['program queries', single ? 16 : qScratch, valueUsage],
      ['program attention', single ? 16 : outScratch, valueUsage],
      ['program parts', splitBytes, usage.STORAGE],
    ]);
    const [staging, qb, ab, split] = held.slice(slots.bytes.length);
    this.unread ??= this.device.createBuffer({ label: 'unread', size: 16, usage: usage.STORAGE });
    const unread = this.unread;
    const value = (a) => held[slots.slot[a]];
    // A value's slot bound as far as the slot reaches (the buffer may be larger: a binding may not).
    const whole = (a) => [value(a), slots.bytes[slots.slot[a]]];

    const binds = [];
    const dispatches = [];
    const commands = [];
    const attention = [];
    const reads = [];
    let outAt = 0;
    let from = 0;
    const kernelsFrom = () => {
      if (dispatches.length > from) commands.push({ kernels: [from, dispatches.length] });
      from = dispatches.length;
    };
    const bind = (weights, scales, input, output) => binds.push({ weights, scales, input, output }) - 1;
    // A small kernel of matmul.wgsl from x (b from `scales`, a vector from `weights`) into op
    // i's value, `groupsX` workgroups a row; params as host/src/gpu/wgpu/programs.rs sets them.
    const small = (i, kernel, x, b, weights, params, groupsX) => {
      const job = bind(weights ?? unread, b === null ? this.placeholder : whole(b), whole(x), [value(i), 0, whole(i)[1]]);
      this.rows(kernel, job, params, groupsX, dispatches);
    };
    const ELEMENTWISE = { add: OP_ADD, mul: OP_MUL, 'gelu-tanh': OP_GELU_TANH, silu: OP_SILU };
    let planAt = 0;
    p.ops.forEach((op, i) => {
      // Made by the op before, fused with it.
      if (i > 0 && fuse[i - 1]) return;
      const v = op.val;
      const t = rowsOf(i);
      const groups = Math.ceil(width(i) / WORKGROUP);
      // elementwise_rows: the op's code in row_base, scale's factor in x_stride.
      const elementwise = (code, by = 0) => paramsOf({ nOut: width(i), t, rowBase: code, xStride: f32Bits(by) });
      switch (op.tag) {
        case 'matmul': {
          const w = weights[v.weight];
          if (w.parts) {
            // Each part into `split`, then its columns placed among the product's (place_columns).
            for (const { w: part, first } of w.parts) {
              const bytes = 4 * t * part.nOut;
              const job = bind(part.data, part.scales || this.placeholder, [value(v.x), bytesOf(v.x)], [split, 0, bytes]);
              this.plan(job, part, t, width(v.x) / 4, dispatches);
              const place = bind(unread, this.placeholder, [split, alignUp(bytes, 16)], [value(i), 0, bytesOf(i)]);
              this.rows('place_columns', place, paramsOf({ nIn: part.nOut, nOut: w.nOut, t, rowBase: first }), Math.ceil(part.nOut / WORKGROUP), dispatches);
            }
            break;
          }
          const job = bind(w.data, w.scales || this.placeholder, [value(v.x), bytesOf(v.x)], [value(i), 0, bytesOf(i)]);
          this.plan(job, w, t, width(v.x) / 4, dispatches);
          break;
        }
        case 'rms-norm': {
          const hasWeight = hasNormWeight(v);
          const f = fuse[i];
          const turns = f?.table !== undefined ? NORM_OP_ROTATE | (f.pairs ? NORM_OP_PAIRS : 0) : 0;
          const flags = (hasWeight ? NORM_OP_WEIGHT : 0) | (f?.add !== undefined ? NORM_OP_ADD : 0) | turns;
          const b = f ? f.add ?? f.table : null;
          const turned = f?.table !== undefined ? width(f.table) : 0;
          // rms_norm_runs: runs of n_in, the table's width in row_quads, flags in scale_row, eps
          // in row_base, the offset in x_stride.
          const params = paramsOf({ nIn: v.group, nOut: width(i), t, rowQuads: turned, scaleRow: flags, rowBase: f32Bits(v.eps), xStride: f32Bits(hasWeight ? v.offset : 1) });
          const made = f ? i + 1 : i;
          small(made, 'rms_norm_runs', v.x, b, hasWeight ? weights[v.weight].data : null, params, width(i) / v.group);
          break;
        }
        case 'add':
        case 'mul':
          small(i, 'elementwise_rows', v[0], v[1], null, elementwise(ELEMENTWISE[op.tag]), groups);
          break;
        case 'scale':
          small(i, 'elementwise_rows', v.x, null, null, elementwise(OP_SCALE, v.by), groups);
          break;
        case 'softcap':
          small(i, 'elementwise_rows', v.x, null, null, elementwise(OP_SOFTCAP, v.cap), groups);
          break;
        case 'bias':
          small(i, 'elementwise_rows', v.x, null, weights[v.weight].data, elementwise(OP_BIAS), groups);
          break;
        case 'gated':
          small(i, 'elementwise_rows', v.gate, v.up, null, elementwise(ELEMENTWISE[v.act]), groups);
          break;
        case 'rotate': {
          // rotate_rows: the table's width in n_in, heads of row_quads, pairs (1) or halves (0) in scale_row.
          const turn = paramsOf({ nIn: width(v.table), nOut: width(i), t, rowQuads: v.headDim, scaleRow: v.rotation === 'pairs' ? 1 : 0 });
          small(i, 'rotate_rows', v.x, v.table, null, turn, groups);
          break;
        }
        case 'cache-write': {
          const w = width(v.k);
          let row = 0;
          for (const q of batch) {
            const c = q.caches[v.cache];
            for (const [src, to] of [[v.k, c.k], [v.v, c.v]]) {
              const job = bind(unread, this.placeholder, whole(src), [to, 0, to.size]);
              // copy_rows: x's rows from row_quads to the ring's rows from scale_row, of x_stride.
              const copy = paramsOf({ nOut: w, t: q.rows, rowQuads: row, scaleRow: q.start % c.slots, xStride: c.slots });
              this.rows('copy_rows', job, copy, Math.ceil(w / WORKGROUP), dispatches);
            }
            row += q.rows;
          }
          break;
        }
        case 'attention': {
          kernelsFrom();
          const w4 = 4 * width(v.q);
          let row = 0;
          for (const q of batch) {
            const plan = plans[planAt++];
            const c = q.caches[v.cache];
            const n = q.rows * w4;
            if (!single) commands.push({ copy: [value(v.q), row * w4, qb, 0, n] });
            commands.push({ attention: attention.length });
            attention.push({ plan, c, q: single ? value(v.q) : qb, out: single ? value(i) : ab });
            if (!single) commands.push({ copy: [ab, 0, value(i), row * w4, n] });
            row += q.rows;
          }
          break;
        }
        case 'last-rows': {
          const w = width(v);
          let end = 0;
          batch.forEach((q, s) => {
            end += q.rows;
            // copy_rows: the sequence's last row to row s (a ring of 2^32 - 1 rows never wraps).
            small(i, 'copy_rows', v, null, null, paramsOf({ nOut: w, t: 1, rowQuads: end - 1, scaleRow: s, xStride: 0xffffffff }), Math.ceil(w / WORKGROUP));
          });
          break;
        }
        case 'output':
        case 'top-k': {
          kernelsFrom();
          const x = op.tag === 'output' ? v : v.x;
          commands.push({ copy: [value(x), 0, staging, outAt, bytesOf(x)] });
          reads.push([outAt, bytesOf(x) / 4, op.tag === 'top-k' ? v.k : 0, width(x)]);
          outAt += bytesOf(x);
          break;
        }
      }
    });
    kernelsFrom();

    const pipelines = await this.pipelinesFor(dispatches);
    try {
      return await this.scoped(async () => {
        let input = 0;
        p.ops.forEach((op, i) => {
          if (op.tag === 'input') this.device.queue.writeBuffer(value(i), 0, inputs[input++]);
        });
        const groups = this.matmulGroups('program params', dispatches, binds);
        const attnAt = [];
        let attnBytes = 0;
        for (const a of attention) {
          attnAt.push(attnBytes);
          attnBytes += a.plan.shapes.byteLength;
        }
        const attnParams = this.ensure('program attention params', Math.max(attnBytes, 16), usage.UNIFORM | usage.COPY_DST);
        const attnGroups = attention.map((a, j) => {
          this.device.queue.writeBuffer(attnParams, attnAt[j], a.plan.shapes);
          return this.attentionGroup(kernels.layout, a.plan, attnParams, a.q, a.c, a.out);
        });
        const attend = (pass, j) => this.recordAttention(pass, attention[j].plan, kernels, attnGroups[j], attnAt[j]);
        this.device.queue.submit([this.encode('program', commands, dispatches, pipelines, groups, attend).finish()]);
        const got = await this.readBack(staging, outBytes, reads.map(([at, n]) => [at, n]));
        return got.map((y, j) => {
          const [, , k, w] = reads[j];
          return k ? topK(y, w, k) : { tag: 'rows', val: y };
        });
      });
    } catch (e) {
      this.dropScratch();
      throw e;
    }
  }

  /** Maps the first `bytes` of `staging` (the work copying into it is submitted) and copies
   *  out each `[byte offset, values]` of `reads` as a Float32Array; unmaps either way. */
  async readBack(staging, bytes, reads) {
    try {
      await staging.mapAsync(GPUMapMode.READ, 0, bytes);
    } catch (e) {
      this.live();
      throw new GpuError('unavailable', `reading the result back: ${e.message}`);
    }
    try {
      const view = staging.getMappedRange(0, bytes);
      return reads.map(([o, n]) => new Float32Array(view.slice(o, o + n * 4)));
    } finally {
      staging.unmap();
    }
  }

  /** Makes the device lost, as a driver reset would. For tests. */
  simulateDeviceLoss() {
    this.device.destroy();
    this.lost ??= 'simulated device loss';
    this.dropScratch();
  }
}
