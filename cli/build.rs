//! The runaway guest of the reliability tests (`tests/runaway`), built by the library's build
//! script: its path reaches this package as the library's `links` metadata and the tests as
//! `WISP_RUNAWAY_WASM`.

fn main() {
    let path = std::env::var("DEP_WISP_RUNAWAY_WASM").expect("the library's build script names the runaway guest");
    println!("cargo:rustc-env=WISP_RUNAWAY_WASM={path}");
}
