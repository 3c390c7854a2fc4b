"""Automatic prefix caching (runtime/prefix_cache.py): exact, and nothing leaks.

Why these could fail: a cached block handed to a sequence whose tokens differ (a wrong hash chain, a salt ignored),
a shared block written by the sequence that took it, a hit that skips the last prompt token (no logits), a block
stored before its rows were computed (a rejected draft, a preempted sequence), or a reference count that never reaches
zero. Every family's greedy tokens in fp32 are transformers' own with the cache on, hit fully, partly (divergence
inside a block) or not at all; the pool is whole again after each load.
"""

from __future__ import annotations

import pytest
from offload_helpers import FAMILIES, drain, references, stock

from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.offload.runtime.kv import KVPool
from moe_offload.engines.offload.runtime.prefix_cache import PrefixCache
from moe_offload.engines.offload.runtime.scheduler import Scheduler, SchedulerConfig, Sequence
from moe_offload.engines.params import SamplingParams

BS = 16
SHARED = [(7 * i + 3) % 120 + 1 for i in range(40)]  # 2.5 blocks: two full blocks, then a half-full one
PROMPTS = (
    SHARED + [5, 9, 11],  # first: fills the cache
    SHARED[:36] + [99, 98, 97, 96, 95],  # diverges inside the third block: two blocks found
    SHARED + [5, 9, 11],  # the first again: every full block found (two, then the last tokens computed)
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],  # nothing in common
    SHARED[:32],  # exactly two blocks: the second is not taken (its last token must be computed for logits)
)
LENGTHS = (8, 6, 8, 5, 6)
CACHED = (0, 32, 32, 0, 16)


def _params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def _whole(engine) -> None:
    """Free + evictable + held blocks = the pool, and nothing is held once every sequence ended."""
    pool = engine.pool
    held = sum(1 for r in pool.ref if r > 0)
    evictable = len(pool.cache.evictable) if pool.cache is not None else 0
    assert len(pool._free) + evictable + held == pool.num_blocks
    assert held == 0 and pool.free_blocks == pool.num_blocks and pool.usage == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_give_transformers_tokens(checkpoints, family):
    """One request after another (each sees the blocks of those before it), then all at once, with the cache on:
    transformers' greedy tokens every time, and the cached tokens each request found."""
    path = checkpoints(family)
    expected = references(path, PROMPTS, LENGTHS)
    engine = build_offload_engine(path, policy="lru", fraction=0.5, max_num_batched_tokens=24,
                                  enable_prefix_caching=True)
    try:
        assert engine.prefix_caching and engine.cache_info()["enable_prefix_caching"]
        gens, out = [], []
        for p, n in zip(PROMPTS, LENGTHS):
            gens.append(engine.start(p, _params(n)))
            out += drain(engine, gens[-1:])
        assert [g.stats.cached_tokens for g in gens] == list(CACHED)
        assert out == expected
        _whole(engine)
        # together, in one batch: the cache holds every prompt's full blocks now
        gens = [engine.start(p, _params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        assert drain(engine, gens) == expected
        assert [g.stats.cached_tokens for g in gens] == [32, 32, 32, 16, 16]
        _whole(engine)
        s = engine.stats()["prefix_cache"]
        assert s["hits"] == sum(CACHED) + 128 and s["queries"] == 2 * sum(map(len, PROMPTS))
    finally:
        engine.close()


def test_cache_off_caches_nothing_and_reports_none(checkpoints):
    path = checkpoints("qwen3_moe")
    engine = build_offload_engine(path, fraction=0.5)
    try:
        assert not engine.prefix_caching and engine.cache_info()["enable_prefix_caching"] is False
        gens = [engine.start(p, _params(n)) for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
        assert drain(engine, gens) == references(path, PROMPTS[:3], LENGTHS[:3])
        assert all(g.stats.cached_tokens == 0 for g in gens) and "prefix_cache" not in engine.stats()
    finally:
        engine.close()


def test_salt_and_prompt_logprobs_keep_a_request_off_other_blocks(checkpoints):
    path = checkpoints("qwen3_moe")
    expected = references(path, PROMPTS[:1], LENGTHS[:1])[0]
    engine = build_offload_engine(path, fraction=0.5, enable_prefix_caching=True)
    try:
        first = engine.generate(PROMPTS[0], _params(8, cache_salt="tenant-a"))
        assert list(first) == expected and first.stats.cached_tokens == 0
        runs = []
        # another salt: another chain; the same salt: its blocks; no salt: neither; prompt logprobs need every
        # prompt position's logits: computed, not found
        for kw in ({"cache_salt": "tenant-b"}, {"cache_salt": "tenant-a"}, {}, {"prompt_logprobs": 1}):
            g = engine.generate(PROMPTS[0], _params(8, **kw))
            runs.append(list(g))  # runs it to the end
            assert g.stats.cached_tokens == (32 if kw == {"cache_salt": "tenant-a"} else 0), kw
        assert runs == [expected] * 4 and len(g.prompt_logprobs) == len(PROMPTS[0])
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_preemption_and_aborts_with_shared_blocks(checkpoints, family):
    """A pool too small for the batch: sequences that share cached blocks are preempted, recomputed (finding their
    own blocks again) and aborted; the survivors get transformers' tokens, and the pool is whole after."""
    path = checkpoints(family)
    prompts = [SHARED + [i + 1, i + 2] for i in range(4)]
    lengths = [20] * 4
    expected = references(path, prompts, lengths)
    # 4 sequences x 4 blocks at their longest, 2 of them shared: 10 blocks, 9 in the pool: preemption at any speed
    engine = build_offload_engine(path, fraction=0.5, block_size=BS, enable_prefix_caching=True,
                                  kv_cache_memory=9 * BS * engine_bytes_per_token(path), max_num_batched_tokens=64)
    try:
        assert engine.pool.num_blocks == 9
        warm = engine.generate(SHARED + [0], _params(2))  # the shared blocks, cached
        assert len(list(warm)) == 2
        gens = [engine.start(p, _params(n)) for p, n in zip(prompts, lengths)]
        doomed = [engine.start(SHARED + [60, 61], _params(30)) for _ in range(2)]
        out = [[] for _ in gens]
        for step in range(400):
            if step == 6:
                for g in doomed:
                    g.close()  # aborted while holding shared blocks
            if not engine.step():
                break
            for o, g in zip(out, gens):
                o += g.drain()
        assert out == expected
        assert engine.scheduler.preemptions >= 1
        assert all(g.stats.cached_tokens == 32 for g in gens)
        _whole(engine)
        assert len(engine.pool.cache.evictable) >= 2  # the shared blocks outlive every sequence that held them
    finally:
        engine.close()


def engine_bytes_per_token(path: str) -> int:
    engine = build_offload_engine(path, fraction=0.5, kv_cache_memory=1 << 20)
    try:
        return engine.kv_bytes_per_token
    finally:
        engine.close()


def test_speculative_drafts_never_enter_the_cache(checkpoints):
    """ngram drafts are written as KV rows and rejected ones rolled back: only blocks of accepted tokens are
    stored, so a later request over the same tokens gets transformers' tokens from them."""
    path = checkpoints("qwen3_moe")
    prompt = SHARED + [5, 9, 11]
    first_ref = references(path, [prompt], [40])[0]
    engine = build_offload_engine(path, fraction=0.5, enable_prefix_caching=True,
                                  speculative={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1, "disable_by_batch_size": None})
    try:
        first = engine.generate(prompt, _params(40))
        assert list(first) == first_ref and first.stats.spec_drafts > 0
        again = prompt + first_ref[:30]  # its output so far: cached blocks made of accepted tokens only
        ref = references(path, [again], [10])[0]
        second = engine.generate(again, _params(10))
        assert list(second) == ref and second.stats.cached_tokens == (len(again) - 1) // BS * BS
    finally:
        engine.close()


def test_a_linear_attention_family_runs_without_the_cache_and_says_why(tmp_path):
    import torch
    from offload_helpers import COMMON, greedy
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(**COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2, linear_num_value_heads=2,
                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                          layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    expected = greedy(stock(str(tmp_path)), PROMPTS[0], 6)[0]
    engine = build_offload_engine(str(tmp_path), fraction=0.5, enable_prefix_caching=True)
    try:
        assert not engine.prefix_caching
        assert "per-sequence state" in engine.cache_info()["prefix_caching_off"]
        for _ in range(2):
            g = engine.generate(PROMPTS[0], _params(6))
            assert list(g) == expected and g.stats.cached_tokens == 0
    finally:
        engine.close()


# -- the pool and the scheduler alone ----------------------------------------------------------------------------

def _pool(blocks: int, events: bool = False) -> KVPool:
    pool = KVPool(blocks, 4, device="cpu")
    pool.cache = PrefixCache(4, "seed", events=events)
    return pool


def _run(sched: Scheduler, seq: Sequence) -> None:
    """Compute ``seq``'s prompt as the engine would (schedule, commit, advance), then finish it."""
    sched.add(seq)
    while seq.remaining:
        out = sched.schedule()
        sched.commit(out)
        for s, n in out.scheduled:
            s.computed += n
    sched.finish(seq)


def test_a_request_that_needs_the_whole_pool_evicts_every_cached_block():
    pool = _pool(12, events=True)
    sched = Scheduler(SchedulerConfig(4, 64), pool)
    for i in range(4):  # four prompts of 2 full blocks and 1 token: 2 cached blocks and a free one each
        _run(sched, Sequence(i, [i * 10 + t for t in range(9)], 9, 9))
    assert len(pool.cache.evictable) == 8 and len(pool._free) == 4 and pool.free_blocks == 12
    big = Sequence(9, list(range(200, 248)), 48, 48)
    sched.add(big)
    sched.schedule()
    assert len(big.blocks) == 12 and not pool.cache.evictable and not pool.cache.by_hash
    kinds = [e.kind for e in pool.cache.drain_events()[1]]
    assert kinds.count("BlockStored") == 8 and kinds.count("BlockRemoved") == 8
    sched.finish(big)
    assert pool.free_blocks == 12 and sum(pool.ref) == 0


def test_the_chain_covers_every_earlier_token():
    cache = PrefixCache(4, "seed")
    a = cache.chain([1, 2, 3, 4, 5, 6, 7, 8], 8, None, [])
    b = cache.chain([9, 2, 3, 4, 5, 6, 7, 8], 8, None, [])
    assert a[1] != b[1]  # the same second block after a different first: another hash
    assert cache.chain([1, 2, 3, 4, 5, 6, 7, 8], 8, "salt", []) != a
    assert PrefixCache(4, "another model").chain([1, 2, 3, 4], 4, None, []) != a[:1]
    assert cache.chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 9, None, a[:1]) == a  # extends a chain it was given


def test_a_block_is_never_freed_twice():
    pool = _pool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)


def test_two_ranks_share_the_same_cached_blocks(checkpoints):
    """--tensor-parallel 2: every rank runs the same scheduler, so each finds the same blocks; tokens stay exact."""
    path = checkpoints("qwen3_moe")
    expected = references(path, PROMPTS, LENGTHS)
    engine = build_offload_engine(path, fraction=0.5, tensor_parallel=2, enable_prefix_caching=True)
    try:
        gens, out = [], []
        for p, n in zip(PROMPTS, LENGTHS):
            gens.append(engine.start(p, _params(n)))
            out += drain(engine, gens[-1:])
        assert out == expected and [g.stats.cached_tokens for g in gens] == list(CACHED)
    finally:
        engine.close()
