// Programs of the `gpu` interface in the browser host: the counterpart of
// host/src/gpu/program.rs. `checkProgram` turns the guest's ops (jco's `{ tag, val }` variants)
// into a program whose every operand, shape and kind has been checked, so that a run only has to
// check its batch (`checkBatch`). webgpu.js records whole runs on the device (`runProgram`);
// `interpret` is the op-by-op reading of the contract it falls back on (products, cache writes
// and attention on the device, the other ops here in f32), as program.rs's `run`.

/** Ops in one program, at most (program.rs's MAX_OPS). */
export const MAX_OPS = 65536;
/** Cache indices of one program, at most. */
export const MAX_CACHES = 1024;
/** Sequences in one run, at most. */
export const MAX_SEQUENCES = 4096;
/** The largest `k` of a `top-k` op. */
export const MAX_TOP_K = 1024;
/** The widest head (MAX_HEAD_DIM of host/src/gpu/mod.rs). */
export const MAX_HEAD_DIM = 512;
/** The widest value (2^31). */
const MAX_WIDTH = 2 ** 31;

const TOKEN = 'token';
const SEQUENCE = 'sequence';

/** The values op `op` reads. */
export function operands({ tag, val }) {
  switch (tag) {
    case 'input': return [];
    case 'add':
    case 'mul': return [val[0], val[1]];
    case 'gated': return [val.gate, val.up];
    case 'rotate': return [val.x, val.table];
    case 'cache-write': return [val.k, val.v];
    case 'attention': return [val.q];
    case 'last-rows':
    case 'output': return [val];
    default: return [val.x];
  }
}

/** The first position a query at `p` sees with `window` (0: none). */
export const firstKey = (p, window) => (window === 0 ? 0 : Math.max(0, p + 1 - window));

/** Whether an rms-norm op (its `val`) has a weight. */
export const hasNormWeight = (v) => v.weight !== undefined && v.weight !== null;

/** The first key and the shape of attention op `v` (its `val`) over sequence `q`'s rows: the
 *  shape of attention.wgsl's `Shape` (webgpu.js's `attentionPlan`), `nKeys` from the first key
 *  the queries see to the last. */
export function attentionOver(q, v) {
  const first = firstKey(q.start, v.window);
  const shape = { t: q.rows, nKeys: q.start + q.rows - first, nHead: v.nHead, nHeadKv: v.nHeadKv, headDim: v.headDim, window: v.window, scale: v.scale, softcap: v.softcap };
  return { first, shape };
}

/**
 * Checks `ops` over `weights` (each `{ nOut, nIn, format }`) with `caches` cache indices:
 * returns `{ ops, weights, shapes, inputs, caches, lastUse }` (each shape `{ rows, width }` or
 * null, each cache use `{ width, written, windows }`), or throws a string that says which op
 * breaks which rule.
 */
export function checkProgram(ops, weights, caches) {
  if (ops.length === 0 || ops.length > MAX_OPS) throw `${ops.length} ops: a program has 1 to ${MAX_OPS}`;
  if (caches > MAX_CACHES) throw `${caches} cache indices: a program has at most ${MAX_CACHES}`;
  const p = {
    ops,
    weights,
    shapes: [],
    inputs: [],
    caches: Array.from({ length: caches }, () => ({ width: null, written: false, windows: [] })),
    lastUse: ops.map((_, i) => i),
  };
  let outputs = 0;
  ops.forEach((op, i) => {
    let shape;
    try {
      shape = shapeOf(p, i, op);
    } catch (why) {
      throw `op ${i} (${op?.tag}): ${why}`;
    }
    for (const a of operands(op)) p.lastUse[a] = i;
    if (op.tag === 'output' || op.tag === 'top-k') outputs += 1;
    p.shapes.push(shape);
  });
  if (outputs === 0) throw 'the program outputs nothing: it has no `output` or `top-k` op';
  return p;
}

/** The value of operand `a` of op `i`. */
function value(p, i, a) {
  if (!Number.isInteger(a) || a >= i) throw `reads value ${a}, which no earlier op made`;
  const s = p.shapes[a];
  if (!s) throw `reads value ${a}, but op ${a} (${p.ops[a].tag}) makes none`;
  return s;
}

/** A token-row operand. */
function tokens(p, i, a) {
  const s = value(p, i, a);
  if (s.rows !== TOKEN) throw `value ${a} has sequence rows; the op needs token rows`;
  return s;
}

/** The weight of index `w`, `[rows, cols]` (rows where given), an f32 vector with `vector`. */
function weight(p, w, rows, cols, vector) {
  const r = p.weights[w];
  if (!r) throw `weight ${w} of ${p.weights.length}`;
  if (vector && r.format !== 'f32') throw `weight ${w} is ${r.format}; a vector must be f32`;
  if ((rows !== null && rows !== r.nOut) || r.nIn !== cols) throw `weight ${w} is [${r.nOut}, ${r.nIn}]; the op needs [${rows ?? 'n'}, ${cols}]`;
  return r;
}

/** Records that an op uses cache `c` with rows of `width`. */
function useCache(p, c, width) {
  const u = p.caches[c];
  if (!u) throw `cache ${c} of ${p.caches.length}`;
  if (u.width !== null && u.width !== width) throw `cache ${c} holds rows of ${u.width}, this op's are ${width}`;
  u.width = width;
  return u;
}

const same = (a, b) => {
  if (a.rows !== b.rows || a.width !== b.width) throw `operands of different shapes: ${a.rows} rows of ${a.width} and ${b.rows} rows of ${b.width}`;
  return a;
};

/** The shape of op `i`'s value (null for the ops that make none), or throws why the op breaks the contract. */
function shapeOf(p, i, op) {
  const v = op?.val;
  switch (op?.tag) {
    case 'input':
      if (!(v >= 1 && v <= MAX_WIDTH)) throw `width ${v} is outside 1..=${MAX_WIDTH}`;
      p.inputs.push(v);
      return { rows: TOKEN, width: v };
    case 'matmul': {
      const s = value(p, i, v.x);
      return { rows: s.rows, width: weight(p, v.weight, null, s.width, false).nOut };
    }
    case 'rms-norm': {
      const s = value(p, i, v.x);
      if (v.group === 0 || s.width % v.group !== 0) throw `group ${v.group} does not divide the width ${s.width}`;
      if (hasNormWeight(v)) weight(p, v.weight, 1, v.group, true);
      return s;
    }
    case 'add':
    case 'mul':
      return same(value(p, i, v[0]), value(p, i, v[1]));
    case 'bias': {
      const s = value(p, i, v.x);
      weight(p, v.weight, 1, s.width, true);
      return s;
    }
    case 'scale':
      return value(p, i, v.x);
    case 'softcap': {
      const s = value(p, i, v.x);
      if (!(Number.isFinite(v.cap) && v.cap > 0)) throw `soft cap ${v.cap} is not a finite positive number`;
      return s;
    }
    case 'gated':
      return same(value(p, i, v.gate), value(p, i, v.up));
    case 'rotate': {
      const s = tokens(p, i, v.x);
      const t = tokens(p, i, v.table);
      const hd = v.headDim;
      if (hd < 2 || hd % 2 !== 0 || hd > MAX_HEAD_DIM || s.width % hd !== 0) {
        throw `head-dim ${hd} is not even within 2..=${MAX_HEAD_DIM} or does not divide the width ${s.width}`;
      }
      if (t.width % 2 !== 0 || t.width > hd) throw `a table of width ${t.width} for heads of ${hd}: it must be even and at most a head`;
      return s;
    }
    case 'cache-write': {
      const k = tokens(p, i, v.k);
      const vs = tokens(p, i, v.v);
      if (k.width !== vs.width) throw `keys of width ${k.width} and values of width ${vs.width}`;
      useCache(p, v.cache, k.width).written = true;
      return null;
    }
    case 'attention': {
      const s = tokens(p, i, v.q);
      if (!(Number.isFinite(v.softcap) && v.softcap >= 0)) throw `soft cap ${v.softcap} is not a finite positive number`;
      if (v.nHead === 0 || v.nHeadKv === 0 || v.nHead % v.nHeadKv !== 0) throw `${v.nHead} query heads cannot share ${v.nHeadKv} key/value heads`;
      if (v.headDim === 0 || v.headDim > MAX_HEAD_DIM) throw `head-dim ${v.headDim} is outside 1..=${MAX_HEAD_DIM}`;
      if (s.width !== v.nHead * v.headDim) throw `q has width ${s.width}, ${v.nHead} heads of ${v.headDim} need ${v.nHead * v.headDim}`;
      const width = v.nHeadKv * v.headDim;
      if (width > 0xffffffff) throw 'the key width overflows';
      const u = useCache(p, v.cache, width);
      if (!u.windows.includes(v.window)) u.windows.push(v.window);
      return s;
    }
    case 'last-rows':
      return { rows: SEQUENCE, width: tokens(p, i, v).width };
    case 'output':
      value(p, i, v);
      return null;
    case 'top-k': {
      const s = value(p, i, v.x);
      if (v.k === 0 || v.k > MAX_TOP_K || v.k > s.width) throw `k ${v.k} is outside 1..=${Math.min(MAX_TOP_K, s.width)} for rows of ${s.width}`;
      return null;
    }
    default:
      throw 'an op this host does not know';
  }
}

/**
 * Checks a run's inputs and batch against `p` (as program.rs's `check_batch`): `batch` holds
 * each sequence as `{ rows, start, caches }` with its caches resolved (`{ slots, width }`, the
 * same object for the same cache). Returns null, or `[tag, message]` of the error.
 */
export function checkBatch(p, inputs, batch, maxElems) {
  if (batch.length === 0 || batch.length > MAX_SEQUENCES) return ['invalid-argument', `a batch of ${batch.length} sequences: 1 to ${MAX_SEQUENCES}`];
  let rows = 0n;
  const seen = new Set();
  for (let s = 0; s < batch.length; s++) {
    const q = batch[s];
    if (q.rows === 0 || q.start + q.rows > 0xffffffff) return ['invalid-argument', `sequence ${s}: ${q.rows} rows from position ${q.start}`];
    if (q.caches.length !== p.caches.length) {
      return ['invalid-argument', `sequence ${s} brings ${q.caches.length} caches; the program has ${p.caches.length} cache indices`];
    }
    for (let c = 0; c < p.caches.length; c++) {
      const cache = q.caches[c];
      const u = p.caches[c];
      if (seen.has(cache)) return ['invalid-argument', `sequence ${s}: cache ${c} appears twice in the batch`];
      seen.add(cache);
      if (u.width !== null && u.width !== cache.width) return ['invalid-argument', `sequence ${s}: cache ${c} has rows of ${cache.width}; the program's are ${u.width}`];
      let span = u.written ? q.rows : 0;
      for (const w of u.windows) span = Math.max(span, q.start + q.rows - firstKey(q.start, w));
      if (span > cache.slots) return ['invalid-argument', `sequence ${s}: ${span} positions of cache ${c} do not fit its ${cache.slots} slots`];
    }
    rows += BigInt(q.rows);
  }
  if (inputs.length !== p.inputs.length) return ['invalid-argument', `${inputs.length} inputs for ${p.inputs.length} input ops`];
  for (let j = 0; j < inputs.length; j++) {
    const want = rows * BigInt(p.inputs[j]);
    if (BigInt(inputs[j].length) !== want) return ['invalid-argument', `input ${j} has ${inputs[j].length} values; ${rows} rows of ${p.inputs[j]} need ${want}`];
  }
  for (let i = 0; i < p.shapes.length; i++) {
    const s = p.shapes[i];
    if (!s) continue;
    const n = BigInt(s.width) * (s.rows === TOKEN ? rows : BigInt(batch.length));
    if (n > BigInt(maxElems)) return ['out-of-memory', `value ${i} of ${n} values exceeds the device's limit of ${maxElems}`];
  }
  return null;
}

/** The rows of value `a` in a run over `batch`: token rows or one a sequence. */
export function rowsOf(p, a, batch) {
  return p.shapes[a]?.rows === SEQUENCE ? batch.length : batch.reduce((n, q) => n + q.rows, 0);
}

/** `act(g)`: GELU-tanh or SiLU as host/src/gpu/mod.rs's `Activation::apply`. */
function activate(act, g) {
  const a = act === 'silu' ? g : Math.fround(1.5957691 * (g + 0.044715 * g * g * g));
  return g / (1 + Math.exp(-a));
}

/** `cap * tanh(x / cap)` as ops/src/op.rs's `softcap` reads it (and the shaders' `softcap`):
 *  (1 - e) / (1 + e), e = e^(-2|y|), and the series to y^7 below |y| = 1/8. */
export function softcap(x, cap) {
  const f = Math.fround;
  const y = f(x / f(cap));
  let t;
  if (Math.abs(y) < 0.125) {
    const y2 = f(y * y);
    t = f(y * f(1 - f(y2 * f(f(1 / 3) - f(y2 * f(f(2 / 15) - f(y2 * f(17 / 315))))))));
  } else {
    const e = f(Math.exp(-2 * Math.abs(y)));
    t = Math.sign(y) * f(f(1 - e) / f(1 + e));
  }
  return f(f(cap) * t);
}

/**
 * Runs a checked program over a checked batch op by op: products, cache writes and attention on
 * `device` (`matmul(x, t, w)`, `writeCache(cache, start, k, v)`, `attend(q, cache, firstKey,
 * shape)`, each resolving to a Float32Array or nothing), the other ops here in f32. `vectors`
 * holds the values of the program's f32 vector weights by weight index. Resolves to the outputs.
 */
export async function interpret(p, device, vectors, inputs, batch) {
  const values = new Array(p.ops.length);
  const outputs = [];
  let nextInput = 0;
  const width = (a) => p.shapes[a]?.width ?? 0;
  const map2 = (a, b, f) => {
    const y = new Float32Array(a.length);
    for (let j = 0; j < a.length; j++) y[j] = f(a[j], b[j]);
    return y;
  };
  for (let i = 0; i < p.ops.length; i++) {
    const op = p.ops[i];
    const v = op.val;
    let made = null;
    switch (op.tag) {
      case 'input':
        made = inputs[nextInput++];
        break;
      case 'matmul':
        made = await device.matmul(values[v.x], rowsOf(p, v.x, batch), v.weight);
        break;
      case 'rms-norm': {
        const x = values[v.x];
        const hasWeight = hasNormWeight(v);
        const w = hasWeight ? vectors[v.weight] : null;
        const offset = hasWeight ? v.offset : 1;
        made = new Float32Array(x.length);
        for (let at = 0; at < x.length; at += v.group) {
          let ss = 0;
          for (let j = 0; j < v.group; j++) ss += x[at + j] * x[at + j];
          const k = 1 / Math.sqrt(ss / v.group + Math.fround(v.eps));
          for (let j = 0; j < v.group; j++) made[at + j] = Math.fround(x[at + j] * k) * Math.fround((w ? w[j] : 0) + offset);
        }
        break;
      }
      case 'add':
        made = map2(values[v[0]], values[v[1]], (a, b) => a + b);
        break;
      case 'mul':
        made = map2(values[v[0]], values[v[1]], (a, b) => a * b);
        break;
      case 'bias': {
        const b = vectors[v.weight];
        const x = values[v.x];
        made = new Float32Array(x.length);
        for (let j = 0; j < x.length; j++) made[j] = x[j] + b[j % b.length];
        break;
      }
      case 'scale': {
        const by = Math.fround(v.by);
        made = values[v.x].map((a) => a * by);
        break;
      }
      case 'softcap':
        made = values[v.x].map((a) => softcap(a, v.cap));
        break;
      case 'gated':
        made = map2(values[v.gate], values[v.up], (g, u) => Math.fround(activate(v.act, g)) * u);
        break;
      case 'rotate': {
        made = Float32Array.from(values[v.x]);
        const w = width(v.x);
        const tw = width(v.table);
        const table = values[v.table];
        const half = tw / 2;
        for (let r = 0; r * w < made.length; r++) {
          for (let h = r * w; h < (r + 1) * w; h += v.headDim) {
            for (let j = 0; j < half; j++) {
              const [a, b] = v.rotation === 'pairs' ? [h + 2 * j, h + 2 * j + 1] : [h + j, h + j + half];
              const c = table[r * tw + j];
              const s = table[r * tw + half + j];
              const [xa, xb] = [made[a], made[b]];
              made[a] = Math.fround(xa * c) - Math.fround(xb * s);
              made[b] = Math.fround(xa * s) + Math.fround(xb * c);
            }
          }
        }
        break;
      }
      case 'cache-write': {
        const w = width(v.k);
        let at = 0;
        for (const q of batch) {
          const n = q.rows * w;
          await device.writeCache(q.caches[v.cache], q.start, values[v.k].subarray(at, at + n), values[v.v].subarray(at, at + n));
          at += n;
        }
        break;
      }
      case 'attention': {
        const w = width(v.q);
        made = new Float32Array(values[v.q].length);
        let at = 0;
        for (const q of batch) {
          const { first, shape } = attentionOver(q, v);
          const n = q.rows * w;
          made.set(await device.attend(values[v.q].subarray(at, at + n), q.caches[v.cache], first, shape), at);
          at += n;
        }
        break;
      }
      case 'last-rows': {
        const w = width(v);
        made = new Float32Array(batch.length * w);
        let end = 0;
        batch.forEach((q, s) => {
          end += q.rows * w;
          made.set(values[v].subarray(end - w, end), s * w);
        });
        break;
      }
      case 'output':
        outputs.push({ tag: 'rows', val: Float32Array.from(values[v]) });
        break;
      case 'top-k':
        outputs.push(topK(values[v.x], width(v.x), v.k));
        break;
    }
    if (made) values[i] = made;
    for (const a of operands(op)) if (p.lastUse[a] === i) values[a] = null;
  }
  return outputs;
}

/** The top `k` of each row of `x` (rows of `width`) as the `top` output: largest first, the
 *  lower index first among equals, NaN below every number. One pass a row, keeping the best
 *  `k` so far in order (most values are below the k-th and cost one comparison). */
export function topK(x, width, k) {
  const rows = width === 0 ? 0 : x.length / width;
  const values = new Float32Array(rows * k);
  const indices = new Uint32Array(rows * k);
  // Whether value a (column ia) ranks before value b (column ib).
  const before = (a, ia, b, ib) => {
    if (Number.isNaN(a) || Number.isNaN(b)) return Number.isNaN(b) && (!Number.isNaN(a) || ia < ib);
    return a > b || (a === b && ia < ib);
  };
  for (let r = 0; r < rows; r++) {
    const at = r * width;
    const top = r * k;
    let n = 0;
    for (let j = 0; j < width; j++) {
      const v = x[at + j];
      if (n === k && !before(v, j, values[top + k - 1], indices[top + k - 1])) continue;
      // Its place among the n kept, found from the end; the rest move down one.
      let i = n < k ? n++ : k - 1;
      while (i > 0 && before(v, j, values[top + i - 1], indices[top + i - 1])) {
        values[top + i] = values[top + i - 1];
        indices[top + i] = indices[top + i - 1];
        i -= 1;
      }
      values[top + i] = v;
      indices[top + i] = j;
    }
  }
  return { tag: 'top', val: { values, indices } };
}
