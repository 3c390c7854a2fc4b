"""The tiny gpt-oss MXFP4 and DeepSeek-V3 FP8 releases through `generate`, the ai-rm runner (decode and serve) and
--expert-dtype on the command line: the host store holds the checkpoint's expert bytes (the releases' own dtype,
bf16, so byte for byte; the acceptance allows 2 %)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from quant_helpers import tensor_bytes

from moe_offload.cli import main
from rm_core import ContractError, Workload, registry

RELEASES = ("gpt_oss_mxfp4", "deepseek_v3_fp8")


def _loaded_events(text: str) -> list[dict]:
    """The loader's experts_loaded log events (JSON lines on stderr)."""
    out = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "experts_loaded":
            out.append(event)
    return out


def _check_store(summary: dict, path: str, fmt: str) -> None:
    stored = tensor_bytes(path, expert_only=True)
    assert summary["expert_format"] == fmt
    assert abs(summary["host_store_bytes"] - stored) <= 0.02 * stored, (summary, stored)


@pytest.mark.parametrize("name", RELEASES)
def test_generate(quantized_checkpoints, name, capsys):
    path = quantized_checkpoints(name)
    rc = main(["generate", "--model", path, "--prompt", "The river runs", "--max-tokens", "5", "--ignore-eos",
               "--fraction", "0.25", "--policy", "lru", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    data = json.loads(out)
    assert len(data["token_ids"]) == 5 and data["stats"]["completion_tokens"] == 5
    _check_store(data["experts"], path, name.rsplit("_", 1)[1])
    assert data["stats"]["bytes_moved"]["cpu:0"] % data["experts"]["expert_bytes"] == 0  # whole stored experts


def test_generate_expert_dtype_int8(checkpoints, demo_model_dir, capsys):
    rc = main(["generate", "--model", str(demo_model_dir), "--prompt", "hello", "--max-tokens", "3", "--ignore-eos",
               "--expert-dtype", "int8", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    experts = json.loads(out)["experts"]
    from moe_offload.control.spec import ModelSpec

    spec = ModelSpec.from_hf_config(str(demo_model_dir))
    assert experts["expert_format"] == "int8"
    # the demo is an fp32 checkpoint: int8 weights + an fp32 scale per row instead of 4 bytes per weight
    assert experts["host_store_bytes"] == spec.with_expert_dtype("int8").routed_expert_bytes < spec.routed_expert_bytes / 3


def test_generate_refuses_a_bad_expert_dtype(quantized_checkpoints, capsys):
    rc = main(["generate", "--model", quantized_checkpoints("gpt_oss_mxfp4"), "--prompt", "hi", "--max-tokens", "2",
               "--expert-dtype", "int8"])
    _, err = capsys.readouterr()
    assert rc != 0 and "this checkpoint's experts are mxfp4; expected bf16" in err and err.count("\n") == 1


@pytest.mark.parametrize("name", RELEASES)
def test_airm_decode_and_serve(quantized_checkpoints, name, capsys):
    path = quantized_checkpoints(name)
    runner = registry.load("airm.workloads", "npu-offload")
    ms = runner(Workload("decode"), backend="cpu", model=path, max_new=4, fraction=0.5, policy="static")
    assert {m.name for m in ms} >= {"airm_tok_s", "moe_offload_expert_hit_rate"}
    handle = runner(Workload("serve"), backend="cpu", model=path, port=0, block=False, fraction=0.5)
    try:
        # served as the directory name; ignore_eos: the API's default temperature 1 samples, and a tiny random model
        # can draw EOS first (seen once in CI: 0 completion tokens)
        body = json.dumps({"model": name, "prompt": "The river", "max_tokens": 4, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{handle.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] >= 1
    finally:
        handle.stop()
    events = _loaded_events(capsys.readouterr().err)
    assert len(events) == 2  # one load per workload
    for event in events:
        assert event["checkpoint_format"] == name.rsplit("_", 1)[1]
        _check_store(event, path, event["checkpoint_format"])


def test_runner_config_key():
    from moe_offload.airm.config import RunConfig
    from moe_offload.backends import engine_options

    assert RunConfig.parse({"expert_dtype": "int8"}).expert_dtype == "int8"
    with pytest.raises(ContractError, match="config.expert_dtype"):
        RunConfig.parse({"expert_dtype": "int2"})
    assert engine_options("cpu", expert_dtype="fp8") == {"expert_dtype": "fp8"}
    assert "expert_dtype" not in engine_options("mock", expert_dtype="fp8")


def test_dense_dtype_key_and_options():
    from moe_offload.airm.config import RunConfig
    from moe_offload.backends import engine_options

    assert RunConfig.parse({"dense_dtype": "int8"}).dense_dtype == "int8"
    with pytest.raises(ContractError, match="config.dense_dtype"):
        RunConfig.parse({"dense_dtype": "fp8"})
    assert engine_options("cpu", expert_dtype="int8", dense_dtype="int8") == {"expert_dtype": "int8", "dense_dtype": "int8"}
    assert "dense_dtype" not in engine_options("mock", dense_dtype="int8")


def test_generate_dense_dtype_int8_needs_bf16(demo_model_dir, capsys):
    rc = main(["generate", "--model", str(demo_model_dir), "--prompt", "hello", "--max-tokens", "2",
               "--dense-dtype", "int8"])  # the demo checkpoint computes in fp32
    _, err = capsys.readouterr()
    assert rc != 0 and "dense_dtype int8: needs bf16 compute on the cpu" in err and err.count("\n") == 1
    rc = main(["generate", "--model", str(demo_model_dir), "--prompt", "hello", "--max-tokens", "3", "--ignore-eos",
               "--dtype", "bfloat16", "--expert-dtype", "int8", "--dense-dtype", "int8", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 3
