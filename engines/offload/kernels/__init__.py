"""Kernels: the one expert kernel and the compiled CPU ops behind it.

    dispatch.expert_forward(module, x [N, H], stored weights) --> torch.ops.moe_offload.* | F.linear
    jit.load() --> builds csrc/ for this CPU's ISA at first use (cached), registers torch.ops.moe_offload
"""
