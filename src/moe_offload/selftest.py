"""`moe-offload selftest`: the hardware-free checks, one line per area, in a few seconds.

Each check is a function that raises on failure; add an area with ``@check("name")``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CHECKS: list[tuple[str, Callable[[], str]]] = []


def check(area: str):
    def wrap(fn):
        CHECKS.append((area, fn))
        return fn

    return wrap


@check("contracts")
def _contracts() -> str:
    from rm_core import LayerPlacement, Measurement, MemoryTier, Placement, Workload
    from rm_core.schema import validate

    tier = MemoryTier("npu0", "device-hbm", 48 * 2**30, accelerator="node/furiosa:0")
    host = MemoryTier("host", "host-dram", 256 * 2**30)
    p = Placement("m", (tier, host), (LayerPlacement(0, ("npu0", "host")), ), "top", {"npu0": 0.5})
    for obj, stem in ((p, "placement"), (Workload("decode", "m"), "workload"), (Measurement("airm_tok_s", 1.0, "tok/s"), "measurement")):
        again = type(obj).from_json(obj.to_json())
        assert again == obj, f"{stem} does not round-trip"
        validate(stem, obj.to_dict())
    return "round-trip and schema ok"


@check("backends")
def _backends() -> str:
    from moe_offload import backends

    found = backends.backends()
    assert "mock" in found and found["mock"].availability().ok, "mock backend missing"
    return ", ".join(f"{n}={'yes' if b.availability().ok else 'no'}" for n, b in found.items())


@check("mock engine")
def _mock() -> str:
    from moe_offload.backends import get_backend
    from moe_offload.engines.base import SamplingParams

    engine = get_backend("mock").build_engine("mock", ms_per_token=0)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    a, b = list(engine.generate([1, 2, 3], params)), list(engine.generate([1, 2, 3], params))
    assert a == b and len(a) == 8, "mock engine is not deterministic"
    return "deterministic"


@check("executor")
def _executor() -> str:
    from moe_offload.engines.offload.selfcheck import exactness

    return exactness("cpu", tokens=4, fractions=(0.0, 0.5))


def run_all(echo: Callable[[str], None]) -> int:
    """Run every check; returns the number that failed."""
    failed = 0
    for area, fn in CHECKS:
        t0 = time.perf_counter()
        try:
            detail = fn()
            echo(f"PASS {area:14} {detail} ({(time.perf_counter() - t0) * 1000:.0f} ms)")
        except Exception as e:  # noqa: BLE001 - every failure becomes one line
            failed += 1
            echo(f"FAIL {area:14} {type(e).__name__}: {e}")
    return failed
