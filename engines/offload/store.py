"""The host store: every routed expert of every MoE layer, once, in host DRAM.

Per layer it keeps the module's fused tensors as loaded (``[E, ...]``), so the
store costs no copy on a CPU run; with a CUDA accelerator they are moved into
pinned memory (page-locked) so fetches can be asynchronous DMA.

Legend: E experts, H hidden, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Names of an experts module's routed tensors, in the order the kernel takes them.
WEIGHT_NAMES = ("up", "down", "up_bias", "down_bias")


@dataclass
class LayerStore:
    """One layer's experts on the host. ``tensors`` = (up [E,2I,H], down [E,H,I], up_bias [E,2I] | None, down_bias [E,H] | None)."""

    tensors: tuple[torch.Tensor | None, ...]

    @property
    def num_experts(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (all its tensors)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors if t is not None)

    def expert(self, e: int) -> tuple[torch.Tensor | None, ...]:
        """Views of expert ``e``'s tensors (no copy)."""
        return tuple(t[e] if t is not None else None for t in self.tensors)


def module_tensor_names(module: torch.nn.Module) -> tuple[str | None, ...]:
    """Attribute names of (up, down, up_bias, down_bias) on a transformers experts module."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    bias = getattr(module, "has_bias", False)
    return (up, "down_proj", up + "_bias" if bias else None, "down_proj_bias" if bias else None)


def take_from_module(module: torch.nn.Module, pin: bool) -> LayerStore:
    """Move the module's routed expert tensors into a LayerStore and detach them from the module.

    The module keeps plain (non-Parameter) attributes pointing at the store, so
    ``model.to(device)`` never moves experts to the accelerator, while code that
    reads ``module.gate_up_proj`` still sees the host tensors.
    """
    tensors = []
    for name in module_tensor_names(module):
        if name is None:
            tensors.append(None)
            continue
        t = module._parameters.pop(name).detach()
        if pin:
            t = t.pin_memory()  # one layer at a time: peak extra host memory is one layer's experts
        tensors.append(t)
        object.__setattr__(module, name, t)
    return LayerStore(tuple(tensors))
