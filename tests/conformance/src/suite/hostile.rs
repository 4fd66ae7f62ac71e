//! The calls a hostile or buggy guest can make through the ABI. Each must be refused with the
//! documented error variant, change nothing on the device (the same budget before and after),
//! and leave the instance working.

use super::{Check, Ctx, Kind, describe, fail, matmul, refused, shape, upload, wit};
use crate::bindings::wisp::llm::gpu;
use crate::reference::{Format, Weight};

const INVALID: &[Kind] = &[Kind::InvalidArgument];

/// `data` or `scales` of a length that does not match the format and shape.
pub fn upload_lengths(ctx: &mut Ctx) -> Check<String> {
    let mut n = 0;
    for f in Format::ALL {
        let w = Weight::random(f, 3, 64, &mut ctx.rng);
        let (d, s) = (w.data.len(), w.scales.len());
        let rb = f.row_bytes(64);
        let mut variants = vec![
            ("one byte of data short", d - 1, s),
            ("one byte of data too many", d + 1, s),
            ("no data", 0, s),
            ("the data of 2 rows", 2 * rb, s),
            ("one scale too many", d, s + 1),
        ];
        if s > 0 {
            variants.push(("one scale short", d, s - 1));
            variants.push(("no scales", d, 0));
        }
        for (what, dl, sl) in variants {
            let data: Vec<u8> = w.data.iter().copied().chain(std::iter::repeat(7)).take(dl).collect();
            let scales: Vec<f32> = w.scales.iter().copied().chain(std::iter::repeat(0.5)).take(sl).collect();
            let call = format!("upload of {} with {what} ({dl} bytes, {sl} scales; want {d} and {s})", shape(&w));
            refused(&call, INVALID, || gpu::upload(wit(f), 3, 64, &data, &scales))?;
            n += 1;
        }
    }
    Ok(format!("{n} uploads with wrong data or scales lengths: invalid-argument"))
}

/// `n-in` not a multiple of the format's block.
pub fn n_in_not_block(_: &mut Ctx) -> Check<String> {
    let mut n = 0;
    for f in [Format::Q8x32, Format::Q8x16, Format::Q4x32] {
        let b = f.block();
        for n_in in [1, b - 1, b + b / 2, 3 * b + 1] {
            let elems = 2 * n_in as usize;
            // The lengths a careless host would compute by truncating division.
            let data_len = if f == Format::Q4x32 { elems / 2 } else { elems };
            let scales_len = if f == Format::Q4x32 { 2 * (elems / 32) } else { elems / b as usize };
            let (data, scales) = (vec![1u8; data_len], vec![0.5f32; scales_len]);
            refused(&format!("allocate of {} [2, {n_in}]", f.name()), INVALID, || gpu::allocate(wit(f), 2, n_in))?;
            let what = format!("upload of {} [2, {n_in}] ({data_len} bytes, {scales_len} scales)", f.name());
            refused(&what, INVALID, || gpu::upload(wit(f), 2, n_in, &data, &scales))?;
            n += 2;
        }
    }
    Ok(format!("{n} allocates and uploads with n-in not a multiple of the block: invalid-argument"))
}

/// Shapes with a zero: weights `[0, n]`, `[n, 0]`, `[0, 0]`, and a product with `t` 0.
pub fn zero_shapes(ctx: &mut Ctx) -> Check<String> {
    for f in Format::ALL {
        let b = f.block();
        refused(&format!("allocate of {} [0, {}]", f.name(), 2 * b), INVALID, || gpu::allocate(wit(f), 0, 2 * b))?;
        refused(&format!("allocate of {} [3, 0]", f.name()), INVALID, || gpu::allocate(wit(f), 3, 0))?;
        refused(&format!("upload of {} [0, 0] with no data", f.name()), INVALID, || {
            gpu::upload(wit(f), 0, 0, &[], &[])
        })?;
        refused(&format!("upload of {} [0, {}] with no data", f.name(), 2 * b), INVALID, || {
            gpu::upload(wit(f), 0, 2 * b, &[], &[])
        })?;
    }
    let w = Weight::random(Format::F32, 4, 32, &mut ctx.rng);
    let h = upload(&w)?;
    refused("matmul with t 0 and an empty x", INVALID, || gpu::matmul(&[], 0, 32, &[&h]))?;
    refused("matmul with n-in 0 and an empty x", INVALID, || gpu::matmul(&[], 1, 0, &[&h]))?;
    Ok("weights [0, n], [n, 0], [0, 0] of every format, and products with t 0 or n-in 0: invalid-argument".into())
}

/// Shapes whose sizes overflow 32 or 64 bits.
pub fn overflowing_shapes(ctx: &mut Ctx) -> Check<String> {
    let max = u32::MAX;
    let too_big = &[Kind::InvalidArgument, Kind::OutOfMemory];
    for f in Format::ALL {
        refused(&format!("allocate of {} [{max}, {max}]", f.name()), INVALID, || gpu::allocate(wit(f), max, max))?;
        refused(&format!("upload of {} [{max}, {max}] with 16 bytes", f.name()), INVALID, || {
            gpu::upload(wit(f), max, max, &[0; 16], &[0.5])
        })?;
        // 2^32 elements: a count that wraps to 0 in 32 bits, matching the empty lists.
        refused(&format!("upload of {} [65536, 65536] with no data", f.name()), too_big, || {
            gpu::upload(wit(f), 65536, 65536, &[], &[])
        })?;
    }
    let aligned = max - 31;
    refused(&format!("allocate of q8x32 [{max}, {aligned}]"), too_big, || {
        gpu::allocate(wit(Format::Q8x32), max, aligned)
    })?;
    let w = Weight::random(Format::F32, 3, 2, &mut ctx.rng);
    let h = upload(&w)?;
    // t * n-in = 2^32 wraps to 0 in 32 bits, the length of the empty x.
    refused("matmul with t 2^31, n-in 2 and an empty x", too_big, || gpu::matmul(&[], 1 << 31, 2, &[&h]))?;
    refused(&format!("matmul with t {max}, n-in {max} and one value of x"), too_big, || {
        gpu::matmul(&[1.0], max, max, &[&h])
    })?;
    Ok("u32::MAX shapes, 2^32-element weights with no data, a huge aligned weight, products whose \
        t * n-in wraps 32 bits: refused"
        .into())
}

/// `x` of a length other than `t * n-in`.
pub fn x_length(ctx: &mut Ctx) -> Check<String> {
    let w = Weight::random(Format::Q8x32, 5, 32, &mut ctx.rng);
    let h = upload(&w)?;
    for (t, len) in [(3, 95), (3, 97), (3, 0), (3, 32), (1, 64), (1, 31)] {
        let x = vec![0.25f32; len];
        refused(&format!("matmul with t {t}, n-in 32 and {len} values of x"), INVALID, || {
            gpu::matmul(&x, t, 32, &[&h])
        })?;
    }
    Ok("x of 95, 97, 0, 32 values for t 3 and of 64, 31 for t 1 (n-in 32): invalid-argument".into())
}

/// A product with no jobs.
pub fn empty_jobs(_: &mut Ctx) -> Check<String> {
    refused("matmul with no jobs", INVALID, || gpu::matmul(&[1.0; 32], 1, 32, &[]))?;
    Ok("matmul with an empty job list: invalid-argument".into())
}

/// A job whose weight has `cols != n-in`, alone or beside a good one.
pub fn cols_mismatch(ctx: &mut Ctx) -> Check<String> {
    let a = Weight::random(Format::F32, 4, 32, &mut ctx.rng);
    let b = Weight::random(Format::Q8x32, 4, 64, &mut ctx.rng);
    let (ha, hb) = (upload(&a)?, upload(&b)?);
    let x32 = ctx.rng.vector(32);
    let x64 = ctx.rng.vector(64);
    refused("matmul with n-in 32 of [f32 [4, 32], q8x32 [4, 64]]", INVALID, || gpu::matmul(&x32, 1, 32, &[&ha, &hb]))?;
    refused("matmul with n-in 32 of [q8x32 [4, 64], f32 [4, 32]]", INVALID, || gpu::matmul(&x32, 1, 32, &[&hb, &ha]))?;
    refused("matmul with n-in 64 of [f32 [4, 32]]", INVALID, || gpu::matmul(&x64, 1, 64, &[&ha]))?;
    refused("matmul with t 2, n-in 32 of [q8x32 [4, 64]]", INVALID, || gpu::matmul(&x64, 2, 32, &[&hb]))?;
    let y = matmul("the good job alone after the refusals", &x32, 1, 32, &[&ha])?;
    ctx.check("f32 [4, 32] after refused products", &y[0], &x32, 1, &a.decode())?;
    Ok("jobs whose cols differ from n-in, alone, first or last: invalid-argument; the good job alone still computes"
        .into())
}

/// 10000 jobs in one call: refused (`invalid-argument` past the host's cap, or
/// `out-of-memory`), or computed correctly. (Each job lends a handle for the call: wasmtime
/// traps past 100000 live handles in a store by default, before the host sees the call.)
pub fn huge_job_list(ctx: &mut Ctx) -> Check<String> {
    const JOBS: usize = 10_000;
    let w = Weight::random(Format::F32, 2, 32, &mut ctx.rng);
    let h = upload(&w)?;
    let jobs = vec![&h; JOBS];
    let x = ctx.rng.vector(32);
    let before = super::budget()?;
    let r = gpu::matmul(&x, 1, 32, &jobs);
    let after = super::budget()?;
    if after != before {
        return fail(format!("a matmul of {JOBS} jobs changed the budget from {before:?} to {after:?}"));
    }
    match r {
        Err(e) if matches!(Kind::of(&e), Kind::InvalidArgument | Kind::OutOfMemory) => {
            Ok(format!("a matmul of {JOBS} jobs: refused with {}", describe(&e)))
        }
        Err(e) => fail(format!(
            "a matmul of {JOBS} jobs returned {}; want outputs, invalid-argument or out-of-memory",
            describe(&e)
        )),
        Ok(y) if y.len() != JOBS => fail(format!("a matmul of {JOBS} jobs returned {} outputs", y.len())),
        Ok(y) => {
            let d = w.decode();
            for (j, yj) in y.iter().enumerate() {
                ctx.check(&format!("job {j} of {JOBS}"), yj, &x, 1, &d)?;
            }
            Ok(format!("a matmul of {JOBS} jobs: computed, every output correct"))
        }
    }
}

/// `write-rows` past the last row, with ranges that wrap 32 bits, with partial rows or the
/// wrong number of scales: refused, and the weight's rows are as they were.
pub fn write_rows(ctx: &mut Ctx) -> Check<String> {
    let w = Weight::random(Format::Q8x32, 5, 64, &mut ctx.rng);
    let h = upload(&w)?;
    // Other values, so that a partial write would show in the product.
    let junk = Weight::random(Format::Q8x32, 5, 64, &mut ctx.rng);
    let (one, one_s) = junk.rows(0, 1);
    let (two, two_s) = junk.rows(0, 2);
    let (three, three_s) = junk.rows(0, 3);
    let long: Vec<u8> = one.iter().copied().chain([1]).collect();
    let extra: Vec<f32> = one_s.iter().copied().chain([1.0]).collect();
    let max = u32::MAX;
    let calls: [(&str, u32, &[u8], &[f32]); 9] = [
        ("rows 5..6 of 5", 5, one, one_s),
        ("rows 4..6 of 5", 4, two, two_s),
        ("first-row u32::MAX", max, one, one_s),
        ("first-row u32::MAX - 1 and 3 rows (the end wraps 32 bits)", max - 1, three, three_s),
        ("63 bytes (not a whole row)", 0, &one[..63], &one_s[..1]),
        ("65 bytes (not a whole row)", 0, &long, one_s),
        ("a row and 1 scale (want 2)", 0, one, &one_s[..1]),
        ("a row and 3 scales (want 2)", 0, one, &extra),
        ("a row and the scales of two", 0, one, two_s),
    ];
    for (what, first, data, scales) in calls {
        refused(&format!("write-rows of q8x32 [5, 64]: {what}"), INVALID, || h.write_rows(first, data, scales))?;
    }
    // No rows at all: a no-op or invalid-argument, either way no change.
    if let Err(e) = h.write_rows(0, &[], &[])
        && Kind::of(&e) != Kind::InvalidArgument
    {
        return fail(format!("write-rows with no data returned {}; want success or invalid-argument", describe(&e)));
    }
    let x = ctx.rng.vector(4 * 64);
    let y = matmul("the weight after refused writes", &x, 4, 64, &[&h])?;
    ctx.check("q8x32 [5, 64] after refused writes (a refused write must change no row)", &y[0], &x, 4, &w.decode())?;
    Ok("9 bad write-rows (past the end, wrapping, partial rows, wrong scales): invalid-argument, rows unchanged".into())
}
