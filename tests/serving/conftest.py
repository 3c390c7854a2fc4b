"""Fixtures: real servers on loopback (free ports), always stopped at teardown."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def serve():
    """serve(app) -> handle with .url; every server started is stopped at teardown."""
    from moe_offload.serving.server import start_server

    handles = []

    def start(app):
        h = start_server(app, "127.0.0.1", 0)
        handles.append(h)
        return h

    yield start
    for h in reversed(handles):
        with contextlib.suppress(Exception):
            h.stop()


@pytest.fixture
def mock_worker(serve):
    """mock_worker(**create_app kwargs, ms_per_token=1, hit_rate=0.85, max_model_len=4096) -> handle."""
    from moe_offload.backends import get_backend
    from moe_offload.serving.worker import create_app

    def start(ms_per_token=1.0, hit_rate=0.85, max_model_len=4096, **kw):
        backend = get_backend("mock")
        engine = backend.build_engine("mock", ms_per_token=ms_per_token, hit_rate=hit_rate, max_model_len=max_model_len)
        kw.setdefault("model_name", "mock")
        kw.setdefault("tiers", backend.tiers())
        return serve(create_app(engine, **kw))

    return start


@pytest.fixture
def cli_worker():
    """cli_worker(*args) -> (process, url): a real `moe-offload worker --port 0 ARGS` process, once /ready answers;
    killed with its process group (a tensor-parallel worker's ranks too) at teardown."""
    import os
    import signal
    import subprocess
    import time

    import httpx

    procs = []

    def start(*args):
        code = "import sys; from moe_offload.cli import main; sys.exit(main())"
        proc = subprocess.Popen([sys.executable, "-c", code, "worker", "--port", "0", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "MOE_OFFLOAD_LOG": "warning"})
        procs.append(proc)
        line = proc.stdout.readline()  # the banner: "moe-offload worker: NAME (BACKEND) at http://127.0.0.1:PORT ..."
        assert " at http://" in line, f"worker did not start (exit {proc.poll()}): {line!r}"
        url = line.split(" at ", 1)[1].split()[0]
        for _ in range(600):
            if httpx.get(url + "/ready").status_code == 200:
                break
            time.sleep(0.1)
        return proc, url

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
