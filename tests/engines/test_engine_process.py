"""EngineProcess and the JSON-lines protocol: conformance of the reference engine, crash detection, restart."""

import sys
import textwrap

import pytest

from moe_offload.engines.conformance import CHECKS, run_checks
from moe_offload.engines.params import SamplingParams
from moe_offload.engines.process import EngineProcess
from moe_offload.errors import EngineError

MOCK_ENGINE = [sys.executable, "-m", "moe_offload.engines.stdio", "--backend", "mock", "--option", "ms_per_token=0"]


def test_reference_engine_passes_conformance():
    lines = []
    assert run_checks(MOCK_ENGINE, lines.append) == 0, "\n".join(lines)
    assert len(lines) == len(CHECKS) and all(line.startswith("PASS") for line in lines)


def test_process_matches_in_process_engine():
    from moe_offload.engines.mock import MockConfig, MockEngine

    params = SamplingParams(max_tokens=10, temperature=0.7, seed=5)
    local = list(MockEngine(MockConfig(ms_per_token=0)).generate([3, 4, 5], params))
    engine = EngineProcess(MOCK_ENGINE)
    try:
        gen = engine.generate([3, 4, 5], params)
        assert list(gen) == local
        assert len(gen.stats.token_ms) == len(local) - 1  # measured at arrival
    finally:
        engine.close()


CRASHY = textwrap.dedent(
    """
    import json, sys
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "health":
            print(json.dumps({"id": req["id"], "event": "health", "vocab_size": 100, "max_model_len": 64,
                              "tokenizer": "byte", "tiers": []}), flush=True)
        elif req["op"] == "generate":
            print(json.dumps({"id": req["id"], "event": "token", "token": 7}), flush=True)
            sys.stderr.write("simulated NPU fault\\n")
            sys.exit(3)
    """
)


def test_dead_engine_is_detected_and_restarted(tmp_path):
    script = tmp_path / "crashy.py"
    script.write_text(CRASHY)
    engine = EngineProcess([sys.executable, str(script)])
    try:
        gen = engine.generate([1, 2], SamplingParams(max_tokens=5))
        assert next(gen) == 7
        with pytest.raises(EngineError, match=r"exited \(code 3\).*simulated NPU fault"):
            next(gen)
        assert not engine.alive
        # The next request starts the process again.
        gen = engine.generate([1, 2], SamplingParams(max_tokens=5))
        assert engine.restarts == 1 and next(gen) == 7
    finally:
        engine.close()


def test_missing_engine_binary_is_a_clear_error(tmp_path):
    with pytest.raises(EngineError, match="could not start the engine process"):
        EngineProcess([str(tmp_path / "no-such-engine")])


CHATTY = textwrap.dedent(
    """
    import json, sys
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "health":
            sys.stderr.write("x" * 1_000_000)  # logs far beyond a pipe's 64 KiB buffer
            sys.stderr.flush()
            print(json.dumps({"id": req["id"], "event": "health", "vocab_size": 100, "max_model_len": 64,
                              "tokenizer": "byte", "tiers": []}), flush=True)
        elif req["op"] == "shutdown":
            sys.exit(0)
    """
)


def test_an_engine_that_logs_a_lot_on_stderr_does_not_block(tmp_path):
    # An unread stderr pipe fills at 64 KiB and the engine blocks in write(): it would never answer.
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    engine = EngineProcess([sys.executable, str(script)], start_timeout=20)
    try:
        assert engine.info.vocab_size == 100
    finally:
        engine.close()


SILENT = textwrap.dedent(
    """
    import os, sys, time
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(60)  # never answers health
    """
)


def test_an_engine_that_fails_its_start_is_not_left_running(tmp_path):
    import os

    script, pid_file = tmp_path / "silent.py", tmp_path / "pid"
    script.write_text(SILENT)
    with pytest.raises(EngineError, match="did not answer"):
        EngineProcess([sys.executable, str(script), str(pid_file)], start_timeout=2)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping for a minute
        os.kill(pid, 0)


STALLS = textwrap.dedent(
    """
    import json, sys, time
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "health":
            print(json.dumps({"id": req["id"], "event": "health", "vocab_size": 100, "max_model_len": 64,
                              "tokenizer": "byte", "tiers": []}), flush=True)
        elif req["op"] == "generate":
            print(json.dumps({"id": req["id"], "event": "token", "token": 7}), flush=True)
            if len(sys.argv) > 1:
                time.sleep(3600)  # hangs after one token (an NPU that stopped)
            print(json.dumps({"id": req["id"], "event": "done", "stats": {"completion_tokens": 1}}), flush=True)
    """
)


def test_an_engine_that_stops_answering_is_killed_by_the_watchdog_and_replaced(tmp_path):
    """After one token the process goes silent: the watchdog kills it (its pid gone) and fails the generation with a
    503; the next request runs on a new process."""
    import os
    import time

    from moe_offload.errors import EngineDown
    from moe_offload.serving.errors import from_offload

    script = tmp_path / "stalls.py"
    script.write_text(STALLS)
    engine = EngineProcess([sys.executable, str(script), "hang"], watchdog=1.5)
    try:
        pid = engine._proc.pid
        gen = engine.generate([1, 2], SamplingParams(max_tokens=5))
        assert next(gen) == 7
        t0 = time.monotonic()
        with pytest.raises(EngineDown, match=r"stalled: no output for 2 s; killed it") as e:
            next(gen)
        assert 1.4 < time.monotonic() - t0 < 5
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, not left running
        err = from_offload(e.value)
        assert (err.status, err.code, err.retry_after) == (503, "engine_failed", 5)
        engine.argv = [sys.executable, str(script)]  # the replacement answers in full
        assert list(engine.generate([1, 2], SamplingParams(max_tokens=5))) == [7]
        assert engine._proc.pid != pid and engine.restarts == 1
    finally:
        engine.close()
