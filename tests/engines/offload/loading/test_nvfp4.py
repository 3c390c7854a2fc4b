"""ModelOpt NVFP4 releases: experts kept at 4.5 bits (the engine's nvfp4 blocks + a tensor scale per row), the other
linears dequantized; fp32 compute gives transformers' tokens on the same weights dequantized, for two families, every
policy and fraction, and from the disk tier. bf16 compute takes the kernels' 8-bit activations (bounded as for GGUF).

The releases are written, and dequantized for the reference, by modelopt_nvfp4.py: ModelOpt's formula written in the
tests, sharing no code with the engine, and itself checked here against the gguf package's NVFP4 reader."""

from __future__ import annotations

import json
import shutil

import modelopt_nvfp4 as spec
import pytest
import torch
from offload_helpers import greedy, moe_layers, placement
from quant_helpers import assert_activation_rounding_bounded, build_nvfp4, tensor_bytes

from moe_offload.engines.offload.loading import ggml, nvfp4, quant
from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.errors import ModelError

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]
FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    return {f: build_nvfp4(root, f) for f in FAMILIES}


def test_the_spec_reference_reads_e4m3_as_torch_and_nvfp4_as_the_gguf_package():
    # the tests' reference (modelopt_nvfp4.py) against two implementations the project did not write: torch's
    # float8_e4m3fn for every scale byte, llama.cpp's NVFP4 blocks (the gguf package) for codes with their scales
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    b = torch.arange(256, dtype=torch.uint8)
    finite = (b & 0x7F) != 0x7F
    assert torch.equal(spec.e4m3_value(b)[finite], b.view(torch.float8_e4m3fn).float()[finite])
    assert spec.e4m3_value(b)[~finite].isnan().all()
    g = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 256, (8, 128), dtype=torch.uint8, generator=g)  # [R, K/2]: every code
    scale = torch.randint(0, 0x7F, (8, 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)  # positive
    blocks = spec.gguf_blocks(weight, scale).numpy()
    theirs = quants.dequantize(blocks.reshape(8, -1), GGMLQuantizationType.NVFP4)
    assert np.array_equal(spec.dequantize(weight, scale, torch.tensor(1.0)).numpy(), theirs)


def test_blocks_hold_the_release_bytes_and_mean_its_weights():
    w = torch.randn(48, 256) * 0.05
    q, s, g = spec.quantize(w)
    blocks = nvfp4.to_blocks(q, s)
    assert blocks.dtype == ggml.DTYPE and tuple(blocks.shape) == (48, 4, 36)
    assert blocks.numel() == q.numel() + s.numel()  # the same bytes, regrouped
    want = spec.dequantize(q, s, g)
    rows = g.expand(48).contiguous()
    assert torch.equal(quant.dequantize(blocks, rows), want)  # bit for bit: e2m1 * e4m3 exact, * g one rounding
    assert torch.equal(nvfp4.dequantize(q, s, g), want)  # the loader's dense-linear path (checkpoint.py)
    assert (want - w).abs().max() <= 0.25 * w.abs().max()  # and they approximate w (4-bit)


def test_row_scales_multiply_each_row(tmp_path):
    from moe_offload.engines.offload.kernels import dispatch, jit

    assert jit.load(), jit.info()
    ops = torch.ops.moe_offload
    w = ggml.random_blocks(24, 512, "nvfp4", seed=5)
    rows = torch.rand(24) + 0.5
    x = torch.randn(2, 512)
    plain, scaled = ops.gemv_q(x, w, dispatch.NO_SCALE), ops.gemv_q(x, w, rows)
    torch.testing.assert_close(scaled, plain * rows, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="fp32 scale per row"):
        ops.gemv_q(x, w, torch.ones(23))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_tokens_equal_transformers_on_the_dequantized_weights(releases, family):
    from transformers import AutoModelForCausalLM

    path, ref_path = releases[family]
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    ref_tokens, ref_logits = greedy(ref, PROMPT, 16)
    layers, num_experts = moe_layers(path)
    for policy in ("static", "lru", "hybrid"):
        for fraction in (0.0, 0.5, 1.0):
            om = load_model(path, placement(layers, num_experts, fraction, policy), policy=policy, dtype="float32",
                            hybrid_threshold=2 if policy == "hybrid" else None)
            assert om.executor.layers[0].store.format == "nvfp4"
            tokens, logits = greedy(om.model, PROMPT, 16)
            assert tokens == ref_tokens, (family, policy, fraction)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=5e-5, msg=f"{family} {policy} {fraction}")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_activation_rounding_is_bounded(releases, family):
    path, ref_path = releases[family]
    base = load_model(ref_path, None, dtype="bfloat16")
    assert_activation_rounding_bounded(base, load_model(path, None, dtype="bfloat16"), PROMPT, 32, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_prices_the_release_and_the_store(releases, family):
    from moe_offload.control.spec import ModelSpec

    path, _ = releases[family]
    spec = ModelSpec.from_hf_config(path)
    assert spec.checkpoint_expert_format == "nvfp4"
    assert abs(spec.checkpoint_bytes - tensor_bytes(path)) <= 0.01 * tensor_bytes(path)
    assert spec.checkpoint_bytes == tensor_bytes(path)  # every tensor counted, exactly, on these files
    om = load_model(path, None)
    assert sum(s.store.nbytes for s in om.executor.layers) == spec.routed_expert_bytes
    assert om.executor.layers[0].store.expert_bytes == spec.expert_bytes


def test_disk_tier_runs_the_release(releases, tmp_path, monkeypatch):
    from moe_offload.engines.offload.loading.convert import convert_checkpoint

    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    path, ref_path = releases["qwen3_moe"]
    from transformers import AutoModelForCausalLM

    ref_tokens, _ = greedy(AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval(), PROMPT, 12)
    man, written = convert_checkpoint(path, "float32")
    assert written and man.fmt == "nvfp4" and not man.in_place  # regrouped: a copy, priced before it is written
    layers, num_experts = moe_layers(path)
    full = load_model(path, None, dtype="float32", host_cache=10**12)
    record = sum(s.store.entry.record_bytes for s in full.executor.layers)  # one host slot in every MoE layer
    full.executor.close()
    for policy in ("static", "lru"):
        om = load_model(path, placement(layers, num_experts, 0.25, policy), policy=policy, dtype="float32",
                        host_cache=record * 5)  # 2 pinned + top-2 + 1 of 8 experts in host memory: misses read disk
        tokens, _ = greedy(om.model, PROMPT, 12)
        assert tokens == ref_tokens, policy
        d = om.executor.stats.snapshot()["disk"]
        assert d["demand_reads"] > 0 and d["disk_bytes"] > 0, (policy, d)  # the misses were read from the store
        om.executor.close()


def test_other_modelopt_algorithms_are_refused_with_one_line(releases, tmp_path):
    path, _ = releases["mixtral"]
    bad = tmp_path / "mixed"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "MIXED_PRECISION"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="MIXED_PRECISION"):
        load_model(str(bad), None, dtype="float32")
    from moe_offload.control.spec import ModelSpec

    with pytest.raises(ModelError, match="NVFP4"):
        ModelSpec.from_hf_config(str(bad))
