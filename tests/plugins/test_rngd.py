"""The RNGD backend around the hardware: detection, tiers from furiosa-smi, the engine process path.

No RNGD card is here: a device node and the engine binary are stood in for by a temp file and
the reference engine process (python -m moe_offload.engines.stdio), so only the NPU itself is not run.
"""

import json
import os
import stat
import sys

import pytest

from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError
from moe_offload.plugins import rngd


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fake_card(tmp_path, monkeypatch):
    node = tmp_path / "npu0"
    node.write_text("")
    monkeypatch.setattr(rngd, "DEVICE_GLOBS", (str(tmp_path / "npu*"),))
    return tmp_path


def test_available_when_a_device_node_exists(fake_card):
    assert rngd.RngdBackend().availability().ok


def test_tiers_from_furiosa_smi(fake_card, monkeypatch):
    info = [{"memory_total_bytes": 48 * 10**9, "memory_used_bytes": 10**9}]
    _executable(fake_card / "furiosa-smi", f"#!/bin/sh\necho '{json.dumps(info)}'\n")
    monkeypatch.setenv("PATH", f"{fake_card}{os.pathsep}{os.environ['PATH']}")
    tiers = rngd.RngdBackend().tiers()
    npu = tiers[0]
    assert npu.name == "rngd:0" and npu.kind == "device-hbm" and npu.capacity_bytes == 48 * 10**9
    assert npu.accelerator.endswith("/furiosa:0") and npu.reserved_bytes == 10**9
    assert tiers[-1].kind == "host-dram"


def test_engine_process_path(fake_card):
    engine_bin = _executable(
        fake_card / "npu-engine",
        f"#!/bin/sh\nexec {sys.executable} -m moe_offload.engines.stdio --backend mock --option ms_per_token=0 \"$@\"\n",
    )
    engine = rngd.RngdBackend().build_engine("mock", None, engine=str(engine_bin))
    try:
        assert engine.info.backend == "rngd"
        tokens = list(engine.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
        assert len(tokens) == 5
    finally:
        engine.close()


def test_engine_binary_is_required(fake_card):
    with pytest.raises(ConfigError, match="engine=PATH"):
        rngd.RngdBackend().build_engine("m", None)
