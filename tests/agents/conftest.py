"""Starts `wisp serve` on Qwen2.5-Coder-0.5B-Instruct (WISP_MODEL) for the agent suite: tools,
log-probabilities, several choices, and a real agent framework, through unmodified clients;
and on Qwen2.5-Coder-1.5B-Instruct (WISP_MODEL_15), which answers from a tool's result where
the 0.5B calls the tool again.

cli/tests/agents.rs runs these tests from the cargo suite; the server process is the one of the
client suite (tests/serve/conftest.py's Server).
"""

import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location("serve_conftest", os.path.join(os.path.dirname(__file__), "..", "serve", "conftest.py"))
_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_serve)
Server = _serve.Server
# Servers with other flags, stopped at the end of each test.
start = _serve.start


@pytest.fixture(scope="session")
def server():
    """The CPU path, four requests in flight at once."""
    s = Server("--gpu", "off", "--parallel", "4")
    yield s
    assert s.stop() == 0, s.stderr()


@pytest.fixture(scope="session")
def big_server():
    """Qwen2.5-Coder-1.5B-Instruct (WISP_MODEL_15), the CPU path: a model that answers from a
    tool's result."""
    s = Server("--gpu", "off", "--parallel", "2", model=os.environ["WISP_MODEL_15"])
    yield s
    assert s.stop() == 0, s.stderr()


@pytest.fixture(scope="session")
def gpu_server():
    """The products on the device (lavapipe here), as `--gpu on` runs them."""
    s = Server("--gpu", "on", "--parallel", "4")
    yield s
    assert s.stop() == 0, s.stderr()
