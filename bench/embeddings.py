"""`wisp serve`'s /v1/embeddings beside llama.cpp's `llama-server --embedding`, same model, same
client, rounds interleaved: texts/s and tokens/s of one request of many short texts and one of a
few long ones, and each side's vectors against the other's (cosine).

    python3 bench/embeddings.py [ROUNDS=5]

$WISP (default: the release build under $CARGO_TARGET_DIR or target/), $LLAMA_SERVER (default:
the CPU build of ../shared/tools/llama-cpp.sh), $MODEL (default: Qwen2.5-Coder-0.5B-Instruct in
wisp's cache), $POOLING (mean). $DEVICE: `none` (the default: the guest's own kernels on one core,
`--gpu off --instances 1`, against llama.cpp on one thread) or `native` (`--device native
--threads $THREADS`, against llama.cpp on $THREADS threads; default: every core).
"""

import math
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
WISP = os.environ.get("WISP", os.path.join(TARGET, "release", "wisp"))
LLAMA = os.environ.get("LLAMA_SERVER", "/var/tmp/llama.cpp-0.3.36/build-cpu/bin/llama-server")
MODEL = os.environ.get("MODEL", os.path.expanduser("~/.cache/wisp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
POOLING = os.environ.get("POOLING", "mean")
DEVICE = os.environ.get("DEVICE", "none")
THREADS = int(os.environ.get("THREADS", os.cpu_count()))

WORDS = ("the a model runs every host one guest binary many devices weights vectors text tokens "
         "server browser library cat mat rug stock market rain london python list sort function").split()


def texts(n, words, seed):
    """`n` texts of `words` words, different each round (no cache to hit)."""
    out = []
    for i in range(n):
        k = seed * 7919 + i * 104729
        out.append(" ".join(WORDS[(k + j * j * 31 + j) % len(WORDS)] for j in range(words)) + f" ({seed}.{i})")
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(port, proc, log):
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"a server ended: {open(log).read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("a server did not start")


def embed(port, model, batch):
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": model, "input": batch}, timeout=900)
    r.raise_for_status()
    body = r.json()
    return time.perf_counter() - start, body["usage"]["prompt_tokens"], [d["embedding"] for d in body["data"]]


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    threads = 1 if DEVICE == "none" else THREADS
    where = ["--gpu", "off"] if DEVICE == "none" else ["--device", "native", "--threads", str(threads), "--gpu", "on"]
    wp, lp = free_port(), free_port()
    wisp = subprocess.Popen([WISP, "serve", "--model", MODEL, "--port", str(wp), "--instances", "1", "--parallel", "1", "--pooling", POOLING, *where],
                            stdout=subprocess.DEVNULL, stderr=open("/tmp/wisp-embed.log", "w"))
    llama = subprocess.Popen([LLAMA, "-m", MODEL, "--port", str(lp), "--embedding", "--pooling", POOLING, "-t", str(threads), "-c", "8192", "-b", "8192", "-ub", "8192", "--no-webui"],
                             stdout=subprocess.DEVNULL, stderr=open("/tmp/llama-embed.log", "w"), env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(LLAMA)))
    try:
        wait(wp, wisp, "/tmp/wisp-embed.log")
        wait(lp, llama, "/tmp/llama-embed.log")
        model = os.path.basename(MODEL).removesuffix(".gguf")
        shapes = {"64 short texts (~12 words)": (64, 12), "4 long texts (~300 words)": (4, 300)}
        results = {(s, side): [] for s in shapes for side in ("wisp", "llama.cpp")}
        agree = []
        for r in range(rounds + 1):
            for shape, (n, words) in shapes.items():
                batch = texts(n, words, r)
                got = {}
                for side, port in (("wisp", wp), ("llama.cpp", lp)):
                    secs, tokens, vectors = embed(port, model, batch)
                    got[side] = vectors
                    if r > 0:  # the first round warms the page cache
                        results[(shape, side)].append((n / secs, tokens / secs))
                agree.extend(cosine(a, b) for a, b in zip(got["wisp"], got["llama.cpp"]))
        print(f"{model}, {POOLING} pooling, DEVICE={DEVICE} ({threads} thread(s) each), {rounds} rounds, medians:")
        for shape in shapes:
            w = [statistics.median(x) for x in zip(*results[(shape, "wisp")])]
            l = [statistics.median(x) for x in zip(*results[(shape, "llama.cpp")])]
            print(f"  {shape}: wisp {w[0]:.1f} texts/s {w[1]:.0f} tok/s, llama.cpp {l[0]:.1f} texts/s {l[1]:.0f} tok/s, ratio {w[1] / l[1]:.2f}")
        print(f"  cosine wisp/llama.cpp over {len(agree)} vectors: min {min(agree):.5f}, median {statistics.median(agree):.5f}")
    finally:
        for p in (wisp, llama):
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
