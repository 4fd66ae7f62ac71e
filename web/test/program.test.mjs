// The browser host's programs without a browser (web/src/program.js): what the conformance kit
// reaches only through the device. In Chromium the kit runs every program on the device's
// recorder but for those with products over rows that are not whole steps of 8 values, which go
// op by op through `interpret`; here each op of `interpret` is held to the contract's formula
// (wit/gpu.wit) in float64 on fresh random values, top-k to the contract's order, and the
// checks to the contract's refusals.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { checkBatch, checkProgram, interpret, MAX_OPS, topK } from '../src/program.js';

/** A generator of the same values on every run (xorshift), uniform in [-2, 2). */
function rng(seed) {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5;
    s >>>= 0;
    return (s / 2 ** 32) * 4 - 2;
  };
}

const f32 = (n, next) => Float32Array.from({ length: n }, next);
const input = (width) => ({ tag: 'input', val: width });
const output = (x) => ({ tag: 'output', val: x });

/** Runs `ops` (no products, caches or attention) over `batch` with `interpret`. */
async function run(ops, weights, vectors, inputs, batch) {
  const p = checkProgram(ops, weights, 0);
  assert.equal(checkBatch(p, inputs, batch, 2 ** 30), null);
  const none = () => assert.fail('a device-free program called the device');
  return interpret(p, { matmul: none, writeCache: none, attend: none }, vectors, inputs, batch);
}

/** Asserts that `got` is `want` (float64) within `rel` of the largest |want|. */
function close(got, want, rel, what) {
  assert.equal(got.length, want.length, `${what}: ${got.length} values, want ${want.length}`);
  const scale = Math.max(1e-30, ...want.map(Math.abs));
  want.forEach((w, i) => assert.ok(Math.abs(got[i] - w) <= rel * scale, `${what}[${i}] is ${got[i]}, want ${w}`));
}

test('each op interpreted matches its formula in float64', async () => {
  const next = rng(7);
  for (const [heads, hd] of [[1, 2], [3, 8], [2, 14]]) {
    const width = heads * hd;
    const rows = [2, 1, 3];
    const batch = rows.map((r, s) => ({ rows: r, start: 5 * s, caches: [] }));
    const t = rows.reduce((a, b) => a + b, 0);
    const a = f32(t * width, next);
    const b = f32(t * width, next);
    const wRow = f32(width, next);
    const wHead = f32(hd, next);
    const weights = [{ nOut: 1, nIn: width, format: 'f32' }, { nOut: 1, nIn: hd, format: 'f32' }];
    const vectors = [wRow, wHead];
    const at = (r, j) => r * width + j;
    const each = (f) => Array.from({ length: t * width }, (_, i) => f(Math.floor(i / width), i % width, i));

    // rms-norm of heads with a weight and an offset; of rows without a weight.
    const norm = (group, w, offset) => each((r, j, i) => {
      const first = r * width + Math.floor(j / group) * group;
      let ss = 0;
      for (let k = 0; k < group; k++) ss += a[first + k] ** 2;
      return (a[i] / Math.sqrt(ss / group + 1e-5)) * ((w ? w[j % group] : 0) + offset);
    });
    const normOp = (weight, offset, group) => ({ tag: 'rms-norm', val: { x: 0, weight, offset, group, eps: 1e-5 } });
    let [y] = await run([input(width), normOp(1, 1, hd), output(1)], weights, vectors, [a], batch);
    close(y.val, norm(hd, wHead, 1), 1e-6, `rms-norm of heads of ${hd}`);
    [y] = await run([input(width), normOp(undefined, 0, width), output(1)], weights, vectors, [a], batch);
    close(y.val, norm(width, null, 1), 1e-6, `rms-norm of rows of ${width} without a weight`);

    // add, mul, bias, scale, the gated activations.
    const two = (tag) => [input(width), input(width), { tag, val: [0, 1] }, output(2)];
    [y] = await run(two('add'), weights, vectors, [a, b], batch);
    close(y.val, each((r, j, i) => a[i] + b[i]), 1e-7, 'add');
    [y] = await run(two('mul'), weights, vectors, [a, b], batch);
    close(y.val, each((r, j, i) => a[i] * b[i]), 1e-7, 'mul');
    [y] = await run([input(width), { tag: 'bias', val: { x: 0, weight: 0 } }, output(1)], weights, vectors, [a], batch);
    close(y.val, each((r, j, i) => a[i] + wRow[j]), 1e-7, 'bias');
    [y] = await run([input(width), { tag: 'scale', val: { x: 0, by: -3.5 } }, output(1)], weights, vectors, [a], batch);
    close(y.val, each((r, j, i) => a[i] * -3.5), 1e-7, 'scale');
    [y] = await run([input(width), { tag: 'softcap', val: { x: 0, cap: 0.75 } }, output(1)], weights, vectors, [a], batch);
    close(y.val, each((r, j, i) => 0.75 * Math.tanh(a[i] / 0.75)), 1e-6, 'softcap');
    const gelu = (g) => 0.5 * g * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (g + 0.044715 * g ** 3)));
    const silu = (g) => g / (1 + Math.exp(-g));
    for (const [act, f] of [['gelu-tanh', gelu], ['silu', silu]]) {
      [y] = await run([input(width), input(width), { tag: 'gated', val: { gate: 0, up: 1, act } }, output(2)], weights, vectors, [a, b], batch);
      close(y.val, each((r, j, i) => f(a[i]) * b[i]), 1e-6, act);
    }

    // Rotations of part of each head (the table narrower than a head), halves and pairs.
    const turned = hd >= 4 ? hd - 2 : hd;
    const half = turned / 2;
    const table = f32(t * turned, next);
    for (const rotation of ['halves', 'pairs']) {
      const ops = [input(width), input(turned), { tag: 'rotate', val: { x: 0, table: 1, headDim: hd, rotation } }, output(2)];
      [y] = await run(ops, weights, vectors, [a, table], batch);
      const want = each((r, j, i) => {
        const h = j % hd;
        if (h >= turned) return a[i];
        const pair = rotation === 'pairs' ? Math.floor(h / 2) : h % half;
        const first = rotation === 'pairs' ? h % 2 === 0 : h < half;
        const other = rotation === 'pairs' ? (first ? i + 1 : i - 1) : first ? i + half : i - half;
        const c = table[r * turned + pair];
        const s = table[r * turned + half + pair];
        return first ? a[i] * c - a[other] * s : a[other] * s + a[i] * c;
      });
      close(y.val, want, 1e-6, `rotate ${rotation} of heads of ${hd}, ${turned} turned`);
    }

    // The last row of each sequence, and its top 3.
    const ops = [input(width), { tag: 'last-rows', val: 0 }, { tag: 'top-k', val: { x: 1, k: Math.min(3, width) } }, output(1)];
    const [top, last] = await run(ops, weights, vectors, [a], batch);
    let end = 0;
    const lastRows = rows.flatMap((r) => {
      end += r;
      return Array.from(a.subarray(at(end - 1, 0), at(end, 0)));
    });
    close(last.val, lastRows, 0, 'last-rows');
    const k = Math.min(3, width);
    assert.deepEqual(Array.from(top.val.indices), rows.flatMap((_, s) => {
      const row = lastRows.slice(s * width, (s + 1) * width);
      return [...row.keys()].sort((x, z) => row[z] - row[x] || x - z).slice(0, k);
    }), 'top-k of the last rows');
  }
});

test('top-k: largest first, the lower index first among equals, NaN last', () => {
  const next = rng(11);
  for (const width of [1, 5, 64, 1000]) {
    // Few distinct values: many ties; some NaN.
    const x = Float32Array.from({ length: 3 * width }, () => (next() > 1.6 ? NaN : Math.round(next() * 3)));
    for (const k of [1, Math.ceil(width / 2), width]) {
      const { values, indices } = topK(x, width, k).val;
      for (let r = 0; r < 3; r++) {
        const row = x.subarray(r * width, (r + 1) * width);
        const rank = (i) => (Number.isNaN(row[i]) ? -Infinity : row[i]);
        const want = [...row.keys()].sort((a, b) => rank(b) - rank(a) || a - b).slice(0, k);
        assert.deepEqual(Array.from(indices.subarray(r * k, (r + 1) * k)), want, `width ${width}, k ${k}, row ${r}`);
        assert.deepEqual(Array.from(values.subarray(r * k, (r + 1) * k)), want.map((i) => row[i]));
      }
    }
  }
});

test('a program that breaks the contract is refused with the op and the rule', () => {
  const w = [{ nOut: 8, nIn: 4, format: 'q8x32' }, { nOut: 1, nIn: 4, format: 'f32' }];
  const mm = (x, weight) => ({ tag: 'matmul', val: { x, weight, precision: 'exact' } });
  const refused = [
    [[input(4), output(7)], 0, /^op 1 \(output\): reads value 7, which no earlier op made/],
    [[input(4), output(0), output(1)], 0, /^op 2 \(output\): reads value 1, but op 1 \(output\) makes none/],
    [[input(4), mm(0, 2), output(1)], 0, /^op 1 \(matmul\): weight 2 of 2/],
    [[input(5), mm(0, 0), output(1)], 0, /weight 0 is \[8, 4\]; the op needs \[n, 5\]/],
    [[input(4), { tag: 'bias', val: { x: 0, weight: 0 } }, output(1)], 0, /weight 0 is q8x32; a vector must be f32/],
    [[input(4), { tag: 'last-rows', val: 0 }, { tag: 'add', val: [0, 1] }, output(2)], 0, /operands of different shapes/],
    [[input(4), input(6), { tag: 'rotate', val: { x: 0, table: 1, headDim: 4, rotation: 'pairs' } }, output(2)], 0, /a table of width 6 for heads of 4/],
    [[input(4), { tag: 'cache-write', val: { k: 0, v: 0, cache: 1 } }, output(0)], 1, /cache 1 of 1/],
    [[input(4), { tag: 'top-k', val: { x: 0, k: 5 } }], 0, /k 5 is outside 1..=4/],
    [[input(4), { tag: 'scale', val: { x: 0, by: 2 } }], 0, /outputs nothing/],
    [[input(4), { tag: 'softcap', val: { x: 0, cap: 0 } }, output(1)], 0, /^op 1 \(softcap\): soft cap 0 is not a finite positive number/],
    [[input(4), { tag: 'attention', val: { q: 0, cache: 0, nHead: 2, nHeadKv: 1, headDim: 2, window: 0, scale: 1, softcap: -1, precision: 'exact' } }, output(1)], 1, /soft cap -1 is not/],
    [[input(4), { tag: 'no-such-op', val: 0 }, output(1)], 0, /an op this host does not know/],
    [[], 0, /0 ops/],
    [[input(4), output(0)], 1025, /1025 cache indices/],
  ];
  for (const [ops, caches, why] of refused) assert.throws(() => checkProgram(ops, w, caches), why);
  const huge = [input(4), ...Array.from({ length: MAX_OPS }, (_, i) => ({ tag: 'scale', val: { x: i, by: 1 } })), output(MAX_OPS)];
  assert.throws(() => checkProgram(huge, w, 0), /ops: a program has 1 to 65536/);
  // A batch that does not fit: the error's kind and what it names.
  const p = checkProgram([input(4), { tag: 'attention', val: { q: 0, cache: 0, nHead: 2, nHeadKv: 1, headDim: 2, window: 0, scale: 1, softcap: 0, precision: 'exact' } }, output(1)], w, 1);
  const c = { slots: 4, width: 2 };
  assert.deepEqual(checkBatch(p, [new Float32Array(8)], [{ rows: 2, start: 3, caches: [c] }], 1e9), ['invalid-argument', 'sequence 0: 5 positions of cache 0 do not fit its 4 slots']);
  assert.deepEqual(checkBatch(p, [new Float32Array(8)], [{ rows: 1, start: 0, caches: [c] }, { rows: 1, start: 0, caches: [c] }], 1e9)?.[1], 'sequence 1: cache 0 appears twice in the batch');
  assert.equal(checkBatch(p, [new Float32Array(8)], [{ rows: 2, start: 0, caches: [c] }], 7)?.[0], 'out-of-memory');
  assert.equal(checkBatch(p, [new Float32Array(8)], [{ rows: 2, start: 2, caches: [c] }], 1e9), null);
});
