"""On/off switches of the offload engine, read from the environment: each is on unless set to 0, false, no or off.

    MOE_OFFLOAD_KERNELS (kernels/jit.py), MOE_OFFLOAD_FAST_DECODE (runtime/fastpath.py, mla_plan.py),
    MOE_OFFLOAD_DECODE_STEP (runtime/decode_step.py),
    MOE_OFFLOAD_MLA_ABSORB (runtime/mla.py), MOE_OFFLOAD_FUSED_ROUTER (runtime/moe_blocks.py),
    MOE_OFFLOAD_DELTANET (runtime/deltanet.py), MOE_OFFLOAD_HUGEPAGES (loading/hugepages.py)
"""

from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def on(name: str) -> bool:
    """The switch ``name`` is on: unset, or set to anything but one of ``OFF`` (any case, spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() not in OFF
