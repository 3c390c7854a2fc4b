"""Model: what a layer computes, from the model's description (control/description.py), bound to its weights.

    fused_bind.py   description + the model's weights --> per layer a kernel layer (kernels/ops.py), its rotary,
                    its MoE block (moe_blocks.py: routers other than softmax) and dense/shared MLP rows (weights.py)
    fastpath.py     DecodePlan: one step of those layers (decode rows, drafts) without transformers' modules
      decode_step.py  every layer in one C++ call when every expert is resident
    mla.py          MLA attention over the latent cache, kv_b_proj absorbed; mla_plan.py binds it for the fused path
    deltanet.py     gated-DeltaNet layers: state in the pool's seats, one-token steps in one kernel call

The engine loop (runtime/) asks model_runner.py for a step's forward; these files are what it runs where the
description says the layers are kinds they compute. The rest still runs transformers' modules (the fallback).
"""
