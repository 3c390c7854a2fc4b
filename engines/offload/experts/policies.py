"""Miss policies: what happens to a routed expert that is not in an accelerator slot.

    static : compute it on the host CPU from the host store (only activations cross the bus)  - the NPU design
    lru    : copy it into a dynamic slot, evicting the least recently used, then compute it there - the GPU design
    hybrid : per expert and step, host compute when fewer than ``threshold`` tokens route to it, else fetch

A layer without dynamic slots cannot fetch, so ``lru``/``hybrid`` compute its misses on the host.
"""

from __future__ import annotations

import math

from moe_offload import settings
from moe_offload.control.vocab import MISS_POLICIES
from moe_offload.errors import ConfigError

# Fallback for the hybrid default when no calibration is given (ASSUMED, not measured; a measured
# moe_offload.control.calibration.Calibration replaces them): a fetch moves one expert over the bus; host
# compute costs ~2 flops per weight per token.
BUS_BYTES_PER_S = {"cuda": 25e9, "cpu": 10e9}  # PCIe 4.0 x16 effective; a host memcpy for the cpu "bus"
HOST_FLOPS_PER_S = 1e11  # a few cores of AVX2/AVX-512 GEMM


def check_policy(policy: str) -> str:
    if policy not in MISS_POLICIES:
        raise ConfigError(f"policy: expected one of {', '.join(MISS_POLICIES)}, got {policy!r}")
    return policy


CALIBRATION_ENV = "MOE_OFFLOAD_CALIBRATION"  # path of a calibration JSON (`moe-offload calibrate --out`)


def default_hybrid_threshold(expert_bytes: int, expert_params: int, device_type: str, calibration=None) -> int:
    """Tokens at which fetching one expert costs as much as computing them on the host.

    With a calibration (a calibration.Calibration or a JSON path; default: the file $MOE_OFFLOAD_CALIBRATION
    names) for this device type: costmodel.hybrid_threshold, from its measured rates. Otherwise (with a
    warning when the calibration is for another device type) the assumed constants above: (expert_bytes / bus bandwidth) / (2 * params / host flops per token), at least 1."""
    cal = calibration if calibration is not None else settings.get(CALIBRATION_ENV)
    if cal is not None:
        from moe_offload.control.calibration import load_calibration
        from moe_offload.control.costmodel import hybrid_threshold

        cal = load_calibration(cal)
        if cal.device_type == device_type:
            return hybrid_threshold(cal, expert_bytes, expert_params)
        # the user gave a calibration, so falling back to assumed constants must not be silent
        from moe_offload.log import get_logger

        get_logger("moe_offload.policies").warning(
            "calibration_not_used", calibration_device=cal.device, engine_device=device_type,
            using="assumed constants for the hybrid threshold",
            hint=f"run `moe-offload calibrate --device {device_type}` on this machine")
    fetch_s = expert_bytes / BUS_BYTES_PER_S.get(device_type, BUS_BYTES_PER_S["cuda"])
    host_token_s = 2 * expert_params / HOST_FLOPS_PER_S
    return max(1, math.ceil(fetch_s / host_token_s))


def fetches(policy: str, tokens: int, dynamic_slots: int, threshold: int) -> bool:
    """True when a missing expert with ``tokens`` routed tokens is fetched into a slot; False: host compute."""
    if dynamic_slots == 0 or policy == "static":
        return False
    if policy == "lru":
        return True
    return tokens >= threshold
