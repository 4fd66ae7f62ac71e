//! `ffn`: gated feed-forward blocks over every upload format and both activations, one token
//! and batches, held to the kit's exact chain of products; and calls whose shapes do not chain.
//! A host may not offer `ffn` (`unavailable`): both cases skip then.

use super::{Check, Ctx, Kind, describe, fail, refused, skip, upload};
use crate::bindings::wisp::llm::gpu::{self, Activation, Error, Weight as Handle};
use crate::reference::{Act, Format, Weight, compare_ffn};

fn wit(a: Act) -> Activation {
    match a {
        Act::GeluTanh => Activation::GeluTanh,
        Act::Silu => Activation::Silu,
    }
}

/// A valid `ffn` call; a host without it skips the case.
fn call(what: &str, x: &[f32], t: u32, n_in: u32, [g, u, d]: [&Handle; 3], act: Act) -> Check<Vec<f32>> {
    match gpu::ffn(x, t, n_in, g, u, d, wit(act)) {
        Ok(y) => Ok(y),
        Err(Error::Unavailable(m)) => skip(format!("the host does not offer ffn (allowed): {m}")),
        Err(e) => fail(format!("{what}: ffn failed: {}", describe(&e))),
    }
}

/// Four shapes (one token, a few, a batch, a batch past 128 rows), the formats of gate, up and
/// down drawn from every format, the activations alternating.
pub fn matches(ctx: &mut Ctx) -> Check<String> {
    let r = &mut ctx.rng;
    let shapes = [(1, r.range(1, 4), r.range(1, 5), r.range(1, 70)), (r.range(2, 9), 4, 6, 100), (r.range(30, 50), 8, 12, 300), (r.range(129, 150), 6, 8, 200)];
    let mut done = Vec::new();
    for (i, (t, in_blocks, ff_blocks, n_out)) in shapes.into_iter().enumerate() {
        // The first block all float formats (odd widths), the others cycling through all.
        let pick = |k: usize| if i == 0 { [Format::F32, Format::Bf16, Format::F32][k] } else { Format::ALL[(i * 3 + k) % Format::ALL.len()] };
        let (fg, fu, fd) = (pick(0), pick(1), pick(2));
        // Widths that are whole blocks of every format (32), plus an odd one where all three
        // weights are float formats.
        let floats = [fg, fu, fd].iter().all(|f| f.block() == 1);
        let (n_in, n_ff) = (32 * in_blocks + if floats { 5 } else { 0 }, 32 * ff_blocks + if floats { 3 } else { 0 });
        let act = if i % 2 == 0 { Act::GeluTanh } else { Act::Silu };
        let ws = [Weight::random(fg, n_ff, n_in, &mut ctx.rng), Weight::random(fu, n_ff, n_in, &mut ctx.rng), Weight::random(fd, n_out, n_ff, &mut ctx.rng)];
        let hs = ws.iter().map(upload).collect::<Check<Vec<_>>>()?;
        let x = ctx.rng.vector((t * n_in) as usize);
        let what = format!(
            "ffn t {t}, [{n_in} -> {n_ff} -> {n_out}], {} {} {}, {act:?}",
            fg.name(),
            fu.name(),
            fd.name()
        );
        let y = call(&what, &x, t, n_in, [&hs[0], &hs[1], &hs[2]], act)?;
        let decoded = ws.each_ref().map(Weight::decode);
        match compare_ffn(&y, &x, t as usize, decoded.each_ref(), act) {
            Ok(e) => ctx.max_error = ctx.max_error.max(e),
            Err(m) => {
                ctx.max_error = ctx.max_error.max(m.max_error);
                return fail(format!("{what}: {}", m.message));
            }
        }
        done.push(what);
    }
    Ok(done.join("; "))
}

/// Shapes that do not chain and inputs that do not match: `invalid-argument`, nothing changed.
pub fn hostile(ctx: &mut Ctx) -> Check<String> {
    let w = |n_out, n_in, ctx: &mut Ctx| upload(&Weight::random(Format::F32, n_out, n_in, &mut ctx.rng));
    let (gate, up, down) = (w(6, 4, ctx)?, w(6, 4, ctx)?, w(3, 6, ctx)?);
    let (wide, tall) = (w(6, 5, ctx)?, w(7, 4, ctx)?);
    let x = ctx.rng.vector(8);
    call("a valid ffn", &x, 2, 4, [&gate, &up, &down], Act::Silu)?;
    let cases: [(&str, &[f32], u32, u32, [&Handle; 3]); 7] = [
        ("t = 0", &[], 0, 4, [&gate, &up, &down]),
        ("an x shorter than t * n-in", &x[..7], 2, 4, [&gate, &up, &down]),
        ("an x longer than t * n-in", &x, 1, 4, [&gate, &up, &down]),
        ("a gate of 5 columns for n-in 4", &x, 2, 4, [&wide, &up, &down]),
        ("an up of 5 columns", &x, 2, 4, [&gate, &wide, &down]),
        ("an up of 7 rows against a gate of 6", &x, 2, 4, [&gate, &tall, &down]),
        ("a down of 4 columns against 6 hidden values", &x, 2, 4, [&gate, &up, &tall]),
    ];
    for (what, x, t, n_in, [g, u, d]) in cases {
        refused(&format!("ffn with {what}"), &[Kind::InvalidArgument], || gpu::ffn(x, t, n_in, g, u, d, Activation::GeluTanh))?;
    }
    Ok(format!("{} ffn calls that do not chain refused with invalid-argument", cases.len()))
}
