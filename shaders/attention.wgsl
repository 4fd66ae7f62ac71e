// Causal grouped-query attention, the `gpu` interface's `attention` (wit/gpu.wit): for each
// query i and head h, out[i, h] = softmax_j(scale * q[i, h] . k[j, g]) @ v[., g] over the keys j
// query i sees, g the key/value head of h.
//
// One workgroup a (head, query). It walks the keys the query sees in chunks of WG: G
// invocations score each key of the chunk together (q is in workgroup memory), then each
// invocation owns one key's score; the chunk's maximum and sum
// are reduced through workgroup memory, and the running output (each invocation owns the
// dimensions d = lid + r * WG) is rescaled by exp(old max - new max) and gains the chunk's
// weighted values: a single pass over the keys, the softmax never stored whole ("online
// softmax"). Sums are f32, as the guest's own kernels.
//
// Host and browser run this same file; each call's queries may be split over dispatches
// (`query_base`) to stay inside the device's workgroup count and a dispatch's time budget.
// Keys and values are the call's own (`attention`) or rows of a ring kept on the device
// (`attention-cached`, a program's `attention` op); `attend_rows` serves a program's batch of
// sequences whose rings share one buffer in one call, each query row reading its own ring.

struct Shape {
    t: u32,
    n_keys: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    window: u32,
    scale: f32,
    // The first query of this dispatch (its workgroups' y is relative to it).
    query_base: u32,
    // Key j is row (first_slot + j) % slots of k and v: a ring (`attention-cached`), or
    // first_slot 0 and slots n_keys for keys sent with the call.
    first_slot: u32,
    slots: u32,
    // Each query's keys split in `splits` runs of `split_len` (workgroup z): with one, `attend`
    // writes the output; with more, each run's partial softmax (its maximum m, its sum l and
    // its weighted values) goes to `out` past the outputs, and `attend_merge` combines them.
    // Splits give a decode step (one query, a few heads) more than a few workgroups.
    splits: u32,
    split_len: u32,
    // Where not 0, each score s becomes softcap * tanh(s / softcap) (`softcap` in matmul.wgsl's
    // reading, ops/src/op.rs's).
    softcap: f32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> s: Shape;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
// The contract's widest head (MAX_HEAD_DIM in host/src/gpu/mod.rs).
const MAX_HEAD_DIM: u32 = 512u;
const PER: u32 = MAX_HEAD_DIM / WG;
// Below every score a finite input gives: the score of a key outside the query's range.
const LOWEST: f32 = -3.0e38;

// Invocations that score one key together, and the keys scored at once.
const G: u32 = 16u;
const KEYS: u32 = WG / G;

var<workgroup> qs: array<f32, MAX_HEAD_DIM>;
// The G parts of each key of a chunk, a row of G + 1 a key (a column read by the 32 lanes of
// a warp then spans every bank).
var<workgroup> parts: array<f32, WG * (G + 1u)>;
var<workgroup> probs: array<f32, WG>;
var<workgroup> red: array<f32, WG>;

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

// The maximum of `x` over the workgroup (every invocation gets it).
fn workgroup_max(lid: u32, x: f32) -> f32 {
    red[lid] = x;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w = w / 2u) {
        if lid < w {
            red[lid] = max(red[lid], red[lid + w]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The sum of `x` over the workgroup (every invocation gets it).
fn workgroup_sum(lid: u32, x: f32) -> f32 {
    red[lid] = x;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w = w / 2u) {
        if lid < w {
            red[lid] = red[lid] + red[lid + w];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// Where the partial of (query i, head h, split sp) starts in `out`: [m, l, acc[head_dim]].
fn partial_at(i: u32, h: u32, sp: u32, hd: u32) -> u32 {
    return s.t * s.n_head * hd + ((i * s.n_head + h) * s.splits + sp) * (hd + 2u);
}

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = s.query_base + wg.y;
    attend_row(wg.x, i, i, wg.z, Ring(s.n_keys - s.t + i, s.first_slot, s.slots, 0u, 0u, s.split_len), lid);
}

// `attend` over query rows of a batch of sequences whose keys and values share the buffer bound
// as k and v: entry e (workgroup y, from query_base) is `rings[2e]` (its row's last key, first
// slot and slots, and the row) and `rings[2e + 1]` (where its ring's keys and values start in
// k and v, and its split_len: its sequence's alone, so that its sums are those of a call of
// that sequence alone; splits past its own find no keys). The row's output goes where a call
// of `t` queries puts row's; entry e's partials where such a call puts query e's
// (`attend_rows_merge` combines them, `splits` of them).
@group(0) @binding(5) var<storage, read> rings: array<vec4<u32>>;

@compute @workgroup_size(64)
fn attend_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = s.query_base + wg.y;
    let a = rings[2u * e];
    let b = rings[2u * e + 1u];
    attend_row(wg.x, a.w, e, wg.z, Ring(a.x, a.y, a.z, b.x, b.y, b.z), lid);
}

// Query i's keys: 0..=last, key j at row (first_slot + j) % slots of a ring whose keys start at
// element k_at of k, its values at v_at of v; its splits `split_len` keys each.
struct Ring {
    last: u32,
    first_slot: u32,
    slots: u32,
    k_at: u32,
    v_at: u32,
    split_len: u32,
}

// Head h of query i, split `split` of its keys, its partials those of query e. Called from
// uniform control flow (barriers).
fn attend_row(h: u32, i: u32, e: u32, split: u32, ring: Ring, lid: u32) {
    let hd = min(s.head_dim, MAX_HEAD_DIM);
    let group = max(s.n_head / max(s.n_head_kv, 1u), 1u);
    let kv_stride = s.n_head_kv * hd;
    let kv_at = (h / group) * hd;
    let k_at = ring.k_at + kv_at;
    let v_at = ring.v_at + kv_at;
    let q_at = (i * s.n_head + h) * hd;

    for (var d = lid; d < hd; d += WG) {
        qs[d] = q[q_at + d];
    }
    workgroupBarrier();

    // The keys this query sees: first..=last.
    let last = ring.last;
    var first = 0u;
    if s.window > 0u && last + 1u > s.window {
        first = last + 1u - s.window;
    }

    // This workgroup's run of them: lo..=hi (none when lo > last).
    let lo = first + split * ring.split_len;
    let hi = min(last, lo + ring.split_len - 1u);

    var m = LOWEST;
    var l = 0.0;
    var acc: array<f32, PER>;
    let sub = lid % G;
    for (var c = lo; c <= hi; c += WG) {
        // The chunk's keys scored G invocations a key, KEYS keys at a time: each reads every
        // G-th dimension, so that a key's row is read in runs of G neighbouring values. Four
        // such keys an invocation at once, four loads of each in flight (the walk is bound by
        // the loads' latency); a key past `hi` is read (its row is in the ring) and dropped.
        for (var kb = lid / G; kb < WG; kb += 4u * KEYS) {
            let kk = vec4<u32>(kb, kb + KEYS, kb + 2u * KEYS, kb + 3u * KEYS);
            let jk = vec4<u32>(c) + kk;
            let at = ((vec4<u32>(ring.first_slot) + jk) % vec4<u32>(ring.slots)) * kv_stride + vec4<u32>(k_at);
            var d = sub;
            var p0 = vec4<f32>(0.0);
            var p1 = vec4<f32>(0.0);
            var p2 = vec4<f32>(0.0);
            var p3 = vec4<f32>(0.0);
            for (; d + 3u * G < hd; d += 4u * G) {
                let o = vec4<u32>(d, d + G, d + 2u * G, d + 3u * G);
                let qv = vec4<f32>(qs[o.x], qs[o.y], qs[o.z], qs[o.w]);
                p0 = fma(qv, vec4<f32>(k[at.x + o.x], k[at.x + o.y], k[at.x + o.z], k[at.x + o.w]), p0);
                p1 = fma(qv, vec4<f32>(k[at.y + o.x], k[at.y + o.y], k[at.y + o.z], k[at.y + o.w]), p1);
                p2 = fma(qv, vec4<f32>(k[at.z + o.x], k[at.z + o.y], k[at.z + o.z], k[at.z + o.w]), p2);
                p3 = fma(qv, vec4<f32>(k[at.w + o.x], k[at.w + o.y], k[at.w + o.z], k[at.w + o.w]), p3);
            }
            for (; d < hd; d += G) {
                p0.x += qs[d] * k[at.x + d];
                p1.x += qs[d] * k[at.y + d];
                p2.x += qs[d] * k[at.z + d];
                p3.x += qs[d] * k[at.w + d];
            }
            let part = vec4<f32>(
                (p0.x + p0.y) + (p0.z + p0.w),
                (p1.x + p1.y) + (p1.z + p1.w),
                (p2.x + p2.y) + (p2.z + p2.w),
                (p3.x + p3.y) + (p3.z + p3.w),
            );
            let kept = select(vec4<f32>(0.0), part, jk <= vec4<u32>(hi));
            parts[kk.x * (G + 1u) + sub] = kept.x;
            parts[kk.y * (G + 1u) + sub] = kept.y;
            parts[kk.z * (G + 1u) + sub] = kept.z;
            parts[kk.w * (G + 1u) + sub] = kept.w;
        }
        workgroupBarrier();
        let j = c + lid;
        var score = LOWEST;
        if j <= hi {
            var dot = 0.0;
            for (var e = 0u; e < G; e++) {
                dot += parts[lid * (G + 1u) + e];
            }
            score = dot * s.scale;
            if s.softcap > 0.0 {
                score = softcap(score, s.softcap);
            }
        }
        let new_m = max(m, workgroup_max(lid, score));
        var p = 0.0;
        if j <= hi {
            p = exp(score - new_m);
        }
        probs[lid] = p;
        let sum = workgroup_sum(lid, p);
        let rescale = exp(m - new_m);
        l = l * rescale + sum;
        m = new_m;
        let n = min(WG, hi + 1u - c);
        for (var r = 0u; r < PER; r++) {
            acc[r] *= rescale;
        }
        // Eight keys a step, their values loaded before any is added (eight loads in flight,
        // not one: the walk is bound by the loads' latency), then added in order of position.
        var jj = 0u;
        for (; jj + 8u <= n; jj += 8u) {
            let p = vec4<f32>(probs[jj], probs[jj + 1u], probs[jj + 2u], probs[jj + 3u]);
            let q4 = vec4<f32>(probs[jj + 4u], probs[jj + 5u], probs[jj + 6u], probs[jj + 7u]);
            let a = ((vec4<u32>(ring.first_slot + c + jj) + vec4<u32>(0u, 1u, 2u, 3u)) % vec4<u32>(ring.slots)) * kv_stride
                + vec4<u32>(v_at);
            let b = ((vec4<u32>(ring.first_slot + c + jj) + vec4<u32>(4u, 5u, 6u, 7u)) % vec4<u32>(ring.slots)) * kv_stride
                + vec4<u32>(v_at);
            for (var r = 0u; r < PER; r++) {
                let d = lid + r * WG;
                if d < hd {
                    let va = vec4<f32>(v[a.x + d], v[a.y + d], v[a.z + d], v[a.w + d]);
                    let vb = vec4<f32>(v[b.x + d], v[b.y + d], v[b.z + d], v[b.w + d]);
                    acc[r] += p.x * va.x;
                    acc[r] += p.y * va.y;
                    acc[r] += p.z * va.z;
                    acc[r] += p.w * va.w;
                    acc[r] += q4.x * vb.x;
                    acc[r] += q4.y * vb.y;
                    acc[r] += q4.z * vb.z;
                    acc[r] += q4.w * vb.w;
                }
            }
        }
        for (; jj + 4u <= n; jj += 4u) {
            let p = vec4<f32>(probs[jj], probs[jj + 1u], probs[jj + 2u], probs[jj + 3u]);
            let a0 = ((ring.first_slot + c + jj) % ring.slots) * kv_stride + v_at;
            let a1 = ((ring.first_slot + c + jj + 1u) % ring.slots) * kv_stride + v_at;
            let a2 = ((ring.first_slot + c + jj + 2u) % ring.slots) * kv_stride + v_at;
            let a3 = ((ring.first_slot + c + jj + 3u) % ring.slots) * kv_stride + v_at;
            for (var r = 0u; r < PER; r++) {
                let d = lid + r * WG;
                if d < hd {
                    let vs = vec4<f32>(v[a0 + d], v[a1 + d], v[a2 + d], v[a3 + d]);
                    acc[r] += p.x * vs.x;
                    acc[r] += p.y * vs.y;
                    acc[r] += p.z * vs.z;
                    acc[r] += p.w * vs.w;
                }
            }
        }
        for (; jj < n; jj++) {
            let pw = probs[jj];
            let at = ((ring.first_slot + c + jj) % ring.slots) * kv_stride + v_at;
            for (var r = 0u; r < PER; r++) {
                let d = lid + r * WG;
                if d < hd {
                    acc[r] += pw * v[at + d];
                }
            }
        }
        // `probs` is rewritten by the next chunk.
        workgroupBarrier();
    }

    if s.splits == 1u {
        for (var r = 0u; r < PER; r++) {
            let d = lid + r * WG;
            if d < hd {
                out[q_at + d] = acc[r] / l;
            }
        }
        return;
    }
    let at = partial_at(e, h, split, hd);
    if lid == 0u {
        out[at] = m;
        out[at + 1u] = l;
    }
    for (var r = 0u; r < PER; r++) {
        let d = lid + r * WG;
        if d < hd {
            out[at + 2u + d] = acc[r];
        }
    }
}

// Combines the splits' partials of (query i, head h): each weighted by exp(m - max m), as the
// single pass rescales its running sums. The host makes at most WG splits: invocation sp reads
// split sp's maximum and sum, and the weights go through workgroup memory, so that the walk
// over the splits of each dimension is one load and one multiply-add a split, four splits'
// loads in flight at once (one at a time, a decode step's 36 splits were 36 round trips to
// memory a dimension), added in the splits' order.
@compute @workgroup_size(64)
fn attend_merge(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = s.query_base + wg.y;
    merge_row(wg.x, i, i, lid);
}

// `attend_merge` of `attend_rows`' entries: entry e's partials into its row's output.
@compute @workgroup_size(64)
fn attend_rows_merge(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = s.query_base + wg.y;
    merge_row(wg.x, rings[2u * e].w, e, lid);
}

// Head h of query i from the partials of query e. Called from uniform control flow.
fn merge_row(h: u32, i: u32, e: u32, lid: u32) {
    let hd = min(s.head_dim, MAX_HEAD_DIM);
    let n = min(s.splits, WG);
    var m = LOWEST;
    var l = 0.0;
    if lid < n {
        let at = partial_at(e, h, lid, hd);
        m = out[at];
        l = out[at + 1u];
    }
    let top = workgroup_max(lid, m);
    var weight = 0.0;
    if lid < n {
        weight = exp(m - top);
    }
    let total = workgroup_sum(lid, weight * l);
    probs[lid] = weight;
    workgroupBarrier();
    let q_at = (i * s.n_head + h) * hd;
    // Split sp's values of (i, h) start at base + sp * (hd + 2).
    let base = partial_at(e, h, 0u, hd) + 2u;
    let step = hd + 2u;
    for (var d = lid; d < hd; d += WG) {
        var a = 0.0;
        var sp = 0u;
        for (; sp + 4u <= n; sp += 4u) {
            let at = base + sp * step + d;
            let v0 = out[at];
            let v1 = out[at + step];
            let v2 = out[at + 2u * step];
            let v3 = out[at + 3u * step];
            a += probs[sp] * v0;
            a += probs[sp + 1u] * v1;
            a += probs[sp + 2u] * v2;
            a += probs[sp + 3u] * v3;
        }
        for (; sp < n; sp++) {
            a += probs[sp] * out[base + sp * step + d];
        }
        out[q_at + d] = a / total;
    }
}
