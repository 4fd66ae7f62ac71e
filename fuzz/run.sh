#!/usr/bin/env bash
# Runs every fuzz target (or those named) for SECONDS each, one target a core, and prints a
# line per target: executions, executions a second, coverage, and whether it crashed.
#
#   fuzz/run.sh [SECONDS] [TARGET...]      (default 60 s, every target)
#   RUNS=1000000 fuzz/run.sh 3600 vocab    (stop after RUNS executions, or SECONDS)
#
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). The host's build
# script embeds the guests; cargo fuzz's nightly has no wasm32-wasip2 target, so the guests are
# built first with the default toolchain and embedded from there (WISP_GUEST_TARGET_DIR).
# Targets that need the default model (`tokenizer`) read WISP_FUZZ_MODEL, else the CLI's cache.
# Corpora grow in fuzz/corpus/TARGET; crashes land in fuzz/artifacts/TARGET; logs in
# $FUZZ_LOGS (default /tmp/wisp-fuzz). JOBS (default: the cores) targets run at once.
#
# FUZZ_SANITIZER (default none): the code under test is safe Rust, so by default the targets
# are built without AddressSanitizer, which costs them half their speed; `address` builds
# them with it (into the target directory's name + `-address`).
#
# The constraint target is built without libFuzzer's comparison hints (trace-compares), into
# the target directory's name + `-plain`: its time goes to llguidance's lexers, built anew by
# derivatives for every grammar, whose hash-table probes the hints instrument (60% of a run
# with them: ~500 inputs a second, ~1,200 without); its dictionary carries the keywords of
# schemas, regexes and Lark that the hints would find.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:-60}
shift || true
all=(gguf request program tokenizer vocab chat_template constraint)
targets=("${@:-${all[@]}}")
sanitizer=${FUZZ_SANITIZER:-none}
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
[[ $sanitizer == none ]] || target_dir+=-$sanitizer
logs=${FUZZ_LOGS:-/tmp/wisp-fuzz}
mkdir -p "$logs"

# A workspace build's guests serve as they are: WISP_GUEST_TARGET_DIR=<its target dir>/guest.
if [[ -z ${WISP_GUEST_TARGET_DIR:-} ]]; then
    (cd .. && cargo build --release --locked --target wasm32-wasip2 --target-dir "$target_dir/guest" \
        -p wisp-guest -p wisp-conformance -p wisp-runaway -p wisp-http -p wisp-virt)
    export WISP_GUEST_TARGET_DIR="$target_dir/guest"
fi

plain=(constraint)
is_plain() { [[ " ${plain[*]} " == *" $1 "* ]]; }

# How target $1 is built: cargo fuzz's flags, and its target directory in CARGO_TARGET_DIR.
flags() {
    if is_plain "$1"; then
        echo "--sanitizer $sanitizer --no-trace-compares"
    else
        echo "--sanitizer $sanitizer"
    fi
}
dir() { if is_plain "$1"; then echo "$target_dir-plain"; else echo "$target_dir"; fi; }

hinted=() unhinted=()
for t in "${targets[@]}"; do
    if is_plain "$t"; then unhinted+=("$t"); else hinted+=("$t"); fi
done
# cargo fuzz builds one target or all: one target alone, else all of them.
build() {
    (( $# )) || return 0
    if (( $# == 1 )); then
        CARGO_TARGET_DIR=$(dir "$1") cargo +nightly fuzz build $(flags "$1") "$1"
    else
        CARGO_TARGET_DIR=$(dir "$1") cargo +nightly fuzz build $(flags "$1")
    fi
}
build "${hinted[@]}"
build "${unhinted[@]}"

run() {
    local t=$1 dict=()
    [[ -f dict/$t.dict ]] && dict=("-dict=dict/$t.dict")
    mkdir -p "corpus/$t"
    # -rss_limit_mb: an input may not make the process grow past 2 GiB; -timeout: nor run 10 s.
    CARGO_TARGET_DIR=$(dir "$t") cargo +nightly fuzz run $(flags "$t") "$t" "corpus/$t" -- "${dict[@]}" \
        -max_total_time="$seconds" ${RUNS:+-runs=$RUNS} -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"$logs/$t.log" 2>&1 && rc=0 || rc=$?
    local runs speed cov
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$logs/$t.log" | grep -o '[0-9]*$' || echo '?')
    speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$logs/$t.log" | grep -o '[0-9]*$' || echo '?')
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$logs/$t.log" | tail -1 || true)
    printf '%-14s %12s runs %8s/s  %-22s %s\n' "$t" "$runs" "$speed" "$cov" \
        "$([[ $rc == 0 ]] && echo 'no crash' || echo "CRASH (rc $rc): $logs/$t.log")"
}

cores=${JOBS:-$(nproc)}
pids=()
for t in "${targets[@]}"; do
    run "$t" &
    pids+=($!)
    if (( ${#pids[@]} >= cores )); then
        wait "${pids[0]}"
        pids=("${pids[@]:1}")
    fi
done
wait
