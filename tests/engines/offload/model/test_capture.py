"""Decode steps as captured CUDA graphs (model/capture.py), everything around the capture, on the CPU.

No GPU here: the pieces run eagerly on the same static buffers a CUDA replay reads (the eager twin), over slot
buffers laid out as a GPU holds them (the loader's CPU slots alias the host store; these tests give them buffers of
their own, as device memory is). What is checked: bucket choice, the split points, the padding rows of a bucket, the
slot table after fetches and evictions, the eager fallback for shapes outside every bucket, and that the pieces give
the tokens (fp32: the logits to rounding) of the graph's own eager steps, at every policy and fraction.
Why it could fail: a padding row writing a real sequence's KV, a masked key read as garbage, a pair of a missing
expert left at zero or taken from a stale slot, a fetch evicting an expert the same step reads, a piece cut one
layer off, a bucket too small for the step.
"""

from __future__ import annotations

import pytest

from moe_offload.engines.offload.experts.slots import SlotCache
from moe_offload.engines.offload.loading import loader
from moe_offload.engines.offload.model import capture
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams

PROMPTS = [list(range(3, 14)), list(range(20, 25)), list(range(40, 71))]


def test_batch_buckets():
    assert [capture.batch_bucket(n, 16) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert capture.batch_bucket(17, 16) is None and capture.batch_bucket(0, 16) is None
    assert capture.batch_bucket(11, 12) == 12  # max_seqs between two buckets is a bucket of its own
    assert capture.batch_bucket(25, 256) == 32


def test_context_buckets():
    assert [capture.context_bucket(n, 64) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert capture.context_bucket(40, 48) == 48 and capture.context_bucket(49, 48) is None


@pytest.fixture
def device_slots(monkeypatch):
    """Slot buffers of their own (a GPU's layout) instead of views of the host store."""
    real = SlotCache

    def slots(*args, **kwargs):
        kwargs["alias_pinned"] = False
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "SlotCache", slots)


def _engine(path, dtype="float32", **kw):
    engine = build_offload_engine(path, dtype=dtype, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, **kw)
    engine.runner.fast = None  # decode steps on the graph (the fused CPU call would take them)
    return engine


def _generate(engine, n: int = 8) -> tuple[list[list[int]], list]:
    """Greedy tokens of PROMPTS, together (a bucket of 4 for 3 sequences), and the logits of every decode step."""
    seen = []
    runner = engine.runner
    forward = runner.forward_paged

    def record(out):
        logits = forward(out)
        if out.decode_only and logits is not None:
            seen.append(logits.float().clone())
        return logits

    runner.forward_paged = record
    gens = [engine.start(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in PROMPTS]
    while engine.step():
        pass
    return [g.drain() for g in gens], seen


def _counts(engine) -> dict:
    s = engine.executor.stats.snapshot()
    return {k: s[k] for k in ("hits", "misses", "fetches", "host_expert_tokens")}


def _capture(engine):
    cap = capture.DecodeCapture.build(engine.runner, 4, 256, eager=True)
    assert cap is not None
    engine.runner.capture = cap
    return cap


@pytest.mark.parametrize("policy,fraction,dtype", [("static", 1.0, "float32"), ("lru", 0.5, "float32"),
                                                   ("static", 0.5, "float32"), ("hybrid", 0.5, "float32"),
                                                   ("lru", 0.25, "float32"), ("lru", 0.5, "bfloat16")])
def test_the_pieces_give_the_graphs_tokens(checkpoints, device_slots, policy, fraction, dtype):
    path = checkpoints("qwen3_moe")
    ref = _engine(path, dtype, policy=policy, fraction=fraction)
    try:
        want, want_logits = _generate(ref)
        want_stats = _counts(ref)
    finally:
        ref.close()
    engine = _engine(path, dtype, policy=policy, fraction=fraction)
    try:
        cap = _capture(engine)
        layers = engine.runner.graph.layers
        moe = [i for i, lay in enumerate(layers) if lay.moe is not None]
        # the cut: every MoE layer whose experts are not all pinned; all resident: one piece, no host part
        assert cap.splits == ([] if fraction == 1.0 else moe)
        got, got_logits = _generate(engine)
        assert cap.steps >= 7, cap.steps  # the decode steps ran the pieces (3 sequences: bucket 4, padded)
        assert {b.batch for b in cap.buckets} >= {4}
        # the same pairs booked as the executor books them: hits, misses, fetches and host tokens
        assert _counts(engine) == want_stats
        for st in engine.executor.layers:  # the table follows the host's slots after every fetch and eviction
            assert engine.executor.slot_table().table[st.pos].tolist() == st.cache.slot_of
    finally:
        engine.close()
    assert got == want
    assert len(got_logits) == len(want_logits)
    # fp32: to rounding (a pair's expert through batched products instead of the executor's per-expert ones); bf16:
    # where those products round differently, a last place of the logits' range
    tol = 1e-5 if dtype == "float32" else 2e-2
    for a, b in zip(got_logits, want_logits):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()), float((a - b).abs().max())


def test_padding_rows_leave_the_sequences_kv(checkpoints, device_slots):
    # one sequence in a bucket of 1 and the same with two more beside it in a bucket of 4: its tokens are the same
    path = checkpoints("qwen3_moe")
    engine = _engine(path, policy="lru", fraction=0.5)
    try:
        _capture(engine)
        g = engine.start(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.step():
            pass
        alone = g.drain()
        tokens, _ = _generate(engine, 6)
    finally:
        engine.close()
    assert tokens[0] == alone


def test_steps_outside_every_bucket_run_eagerly(checkpoints, device_slots):
    path = checkpoints("qwen3_moe")
    engine = _engine(path, policy="static", fraction=1.0)
    try:
        cap = capture.DecodeCapture.build(engine.runner, 4, 16, eager=True)  # contexts of 4 blocks (16 tokens) at most
        engine.runner.capture = cap
        steps0 = engine.runner.graph.steps
        g = engine.start(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))
        while engine.step():
            pass
        assert len(g.drain()) == 10
        # 11 prompt tokens: decode contexts 12..20; those past 16 tokens are in no bucket and ran the graph eagerly
        assert cap.steps == 5, cap.steps
        assert engine.runner.graph.steps - steps0 == 1 + 4  # the prefill chunk and the eager decode steps
        assert cap.forward([1], [17], [[0, 1, 2, 3, 4]]) is None
    finally:
        engine.close()


def test_what_is_not_captured_says_why(checkpoints, tmp_path, monkeypatch):
    # the CPU loader's slots alias the host store: nothing to gather from on the device; and CPU engines never capture
    engine = _engine(checkpoints("qwen3_moe"), policy="static", fraction=1.0)
    try:
        assert engine.runner.capture is None
        assert "alias the host store" in capture.refuse(engine.runner)
        assert capture.DecodeCapture.build(engine.runner, 4, 256) is None  # not a CUDA device
    finally:
        engine.close()
    import families

    real = SlotCache
    monkeypatch.setattr(loader, "SlotCache", lambda *a, **k: real(*a, **{**k, "alias_pinned": False}))
    for family, why in (("hunyuan_v1_moe", "a MoE block run as its module"), ("qwen3_next", "gated-DeltaNet")):
        engine = _engine(families.build(family, tmp_path / family), policy="static", fraction=1.0)
        try:
            assert why in capture.refuse(engine.runner), (family, capture.refuse(engine.runner))
        finally:
            engine.close()


CAPTURED_FAMILIES = ["gpt_oss", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "minimax_m2", "ernie4_5_moe",
                     "granitemoeshared", "aria", "deepseek_v3", "deepseek_v2"]


@pytest.mark.parametrize("family", CAPTURED_FAMILIES)
def test_every_router_and_shared_expert_kind_is_captured(checkpoints, device_slots, tmp_path, family):
    # sinks and biased clamped-SwiGLU experts (gpt-oss), a gated shared expert (Qwen2-MoE), grouped sigmoid routers
    # with shared experts (GLM-4.5), a biased sigmoid top-k (MiniMax-M2), an fp32 softmax with a correction bias
    # (Ernie 4.5), multipliers and a shared MLP beside the block (Granite), ungated shared experts with transposed
    # experts (Aria), MLA's latent rows with dense first layers (DeepSeek-V3) and the complex rotary (DeepSeek-V2): half
    # the experts, fetched as the step routes
    import families

    helpers = ("gpt_oss", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3")  # offload_helpers.py builds these
    path = checkpoints(family) if family in helpers else families.build(family, tmp_path)
    ref = _engine(path, policy="lru", fraction=0.5)
    try:
        want, _ = _generate(ref, 6)
    finally:
        ref.close()
    engine = _engine(path, policy="lru", fraction=0.5)
    try:
        cap = _capture(engine)
        got, _ = _generate(engine, 6)
        assert cap.steps >= 5
    finally:
        engine.close()
    assert got == want


def test_buckets_whose_pairs_gather_too_much_run_eagerly(checkpoints, device_slots, monkeypatch):
    # a piece gathers each routed pair's weights: a bucket whose pairs would read more than the cap is not captured
    engine = _engine(checkpoints("qwen3_moe"), policy="static", fraction=1.0)
    try:
        st = engine.executor.layers[0]
        K = engine.runner.graph.layers[0].moe.router.r.top_k
        monkeypatch.setattr(capture, "GATHER_MAX_BYTES", 2 * K * st.expert_bytes)  # two sequences' pairs
        cap = _capture(engine)
        assert cap.max_batch == 2
        assert cap.bucket([5, 6]) == capture.Bucket(2, 2) and cap.bucket([5, 6, 7]) is None
        # three short prompts prefilled in one step, then decoding together: every decode step has three sequences
        gens = [engine.start(list(range(3 + 7 * i, 8 + 7 * i)), SamplingParams(max_tokens=4, ignore_eos=True))
                for i in range(3)]
        while engine.step():
            pass
        assert [len(g.drain()) for g in gens] == [4, 4, 4] and cap.steps == 0  # all of them eager
    finally:
        engine.close()
