"""What a server left running must survive: ../shared/RELIABILITY.md items 30-35, one test or
more each, against the real `wisp serve`."""

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from openai import OpenAI

from conftest import wait_until


def post(server, path, body=None, raw=None, headers=None, timeout=120):
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers=headers or {"content-type": "application/json"}, timeout=timeout)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def assert_error(r, status, kind=None, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    e = r.json()["error"]
    assert isinstance(e["message"], str) and e["message"], e
    if kind:
        assert e["type"] == kind, e
    if param:
        assert param in (e.get("param") or "") or param in e["message"], e
    return e


def user(text="Hi"):
    return [{"role": "user", "content": text}]


# RELIABILITY 30: malformed JSON, missing or mistyped fields, values out of range, a prompt
# past the context, an unknown model or path.
def test_bad_requests_are_400_with_an_openai_error(server):
    m = server.model
    cases = [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (json.dumps({"messages": user()}).encode(), "model"),
        (json.dumps({"model": m}).encode(), "messages"),
        (json.dumps({"model": m, "messages": "hi"}).encode(), "messages"),
        (json.dumps({"model": m, "messages": []}).encode(), "messages"),
        (json.dumps({"model": m, "messages": [{"role": "user", "content": 5}]}).encode(), "messages"),
        (json.dumps({"model": m, "messages": [{"content": "x"}]}).encode(), "role"),
        (json.dumps({"model": m, "messages": user(), "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": m, "messages": user(), "max_tokens": -5}).encode(), "max_tokens"),
        (json.dumps({"model": m, "messages": user(), "max_tokens": "ten"}).encode(), "max_tokens"),
        (json.dumps({"model": m, "messages": user(), "temperature": 9}).encode(), "temperature"),
        (json.dumps({"model": m, "messages": user(), "top_p": 1.5}).encode(), "top_p"),
        (json.dumps({"model": m, "messages": user(), "min_p": -0.1}).encode(), "min_p"),
        (json.dumps({"model": m, "messages": user(), "n": 9}).encode(), "n"),
        (json.dumps({"model": m, "messages": user(), "stream": "yes"}).encode(), "stream"),
        (json.dumps({"model": m, "messages": user(), "frequency_penalty": 0.5}).encode(), "frequency_penalty"),
        (json.dumps({"model": m, "messages": user(), "logprobs": "yes"}).encode(), "logprobs"),
        (json.dumps({"model": m, "messages": user(), "logprobs": True, "top_logprobs": 21}).encode(), "top_logprobs"),
        (json.dumps({"model": m, "messages": user(), "tools": [{"type": "function", "function": {"name": "a b"}}]}).encode(), "tools[0].function.name"),
        (json.dumps({"model": m, "messages": user(), "stop": ["a", "b", "c", "d", "e"]}).encode(), "stop"),
        (json.dumps({"model": m, "messages": user(), "seed": 1e30}).encode(), "seed"),
        # Known fields that would change the answer, refused rather than ignored.
        (json.dumps({"model": m, "messages": user(), "logit_bias": {"1": 100}}).encode(), "logit_bias"),
        (json.dumps({"model": m, "messages": user(), "functions": [{"name": "f"}]}).encode(), "functions"),
    ]
    for raw, param in cases:
        assert_error(post(server, "/v1/chat/completions", raw=raw), 400, "invalid_request_error", param)
    for raw, param in [
        (json.dumps({"model": m}).encode(), "prompt"),
        (json.dumps({"model": m, "prompt": ["a", "b"]}).encode(), "prompt"),
        (json.dumps({"model": m, "prompt": [4294967295]}).encode(), None),
        (json.dumps({"model": m, "prompt": [-1]}).encode(), "prompt"),
        (json.dumps({"model": m, "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": m, "prompt": "x", "logit_bias": {"1": -100}}).encode(), "logit_bias"),
    ]:
        assert_error(post(server, "/v1/completions", raw=raw), 400, "invalid_request_error", param)
    # Not JSON's content type: the body is still what counts.
    assert_error(post(server, "/tokenize", raw=b"content=x", headers={"content-type": "text/plain"}), 400)
    assert_error(post(server, "/detokenize", {"tokens": "abc"}), 400, param="tokens")
    assert_error(post(server, "/detokenize", {"tokens": [4294967295]}), 400)


def test_a_prompt_past_the_context_is_400_and_the_server_goes_on(start):
    s = start("--ctx", "64")
    long = "word " * 200
    e = assert_error(post(s, "/v1/completions", {"model": s.model, "prompt": long}), 400, "invalid_request_error")
    assert e["code"] == "context_length_exceeded"
    e = assert_error(post(s, "/v1/chat/completions", {"model": s.model, "messages": user(long)}), 400)
    assert e["code"] == "context_length_exceeded"
    # A reply that reaches the end of the context stops there with "length".
    r = post(s, "/v1/completions", {"model": s.model, "prompt": "word " * 40, "max_tokens": 1000, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] in ("length", "stop")
    assert r["usage"]["total_tokens"] <= 64


def test_unknown_models_paths_and_methods(server):
    e = assert_error(post(server, "/v1/chat/completions", {"model": "gpt-17", "messages": user()}), 404, "not_found_error")
    assert e["code"] == "model_not_found" and e["param"] == "model"
    assert_error(post(server, "/v1/completions", {"model": "gpt-17", "prompt": "x"}), 404)
    assert_error(httpx.get(server.url + "/v1/models/gpt-17"), 404)
    assert_error(httpx.get(server.url + "/v2/everything"), 404)
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    assert_error(httpx.delete(server.url + "/v1/models"), 405)


# RELIABILITY 31: a body past the cap, a slow client, an idle connection.
def test_a_body_past_the_cap_is_413_before_it_is_read(start):
    s = start("--max-body", "1")
    # Declared too large: answered at once, without sending the body.
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 17000000\r\n\r\n")
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head
    assert '"error"' in head
    # Chunked, no length: cut at the cap.
    def chunks():
        for _ in range(40):
            yield b"x" * 65536
    r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 413)
    # Under the cap, a real request still works.
    r = post(s, "/v1/completions", {"model": s.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_slow_and_idle_clients_are_closed_and_others_go_on(start):
    s = start("--read-timeout", "2")
    # Idle: connected, nothing sent.
    idle = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    # Slow: headers promise a body that trickles in a byte a second.
    slow = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    # Slow headers.
    slow_head = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    slow_head.sendall(b"GET /health HTTP/1.1\r\n")
    stop = threading.Event()

    def trickle():
        for _ in range(30):
            if stop.is_set():
                return
            try:
                slow.sendall(b" ")
                slow_head.sendall(b"X")
            except OSError:
                return
            time.sleep(1)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    # Meanwhile others are served at once.
    t0 = time.time()
    for _ in range(5):
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    r = post(s, "/v1/completions", {"model": s.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and time.time() - t0 < 20

    def closed(sock):
        try:
            sock.settimeout(15)
            data = b""
            while True:
                d = sock.recv(65536)
                if not d:
                    return True, data
                data += d
        except OSError as e:
            return True, repr(e).encode()

    t0 = time.time()
    ok, _ = closed(idle)
    assert ok and time.time() - t0 < 15
    ok, data = closed(slow)
    assert ok and time.time() - t0 < 20
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
    ok, _ = closed(slow_head)
    assert ok and time.time() - t0 < 20
    stop.set()


# RELIABILITY 32: floods get 429 with Retry-After; memory stays bounded and comes back.
def test_a_flood_past_the_queue_gets_429_and_memory_comes_back(start):
    s = start("--parallel", "1", "--queue", "2", "--instances", "1")
    body = {"model": s.model, "prompt": "Count: one, two,", "max_tokens": 12, "temperature": 0}

    def flood(n):
        results = [None] * n

        def go(i):
            results[i] = httpx.post(s.url + "/v1/completions", json=body, timeout=300)

        ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        return results

    flood(4)  # warm up: the sessions' memory reaches its working size
    before = s.rss_kib()
    for _ in range(3):
        rs = flood(12)
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) >= 1 and codes.count(200) >= 3, codes
        texts = {r.json()["choices"][0]["text"] for r in rs if r.status_code == 200}
        assert len(texts) == 1, texts
        for r in rs:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert_error(r, 429, "rate_limit_error")
    after = s.rss_kib()
    assert after <= before * 1.10, (before, after)


# RELIABILITY 33: a client that disconnects mid-stream frees its session at once; the rest goes on.
def test_a_client_leaving_mid_stream_frees_its_session(start):
    s = start("--parallel", "2", "--instances", "1")
    c = OpenAI(base_url=s.v1, api_key="x", max_retries=0)

    def gauge(name):
        for line in httpx.get(s.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
        return 0.0

    other = {}

    def finish_other():
        other["text"] = c.completions.create(model=s.model, prompt="Once upon a time", max_tokens=40, temperature=0).choices[0].text

    # The stream that leaves.
    leaving = c.completions.create(model=s.model, prompt="The alphabet:", max_tokens=2000, temperature=0, stream=True)
    it = iter(leaving)
    next(it)
    next(it)
    t = threading.Thread(target=finish_other)
    t.start()
    assert wait_until(lambda: gauge("wisp_requests_in_flight") == 2, 30)
    leaving.response.close()
    assert wait_until(lambda: gauge("wisp_cancelled_total") >= 1, 10), httpx.get(s.url + "/metrics").text
    assert wait_until(lambda: gauge("wisp_requests_in_flight") <= 1, 10)
    t.join(120)
    assert other["text"]
    # The same request alone gives the same text.
    alone = c.completions.create(model=s.model, prompt="Once upon a time", max_tokens=40, temperature=0).choices[0].text
    assert other["text"] == alone
    assert gauge("wisp_requests_in_flight") == 0


def test_a_client_leaving_before_its_reply_is_cancelled_too(start):
    s = start("--parallel", "1", "--instances", "1")
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
        body = json.dumps({"model": s.model, "prompt": "The alphabet:", "max_tokens": 2000, "temperature": 0}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.5)
    metrics = lambda: httpx.get(s.url + "/metrics").text
    assert wait_until(lambda: "wisp_cancelled_total 1" in metrics(), 15), metrics()
    # The slot is free again: a new request is served at once.
    r = post(s, "/v1/completions", {"model": s.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=30)
    assert r.status_code == 200


# RELIABILITY 34: no or a wrong key: 401, and nothing of the model runs.
def test_the_api_key_guards_every_route_but_health(start):
    s = start("--api-key", "s3cret")
    body = {"model": s.model, "prompt": "Hi", "max_tokens": 2}
    for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}]:
        for method, path, b in [("post", "/v1/completions", body), ("post", "/v1/chat/completions", {"model": s.model, "messages": user()}),
                                ("get", "/v1/models", None), ("post", "/tokenize", {"content": "x"}), ("get", "/metrics", None)]:
            r = httpx.request(method, s.url + path, json=b, headers=headers)
            e = assert_error(r, 401, "authentication_error")
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/openapi.json").status_code == 200
    good = {"Authorization": "Bearer s3cret"}
    metrics = httpx.get(s.url + "/metrics", headers=good).text
    assert "wisp_prompt_tokens_total 0" in metrics and "wisp_generated_tokens_total 0" in metrics, metrics
    c = OpenAI(base_url=s.v1, api_key="s3cret", max_retries=0)
    assert c.completions.create(model=s.model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(Exception) as e:
        OpenAI(base_url=s.v1, api_key="nope", max_retries=0).models.list()
    assert "401" in str(e.value)


# RELIABILITY 35: SIGTERM under load: no new requests, those in flight finish, exit 0.
def test_sigterm_under_load_finishes_what_is_in_flight_and_exits_0(start):
    s = start("--parallel", "4")
    c = OpenAI(base_url=s.v1, api_key="x", max_retries=0)
    results, started = {}, threading.Barrier(5)

    def stream(i):
        chunks = c.completions.create(model=s.model, prompt=f"Story number {i}:", max_tokens=24, temperature=0, stream=True)
        text, finish = "", None
        for n, ch in enumerate(chunks):
            if n == 0:
                started.wait(60)
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        results[i] = (text, finish)

    ts = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    started.wait(120)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # No new connections once it stops taking them.
    with pytest.raises(httpx.HTTPError):
        httpx.get(s.url + "/health", timeout=5)
    [t.join(120) for t in ts]
    assert s.proc.wait(timeout=120) == 0, s.stderr()
    assert sorted(results) == [0, 1, 2, 3], results
    for text, finish in results.values():
        assert finish in ("stop", "length") and text, results
    assert "stopped" in s.stderr()


# Every request has a time limit (--request-timeout): 504 with an OpenAI error, or an error
# event in a stream; the server goes on.
def test_a_request_past_its_time_limit_ends_with_504_or_an_error_event(start):
    s = start("--request-timeout", "2", "--instances", "1")
    body = {"model": s.model, "prompt": "The alphabet:", "max_tokens": 100000, "temperature": 0}
    t0 = time.time()
    e = assert_error(post(s, "/v1/completions", body), 504, "timeout_error")
    assert e["code"] == "timeout" and time.time() - t0 < 30
    events = []
    with httpx.stream("POST", s.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200
        events = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "timeout_error", events[-3:]
    r = post(s, "/v1/completions", {"model": s.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
