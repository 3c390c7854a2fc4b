"""The offload engine: one data plane for every transformers MoE family, in four rooms.

    loading/   checkpoint --inspect, load_model--> transformers model + Executor (experts as stored: bf16 | int8 | fp8 | mxfp4)
    experts/   [router] -> [split hits/misses] -> [hits on the accelerator || misses on the host] -> [combine]
               executor (the registered experts function), store (host tier), slots (accelerator tier), policies, stats
    kernels/   expert_forward and the compiled CPU ops it dispatches to (JIT-built for this CPU's ISA)
    runtime/   OffloadEngine: scheduler -> model runner (paged KV, fused decode path) -> sampling -> tokens + stats
    tools/     calibrate (measured cost-model inputs), selfcheck (the exactness run of selftest / gpu_check)

    build_offload_engine(path, placement | fraction, policy=) -> OffloadEngine      (runtime/build.py)
    load_model(path, placement, policy=, device=, dtype=, expert_dtype=) -> OffloadedModel   (loading/loader.py)

The control plane (moe_offload.control) decides what is resident; this package executes that decision and
measures what happened. Nothing here is imported by the control plane.
"""
