// gemm_coop: y = x @ W^T on cooperative matrices (tensor cores), for t >= 128 on adapters that
// offer 16x16x16 f16 x f16 + f32 matrices to subgroups of 32. Not a module of its own: the host
// builds "enable f16; enable wgpu_cooperative_matrix;" + matmul.wgsl + this file, so that the
// bindings, Params and the loaders (`w8_at`, `x8_at`) are matmul.wgsl's, and builds it only on
// such adapters.
//
// A workgroup of 256 (8 subgroups) computes a 128 x 128 tile of y (128 rows of x, 128 rows of
// W) over the columns in steps of 32. Each step, every invocation decodes 16 weights of one
// row and loads 16 x values of one row, converts them to f16 and stores them into workgroup
// memory (two buffers: the next step's values are loaded into registers while the current
// step is multiplied, as in `gemm_wide`). Subgroup g multiplies rows 64 * (g / 4) .. + 64 of
// x's tile by rows 32 * (g % 4) .. + 32 of W's: 4 x 2 matrices of 16 x 16, accumulated in f32.
// Tiles inside y are stored straight from the matrices; at y's edges each matrix goes through
// workgroup memory and only the elements inside y are written. Split over k as `gemm_wide`
// is (workgroup z: the z-th of nz runs of steps, its partial sums in plane z of y).

const CT: u32 = 128u;
const CN: u32 = 128u;
const CK: u32 = 32u;
// Row stride of the staged tiles, in f16: CK + 8, so that rows start 16 bytes apart in the
// banks (a stride of 64 bytes would put every other row in the same banks).
const CS: u32 = 40u;
const CBUF: u32 = 5120u;
// Where x's buffers start in `halves`.
const CX: u32 = 10240u;

// The staged steps: W's buffer b at b * CBUF, x's at CX + b * CBUF, each
// halves[at + r * CS + k] = row r, column k of the step (rows of W, or of x).
var<workgroup> halves: array<f16, 20480>;
// One 16 x 16 matrix a subgroup, on its way to y at the edges.
var<workgroup> ch: array<f32, 2048>;

// Stores 16 values of row r, columns k .. k + 16, into `halves` at `at`.
fn stage16(at: u32, r: u32, k: u32, v0: W8, v1: W8) {
    let i = at + r * CS + k;
    let h = array<vec4<f16>, 4>(vec4<f16>(v0.lo), vec4<f16>(v0.hi), vec4<f16>(v1.lo), vec4<f16>(v1.hi));
    halves[i] = h[0].x;
    halves[i + 1u] = h[0].y;
    halves[i + 2u] = h[0].z;
    halves[i + 3u] = h[0].w;
    halves[i + 4u] = h[1].x;
    halves[i + 5u] = h[1].y;
    halves[i + 6u] = h[1].z;
    halves[i + 7u] = h[1].w;
    halves[i + 8u] = h[2].x;
    halves[i + 9u] = h[2].y;
    halves[i + 10u] = h[2].z;
    halves[i + 11u] = h[2].w;
    halves[i + 12u] = h[3].x;
    halves[i + 13u] = h[3].y;
    halves[i + 14u] = h[3].z;
    halves[i + 15u] = h[3].w;
}

// Writes the 16 x 16 matrix m of y at rows t, columns n, the elements inside y only, through
// the subgroup's part of `ch`. Called from uniform control flow (it has barriers).
fn store_edge(m: coop_mat16x16<f32, C>, g: u32, lane: u32, plane: u32, t: u32, n: u32) {
    var v = m;
    let at = g * 256u;
    coopStoreT(v, &ch[at], 16u);
    workgroupBarrier();
    let r = lane / 2u;
    let c0 = (lane % 2u) * 8u;
    if (t + r < params.t) {
        for (var c = c0; c < c0 + 8u; c++) {
            if (n + c < params.n_out) {
                y[plane + (t + r) * params.n_out + n + c] = ch[g * 256u + r * 16u + c];
            }
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn gemm_coop(
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row0 = params.row_base + wid.x * CN;
    let t0 = params.t_base + wid.y * CT;
    // Staging: row li / 2 of each tile, columns (li % 2) * 16 .. + 16 of the step.
    let lr = li / 2u;
    let lk = (li % 2u) * 16u;
    let wrow = min(row0 + lr, params.n_out - 1u);
    let xo = min(t0 + lr, params.t - 1u) * 4u * params.x_stride;
    let g = li / 32u;
    let gt = (g / 4u) * 64u;
    let gn = (g % 4u) * 32u;

    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();

    // This workgroup's run of steps: first .. first + steps.
    let all = (params.n_in + CK - 1u) / CK;
    let run = (all + nwg.z - 1u) / nwg.z;
    let first = min(wid.z * run, all);
    let steps = min(run, all - first);
    let k0 = first * CK + lk;
    var w0 = w8_at(wrow, k0);
    var w1 = w8_at(wrow, k0 + 8u);
    var x0 = x8_at(xo, k0);
    var x1 = x8_at(xo, k0 + 8u);
    stage16(0u, lr, lk, w0, w1);
    stage16(CX, lr, lk, x0, x1);
    workgroupBarrier();
    for (var s = 0u; s < steps; s++) {
        let cur = (s % 2u) * CBUF;
        let more = s + 1u < steps;
        if (more) {
            let k = k0 + (s + 1u) * CK;
            w0 = w8_at(wrow, k);
            w1 = w8_at(wrow, k + 8u);
            x0 = x8_at(xo, k);
            x1 = x8_at(xo, k + 8u);
        }
        for (var kk = 0u; kk < CK; kk += 16u) {
            let xa = CX + cur + gt * CS + kk;
            let wa = cur + gn * CS + kk;
            // Indices bound with `let`: naga 30 panics on a cooperative load or store whose
            // index is computed inline.
            let xa1 = xa + 16u * CS;
            let xa2 = xa + 32u * CS;
            let xa3 = xa + 48u * CS;
            let wa1 = wa + 16u * CS;
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&halves[xa], CS);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&halves[xa1], CS);
            let a2 = coopLoadT<coop_mat16x16<f16, A>>(&halves[xa2], CS);
            let a3 = coopLoadT<coop_mat16x16<f16, A>>(&halves[xa3], CS);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&halves[wa], CS);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&halves[wa1], CS);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c30 = coopMultiplyAdd(a3, b0, c30);
            c31 = coopMultiplyAdd(a3, b1, c31);
        }
        if (more) {
            let next = (1u - s % 2u) * CBUF;
            stage16(next, lr, lk, w0, w1);
            stage16(CX + next, lr, lk, x0, x1);
        }
        workgroupBarrier();
    }

    let t = t0 + gt;
    let n = row0 + gn;
    let n_out = params.n_out;
    let plane = wid.z * params.t * n_out;
    // Uniform across the workgroup: the whole tile inside y, and rows 16-byte aligned.
    if (t0 + CT <= params.t && row0 + CN <= n_out && n_out % 4u == 0u) {
        let i0 = plane + t * n_out + n;
        let i1 = i0 + 16u * n_out;
        let i2 = i0 + 32u * n_out;
        let i3 = i0 + 48u * n_out;
        let j0 = i0 + 16u;
        let j1 = i1 + 16u;
        let j2 = i2 + 16u;
        let j3 = i3 + 16u;
        coopStoreT(c00, &y[i0], n_out);
        coopStoreT(c01, &y[j0], n_out);
        coopStoreT(c10, &y[i1], n_out);
        coopStoreT(c11, &y[j1], n_out);
        coopStoreT(c20, &y[i2], n_out);
        coopStoreT(c21, &y[j2], n_out);
        coopStoreT(c30, &y[i3], n_out);
        coopStoreT(c31, &y[j3], n_out);
    } else {
        let lane = li % 32u;
        store_edge(c00, g, lane, plane, t, n);
        store_edge(c01, g, lane, plane, t, n + 16u);
        store_edge(c10, g, lane, plane, t + 16u, n);
        store_edge(c11, g, lane, plane, t + 16u, n + 16u);
        store_edge(c20, g, lane, plane, t + 32u, n);
        store_edge(c21, g, lane, plane, t + 32u, n + 16u);
        store_edge(c30, g, lane, plane, t + 48u, n);
        store_edge(c31, g, lane, plane, t + 48u, n + 16u);
    }
}
