"""Records llama.cpp's embeddings of TEXTS (its server's `/v1/embeddings`, `--embedding
--pooling P`, L2-normalized as it does by default) for Qwen2.5-Coder-0.5B-Instruct and Gemma 3
270M, each pooling of POOLINGS, with the token ids it embedded; into
tests/embeddings/llama-cpp.json. tests/tests/embeddings.rs holds wisp's vectors to them.

    python3 tests/embeddings/record.py LLAMA_CPP_DIR [WISP_CACHE]
        # LLAMA_CPP_DIR: llama.cpp's source, built in build-cpu/ (e.g. /var/tmp/llama.cpp-0.3.36);
        # WISP_CACHE: where wisp::fetch keeps the GGUFs (~/.cache/wisp)
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent

MODELS = ["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf"]
POOLINGS = ["mean", "last", "cls"]
# Short and long (past a prompt's batch of 64 tokens), code and prose.
TEXTS = [
    "The cat sat on the mat.",
    "def add(a, b):\n    return a + b",
    "Embeddings turn text into vectors; similar texts get vectors that point the same way. " * 6,
    "Paris",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def record(bin_dir, model, pooling):
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    server = subprocess.Popen(
        [str(bin_dir / "llama-server"), "-m", str(model), "--embedding", "--pooling", pooling, "--port", str(port),
         "-c", "1024", "-b", "1024", "-ub", "1024", "-t", "2", "--no-warmup"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.2)
        out = []
        for text in TEXTS:
            tokens = post(port, "/tokenize", {"content": text, "add_special": True})["tokens"]
            vector = post(port, "/v1/embeddings", {"input": text})["data"][0]["embedding"]
            out.append({"text": text, "tokens": tokens, "embedding": [round(v, 7) for v in vector]})
        return out
    finally:
        server.terminate()
        server.wait()


def main():
    bin_dir = pathlib.Path(sys.argv[1]) / "build-cpu" / "bin"
    cache = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser("~/.cache/wisp"))
    version = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True,
                             env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)))
    recorded = {"llama_cpp": (version.stdout + version.stderr).strip().splitlines()[-2:], "models": {}}
    for name in MODELS:
        recorded["models"][name] = {p: record(bin_dir, cache / name, p) for p in POOLINGS}
        print(name, "recorded", file=sys.stderr)
    (HERE / "llama-cpp.json").write_text(json.dumps(recorded, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
