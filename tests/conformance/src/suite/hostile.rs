//! The calls a hostile or buggy guest can make through the ABI. Each must be refused with the
//! documented error variant, change nothing on the device (the same budget before and after),
//! and leave the instance working.

use super::{Check, Ctx, Kind, budget, describe, fail, matmul, one_sequence, products, program, refused, shape, skip, upload, wit};
use crate::bindings::wisp::llm::gpu::{self, Error, MatmulOp, Op, Output, Precision, Weight as Handle};
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

/// Shapes with a zero: weights `[0, n]`, `[n, 0]`, `[0, 0]`, a run of no rows and an input of
/// width 0.
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
    let p = program("a product of f32 [4, 32]", &[&h], &products(32, 1))?;
    refused("a run of a product of n-in 32 over a sequence of 0 rows and an empty x", INVALID, || {
        p.run(&[Vec::new()], &[one_sequence(0)])
    })?;
    refused("create-program of an input of width 0 and its output", INVALID, || {
        gpu::create_program(&[], 0, &[Op::Input(0), Op::Output(0)])
    })?;
    Ok("weights [0, n], [n, 0], [0, 0] of every format, a run of 0 rows, an input of width 0: invalid-argument".into())
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
    let p = program("a product of f32 [3, 2]", &[&h], &products(2, 1))?;
    // rows * n-in = 2^32 wraps to 0 in 32 bits, the length of the empty x.
    refused("a run of a product of n-in 2 over 2^31 rows and an empty x", too_big, || {
        p.run(&[Vec::new()], &[one_sequence(1 << 31)])
    })?;
    refused(&format!("a run of a product of n-in 2 over {max} rows and one value of x"), too_big, || {
        p.run(&[vec![1.0]], &[one_sequence(max)])
    })?;
    refused(&format!("create-program of an input of width {max} and its output"), INVALID, || {
        gpu::create_program(&[], 0, &[Op::Input(max), Op::Output(0)])
    })?;
    Ok("u32::MAX shapes, 2^32-element weights with no data, a huge aligned weight, runs whose \
        rows * n-in wraps 32 bits, an input of width u32::MAX: refused"
        .into())
}

/// A run of a product whose `x` holds other than `t * n-in` values (`t` the sequence's rows).
pub fn x_length(ctx: &mut Ctx) -> Check<String> {
    let w = Weight::random(Format::Q8x32, 5, 32, &mut ctx.rng);
    let h = upload(&w)?;
    let p = program("a product of q8x32 [5, 32]", &[&h], &products(32, 1))?;
    for (t, len) in [(3, 95), (3, 97), (3, 0), (3, 32), (1, 64), (1, 31)] {
        let x = vec![0.25f32; len];
        refused(&format!("a run of a product of n-in 32 over {t} rows with {len} values of x"), INVALID, || {
            p.run(&[x], &[one_sequence(t)])
        })?;
    }
    Ok("x of 95, 97, 0, 32 values for 3 rows and of 64, 31 for 1 row (n-in 32): invalid-argument".into())
}

/// Programs that return nothing: an input alone, products whose values no `output` returns.
pub fn no_outputs(ctx: &mut Ctx) -> Check<String> {
    let w = Weight::random(Format::F32, 4, 32, &mut ctx.rng);
    let h = upload(&w)?;
    let cases = [
        ("an input alone", vec![Op::Input(32)]),
        ("a product and no output", products(32, 1)[..2].to_vec()),
        ("two products of one input and no output", products(32, 2)[..3].to_vec()),
    ];
    for (what, ops) in &cases {
        refused(&format!("create-program of {what}"), INVALID, || gpu::create_program(&[&h, &h], 0, ops))?;
    }
    Ok("programs of an input alone, of one product and of two with no output: invalid-argument".into())
}

/// A product whose weight's columns differ from the width of its `x`, alone or beside a good
/// one, of an input or of another product.
pub fn cols_mismatch(ctx: &mut Ctx) -> Check<String> {
    let a = Weight::random(Format::F32, 4, 32, &mut ctx.rng);
    let b = Weight::random(Format::Q8x32, 4, 64, &mut ctx.rng);
    let (ha, hb) = (upload(&a)?, upload(&b)?);
    let mm = |x, weight| Op::Matmul(MatmulOp { x, weight, precision: Precision::Exact });
    let cases: [(&str, Vec<&Handle>, Vec<Op>); 5] = [
        ("products of an x of 32 by [f32 [4, 32], q8x32 [4, 64]]", vec![&ha, &hb], products(32, 2)),
        ("products of an x of 32 by [q8x32 [4, 64], f32 [4, 32]]", vec![&hb, &ha], products(32, 2)),
        ("a product of an x of 64 by f32 [4, 32]", vec![&ha], products(64, 1)),
        ("a product of an x of 32 by q8x32 [4, 64]", vec![&hb], products(32, 1)),
        ("a product of another's 4 values by f32 [4, 32]", vec![&ha], vec![Op::Input(32), mm(0, 0), mm(1, 0), Op::Output(2)]),
    ];
    for (what, weights, ops) in &cases {
        refused(&format!("create-program of {what}"), INVALID, || gpu::create_program(weights, 0, ops))?;
    }
    let x32 = ctx.rng.vector(32);
    let y = matmul("the good product alone after the refusals", &x32, 1, 32, &[&ha])?;
    ctx.check("f32 [4, 32] after refused programs", &y[0], &x32, 1, &a.decode())?;
    Ok("products whose weight's cols differ from their x's width, alone, first, last or chained: \
        invalid-argument; the good product alone still computes"
        .into())
}

/// A program of 10000 products whose weights list names one weight 10000 times: refused
/// (`invalid-argument` past the host's cap on a program's weights, or `out-of-memory`), or made
/// and run correctly. (Each entry lends a handle for the call: wasmtime traps past 100000 live
/// handles in a store by default, before the host sees the call.)
pub fn huge_weight_list(ctx: &mut Ctx) -> Check<String> {
    const N: usize = 10_000;
    let w = Weight::random(Format::F32, 2, 32, &mut ctx.rng);
    let h = upload(&w)?;
    let weights = vec![&h; N];
    let what = format!("create-program of {N} products over a list of {N} weights");
    let before = budget()?;
    let p = match gpu::create_program(&weights, 0, &products(32, N as u32)) {
        Ok(p) => p,
        Err(e) if matches!(Kind::of(&e), Kind::InvalidArgument | Kind::OutOfMemory) => {
            let after = budget()?;
            if after != before {
                return fail(format!("{what} was refused, but the budget went from {before:?} to {after:?}"));
            }
            return Ok(format!("{what}: refused with {}", describe(&e)));
        }
        Err(e) => return fail(format!("{what} returned {}; want a program, invalid-argument or out-of-memory", describe(&e))),
    };
    let x = ctx.rng.vector(32);
    let y = p.run(std::slice::from_ref(&x), &[one_sequence(1)]).or_else(|e| fail(format!("the run of {N} products failed: {}", describe(&e))))?;
    if y.len() != N {
        return fail(format!("the run of {N} products returned {} outputs", y.len()));
    }
    let d = w.decode();
    for (j, o) in y.iter().enumerate() {
        let Output::Rows(yj) = o else { return fail(format!("output {j} of {N} is a top, not rows")) };
        ctx.check(&format!("product {j} of {N}"), yj, &x, 1, &d)?;
    }
    Ok(format!("{what}: made, and every output of its run correct"))
}

/// `create-kv-cache`: a valid cache costs `8 * slots * width` bytes and a handle, says its size
/// and gives them back when dropped; caches of no size, of sizes that overflow 64 bits, past
/// `max-weight-bytes` (a half) or past the budget are refused with the documented error and
/// change nothing. A host without kv-caches (`unavailable`) skips the case.
pub fn kv_cache(ctx: &mut Ctx) -> Check<String> {
    let before = budget()?;
    let (slots, width) = (40u32, 48u32);
    let cache = match gpu::create_kv_cache(slots, width) {
        Ok(c) => c,
        Err(Error::Unavailable(m)) => return skip(format!("the host does not offer kv-caches (allowed): {m}")),
        Err(e) => return fail(format!("create-kv-cache of {slots} slots of {width} failed: {}", describe(&e))),
    };
    let during = budget()?;
    let bytes = 8 * slots as u64 * width as u64;
    let got = (cache.slots(), cache.width());
    if during != (before.0.wrapping_sub(bytes), before.1.wrapping_sub(1)) || got != (slots, width) {
        return fail(format!(
            "a kv-cache of {slots} x {width}: budget {before:?} -> {during:?} (want {bytes} bytes and a handle \
             less), slots and width {got:?}"
        ));
    }
    drop(cache);
    let after = budget()?;
    if after != before {
        return fail(format!("dropping a kv-cache left the budget at {after:?}, not {before:?}"));
    }
    let valid = format!("a kv-cache of {slots} x {width} costs {bytes} bytes and a handle, given back on drop");
    let oom = &[Kind::OutOfMemory];
    let too_big = &[Kind::InvalidArgument, Kind::OutOfMemory];
    refused("create-kv-cache of 0 slots of 6", INVALID, || gpu::create_kv_cache(0, 6))?;
    refused("create-kv-cache of 8 slots of 0", INVALID, || gpu::create_kv_cache(8, 0))?;
    refused("create-kv-cache of 0 slots of 0", INVALID, || gpu::create_kv_cache(0, 0))?;
    let max = u32::MAX;
    refused(&format!("create-kv-cache of {max} slots of {max}"), too_big, || gpu::create_kv_cache(max, max))?;
    let mut checked = vec!["sizes of 0: invalid-argument", "u32::MAX x u32::MAX: refused"];
    let width = 1024u64;
    let limit = ctx.device.max_weight_bytes;
    let slots = limit / (4 * width) + 1;
    if slots <= max as u64 {
        let what = format!("create-kv-cache of {slots} slots of {width} (halves of {} bytes, max-weight-bytes {limit})", 4 * slots * width);
        refused(&what, oom, || gpu::create_kv_cache(slots as u32, width as u32))?;
        checked.push("past max-weight-bytes: out-of-memory");
    }
    let slots = before.0 / (8 * width) + 1;
    if slots <= max as u64 {
        let what = format!("create-kv-cache of {slots} slots of {width} ({} bytes, budget-bytes {})", 8 * slots * width, before.0);
        refused(&what, oom, || gpu::create_kv_cache(slots as u32, width as u32))?;
        checked.push("past budget-bytes: out-of-memory");
    }
    Ok(format!("{valid}; {}", checked.join("; ")))
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
