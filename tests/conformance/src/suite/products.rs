//! Products: every upload format on fresh random shapes, several products of one input,
//! weights written in chunks or only in part, and NaN / infinity in inputs and weights. Each
//! product is a program of `matmul` ops (`exact`) over one input (see [`super::matmul`]).

use super::{Check, Ctx, allocate, matmul, shape, upload, write_rows};
use crate::reference::{Decoded, Format, Weight};
use crate::rng::Rng;

/// `n_in`: a multiple of the format's block, drawn from about `lo..=hi`.
fn n_in(f: Format, rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    let b = f.block();
    b * rng.range(lo.div_ceil(b).max(1), (hi / b).max(1))
}

/// `(t, n_out, n_in)`: one decode step (t = 1), a few rows, a prefill-sized batch, more rows
/// than a typical workgroup covers, and a batch past 128 rows of x (where a host may switch to
/// kernels for large products, and must keep their accuracy). Drawn fresh, so that they are
/// multiples of no tile.
fn shapes(f: Format, rng: &mut Rng) -> [(u32, u32, u32); 5] {
    [
        (1, rng.range(1, 70), n_in(f, rng, 1, 256)),
        (rng.range(2, 3), rng.range(65, 300), n_in(f, rng, 64, 700)),
        (rng.range(4, 37), rng.range(300, 700), n_in(f, rng, 256, 1100)),
        (rng.range(38, 50), rng.range(513, 800), n_in(f, rng, 700, 1300)),
        (rng.range(129, 160), rng.range(129, 300), n_in(f, rng, 256, 700)),
    ]
}

/// One format: `upload`, then its product held to the kit's own decoding.
pub fn format(ctx: &mut Ctx, f: Format) -> Check<String> {
    let mut done = Vec::new();
    for (t, n_out, n_in) in shapes(f, &mut ctx.rng) {
        let w = Weight::random(f, n_out, n_in, &mut ctx.rng);
        let h = upload(&w)?;
        let x = ctx.rng.vector((t * n_in) as usize);
        let what = format!("{} t {t}", shape(&w));
        let y = matmul(&what, &x, t, n_in, &[&h])?;
        ctx.check(&what, &y[0], &x, t, &w.decode())?;
        done.push(format!("[{n_out}, {n_in}] t {t}"));
    }
    Ok(format!("{}: {}", f.name(), done.join(", ")))
}

/// Every format in one program, a weight named twice, for a decode step and for a batch.
pub fn batch(ctx: &mut Ctx) -> Check<String> {
    let n_in = 32 * ctx.rng.range(2, 20);
    let weights: Vec<Weight> =
        Format::ALL.iter().map(|&f| Weight::random(f, ctx.rng.range(1, 300), n_in, &mut ctx.rng)).collect();
    let handles = weights.iter().map(upload).collect::<Check<Vec<_>>>()?;
    let order = [0, 1, 2, 3, 4, 2, 0];
    let jobs: Vec<_> = order.iter().map(|&i| &handles[i]).collect();
    let decoded: Vec<Decoded> = weights.iter().map(Weight::decode).collect();
    let mut ts = Vec::new();
    for t in [1, ctx.rng.range(5, 24)] {
        let x = ctx.rng.vector((t * n_in) as usize);
        let what = format!("{} products of one input, n-in {n_in}, t {t}", jobs.len());
        let y = matmul(&what, &x, t, n_in, &jobs)?;
        for (j, &i) in order.iter().enumerate() {
            ctx.check(&format!("{what}, product {j} ({})", shape(&weights[i])), &y[j], &x, t, &decoded[i])?;
        }
        ts.push(t.to_string());
    }
    let shapes: Vec<_> = order.iter().map(|&i| shape(&weights[i])).collect();
    Ok(format!("products of {} at t {}", shapes.join(", "), ts.join(" and ")))
}

/// `allocate`, then `write-rows` in several chunks, last chunk first.
pub fn chunked(ctx: &mut Ctx) -> Check<String> {
    let mut done = Vec::new();
    for f in Format::ALL {
        let n_out = ctx.rng.range(20, 300);
        let n_in = n_in(f, &mut ctx.rng, 16, 600);
        let w = Weight::random(f, n_out, n_in, &mut ctx.rng);
        let h = allocate(f, n_out, n_in)?;
        let mut cuts: Vec<u32> = (0..ctx.rng.range(2, 4)).map(|_| ctx.rng.range(1, n_out - 1)).collect();
        cuts.extend([0, n_out]);
        cuts.sort_unstable();
        cuts.dedup();
        for c in cuts.windows(2).rev() {
            write_rows(&h, &w, c[0], c[1] - c[0])?;
        }
        let t = ctx.rng.range(1, 12);
        let x = ctx.rng.vector((t * n_in) as usize);
        let what = format!("{} written in {} chunks, t {t}", shape(&w), cuts.len() - 1);
        let y = matmul(&what, &x, t, n_in, &[&h])?;
        ctx.check(&what, &y[0], &x, t, &w.decode())?;
        done.push(format!("{} in {} chunks", shape(&w), cuts.len() - 1));
    }
    Ok(done.join(", "))
}

/// Rows never written read as zero.
pub fn unwritten_rows(ctx: &mut Ctx) -> Check<String> {
    // q8x16 [50, 48] with rows 10..20 and 35..40 written.
    let w = Weight::random(Format::Q8x16, 50, 48, &mut ctx.rng);
    let h = allocate(Format::Q8x16, 50, 48)?;
    let mut want = Decoded::zeros(50, 48);
    let full = w.decode();
    for (first, count) in [(10, 10), (35, 5)] {
        write_rows(&h, &w, first, count)?;
        want.copy_rows(&full, first as usize, count as usize);
    }
    let x = ctx.rng.vector(3 * 48);
    let y = matmul("q8x16 [50, 48], rows 10..20 and 35..40 written", &x, 3, 48, &[&h])?;
    ctx.check("q8x16 [50, 48] with rows 10..20 and 35..40 written, t 3", &y[0], &x, 3, &want)?;
    // f32 [7, 9] and q4x32 [33, 64], never written.
    let a = allocate(Format::F32, 7, 9)?;
    let x = ctx.rng.vector(5 * 9);
    let y = matmul("f32 [7, 9] never written", &x, 5, 9, &[&a])?;
    ctx.check("f32 [7, 9] never written, t 5", &y[0], &x, 5, &Decoded::zeros(7, 9))?;
    let b = allocate(Format::Q4x32, 33, 64)?;
    let x = ctx.rng.vector(64);
    let y = matmul("q4x32 [33, 64] never written", &x, 1, 64, &[&b])?;
    ctx.check("q4x32 [33, 64] never written, t 1", &y[0], &x, 1, &Decoded::zeros(33, 64))?;
    Ok("q8x16 [50, 48] written in part, f32 [7, 9] and q4x32 [33, 64] never written".into())
}

/// NaN and infinities in `x`: the rows of `y` they enter are NaN or infinite, the others exact.
pub fn non_finite_input(ctx: &mut Ctx) -> Check<String> {
    let n_in = 64;
    let weights =
        [Weight::random(Format::F32, 37, n_in, &mut ctx.rng), Weight::random(Format::Q4x32, 29, n_in, &mut ctx.rng)];
    let handles = [upload(&weights[0])?, upload(&weights[1])?];
    let decoded = [weights[0].decode(), weights[1].decode()];
    // t = 6: rows 0 and 4 finite; a NaN in row 1, +inf in row 2, -inf in row 3, all NaN in row 5.
    let mut x = ctx.rng.vector(6 * 64);
    x[64 + 3] = f32::NAN;
    x[2 * 64 + 5] = f32::INFINITY;
    x[3 * 64 + 63] = f32::NEG_INFINITY;
    x[5 * 64..].fill(f32::NAN);
    let mut single = ctx.rng.vector(64);
    single[0] = f32::NAN;
    for (t, x) in [(6, &x), (1, &single)] {
        let what = format!("f32 [37, 64] and q4x32 [29, 64] with NaN and infinities in x, t {t}");
        let y = matmul(&what, x, t, n_in, &[&handles[0], &handles[1]])?;
        for j in 0..2 {
            ctx.check(&format!("{what}, product {j}"), &y[j], x, t, &decoded[j])?;
        }
    }
    Ok("NaN, +inf and -inf in x (t 6 and t 1): their rows NaN or infinite, the other rows exact".into())
}

/// NaN and infinities in weights and scales: the columns of `y` they enter are NaN or infinite.
pub fn non_finite_weights(ctx: &mut Ctx) -> Check<String> {
    let n_in = 64u32;
    let mut weights: Vec<Weight> =
        [(Format::F32, 12), (Format::Bf16, 10), (Format::Q8x32, 8), (Format::Q8x16, 6), (Format::Q4x32, 7)]
            .iter()
            .map(|&(f, n_out)| Weight::random(f, n_out, n_in, &mut ctx.rng))
            .collect();
    let put =
        |data: &mut [u8], i: usize, bytes: &[u8]| data[i * bytes.len()..(i + 1) * bytes.len()].copy_from_slice(bytes);
    put(&mut weights[0].data, 2 * 64 + 7, &f32::NAN.to_le_bytes());
    put(&mut weights[0].data, 5 * 64, &f32::INFINITY.to_le_bytes());
    put(&mut weights[0].data, 9 * 64 + 63, &f32::NEG_INFINITY.to_le_bytes());
    put(&mut weights[1].data, 64 + 3, &0x7fc0u16.to_le_bytes());
    put(&mut weights[1].data, 4 * 64 + 4, &0x7f80u16.to_le_bytes());
    put(&mut weights[1].data, 8 * 64 + 63, &0xff80u16.to_le_bytes());
    weights[2].scales[3 * 2] = f32::NAN; // row 3, block 0
    weights[2].scales[6 * 2 + 1] = f32::INFINITY; // row 6, block 1
    weights[3].scales[4 + 3] = f32::NEG_INFINITY; // row 1, block 3
    weights[4].scales[(2 * 2 + 1) * 2] = f32::NAN; // row 2, block 1: d
    weights[4].scales[(5 * 2) * 2 + 1] = f32::INFINITY; // row 5, block 0: m
    let handles = weights.iter().map(upload).collect::<Check<Vec<_>>>()?;
    let jobs: Vec<_> = handles.iter().collect();
    let x = ctx.rng.vector(5 * 64);
    let what = "weights of every format with NaN and infinities in data or scales, t 5";
    let y = matmul(what, &x, 5, n_in, &jobs)?;
    for (j, w) in weights.iter().enumerate() {
        ctx.check(&format!("{what}, product {j} ({})", shape(w)), &y[j], &x, 5, &w.decode())?;
    }
    Ok("NaN and infinities in f32 and bf16 data, q8 scales, q4 d and m: their outputs NaN or infinite, the rest exact"
        .into())
}
