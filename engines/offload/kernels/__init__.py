"""Kernels: the one expert kernel and the compiled CPU ops behind it.

    dispatch.expert_forward(module, x [N, H], stored weights) --> torch.ops.moe_offload.* | F.linear
    csrc/cpu/*.cpp, *.h --jit.load() (at first use, for this CPU's ISA; cached by the bytes)--> torch.ops.moe_offload
    ops.py: every op's signature with shapes, MAX_TOKENS, and the front door: the only module outside the build
            (jit.py) and the kernels' own wiring (dispatch.py, gemm.py) that calls them; per device (ops.native),
            the torch computation of the ops the owned graph calls where the compiled kernels do not run
    fakes.py: every op's fake (meta) kernel, registered by jit.py

csrc/cpu/: vec.h and quant.h (the ISA helpers, the only #ifs), common.h (checks, row loops, op declarations),
gemm.cpp, moe.cpp, moe_quant.cpp, decode.cpp (one op family each), bindings.cpp (every m.def / m.impl).
"""
