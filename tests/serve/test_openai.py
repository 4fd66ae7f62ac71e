"""`wisp serve` through the `openai` Python package, unmodified (issue 24's first must-show)."""

import os
import subprocess

import httpx
import pytest
from openai import OpenAI

from conftest import BIN, MODEL


def client(server, **kw):
    return OpenAI(base_url=server.v1, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_the_model_list_names_the_served_model(server):
    models = client(server).models.list().data
    assert [m.id for m in models] == [server.model]
    assert client(server).models.retrieve(server.model).id == server.model


def test_a_chat_completion_streamed_equals_the_same_not_streamed(server):
    c = client(server)
    whole = c.chat.completions.create(model=server.model, messages=CHAT, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert text.strip(), whole
    u = whole.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(
        c.chat.completions.create(
            model=server.model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == u.total_tokens
    assert len({ch.id for ch in chunks}) == 1


def test_a_text_completion_equals_wisp_run_and_its_stream(server):
    prompt = "The capital of France is"
    c = client(server)
    r = c.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    # The CLI's greedy continuation of the same prompt (it prints the prompt first).
    out = subprocess.run(
        [BIN, "run", "--model", MODEL, "--gpu", "off", "-n", "12", "--temp", "0", prompt],
        capture_output=True, text=True, check=True,
    ).stdout
    assert out.rstrip("\n") == prompt + text
    streamed = "".join(
        ch.choices[0].text for ch in c.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    )
    assert streamed == text


def test_token_ids_as_a_prompt_give_the_same_text(server):
    c = client(server)
    ids = httpx.post(server.url + "/tokenize", json={"content": "Once upon a time", "add_special": True}).json()["tokens"]
    a = c.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0).choices[0].text
    b = c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8, temperature=0).choices[0].text
    assert a == b and a


def test_a_stop_sequence_ends_the_text_before_it(server):
    c = client(server)
    prompt = "List the days of the week: Monday,"
    full = c.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    # A stop sequence taken from the middle of the greedy text itself.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    r = c.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True)
    )
    assert s == r.choices[0].text


def test_sampling_with_a_seed_repeats_and_other_seeds_differ(server):
    c = client(server)

    def run(seed):
        r = c.completions.create(
            model=server.model, prompt="My favourite animal is", max_tokens=16, temperature=1.0, top_p=1.0, seed=seed
        )
        return r.choices[0].text

    assert run(7) == run(7)
    assert len({run(s) for s in range(1, 5)}) > 1


def test_usage_counts_and_the_length_finish(server):
    r = client(server).completions.create(model=server.model, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3
    ids = httpx.post(server.url + "/tokenize", json={"content": "Hello", "add_special": True}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)


def test_tokenize_and_detokenize_as_llama_cpp_has_them(server):
    r = httpx.post(server.url + "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    pieces = r["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    ids = [p["id"] for p in pieces]
    assert httpx.post(server.url + "/tokenize", json={"content": "Hello world"}).json()["tokens"] == ids
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"


def test_health_openapi_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]
    client(server).completions.create(model=server.model, prompt="Hi", max_tokens=2, temperature=0)
    m = httpx.get(server.url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in [
        'wisp_requests_total{endpoint="/v1/completions",status="200"}',
        "wisp_prompt_tokens_total", "wisp_cached_prompt_tokens_total", "wisp_generated_tokens_total", "wisp_queue_depth",
        "wisp_requests_in_flight",
        "wisp_batch_size_bucket", "wisp_time_to_first_token_seconds_bucket", "wisp_time_per_output_token_seconds_bucket",
    ]:
        assert name in text, name
    generated = [l for l in text.splitlines() if l.startswith("wisp_generated_tokens_total")]
    assert int(float(generated[0].split()[-1])) >= 2


def cached(usage):
    return usage.prompt_tokens_details.cached_tokens


def test_a_chats_next_turn_continues_from_the_first_and_says_so(start):
    """The prompt cache: a finished request's session is kept, and a later request whose prompt
    begins the same way continues from it (its usage says how many prompt tokens were reused);
    the text is the text without the cache, greedy and seeded alike."""
    cache, plain = start("--instances", "1"), start("--instances", "1", "--no-prompt-cache")
    first = [{"role": "user", "content": "Name three rivers of Europe."}]

    def chat(s, messages, **kw):
        return client(s).chat.completions.create(model=s.model, messages=messages, max_tokens=16, **kw)

    r1 = chat(cache, first, temperature=0)
    assert cached(r1.usage) == 0
    turn = first + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Which is longest?"}]
    r2 = chat(cache, turn, temperature=0)
    # The first turn's whole prompt at least came from its session.
    assert r1.usage.prompt_tokens <= cached(r2.usage) < r2.usage.prompt_tokens, (r1.usage, r2.usage)
    p2 = chat(plain, turn, temperature=0)
    assert cached(p2.usage) == 0 and p2.choices[0].message.content == r2.choices[0].message.content
    # The same prompt again, sampled with a seed: all of it held, the draws a new session's.
    seeded = [chat(s, turn, temperature=0.9, seed=11).choices[0].message.content for s in (cache, cache, plain)]
    assert seeded[0] == seeded[1] == seeded[2], seeded
    metrics = httpx.get(cache.url + "/metrics").text
    reused = [l for l in metrics.splitlines() if l.startswith("wisp_cached_prompt_tokens_total")]
    assert int(float(reused[0].split()[-1])) >= cached(r2.usage), reused
