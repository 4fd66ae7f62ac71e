#!/usr/bin/env bash
# `wisp bake`'s component measured: bake time and size, a guest instance started with the
# model pre-initialized against one that reads the GGUF (host/examples/instance_start.rs, the
# same wasmtime mechanism as `wasmtime serve`), then under `wasmtime serve`: a new instance per
# request and the time to first token beside warm `wisp serve` (bench/bake.py).
#
#   bench/bake.sh [MODEL=qwen2.5-coder-0.5b]
#
# Needs a release build with the example (`cargo build --release --examples`), wasmtime-cli
# 48 (WASMTIME, else ~/.cache/wisp/tools/bin/wasmtime, where cli/tests/bake.rs installs it)
# and python3 with httpx (pip).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
wisp=${WISP:-$target/release/wisp}
wasmtime=${WASMTIME:-$HOME/.cache/wisp/tools/bin/wasmtime}
model=$("$wisp" fetch "${1:-qwen2.5-coder-0.5b}")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%FT%TZ); wisp $(git rev-parse --short HEAD); $("$wasmtime" --version)"
/usr/bin/time -f "bake: %e s, peak RSS %M KiB" "$wisp" bake --model "$model" -o "$out/model.http.wasm" 2>&1 | grep -v "^wisp: run it"
echo "model file $(stat -c %s "$model") bytes, component $(stat -c %s "$out/model.http.wasm") bytes"
"$target/release/examples/instance_start" "$model" 20
python3 bench/bake.py "$wasmtime" "$out/model.http.wasm" "$wisp" "$model"
