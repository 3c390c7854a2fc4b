"""Bad input fails with a one-line user error before any large allocation."""

from __future__ import annotations

import json

import pytest
from offload_helpers import moe_layers, placement

from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.errors import ConfigError, ModelError, PlacementError


def test_missing_shard(checkpoints, tmp_path):
    src = checkpoints("qwen3_moe")
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="missing 2 of 2 safetensors shards"):
        load_model(str(tmp_path), None)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelError, match="not a directory"):
        load_model(str(tmp_path / "nope"), None)
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path), None)


def test_dense_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="dense model"):
        load_model(str(tmp_path), None)


def test_placement_for_another_model(checkpoints):
    path = checkpoints("qwen3_moe")
    layers, n = moe_layers(path)
    with pytest.raises(PlacementError, match=r"covers MoE layers \[0, 1, 2\], expected this model's MoE layers \[0, 1\]"):
        load_model(path, placement([0, 1, 2], n, 0.5, "static"))
    with pytest.raises(PlacementError, match="16 experts, expected this model's 8"):
        load_model(path, placement(layers, 16, 0.5, "static"))


def test_bad_options(checkpoints):
    path = checkpoints("qwen3_moe")
    with pytest.raises(ConfigError, match="policy"):
        load_model(path, None, policy="lfu")
    with pytest.raises(ConfigError, match="hybrid_threshold"):
        load_model(path, None, policy="hybrid", hybrid_threshold=0)
    with pytest.raises(ConfigError, match="device"):
        load_model(path, None, device="tpu")


def test_slots_that_do_not_fit_the_gpu(checkpoints, monkeypatch):
    # The CUDA fit check itself, with the driver's free memory replaced: runs without a GPU.
    import torch
    from transformers import AutoConfig

    from moe_offload.engines.offload.experts import cuda
    from moe_offload.engines.offload.loading import inspection, loader

    path = checkpoints("qwen3_moe")
    experts, dense = inspection.inspect_model(AutoConfig.from_pretrained(path))
    _, _, layout = loader.plan_layers(experts, None, torch.device("cpu"))
    need = sum(i.expert_bytes * i.num_experts for i in experts) + dense
    monkeypatch.setattr(cuda, "free_bytes", lambda dev: need - 1)
    with pytest.raises(PlacementError, match="GiB is free"):
        loader._check_cuda_fit(torch.device("cuda", 0), experts, layout, dense)
    monkeypatch.setattr(cuda, "free_bytes", lambda dev: need)
    loader._check_cuda_fit(torch.device("cuda", 0), experts, layout, dense)
