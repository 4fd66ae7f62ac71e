#!/usr/bin/env bash
# An A/B of two `wisp` binaries on one GPU, interleaved in one run (see BENCHMARKS.md): each
# round `wisp bench --gpu on` of A, then B, then B with `--precision fast`, on a 512-token prompt;
# then, with B, the golden check (both precisions), the conformance kit, greedy text (--temp 0) with the GPU
# on against the guest's CPU alone, and one decode step's anatomy (WISP_TIMES, WISP_PROFILE).
# Run from the repository root on the GPU machine:
#
#   bench/ab-bins.sh WISP_A WISP_B GGUF [ROUNDS] [OUT_DIR]
#
# Eight files come back in OUT_DIR (the device returns no more): device, a, b, b-fast, golden,
# conformance, greedy, anatomy. If `.gl/` holds the Vulkan loader debs (the device README's
# recipe), they are unpacked first.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: bench/ab-bins.sh WISP_A WISP_B GGUF [ROUNDS] [OUT_DIR]" >&2; exit 2; }
a=$1 b=$2 model=$3 rounds=${4:-3}
out=${5:-${OUT:-/tmp/wisp-ab}}
mkdir -p "$out"
. "$(dirname "$0")/steps.sh"
step device "$b" info --model "$model"
bench=(bench --model "$model" --gpu on --runs 3 --prompt-tokens 512 --matmul-size 0)
for r in $(seq "$rounds"); do
    step a "$a" "${bench[@]}"
    step b "$b" "${bench[@]}"
    step b-fast "$b" "${bench[@]}" --precision fast
done
golden=tests/golden/gemma3-270m.json
step golden "$b" eval --model "$model" --golden "$golden" --gpu on
step golden "$b" eval --model "$model" --golden "$golden" --gpu on --precision fast
step conformance "$b" conformance --model "$model"
prompt="The history of the printing press begins"
on=$("$b" run --model "$model" --gpu on --temp 0 -n 64 --no-display-prompt "$prompt" 2>/dev/null)
off=$("$b" run --model "$model" --gpu off --temp 0 -n 64 --no-display-prompt "$prompt" 2>/dev/null)
printf 'gpu on:  %s\ngpu off: %s\n' "$on" "$off" | tee -a "$out/greedy.txt"
if [ -n "$on" ] && [ "$on" = "$off" ]; then echo "greedy: the same text" | tee -a "$out/greedy.txt"; else echo "greedy: DIFFERENT" | tee -a "$out/greedy.txt"; status=1; fi
step anatomy env WISP_TIMES=1 WISP_PROFILE=1 "$b" bench --model "$model" --gpu on --runs 1 --prompt-tokens 512 --decode-tokens 4 --matmul-size 0
exit $status
