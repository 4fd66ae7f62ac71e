#!/usr/bin/env bash
# The GPU benchmark of issue #11, in one run on the GPU machine (see BENCHMARKS.md, "GPU path:
# NVIDIA H200"). Run from the repository root there:
#
#   bench/gpu.sh WISP GEMMA_GGUF QWEN_GGUF [OUT_DIR]
#
# WISP is a `wisp` binary built here (`cargo build --release`); the machine has no network, so
# the binary and the models travel with it: `bench/carry.sh` here packs them into `.dev/` and
# prints the calls that carry them, and `bench/carry.sh --unpack` there puts them in /tmp. If
# `.gl/` holds the Vulkan loader debs (the device README's recipe), they are unpacked first.
#
# What it runs, each part's output also in OUT_DIR (default $OUT, else /tmp/wisp-gpu):
#   1. the device wgpu finds;
#   2. per model: `wisp bench` with --gpu on, auto and off (128-token prompt) and --gpu on with
#      a 512-token prompt, in both precisions; the golden check with --gpu on, both precisions;
#   3. wisp's matmul per upload format at [4096, 4096] for t = 1, 16, 128, 512 and 4096 (4096^3)
#      and at [16384, 16384] (GEMV bandwidth),
#      whole calls (x uploaded, y read back) and kernels alone (timestamp queries around ten
#      back-to-back runs); the conformance kit against this GPU;
#   4. if WISP_TESTS names the wgpu_backend test binary (`cargo test --release -p wisp --test
#      wgpu_backend --no-run` prints it), the backend's tests on this GPU (cooperative matrices
#      required), its kernel sweep (every kernel variant, cooperative matrices included,
#      kernel-only; GEMV also at
#      [32768, 32768]) and its round-trip sweep (attention and a small product, end to end);
#   5. torch on the same GPU: fp32 (TF32 off) and fp16 products at 4096^3 and at the models'
#      shapes, and the device-to-device copy rate (bench/torch_ref.py).
# With WISP_MODELS_ONLY=1, parts 1 and 2 and the conformance kit only. With WISP_PARALLEL_ONLY=1,
# part 1 and then batched decoding alone, Gemma's (QWEN_GGUF may be -): `wisp bench --parallel
# 1,4,16,64` (N sessions of a 128-token prompt and 128 generated tokens each) and, where
# LLAMA_BATCHED names llama.cpp's `llama-batched-bench` (its CUDA build, see
# ../shared/tools/llama-cpp.sh), the same shape there (-npp 128 -ntg 128 -npl 1,4,16,64),
# interleaved, WISP_ROUNDS (default 2) rounds of each.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: bench/gpu.sh WISP GEMMA_GGUF QWEN_GGUF [OUT_DIR]" >&2; exit 2; }
wisp=$1 gemma=$2 qwen=$3
out=${4:-${OUT:-/tmp/wisp-gpu}}
mkdir -p "$out"
. "$(dirname "$0")/steps.sh"
step device "$wisp" info --model "$gemma"
if [ "${WISP_PARALLEL_ONLY:-0}" = 1 ]; then
    for round in $(seq "${WISP_ROUNDS:-2}"); do
        step "parallel-wisp-$round" "$wisp" bench --model "$gemma" --gpu on --runs 1 --prompt-tokens 128 \
            --decode-tokens 128 --parallel 1,4,16,64 --matmul-size 0
        if [ -n "${LLAMA_BATCHED:-}" ]; then
            step "parallel-llama-$round" "$LLAMA_BATCHED" -m "$gemma" -ngl 99 -c 20480 -b 2048 -ub 512 \
                -npp 128 -ntg 128 -npl 1,4,16,64
        fi
    done
    exit $status
fi
for m in gemma qwen; do
    path=${!m}
    golden=tests/golden/gemma3-270m.json
    [ "$m" = qwen ] && golden=tests/golden/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b.json
    for mode in on auto off; do
        step "$m-bench-$mode" "$wisp" bench --model "$path" --gpu "$mode" --runs 3
    done
    for precision in exact fast; do
        step "$m-bench-on-512-$precision" "$wisp" bench --model "$path" --gpu on --runs 3 --prompt-tokens 512 --precision $precision
        step "$m-golden-on-$precision" "$wisp" eval --model "$path" --golden "$golden" --gpu on --precision $precision
    done
done
step conformance "$wisp" conformance --model "$gemma"
if [ "${WISP_MODELS_ONLY:-0}" = 1 ]; then
    # The model runs and the conformance kit alone (a change that leaves the kernels as they were).
    exit $status
fi
step matmul-4096 "$wisp" bench --model "$gemma" --gpu on --runs 1 --prompt-tokens 8 --decode-tokens 8 --matmul-size 4096
step matmul-16384 "$wisp" bench --model "$gemma" --gpu on --runs 1 --prompt-tokens 8 --decode-tokens 8 --matmul-size 16384
if [ -n "${WISP_TESTS:-}" ]; then
    step wgpu-tests env WISP_REQUIRE_COOP=1 WISP_REQUIRE_LARGE=1 "$WISP_TESTS" --test-threads 1
    step kernel-sweep env WISP_SWEEP_N=16384 "$WISP_TESTS" --ignored --nocapture kernel_sweep
    # GEMV over 768 MB of q4x32 (f32 and bf16 do not fit one binding there), the size of the copy below.
    step gemv-sweep-32768 env WISP_SWEEP_N=32768 WISP_SWEEP_M=256 "$WISP_TESTS" --ignored --nocapture kernel_sweep
    step round-trips "$WISP_TESTS" --ignored --nocapture round_trip_sweep
fi
step torch python3 bench/torch_ref.py
exit $status
