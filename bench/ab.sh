#!/usr/bin/env bash
# An A/B of two guests on one host, interleaved in one run (see BENCHMARKS.md): the guest the
# binary carries (A) against the component file B (run as WISP_COMPONENT=B), each round
# `wisp bench --gpu on` of both on a 512-token prompt, then the golden check and the
# conformance kit with A. Run from the repository root on the GPU machine:
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
if [ -d .gl ] && ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
status=0
step() { # name, command...
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee -a "$out/$name.txt" || status=1
}
step device "$wisp" info --model "$model"
for r in $(seq "$rounds"); do
    step "a" "$wisp" bench --model "$model" --gpu on --runs 3 --prompt-tokens 512 --matmul-size 0
    step "b" env WISP_COMPONENT="$b" "$wisp" bench --model "$model" --gpu on --runs 3 --prompt-tokens 512 --matmul-size 0
done
golden=tests/golden/gemma3-270m.json
step golden "$wisp" eval --model "$model" --golden "$golden" --gpu on
step conformance "$wisp" conformance --model "$model"
exit $status
