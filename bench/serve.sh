#!/usr/bin/env bash
# `wisp serve` beside llama.cpp's `llama-server` on this machine, same model, same client, rounds
# interleaved (bench/serve_load.py): aggregate decode tok/s and time to first token for N
# concurrent streams. Both servers get every core of the machine.
#
#   bench/serve.sh [CLIENTS=8] [TOKENS=64] [ROUNDS=3] [PROMPT_TOKENS=128]
#
# Each stream's prompt is PROMPT_TOKENS tokens, new each round (0: eight short prompts, the same
# every round, which both servers then find cached from the round before).
#
# $DEVICE picks where wisp computes: `none` (the default: the guest's own kernels, `--gpu off`, an
# instance a core) or `native` (the host's native CPU device on every core: `--device native
# --threads $(nproc)`, one instance, every stream in its batched step).
#
# Needs a release build (`cargo build --release`), llama.cpp's CPU build
# (`../shared/tools/llama-cpp.sh cpu`, or LLAMA_SERVER=path) and python3 with httpx (pip).
set -euo pipefail
cd "$(dirname "$0")/.."
clients=${1:-8} tokens=${2:-64} rounds=${3:-3} prompt_tokens=${4:-128}
target=${CARGO_TARGET_DIR:-target}
wisp=${WISP:-$target/release/wisp}
llama=${LLAMA_SERVER:-/var/tmp/llama.cpp-0.3.36/build-cpu/bin/llama-server}
model=$("$wisp" fetch)
cores=$(nproc)
ctx=512
case ${DEVICE:-none} in
none) where=(--gpu off) ;;
native) where=(--device native --threads "$cores" --gpu on) ;;
*) echo "DEVICE is none or native, not $DEVICE" >&2; exit 2 ;;
esac
# WISP_SERVE_ARGS: more options of `wisp serve` (e.g. `--precision fast`).
"$wisp" serve --model "$model" --port 18080 "${where[@]}" --parallel "$clients" --ctx "$ctx" ${WISP_SERVE_ARGS:-} 2>/tmp/wisp-serve.log &
wisp_pid=$!
"$llama" -m "$model" --port 18081 -t "$cores" --parallel "$clients" -c $((ctx * clients)) --no-webui \
    >/tmp/llama-server.log 2>&1 &
llama_pid=$!
trap 'kill $wisp_pid $llama_pid 2>/dev/null; wait 2>/dev/null' EXIT
for port in 18080 18081; do
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%FT%TZ); wisp $(git rev-parse --short HEAD)"
head -n 1 /tmp/wisp-serve.log
python3 bench/serve_load.py --server wisp=http://127.0.0.1:18080 --server llama.cpp=http://127.0.0.1:18081 \
    --clients "$clients" --tokens "$tokens" --rounds "$rounds" --prompt-tokens "$prompt_tokens"
