//! Every `tokenizer.ggml.pre` that llama.cpp's vocabulary loader knows, held to
//! `llama-tokenize`: tests/pretok/ids.json holds the ids llama.cpp 0.3.36 gives for each text
//! of tests/pretok/corpus.json under each name (tests/pretok/record.py, run by hand; the suite
//! does not build llama.cpp), in tiny Llama-architecture files (tests/pretok/vocab.py) with two
//! vocabularies: a real one, Qwen2.5-Coder-0.5B's, and `substrings`, whose ids spell out every
//! cut of the pre-tokenizer. wisp must give the same ids for every text under every name,
//! without BOS and without parsing special tokens, as the recording ran. An unknown name is a
//! one-line error that names it.
//!
//! Without python3 and the `gguf` package the test skips locally and fails under `CI=true`.

use std::path::{Path, PathBuf};
use wisp::{GpuCtx, GpuMode};
use wisp_tests::{python, qwen_model, root};

/// The ids recorded under one vocabulary: `(pre, ids of each text)`.
type Recorded = Vec<(String, Vec<Vec<u32>>)>;

/// The texts, and the ids recorded under the real vocabulary (its file name) and under the
/// `substrings` one.
fn recorded() -> (Vec<String>, String, Recorded, Recorded) {
    let text = std::fs::read_to_string(root().join("tests/pretok/ids.json")).expect("tests/pretok/ids.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("ids.json is JSON");
    let texts: Vec<String> = serde_json::from_value(v["texts"].clone()).expect("texts: a list of strings");
    let pres = |vocab: &str| -> Recorded {
        let pres: serde_json::Map<String, serde_json::Value> =
            serde_json::from_value(v["vocabs"][vocab]["pre"].clone()).expect("pre: a map from names to ids");
        pres.into_iter().map(|(name, ids)| (name, serde_json::from_value(ids).expect("a list of lists of ids"))).collect()
    };
    let file = v["vocabs"]["real"]["file"].as_str().expect("vocabs.real.file").to_string();
    (texts, file, pres("real"), pres("substrings"))
}

/// Tiny files carrying the vocabulary `source` (a GGUF file, or `substrings`) under each of
/// `pres`, in a directory of their own (`tag`), or `None` (after saying why) without Python's
/// packages.
fn models(tag: &str, source: &std::ffi::OsStr, pres: &[&str]) -> Option<PathBuf> {
    let out = std::env::temp_dir().join(format!("wisp-pretok-{tag}-{}", std::process::id()));
    let mut args = vec![source, out.as_os_str()];
    args.extend(pres.iter().map(|p| std::ffi::OsStr::new(*p)));
    python("pretok/vocab.py", &args, "gguf and numpy").then_some(out)
}

/// The ids wisp gives each text under the file at `path`; the error for a file it refuses.
fn tokenize(wisp: &wisp::Wisp, path: &Path, texts: &[String]) -> Result<Vec<Vec<u32>>, String> {
    let mut inst = wisp.instantiate(GpuCtx::none(), path.parent()).expect("an instance");
    let m = match inst.open_model(path, GpuMode::Off).expect("no trap") {
        Ok(m) => m,
        Err(e) => return Err(e.to_string()),
    };
    Ok(texts.iter().map(|t| inst.tokenize(m, t, false, false).expect("no trap").expect("tokenizes")).collect())
}

/// wisp against the ids recorded under the vocabulary `source`: a line for each text that
/// differs, or each name wisp refuses.
fn differences(tag: &str, source: &std::ffi::OsStr, pres: &Recorded, texts: &[String]) -> Option<Vec<String>> {
    assert!(pres.len() >= 80, "ids.json records {} names for {tag}", pres.len());
    let names: Vec<&str> = pres.iter().map(|(n, _)| n.as_str()).collect();
    let dir = models(tag, source, &names)?;
    let wisp = wisp::Wisp::new(wisp::Options::default()).expect("the runtime");
    let mut out = Vec::new();
    for (name, want) in pres {
        let path = dir.join(format!("{name}.gguf"));
        match tokenize(&wisp, &path, texts) {
            Err(e) => out.push(format!("{tag} {name}: {e}")),
            Ok(got) => {
                for ((text, got), want) in texts.iter().zip(&got).zip(want) {
                    if got != want {
                        out.push(format!("{tag} {name}: {text:?}: wisp {got:?}, llama-tokenize {want:?}"));
                    }
                }
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Some(out)
}

#[test]
fn every_pre_tokenizer_gives_the_ids_of_llama_tokenize_on_the_corpus() {
    let (texts, file, real, substrings) = recorded();
    assert_eq!(qwen_model().file_name().and_then(|f| f.to_str()), Some(file.as_str()), "the recorded vocabulary");
    let Some(mut failures) = differences("real", qwen_model().as_os_str(), &real, &texts) else { return };
    failures.extend(differences("substrings", "substrings".as_ref(), &substrings, &texts).unwrap_or_default());
    assert!(failures.is_empty(), "{} differences:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn an_unknown_pre_tokenizer_is_a_one_line_error_naming_it() {
    let Some(dir) = models("unknown", "substrings".as_ref(), &["no-such-pre"]) else { return };
    let wisp = wisp::Wisp::new(wisp::Options::default()).expect("the runtime");
    let e = tokenize(&wisp, &dir.join("no-such-pre.gguf"), &[]).expect_err("an unknown pre-tokenizer is refused");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(e.contains("\"no-such-pre\"") && !e.contains('\n'), "{e}");
}
