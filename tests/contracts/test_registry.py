"""Entry-point registry, protocol version and metric names."""

import subprocess
import sys

import pytest

from rm_core import METRICS, PROTOCOL_VERSION, ContractError, registry
from rm_core.schema import validate_manifest


def test_workload_loads_without_side_effects():
    # A fresh interpreter: loading the workload must not import torch or start anything.
    code = (
        "import sys, threading\n"
        "from rm_core import registry\n"
        "r = registry.load('airm.workloads', 'npu-offload')\n"
        "assert callable(r)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert threading.active_count() == 1, 'a thread was started'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ContractError) as err:
        registry.load("airm.workloads", "no-such-workload")
    assert "npu-offload" in str(err.value)
    assert "npu-offload" in registry.names("airm.workloads")


def test_protocol_and_metric_units():
    major, minor = PROTOCOL_VERSION.split(".")
    assert major.isdigit() and minor.isdigit()
    assert METRICS["airm_tok_s"].unit == "tok/s"
    assert METRICS["airm_tpot_p50_ms"].unit == "ms"
    assert METRICS["airm_tpot_p90_ms"].unit == "ms"
    assert METRICS["airm_power_w"].unit == "W"


def test_manifest_validation_reports_the_problem(tmp_path):
    bad = tmp_path / "ai-rm.yaml"
    bad.write_text("apiVersion: ai-rm/v0.1\nname: x\n")
    with pytest.raises(ContractError, match="required"):
        validate_manifest(bad)
    garbled = tmp_path / "g.yaml"
    garbled.write_text("a: [1,\n")
    with pytest.raises(ContractError, match="YAML"):
        validate_manifest(garbled)


def test_project_manifest_is_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    manifest = validate_manifest(root / "ai-rm.yaml")
    ep = manifest["entry_point"]
    runner = registry.load(ep["group"], ep["name"])
    assert f"{runner.__module__}:{runner.__name__}" == ep["object"]
    assert manifest["protocol"] == PROTOCOL_VERSION
    declared = {m["name"]: m["unit"] for m in manifest["metrics"]}
    for name, spec in METRICS.items():
        assert declared.get(name) == spec.unit, f"{name} missing or with another unit in ai-rm.yaml"
