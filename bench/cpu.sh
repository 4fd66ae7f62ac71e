#!/usr/bin/env bash
# The guest's one core against llama.cpp's one thread, in one run, interleaved (issue #27; see
# BENCHMARKS.md, "Speed: guest on one core, CPU path"). From the repository root:
#
#   bench/cpu.sh [WISP] [ROUNDS]
#
# WISP is a `wisp` binary (default: the release build under $CARGO_TARGET_DIR or target/);
# ROUNDS (default 5) rounds, each running, per model, wisp in both precisions and llama-bench
# back to back: a 128-token prompt and 64 generated tokens (`wisp bench --gpu off --runs 1`,
# `llama-bench -p 128 -n 64 -r 1 -t $THREADS`). A first round of each, not counted, warms the
# page cache and the CPU. It prints each side's median prefill and decode tok/s and wisp's ratio
# to llama.cpp's.
#
# $DEVICE picks where wisp computes: `none` (the default: the guest alone, on one core, `--gpu
# off`) or `native` (the host's native CPU device on $THREADS threads: `--device native
# --threads $THREADS`, the guest's whole passes there).
#
# Models: $GEMMA and $QWEN (default: wisp's cache, as `wisp fetch gemma3-270m` and `wisp fetch
# qwen2.5-coder-0.5b` leave them; QWEN=- leaves Qwen out); $MORE, space-separated NAME=PATH
# pairs, adds others (e.g. MORE="qwen15=$HOME/.cache/wisp/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"). llama.cpp: $LLAMA_BENCH, else the CPU
# build of ../shared/tools/llama-cpp.sh (built if missing; on the GPU machine, which has no
# network, set LLAMA_CPP_TGZ to the tarball of `llama-cpp.sh pack`). $THREADS (default 1) is
# llama.cpp's thread count, and the native device's; the guest alone runs on one core. Raw outputs go to $OUT (default
# /tmp/wisp-cpu).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
wisp=${1:-$target/release/wisp}
rounds=${2:-5}
cache=${WISP_CACHE:-$HOME/.cache/wisp}
gemma=${GEMMA:-$cache/gemma-3-270m-q4_k_m.gguf}
qwen=${QWEN:-$cache/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
threads=${THREADS:-1}
device=${DEVICE:-none}
case $device in
none) where=(--gpu off) ;;
native) where=(--device native --threads "$threads" --gpu on) ;;
*) echo "DEVICE is none or native, not $device" >&2; exit 2 ;;
esac
declare -A extra=()
for pair in ${MORE:-}; do
    extra[${pair%%=*}]=${pair#*=}
done
out=${OUT:-/tmp/wisp-cpu}
mkdir -p "$out"
[ -x "$wisp" ] || { echo "no wisp binary at $wisp (cargo build --release)" >&2; exit 2; }
if [ -z "${LLAMA_BENCH:-}" ]; then
    tool=$root/../shared/tools/llama-cpp.sh
    LLAMA_BENCH=${LLAMA_CPP_DIR:-/var/tmp/llama.cpp-0.3.36}/build-cpu/bin/llama-bench
    [ -x "$LLAMA_BENCH" ] || "$tool" cpu >&2
fi
models=(gemma)
[ "$qwen" != - ] && models+=(qwen)
models+=("${!extra[@]}")
model_path() { if [ -n "${extra[$1]:-}" ]; then echo "${extra[$1]}"; else echo "${!1}"; fi; }
for m in "${models[@]}"; do
    path=$(model_path "$m")
    [ -f "$path" ] || { echo "no $m model at $path (wisp fetch)" >&2; exit 2; }
done

# One measurement: appends a JSON line {model, side, round, prefill, decode} to $out/runs.jsonl.
measure() {
    local m=$1 side=$2 round=$3 path log
    path=$(model_path "$m")
    log=$out/$m-$side-$round.json
    case $side in
    wisp-exact | wisp-fast)
        "$wisp" bench --model "$path" "${where[@]}" --runs 1 --prompt-tokens 128 --decode-tokens 64 \
            --precision "${side#wisp-}" --json >"$log"
        python3 - "$log" "$m" "$side" "$round" >>"$out/runs.jsonl" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"model": sys.argv[2], "side": sys.argv[3], "round": int(sys.argv[4]),
                  "prefill": r["prefill_tok_s"], "decode": r["decode_tok_s"]}))
EOF
        ;;
    llama)
        "$LLAMA_BENCH" -m "$path" -p 128 -n 64 -r 1 -t "$threads" -o json >"$log" 2>/dev/null
        python3 - "$log" "$m" "$side" "$round" >>"$out/runs.jsonl" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
rate = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
print(json.dumps({"model": sys.argv[2], "side": sys.argv[3], "round": int(sys.argv[4]), **rate}))
EOF
        ;;
    esac
}

: >"$out/runs.jsonl"
echo "wisp $("$wisp" --version 2>/dev/null || echo "$wisp") (${where[*]}), llama-bench $LLAMA_BENCH (-t $threads), $rounds rounds; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)" >&2
for round in $(seq 0 "$rounds"); do
    for m in "${models[@]}"; do
        for side in wisp-exact llama wisp-fast; do
            measure "$m" "$side" "$round"
        done
    done
    [ "$round" = 0 ] && echo "warm-up round done" >&2 || echo "round $round of $rounds done" >&2
done

python3 - "$out/runs.jsonl" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs = [r for r in runs if r["round"] > 0]
def median(model, side, what):
    v = [r[what] for r in runs if r["model"] == model and r["side"] == side]
    return statistics.median(v) if v else float("nan")
print(f"{'model':8} {'wisp':6} {'prefill wisp':>13} {'llama.cpp':>10} {'ratio':>6}   {'decode wisp':>12} {'llama.cpp':>10} {'ratio':>6}")
for model in sorted({r["model"] for r in runs}):
    lp, ld = median(model, "llama", "prefill"), median(model, "llama", "decode")
    for side in ("wisp-exact", "wisp-fast"):
        wp, wd = median(model, side, "prefill"), median(model, side, "decode")
        print(f"{model:8} {side[5:]:6} {wp:13.1f} {lp:10.1f} {wp / lp:6.2f}   {wd:12.1f} {ld:10.1f} {wd / ld:6.2f}")
EOF
