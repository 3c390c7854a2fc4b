"""ModelSpec's parameter counts against the tensors transformers itself builds, for every family we name.

Models are built on the meta device (no memory, no weights): what is compared is
the parameter count of each component and the MoE layer layout.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moe_offload.control.spec import ModelSpec  # noqa: E402

SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
             intermediate_size=96, moe_intermediate_size=32)
FAMILIES = {
    "mixtral": {},
    "qwen2_moe": {"shared_expert_intermediate_size": 48, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    "qwen3_moe": {"mlp_only_layers": [0]},
    "olmoe": {},
    "deepseek_v2": {"first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 2, "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
    "deepseek_v3": {"first_k_dense_replace": 2, "n_routed_experts": 16, "num_experts_per_tok": 4, "q_lora_rank": 24,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_group": 4, "topk_group": 2},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16},
    "solar_open": {"n_routed_experts": 8, "head_dim": 16},
    "glm4_moe": {"first_k_dense_replace": 1, "n_routed_experts": 8, "attention_bias": True, "use_qk_norm": True},
    "granitemoe": {},
    "phimoe": {},
    "ernie4_5_moe": {"moe_num_experts": 8, "moe_k": 2},
    "minimax": {},
}

NO_MOE_INTERMEDIATE = {"mixtral", "olmoe", "gpt_oss", "granitemoe", "phimoe", "minimax"}


def _count_hf(model) -> int:
    # Parameters plus the routing-correction buffers that checkpoints store (DeepSeek-V3's
    # e_score_correction_bias); MiniMax's decay buffers are recomputed at load, not weights.
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return n


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_counts_match_transformers(family):
    small = dict(SMALL)
    if family in NO_MOE_INTERMEDIATE:  # these size experts by intermediate_size; a stray key would mislead
        small.pop("moe_intermediate_size")
    cfg = transformers.AutoConfig.for_model(family, **{**small, **FAMILIES[family]})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    routed = sum(p.numel() for _, p in experts)
    moe_layers = sorted({int(n.split(".layers.")[1].split(".")[0]) for n, _ in experts})
    assert spec.moe_layers == tuple(moe_layers)
    assert spec.routed_expert_params == routed
    assert spec.total_params == _count_hf(model), spec.summary()
