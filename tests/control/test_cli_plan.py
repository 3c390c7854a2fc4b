"""`moe-offload spec | budget | plan` through cli.main: output, files, and one-line errors."""

import json

import pytest

from moe_offload.cli import main
from moe_offload.control.profile import save_routes, synthetic_routes

from .conftest import moe_config


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny-moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(moe_config()))
    return d


@pytest.fixture
def routes_file(tmp_path, model_dir):
    r = synthetic_routes(300, tuple(range(8)), 32, 4, skew=1.2, seed=0, model="tiny-moe")
    path = tmp_path / "routes.safetensors"
    save_routes(path, r)
    return path


def _one_error_line(capsys, argv, match):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert match in err, err
    return err


def test_spec_text_and_json(capsys, model_dir):
    assert main(["spec", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "32 routed, top-4" in out and "parameters" in out
    assert main(["spec", "--model", str(model_dir / "config.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_experts"] == 32 and data["moe_layers"] == list(range(8)) and data["total_params"] > 0
    # the decode path the registry gives this family (control/families.py), said in the text and the JSON
    assert data["decode_path"] == "fused" and "qwen3_moe" in data["decode_path_reason"]
    assert "decode path" in out and "fused (the registry's qwen3_moe entry" in out


def test_spec_says_why_an_unregistered_family_takes_the_module_path(capsys, tmp_path):
    d = tmp_path / "phimoe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**moe_config(), "model_type": "phimoe"}))
    assert main(["spec", "--model", str(d), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decode_path"] == "module" and "not in the registry" in data["decode_path_reason"]


def test_spec_says_which_families_decode_on_the_owned_graph(capsys, tmp_path):
    # a part the fused call lacks, known from the config (Hunyuan's q/k norms after the rotary): the graph decodes, and
    # spec says why; Granite's multipliers and GraniteMoeShared's shared MLP beside the router are the fused call's
    paths = {}
    for model_type, extra in (("hunyuan_v1_moe", {"moe_topk": 4}), ("granitemoeshared", {"shared_intermediate_size": 64}),
                              ("granitemoe", {})):
        d = tmp_path / model_type
        d.mkdir()
        cfg = {**moe_config(), "model_type": model_type, "num_local_experts": 32, "embedding_multiplier": 12.0,
               "residual_multiplier": 0.22, "logits_scaling": 6.0, **extra}
        (d / "config.json").write_text(json.dumps(cfg))
        assert main(["spec", "--model", str(d), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        paths[model_type] = (data["decode_path"], data["decode_path_reason"])
    assert paths["hunyuan_v1_moe"][0] == "graph" and "after the rotary" in paths["hunyuan_v1_moe"][1], paths
    assert paths["granitemoeshared"][0] == paths["granitemoe"][0] == "fused", paths


def test_budget_json(capsys, model_dir):
    assert main(["budget", "--model", str(model_dir), "--accelerator", "64MiB", "--accelerator", "64MiB",
                 "--context", "128", "--reserve", "1MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [a["tier"] for a in data["accelerators"]] == ["accel:0", "accel:1"]
    assert data["accelerators"][0]["slots_per_layer"] >= 4


def test_plan_writes_placement(capsys, tmp_path, model_dir, routes_file):
    out = tmp_path / "placement.json"
    assert main(["plan", "--model", str(model_dir), "--profile", str(routes_file), "--slots", "8,4", "--policy", "global",
                 "--out", str(out), "--simulate"]) == 0
    text = capsys.readouterr().out
    assert "predicted hit rate: accel:0" in text and "replayed hit rate" in text
    assert "(misses, on host:" in text  # the host's share is not shown as a hit rate
    from rm_core import Placement

    p = Placement.from_json(out.read_text())
    assert p.policy == "global" and p.profile == str(routes_file)
    assert sum(lp.slots["accel:0"] for lp in p.layers) == 64
    assert main(["plan", "--model", str(model_dir), "--profile", str(routes_file), "--fraction", "0.25", "--policy", "mix:4",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["placement"]["layers"][0]["slots"] == {"accel:0": 8}
    assert main(["plan", "--model", str(model_dir), "--budget", "64MiB", "--policy", "lru"]) == 0


def test_plan_across_three_tiers(capsys, tmp_path, model_dir, routes_file):
    # --host-memory: host memory pins the next-hottest experts, the rest go to the disk tier (the expert store)
    from moe_offload.control.spec import ModelSpec

    spec = ModelSpec.from_hf_config(str(model_dir))
    record = -(-spec.expert_bytes // 4096) * 4096
    host = record * spec.num_moe_layers * 12  # 12 host slots per layer
    out = tmp_path / "placement.json"
    assert main(["plan", "--model", str(model_dir), "--profile", str(routes_file), "--slots", "8", "--host-memory",
                 str(host), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "host: 12 expert slots per layer" in text and f"disk: {(32 - 8 - (12 - 4)) * 8} experts in the expert store" in text
    assert "(misses, on disk:" in text
    from rm_core import Placement

    p = Placement.from_json(out.read_text())
    assert [t.kind for t in p.tiers][-1] == "disk"
    assert all(len(lp.pinned("host")) == 12 - 4 and lp.slots["host"] == 12 for lp in p.layers)
    assert sum(p.predicted_hit_rate.values()) == pytest.approx(1.0) and p.predicted_hit_rate["host"] > 0
    _one_error_line(capsys, ["plan", "--model", str(model_dir), "--slots", "8", "--host-memory", str(record)],
                    "at least top-k (4)")
    _one_error_line(capsys, ["plan", "--model", str(model_dir), "--slots", "8", "--host-memory", str(host),
                             "--policy", "auto"], "not auto")


def test_bad_inputs_exit_with_one_line(capsys, tmp_path, model_dir, routes_file):
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    _one_error_line(capsys, ["spec", "--model", str(dense)], "not a routed MoE model")
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"model_type": "mixtral", "hidden_size": ')
    _one_error_line(capsys, ["spec", "--model", str(garbled)], "not valid JSON")
    _one_error_line(capsys, ["plan", "--model", str(model_dir), "--slots", "40"], "slots=40 exceeds experts per layer (32)")
    _one_error_line(capsys, ["budget", "--model", str(model_dir), "--accelerator", "-4GiB"], "expected a size >= 0")
    other = tmp_path / "other.safetensors"
    save_routes(other, synthetic_routes(20, tuple(range(8)), 64, 4, model="big-moe"))
    _one_error_line(capsys, ["plan", "--model", str(model_dir), "--profile", str(other), "--slots", "4"],
                    "profile of big-moe (8 MoE layers x 64 experts) does not fit tiny-moe")
    _one_error_line(capsys, ["plan", "--model", str(model_dir), "--slots", "4", "--policy", "best"], "policy")
    _one_error_line(capsys, ["plan", "--model", str(model_dir)], "--slots")
    _one_error_line(capsys, ["spec", "--model", str(tmp_path / "missing")], "no config.json")


def test_control_plane_imports_neither_torch_nor_numpy():
    import subprocess
    import sys

    code = ("import sys, moe_offload.control.spec, moe_offload.control.profile, moe_offload.control.placement, moe_offload.control.budget, "
            "moe_offload.commands.plan; print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_plan_shows_the_host_memory_split_weights_first(capsys, tmp_path, model_dir):
    # --backend cpu: this machine's host tier holds the dense weights, the experts and the KV budget they leave
    from moe_offload.control.spec import ModelSpec

    spec = ModelSpec.from_hf_config(str(model_dir))
    assert main(["plan", "--model", str(model_dir), "--backend", "cpu", "--fraction", "0.5", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["experts_tier"] == "host" and mem["experts_bytes"] == spec.routed_expert_bytes
    assert mem["dense_bytes"] == spec.non_expert_bytes and 0 < mem["kv_bytes"] <= 4 << 30
    assert main(["plan", "--model", str(model_dir), "--backend", "cpu", "--fraction", "0.5"]) == 0
    assert "host memory: weights first: every expert fits" in capsys.readouterr().out
    # a hardware profile (a GPU host: dense weights and KV on the device): its host tier, less the stated 1 GiB
    # reserve, holds half the experts -> the rest on the disk tier; below the reserve, the shortfall is stated, and
    # planning for that machine still answers (rc 0)
    import dataclasses

    from moe_offload.control.hardware import load_hardware
    from moe_offload.hostmem import RESERVE

    hw = load_hardware("h100-pcie")
    for host, want in ((RESERVE + spec.routed_expert_bytes // 2, "disk"), (RESERVE // 2, "short")):
        f = tmp_path / f"host-{host}.json"
        f.write_text(json.dumps(dataclasses.replace(hw, host_memory_bytes=host).to_dict()))
        assert main(["plan", "--model", str(model_dir), "--hardware", str(f), "--json"]) == 0
        mem = json.loads(capsys.readouterr().out)["memory"]
        if want == "disk":
            assert mem["experts_tier"] == "disk" and mem["experts_bytes"] == spec.routed_expert_bytes // 2
            assert mem["dense_bytes"] == 0 and mem["kv_bytes"] == 0
        else:
            assert "0.50 GiB short" in mem["error"]


def test_spec_and_plan_state_the_disk_the_disk_tier_needs(capsys, model_dir, monkeypatch, tmp_path):
    # experts kept as shipped: read in place, no copy; --expert-dtype int8 re-lays them out: a copy of every expert
    # (records padded to 4 KiB), set against the free space of the store's disk
    from moe_offload.control.spec import ModelSpec

    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    spec = ModelSpec.from_hf_config(str(model_dir))
    assert spec.disk_in_place and spec.disk_copy_bytes == 0
    int8 = spec.with_expert_dtype("int8")
    assert not int8.disk_in_place
    assert int8.disk_copy_bytes == spec.num_moe_layers * spec.num_experts * -(-int8.expert_bytes // 4096) * 4096
    host = ["--host-memory", str(spec.routed_expert_bytes // 4)]
    assert main(["plan", "--model", str(model_dir), "--slots", "8", *host, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disk"] == {"in_place": True, "store_bytes": 0,
                                                          "reason": "reads the checkpoint's expert tensors in place (no copy)"}
    assert main(["plan", "--model", str(model_dir), "--slots", "8", *host, "--expert-dtype", "int8"]) == 0
    assert f"disk: an expert store copy of {int8.disk_copy_bytes / 2**30:.2f} GiB" in capsys.readouterr().out
    from moe_offload import hostmem

    monkeypatch.setattr(hostmem, "disk_free", lambda path=None: (1, "/small"))
    assert main(["plan", "--model", str(model_dir), "--slots", "8", *host, "--expert-dtype", "int8", "--json"]) == 0
    disk = json.loads(capsys.readouterr().out)["disk"]
    assert disk["short"] is True and "the engine will refuse it" in disk["reason"]
    assert main(["spec", "--model", str(model_dir)]) == 0
    assert "in place (no copy)" in capsys.readouterr().out
