//! The blocks of every GGUF tensor type and their dequantization that the guest's unit test
//! `quant::tests::dequantize_is_ggufs_bit_for_bit` holds wisp's reading to
//! (`tests/formats/formats.gguf`) are the `gguf` package's own: `tests/formats/make.py` writes
//! the same bytes again. Without python3 and gguf the test skips locally and fails under
//! `CI=true` (`.ci/run` installs them).

use wisp_tests::{python, root};

#[test]
fn the_dequantization_fixture_is_ggufs_own() {
    let out = std::env::temp_dir().join(format!("wisp-formats-{}.gguf", std::process::id()));
    if !python("formats/make.py", &[out.as_os_str()], "gguf and numpy") {
        return;
    }
    let made = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let kept = std::fs::read(root().join("tests/formats/formats.gguf")).unwrap();
    assert!(made == kept, "tests/formats/make.py wrote {} bytes unlike tests/formats/formats.gguf ({} bytes): run it again", made.len(), kept.len());
}
