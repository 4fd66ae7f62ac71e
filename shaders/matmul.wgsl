// y[t, n_out] = x[t, n_in] @ W[n_out, n_in]^T, with W decoded in the shader from its upload
// format: the byte layouts of `wit/gpu.wit`, decoded as the host's `cpu::decode_rows` does
// (f32; bf16 = the high half of an f32; q8: w = d * q, q a signed byte; q4: w = d * q - m,
// element 2i in the low nibble of byte i).
//
// Bindings, group 0 (one layout for every entry point and format):
//   0  params   uniform, dynamic offset  Params: the shape, and the part of it one dispatch covers
//   1  weights  storage, read            array<vec4<u32>>: W's data in its upload format; row r
//                                        starts at quad r * row_quads. Rows are whole steps
//                                        (below): f32 and bf16 rows of other lengths end in
//                                        zero padding; the block formats never need it
//   2  scales   storage, read            array<f32>: W's block scales as uploaded, scale_row a
//                                        row ([d] a block; [d, m] a block for q4x32); f32 and
//                                        bf16 bind a placeholder
//   3  x        storage, read            array<vec4<f32>>: x[t, n_in], row-major, each row
//                                        padded with zeros to x_stride quads (a whole step)
//   4  y        storage, read_write      array<f32>: y[t, n_out], row-major (one job's range)
//
// Pipeline-overridable constants:
//   FORMAT   0 f32, 1 bf16, 2 q8x32, 3 q8x16, 4 q4x32
//   LANES_K  `gemv` only: invocations sharing one row (a power of two, at most 64). 1 on CPU
//            devices (rows per invocation, no barrier); on a GPU two warps' worth, so that
//            neighbouring invocations read neighbouring quads of a row (coalesced), summed
//            through workgroup memory after one barrier.
//   GEMV_BLOCKS  `gemv` only: blocks of 4 weight rows an invocation, 1 or 2. Two share each
//            x load among eight rows (q4x32 runs faster so on the H200); the q8 formats run
//            faster with one.
//
// A row is walked in steps of one quad of weights (two for f32): 8 elements for f32 and bf16,
// 16 for q8x32 and q8x16 (one scale a step), 32 for q4x32 (one [d, m] a step). Weights are
// loaded a quad at a time, scales once a step, and every loaded value is used by several rows:
// a load whose address differs between invocations is what costs most on CPU implementations
// (lavapipe fetches it lane by lane); barriers are slow there too, so neither kernel needs one
// on a CPU device.
//
// Entry points:
//   gemv  small t (decode). Each invocation: 4 or 8 weight rows (64 / LANES_K apart) against
//         one row of x (wid.y), sharing each x load among the rows.
//   gemm  t >= 4 (prefill), register-blocked: each invocation computes 8 weight rows (64
//         apart) x 4 rows of x = 32 outputs; a workgroup covers 512 weight rows and 4 rows of
//         x. All its invocations read the same x values (broadcast loads), and each decoded
//         weight is used 4 times. No workgroup memory, no barrier.
// Shapes that are not a multiple of the tile are clamped on load and masked on store.

struct Params {
    n_in: u32,       // columns of W and x
    n_out: u32,      // rows of W, columns of y
    t: u32,          // rows of x and y
    row_quads: u32,  // vec4<u32> of weights a row of W
    scale_row: u32,  // f32 scales a row of W
    row_base: u32,   // first row of W this dispatch covers
    t_base: u32,     // first row of x this dispatch covers
    x_stride: u32,   // vec4<f32> a row of x (n_in padded with zeros to a whole step)
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> scales: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

override FORMAT: u32 = 0u;
override LANES_K: u32 = 1u;
override GEMV_BLOCKS: u32 = 1u;

const F32: u32 = 0u;
const BF16: u32 = 1u;
const Q8X32: u32 = 2u;
const Q8X16: u32 = 3u;
const Q4X32: u32 = 4u;

const WG: u32 = 64u;

// Elements of a row a step covers.
fn step_elements() -> u32 {
    switch FORMAT {
        case F32, BF16: {
            return 8u;
        }
        case Q8X32, Q8X16: {
            return 16u;
        }
        default: {
            return 32u;
        }
    }
}

// ---- decoding -----------------------------------------------------------------------------

// Eight consecutive weights of a row.
struct W8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// Four words of bf16 pairs: element 2i in the low half of word i, 2i + 1 in the high half.
fn bf16_group(q: vec4<u32>) -> W8 {
    let even = bitcast<vec4<f32>>(q << vec4<u32>(16u));
    let odd = bitcast<vec4<f32>>(q & vec4<u32>(0xffff0000u));
    return W8(vec4<f32>(even.x, odd.x, even.y, odd.y), vec4<f32>(even.z, odd.z, even.w, odd.w));
}

// Two words of signed bytes, times their block's scale: w = d * q.
fn q8_group(w0: u32, w1: u32, d: f32) -> W8 {
    return W8(d * q8_exact(w0), d * q8_exact(w1));
}

// The eight nibbles of a word: element 2i in the low nibble of byte i, so nibble n is element n.
// w = d * q - m.
fn q4_group(word: u32, d: f32, m: f32) -> W8 {
    let q = q4_exact(word);
    return W8(d * q.lo - m, d * q.hi - m);
}

// Exact decoders without an int-to-float conversion (which runs at a quarter of the FMA rate on
// GPUs): a byte or nibble b placed in the mantissa of 2^23 is the float 2^23 + b exactly, and
// one subtraction gives b. A field can stay where it is in its word: at bits j .. j + n of the
// mantissa under an exponent of 2^(23 - j), it is the float 2^(23 - j) + b. So a word takes one
// shift (its upper half down: bit 23 belongs to the exponent) and one mask-and-or a field.

// The four signed bytes of a word, byte 0 first, exactly.
fn q8_exact(word: u32) -> vec4<f32> {
    let u = word ^ 0x80808080u;
    let b = vec4<u32>(u, u, u >> 16u, u >> 16u) & vec4<u32>(0xffu, 0xff00u, 0xffu, 0xff00u);
    let e = vec4<u32>(0x4b000000u, 0x47000000u, 0x4b000000u, 0x47000000u);
    return bitcast<vec4<f32>>(b | e) - vec4<f32>(8388736.0, 32896.0, 8388736.0, 32896.0);
}

// The eight nibbles of a word (element 2i in the low nibble of byte i), exactly.
fn q4_exact(word: u32) -> W8 {
    let mask = vec4<u32>(0xfu, 0xf0u, 0xf00u, 0xf000u);
    let e = vec4<u32>(0x4b000000u, 0x49000000u, 0x47000000u, 0x45000000u);
    let bias = vec4<f32>(8388608.0, 524288.0, 32768.0, 2048.0);
    let lo = bitcast<vec4<f32>>((vec4<u32>(word) & mask) | e) - bias;
    let hi = bitcast<vec4<f32>>((vec4<u32>(word >> 16u) & mask) | e) - bias;
    return W8(lo, hi);
}

// How the products read x: 0, as it is; 1 and 2, x holds the gate outputs g of a program's
// gated op (params.t rows of x_stride quads) and then its up outputs u (the same shape, from
// the first multiple of X_ALIGN elements past g: where a binding of them may start), and is
// read as h = act(g) * u, act the tanh GELU (1) or SiLU (2) as `elementwise_rows` computes
// it: the product after the gated op does the activation step as it reads.
override X_ACT: u32 = 0u;
override X_ALIGN: u32 = 4u;

// x[i .. i + 4], i a multiple of 4.
fn x_quad(i: u32) -> vec4<f32> {
    let g = x[i / 4u];
    if (X_ACT == 0u) {
        return g;
    }
    let up = (params.t * 4u * params.x_stride + X_ALIGN - 1u) / X_ALIGN * X_ALIGN;
    let u = x[(i + up) / 4u];
    var a = g;
    if (X_ACT == 1u) {
        a = 1.5957691216 * (g + 0.044715 * g * g * g);
    }
    return g / (1.0 + exp(-a)) * u;
}

// ---- gemv ---------------------------------------------------------------------------------

// Step s of weight row `row`, dotted with the step's x values (x0, x1, ... in order).
fn f32_dot(row: u32, s: u32, x0: vec4<f32>, x1: vec4<f32>) -> f32 {
    let i = row * params.row_quads + 2u * s;
    return dot(bitcast<vec4<f32>>(weights[i]), x0) + dot(bitcast<vec4<f32>>(weights[i + 1u]), x1);
}

fn bf16_dot(row: u32, s: u32, x0: vec4<f32>, x1: vec4<f32>) -> f32 {
    let w = bf16_group(weights[row * params.row_quads + s]);
    return dot(w.lo, x0) + dot(w.hi, x1);
}

fn q8_dot(row: u32, s: u32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
    let w = weights[row * params.row_quads + s];
    let d = scales[row * params.scale_row + select(s / 2u, s, FORMAT == Q8X16)];
    let a = q8_group(w.x, w.y, d);
    let b = q8_group(w.z, w.w, d);
    return dot(a.lo, x0) + dot(a.hi, x1) + dot(b.lo, x2) + dot(b.hi, x3);
}

// A q4x32 block as sum_k (d q_k - m) x_k = d sum_k q_k x_k - m sum_k x_k: the scale and the
// offset once a block, not once an element (`x_sum`, the block's sum of x, is shared by the
// rows). The exact nibbles keep the inner sum exact up to f32 rounding.
fn q4_dot(row: u32, s: u32, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>,
          x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>, x_sum: f32) -> f32 {
    let w = weights[row * params.row_quads + s];
    let si = row * params.scale_row + 2u * s;
    let d = scales[si];
    let m = scales[si + 1u];
    let a = q4_exact(w.x);
    let b = q4_exact(w.y);
    let c = q4_exact(w.z);
    let e = q4_exact(w.w);
    let qx = dot(a.lo, x0) + dot(a.hi, x1) + dot(b.lo, x2) + dot(b.hi, x3)
        + dot(c.lo, x4) + dot(c.hi, x5) + dot(e.lo, x6) + dot(e.hi, x7);
    return d * qx - m * x_sum;
}

// Step s of the four weight rows r against one row of x at offset xo: its x values are loaded
// once and shared by the four rows.
fn gemv_step(acc: vec4<f32>, r: vec4<u32>, s: u32, xo: u32) -> vec4<f32> {
    let k = xo + s * step_elements();
    var a = acc;
    switch FORMAT {
        case F32: {
            let x0 = x_quad(k);
            let x1 = x_quad(k + 4u);
            a += vec4<f32>(
                f32_dot(r.x, s, x0, x1), f32_dot(r.y, s, x0, x1), f32_dot(r.z, s, x0, x1), f32_dot(r.w, s, x0, x1),
            );
        }
        case BF16: {
            let x0 = x_quad(k);
            let x1 = x_quad(k + 4u);
            a += vec4<f32>(
                bf16_dot(r.x, s, x0, x1), bf16_dot(r.y, s, x0, x1), bf16_dot(r.z, s, x0, x1), bf16_dot(r.w, s, x0, x1),
            );
        }
        case Q8X32, Q8X16: {
            let x0 = x_quad(k);
            let x1 = x_quad(k + 4u);
            let x2 = x_quad(k + 8u);
            let x3 = x_quad(k + 12u);
            a += vec4<f32>(
                q8_dot(r.x, s, x0, x1, x2, x3), q8_dot(r.y, s, x0, x1, x2, x3),
                q8_dot(r.z, s, x0, x1, x2, x3), q8_dot(r.w, s, x0, x1, x2, x3),
            );
        }
        default: {
            let x0 = x_quad(k);
            let x1 = x_quad(k + 4u);
            let x2 = x_quad(k + 8u);
            let x3 = x_quad(k + 12u);
            let x4 = x_quad(k + 16u);
            let x5 = x_quad(k + 20u);
            let x6 = x_quad(k + 24u);
            let x7 = x_quad(k + 28u);
            let xs = dot((x0 + x1) + (x2 + x3) + ((x4 + x5) + (x6 + x7)), vec4<f32>(1.0));
            a += vec4<f32>(
                q4_dot(r.x, s, x0, x1, x2, x3, x4, x5, x6, x7, xs), q4_dot(r.y, s, x0, x1, x2, x3, x4, x5, x6, x7, xs),
                q4_dot(r.z, s, x0, x1, x2, x3, x4, x5, x6, x7, xs), q4_dot(r.w, s, x0, x1, x2, x3, x4, x5, x6, x7, xs),
            );
        }
    }
    return a;
}

var<workgroup> partial: array<vec4<f32>, WG>;

// Sums the LANES_K lanes' parts of the four rows' outputs and writes y[tr, rows] for the rows
// that exist. Called from uniform control flow (it has a barrier).
fn gemv_store(li: u32, part: vec4<f32>, rows: vec4<u32>, tr: u32) {
    let lane = li % LANES_K;
    var acc = part;
    if (LANES_K > 1u) {
        partial[li] = acc;
        workgroupBarrier();
        if (lane == 0u) {
            for (var i = 1u; i < LANES_K; i++) {
                acc += partial[li + i];
            }
        }
    }
    if (lane == 0u && tr < params.t) {
        let i = tr * params.n_out;
        let n_out = params.n_out;
        if (rows.x < n_out) { y[i + rows.x] = acc.x; }
        if (rows.y < n_out) { y[i + rows.y] = acc.y; }
        if (rows.z < n_out) { y[i + rows.z] = acc.z; }
        if (rows.w < n_out) { y[i + rows.w] = acc.w; }
    }
}

// A block of four weight rows (64 / LANES_K apart) against one row of x: the x values of a step
// are loaded once for the four rows.
struct Rows4 {
    rows: vec4<u32>,
    // `rows`, clamped to rows that exist (loads), where `rows` masks the stores.
    r: vec4<u32>,
}

fn rows4(first: u32, apart: u32) -> Rows4 {
    let rows = vec4<u32>(first) + vec4<u32>(0u, 1u, 2u, 3u) * apart;
    return Rows4(rows, min(rows, vec4<u32>(params.n_out - 1u)));
}

@compute @workgroup_size(64)
fn gemv(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lane = lid.x % LANES_K;
    let rows_apart = WG / LANES_K;
    let row0 = params.row_base + wid.x * (4u * GEMV_BLOCKS * rows_apart) + lid.x / LANES_K;
    let a = rows4(row0, rows_apart);
    let b = rows4(row0 + 4u * rows_apart, rows_apart);
    let tr = params.t_base + wid.y;
    let xo = min(tr, params.t - 1u) * (4u * params.x_stride);

    // Loop bounds are uniform across the workgroup (the barriers below need it).
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    let steps = (params.n_in + step_elements() - 1u) / step_elements();
    for (var s0 = 0u; s0 < steps; s0 += LANES_K) {
        let s = s0 + lane;
        if (s < steps) {
            acc_a = gemv_step(acc_a, a.r, s, xo);
            if (GEMV_BLOCKS > 1u) {
                acc_b = gemv_step(acc_b, b.r, s, xo);
            }
        }
    }

    gemv_store(lid.x, acc_a, a.rows, tr);
    if (GEMV_BLOCKS > 1u) {
        // `partial` is reused: every lane 0 has read its first use.
        workgroupBarrier();
        gemv_store(lid.x, acc_b, b.rows, tr);
    }
}

// ---- gemm ---------------------------------------------------------------------------------

// Eight consecutive x values of each of the four rows of x of an invocation.
struct X8 {
    a0: vec4<f32>,
    a1: vec4<f32>,
    b0: vec4<f32>,
    b1: vec4<f32>,
    c0: vec4<f32>,
    c1: vec4<f32>,
    d0: vec4<f32>,
    d1: vec4<f32>,
}

// x[o + k .. o + k + 8] for the four row offsets o.
fn x8(o: vec4<u32>, k: u32) -> X8 {
    return X8(
        x_quad(o.x + k), x_quad(o.x + k + 4u),
        x_quad(o.y + k), x_quad(o.y + k + 4u),
        x_quad(o.z + k), x_quad(o.z + k + 4u),
        x_quad(o.w + k), x_quad(o.w + k + 4u),
    );
}

// acc[c] += w . x_c for the four rows c of x.
fn fma8(acc: vec4<f32>, w: W8, v: X8) -> vec4<f32> {
    return acc + vec4<f32>(
        dot(w.lo, v.a0) + dot(w.hi, v.a1),
        dot(w.lo, v.b0) + dot(w.hi, v.b1),
        dot(w.lo, v.c0) + dot(w.hi, v.c1),
        dot(w.lo, v.d0) + dot(w.hi, v.d1),
    );
}

// One step s of weight row `row` against the four rows of x: the step's x values are loaded
// once by the caller and shared by all the invocation's weight rows.
fn f32_row(acc: vec4<f32>, row: u32, s: u32, v: X8) -> vec4<f32> {
    let i = row * params.row_quads + 2u * s;
    return fma8(acc, W8(bitcast<vec4<f32>>(weights[i]), bitcast<vec4<f32>>(weights[i + 1u])), v);
}

fn bf16_row(acc: vec4<f32>, row: u32, s: u32, v: X8) -> vec4<f32> {
    return fma8(acc, bf16_group(weights[row * params.row_quads + s]), v);
}

fn q8_row(acc: vec4<f32>, row: u32, s: u32, v0: X8, v1: X8) -> vec4<f32> {
    let w = weights[row * params.row_quads + s];
    let d = scales[row * params.scale_row + select(s / 2u, s, FORMAT == Q8X16)];
    return fma8(fma8(acc, q8_group(w.x, w.y, d), v0), q8_group(w.z, w.w, d), v1);
}

fn q4_row(acc: vec4<f32>, row: u32, s: u32, v0: X8, v1: X8, v2: X8, v3: X8) -> vec4<f32> {
    let w = weights[row * params.row_quads + s];
    let si = row * params.scale_row + 2u * s;
    let d = scales[si];
    let m = scales[si + 1u];
    var a = fma8(acc, q4_group(w.x, d, m), v0);
    a = fma8(a, q4_group(w.y, d, m), v1);
    a = fma8(a, q4_group(w.z, d, m), v2);
    return fma8(a, q4_group(w.w, d, m), v3);
}

// Accumulators of an invocation: one vec4 (its four rows of x) for each of its 8 weight rows.
struct Acc {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
    e: vec4<f32>,
    f: vec4<f32>,
    g: vec4<f32>,
    h: vec4<f32>,
}

// Rows of W of an invocation (8, 64 apart), clamped to the last row.
struct Rows {
    a: u32,
    b: u32,
    c: u32,
    d: u32,
    e: u32,
    f: u32,
    g: u32,
    h: u32,
}

// Step s of the invocation's weight rows over the four rows of x at offsets o.
fn gemm_step(acc: Acc, r: Rows, s: u32, o: vec4<u32>) -> Acc {
    var a = acc;
    let k = s * step_elements();
    switch FORMAT {
        case F32: {
            let v = x8(o, k);
            a.a = f32_row(a.a, r.a, s, v);
            a.b = f32_row(a.b, r.b, s, v);
            a.c = f32_row(a.c, r.c, s, v);
            a.d = f32_row(a.d, r.d, s, v);
            a.e = f32_row(a.e, r.e, s, v);
            a.f = f32_row(a.f, r.f, s, v);
            a.g = f32_row(a.g, r.g, s, v);
            a.h = f32_row(a.h, r.h, s, v);
        }
        case BF16: {
            let v = x8(o, k);
            a.a = bf16_row(a.a, r.a, s, v);
            a.b = bf16_row(a.b, r.b, s, v);
            a.c = bf16_row(a.c, r.c, s, v);
            a.d = bf16_row(a.d, r.d, s, v);
            a.e = bf16_row(a.e, r.e, s, v);
            a.f = bf16_row(a.f, r.f, s, v);
            a.g = bf16_row(a.g, r.g, s, v);
            a.h = bf16_row(a.h, r.h, s, v);
        }
        case Q8X32, Q8X16: {
            let v0 = x8(o, k);
            let v1 = x8(o, k + 8u);
            a.a = q8_row(a.a, r.a, s, v0, v1);
            a.b = q8_row(a.b, r.b, s, v0, v1);
            a.c = q8_row(a.c, r.c, s, v0, v1);
            a.d = q8_row(a.d, r.d, s, v0, v1);
            a.e = q8_row(a.e, r.e, s, v0, v1);
            a.f = q8_row(a.f, r.f, s, v0, v1);
            a.g = q8_row(a.g, r.g, s, v0, v1);
            a.h = q8_row(a.h, r.h, s, v0, v1);
        }
        default: {
            let v0 = x8(o, k);
            let v1 = x8(o, k + 8u);
            let v2 = x8(o, k + 16u);
            let v3 = x8(o, k + 24u);
            a.a = q4_row(a.a, r.a, s, v0, v1, v2, v3);
            a.b = q4_row(a.b, r.b, s, v0, v1, v2, v3);
            a.c = q4_row(a.c, r.c, s, v0, v1, v2, v3);
            a.d = q4_row(a.d, r.d, s, v0, v1, v2, v3);
            a.e = q4_row(a.e, r.e, s, v0, v1, v2, v3);
            a.f = q4_row(a.f, r.f, s, v0, v1, v2, v3);
            a.g = q4_row(a.g, r.g, s, v0, v1, v2, v3);
            a.h = q4_row(a.h, r.h, s, v0, v1, v2, v3);
        }
    }
    return a;
}

// Writes row `row` of W's outputs for the rows t0..t0+4 of x that exist.
fn store4(row: u32, t0: u32, acc: vec4<f32>) {
    let n_out = params.n_out;
    if (row >= n_out) {
        return;
    }
    let t = params.t;
    let i = t0 * n_out + row;
    y[i] = acc.x;
    if (t0 + 1u < t) { y[i + n_out] = acc.y; }
    if (t0 + 2u < t) { y[i + 2u * n_out] = acc.z; }
    if (t0 + 3u < t) { y[i + 3u * n_out] = acc.w; }
}

@compute @workgroup_size(64)
fn gemm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = params.row_base + wid.x * (8u * WG) + lid.x;
    let last = params.n_out - 1u;
    let r = Rows(
        min(row0, last), min(row0 + 1u * WG, last), min(row0 + 2u * WG, last), min(row0 + 3u * WG, last),
        min(row0 + 4u * WG, last), min(row0 + 5u * WG, last), min(row0 + 6u * WG, last), min(row0 + 7u * WG, last),
    );

    // Rows t0..t0+4 of x, clamped to the last one: the same for the whole workgroup.
    let t0 = params.t_base + wid.y * 4u;
    let o = min(vec4<u32>(t0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(params.t - 1u)) * 4u * params.x_stride;

    let zero = vec4<f32>(0.0);
    var acc = Acc(zero, zero, zero, zero, zero, zero, zero, zero);
    let steps = (params.n_in + step_elements() - 1u) / step_elements();
    for (var s = 0u; s < steps; s++) {
        acc = gemm_step(acc, r, s, o);
    }

    if (t0 < params.t) {
        store4(row0, t0, acc.a);
        store4(row0 + 1u * WG, t0, acc.b);
        store4(row0 + 2u * WG, t0, acc.c);
        store4(row0 + 3u * WG, t0, acc.d);
        store4(row0 + 4u * WG, t0, acc.e);
        store4(row0 + 5u * WG, t0, acc.f);
        store4(row0 + 6u * WG, t0, acc.g);
        store4(row0 + 7u * WG, t0, acc.h);
    }
}

// ---- gemm_tiled ---------------------------------------------------------------------------

// t >= 4 on GPUs. A workgroup of 256 computes a 64 x 64 tile of y (64 rows of W, 64 rows of
// x), 4 x 4 outputs an invocation, over the columns in steps of 32 staged in workgroup memory:
// each invocation decodes 8 weights and loads 8 x values a step, so every weight is read from
// memory once per 64 rows of x (not once per 4, as in `gemm`) and neighbouring invocations
// read neighbouring words. Reads past a row's data or x's padded row give zeros.

const TILE: u32 = 64u;
const TK: u32 = 32u;

// A step of W's tile and of x's, transposed: a vec4 holds 4 consecutive rows of one column,
// W's at 0 and x's at 512, small[base + k * 16 + r / 4][r % 4] = row r, column k. (`gemm_wide`
// has its own, larger array: sharing one would cost this kernel half its occupancy; and WGSL
// cannot pass a workgroup array to a function, hence a staging function for each.)
var<workgroup> small: array<vec4<f32>, 1024>;

// Stores eight values of tile row `r`, columns k .. k + 8, into `small` at `base`.
fn stage8_small(base: u32, r: u32, k: u32, v: W8) {
    let i = base + k * 16u + r / 4u;
    let c = r % 4u;
    small[i][c] = v.lo.x;
    small[i + 16u][c] = v.lo.y;
    small[i + 32u][c] = v.lo.z;
    small[i + 48u][c] = v.lo.w;
    small[i + 64u][c] = v.hi.x;
    small[i + 80u][c] = v.hi.y;
    small[i + 96u][c] = v.hi.z;
    small[i + 112u][c] = v.hi.w;
}

// Elements of a row in one quad of W's data.
fn quad_elements() -> u32 {
    switch FORMAT {
        case F32: {
            return 4u;
        }
        case BF16: {
            return 8u;
        }
        case Q8X32, Q8X16: {
            return 16u;
        }
        default: {
            return 32u;
        }
    }
}

// The eight weights of row `row` from element k (a multiple of 8), zeros past the row's data.
fn w8_at(row: u32, k: u32) -> W8 {
    let zero = vec4<f32>(0.0);
    if (k >= params.row_quads * quad_elements()) {
        return W8(zero, zero);
    }
    let base = row * params.row_quads;
    switch FORMAT {
        case F32: {
            let i = base + k / 4u;
            return W8(bitcast<vec4<f32>>(weights[i]), bitcast<vec4<f32>>(weights[i + 1u]));
        }
        case BF16: {
            return bf16_group(weights[base + k / 8u]);
        }
        case Q8X32, Q8X16: {
            let s = k / 16u;
            let w = weights[base + s];
            let d = scales[row * params.scale_row + select(s / 2u, s, FORMAT == Q8X16)];
            if ((k & 8u) == 0u) {
                return q8_group(w.x, w.y, d);
            }
            return q8_group(w.z, w.w, d);
        }
        default: {
            let s = k / 32u;
            let w = weights[base + s];
            let si = row * params.scale_row + 2u * s;
            return q4_group(w[(k % 32u) / 8u], scales[si], scales[si + 1u]);
        }
    }
}

// x[row at element offset xo, k .. k + 8] (k a multiple of 8), zeros past the row's padding.
fn x8_at(xo: u32, k: u32) -> W8 {
    let zero = vec4<f32>(0.0);
    if (k >= 4u * params.x_stride) {
        return W8(zero, zero);
    }
    return W8(x_quad(xo + k), x_quad(xo + k + 4u));
}

// y[t, row] for the rows of W r..r+4 (the lanes of acc) that exist, t < params.t, in the
// plane of y from element `plane` (0 but for `gemm_wide` split over k).
fn store_tile(plane: u32, t: u32, r: u32, acc: vec4<f32>) {
    if (t >= params.t) {
        return;
    }
    let n_out = params.n_out;
    let i = plane + t * n_out + r;
    if (r < n_out) { y[i] = acc.x; }
    if (r + 1u < n_out) { y[i + 1u] = acc.y; }
    if (r + 2u < n_out) { y[i + 2u] = acc.z; }
    if (r + 3u < n_out) { y[i + 3u] = acc.w; }
}

@compute @workgroup_size(256)
fn gemm_tiled(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = params.row_base + wid.x * TILE;
    let t0 = params.t_base + wid.y * TILE;
    // Staging: tile row li / 4 of W and of x, columns (li % 4) * 8 .. + 8 of the step.
    let lr = li / 4u;
    let lk = (li % 4u) * 8u;
    let wrow = min(row0 + lr, params.n_out - 1u);
    let xo = min(t0 + lr, params.t - 1u) * 4u * params.x_stride;
    // Computing: rows 4 * (li % 16) .. + 4 of W's tile against rows 4 * (li / 16) .. + 4 of x's.
    let cr = li % 16u;
    let ct = li / 16u;

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let steps = (params.n_in + TK - 1u) / TK;
    for (var s = 0u; s < steps; s++) {
        let k = s * TK + lk;
        stage8_small(0u, lr, lk, w8_at(wrow, k));
        stage8_small(512u, lr, lk, x8_at(xo, k));
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let w = small[kk * 16u + cr];
            let v = small[512u + kk * 16u + ct];
            acc0 += w * v.x;
            acc1 += w * v.y;
            acc2 += w * v.z;
            acc3 += w * v.w;
        }
        workgroupBarrier();
    }

    let r = row0 + 4u * cr;
    let t = t0 + 4u * ct;
    store_tile(0u, t, r, acc0);
    store_tile(0u, t + 1u, r, acc1);
    store_tile(0u, t + 2u, r, acc2);
    store_tile(0u, t + 3u, r, acc3);
}

// ---- gemm_wide ------------------------------------------------------------------------------

// Large t on GPUs. A workgroup of 256 computes a 128 x 128 tile of y (128 rows of W, 128 rows
// of x), 8 x 8 outputs an invocation: rows 4 * tx .. + 4 and 64 + 4 * tx .. + 4 of W's tile,
// likewise of x's with ty, so that a step of one column loads four vec4 from workgroup memory
// for 64 FMAs. The columns go in steps of 16 through two buffers: while a step is computed
// from one, the next step's weights (decoded) and x values are already loaded into registers
// (a step of FMAs, ~2000 cycles, hides their latency), and are stored into the other after it;
// one barrier a step. Each invocation stages eight values of one row of W and of x a step; a
// warp's 32 stores go to 32 consecutive rows (distinct banks).
//
// Split over k: a dispatch of nz > 1 workgroups in z (few tiles, long rows: a product with few
// output rows would leave most of a large GPU idle) gives workgroup z the z-th of nz runs of
// whole steps, and its tile's partial sums go to plane z of y (t * n_out values a plane). The
// planes are summed afterwards (`sum_planes`).

const WT: u32 = 128u;
const WK: u32 = 16u;
// vec4 of one buffer: WK columns of 128 rows.
const WBUF: u32 = 512u;
// Where x's buffers start in `tiles`.
const WX: u32 = 1024u;

// The steps of W's tile and of x's, transposed: W's buffer b at b * WBUF, x's at WX + b * WBUF,
// each tiles[at + k * 32 + r / 4][r % 4] = row r, column k of the step.
var<workgroup> tiles: array<vec4<f32>, 2048>;

// Stores eight values of tile row `r`, columns k .. k + 8, into `tiles` at `at`.
fn stage8(at: u32, r: u32, k: u32, v: W8) {
    let i = at + k * 32u + r / 4u;
    let c = r % 4u;
    tiles[i][c] = v.lo.x;
    tiles[i + 32u][c] = v.lo.y;
    tiles[i + 64u][c] = v.lo.z;
    tiles[i + 96u][c] = v.lo.w;
    tiles[i + 128u][c] = v.hi.x;
    tiles[i + 160u][c] = v.hi.y;
    tiles[i + 192u][c] = v.hi.z;
    tiles[i + 224u][c] = v.hi.w;
}

// Outputs of 4 rows of W (the lanes) against 4 rows of x (t0 .. t3).
struct Quad4 {
    t0: vec4<f32>,
    t1: vec4<f32>,
    t2: vec4<f32>,
    t3: vec4<f32>,
}

fn outer4(q: Quad4, w: vec4<f32>, v: vec4<f32>) -> Quad4 {
    return Quad4(
        fma(w, vec4<f32>(v.x), q.t0), fma(w, vec4<f32>(v.y), q.t1),
        fma(w, vec4<f32>(v.z), q.t2), fma(w, vec4<f32>(v.w), q.t3),
    );
}

// y[t .. t + 4, r .. r + 4] from a Quad4, for the rows of each that exist.
fn store_quad(plane: u32, t: u32, r: u32, q: Quad4) {
    store_tile(plane, t, r, q.t0);
    store_tile(plane, t + 1u, r, q.t1);
    store_tile(plane, t + 2u, r, q.t2);
    store_tile(plane, t + 3u, r, q.t3);
}

@compute @workgroup_size(256)
fn gemm_wide(
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row0 = params.row_base + wid.x * WT;
    let t0 = params.t_base + wid.y * WT;
    // Staging: tile row li % 128 of W and of x, columns (li / 128) * 8 .. + 8 of the step.
    let lr = li % WT;
    let lk = (li / WT) * 8u;
    let wrow = min(row0 + lr, params.n_out - 1u);
    let xo = min(t0 + lr, params.t - 1u) * 4u * params.x_stride;
    let tx = li % 16u;
    let ty = li / 16u;

    let zero = vec4<f32>(0.0);
    var aa = Quad4(zero, zero, zero, zero);
    var ab = Quad4(zero, zero, zero, zero);
    var ba = Quad4(zero, zero, zero, zero);
    var bb = Quad4(zero, zero, zero, zero);

    // This workgroup's run of steps: first .. first + steps.
    let all = (params.n_in + WK - 1u) / WK;
    let run = (all + nwg.z - 1u) / nwg.z;
    let first = min(wid.z * run, all);
    let steps = min(run, all - first);
    let k0 = first * WK;
    var wv = w8_at(wrow, k0 + lk);
    var xv = x8_at(xo, k0 + lk);
    stage8(0u, lr, lk, wv);
    stage8(WX, lr, lk, xv);
    workgroupBarrier();
    for (var s = 0u; s < steps; s++) {
        let cur = (s % 2u) * WBUF;
        let more = s + 1u < steps;
        if (more) {
            let k = k0 + (s + 1u) * WK + lk;
            wv = w8_at(wrow, k);
            xv = x8_at(xo, k);
        }
        for (var kk = 0u; kk < WK; kk++) {
            let i = cur + kk * 32u;
            let w0 = tiles[i + tx];
            let w1 = tiles[i + 16u + tx];
            let v0 = tiles[WX + i + ty];
            let v1 = tiles[WX + i + 16u + ty];
            aa = outer4(aa, w0, v0);
            ab = outer4(ab, w1, v0);
            ba = outer4(ba, w0, v1);
            bb = outer4(bb, w1, v1);
        }
        if (more) {
            let next = (1u - s % 2u) * WBUF;
            stage8(next, lr, lk, wv);
            stage8(WX + next, lr, lk, xv);
        }
        workgroupBarrier();
    }

    let r = row0 + 4u * tx;
    let t = t0 + 4u * ty;
    let plane = wid.z * params.t * params.n_out;
    store_quad(plane, t, r, aa);
    store_quad(plane, t, r + 64u, ab);
    store_quad(plane, t + 64u, r, ba);
    store_quad(plane, t + 64u, r + 64u, bb);
}

// ---- the sums of a product split over k -----------------------------------------------------

// Invocations of a workgroup that reduces a run of values (`rms_norm_runs`): a row's loads in
// flight at once (a decode step's rows of 640 took ten dependent rounds with WG).
const PAIR_WG: u32 = 256u;

var<workgroup> norm_sums: array<f32, PAIR_WG>;

// The sum of `v` over a workgroup of `size` invocations (a power of two, at most PAIR_WG),
// through `norm_sums` (from uniform control flow: it has barriers).
fn workgroup_total(li: u32, v: f32, size: u32) -> f32 {
    norm_sums[li] = v;
    workgroupBarrier();
    for (var k = size / 2u; k > 0u; k /= 2u) {
        if (li < k) {
            norm_sums[li] += norm_sums[li + k];
        }
        workgroupBarrier();
    }
    return norm_sums[0];
}

// x[i] summed over params.x_stride planes of params.t * params.row_quads values.
fn plane_sum(i: u32) -> f32 {
    return planes_at(i, params.t * params.row_quads);
}

// x[i] summed over params.x_stride planes of `plane` values.
fn planes_at(i: u32, plane: u32) -> f32 {
    var v = x[i / 4u][i % 4u];
    for (var p = 1u; p < params.x_stride; p++) {
        let at = p * plane + i;
        v += x[at / 4u][at % 4u];
    }
    return v;
}

// y[r, j] = the sum of x's planes at [r, j]: the partial sums of a product split over k
// (n_out, row_quads: the width of a row). One invocation an element.
@compute @workgroup_size(64)
fn sum_planes(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let j = gid.x;
    if (r >= params.t || j >= params.n_out) {
        return;
    }
    y[r * params.n_out + j] = plane_sum(r * params.row_quads + j);
}

// y[r, row_base + j] = x[r, j]: the product of one part of a weight held in parts (its rows
// from row_base; x: t rows of n_in values) placed among the whole product's columns (y: rows
// of n_out values). One invocation an element.
@compute @workgroup_size(64)
fn place_columns(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let j = gid.x;
    if (r >= params.t || j >= params.n_in) {
        return;
    }
    let i = r * params.n_in + j;
    y[r * params.n_out + params.row_base + j] = x[i / 4u][i % 4u];
}

// ---- the ops of a program (`wit/gpu.wit`'s `op`) between its products ----------------------

// Each writes a value of `params.t` rows of `params.n_out` values, row r = params.t_base + wid.y,
// row-major and unpadded, from operands in the same layout: a from x, b from `scales`, a vector
// (a bias, a norm's weight) from `weights`. The program's own elementwise code, in row_base
// (`elementwise_rows`):
const OP_ADD: u32 = 0u;
const OP_MUL: u32 = 1u;
const OP_SCALE: u32 = 2u;
const OP_BIAS: u32 = 3u;
const OP_GELU_TANH: u32 = 4u;
const OP_SILU: u32 = 5u;
const OP_SOFTCAP: u32 = 6u;

// cap * tanh(x / cap), as ops/src/op.rs's `softcap` reads it: tanh(y) = (1 - e) / (1 + e) with
// e = e^(-2|y|) (no overflow for any input), and its series to y^7 below |y| = 1/8, where 1 - e
// would cancel. (matmul.wgsl and attention.wgsl each hold this function, word for word.)
fn softcap(x: f32, cap: f32) -> f32 {
    let y = x / cap;
    var t: f32;
    if abs(y) < 0.125 {
        let y2 = y * y;
        t = y * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0 - y2 * (17.0 / 315.0))));
    } else {
        let e = exp(-2.0 * abs(y));
        t = sign(y) * ((1.0 - e) / (1.0 + e));
    }
    return cap * t;
}

// x's element i (bound as quads).
fn x_at(i: u32) -> f32 {
    return x[i / 4u][i % 4u];
}

// The weights' element i, an f32.
fn weight_at(i: u32) -> f32 {
    return bitcast<f32>(weights[i / 4u][i % 4u]);
}

// add, mul: y = a op b; scale: y = a * bitcast<f32>(x_stride); softcap: y = softcap(a, the cap
// bitcast<f32>(x_stride)); bias: y = a + w[column]; the
// gated ops: y = act(a) * b, act(g) = g / (1 + e^-a), with a = 2 sqrt(2 / pi) (g + 0.044715 g^3)
// for the tanh GELU (0.5 g (1 + tanh(a / 2)) rewritten: no overflow, no tanh) and a = g for
// SiLU, as the guest's own kernel computes it. One invocation an element.
@compute @workgroup_size(64)
fn elementwise_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let j = gid.x;
    let n = params.n_out;
    if (r >= params.t || j >= n) {
        return;
    }
    let i = r * n + j;
    let a = x_at(i);
    var v = 0.0;
    switch params.row_base {
        case OP_ADD: {
            v = a + scales[i];
        }
        case OP_MUL: {
            v = a * scales[i];
        }
        case OP_SCALE: {
            v = a * bitcast<f32>(params.x_stride);
        }
        case OP_BIAS: {
            v = a + weight_at(j);
        }
        case OP_SOFTCAP: {
            v = softcap(a, bitcast<f32>(params.x_stride));
        }
        case OP_GELU_TANH: {
            let g = 1.5957691216 * (a + 0.044715 * a * a * a);
            v = a / (1.0 + exp(-g)) * scales[i];
        }
        default: {
            v = a / (1.0 + exp(-a)) * scales[i];
        }
    }
    y[i] = v;
}

// The rms-norm op: y = v / sqrt(mean(v^2) + eps) * (w + offset) over each run of n_in values of
// a row (w: 0 without a weight), eps and offset the bits of row_base and x_stride. Flags in
// scale_row (NORM_OP_*): with ADD, y = that + b, b from `scales` (a norm and the add after it);
// with ROTATE, each run (a head) is then turned as `rotate_rows` turns it, by the row's table in
// `scales` of row_quads values (a head norm and the rotation after it); with NEXT (and ADD, a
// run the whole row, no offset: x_stride is free), that sum y is normed again, by the weights
// from element x_stride on, into y from element row_quads on (a norm after a product, the
// residual add and the norm before the next product). One workgroup a run (wid.x) of a row.
const NORM_OP_WEIGHT: u32 = 1u;
const NORM_OP_ADD: u32 = 2u;
const NORM_OP_ROTATE: u32 = 4u;
const NORM_OP_PAIRS: u32 = 8u;
const NORM_OP_NEXT: u32 = 16u;

@compute @workgroup_size(256)
fn rms_norm_runs(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    if (r >= params.t) {
        return;
    }
    let n = params.n_in;
    let flags = params.scale_row;
    let at = r * params.n_out + wid.x * n;
    var ss = 0.0;
    for (var j = li; j < n; j += PAIR_WG) {
        let v = x_at(at + j);
        ss += v * v;
    }
    let eps = bitcast<f32>(params.row_base);
    let scale = 1.0 / sqrt(workgroup_total(li, ss, PAIR_WG) / f32(n) + eps);
    let next = (flags & NORM_OP_NEXT) != 0u;
    let offset = select(bitcast<f32>(params.x_stride), 0.0, next);
    let turned = params.row_quads;
    let half = turned / 2u;
    var ss2 = 0.0;
    for (var j = li; j < n; j += PAIR_WG) {
        var v = x_at(at + j) * scale * norm_weight(j, offset);
        if ((flags & NORM_OP_ROTATE) != 0u && j < turned) {
            var pair = j % half;
            var first = j < half;
            var k = select(j - half, j + half, first);
            if ((flags & NORM_OP_PAIRS) != 0u) {
                pair = j / 2u;
                first = j % 2u == 0u;
                k = select(j - 1u, j + 1u, first);
            }
            let o = x_at(at + k) * scale * norm_weight(k, offset);
            let cos = scales[r * turned + pair];
            let sin = scales[r * turned + half + pair];
            v = select(o * sin + v * cos, v * cos - o * sin, first);
        }
        if ((flags & NORM_OP_ADD) != 0u) {
            v = scales[at + j] + v;
        }
        y[at + j] = v;
        ss2 += v * v;
    }
    if (next) {
        // Every invocation has read the first total before `norm_sums` is written again.
        workgroupBarrier();
        let scale2 = 1.0 / sqrt(workgroup_total(li, ss2, PAIR_WG) / f32(n) + eps);
        for (var j = li; j < n; j += PAIR_WG) {
            y[turned + at + j] = y[at + j] * scale2 * weight_at(params.x_stride + j);
        }
    }
}

// The factor of value j of a run in `rms_norm_runs`: w[j] + offset, or offset without a weight.
fn norm_weight(j: u32, offset: f32) -> f32 {
    if ((params.scale_row & NORM_OP_WEIGHT) != 0u) {
        return weight_at(j) + offset;
    }
    return offset;
}

// The rotate op: the first n_in values of each head (of row_quads values) of a row turned by
// the row's table in `scales` (n_in / 2 cosines, then as many sines), as halves (scale_row 0:
// value j with j + n_in / 2) or pairs (1: 2j with 2j + 1); the rest of each head as it is. One
// invocation an element.
@compute @workgroup_size(64)
fn rotate_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let c = gid.x;
    let n = params.n_out;
    if (r >= params.t || c >= n) {
        return;
    }
    let i = r * n + c;
    let j = c % params.row_quads;
    let turned = params.n_in;
    if (j >= turned) {
        y[i] = x_at(i);
        return;
    }
    let half = turned / 2u;
    var pair = j % half;
    var first = j < half;
    var other = i + half;
    if (!first) {
        other = i - half;
    }
    if (params.scale_row == 1u) {
        pair = j / 2u;
        first = j % 2u == 0u;
        other = select(i - 1u, i + 1u, first);
    }
    let cos = scales[r * turned + pair];
    let sin = scales[r * turned + half + pair];
    let v = x_at(i);
    let o = x_at(other);
    // (a, b) -> (a c - b s, a s + b c)
    y[i] = select(o * sin + v * cos, v * cos - o * sin, first);
}

// Copies rows: row row_quads + r of x (rows of n_out values) to row (scale_row + r) % x_stride
// of y, for r < t, and where n_in is not 0 the same row of `scales` to that row of y from
// element n_in on: a program's cache writes (keys and values into a kv-cache's ring, the
// values from n_in) and its last rows. One invocation an element.
@compute @workgroup_size(64)
fn copy_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let j = gid.x;
    let n = params.n_out;
    if (r >= params.t || j >= n) {
        return;
    }
    let to = (params.scale_row + r) % params.x_stride;
    let src = (params.row_quads + r) * n + j;
    y[to * n + j] = x_at(src);
    if (params.n_in != 0u) {
        y[params.n_in + to * n + j] = scales[src];
    }
}

// Scatters rows: for entry r < t of the host's table in `weights`, (k, v, row, 0), row `row`
// of x (rows of n_out values) to y from element k and, unless v is 0xffffffff, the same row of
// `scales` to y from element v: the cache writes of a program's batch of sequences whose
// kv-caches share one buffer (each row's key and value row in its sequence's ring), and the
// last rows of a batch's sequences. One invocation an element.
@compute @workgroup_size(64)
fn scatter_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let j = gid.x;
    let n = params.n_out;
    if (r >= params.t || j >= n) {
        return;
    }
    let to = weights[r];
    let src = to.z * n + j;
    y[to.x + j] = x_at(src);
    if (to.y != 0xffffffffu) {
        y[to.y + j] = scales[src];
    }
}

// A `top-k` op's candidates: the rows of x (t rows of n_out values) in chunks of TOP_CHUNK
// values, one workgroup a (chunk, row), each writing its chunk's first `row_quads` (k, at most
// TOP_CHUNK) in the contract's order: larger values first, of equal values the lower column
// first, NaN below every number (both zeros one value). Entry e of chunk c of row r is
// y[2 * ((r * chunks + c) * k + e)] = the value, [.. + 1] = its column as an f32 (exact: the
// host sends rows of at most 2^24), or -1 where the chunk has fewer than k values. The top k of
// a row are the top k of its chunks' candidates, which the host takes from them (each chunk's
// in order, chunk after chunk: equal values come by column). The chunk is sorted whole
// (bitonic, in workgroup memory): 55 steps, a barrier each, whatever k.
const TOP_WG: u32 = 256u;
const TOP_CHUNK: u32 = 1024u;
var<workgroup> top_keys: array<u32, TOP_CHUNK>;
var<workgroup> top_cols: array<u32, TOP_CHUNK>;

// A key that orders values as u32s: a larger value a larger key, -0 and +0 one key, NaN 0
// (below every number's).
fn top_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    let magnitude = b & 0x7fffffffu;
    if (magnitude > 0x7f800000u) {
        return 0u;
    }
    if (magnitude == 0u) {
        return 0x80000000u;
    }
    return select(b | 0x80000000u, ~b, b != magnitude);
}

// Whether entry a comes before entry b: a larger key, or an equal key and a lower column.
fn top_before(a: u32, b: u32) -> bool {
    let ka = top_keys[a];
    let kb = top_keys[b];
    return ka > kb || (ka == kb && top_cols[a] < top_cols[b]);
}

// `top_k_chunks` for k = 1 (a greedy choice): the chunk's first entry in the same order, each
// invocation's first of its values, then the workgroup's, pairwise (8 steps, not a sort's 55).
fn top_first(li: u32, r: u32, n: u32, chunk: u32, chunks: u32) {
    var best_key = 0u;
    var best_col = 0xffffffffu;
    for (var e = li; e < TOP_CHUNK; e += TOP_WG) {
        let col = chunk * TOP_CHUNK + e;
        if (r < params.t && col < n) {
            let key = top_key(x_at(r * n + col));
            if (key > best_key || (key == best_key && col < best_col)) {
                best_key = key;
                best_col = col;
            }
        }
    }
    top_keys[li] = best_key;
    top_cols[li] = best_col;
    workgroupBarrier();
    for (var w = TOP_WG / 2u; w > 0u; w = w / 2u) {
        if (li < w && top_before(li + w, li)) {
            top_keys[li] = top_keys[li + w];
            top_cols[li] = top_cols[li + w];
        }
        workgroupBarrier();
    }
    if (li == 0u && r < params.t) {
        let at = 2u * (r * chunks + chunk);
        let col = top_cols[0];
        if (col < n) {
            y[at] = x_at(r * n + col);
            y[at + 1u] = f32(col);
        } else {
            y[at] = 0.0;
            y[at + 1u] = -1.0;
        }
    }
}

@compute @workgroup_size(256)
fn top_k_chunks(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = params.t_base + wid.y;
    let n = params.n_out;
    let chunk = wid.x;
    let chunks = (n + TOP_CHUNK - 1u) / TOP_CHUNK;
    let k = min(params.row_quads, TOP_CHUNK);
    if (k == 1u) {
        top_first(li, r, n, chunk, chunks);
        return;
    }
    // Padding: key 0 and the highest column, after every NaN.
    for (var e = li; e < TOP_CHUNK; e += TOP_WG) {
        let col = chunk * TOP_CHUNK + e;
        var key = 0u;
        var at = 0xffffffffu;
        if (r < params.t && col < n) {
            key = top_key(x_at(r * n + col));
            at = col;
        }
        top_keys[e] = key;
        top_cols[e] = at;
    }
    workgroupBarrier();
    // Sorted so that each entry comes before the ones after it.
    for (var size = 2u; size <= TOP_CHUNK; size = size * 2u) {
        for (var stride = size / 2u; stride > 0u; stride = stride / 2u) {
            for (var e = li; e < TOP_CHUNK / 2u; e += TOP_WG) {
                let a = 2u * stride * (e / stride) + e % stride;
                let b = a + stride;
                // Runs of `size` alternate in direction until the last, which is in order.
                let forward = (a & size) == 0u;
                if (top_before(b, a) == forward) {
                    let key = top_keys[a];
                    let col = top_cols[a];
                    top_keys[a] = top_keys[b];
                    top_cols[a] = top_cols[b];
                    top_keys[b] = key;
                    top_cols[b] = col;
                }
            }
            workgroupBarrier();
        }
    }
    if (r >= params.t) {
        return;
    }
    for (var e = li; e < k; e += TOP_WG) {
        let at = 2u * ((r * chunks + chunk) * k + e);
        let col = top_cols[e];
        if (col < n) {
            y[at] = x_at(r * n + col);
            y[at + 1u] = f32(col);
        } else {
            y[at] = 0.0;
            y[at + 1u] = -1.0;
        }
    }
}
