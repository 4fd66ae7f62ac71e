"""Starts `wisp serve` on a free loopback port for the tests of this folder.

The server is the real binary (WISP_BIN) on the real default model (WISP_MODEL), as
cli/tests/serve.rs runs these tests from the cargo suite.
"""

import os
import re
import signal
import subprocess
import threading
import time

import pytest

BIN = os.environ.get("WISP_BIN", "")
MODEL = os.environ.get("WISP_MODEL", "")


class Server:
    """One `wisp serve` process; its stderr is kept for the assertion messages."""

    def __init__(self, *args, env=None, model=None):
        cmd = [BIN, "serve", "--model", model or MODEL, "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env or os.environ.copy()
        )
        self.log = []
        self.url = None
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"serving (\S+) on (http://\S+) ", line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                break
        if self.url is None:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"wisp serve did not start ({self.proc.returncode}): {''.join(self.log)}")
        self.port = int(self.url.rsplit(":", 1)[1])
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    @property
    def v1(self):
        return self.url + "/v1"

    def proc_kib(self, file, key):
        """A figure in KiB from the server's /proc/PID/`file` (`status`, `smaps_rollup`)."""
        with open(f"/proc/{self.proc.pid}/{file}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"no {key} in /proc/PID/{file}")

    def rss_kib(self):
        """Resident memory of the server process."""
        return self.proc_kib("status", "VmRSS")

    def pss_kib(self):
        """Proportional resident memory: a page shared by N mappings counted 1/N."""
        return self.proc_kib("smaps_rollup", "Pss")

    def stop(self, sig=signal.SIGTERM, timeout=120):
        """Sends `sig` and returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def stderr(self):
        return "".join(self.log)


@pytest.fixture(scope="session")
def server():
    """The shared server: the CPU path, two instances, the defaults otherwise."""
    s = Server("--gpu", "off", "--instances", "2")
    yield s
    assert s.stop() == 0, s.stderr()


@pytest.fixture
def start():
    """Starts servers with other flags; each is stopped at the end of the test."""
    started = []

    def make(*args, **kw):
        s = Server("--gpu", "off", *args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(signal.SIGKILL) if s.proc.poll() is None else None


def wait_until(cond, timeout=30.0, step=0.05):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()
