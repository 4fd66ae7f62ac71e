"""What a request to a baked component pays before its first token, under `wasmtime serve`,
beside `wisp serve` on the same model (whose instances are warm: its time to first token is the
prefill alone). Run by bench/bake.sh; prints one line per figure, medians of several runs.

usage: python3 bench/bake.py WASMTIME BAKED.wasm WISP MODEL.gguf
"""

import re
import socket
import statistics
import subprocess
import sys
import time

import httpx

WASMTIME, BAKED, WISP, MODEL = sys.argv[1:5]
MODEL_ID = MODEL.rsplit("/", 1)[-1].removesuffix(".gguf")
PROMPT = "Write a Python function that parses an ISO 8601 date and returns the weekday. " * 4


def start(cmd, ready):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t = time.monotonic()
    for line in p.stdout:
        m = re.search(ready, line)
        if m:
            return p, m.group(1).rstrip("/"), time.monotonic() - t
    raise RuntimeError(f"{cmd[0]} did not start")


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_ms(f, n):
    f()
    times = []
    for _ in range(n):
        t = time.monotonic()
        f()
        times.append(time.monotonic() - t)
    return statistics.median(times) * 1e3


def first_token(url):
    """Seconds from sending a streamed completion to its first text chunk."""
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    t = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                return time.monotonic() - t
    raise RuntimeError("no text")


def per_request(url):
    health = median_ms(lambda: httpx.get(url + "/health", timeout=60), 20)
    models = median_ms(lambda: httpx.get(url + "/v1/models", timeout=60), 20)
    return f"/health {health:.1f} ms, /v1/models (the model opened) {models:.1f} ms"


# As docs/deploy.md runs it: compiled ahead, the image mapped into each instance.
cwasm = BAKED.removesuffix(".wasm") + ".cwasm"
t = time.monotonic()
subprocess.run([WASMTIME, "compile", "-O", "memory-guaranteed-dense-image-size=4294967296", BAKED, "-o", cwasm], check=True)
print(f"wasmtime compile: {time.monotonic() - t:.1f} s")
plain, purl, pstart = start([WASMTIME, "serve", "--addr", f"127.0.0.1:{port()}", BAKED], r"Serving HTTP on (http://\S+)")
try:
    print(f"wasmtime serve M.http.wasm: started in {pstart:.1f} s; a new instance per request, median of 20: {per_request(purl)}")
finally:
    plain.terminate()
    plain.wait()
baked, burl, bstart = start([WASMTIME, "serve", "--allow-precompiled", "--addr", f"127.0.0.1:{port()}", cwasm], r"Serving HTTP on (http://\S+)")
served, surl, sstart = start([WISP, "serve", "--model", MODEL, "--gpu", "off", "--port", "0", "--instances", "1"], r"on (http://\S+) ")
try:
    print(f"wasmtime serve --allow-precompiled M.cwasm: started in {bstart:.1f} s; a new instance per request, median of 20: {per_request(burl)}")
    tb, ts = [], []
    for _ in range(5):  # interleaved: the machine's noise falls on both
        tb.append(first_token(burl))
        ts.append(first_token(surl))
    b, s = statistics.median(tb) * 1e3, statistics.median(ts) * 1e3
    print(f"time to first token, {len(PROMPT)}-character prompt, median of 5: baked {b:.0f} ms, wisp serve (warm) {s:.0f} ms: +{b - s:.0f} ms")
finally:
    for p in (baked, served):
        p.terminate()
        p.wait()
