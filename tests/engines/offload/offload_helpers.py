"""Shared helpers of the offload executor tests: tiny checkpoints of several MoE families, placements
from a resident fraction, a greedy loop, stock references.

Each family is built with transformers' own config class (hidden 32, 2-3 layers, 8 experts, top-2)
so the whole folder runs in a few minutes on 2 cores."""

from __future__ import annotations

import torch

from rm_core import LayerPlacement, MemoryTier, Placement

E = 8  # routed experts per layer in every tiny model
COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=256, initializer_range=0.1, dtype="float32", eos_token_id=None,
              bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _configs():
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
        SolarOpenConfig,
    )

    c = COMMON
    return {
        "qwen3_moe": lambda: Qwen3MoeConfig(**c, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
                                            num_experts=E, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen2_moe": lambda: Qwen2MoeConfig(**c, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=32, num_experts=E, num_experts_per_tok=2),
        "mixtral": lambda: MixtralConfig(**c, num_hidden_layers=2, intermediate_size=16, num_local_experts=E,
                                         num_experts_per_tok=2),
        "olmoe": lambda: OlmoeConfig(**{k: v for k, v in c.items() if k != "head_dim"}, num_hidden_layers=2,
                                     intermediate_size=16, num_experts=E, num_experts_per_tok=2),
        # first layer dense, grouped routing (2 groups, pick 1), scaled weights
        "deepseek_v3": lambda: DeepseekV3Config(**{k: v for k, v in c.items() if k != "head_dim"} | {"num_key_value_heads": 4},
                                                num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
                                                n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2,
                                                first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                                kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                v_head_dim=8),
        # transposed fused tensors, biases, clamped swiglu gate on interleaved gate/up
        "gpt_oss": lambda: GptOssConfig(**c, num_hidden_layers=2, intermediate_size=16, num_local_experts=E,
                                        num_experts_per_tok=2, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"]),
        "solar_open": lambda: SolarOpenConfig(**c, num_hidden_layers=2, moe_intermediate_size=16, n_routed_experts=E,
                                              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                              routed_scaling_factor=1.5),
    }


FAMILIES = tuple(_configs())


def build_checkpoint(family: str, root) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_configs()[family]())
    if family == "gpt_oss":  # transformers zero-initialises the router bias; make it matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.mlp.router.bias, std=0.5)
    path = root / family
    model.save_pretrained(path)
    return str(path)

def build_qwen3_next(path) -> str:
    """A tiny Qwen3-Next: gated-DeltaNet layers around a gated full-attention layer (partial rotary), zero-centred
    norms given weights away from zero (transformers initialises them to 0, where (1 + w) and w would agree)."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(**COMMON | {"head_dim": 16}, num_hidden_layers=3, intermediate_size=64,
                          moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, linear_num_value_heads=4,
                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                          layer_types=["linear_attention", "full_attention", "linear_attention"])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


ACC = MemoryTier("acc:0", "device-hbm", 2**34, accelerator="test/cpu:0")
HOST = MemoryTier("host", "host-dram", 2**35)


def placement(layers: list[int], num_experts: int, fraction: float, policy: str, seed: int = 0) -> Placement:
    """A placement keeping round(fraction * E) slots per layer:
    static pins them all; lru keeps them all dynamic; hybrid pins half and keeps half dynamic.
    Pinned experts are a per-layer pseudo-random subset, so hits and misses mix."""
    n = round(fraction * num_experts)
    lps = []
    for layer in layers:
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        order = torch.randperm(num_experts, generator=g).tolist()
        npin = {"static": n, "lru": 0, "hybrid": n // 2}[policy]
        pinned = set(order[:npin])
        home = tuple(ACC.name if e in pinned else HOST.name for e in range(num_experts))
        lps.append(LayerPlacement(layer, home, {ACC.name: n}))
    return Placement("test", (ACC, HOST), tuple(lps), policy)


def moe_layers(path: str) -> tuple[list[int], int]:
    from transformers import AutoConfig

    from moe_offload.engines.offload.loading.inspection import find_experts

    infos = find_experts(AutoConfig.from_pretrained(path))
    return [i.layer for i in infos], infos[0].num_experts


@torch.no_grad()
def greedy(model, prompt: list[int], n: int, device="cpu"):
    """n greedy tokens with a KV cache; returns (tokens, fp32 logits [n, vocab])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    x = torch.tensor([prompt], device=device)
    tokens, logits = [], []
    for _ in range(n):
        out = model(x, past_key_values=cache, use_cache=True)
        last = out.logits[:, -1].float()
        logits.append(last.cpu())
        x = last.argmax(-1, keepdim=True)
        tokens.append(int(x))
    return tokens, torch.cat(logits)


def stock(path: str, device: str = "cpu"):
    """transformers' own implementation: stock from_pretrained, default experts implementation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).to(device).eval()


def run_in_variant(variant: str, body: str) -> None:
    """Run ``body`` (Python; ``torch``, ``jit`` and ``ops`` = torch.ops.moe_offload in scope) in a fresh
    process with the kernels built for ISA ``variant`` (ops register once per process); skip where the CPU lacks
    it (the build would pick another variant). Fails with the child's stderr."""
    import os
    import subprocess
    import sys

    import pytest

    from moe_offload.engines.offload.kernels import jit

    needs = next(v[1] for v in jit.VARIANTS if v[0] == variant)
    if not set(needs) <= jit.cpu_flags():
        pytest.skip(f"CPU lacks {variant}")
    code = f"""
import torch
from moe_offload.engines.offload.kernels import jit
assert jit.load() and jit.info()["variant"] == {variant!r}, jit.info()
ops = torch.ops.moe_offload
""" + body
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, jit.ENV: variant}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def routed_pairs(T: int, K: int, E: int, seed: int = 0):
    """A step's routing as the executor sorts it: top [T, K] experts, the expert-sorted pairs' token (tok) and (token, k)
    row (perm), and per routed expert its first pair and count."""
    top = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(seed + t))[:K] for t in range(T)])
    sorted_ids, perm = torch.sort(top.reshape(-1), stable=True)
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = [0, *torch.cumsum(counts, 0)[:-1].tolist()]
    return top, perm // K, perm, uniq.tolist(), starts, counts.tolist()


def staggered(engine, prompts, lengths, join_after=2):
    """Start the first two, step twice, start the third; step until all are done. Returns each one's tokens."""
    from moe_offload.engines.params import SamplingParams

    gens = [engine.start(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts[:2], lengths[:2])]
    for _ in range(join_after):
        engine.step()
    gens += [engine.start(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts[2:], lengths[2:])]
    return drain(engine, gens), gens


def drain(engine, gens) -> list[list[int]]:
    """Step ``engine`` until it has no work; each generation's tokens, every one finished."""
    out = [[] for _ in gens]
    while engine.step():
        for o, g in zip(out, gens):
            o += g.drain()
    for o, g in zip(out, gens):
        o += g.drain()
        assert g.finished
    return out


_REFERENCES: dict = {}


def references(path: str, prompts, lengths) -> list[list[int]]:
    """transformers' greedy tokens of each prompt (lengths[i] of them) on the checkpoint at ``path``, once per session."""
    key = (path, tuple(map(tuple, prompts)), tuple(lengths))
    if key not in _REFERENCES:
        model = stock(path)
        _REFERENCES[key] = [greedy(model, p, n)[0] for p, n in zip(prompts, lengths)]
    return _REFERENCES[key]


def build_with_mtp(config, path) -> str:
    """A tiny checkpoint of ``config`` (its num_hidden_layers N) that ships one MTP layer as DeepSeek-V3 and GLM-4.5
    releases do: a decoder layer's tensors under ``model.layers.N.`` (per-expert linears, as save_pretrained writes
    them) and the layer's enorm, hnorm, eh_proj and shared_head beside them, in the one safetensors file;
    ``num_nextn_predict_layers`` 1. The decoder layer is the N+1-layer model's last one, so transformers itself loads
    it from ``path/full`` (the tests' oracle)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    n = int(config.num_hidden_layers)
    config.num_hidden_layers, config.num_nextn_predict_layers = n + 1, 1
    torch.manual_seed(4321)
    full = AutoModelForCausalLM.from_config(config)
    full.save_pretrained(path / "full")
    sd = load_file(str(path / "full" / "model.safetensors"))
    H, V = int(config.hidden_size), int(config.vocab_size)
    g = torch.Generator().manual_seed(99)
    pre = f"model.layers.{n}."
    sd[pre + "enorm.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    sd[pre + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    sd[pre + "eh_proj.weight"] = 0.2 * torch.randn(H, 2 * H, generator=g)
    sd[pre + "shared_head.norm.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    sd[pre + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    sd[pre + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "full" / "config.json").read_text())
    cfg["num_hidden_layers"] = n
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = path / "full" / "generation_config.json"
    if gen.exists():
        (path / "generation_config.json").write_text(gen.read_text())
    return str(path)
