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


def test_several_cards_reach_the_engine_process(fake_card, tmp_path):
    # the engine binary records its command line, then serves as the reference (mock) engine: what the one engine
    # process for both cards is given (test_devices.py runs the reference engine on two devices)
    from rm_core import Placement

    argv_file = tmp_path / "argv"
    engine_bin = _executable(
        fake_card / "npu-engine",
        f"#!/bin/sh\necho \"$@\" > {argv_file}\n"
        f"exec {sys.executable} -m moe_offload.engines.stdio --backend mock --option ms_per_token=0\n",
    )
    from moe_offload.control import placement as P
    from moe_offload.control.devices import device_tiers
    from moe_offload.control.spec import ModelSpec
    from rm_core import MemoryTier

    spec = ModelSpec(name="m", model_type="qwen3_moe", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2,
                     hidden_size=32, expert_intermediate_size=16, vocab_size=128, num_attention_heads=4,
                     num_kv_heads=2, head_dim=8)
    cards = [MemoryTier(f"rngd:{i}", "device-hbm", 48 * 10**9, accelerator=f"n/furiosa:{i}") for i in range(2)]
    placement = P.from_fraction(spec, device_tiers(["rngd:0", "rngd:1"], cards + [MemoryTier("host", "host-dram", 1)]),
                                0.5, devices=["rngd:0", "rngd:1"])
    engine = rngd.RngdBackend().build_engine("mock", placement, engine=str(engine_bin), devices="rngd:0,rngd:1")
    try:
        args = argv_file.read_text().split()
        assert args[args.index("--devices") + 1] == "rngd:0,rngd:1"
        sent = Placement.from_json(open(args[args.index("--placement") + 1]).read())
        assert sent == placement and {len(lp.pinned("rngd:0")) for lp in sent.layers} == {2}
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="rngd:N"):
        rngd.RngdBackend().build_engine("mock", None, engine=str(engine_bin), devices="cuda:0,cuda:1")
