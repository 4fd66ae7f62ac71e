#!/usr/bin/env bash
# An A/B of two guests on one host, interleaved in one run (see BENCHMARKS.md): the guest the
# binary carries (A) against the component file B (run as WISP_COMPONENT=B), each round
# `wisp bench --gpu on` of both on a 512-token prompt (and of A with `--precision fast`), then
# the golden check (both precisions) and the conformance kit with A. Run from the repository
# root on the GPU machine:
#
#   bench/ab.sh WISP GGUF B_WASM [ROUNDS] [OUT_DIR]
#
# Each bench prints its first run apart ("run 1: prefill ..."): a process's first prefill,
# pipelines built on first use included. If `.gl/` holds the Vulkan loader debs (the device
# README's recipe), they are unpacked first.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: bench/ab.sh WISP GGUF B_WASM [ROUNDS] [OUT_DIR]" >&2; exit 2; }
wisp=$1 model=$2 b=$3 rounds=${4:-3}
out=${5:-${OUT:-/tmp/wisp-ab}}
mkdir -p "$out"
. "$(dirname "$0")/steps.sh"
step device "$wisp" info --model "$model"
for r in $(seq "$rounds"); do
    step "a" "$wisp" bench --model "$model" --gpu on --runs 3 --prompt-tokens 512 --matmul-size 0
    step "b" env WISP_COMPONENT="$b" "$wisp" bench --model "$model" --gpu on --runs 3 --prompt-tokens 512 --matmul-size 0
    step "a-fast" "$wisp" bench --model "$model" --gpu on --runs 3 --prompt-tokens 512 --matmul-size 0 --precision fast
done
golden=tests/golden/gemma3-270m.json
step golden "$wisp" eval --model "$model" --golden "$golden" --gpu on
step golden-fast "$wisp" eval --model "$model" --golden "$golden" --gpu on --precision fast
step conformance "$wisp" conformance --model "$model"
exit $status
