"""The gathered hit path (experts/cuda.py gathered_hits, dispatch.experts_gathered): a layer's slot hits in one
batched call, the CUDA decode path, here on the CPU with slots as real buffers (the CPU's own pinned slots alias the
host store, so nothing is gathered there by default).

Why these could fail: a pair gathered from the wrong slot (pinned and dynamic slots share the buffers), a row taken
from the wrong token in a step of several tokens, gpt-oss's transposed weights or biases read in the other layout,
an output placed at another k, or a fetch overwriting a slot the gathered call still reads.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import FAMILIES, greedy

from moe_offload.engines.offload.experts import cuda as cuda_part
from moe_offload.engines.offload.experts.slots import SlotCache
from moe_offload.engines.offload.loading import loader
from moe_offload.engines.offload.tools.selfcheck import fraction_placement

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]
GATHERED = cuda_part.gathered_hits


def _run(path, policy, fraction, gather, monkeypatch):
    monkeypatch.setattr(loader, "SlotCache", lambda *a, **kw: SlotCache(*a, **{**kw, "alias_pinned": False}))
    om = loader.load_model(path, fraction_placement(path, fraction, policy), policy=policy, device="cpu")
    om.executor.gather_hits = gather
    calls = []
    def counted(*a):
        calls.append(GATHERED(*a))
        return calls[-1]

    monkeypatch.setattr(cuda_part, "gathered_hits", counted)
    with torch.no_grad():
        tokens, logits = greedy(om.model, PROMPT, 8)
    return tokens, logits, calls, om.executor.stats.snapshot()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy,fraction", [("static", 1.0), ("static", 0.5), ("lru", 0.5), ("hybrid", 0.5)])
def test_gathered_hits_match_the_per_expert_loop(checkpoints, family, policy, fraction, monkeypatch):
    path = checkpoints(family)
    ref_tokens, ref_logits, ref_calls, ref_stats = _run(path, policy, fraction, False, monkeypatch)
    tokens, logits, calls, stats = _run(path, policy, fraction, True, monkeypatch)
    assert not ref_calls
    assert calls and all(calls), "the gathered path did not run for every layer with hits"
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert (stats["hits"], stats["misses"], stats["bytes_copied"]) == (ref_stats["hits"], ref_stats["misses"],
                                                                       ref_stats["bytes_copied"])


def test_gathered_hits_leave_oversized_steps_to_the_loop(checkpoints, monkeypatch):
    path = checkpoints("qwen3_moe")
    monkeypatch.setattr(cuda_part, "GATHER_MAX_BYTES", 0)  # every step's pairs over the limit: the loop runs
    tokens, _, calls, _ = _run(path, "static", 1.0, True, monkeypatch)
    assert calls and not any(calls)
    assert tokens == _run(path, "static", 1.0, False, monkeypatch)[0]


def test_the_slot_table_follows_every_fetch_and_eviction(checkpoints, monkeypatch):
    # lru at 0.25: every decode step fetches and evicts; after each step the device table, synced, is the host's
    # bookkeeping, and the gathered path read its hits from it (a stale row would gather a wrong expert's weights and
    # move the logits: test_gathered_hits_match_the_per_expert_loop)
    from moe_offload.engines.offload.experts.slot_table import SlotTable

    path = checkpoints("qwen3_moe")
    monkeypatch.setattr(loader, "SlotCache", lambda *a, **kw: SlotCache(*a, **{**kw, "alias_pinned": False}))
    om = loader.load_model(path, fraction_placement(path, 0.25, "lru"), policy="lru", device="cpu")
    ex = om.executor
    ex.gather_hits = True
    table = ex.slot_table()
    versions = []
    with torch.no_grad():
        for n in range(1, 6):
            greedy(om.model, PROMPT[:n] + [n * 7], 1)
            versions.append([s.cache.version for s in ex.layers])
            table.sync()
            for i, st in enumerate(ex.layers):
                assert table.table[i].tolist() == st.cache.slot_of
                ids = torch.tensor([[e, (e + 3) % len(st.cache.slot_of)] for e in range(len(st.cache.slot_of))])
                assert table.slots_of(i, ids).tolist() == [[st.cache.slot_of[a], st.cache.slot_of[b]]
                                                           for a, b in ids.tolist()]
    assert versions[-1] != versions[0], "no fetch moved a slot: the test did not exercise the table"
    assert table.sync() == 0  # nothing changed since: no row copied
    with pytest.raises(ValueError, match="expert count"):
        SlotTable([ex.layers[0].cache, type("C", (), {"slot_of": [-1], "version": 0})()], torch.device("cpu"))
