"""Start time and memory of baked components on a wasmCloud 2.x host and under `wasmtime serve`,
with their default settings (both compile the component in memory), and under `wasmtime serve`
of the component compiled ahead (`wasmtime compile`): for each component given, in turn, a fresh
host or server, then

- the workload's start (pull and compile), and the first request after it (`GET /health`, which
  makes an instance: the first one also builds the runtime's copy-on-write image);
- later requests to fresh instances (`/health`, median and max of 20);
- on a second fresh one (the timings come from one outside any cgroup), the process's memory at
  its peak while serving one chat request, then 16 at once:
  PSS (a page mapped by many instances counts once) and, where a memory cgroup (v1) can be made,
  the cgroup's anonymous plus shared memory (which counts the copy-on-write image whether or not
  it is mapped).

usage: python3 bench/wasmcloud.py WASH WASMTIME BAKED.wasm [BAKED.wasm ...]
(needs nats-server, docker-registry, python3 with httpx and nats-py; run as bench/wasmcloud.sh)
"""

import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import nats

WASH, WASMTIME, *BAKED = sys.argv[1:]
CGROUP = Path("/sys/fs/cgroup/memory")
BODY = {"model": "", "messages": [{"role": "user", "content": "Write a haiku about rust."}], "max_tokens": 16, "temperature": 0}


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(p, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", p)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {p}")


def start(cmd, ready, name, cgroup):
    """`cmd` started (in its own memory cgroup if `cgroup` and one can be made); returns the
    process, the first group of the line matching `ready`, and the cgroup (or None)."""
    group = None
    if cgroup and CGROUP.is_dir():
        group = CGROUP / f"wisp-bench-{name}-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            group = None
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if group is not None:
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    for line in p.stdout:
        m = re.search(ready, line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, m.group(1), group
    raise RuntimeError(f"{cmd[0]} did not start")


def memory_mib(p, group):
    pss = 0
    with open(f"/proc/{p.pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) >> 10
    charged = None
    if group is not None:
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        charged = (int(stat["rss"]) + int(stat["shmem"])) >> 20
    return pss, charged


def peak_serving(p, group, url, headers, n):
    """The process's peak (PSS, cgroup) MiB while `n` chat requests run at once."""
    peak = [0, 0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            pss, charged = memory_mib(p, group)
            peak[0], peak[1] = max(peak[0], pss), max(peak[1], charged or 0)
            time.sleep(0.02)

    def one():
        r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=headers, timeout=600)
        r.raise_for_status()

    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    done.set()
    w.join()
    return peak[0], peak[1] if group is not None else None


def requests(url, headers):
    """ms of the first `/health` (a new instance, the first of the component) and of 20 later."""
    # One client: making one per request (its TLS settings) would cost more than the instance.
    client = httpx.Client(headers=headers, timeout=600)

    def once():
        t = time.monotonic()
        client.get(url + "/health").raise_for_status()
        return (time.monotonic() - t) * 1e3

    first = once()
    later = [once() for _ in range(20)]
    return first, statistics.median(later), max(later)


def model_id(url, headers):
    return httpx.get(url + "/v1/models", headers=headers, timeout=600).json()["data"][0]["id"]


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


async def nats_request(url, subject, body):
    nc = await nats.connect(url)
    try:
        for _ in range(100):
            try:
                return json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=600)).data)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.1)
        raise RuntimeError("the host never answered")
    finally:
        await nc.close()


def server(kind, baked, image, tmp, nats_url, tag, cgroup):
    """Starts `kind` (wasmcloud, serve: `wasmtime serve` of the component, cwasm: of it compiled
    ahead) serving `baked`; returns the process, its cgroup, its URL, the Host header to send
    and the seconds its start took (the workload's start, or the server's to its first line)."""
    name = f"{tag}-{kind}-{'memory' if cgroup else 'time'}"
    if kind == "wasmcloud":
        http = port()
        p, host_id, group = start(
            [WASH, "host", "--host-name", name, "--http-addr", f"127.0.0.1:{http}", "--scheduler-nats-url", nats_url,
             "--data-nats-url", nats_url, "--allow-insecure-registries", "--oci-cache-dir", str(tmp / f"oci-{name}")],
            r'Host started host_id="([^"]+)"', name, cgroup,
        )
        request = {"workloadId": f"bench-{name}", "workload": {"namespace": "default", "name": "bench", "witWorld": {
            "components": [{"name": "wisp", "image": image}],
            "hostInterfaces": [{"namespace": "wasi", "package": "http", "interfaces": ["incoming-handler"], "config": {"host": "wisp"}}],
        }}}
        t = time.monotonic()
        status = asyncio.run(nats_request(nats_url, f"runtime.host.{host_id}.workload.start", request))["workloadStatus"]
        assert status["workloadState"] == "WORKLOAD_STATE_RUNNING", status
        return p, group, f"http://127.0.0.1:{http}", {"Host": "wisp"}, time.monotonic() - t
    path, flags = baked, []
    if kind == "cwasm":
        path = str(tmp / f"{name}.cwasm")
        subprocess.run([WASMTIME, "compile", baked, "-o", path], check=True)
        flags = ["--allow-precompiled"]
    t = time.monotonic()
    p, url, group = start([WASMTIME, "serve", *flags, "--addr", "127.0.0.1:0", path], r"Serving HTTP on (http://\S+)/", name, cgroup)
    return p, group, url, {}, time.monotonic() - t


def measure(kind, baked, image, tmp, nats_url, tag):
    """Times on a server outside any cgroup (charging pages to one slows them), then memory on a
    second one inside its own."""
    p, _, url, headers, start_s = server(kind, baked, image, tmp, nats_url, tag, False)
    try:
        first, median, worst = requests(url, headers)
    finally:
        p.kill()
        p.wait()
    p, group, url, headers, _ = server(kind, baked, image, tmp, nats_url, tag, True)
    try:
        BODY["model"] = model_id(url, headers)
        one = peak_serving(p, group, url, headers, 1)
        many = peak_serving(p, group, url, headers, 16)
    finally:
        p.kill()
        p.wait()
        if group is not None:
            group.rmdir()
    what = {"wasmcloud": "wasmCloud", "serve": "wasmtime serve", "cwasm": "wasmtime serve (compiled ahead)"}[kind]
    print(
        f"{what} {Path(baked).name}: start {start_s:.1f} s; first request {first:.1f} ms; fresh instances "
        f"median {median:.1f} ms, max {worst:.1f} ms; memory serving 1 / 16: PSS {one[0]} / {many[0]} MiB "
        f"({ratio(many[0], one[0])}), cgroup anon+shmem {one[1]} / {many[1]} MiB ({ratio(many[1], one[1])})",
        flush=True,
    )


def main():
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        nats_port, registry_port = port(), port()
        procs = [subprocess.Popen(["nats-server", "-a", "127.0.0.1", "-p", str(nats_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        (tmp / "registry.yml").write_text(
            f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {tmp / 'registry'}\n"
            f"http:\n  addr: 127.0.0.1:{registry_port}\n"
        )
        procs.append(subprocess.Popen(["docker-registry", "serve", str(tmp / "registry.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            wait_port(nats_port)
            wait_port(registry_port)
            images = []
            for i, baked in enumerate(BAKED):
                image = f"127.0.0.1:{registry_port}/bench/c{i}:latest"
                subprocess.run([WASH, "oci", "push", "--insecure", image, baked], check=True, capture_output=True)
                images.append(image)
            for i, (baked, image) in enumerate(zip(BAKED, images)):
                for kind in ["wasmcloud", "serve", "cwasm"]:
                    measure(kind, baked, image, tmp, f"nats://127.0.0.1:{nats_port}", f"c{i}")
        finally:
            for p in procs:
                p.kill()


if __name__ == "__main__":
    main()
