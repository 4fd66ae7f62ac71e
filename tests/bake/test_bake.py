"""`wisp bake`'s component served by `wasmtime serve` (no `-S cli`), driven by the `openai`
Python package, against `wisp serve` on the same model (issue 26's must-shows).

cli/tests/bake.rs runs this with WISP_BIN (the CLI), WISP_WASMTIME (wasmtime-cli 48),
WISP_BAKED (the component it baked) and WISP_MODEL (Qwen2.5-Coder-0.5B-Instruct, which has a
chat template) set.
"""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest
from openai import OpenAI

BIN = os.environ.get("WISP_BIN", "")
WASMTIME = os.environ.get("WISP_WASMTIME", "")
BAKED = os.environ.get("WISP_BAKED", "")
MODEL = os.environ.get("WISP_MODEL", "")
MODEL_ID = os.path.basename(MODEL).removesuffix(".gguf")

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server process whose stderr is kept for the assertion messages."""

    def __init__(self, cmd, ready):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = []
        self.url = None
        for line in self.proc.stdout:
            self.log.append(line)
            m = re.search(ready, line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"{cmd[0]} did not start ({self.proc.returncode}): {''.join(self.log)}")
        self.url = self.url.rstrip("/")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def pss_kib(self):
        """Resident memory, each page counted once however many instances map it: a page
        shared by N mappings counts 1/N (RSS would count the image once per instance that
        maps it, in one process)."""
        with open(f"/proc/{self.proc.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
        raise RuntimeError("no Pss")

    def cpu_seconds(self):
        """User and system time of the process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def output(self):
        return "".join(self.log)


@pytest.fixture(scope="module")
def baked():
    """`wasmtime serve` of the baked component on a loopback port, with nothing but the proxy
    world (no `-S cli`, no directory)."""
    port = free_port()
    p = Process([WASMTIME, "serve", "--addr", f"127.0.0.1:{port}", BAKED], r"Serving HTTP on (http://\S+)")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    """`wasmtime serve` of the component compiled ahead (`wasmtime compile`, default settings),
    as docs/deploy.md runs it in production: every instance maps the image from the file."""
    cwasm = tmp_path_factory.mktemp("cwasm") / "baked.cwasm"
    subprocess.run([WASMTIME, "compile", BAKED, "-o", str(cwasm)], check=True)
    port = free_port()
    p = Process([WASMTIME, "serve", "--allow-precompiled", "--addr", f"127.0.0.1:{port}", str(cwasm)], r"Serving HTTP on (http://\S+)")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def served():
    """`wisp serve` of the same model on its CPU path, for the reference texts."""
    p = Process([BIN, "serve", "--model", MODEL, "--gpu", "off", "--port", "0", "--instances", "1"], r"on (http://\S+) ")
    yield p
    p.stop()


def client(p):
    return OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def chat(p, **kw):
    return client(p).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=48, temperature=0, **kw)


def test_the_component_imports_nothing_outside_the_proxy_world(baked):
    # cli/tests/bake.rs checks the import list itself; here: it really runs without -S cli.
    r = httpx.get(baked.url + "/health", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


def test_the_model_list_names_the_baked_model(baked):
    assert [m.id for m in client(baked).models.list().data] == [MODEL_ID]
    assert client(baked).models.retrieve(MODEL_ID).id == MODEL_ID


def test_a_chat_completion_gives_wisp_serves_greedy_text(baked, served):
    mine, theirs = chat(baked), chat(served)
    assert mine.choices[0].message.content == theirs.choices[0].message.content, (mine, theirs)
    assert mine.choices[0].message.content.strip()
    assert mine.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert mine.usage.completion_tokens == theirs.usage.completion_tokens


def test_a_streamed_chat_completion_gives_the_same_text(baked, served):
    whole = chat(served).choices[0].message.content
    chunks = list(chat(baked, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3, "the text came in one piece"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_a_text_completion_gives_the_same_text(baked, served):
    kw = dict(model=MODEL_ID, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    mine, theirs = client(baked).completions.create(**kw), client(served).completions.create(**kw)
    assert mine.choices[0].text == theirs.choices[0].text
    assert mine.choices[0].finish_reason == "length" and mine.usage.completion_tokens == 24


def test_structured_output_follows_its_schema(baked):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    r = client(baked).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Give a number as JSON."}], max_tokens=32, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value, dict) and isinstance(value["n"], int), r


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}


def test_tool_calls_are_wisp_serves(baked, served):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER], max_tokens=60, temperature=0)
    for choice in ["required", "auto"]:
        mine, theirs = client(baked).chat.completions.create(tool_choice=choice, **kw), client(served).chat.completions.create(tool_choice=choice, **kw)
        assert mine.choices[0].finish_reason == theirs.choices[0].finish_reason == "tool_calls", (choice, mine, theirs)
        calls = lambda r: [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
        assert calls(mine) == calls(theirs) and calls(mine)[0][0] == "get_weather"
    streamed = [c for c in client(baked).chat.completions.create(tool_choice="required", stream=True, **kw) if c.choices]
    deltas = [t for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather" and streamed[-1].choices[0].finish_reason == "tool_calls"


def test_messages_and_responses_give_the_chats_text(baked, served):
    import anthropic

    whole = chat(served).choices[0].message.content
    a = anthropic.Anthropic(base_url=baked.url, api_key="unused", max_retries=0, timeout=600)
    kw = dict(model=MODEL_ID, system=CHAT[0]["content"], messages=[CHAT[1]], max_tokens=48, extra_body={"temperature": 0})
    m = a.messages.create(**kw)
    assert m.content[0].text == whole and m.stop_reason in ("end_turn", "max_tokens")
    with a.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == whole
    kw = dict(model=MODEL_ID, instructions=CHAT[0]["content"], input=CHAT[1]["content"], max_output_tokens=48, temperature=0)
    assert client(baked).responses.create(**kw).output_text == whole
    events = list(client(baked).responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole
    assert events[-1].type in ("response.completed", "response.incomplete")
    # No state between requests here.
    r = httpx.post(baked.url + "/v1/responses", json=dict(kw, previous_response_id="resp_1"), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(baked.url + "/v1/messages", json={"model": MODEL_ID, "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_embeddings_are_wisp_serves(baked, served):
    texts = ["The cat sat on the mat.", "def add(a, b):\n    return a + b"]
    mine = client(baked).embeddings.create(model=MODEL_ID, input=texts)
    theirs = client(served).embeddings.create(model=MODEL_ID, input=texts)
    assert [d.embedding for d in mine.data] == [d.embedding for d in theirs.data]
    assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens > 0
    r = httpx.post(baked.url + "/v1/embeddings", json={"model": MODEL_ID, "input": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


@pytest.mark.parametrize(
    "method,path,body,status,param",
    [
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model"),
        ("POST", "/v1/chat/completions", {"model": MODEL_ID, "messages": []}, 400, "messages"),
        ("POST", "/v1/chat/completions", {"model": MODEL_ID, "messages": CHAT, "temperature": 9}, 400, "temperature"),
        ("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "n": 2}, 400, "n"),
        ("POST", "/v1/chat/completions", "{not json", 400, None),
        ("GET", "/v1/chat/completions", None, 405, None),
        ("GET", "/nowhere", None, 404, None),
        ("GET", "/v1/models/nope", None, 404, "model"),
    ],
)
def test_bad_requests_get_openais_error_shape(baked, method, path, body, status, param):
    kw = {"content": body} if isinstance(body, str) else ({"json": body} if body is not None else {})
    r = httpx.request(method, baked.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param


def test_a_body_past_the_cap_is_refused_with_413(baked):
    r = httpx.post(baked.url + "/v1/completions", content=b"x" * (17 << 20), timeout=120)
    assert r.status_code == 413, r.text


def test_a_client_leaving_mid_stream_ends_its_generation(baked):
    """The instance notices at its next write and stops generating: the server's CPU goes
    quiet, and it serves the next request."""
    body = {"model": MODEL_ID, "prompt": "def main():", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", baked.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got), got
    time.sleep(1.0)
    cpu0 = baked.cpu_seconds()
    time.sleep(2.0)
    busy = baked.cpu_seconds() - cpu0
    assert busy < 0.5, f"the server kept {busy:.2f} s of CPU busy in 2 s after its client left"
    assert httpx.get(baked.url + "/health", timeout=60).status_code == 200


def test_the_compiled_component_gives_the_same_text(precompiled, served):
    assert chat(precompiled).choices[0].message.content == chat(served).choices[0].message.content


def test_sixteen_concurrent_requests_share_one_image(precompiled):
    """16 requests at once all complete; the server uses more than one core; its resident
    memory (PSS) while they run stays within 1.5x of serving one request (every instance maps
    the same memory image, copy-on-write)."""
    kw = dict(model=MODEL_ID, prompt="def quicksort(items):", max_tokens=32, temperature=0)
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], precompiled.pss_kib())
            time.sleep(0.02)

    def one_request():
        return client(precompiled).completions.create(**kw).choices[0].text

    # One request alone: its peak resident memory.
    threading.Thread(target=watch, daemon=True).start()
    alone = one_request()
    done.set()
    time.sleep(0.1)
    one_peak = peak[0]

    peak[0], done = 0, threading.Event()
    threading.Thread(target=watch, daemon=True).start()
    cpu0, t0 = precompiled.cpu_seconds(), time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda _: one_request(), range(16)))
    cpu, wall = precompiled.cpu_seconds() - cpu0, time.monotonic() - t0
    done.set()
    time.sleep(0.1)
    assert texts == [alone] * 16, texts
    cores = cpu / wall
    assert cores > 1.2, f"16 concurrent requests kept {cores:.2f} cores busy"
    assert peak[0] <= 1.5 * one_peak, f"resident memory {peak[0]} KiB with 16 requests, {one_peak} KiB with one"
    print(f"16 requests: {wall:.1f} s, {cores:.2f} cores, peak PSS {peak[0] / 1024:.0f} MiB (one request {one_peak / 1024:.0f} MiB)")
