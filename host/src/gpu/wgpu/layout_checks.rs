//! The kernel parameter layouts and constants are defined once, here in Rust; the shaders and
//! the browser host spell them out again, and these tests hold each spelling to the Rust one
//! (llama.cpp's `ggml-common.h` habit, checked rather than generated).
#![cfg(test)]

use super::attention;
use super::{
    DISPATCH_MACS, GEMM_MIN_T, GEMM_ROWS, PARAMS_BYTES, Params, WORKGROUP, WRITE_CHUNK, X_PLAIN,
    format_id, x_act,
};
use crate::gpu::{Activation, Format};
use std::collections::HashMap;

const MATMUL: &str = include_str!("../../../../shaders/matmul.wgsl");
const ATTENTION: &str = include_str!("../../../../shaders/attention.wgsl");
const WEBGPU: &str = include_str!("../../../../web/src/webgpu.js");
const PROGRAM_JS: &str = include_str!("../../../../web/src/program.js");

/// Every `const NAME: u32 = Nu;` of a WGSL source.
fn wgsl_consts(src: &str) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for line in src.lines() {
        let Some(rest) = line.trim().strip_prefix("const ") else { continue };
        let Some((name, value)) = rest.split_once(": u32 = ") else { continue };
        // Constants made of others (`MAX_HEAD_DIM / WG`) are left out.
        if let Ok(v) = value.trim_end_matches(';').trim_end_matches('u').parse() {
            out.insert(name.to_string(), v);
        }
    }
    out
}

/// The field names of WGSL struct `name`, in order.
fn wgsl_fields(src: &str, name: &str) -> Vec<String> {
    let start = src.find(&format!("struct {name} {{")).unwrap_or_else(|| panic!("no struct {name}"));
    let body = &src[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
    body.lines()
        .map(|l| l.split("//").next().unwrap_or("").trim())
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_string()))
        .collect()
}

/// The field names of a Rust struct, in order, from its `Debug` form.
fn rust_fields(debug: &str) -> Vec<String> {
    let body = &debug[debug.find('{').unwrap() + 1..debug.rfind('}').unwrap()];
    body.split(',').filter_map(|f| f.split_once(':').map(|(n, _)| n.trim().to_string())).collect()
}

/// Every top-level `const NAME = <integer expression>;` of a JS source (exported or not):
/// integers, `a ** b` and `a << b`.
fn js_consts(src: &str) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for line in src.lines() {
        let Some(rest) = line.strip_prefix("export ").unwrap_or(line).strip_prefix("const ") else { continue };
        let Some((name, expr)) = rest.split_once(" = ") else { continue };
        let expr = expr.trim_end_matches(';');
        let num = |s: &str| s.trim().parse::<u64>().ok();
        let value = if let Some((a, b)) = expr.split_once("**") {
            num(a).zip(num(b)).map(|(a, b)| a.pow(b as u32))
        } else if let Some((a, b)) = expr.split_once("<<") {
            num(a).zip(num(b)).map(|(a, b)| a << b)
        } else {
            num(expr)
        };
        if let Some(v) = value {
            out.insert(name.trim().to_string(), v);
        }
    }
    out
}

/// The `key: N` pairs of the JS object literal after `const NAME = {` (one line).
fn js_object(src: &str, name: &str) -> HashMap<String, u64> {
    let line = src.lines().find(|l| l.starts_with(&format!("const {name} = {{"))).unwrap_or_else(|| panic!("no {name}"));
    let body = &line[line.find('{').unwrap() + 1..line.rfind('}').unwrap()];
    body.split(',')
        .filter_map(|kv| kv.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().parse().unwrap()))
        .collect()
}

#[test]
fn the_shaders_params_are_rusts() {
    let names = rust_fields(&format!("{:?}", <Params as bytemuck::Zeroable>::zeroed()));
    assert_eq!(names, wgsl_fields(MATMUL, "Params"));
    assert_eq!(PARAMS_BYTES as usize, 4 * names.len());
    let names = rust_fields(&format!("{:?}", <attention::Params as bytemuck::Zeroable>::zeroed()));
    assert_eq!(names, wgsl_fields(ATTENTION, "Shape"));
}

#[test]
fn the_shaders_constants_are_rusts() {
    let m = wgsl_consts(MATMUL);
    let want: &[(&str, u64)] = &[
        ("WG", WORKGROUP as u64),
        ("F32", format_id(Format::F32) as u64),
        ("BF16", format_id(Format::Bf16) as u64),
        ("Q8X32", format_id(Format::Q8x32) as u64),
        ("Q8X16", format_id(Format::Q8x16) as u64),
        ("Q4X32", format_id(Format::Q4x32) as u64),
        // The wgpu host's alone (the browser host takes a top-k on the host).
        ("TOP_CHUNK", super::programs::TOP_CHUNK as u64),
    ];
    for &(name, v) in want.iter().chain(super::programs::SHADER_CONSTANTS) {
        assert_eq!(m.get(name), Some(&v), "{name} in matmul.wgsl");
    }
    let a = wgsl_consts(ATTENTION);
    assert_eq!(a.get("WG"), Some(&64), "WG in attention.wgsl");
    assert_eq!(a.get("MAX_HEAD_DIM"), Some(&(crate::gpu::MAX_HEAD_DIM as u64)), "MAX_HEAD_DIM in attention.wgsl");
}

/// `softcap` is one function, spelled in each shader that caps: the same text in both.
#[test]
fn the_shaders_soft_caps_are_one() {
    let of = |src: &'static str| {
        let from = src.find("\nfn softcap(").expect("fn softcap");
        &src[from..from + src[from..].find("\n}\n").expect("its end")]
    };
    assert_eq!(of(MATMUL), of(ATTENTION));
}

#[test]
fn the_browser_hosts_constants_are_rusts() {
    let js = js_consts(WEBGPU);
    let want: &[(&str, u64)] = &[
        ("WORKGROUP", WORKGROUP as u64),
        ("GEMM_MIN_T", GEMM_MIN_T as u64),
        ("GEMM_ROWS", GEMM_ROWS as u64),
        ("DISPATCH_MACS", DISPATCH_MACS),
        ("WRITE_CHUNK", WRITE_CHUNK as u64),
        ("PARAMS_BYTES", PARAMS_BYTES),
        ("SHAPE_BYTES", attention::PARAMS_BYTES),
    ];
    for &(name, v) in want.iter().chain(super::programs::SHADER_CONSTANTS) {
        assert_eq!(js.get(name), Some(&v), "{name} in web/src/webgpu.js");
    }
    let acts = js_object(WEBGPU, "X_ACT");
    assert_eq!(acts["none"], X_PLAIN as u64);
    assert_eq!(acts["gelu_tanh"], x_act(Activation::GeluTanh) as u64);
    assert_eq!(acts["silu"], x_act(Activation::Silu) as u64);
    for f in [Format::F32, Format::Bf16, Format::Q8x32, Format::Q8x16, Format::Q4x32] {
        let line = WEBGPU
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{}: {{ id:", f.name())))
            .unwrap_or_else(|| panic!("{} in FORMATS", f.name()));
        assert!(line.contains(&format!("id: {},", format_id(f) as u64)), "{line}");
        assert!(line.contains(&format!("block: {}n", f.block())), "{line}");
    }
}

#[test]
fn the_browser_hosts_params_are_rusts() {
    // `const PARAMS_FIELDS = ['nIn', ...];`: the Rust field names in camel case, in order.
    let line = WEBGPU.lines().find(|l| l.starts_with("const PARAMS_FIELDS = [")).expect("PARAMS_FIELDS in web/src/webgpu.js");
    let js: Vec<String> = line[line.find('[').unwrap() + 1..line.rfind(']').unwrap()]
        .split(',')
        .map(|f| f.trim().trim_matches('\'').to_string())
        .collect();
    let camel = |snake: &str| {
        let mut parts = snake.split('_');
        let first = parts.next().unwrap_or("").to_string();
        parts.fold(first, |acc, p| acc + &p[..1].to_uppercase() + &p[1..])
    };
    let rust: Vec<String> = rust_fields(&format!("{:?}", <Params as bytemuck::Zeroable>::zeroed())).iter().map(|f| camel(f)).collect();
    assert_eq!(js, rust);
}

#[test]
fn the_browser_hosts_program_limits_are_rusts() {
    use crate::gpu::program;
    let js = js_consts(PROGRAM_JS);
    let want: &[(&str, u64)] = &[
        ("MAX_OPS", program::MAX_OPS as u64),
        ("MAX_CACHES", program::MAX_CACHES as u64),
        ("MAX_SEQUENCES", program::MAX_SEQUENCES as u64),
        ("MAX_TOP_K", program::MAX_TOP_K as u64),
        ("MAX_HEAD_DIM", crate::gpu::MAX_HEAD_DIM as u64),
    ];
    for &(name, v) in want {
        assert_eq!(js.get(name), Some(&v), "{name} in web/src/program.js");
    }
}

#[test]
fn the_parsers_see_what_they_should() {
    // A constant or field the parsers skipped would pass the checks above vacuously.
    assert!(wgsl_consts(MATMUL).len() >= 20);
    assert_eq!(wgsl_fields("struct S {\n    a: u32, // x\n    b: f32,\n}", "S"), ["a", "b"]);
    assert_eq!(js_consts("const A = 2 ** 3;\nconst B = 1 << 4;\nconst C = 7;\n  const D = 1;")["A"], 8);
    assert_eq!(js_consts("const B = 1 << 4;")["B"], 16);
    assert!(!js_consts("  const D = 1;").contains_key("D"));
    assert_eq!(js_consts("export const E = 5;")["E"], 5);
}
