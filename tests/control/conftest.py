"""Control-plane fixtures: small specs, tiers and synthetic routes (no torch)."""

import pytest

from moe_offload.control.spec import ModelSpec
from rm_core import MemoryTier


def moe_config(**over):
    cfg = dict(model_type="qwen3_moe", _name_or_path="tiny-moe", hidden_size=64, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100, intermediate_size=128,
               moe_intermediate_size=32, num_experts=32, num_experts_per_tok=4, torch_dtype="bfloat16")
    cfg.update(over)
    return cfg


@pytest.fixture
def spec():
    return ModelSpec.from_hf_config(moe_config())


@pytest.fixture
def tiers():
    return [
        MemoryTier("npu0", "device-hbm", 2**30, accelerator="node/furiosa:0"),
        MemoryTier("npu1", "device-hbm", 2**30, accelerator="node/furiosa:1"),
        MemoryTier("host", "host-dram", 2**34),
    ]


@pytest.fixture
def one_tier():
    return [MemoryTier("gpu0", "device-hbm", 2**30, accelerator="node/nvidia:0"), MemoryTier("host", "host-dram", 2**34)]
