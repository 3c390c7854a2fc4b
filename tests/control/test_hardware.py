"""Hardware profiles: built-ins documented and derived as stated, JSON files, the CLI (`hardware`, `predict
--hardware`, `plan --policy auto --hardware`, `budget --hardware`), and pricing experts in another dtype."""

import json
from pathlib import Path

import pytest

from moe_offload.cli import main
from moe_offload.control import placement as P
from moe_offload.control.calibration import _ASSUMED, QUANTITIES
from moe_offload.control.costmodel import expert_bytes_per_param, predict
from moe_offload.control.hardware import ASSUMPTIONS, BUILTIN, HardwareProfile, load_hardware
from moe_offload.control.spec import ModelSpec
from moe_offload.errors import ConfigError

from .conftest import moe_config

DATA = Path(__file__).parent / "data"
DATASHEET = ("accelerators", "device_bytes_per_s", "device_flops_per_s", "bus_bytes_per_s", "host_bytes_per_s",
             "host_cores", "host_flops_per_s", "host_memory_bytes")


def _one_error_line(capsys, argv, match):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert match in err, err


def test_builtins_cover_the_issue_machines():
    assert {"rngd-2x-xeon4410y", "rtx3060-pcie3", "h100-pcie", "h200-nvl"} <= set(BUILTIN)
    rngd = BUILTIN["rngd-2x-xeon4410y"]
    assert rngd.device == "rngd" and rngd.accelerators == (int(47.5 * 2**30),) * 2
    assert BUILTIN["rtx3060-pcie3"].bus_bytes_per_s == pytest.approx(15.75e9, rel=0.001)  # PCIe 3.0 x16
    assert BUILTIN["h200-nvl"].bus_bytes_per_s == pytest.approx(63.0e9, rel=0.001)  # PCIe 5.0 x16


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_number_has_a_source_and_derives_as_documented(name):
    p = BUILTIN[name]
    missing = [f for f in DATASHEET if not p.sources.get(f)]
    assert not missing, f"{name}: no source for {missing}"
    cal = p.calibration()
    assert not cal.measured and set(cal.sources().values()) == {"assumed"}
    assert all(getattr(cal, q).how for q in QUANTITIES)
    assert p.name in cal.label() and "nothing measured" in cal.label()
    assert cal.value("device_expert_bytes_per_s") == pytest.approx(p.device_bytes_per_s * p.device_efficiency)
    assert cal.value("bus_bytes_per_s") == pytest.approx(p.bus_bytes_per_s * p.bus_efficiency)
    assert cal.value("host_expert_bytes_per_s") == pytest.approx(
        min(p.host_bytes_per_s * p.host_efficiency, p.host_cores * p.core_bytes_per_s))
    assert cal.overlaps_host  # a real accelerator computes beside the host
    tiers = p.tiers()
    assert [t.capacity_bytes for t in P.accelerator_tiers(tiers)] == list(p.accelerators)
    assert P.host_tier_name(tiers) == "host"


def test_profile_overheads_are_the_cost_models_assumed_cuda_defaults():
    # The overheads are the engine's, not the hardware's: the profiles must not drift from the assumed defaults.
    for p in BUILTIN.values():
        assert (p.layer_overhead_ms, p.step_overhead_ms) == (_ASSUMED["cuda"]["layer_overhead_ms"],
                                                              _ASSUMED["cuda"]["step_overhead_ms"])
    assert {"device_efficiency", "bus_efficiency", "host_efficiency", "core_bytes_per_s", "flops_efficiency"} <= set(ASSUMPTIONS)


def test_json_file_round_trip(tmp_path):
    p = BUILTIN["rtx3060-pcie3"]
    path = tmp_path / "box.json"
    path.write_text(json.dumps(p.to_dict()))
    assert load_hardware(str(path)) == p
    assert load_hardware(p.to_dict()) == p and load_hardware(p) == p


@pytest.mark.parametrize("change, match", [
    ({"device": "tpu"}, "device"),
    ({"accelerators": []}, "accelerators"),
    ({"accelerators": "12GiB"}, "accelerators"),
    ({"device_bytes_per_s": 0}, "device_bytes_per_s"),
    ({"host_efficiency": 1.5}, "host_efficiency"),
    ({"layer_overhead_ms": -1}, "layer_overhead_ms"),
    ({"bus_bytes_per_s": "fast"}, "bus_bytes_per_s"),
    ({"colour": "green"}, "unknown key 'colour'"),
    ({"format": "other/2"}, "format"),
    ({"notes": "x"}, "notes"),
])
def test_bad_profiles_are_one_line_errors(change, match):
    d = BUILTIN["h100-pcie"].to_dict() | change
    with pytest.raises(ConfigError, match=match):
        HardwareProfile.from_dict(d)


def test_load_hardware_errors(tmp_path):
    with pytest.raises(ConfigError, match="built-in profile"):
        load_hardware("no-such-box")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hardware(str(bad))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match="lacks"):
        load_hardware(str(partial))


def test_expert_dtype_prices_only_the_experts(one_tier):
    spec = ModelSpec.from_hf_config(moe_config())
    cal = BUILTIN["rtx3060-pcie3"].calibration()
    pl = P.from_fraction(spec, one_tier, 0.25, "lru")
    bf16 = predict(spec, pl, "lru", cal)
    q8 = predict(spec, pl, "lru", cal, expert_dtype="q8_0")
    assert q8.bytes_moved_per_token == pytest.approx(bf16.bytes_moved_per_token * 34 / 32 / 2, rel=1e-3)
    assert q8.fetch_ms == pytest.approx(bf16.fetch_ms * 34 / 64, rel=1e-3)
    assert q8.dense_ms == bf16.dense_ms  # attention and the rest keep the config's dtype
    assert predict(spec, pl, "lru", cal, expert_dtype=1.0).bytes_moved_per_token == pytest.approx(
        predict(spec, pl, "lru", cal, expert_dtype="int8").bytes_moved_per_token)
    assert expert_bytes_per_param("mxfp4") == 17 / 32
    for bad in ("int3", 0, -1.0, True, float("nan")):
        with pytest.raises(ConfigError, match="expert dtype"):
            expert_bytes_per_param(bad)


def test_cli_hardware_list_and_show(capsys):
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUILTIN)
    assert main(["hardware", "rngd-2x-xeon4410y"]) == 0
    out = capsys.readouterr().out
    assert "FuriosaAI RNGD datasheet" in out and "assumed" in out and "Xeon Silver 4410Y" in out
    assert main(["hardware", "h200-nvl", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["name"] == "h200-nvl" and data["calibration"]["device"] == "cuda"
    _one_error_line(capsys, ["hardware", "nope"], "built-in profile")


def test_cli_predict_hardware_file_equals_name(capsys, tmp_path):
    path = tmp_path / "box.json"
    path.write_text(json.dumps(BUILTIN["rtx3060-pcie3"].to_dict()))
    model = str(DATA / "qwen1.5-moe-a2.7b")
    runs = []
    for hw in ("rtx3060-pcie3", str(path)):
        assert main(["predict", "--model", model, "--hardware", hw, "--fraction", "0.25", "--json"]) == 0
        runs.append([p["ms_per_token"] for p in json.loads(capsys.readouterr().out)["predictions"]])
    assert runs[0] == runs[1] and len(runs[0]) == 3
    _one_error_line(capsys, ["predict", "--model", model, "--hardware", "rtx3060-pcie3", "--calibration", str(path),
                             "--fraction", "0.25"], "not both")
    _one_error_line(capsys, ["predict", "--model", model, "--hardware", "nope", "--fraction", "0.25"], "built-in")
    _one_error_line(capsys, ["predict", "--model", model, "--hardware", "h100-pcie", "--fraction", "0.25",
                             "--expert-dtype", "int3"], "expert dtype")


def test_cli_plan_auto_sizes_from_the_profile(capsys, tmp_path):
    out = tmp_path / "placement.json"
    assert main(["plan", "--model", str(DATA / "qwen1.5-moe-a2.7b"), "--hardware", "rtx3060-pcie3", "--policy", "auto",
                 "--reserve", "1GiB", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "rtx3060-pcie3" in data["calibration"] and data["chosen"]["ms_per_token"] > 0
    placement = json.loads(out.read_text())
    assert [t["name"] for t in placement["tiers"]] == ["cuda:0", "host"]
    # 12 GiB less 1 GiB reserve, the 3.4 GB of non-expert weights and the KV cache leave room for ~40 % of experts
    slots = sum(lp["slots"].get("cuda:0", 0) for lp in placement["layers"]) / (24 * 60)
    assert 0.2 < slots < 0.5, slots
    _one_error_line(capsys, ["plan", "--model", str(DATA / "qwen1.5-moe-a2.7b"), "--hardware", "rtx3060-pcie3",
                             "--backend", "mock", "--policy", "auto"], "not both")
