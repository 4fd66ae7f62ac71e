// gemm_large: y = x @ W^T for products of many tiles on GPUs with 48 KiB of workgroup memory.
// Not a module of its own: the host builds matmul.wgsl + this file (whose bindings, Params,
// `w8_at`, `x8_at`, `Quad4`, `outer4`, `store_quad` and WK it uses), and runs it only where the
// adapter offers that much workgroup memory and the product has enough tiles to fill the GPU.
//
// `gemm_wide` with twice the rows of x: a workgroup of 256 computes a 128 x 256 tile of y (128
// rows of W, 256 rows of x), 8 x 16 outputs an invocation: rows 4 * tx .. + 4 and 64 + 4 * tx ..
// + 4 of W's tile, rows 4 * ty + 64 * j .. + 4 (j = 0..4) of x's. A column of a step loads six
// vec4 from workgroup memory for 128 FMAs (`gemm_wide`: four for 64), and a step's staging
// (global loads, stores, barrier) is shared by twice the FMAs. The price: ~190 registers an
// invocation, so one workgroup an SM, and half as many tiles; so only for products of many
// tiles (the host's choice: t = 512 on [4096, 4096] is 64 tiles, 18 TFLOP/s against
// `gemm_wide`'s 30 on the H200; 4096^3 is 512 tiles, 36-38 against 30). Steps of 16 columns
// through two buffers, one barrier a step, as in `gemm_wide`; the next step's values are loaded
// unconditionally (past the last step, `w8_at` and `x8_at` give zeros). Not split over k.

// vec4 of one buffer: W's 16 columns of 128 rows, then x's 16 of 256.
const LBUF: u32 = 1536u;
const LX: u32 = 512u;

// The steps of W's tile and of x's, transposed: buffer b at at = b * LBUF, W's 128 rows at
// large[at + k * 32 + r / 4][r % 4] (row r, column k), x's 256 at large[at + LX + k * 64 + r / 4].
var<workgroup> large: array<vec4<f32>, 3072>;

// Stores eight values of tile row `r` (of a tile of `rows` rows), columns k .. k + 8, into
// `large` at `at`: large[at + k * rows / 4 + r / 4][r % 4] = row r, column k.
fn stage8_large(at: u32, rows: u32, r: u32, k: u32, v: W8) {
    let q = rows / 4u;
    let i = at + k * q + r / 4u;
    let c = r % 4u;
    large[i][c] = v.lo.x;
    large[i + q][c] = v.lo.y;
    large[i + 2u * q][c] = v.lo.z;
    large[i + 3u * q][c] = v.lo.w;
    large[i + 4u * q][c] = v.hi.x;
    large[i + 5u * q][c] = v.hi.y;
    large[i + 6u * q][c] = v.hi.z;
    large[i + 7u * q][c] = v.hi.w;
}

@compute @workgroup_size(256)
fn gemm_large(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = params.row_base + wid.x * 128u;
    let t0 = params.t_base + wid.y * 256u;
    // Staging: row li % 128 of W's tile, columns (li / 128) * 8 .. + 8 of the step; row li of
    // x's, all 16 columns.
    let lk = (li / 128u) * 8u;
    let wrow = min(row0 + li % 128u, params.n_out - 1u);
    let xo = min(t0 + li, params.t - 1u) * 4u * params.x_stride;
    let tx = li % 16u;
    let ty = li / 16u;

    let zero = vec4<f32>(0.0);
    var a0 = Quad4(zero, zero, zero, zero);
    var a1 = Quad4(zero, zero, zero, zero);
    var a2 = Quad4(zero, zero, zero, zero);
    var a3 = Quad4(zero, zero, zero, zero);
    var b0 = Quad4(zero, zero, zero, zero);
    var b1 = Quad4(zero, zero, zero, zero);
    var b2 = Quad4(zero, zero, zero, zero);
    var b3 = Quad4(zero, zero, zero, zero);

    let steps = (params.n_in + WK - 1u) / WK;
    var wv = w8_at(wrow, lk);
    var xv0 = x8_at(xo, 0u);
    var xv1 = x8_at(xo, 8u);
    stage8_large(0u, 128u, li % 128u, lk, wv);
    stage8_large(LX, 256u, li, 0u, xv0);
    stage8_large(LX, 256u, li, 8u, xv1);
    workgroupBarrier();
    for (var s = 0u; s < steps; s++) {
        let cur = (s % 2u) * LBUF;
        let k = (s + 1u) * WK;
        wv = w8_at(wrow, k + lk);
        xv0 = x8_at(xo, k);
        xv1 = x8_at(xo, k + 8u);
        for (var kk = 0u; kk < WK; kk++) {
            let i = cur + kk * 32u;
            let j = cur + LX + kk * 64u + ty;
            let w0 = large[i + tx];
            let w1 = large[i + 16u + tx];
            let v0 = large[j];
            let v1 = large[j + 16u];
            let v2 = large[j + 32u];
            let v3 = large[j + 48u];
            a0 = outer4(a0, w0, v0);
            a1 = outer4(a1, w0, v1);
            a2 = outer4(a2, w0, v2);
            a3 = outer4(a3, w0, v3);
            b0 = outer4(b0, w1, v0);
            b1 = outer4(b1, w1, v1);
            b2 = outer4(b2, w1, v2);
            b3 = outer4(b3, w1, v3);
        }
        let next = (1u - s % 2u) * LBUF;
        stage8_large(next, 128u, li % 128u, lk, wv);
        stage8_large(next + LX, 256u, li, 0u, xv0);
        stage8_large(next + LX, 256u, li, 8u, xv1);
        workgroupBarrier();
    }

    let r = row0 + 4u * tx;
    let t = t0 + 4u * ty;
    store_quad(0u, t, r, a0);
    store_quad(0u, t + 64u, r, a1);
    store_quad(0u, t + 128u, r, a2);
    store_quad(0u, t + 192u, r, a3);
    store_quad(0u, t, r + 64u, b0);
    store_quad(0u, t + 64u, r + 64u, b1);
    store_quad(0u, t + 128u, r + 64u, b2);
    store_quad(0u, t + 192u, r + 64u, b3);
}
