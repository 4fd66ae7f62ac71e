#!/usr/bin/env python3
"""Concurrent streaming clients against OpenAI-compatible servers, rounds interleaved.

    bench/serve_load.py --server wisp=http://127.0.0.1:8080 --server llama=http://127.0.0.1:8081 \
        --clients 8 --tokens 64 --rounds 3

Each round sends `--clients` streaming `/v1/completions` requests at once (different prompts,
greedy) to one server, then the next server, and so on (so that the machine's noise falls on
both). Per round it prints the aggregate decode rate (completion tokens of all streams over the
wall time from the first request to the last byte) and the time to first token (p50, p95), then
the medians over rounds as one JSON line per server.

With `--prompt-tokens N` each prompt is N tokens (the first server's /tokenize and /detokenize,
llama.cpp's routes, which both servers have), and begins with the round's and client's number,
so that no round re-uses another's keys and values (both servers keep a finished request's
prompt for the next); without, the eight short prompts below, the same every round.
"""

import argparse
import json
import statistics
import threading
import time

import httpx

PROMPTS = [
    "The history of the printing press", "A recipe for bread:", "def fibonacci(n):",
    "The three laws of motion are", "Once upon a time, in a small village,",
    "The best way to learn a language is", "Rivers of Europe, from longest:", "Dear hiring manager,",
]


FILLER = (
    " It began as a small idea and grew, one careful step after another, into something that many"
    " people use every day without a second thought. The early years were slow: tools were scarce,"
    " money was short, and every mistake cost weeks. Yet each setback taught a lesson that later"
    " saved months. By the time the work was known outside its first circle, its makers had learned"
    " to measure before they built, to write down what they found, and to keep what worked while"
    " they replaced what did not. What follows tells that story in order, from the first sketches"
    " to the present day, with the names, places and numbers that mattered along the way."
)


def prompts(url, clients, n, round_no):
    """`clients` prompts of `n` tokens each, numbered by round and client."""
    out = []
    for i in range(clients):
        text = f"Note {round_no}.{i}. {PROMPTS[i % len(PROMPTS)]}" + FILLER * 4
        ids = httpx.post(url + "/tokenize", json={"content": text}, timeout=30).json()["tokens"][:n]
        out.append(httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["content"])
    return out


def model_id(url):
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def one(url, model, prompt, tokens, out, i):
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            if d.get("choices") and d["choices"][0].get("text"):
                chunks += 1
                first = first or time.perf_counter()
    n = usage["completion_tokens"] if usage else chunks
    out[i] = (first - t0 if first else float("nan"), n, time.perf_counter())


def round_(url, model, texts, tokens):
    clients = len(texts)
    out = [None] * clients
    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(url, model, texts[i], tokens, out, i)) for i in range(clients)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    end = max(o[2] for o in out)
    ttft = sorted(o[0] for o in out)
    total = sum(o[1] for o in out)
    p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
    return {"tok_s": total / (end - t0), "tokens": total, "ttft_p50": statistics.median(ttft), "ttft_p95": p95}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", action="append", required=True, help="NAME=URL, repeated")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="each prompt's tokens (0: the short prompts)")
    a = ap.parse_args()
    servers = [s.split("=", 1) for s in a.server]
    models = {name: model_id(url) for name, url in servers}

    def texts(round_no):
        if a.prompt_tokens <= 0:
            return [PROMPTS[i % len(PROMPTS)] for i in range(a.clients)]
        return prompts(servers[0][1], a.clients, a.prompt_tokens, round_no)

    for name, url in servers:  # warm-up: pipelines, caches, first allocations
        round_(url, models[name], texts(0), 8)
    runs = {name: [] for name, _ in servers}
    for r in range(a.rounds):
        round_texts = texts(r + 1)
        for name, url in servers:
            x = round_(url, models[name], round_texts, a.tokens)
            runs[name].append(x)
            print(f"round {r + 1} {name:>8}: {x['tok_s']:7.1f} tok/s aggregate ({x['tokens']} tokens), "
                  f"TTFT p50 {x['ttft_p50']:.2f} s p95 {x['ttft_p95']:.2f} s", flush=True)
    for name, xs in runs.items():
        med = {k: statistics.median(x[k] for x in xs) for k in ("tok_s", "ttft_p50", "ttft_p95")}
        print(json.dumps({"server": name, "clients": a.clients, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
                          "rounds": a.rounds, **med}))


if __name__ == "__main__":
    main()
