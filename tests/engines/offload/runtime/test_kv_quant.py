"""A quantized KV cache (--kv-cache-dtype int8 | fp8; runtime/kv_quant.py, kernels/csrc/cpu/decode.cpp).

Why these could fail: a scale per row where it must be per (row, head), codes rounded differently on the two paths
(the fused kernel's rows would then not be the module path's and a sequence's numbers would change with the path
that wrote them), a dequantized row read with another row's scale, the budget priced in bf16 bytes (no more tokens),
a prefix-cache hit that reads other numbers than the recompute it replaces. The fp8 codes are checked against
torch's own float8_e4m3fn conversion, the int8 codes against numpy's rounding: references this project did not write.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.runtime import kv_quant
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], list(range(50, 90)))


def _rows(n=64, heads=4, dim=32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * torch.rand(n, heads, 1, generator=g) * 8
    x[0, 1] = 0  # an all-zero head: scale 1, codes 0
    return x.to(torch.bfloat16)


def test_int8_codes_are_numpys_rounding_per_row_and_head():
    x = _rows()
    q, s = kv_quant.quantize(x, torch.int8)
    xf = x.float().numpy()
    scale = np.abs(xf).max(axis=-1) * np.float32(1 / 127)
    scale[scale == 0] = 1
    want = np.clip(np.round(xf / scale[..., None]), -127, 127).astype(np.int8)  # numpy: half to even
    assert q.dtype == torch.int8 and s.shape == x.shape[:2]
    assert np.array_equal(q.numpy(), want) and np.array_equal(s.numpy(), scale)
    assert q[0, 1].abs().max() == 0 and s[0, 1] == 1
    back = kv_quant.dequantize(q, s, torch.float32)
    assert torch.allclose(back, x.float(), atol=0, rtol=0) is False  # lossy, but within half a step per value
    assert ((back - x.float()).abs() <= s.unsqueeze(-1) / 2 + 1e-6).all()


def test_fp8_codes_are_torchs_e4m3fn_conversion():
    x = _rows(seed=1)
    q, s = kv_quant.quantize(x, torch.uint8)
    ref = (x.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn)  # torch's conversion (round to nearest even)
    assert q.dtype == torch.uint8 and torch.equal(q, ref.view(torch.uint8))
    assert torch.equal(kv_quant.dequantize(q, s, torch.float32), ref.float() * s.unsqueeze(-1))
    # every head's largest value maps to e4m3's largest finite value, 448
    assert torch.equal(q.view(torch.float8_e4m3fn).float().abs().amax(-1)[s != 1], torch.full_like(s[s != 1], 448.0))


def test_unknown_cache_dtype_is_refused_before_loading():
    with pytest.raises(ConfigError, match="kv_cache_dtype: expected one of auto, int8, fp8, fp8_e4m3"):
        build_offload_engine("/nonexistent", kv_cache_dtype="fp4")


@pytest.mark.parametrize("codes", ["int8", "fp8"])
def test_the_same_budget_holds_about_twice_the_tokens(checkpoints, codes):
    budget = 64 << 10
    engines = {c: build_offload_engine(checkpoints("qwen3_moe"), dtype="bfloat16", kv_cache_memory=budget,
                                       kv_cache_dtype=c) for c in ("auto", codes)}
    try:
        plain, small = engines["auto"], engines[codes]
        # per layer and token: 2 x Hkv x D values; bf16 two bytes each, codes one plus a 4-byte scale per head
        hd = plain.model.config.head_dim
        assert plain.kv_bytes_per_token / small.kv_bytes_per_token == pytest.approx(2 * hd / (hd + 4))
        for e in (plain, small):  # the budget's blocks, nothing capped them
            assert e.pool.num_blocks == budget // (e.kv_bytes_per_token * e.pool.block_size)
        # 2 D / (D + 4) more tokens: 1.94x at head_dim 128, less at this checkpoint's tiny head_dim
        assert small.pool.num_blocks >= int(plain.pool.num_blocks * 2 * hd / (hd + 4)) - 1 > plain.pool.num_blocks
        assert small.cache_info()["cache_dtype"] == codes and plain.cache_info()["cache_dtype"] == "auto"
        assert small.info.approximate == f"kv_cache_dtype={codes}" and plain.info.approximate == ""
        list(small.generate(PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True)))
        # what the pool really holds per token: the bytes the budget priced
        held = sum(t[0].nbytes for t in small.pool.layers.values()) + sum(
            t.nbytes for pair in small.pool.scales.values() for t in pair) + sum(
            t[1].nbytes for t in small.pool.layers.values())
        assert held == small.kv_bytes_per_token * small.pool.num_blocks * small.pool.block_size
    finally:
        for e in engines.values():
            e.close()


def _greedy(engine, prompts, n=10) -> list[list[int]]:
    gens = [engine.start(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    return [list(g) for g in gens]


@pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("family,codes", [("qwen3_moe", "int8"), ("qwen3_moe", "fp8"), ("gpt_oss", "int8")])
def test_fused_kernel_writes_and_reads_the_module_paths_codes(checkpoints, family, codes):
    """Every decode-only step on both paths from the same pool: the fused kernel's codes and scales for the new rows are
    the module path's bit for bit, and the logits agree as the bf16 cache's do (test_fastpath.py's bounds)."""
    engine = build_offload_engine(checkpoints(family), dtype="bfloat16", block_size=4, kv_cache_dtype=codes)
    runner, pool = engine.runner, engine.pool
    plan = runner.fast
    assert plan is not None and pool.codes is not None
    gens = [engine.start(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    gaps, compared = [], 0
    try:
        for _ in range(40):
            sched = engine.scheduler.schedule()
            if sched.is_empty:
                break
            with torch.inference_mode():
                if not all(n == 1 for _, n in sched.scheduled):
                    engine.output.emit(sched, runner.forward_paged(sched))
                    continue
                fast = runner.forward_fast(sched).float()
                written = {i: [t.clone() for t in (*pool.layers[i], *pool.scales[i])] for i in pool.layers}
                graph, runner.fast, runner.graph = runner.graph, None, None  # the reference: transformers' modules
                try:
                    ref = runner.forward_paged(sched).float()
                finally:
                    runner.fast, runner.graph = plan, graph
                for i, saved in written.items():
                    for a, b in zip(saved, (*pool.layers[i], *pool.scales[i])):
                        assert torch.equal(a, b), (i, "the fused kernel's KV codes differ from the module path's")
                compared += 1
                gaps.append(float((fast - ref).abs().max() / ref.abs().max()))
                engine.output.emit(sched, ref)
    finally:
        engine.close()
    assert [len(g.drain()) for g in gens] == [12, 12, 12]
    assert compared >= 8
    gaps.sort()
    assert gaps[len(gaps) // 2] < 1e-3 and gaps[-1] < 5e-2, gaps


@pytest.mark.parametrize("codes", ["int8", "fp8"])
def test_quantized_cache_stays_close_to_the_bf16_cache(checkpoints, codes):
    # each prompt's first token: its prefill attends over rows read back from the pool, quantized or not
    def first(c):
        engine = build_offload_engine(checkpoints("qwen3_moe"), dtype="bfloat16", kv_cache_dtype=c)
        try:
            gens = [engine.start(p, SamplingParams(max_tokens=1, logprobs=5)) for p in PROMPTS]
            for g in gens:
                list(g)
            return [g.logprobs[0] for g in gens]
        finally:
            engine.close()

    for a, b in zip(first("auto"), first(codes)):
        assert a.token == b.token  # top-1 agrees
        assert max(abs(x[1] - y[1]) for x, y in zip(a.top, b.top)) < 0.05, (a, b)


def test_prefix_cache_hits_read_the_numbers_a_recompute_writes(checkpoints):
    # the pool always hands back dequantized rows, so a cached prefix gives the tokens of the request that wrote it
    shared = list(range(10, 50))
    engine = build_offload_engine(checkpoints("qwen3_moe"), dtype="bfloat16", block_size=4, kv_cache_dtype="int8",
                                  enable_prefix_caching=True)
    try:
        first = _greedy(engine, [shared + [3]])[0]
        again = engine.start(shared + [3], SamplingParams(max_tokens=10, ignore_eos=True))
        tokens = list(again)
        assert again.stats.cached_tokens >= 36 and tokens == first
    finally:
        engine.close()


def test_mla_layers_keep_a_quantized_latent_cache_on_the_module_path(checkpoints):
    engine = build_offload_engine(checkpoints("deepseek_v3"), dtype="bfloat16", block_size=4, kv_cache_dtype="int8")
    try:
        assert engine.runner.fast is None  # the fused MLA kernel reads bf16 latents: refused, with the reason logged
        assert engine.pool.codes == torch.int8
        assert all(len(t) == 10 for t in _greedy(engine, PROMPTS))
        assert all(k.dtype == torch.int8 for k, _ in engine.pool.layers.values())
    finally:
        engine.close()


def test_two_ranks_keep_the_same_quantized_cache(checkpoints):
    # --tensor-parallel 2 (bf16): each rank holds the KV of every head in its own pool and quantizes it alike, so the
    # tokens are the one-process run's
    path = checkpoints("qwen3_moe")
    one = build_offload_engine(path, dtype="bfloat16", kv_cache_dtype="int8")
    try:
        want = _greedy(one, PROMPTS)
    finally:
        one.close()
    two = build_offload_engine(path, dtype="bfloat16", kv_cache_dtype="int8", tensor_parallel=2)
    try:
        assert two.pool.codes == torch.int8 and _greedy(two, PROMPTS) == want
    finally:
        two.close()
