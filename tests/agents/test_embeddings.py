"""Embeddings (`POST /v1/embeddings`) through the unmodified `openai` client: the library's
vectors to the bit (WISP_LIBRARY_EMBEDDINGS, computed by cli/tests/agents.rs), floats and
base64, texts and token ids, every pooling, related sentences closer than unrelated ones, the
usage counts, requests beside a generation, and bad requests as OpenAI-shaped errors."""

import base64
import json
import math
import os
import struct
import threading

import httpx
import pytest
from openai import OpenAI


def client(server):
    return OpenAI(base_url=server.v1, api_key="none", timeout=600)


def library():
    path = os.environ.get("WISP_LIBRARY_EMBEDDINGS")
    if not path:
        if os.environ.get("CI") in ("true", "1"):
            pytest.fail("WISP_LIBRARY_EMBEDDINGS is not set (cli/tests/agents.rs sets it), and CI=true requires it")
        pytest.skip("no WISP_LIBRARY_EMBEDDINGS: run through cargo test --test agents")
    with open(path) as f:
        return json.load(f)


def f32(values):
    """Values as the f32 they spell (JSON carries each as its shortest decimal)."""
    return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_vectors_are_the_librarys_in_floats_and_base64(server):
    lib = library()
    c = client(server)
    floats = c.embeddings.create(model=server.model, input=lib["texts"], encoding_format="float")
    assert floats.object == "list" and floats.model == server.model
    assert [d.index for d in floats.data] == list(range(len(lib["texts"])))
    for d, want in zip(floats.data, lib["mean"]):
        assert f32(d.embedding) == f32(want)
        assert abs(math.sqrt(sum(v * v for v in d.embedding)) - 1) < 1e-5
    tokens = sum(len(t) for t in lib["tokens"])
    assert floats.usage.prompt_tokens == tokens and floats.usage.total_tokens == tokens
    # The client's default asks for base64 and decodes it: the same vectors.
    default = c.embeddings.create(model=server.model, input=lib["texts"])
    assert [f32(d.embedding) for d in default.data] == [f32(d.embedding) for d in floats.data]
    raw = httpx.post(server.v1 + "/embeddings", json={"model": server.model, "input": lib["texts"][0], "encoding_format": "base64"}, timeout=600).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == f32(lib["mean"][0])
    # Token ids as they are, one list and several.
    one = c.embeddings.create(model=server.model, input=lib["tokens"][3], encoding_format="float")
    assert f32(one.data[0].embedding) == f32(lib["mean"][3])
    many = c.embeddings.create(model=server.model, input=lib["tokens"][:2], encoding_format="float")
    assert [f32(d.embedding) for d in many.data] == [f32(v) for v in lib["mean"][:2]]


@pytest.mark.parametrize("pooling", ["last", "cls"])
def test_other_poolings_are_the_librarys(start, pooling):
    lib = library()
    s = start("--pooling", pooling)
    r = client(s).embeddings.create(model=s.model, input=lib["texts"], encoding_format="float")
    assert [f32(d.embedding) for d in r.data] == [f32(v) for v in lib[pooling]]


def test_related_sentences_are_closer_than_unrelated_ones(server):
    triples = [
        ("The cat sat on the mat.", "A kitten was resting on the rug.", "The stock market fell sharply today."),
        ("How do I sort a list in Python?", "Sorting a Python list: use sorted() or list.sort().", "The recipe needs two cups of flour."),
        ("It is raining heavily in London.", "London has a storm with a lot of rain today.", "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"),
        ("I love eating fresh strawberries in summer.", "Summer is the season for sweet, ripe berries.", "The compiler reported a type error on line 12."),
    ]
    c = client(server)
    for a, b, other in triples:
        v = [d.embedding for d in c.embeddings.create(model=server.model, input=[a, b, other]).data]
        related, unrelated = cosine(v[0], v[1]), max(cosine(v[0], v[2]), cosine(v[1], v[2]))
        assert related > unrelated, (a, b, other, related, unrelated)


def test_embeddings_run_beside_generations(server):
    lib = library()
    c = client(server)
    results, errors = {}, []

    def embed(i):
        try:
            results[i] = [f32(d.embedding) for d in c.embeddings.create(model=server.model, input=lib["texts"], encoding_format="float").data]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def chat():
        try:
            results["chat"] = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=24, temperature=0)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=chat)] + [threading.Thread(target=embed, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(results[i] == [f32(v) for v in lib["mean"]] for i in range(3))
    assert results["chat"].choices[0].message.content


def test_bad_requests_are_openai_errors(server):
    def post(body):
        r = httpx.post(server.v1 + "/embeddings", json=body, timeout=600)
        return r.status_code, r.json()["error"]

    m = server.model
    for body, param in [
        ({"model": m, "input": []}, "input"),
        ({"model": m, "input": ""}, "input"),
        ({"model": m, "input": ["a", ""]}, "input"),
        ({"model": m, "input": [[1], []]}, "input"),
        ({"model": m, "input": {"text": "a"}}, "input"),
        ({"model": m, "input": ["a"] * 2049}, "input"),
        ({"model": m, "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"model": m, "input": "a", "dimensions": 3}, "dimensions"),
        ({"model": m, "input": [10**9]}, "input"),
    ]:
        status, e = post(body)
        assert status == 400 and e["type"] == "invalid_request_error" and e["param"] == param, (body, status, e)
    status, e = post({"model": m, "input": "word " * 5000})
    assert status == 400 and e["code"] == "context_length_exceeded" and e["param"] == "input", e
    status, e = post({"model": "another-model", "input": "a"})
    assert status == 404, e
    # The server goes on.
    assert len(client(server).embeddings.create(model=m, input="still here").data[0].embedding) > 0
