"""ModelSpec against what model publishers state: totals within 1 %, active parameters too.

The configs are the public config.json values of each checkpoint (the keys that matter).
Publishers round active counts to two significant figures (3.3B, 37B), which alone is up
to 1.5 %; active counts are therefore checked within 2 %.
"""

import pytest

from moe_offload.control.spec import ModelSpec
from moe_offload.errors import ConfigError, ModelError

MIXTRAL_8X7B = {
    "model_type": "mixtral", "_name_or_path": "mistralai/Mixtral-8x7B-v0.1", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False, "sliding_window": None,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "_name_or_path": "deepseek-ai/DeepSeek-V3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "_name_or_path": "Qwen/Qwen3-30B-A3B", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "torch_dtype": "bfloat16",
}
GPT_OSS_120B = {
    "model_type": "gpt_oss", "_name_or_path": "openai/gpt-oss-120b", "num_hidden_layers": 36, "num_local_experts": 128,
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128, "tie_word_embeddings": False, "experts_per_token": 4,
    "num_experts_per_tok": 4, "attention_bias": True, "swiglu_limit": 7.0, "torch_dtype": "bfloat16",
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
OLMOE_1B_7B = {
    "model_type": "olmoe", "_name_or_path": "allenai/OLMoE-1B-7B-0924", "vocab_size": 50304, "hidden_size": 2048,
    "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "tie_word_embeddings": False,
    "clip_qkv": None, "torch_dtype": "bfloat16",
}

# config, published total, published active, how the publisher counts active parameters
PUBLISHED = {
    "mixtral-8x7b": (MIXTRAL_8X7B, 46.7e9, 12.9e9, "with embeddings"),
    "deepseek-v3": (DEEPSEEK_V3, 671e9, 37e9, "with embeddings"),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 30.5e9, 3.3e9, "with embeddings"),
    # OpenAI's gpt-oss model card counts the unembedding but not the embedding table as active.
    "gpt-oss-120b": (GPT_OSS_120B, 116.8e9, 5.1e9, "without the embedding table"),
    "olmoe-1b-7b": (OLMOE_1B_7B, 6.9e9, 1.3e9, "with embeddings"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_params_within_one_percent(name):
    cfg, total, _, _ = PUBLISHED[name]
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.total_params == pytest.approx(total, rel=0.01), f"{name}: {spec.total_params / 1e9:.2f}B"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_active_params_as_published(name):
    cfg, _, active, convention = PUBLISHED[name]
    spec = ModelSpec.from_hf_config(cfg)
    got = spec.active_params - (spec.embedding_params if convention == "without the embedding table" else 0)
    assert got == pytest.approx(active, rel=0.02), f"{name}: {got / 1e9:.3f}B"


def test_shapes_of_the_published_models():
    ds = ModelSpec.from_hf_config(DEEPSEEK_V3)
    assert ds.moe_layers == tuple(range(3, 61)) and ds.num_moe_layers == 58
    assert (ds.num_experts, ds.top_k, ds.num_shared_experts) == (256, 8, 1)
    # FP8 release: e4m3 weights plus an fp32 scale per 128x128 block (gate, up and down: 16 x 56 blocks each)
    assert ds.expert_format == "fp8" and ds.expert_bytes == 3 * 7168 * 2048 + 3 * 16 * 56 * 4
    assert ds.with_expert_dtype("bf16").expert_bytes == 3 * 7168 * 2048 * 2
    # MLA caches the 512-wide latent plus the 64-wide rope key: 576 bf16 values per layer and token.
    assert ds.kv_bytes_per_token == 61 * 576 * 2
    oss = ModelSpec.from_hf_config(GPT_OSS_120B)
    assert oss.quantization == "mxfp4" and oss.expert_bias and oss.router_bias
    assert oss.layer_types.count("sliding_attention") == 18
    per_layer = 2 * 8 * 64 * 2
    assert oss.kv_bytes_per_token == 36 * per_layer
    # at 8192 tokens the 18 sliding layers keep only their 128-token window
    assert oss.kv_cache_bytes(8192) == 18 * per_layer * 8192 + 18 * per_layer * 128
    mx = ModelSpec.from_hf_config(MIXTRAL_8X7B)
    assert mx.expert_bytes == 3 * 4096 * 14336 * 2 and mx.moe_layers == tuple(range(32))
    q = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    assert q.name == "Qwen/Qwen3-30B-A3B" and q.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2


def test_dense_config_is_a_clear_error():
    dense = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 100}
    with pytest.raises(ModelError, match="not a routed MoE model: no num_experts / n_routed_experts / num_local_experts"):
        ModelSpec.from_hf_config(dense)


def test_missing_key_is_named():
    cfg = dict(MIXTRAL_8X7B)
    del cfg["hidden_size"]
    with pytest.raises(ModelError, match="lacks 'hidden_size'"):
        ModelSpec.from_hf_config(cfg)
    cfg = dict(MIXTRAL_8X7B)
    del cfg["num_experts_per_tok"]
    with pytest.raises(ModelError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config(cfg)


def test_reads_directory_and_file(tmp_path):
    import json

    d = tmp_path / "Mixtral-8x7B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in MIXTRAL_8X7B.items() if k != "_name_or_path"}))
    assert ModelSpec.from_hf_config(d).name == "Mixtral-8x7B"
    assert ModelSpec.from_hf_config(d / "config.json").total_params == ModelSpec.from_hf_config(MIXTRAL_8X7B).total_params


GPT_OSS_20B = {**GPT_OSS_120B, "_name_or_path": "openai/gpt-oss-20b", "num_hidden_layers": 24, "num_local_experts": 32,
               "layer_types": ["sliding_attention", "full_attention"] * 12}


@pytest.mark.parametrize("cfg,gib", [(GPT_OSS_120B, 60.8), (GPT_OSS_20B, 12.8)])
def test_gpt_oss_checkpoint_sizes_from_the_config_alone(cfg, gib):
    # the model card's sizes: MXFP4 experts (two weights per byte + an E8M0 scale per 32), everything else bf16
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.expert_format == "mxfp4" and spec.checkpoint_expert_format == "mxfp4"
    assert spec.checkpoint_bytes / 2**30 == pytest.approx(gib, rel=0.03)
    assert spec.total_bytes == spec.checkpoint_bytes  # held as shipped: nothing is dequantized
    H = I = 2880
    assert spec.expert_bytes == 3 * H * I // 2 + 3 * H * I // 32 + (2 * I + H) * 2


def test_expert_dtype_prices_the_format():
    mx = ModelSpec.from_hf_config(MIXTRAL_8X7B)
    H, I = 4096, 14336
    assert mx.expert_bytes == 3 * H * I * 2
    q8 = mx.with_expert_dtype("int8")
    assert q8.expert_bytes == 3 * H * I + 4 * (2 * I + H)  # one fp32 scale per output row
    assert q8.routed_expert_bytes == 32 * 8 * q8.expert_bytes and q8.checkpoint_bytes == mx.checkpoint_bytes
    assert q8.total_bytes == mx.non_expert_bytes + q8.routed_expert_bytes
    f8 = mx.with_expert_dtype("fp8")
    assert f8.expert_bytes == 3 * H * I + 4 * (2 * 112 * 32 + 32 * 112)  # gate and up blocks kept apart
    assert mx.with_expert_dtype(None) is mx and mx.with_expert_dtype("bf16").expert_bytes == mx.expert_bytes
    oss = ModelSpec.from_hf_config(GPT_OSS_120B)
    assert oss.with_expert_dtype("bf16").expert_bytes == oss.expert_params * 2
    with pytest.raises(ConfigError, match="this checkpoint's experts are mxfp4; expected bf16"):
        oss.with_expert_dtype("int8")
    q4 = mx.with_expert_dtype("int4")  # q4_0 blocks: an fp16 scale per 32 weights
    assert q4.expert_bytes == 3 * H * I // 32 * 18
    with pytest.raises(ConfigError, match="expected one of int8, fp8, int4, bf16"):
        mx.with_expert_dtype("q4")


def test_unsupported_quantization_is_named():
    # symmetric 4-bit GPTQ is held as q4_0 blocks; what the loader refuses, spec refuses with the same line
    gptq = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert gptq.expert_format == "q4_0" and gptq.expert_bytes == 3 * 4096 * 14336 // 32 * 18
    # AWQ (a zero point per group) as q4_z blocks: 19 bytes per 32 weights
    awq = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "awq", "bits": 4,
                                                                            "group_size": 128, "version": "gemm"}})
    assert awq.expert_format == "q4_z" and awq.expert_bytes == 3 * 4096 * 14336 // 32 * 19
    with pytest.raises(ModelError, match="quant_method 'hqq' is not supported"):
        ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "hqq", "bits": 4}})
    with pytest.raises(ModelError, match="AWQ with bits=4 zero_point=True version='gemv'"):
        ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "awq", "bits": 4,
                                                                            "version": "gemv"}})
    zp = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "gptq", "bits": 4, "sym": False}})
    assert zp.expert_format == "q4_z"  # zero points: q4_z blocks
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    for sym, fmt in ((None, "q4_0"), (True, "q4_0"), (False, "q4_z")):  # symmetric defaults to true in the format
        w = dict(ct["config_groups"]["g"]["weights"], **({} if sym is None else {"symmetric": sym}))
        spec = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": dict(ct, config_groups={"g": {
            "weights": w}})})
        assert spec.expert_format == fmt, sym
    # act-order: each projection keeps its int32 input order beside its blocks (4 bytes per input feature)
    act = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                           "desc_act": True}})
    assert act.act_order and act.expert_bytes == 3 * 4096 * 14336 // 32 * 18 + 4 * (4096 + 14336)
    static = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "desc_act": True, "static_groups": True}})  # groups stay consecutive
    assert not static.act_order and static.expert_bytes == 3 * 4096 * 14336 // 32 * 18
    assert act.with_expert_dtype("bf16").expert_bytes == 3 * 4096 * 14336 * 2  # dequantized: no orders kept
    with pytest.raises(ModelError, match="GPTQ with bits=4 checkpoint_format='gptq_v2'"):
        ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                           "checkpoint_format": "gptq_v2"}})
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float"}}}}
    with pytest.raises(ModelError, match="compressed-tensors 'float-quantized'"):
        ModelSpec.from_hf_config({**MIXTRAL_8X7B, "quantization_config": fp8})


def test_a_budget_buys_slots_by_stored_bytes():
    # an 80 GiB accelerator: gpt-oss-120b's MXFP4 experts fit several times more slots than bf16 ones would
    from moe_offload.control.budget import plan_budget

    oss = ModelSpec.from_hf_config(GPT_OSS_120B)
    mxfp4 = plan_budget(oss, ["40GiB"], context=4096).accelerators[0]
    bf16 = plan_budget(oss.with_expert_dtype("bf16"), ["40GiB"], context=4096).accelerators[0]
    assert mxfp4.slots == mxfp4.free_bytes // (oss.expert_bytes * 36)
    assert bf16.slots == bf16.free_bytes // (oss.expert_params * 2 * 36)
    assert mxfp4.slots > 3 * bf16.slots > 0


def test_spec_and_budget_commands_show_stored_bytes(tmp_path, capsys):
    import json

    from moe_offload.cli import main

    cfg = tmp_path / "gpt-oss-120b" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(GPT_OSS_120B))
    assert main(["spec", "--model", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "experts held as      mxfp4\n" in out and "checkpoint           60.77 GiB (as stored: experts mxfp4)" in out
    assert main(["spec", "--model", str(cfg), "--expert-dtype", "bf16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["expert_format"] == "bfloat16" and data["checkpoint_expert_format"] == "mxfp4"
    assert data["expert_bytes"] == ModelSpec.from_hf_config(GPT_OSS_120B).expert_params * 2
    assert main(["budget", "--model", str(cfg), "--accelerator", "40GiB", "--json"]) == 0
    mx = json.loads(capsys.readouterr().out)
    assert main(["budget", "--model", str(cfg), "--accelerator", "40GiB", "--expert-dtype", "bf16", "--json"]) == 0
    bf = json.loads(capsys.readouterr().out)
    assert mx["accelerators"][0]["slots_per_layer"] > 3 * bf["accelerators"][0]["slots_per_layer"]
    assert main(["plan", "--model", str(cfg), "--fraction", "0.1", "--expert-dtype", "int8"]) != 0  # refused for mxfp4
    assert "this checkpoint's experts are mxfp4" in capsys.readouterr().err
