"""The cost model: calibration JSON, predicted orderings in cases with a known answer, choose/auto, the CLI,
the hybrid threshold from a calibration, and a real (quick) calibration on the CPU."""

import json
import math

import pytest
from click.testing import CliRunner

from moe_offload.control import placement as P
from moe_offload.control.calibration import QUANTITIES, Calibration, Quantity
from moe_offload.control.costmodel import NEVER, choose, hybrid_threshold, predict, rank
from moe_offload.control.profile import Profile, synthetic_routes
from moe_offload.control.spec import ModelSpec
from moe_offload.errors import ConfigError, PlacementError

from .conftest import moe_config


def cuda_cal(**values):
    return Calibration.assumed("cuda").with_values(**values)


def place(spec, one_tier, fraction, policy="top", profile=None):
    return P.from_fraction(spec, one_tier, fraction, policy, profile)


def test_calibration_json_round_trip(tmp_path):
    cal = Calibration.assumed("cpu").with_values(bus_bytes_per_s=Quantity(3e9, "measured", "copy test"))
    cal = Calibration(**{**{f: getattr(cal, f) for f in QUANTITIES}, "device": "cuda:1", "machine": "box",
                         "when": "2026-01-01T00:00:00+00:00", "expert_shape": {"hidden": 64, "expert_bytes": 10},
                         "notes": ("n",)})
    assert Calibration.from_json(cal.to_json()) == cal
    path = tmp_path / "cal.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back == cal and back.device_type == "cuda"
    assert back.sources()["bus_bytes_per_s"] == "measured" and back.sources()["device_read_bytes_per_s"] == "assumed"
    assert "assumed:" in back.label() and not back.measured


@pytest.mark.parametrize("bad, match", [
    ({"device": "tpu"}, "device"),
    ({"bus_bytes_per_s": {"value": -1, "source": "measured"}}, ">= 0"),
    ({"bus_bytes_per_s": {"value": 0, "source": "measured"}}, "rate > 0"),
    ({"bus_bytes_per_s": {"value": 1e9, "source": "guessed"}}, "source"),
    ({"format": "other/9"}, "format"),
    # wrong JSON types in the descriptive fields were TypeErrors/ValueErrors (a traceback-style CLI line),
    # or silently wrong: "notes": "abc" became three notes
    ({"notes": 5}, "notes"),
    ({"notes": "abc"}, "notes"),
    ({"expert_shape": "x"}, "expert_shape"),
    ({"expert_shape": [1, 2]}, "expert_shape"),
    ({"expert_shape": {"expert_bytes": "abc"}}, "expert_shape.expert_bytes"),
])
def test_calibration_rejects_bad_values(bad, match):
    d = Calibration.assumed("cpu").to_dict() | bad
    with pytest.raises(ConfigError, match=match):
        Calibration.from_dict(d)


def test_calibration_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no calibration file"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Calibration.load(tmp_path / "bad.json")
    d = Calibration.assumed("cpu").to_dict()
    del d["step_overhead_ms"]  # added later: older files load, with the quantity labelled assumed
    assert Calibration.from_dict(d).step_overhead_ms.source == "assumed"
    del d["bus_bytes_per_s"]
    with pytest.raises(ConfigError, match="lacks 'bus_bytes_per_s'"):
        Calibration.from_dict(d)


def test_more_resident_is_faster(spec, one_tier):
    cal = cuda_cal()
    times = [predict(spec, place(spec, one_tier, f), "static", cal).ms_per_token for f in (0.0, 0.25, 0.5, 1.0)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1], times
    full = predict(spec, place(spec, one_tier, 1.0), "static", cal)
    assert full.host_experts_ms == 0 and full.fetch_ms == 0 and full.accelerator_hit_rate == 1.0


def test_prediction_parts_add_up_and_are_labelled(spec, one_tier):
    p = predict(spec, place(spec, one_tier, 0.25, "lru"), "lru", cuda_cal())
    assert p.label == "predicted" and p.text().startswith("predicted ")
    assert math.isclose(sum(p.breakdown().values()), p.ms_per_token, rel_tol=1e-9)
    assert p.fetches_per_token == pytest.approx(spec.num_moe_layers * spec.top_k * 0.75)  # uniform: 25 % of slots hit
    assert p.bytes_moved_per_token == pytest.approx(p.fetches_per_token * spec.expert_bytes)
    assert json.loads(json.dumps(p.to_dict()))["label"] == "predicted"


def test_static_vs_lru_follows_bus_and_host(spec, one_tier):
    # Slow bus, fast host: computing misses where they are beats copying them.
    slow_bus = cuda_cal(bus_bytes_per_s=1e9, host_expert_bytes_per_s=1e11)
    static = predict(spec, place(spec, one_tier, 0.25, "top"), "static", slow_bus)
    lru = predict(spec, place(spec, one_tier, 0.25, "lru"), "lru", slow_bus)
    assert static.ms_per_token < lru.ms_per_token
    # Fast bus, slow host: fetching wins.
    fast_bus = cuda_cal(bus_bytes_per_s=1e12, host_expert_bytes_per_s=1e9)
    static = predict(spec, place(spec, one_tier, 0.25, "top"), "static", fast_bus)
    lru = predict(spec, place(spec, one_tier, 0.25, "lru"), "lru", fast_bus)
    assert lru.ms_per_token < static.ms_per_token
    assert choose(spec, one_tier, None, slow_bus, slots={"gpu0": 8})[0] == "static"
    assert choose(spec, one_tier, None, fast_bus, slots={"gpu0": 8})[0] in ("lru", "hybrid")


def test_cpu_accelerator_never_fetches(spec, one_tier):
    # On a CPU "accelerator" host and device are the same cores: a fetch only adds a copy.
    cal = Calibration.assumed("cpu")
    assert hybrid_threshold(cal, spec.expert_bytes, spec.expert_params) == NEVER
    static = predict(spec, place(spec, one_tier, 0.25, "top"), "static", cal)
    lru = predict(spec, place(spec, one_tier, 0.25, "lru"), "lru", cal)
    assert static.ms_per_token < lru.ms_per_token and static.overlap_ms == 0
    hybrid = predict(spec, place(spec, one_tier, 0.25, "mix:4"), "hybrid", cal)
    assert hybrid.fetch_ms == 0  # hybrid acts as static


def test_hybrid_fetches_wide_steps_only(spec, one_tier):
    # Bus slower than the host at one token, so hybrid fetches only when many tokens share an expert.
    cal = cuda_cal(bus_bytes_per_s=5e9, host_expert_bytes_per_s=2e10, host_expert_flops_per_s=5e10)
    n = hybrid_threshold(cal, spec.expert_bytes, spec.expert_params)
    assert 1 < n < NEVER
    pl = place(spec, one_tier, 0.5, "mix:8")
    assert predict(spec, pl, "hybrid", cal, tokens=1).fetch_ms == 0
    assert predict(spec, pl, "hybrid", cal, tokens=64 * n).fetch_ms > 0


def test_profile_and_given_hit_rates(spec, one_tier):
    routes = synthetic_routes(2000, spec.moe_layers, spec.num_experts, spec.top_k, skew=1.5, seed=1)
    profile = Profile.from_routes(routes)
    cal = cuda_cal()
    hot = predict(spec, place(spec, one_tier, 0.25, "top", profile), "static", cal, profile=profile)
    uniform = predict(spec, place(spec, one_tier, 0.25, "top"), "static", cal)
    assert hot.accelerator_hit_rate > uniform.accelerator_hit_rate + 0.1
    assert hot.ms_per_token < uniform.ms_per_token and hot.hit_rate_source.startswith("profile")
    given = predict(spec, place(spec, one_tier, 0.25), "static", cal, hit_rates={"host": 0.4})
    assert given.accelerator_hit_rate == pytest.approx(0.6) and given.hit_rate_source == "given"
    with pytest.raises(ConfigError, match="hit_rates"):
        predict(spec, place(spec, one_tier, 0.25), "static", cal, hit_rates=1.5)


def test_predict_rejects_bad_input(spec, one_tier):
    other = P.from_fraction(ModelSpec.from_hf_config(moe_config(num_experts=16)), one_tier, 0.5)
    with pytest.raises(PlacementError, match="does not fit"):
        predict(spec, other, "static", cuda_cal())
    with pytest.raises(ConfigError, match="policy"):
        predict(spec, place(spec, one_tier, 0.5), "fifo", cuda_cal())
    with pytest.raises(ConfigError, match="tokens"):
        predict(spec, place(spec, one_tier, 0.5), "static", cuda_cal(), tokens=0)


def test_rank_is_sorted_and_full_residency_has_one_candidate(spec, one_tier):
    ranked = rank(spec, one_tier, None, cuda_cal(), slots={"gpu0": 8})
    times = [p.ms_per_token for _, _, p in ranked]
    assert times == sorted(times) and len(ranked) > 3
    assert [(p.policy, p.placement_policy) for _, _, p in rank(spec, one_tier, None, cuda_cal(),
                                                               slots={"gpu0": spec.num_experts})] == [("static", "top")]
    # slots sized from memory by the budget when not given
    policy, placement, pred = choose(spec, one_tier, None, cuda_cal())
    assert policy == "static" and placement.layers[0].slots["gpu0"] == spec.num_experts


def test_policies_threshold_from_calibration(spec, tmp_path, monkeypatch, capsys):
    from moe_offload.engines.offload.experts import policies

    monkeypatch.delenv(policies.CALIBRATION_ENV, raising=False)
    assumed = policies.default_hybrid_threshold(spec.expert_bytes, spec.expert_params, "cuda")
    cal = cuda_cal(bus_bytes_per_s=5e9, host_expert_bytes_per_s=2e10, host_expert_flops_per_s=5e10)
    want = hybrid_threshold(cal, spec.expert_bytes, spec.expert_params)
    assert policies.default_hybrid_threshold(spec.expert_bytes, spec.expert_params, "cuda", cal) == want != assumed
    path = tmp_path / "cal.json"
    cal.save(path)
    monkeypatch.setenv(policies.CALIBRATION_ENV, str(path))
    assert policies.default_hybrid_threshold(spec.expert_bytes, spec.expert_params, "cuda") == want
    # a calibration of another device type is not used: the assumed constants are, and a warning says so
    # (the user gave a calibration: a silent fallback would hide that it had no effect)
    capsys.readouterr()
    assert policies.default_hybrid_threshold(spec.expert_bytes, spec.expert_params, "cpu") == \
        policies.default_hybrid_threshold(spec.expert_bytes, spec.expert_params, "cpu", Calibration.assumed("cuda"))
    err = capsys.readouterr().err
    assert err.count("calibration_not_used") == 2 and "cuda" in err


def _write_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(moe_config()))
    return str(path)


def test_cli_predict_and_plan_auto(tmp_path):
    from moe_offload.cli import main
    from moe_offload.commands.costmodel import predict_cmd

    cfg = _write_config(tmp_path)
    cal = tmp_path / "cal.json"
    cuda_cal(bus_bytes_per_s=1e9, host_expert_bytes_per_s=1e11).save(cal)
    r = CliRunner().invoke(predict_cmd, ["--model", cfg, "--fraction", "0.25", "--calibration", str(cal)])
    assert r.exit_code == 0, r.output
    assert "PREDICTED" in r.output and all(p in r.output for p in ("static", "lru", "hybrid"))
    r = CliRunner().invoke(predict_cmd, ["--model", cfg, "--fraction", "0.25", "--policy", "lru", "--json"])
    data = json.loads(r.output)
    assert data["label"] == "predicted" and [p["policy"] for p in data["predictions"]] == ["lru"]
    assert data["calibration"]["bus_bytes_per_s"]["source"] == "assumed"
    r = CliRunner().invoke(predict_cmd, ["--model", cfg])
    assert r.exit_code != 0 and "--placement FILE or --fraction" in str(r.exception)

    out = tmp_path / "placement.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--model", cfg, "--slots", "8", "--policy", "auto", "--calibration", str(cal), "--out", str(out),
                   "--json"])
    assert rc == 0
    result = json.loads(buf.getvalue().split("\n  wrote")[0])
    assert result["chosen"]["policy"] == "static"  # slow bus, fast host
    assert result["predictions"][0]["ms_per_token"] <= result["predictions"][-1]["ms_per_token"]
    assert json.loads(out.read_text())["policy"] == result["chosen"]["placement_policy"]


def test_calibrate_on_cpu_is_positive_and_finite(tmp_path):
    pytest.importorskip("torch")
    from moe_offload.engines.offload.tools.calibrate import calibrate

    spec = ModelSpec.from_hf_config(moe_config())
    cal = calibrate("cpu", spec, quick=True)
    for name in QUANTITIES:
        q = getattr(cal, name)
        assert q.source == "measured" and math.isfinite(q.value) and (q.value >= 0 if name.endswith("_ms") else q.value > 0), (name, q)
    assert cal.measured and cal.device == "cpu" and cal.when and cal.machine
    assert cal.expert_shape["expert_bytes"] == spec.expert_bytes
    assert Calibration.from_json(cal.to_json()) == cal
    # a measured CPU calibration still predicts a finite time
    p = predict(spec, place(spec, _tiers(), 0.25), "static", cal)
    assert math.isfinite(p.ms_per_token) and p.ms_per_token > 0


def _tiers():
    from rm_core import MemoryTier

    return [MemoryTier("cpu:0", "host-dram", 2**34, accelerator="n/cpu:0", labels={"emulates": "device-hbm"}),
            MemoryTier("host", "host-dram", 2**34)]


def test_disk_tier_reads_follow_the_host_slots(one_tier):
    spec = ModelSpec.from_hf_config(moe_config())
    cal = Calibration.assumed("cpu").with_values(disk_read_bytes_per_s=1e9)
    pl = place(spec, one_tier, 0.0)
    E, K, L, nbytes = spec.num_experts, spec.top_k, spec.num_moe_layers, spec.expert_bytes
    base = predict(spec, pl, "static", cal)
    assert base.disk_ms == 0 and base.host_tier_hit_rate is None
    every = predict(spec, pl, "static", cal, host_slots=E)  # every expert in host memory: nothing read
    assert every.disk_ms == 0 and every.host_tier_hit_rate == 1.0
    assert math.isclose(every.ms_per_token, base.ms_per_token)
    quarter = predict(spec, pl, "static", cal, host_slots=E // 4)  # uniform routing: 1/4 of the asked-for hit
    assert math.isclose(quarter.host_tier_hit_rate, 0.25)
    assert math.isclose(quarter.disk_bytes_per_token, L * K * 0.75 * nbytes)
    assert math.isclose(quarter.disk_ms, 1000 * L * K * 0.75 * nbytes / 1e9)
    assert quarter.ms_per_token > base.ms_per_token and any("disk tier" in a for a in quarter.assumptions)
    given = predict(spec, pl, "static", cal, host_slots=E // 4, host_hit_rate=0.9)  # a measured host hit rate
    assert math.isclose(given.disk_bytes_per_token, L * K * 0.1 * nbytes) and math.isclose(given.host_tier_hit_rate, 0.9)
    slower = predict(spec, pl, "static", cal.with_values(disk_read_bytes_per_s=1e8), host_slots=E // 4)
    assert slower.ms_per_token > quarter.ms_per_token


def test_calibration_files_without_a_disk_rate_still_load():
    d = Calibration.assumed("cpu").to_dict()
    del d["disk_read_bytes_per_s"]
    cal = Calibration.from_dict(d)
    assert cal.value("disk_read_bytes_per_s") == 1e9 and cal.sources()["disk_read_bytes_per_s"] == "assumed"
