"""rm-core conformance kit: a pytest plugin (entry point ``pytest11: rm_core``) for workload runners.

A workload author checks a runner against the contracts with::

    def test_my_runner_conforms(airm_conformance):
        airm_conformance("my-workload", {"backend": "mock"})

or calls the ``check_*`` functions one by one. Every check raises
``AssertionError`` with a message saying what the runner did wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

from rm_core.contracts import Measurement, Workload
from rm_core.errors import ContractError
from rm_core.metrics import METRICS
from rm_core.schema import validate

GROUP = "airm.workloads"


def check_loads_without_side_effects(name: str) -> None:
    """Loading the runner in a fresh interpreter imports no torch and starts no thread or process."""
    code = (
        "import sys, threading, multiprocessing\n"
        "from rm_core import registry\n"
        f"r = registry.load({GROUP!r}, {name!r})\n"
        "assert callable(r), 'the entry point is not callable'\n"
        "assert 'torch' not in sys.modules, 'loading imported torch'\n"
        "assert threading.active_count() == 1, 'loading started a thread'\n"
        "assert not multiprocessing.active_children(), 'loading started a process'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"loading {name!r} had side effects: {done.stderr.strip().splitlines()[-1:]}"


def check_rejects_bad_config(runner: Callable, config: dict[str, Any]) -> None:
    """Unknown keys and KV-cache transport are refused with ContractError before anything starts."""
    cases = {
        "an unknown key": {**config, "no_such_key_for_conformance": 1},
        "kv_transport": {**config, "kv_transport": "nixl"},
    }
    for what, bad in cases.items():
        try:
            runner(Workload("decode"), **bad)
        except ContractError:
            continue
        except Exception as e:  # noqa: BLE001 - the wrong exception type is itself the finding
            raise AssertionError(f"{what} raised {type(e).__name__}, expected ContractError: {e}") from e
        raise AssertionError(f"{what} was accepted; expected ContractError")


def check_decode(runner: Callable, config: dict[str, Any]) -> list[Measurement]:
    """A decode run returns valid Measurements: the throughput and latency KPIs with their rm-core units."""
    result = runner(Workload("decode"), **{**config, "max_new": 4, "repeat": 1})
    assert isinstance(result, list) and result, "decode must return a non-empty list of Measurement"
    names = set()
    for m in result:
        assert isinstance(m, Measurement), f"decode returned {type(m).__name__}, expected Measurement"
        validate("measurement", json.loads(m.to_json()))
        spec = METRICS.get(m.name)
        if spec is not None:
            assert m.unit == spec.unit, f"{m.name} in {m.unit!r}, rm-core says {spec.unit!r}"
        names.add(m.name)
    for required in ("airm_tok_s", "airm_tpot_p50_ms", "airm_tpot_p90_ms"):
        assert required in names, f"decode did not report {required}"
    return result


def check_serve_nonblocking(runner: Callable, config: dict[str, Any], timeout: float = 60.0) -> None:
    """serve with block=False returns a handle whose url answers /health, and stop() ends it."""
    handle = runner(Workload("serve"), **{**config, "block": False, "port": 0})
    try:
        url = handle.url
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            assert resp.status == 200, f"/health answered {resp.status}"
    finally:
        handle.stop()
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2)
    except OSError:
        return
    raise AssertionError("the server still answers after stop()")


def run_all(name: str, config: dict[str, Any], serve: bool = True) -> None:
    from rm_core import registry

    check_loads_without_side_effects(name)
    runner = registry.load(GROUP, name)
    check_rejects_bad_config(runner, config)
    check_decode(runner, config)
    if serve:
        check_serve_nonblocking(runner, config)


try:
    import pytest
except ImportError:  # the kit is a pytest plugin; without pytest only the check functions are used
    pytest = None

if pytest is not None:

    @pytest.fixture
    def airm_conformance():
        """Call with (workload name, runner config[, serve=True]) to run every conformance check."""
        return run_all
