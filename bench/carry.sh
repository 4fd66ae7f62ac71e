#!/usr/bin/env bash
# Packs what a run on the GPU machine needs into `.dev/` (git-ignored), in pieces that each fit
# one device call beside the working tree (the device README: 64 MiB a call in all). From the
# repository root here:
#
#   bench/carry.sh [WISP] [MODEL...]
#
# WISP (default: the release build) is stripped and compressed (~78 MB -> ~15 MB); each MODEL
# (default: Gemma 3 270M from wisp's cache) is split into pieces of at most $PIECE_MIB MiB (48),
# named `.dev/NAME.pNN`; `../shared/tools/llama-cpp.sh pack` makes `.dev/llama.tgz` (and the
# script itself is copied beside it, since `../shared` does not travel). It prints the
# calls to make, in order: the first carries `.gl`, the binary and llama.cpp's source, each next
# one a piece. A call's carried `.dev/` replaces the last one's there, so each call runs
# `bench/carry.sh --keep`, which moves what it brought to /tmp/wisp-carried; `bench/carry.sh
# --unpack` then puts the binary at /tmp/wisp and each model, once all its pieces are there, at
# /tmp/NAME (and checks its SHA-256 against the one recorded here).
set -euo pipefail
cd "$(dirname "$0")/.."
kept=/tmp/wisp-carried
if [ "${1:-}" = --keep ] || [ "${1:-}" = --unpack ]; then
    mkdir -p "$kept"
    [ -d .dev ] && cp -f .dev/* "$kept"/ 2>/dev/null || true
    [ "$1" = --keep ] && { ls "$kept"; exit 0; }
fi
if [ "${1:-}" = --unpack ]; then
    [ -f "$kept/wisp.xz" ] && python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$kept/wisp.xz'), open('/tmp/wisp', 'wb'))" &&
        chmod +x /tmp/wisp && echo "/tmp/wisp"
    for sum in "$kept"/*.sha256; do
        [ -e "$sum" ] || continue
        name=$(basename "$sum" .sha256)
        if cat "$kept/$name".p?? >"/tmp/$name" 2>/dev/null &&
            [ "$(sha256sum "/tmp/$name" | cut -d' ' -f1)" = "$(cat "$sum")" ]; then
            echo "/tmp/$name"
        else
            echo "/tmp/$name: pieces missing or damaged" >&2
            rm -f "/tmp/$name"
        fi
    done
    exit 0
fi
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo /.dev/ >>.git/info/exclude
target=${CARGO_TARGET_DIR:-target}
wisp=${1:-$target/release/wisp}
shift || true
models=("$@")
[ ${#models[@]} -gt 0 ] || models=("$HOME/.cache/wisp/gemma-3-270m-q4_k_m.gguf")
limit=$(( ${PIECE_MIB:-48} << 20 ))
mkdir -p .dev
strip -o .dev/wisp "$wisp"
xz -T0 -6 -f .dev/wisp
for m in "${models[@]}"; do
    name=$(basename "$m")
    rm -f ".dev/$name".p??
    # As few pieces as the limit allows, of equal size.
    size=$(stat -c %s "$m")
    count=$(( (size + limit - 1) / limit ))
    split -b $(( (size + count - 1) / count )) -d -a 2 "$m" ".dev/$name.p"
    sha256sum "$m" | cut -d' ' -f1 >".dev/$name.sha256"
done
[ -f .dev/llama.tgz ] || ../shared/tools/llama-cpp.sh pack "$PWD/.dev/llama.tgz" >/dev/null
cp ../shared/tools/llama-cpp.sh .dev/llama-cpp.sh
echo "calls, in order (each within the machine's idle release of the last):"
sums=$(for m in "${models[@]}"; do printf ', .dev/%s.sha256' "$(basename "$m")"; done)
echo "  carry [.gl, .dev/wisp.xz, .dev/llama.tgz, .dev/llama-cpp.sh$sums]: bench/carry.sh --unpack, and start"
echo "    llama.cpp's build in the background: setsid env LLAMA_CPP_DIR=/tmp/llama.cpp LLAMA_CPP_TGZ=/tmp/wisp-carried/llama.tgz"
echo "    bash /tmp/wisp-carried/llama-cpp.sh cpu > /tmp/llama.log 2>&1 < /dev/null & (CPU; its header says how to build with CUDA)"
for m in "${models[@]}"; do
    for p in ".dev/$(basename "$m")".p??; do
        echo "  carry [$p]: bench/carry.sh --keep"
    done
done
echo "  then, with the last piece: bench/carry.sh --unpack && bench/gpu.sh /tmp/wisp /tmp/MODEL ..."
