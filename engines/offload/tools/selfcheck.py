"""A seconds-long exactness check of the executor, shared by `moe-offload selftest` and bench/gpu_check.py."""

from __future__ import annotations

import tempfile

import torch

from moe_offload.control.vocab import MISS_POLICIES
from moe_offload.engines.offload.loading.inspection import find_experts
from moe_offload.engines.offload.loading.loader import load_model
from rm_core import LayerPlacement, MemoryTier, Placement


def tiny_checkpoint(root: str, *, layers: int = 2, experts: int = 8, hidden: int = 32) -> str:
    """A random-weight Qwen3-MoE checkpoint (fp32) in ``root``; returns its path."""
    from transformers import Qwen3MoeConfig

    from moe_offload.demo import save_random_model

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         num_experts=experts, num_experts_per_tok=2, initializer_range=0.1, dtype="float32",
                         max_position_embeddings=256)
    save_random_model(root, cfg)
    return root


def fraction_placement(path: str, fraction: float, policy: str) -> Placement:
    """Pins the first round(fraction*E) experts for static, keeps them dynamic for lru, half/half for hybrid."""
    from transformers import AutoConfig

    infos = find_experts(AutoConfig.from_pretrained(path))
    acc, host = MemoryTier("acc:0", "device-hbm", 2**40, accelerator="selfcheck/any:0"), MemoryTier("host", "host-dram", 2**40)
    lps = []
    for info in infos:
        n = round(fraction * info.num_experts)
        pin = {"static": n, "lru": 0, "hybrid": n // 2}[policy]
        lps.append(LayerPlacement(info.layer, tuple("acc:0" if e < pin else "host" for e in range(info.num_experts)), {"acc:0": n}))
    return Placement("selfcheck", (acc, host), tuple(lps), policy)


@torch.no_grad()
def greedy(model, prompt, n, device):
    from transformers import DynamicCache

    cache, x, out = DynamicCache(config=model.config), torch.tensor([prompt], device=device), []
    logits = []
    for _ in range(n):
        last = model(x, past_key_values=cache, use_cache=True).logits[:, -1].float()
        x = last.argmax(-1, keepdim=True)
        out.append(int(x))
        logits.append(last.cpu())
    return out, torch.cat(logits)


def exactness(device: str = "cpu", tokens: int = 8, fractions=(0.0, 0.5, 1.0), path: str | None = None) -> str:
    """Greedy tokens of every policy x fraction equal stock transformers' on ``device``; raises AssertionError if not."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per check: no loading bars
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        path = path or tiny_checkpoint(tmp)
        prompt = [3, 17, 42, 9, 88, 5]
        ref, ref_logits = greedy(AutoModelForCausalLM.from_pretrained(path).to(device).eval(), prompt, tokens, device)
        worst = 0.0
        for policy in MISS_POLICIES:
            for f in fractions:
                om = load_model(path, fraction_placement(path, f, policy), policy=policy, device=device, hybrid_threshold=2)
                got, logits = greedy(om.model, prompt, tokens, device)
                assert got == ref, f"{policy} fraction={f}: {got} != stock {ref}"
                worst = max(worst, (logits - ref_logits).abs().max().item())
        assert worst <= 1e-5, f"max |logit - stock| = {worst:.2e} > 1e-5"
    return f"{len(fractions) * 3} policy x fraction runs = stock greedy, max |dlogit| {worst:.1e}"
