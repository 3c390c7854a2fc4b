"""The one expert kernel: a set of tokens through one expert.

Every path (accelerator slots, host store, fetched slots) calls ``expert_forward``,
so where host and accelerator share device type and precision the results are
bit-identical and greedy output does not depend on the resident fraction.
This is the seam for a memory-bandwidth GEMV kernel later (registered as an
opaque torch custom op); today it is two ``F.linear`` calls around the module's
own gate, which is what transformers' experts implementations compute.

Legend: N tokens routed to this expert, H hidden, I intermediate (2I gate+up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_forward(
    module: torch.nn.Module,
    x: torch.Tensor,  # [N, H]
    up: torch.Tensor,  # [2I, H] ([H, 2I] when module.is_transposed); [I, H] without a gate
    down: torch.Tensor,  # [H, I] ([I, H] when transposed)
    up_bias: torch.Tensor | None = None,  # [2I]
    down_bias: torch.Tensor | None = None,  # [H]
    post_norm: bool = True,
) -> torch.Tensor:
    """Unweighted output [N, H] of one expert; the routing weight is applied by the caller's combine.
    ``post_norm=False`` leaves the module's post-expert norm (whose weights live on the accelerator) to the caller."""
    x = x.to(up.dtype)
    if module.is_transposed:
        h = x @ up  # [N, 2I]
    else:
        h = F.linear(x, up)  # [N, 2I]
    if up_bias is not None:
        h = h + up_bias
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # [N, I]
    y = h @ down if module.is_transposed else F.linear(h, down)  # [N, H]
    if down_bias is not None:
        y = y + down_bias
    if post_norm and module.has_post_expert_norm:
        y = module.post_expert_norm(y)
    return y
