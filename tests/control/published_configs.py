"""config.json of published MoE checkpoints whose layers go beyond attention + MoE: sparse (indexed) attention,
linear attention (Gated DeltaNet, Kimi Delta Attention), Mamba and Mamba-2 hybrids, a vision tower.

Written from the files the publishers ship on the Hugging Face Hub (the keys that shape the model; tokenizer ids,
dropout and training-only keys are left out where they change nothing). The tests compare what ModelSpec makes of
each with what transformers instantiates from the very same dict, so the check holds whatever the copy's fidelity.
"""

DEEPSEEK_V32 = {
    "_name_or_path": "deepseek-ai/DeepSeek-V3.2", "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "attention_bias": False, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
    "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
GLM_45 = {
    "_name_or_path": "zai-org/GLM-4.5", "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "attention_bias": True, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
    "intermediate_size": 12288, "max_position_embeddings": 131072, "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_qk_norm": True,
    "vocab_size": 151552, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
}
GLM_46 = {**GLM_45, "_name_or_path": "zai-org/GLM-4.6", "max_position_embeddings": 202752}
QWEN3_NEXT_80B = {
    "_name_or_path": "Qwen/Qwen3-Next-80B-A3B-Instruct", "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next", "attention_bias": False, "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3_VL_30B_A3B = {
    "_name_or_path": "Qwen/Qwen3-VL-30B-A3B-Instruct", "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe", "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_moe_text", "attention_bias": False, "decoder_sparse_step": 1, "dtype": "bfloat16",
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 5000000, "vocab_size": 151936,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "vision_config": {
        "model_type": "qwen3_vl_moe", "deepstack_visual_indexes": [8, 16, 24], "depth": 27,
        "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304,
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}
KIMI_LINEAR_48B = {
    "_name_or_path": "moonshotai/Kimi-Linear-48B-A3B-Instruct", "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear", "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_experts": 256,
    "num_experts_per_token": 8, "num_expert_group": 1, "num_hidden_layers": 27, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "use_grouped_topk": True,
    "v_head_dim": 128, "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
}
MINIMAX_M2 = {
    "_name_or_path": "MiniMaxAI/MiniMax-M2", "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
    "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
    "max_position_embeddings": 196608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
    "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
    "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64,
    "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False, "use_mtp": True,
    "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
}
GPT_OSS_20B = {
    "_name_or_path": "openai/gpt-oss-20b", "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "attention_bias": True, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
JAMBA_MINI_15 = {
    "_name_or_path": "ai21labs/AI21-Jamba-Mini-1.5", "architectures": ["JambaForCausalLM"], "model_type": "jamba",
    "attn_layer_offset": 4, "attn_layer_period": 8, "expert_layer_offset": 1, "expert_layer_period": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "mamba_conv_bias": True, "mamba_d_conv": 4,
    "mamba_d_state": 16, "mamba_dt_rank": 256, "mamba_expand": 2, "mamba_proj_bias": False,
    "max_position_embeddings": 262144, "num_attention_heads": 32, "num_experts": 16, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_logits_to_keep": 1, "rms_norm_eps": 1e-06,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_mamba_kernels": True,
    "vocab_size": 65536, "bos_token_id": 1, "eos_token_id": [2, 518], "pad_token_id": 0,
}
# Nemotron-H's config.json gives the layer pattern and no num_hidden_layers.
NEMOTRON_3_NANO = {
    "_name_or_path": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h", "attention_bias": False, "chunk_size": 128, "conv_kernel": 4, "expand": 2,
    "head_dim": 128, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu",
    "mamba_num_heads": 64, "mamba_proj_bias": False, "max_position_embeddings": 262144, "mlp_bias": False,
    "mlp_hidden_act": "relu2", "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
    "n_group": 1, "n_groups": 8, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_key_value_heads": 2, "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True, "residual_in_fp32": False, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "ssm_state_size": 128, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_bias": False, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 131072,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

PUBLISHED = {
    "deepseek-v3.2": DEEPSEEK_V32, "glm-4.5": GLM_45, "glm-4.6": GLM_46, "qwen3-next-80b-a3b": QWEN3_NEXT_80B,
    "qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B, "kimi-linear-48b-a3b": KIMI_LINEAR_48B, "minimax-m2": MINIMAX_M2,
    "gpt-oss-20b": GPT_OSS_20B, "jamba-mini-1.5": JAMBA_MINI_15, "nemotron-3-nano-30b-a3b": NEMOTRON_3_NANO,
}
