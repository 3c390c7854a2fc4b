"""The offload executor for transformers MoE models: expert store, slot caches, miss policies, route capture.

    loader.load_model(path, placement, policy=, device=, dtype=, hybrid_threshold=, expert_dtype=) -> OffloadedModel
    OffloadedModel.executor: Executor (stats.snapshot()/reset(), capture(bool)/captured(), tier_names)

Modules: loader (checkpoint -> model + executor), checkpoint (quantized checkpoints read as stored),
executor (the registered experts function), kernels (the one expert kernel), quant (expert formats: int8,
fp8, mxfp4), cpu_kernels / quant_kernels (compiled CPU kernels), store (host store), slots (slot caches), policies, stats,
cuda (CUDA-only pieces), selfcheck (the selftest/gpu_check exactness run), engine (the Engine, runtime side).
"""
