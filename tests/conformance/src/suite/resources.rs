//! Handles and budgets: accessors, dropping and re-uploading, exhausting the handle and byte
//! budgets, the device's size limits, and the state the kit leaves behind.

use super::{Check, Ctx, Kind, allocate, budget, expect, fail, matmul, one_sequence, products, program, refused, shape, skip, upload, wit};
use crate::bindings::wisp::llm::gpu::{self, Error, Op, WeightFormat};
use crate::reference::{Format, Weight};

/// The most handles the kit allocates to exhaust the handle budget.
const MAX_HANDLES: u32 = 65536;
/// The largest byte budget the kit fills.
const MAX_FILL_BYTES: u64 = 256 << 20;

/// `rows`, `cols` and `format` say what was uploaded or allocated.
pub fn accessors(ctx: &mut Ctx) -> Check<String> {
    for f in Format::ALL {
        let (n_out, n_in) = (ctx.rng.range(1, 40), f.block() * ctx.rng.range(1, 8));
        let w = Weight::random(f, n_out, n_in, &mut ctx.rng);
        for (how, h) in [("uploaded", upload(&w)?), ("allocated", allocate(f, n_out, n_in)?)] {
            let got = (h.rows(), h.cols(), h.format());
            if got != (n_out, n_in, wit(f)) {
                return fail(format!("{how} {}: rows, cols, format are {got:?}", shape(&w)));
            }
        }
    }
    Ok("rows, cols and format of uploaded and allocated weights of every format".into())
}

/// Dropping a weight gives its budget back and leaves the others working; new uploads work.
pub fn lifetimes(ctx: &mut Ctx) -> Check<String> {
    let before = budget()?;
    if before.1 < 3 {
        return skip(format!("budget-handles is {}: the case holds 3 weights", before.1));
    }
    let n_in = 96;
    let a = Weight::random(Format::Q8x32, 40, n_in, &mut ctx.rng);
    let b = Weight::random(Format::Q4x32, 17, n_in, &mut ctx.rng);
    let ha = upload(&a)?;
    let hb = upload(&b)?;
    let held = budget()?;
    if held.1 != before.1 - 2 || held.0 >= before.0 {
        return fail(format!(
            "after two uploads the budget (bytes, handles) is {held:?}; it was {before:?}: both must go down"
        ));
    }
    drop(ha);
    let one = budget()?;
    if one.1 != before.1 - 1 || one.0 <= held.0 {
        return fail(format!(
            "after dropping {} the budget (bytes, handles) is {one:?}; with both held it was {held:?}: \
             a dropped weight's bytes and handle must be given back",
            shape(&a)
        ));
    }
    let x = ctx.rng.vector(3 * n_in as usize);
    let y = matmul("the weight left after a drop", &x, 3, n_in, &[&hb])?;
    ctx.check(&format!("{} after another weight was dropped", shape(&b)), &y[0], &x, 3, &b.decode())?;
    let c = Weight::random(Format::F32, 23, n_in, &mut ctx.rng);
    let hc = upload(&c)?;
    let y = matmul("a new upload after a drop", &x, 3, n_in, &[&hb, &hc])?;
    ctx.check(&shape(&b), &y[0], &x, 3, &b.decode())?;
    ctx.check(&format!("{} uploaded after a drop", shape(&c)), &y[1], &x, 3, &c.decode())?;
    drop((hb, hc));
    drop(allocate(Format::Q8x16, 9, n_in)?);
    let after = budget()?;
    if after != before {
        return fail(format!(
            "after dropping every weight the budget (bytes, handles) is {after:?}; it was {before:?}"
        ));
    }
    Ok("upload two, drop one (its budget comes back, the other still works), upload again, drop all".into())
}

/// Allocating past `budget-handles` is `out-of-memory`; dropping gives the handles back.
pub fn budget_handles(ctx: &mut Ctx) -> Check<String> {
    let (_, handles) = budget()?;
    if handles > MAX_HANDLES {
        return skip(format!("budget-handles is {handles}: more than the kit allocates ({MAX_HANDLES})"));
    }
    let mut held = Vec::with_capacity(handles as usize);
    for i in 0..handles {
        match gpu::allocate(WeightFormat::F32, 1, 1) {
            Ok(h) => held.push(h),
            Err(e) => {
                return fail(format!(
                    "allocate {} of f32 [1, 1], within budget-handles {handles}, returned {}",
                    i + 1,
                    super::describe(&e)
                ));
            }
        }
    }
    expect(
        &format!("allocate {} of f32 [1, 1], past budget-handles {handles}", handles + 1),
        gpu::allocate(WeightFormat::F32, 1, 1),
        &[Kind::OutOfMemory],
    )?;
    let (_, left) = budget()?;
    if left != 0 {
        return fail(format!("with {handles} handles held, budget-handles is {left}, not 0"));
    }
    drop(held);
    let (_, back) = budget()?;
    if back != handles {
        return fail(format!("after dropping {handles} handles, budget-handles is {back}, not {handles}"));
    }
    let w = Weight::random(Format::F32, 3, 5, &mut ctx.rng);
    let h = upload(&w)?;
    let x = ctx.rng.vector(5);
    let y = matmul("an upload after the handle budget was spent and given back", &x, 1, 5, &[&h])?;
    ctx.check("f32 [3, 5] after the handle budget was given back", &y[0], &x, 1, &w.decode())?;
    Ok(format!("{handles} handles held, the next allocate out-of-memory, all given back on drop"))
}

/// Uploading until the byte budget is spent ends in `out-of-memory`, no later than
/// `budget-bytes`; dropping gives the bytes back.
pub fn budget_bytes(ctx: &mut Ctx) -> Check<String> {
    let (bytes, handles) = budget()?;
    if bytes > MAX_FILL_BYTES {
        return skip(format!(
            "budget-bytes is {bytes}: more than the kit fills ({} MiB); run it with a smaller budget \
             (`wisp conformance` gives 64 MiB)",
            MAX_FILL_BYTES >> 20
        ));
    }
    // q8x32 weights of about an eighth of the budget each.
    let n_in = 1024u32;
    let rows = (bytes / 8 / n_in as u64).clamp(1, (ctx.device.max_weight_bytes / n_in as u64).clamp(1, u32::MAX as u64))
        as u32;
    let chunk = rows as u64 * n_in as u64;
    let data = vec![1u8; chunk as usize];
    let scales = vec![0.5f32; chunk as usize / 32];
    let mut held = Vec::new();
    loop {
        if held.len() as u32 >= handles {
            return skip(format!("budget-handles {handles} ran out before budget-bytes {bytes}"));
        }
        match gpu::upload(WeightFormat::Q8x32, rows, n_in, &data, &scales) {
            Ok(h) => held.push(h),
            Err(Error::OutOfMemory(_)) => break,
            Err(e) => {
                return fail(format!(
                    "upload {} of q8x32 [{rows}, {n_in}] ({chunk} bytes) returned {}; want success within \
                     budget-bytes {bytes}, then out-of-memory",
                    held.len() + 1,
                    super::describe(&e)
                ));
            }
        }
        if held.len() as u64 * chunk > bytes {
            return fail(format!(
                "{} uploads of {chunk} bytes were accepted: more than budget-bytes {bytes}",
                held.len()
            ));
        }
    }
    let n = held.len();
    if n == 0 && chunk * 9 / 8 <= bytes {
        return fail(format!("the first upload of {chunk} bytes was refused with budget-bytes {bytes}"));
    }
    drop(held);
    let back = budget()?;
    if back != (bytes, handles) {
        return fail(format!(
            "after dropping {n} weights the budget (bytes, handles) is {back:?}; it was {:?}",
            (bytes, handles)
        ));
    }
    let w = Weight::random(Format::Q8x32, rows.min(64), n_in, &mut ctx.rng);
    let h = upload(&w)?;
    let x = ctx.rng.vector(n_in as usize);
    let y = matmul("an upload after the byte budget was spent and given back", &x, 1, n_in, &[&h])?;
    ctx.check(&format!("{} after the byte budget was given back", shape(&w)), &y[0], &x, 1, &w.decode())?;
    Ok(format!(
        "{n} uploads of {chunk} bytes (q8x32 [{rows}, {n_in}]) accepted, the next out-of-memory; all given back on drop"
    ))
}

/// A weight past `max-weight-bytes` is `out-of-memory`, refused before anything is reserved.
pub fn limit_weight_bytes(ctx: &mut Ctx) -> Check<String> {
    let max = ctx.device.max_weight_bytes;
    let n_in = 65536u32;
    for f in Format::ALL {
        let row = f.row_bytes(n_in) as u64;
        let n_out = max / row + 1;
        if n_out > u32::MAX as u64 {
            return skip(format!("max-weight-bytes {max} is more than any [u32, 65536] weight"));
        }
        let what =
            format!("allocate of {} [{n_out}, {n_in}] ({} bytes, max-weight-bytes {max})", f.name(), n_out * row);
        refused(&what, &[Kind::OutOfMemory], || gpu::allocate(wit(f), n_out as u32, n_in))?;
    }
    Ok(format!("weights of every format one row past max-weight-bytes {max}: out-of-memory"))
}

/// A run whose value (an input, or a product it makes) holds more than
/// `max-activation-elements` values is `out-of-memory`.
pub fn limit_activations(ctx: &mut Ctx) -> Check<String> {
    let max = ctx.device.max_activation_elements;
    let (bytes, _) = budget()?;
    // A product's value: t rows of x against a weight [n_out, 1], t * n_out one past the limit.
    let t = max.min(1 << 16);
    let n_out = max / t + 1;
    if n_out > u32::MAX as u64 || 4 * n_out > ctx.device.max_weight_bytes.min(bytes) {
        return skip(format!("max-activation-elements {max} needs a weight larger than the device or budget takes"));
    }
    let h = allocate(Format::F32, n_out as u32, 1)?;
    let p = program(&format!("a product of f32 [{n_out}, 1]"), &[&h], &products(1, 1))?;
    let x = vec![1.0f32; t as usize];
    let what = format!(
        "a run of a product of {t} rows by f32 [{n_out}, 1] (a value of {} values, max-activation-elements {max})",
        t * n_out
    );
    refused(&what, &[Kind::OutOfMemory], || p.run(&[x], &[one_sequence(t as u32)]))?;
    let mut checked = vec![what];
    // An input's value, where the input fits in a list the kit can send (16 MiB).
    if max < 1 << 22 {
        let p = program("an input of width 1 and its output", &[], &[Op::Input(1), Op::Output(0)])?;
        let t = max + 1;
        let x = vec![1.0f32; t as usize];
        let what = format!("a run of an input of {t} rows of 1 (max-activation-elements {max})");
        refused(&what, &[Kind::OutOfMemory], || p.run(&[x], &[one_sequence(t as u32)]))?;
        checked.push(what);
    }
    Ok(checked.join("; ") + ": out-of-memory")
}

/// After every refusal and drop of the kit, the budget is what it was at the start and the
/// device still computes.
pub fn recovers(ctx: &mut Ctx) -> Check<String> {
    let now = budget()?;
    if now != ctx.initial {
        return fail(format!(
            "the budget (bytes, handles) is {now:?}; when the kit started it was {:?}: weights dropped, \
             or calls refused, earlier in the kit were not given back",
            ctx.initial
        ));
    }
    let w = Weight::random(Format::Q4x32, ctx.rng.range(1, 100), 32 * ctx.rng.range(1, 8), &mut ctx.rng);
    let h = upload(&w)?;
    let t = ctx.rng.range(1, 6);
    let x = ctx.rng.vector((t * w.n_in) as usize);
    let y = matmul("an upload after the kit's refusals", &x, t, w.n_in, &[&h])?;
    ctx.check(&format!("{} t {t} after the kit's refusals", shape(&w)), &y[0], &x, t, &w.decode())?;
    Ok("the budget is back where it started, and a new upload computes correctly".into())
}
