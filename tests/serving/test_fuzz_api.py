"""The API fuzz (scripts/fuzz_api.py: schemathesis on the worker's own /openapi.json), reduced for CI: the mock
engine, 20 examples per operation and phase. The full run (100 per operation) is the script's default."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_api.py"


def test_fuzzing_the_openapi_schema_finds_no_server_error(capfd):
    spec = importlib.util.spec_from_file_location("fuzz_api", SCRIPT)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    rc = fuzz.main(["--backend", "mock", "--examples", "20", "--seed", "7"])
    out = capfd.readouterr().out
    assert rc == 0, out[-4000:]
    assert "/health after the run: 200" in out and "generated" in out  # it ran cases, and the worker survived them
