"""The KV probe (kv_budget.probe_kv_bytes) on ranks: every rank pages or none, and a rank's collective failure is not
mistaken for a layer the pool cannot hold."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_offload.engines.offload.ranks import parallel
from moe_offload.engines.offload.runtime import kv, kv_budget


class _Rank:
    """What the probe reads of an executor on rank 0 of 2 (``--tensor-parallel 2``)."""

    ep = (0, 2)
    stats = None
    dry = False


@pytest.fixture
def model(checkpoints):
    m = AutoModelForCausalLM.from_pretrained(checkpoints("qwen3_moe"), dtype=torch.float32)
    m.eval()
    return m


def test_one_process_pages_the_model(model):
    """The reference for the two below: alone, this model's probe finds its KV bytes and leaves paged attention."""
    got = kv_budget.probe_kv_bytes(model, None, torch.device("cpu"))
    assert got is not None and got[0] > 0
    assert model.config._attn_implementation == kv.ATTENTION


def test_a_rank_whose_probe_passed_does_not_page_when_another_rank_cannot(model, monkeypatch):
    """Rank 0's probe passes, another rank's failed (agree says False): rank 0 keeps the model's own attention, so
    every rank runs the same steps and the same collectives."""
    asked = []
    monkeypatch.setattr(parallel, "agree", lambda ok: asked.append(ok) or False)
    own = model.config._attn_implementation
    assert kv_budget.probe_kv_bytes(model, _Rank(), torch.device("cpu")) is None
    assert asked == [True]  # this rank's own probe passed; the ranks' agreement decided
    assert model.config._attn_implementation == own


def test_a_collective_failure_during_the_probe_is_raised(model, monkeypatch):
    """A torch.distributed error inside the probe's forward (a rank gone, a timed-out collective) propagates: it says
    nothing about whether the pool can hold the model's KV."""
    def gone(*args, **kwargs):
        raise torch.distributed.DistBackendError("rank 1 closed the connection")

    monkeypatch.setattr(model, "forward", gone)
    monkeypatch.setattr(parallel, "agree", lambda ok: pytest.fail("no agreement after a failed collective"))
    with pytest.raises(torch.distributed.DistBackendError, match="rank 1"):
        kv_budget.probe_kv_bytes(model, _Rank(), torch.device("cpu"))


def test_a_rank_whose_own_probe_failed_still_joins_the_agreement(model, monkeypatch):
    """A layer this rank cannot page: it still calls agree (with False), so the other ranks are not left waiting."""
    def cannot(*args, **kwargs):
        raise ValueError("a cache this layer does not take")

    asked = []
    monkeypatch.setattr(model, "forward", cannot)
    monkeypatch.setattr(parallel, "agree", lambda ok: asked.append(ok) or ok)
    assert kv_budget.probe_kv_bytes(model, _Rank(), torch.device("cpu")) is None
    assert asked == [False]


def test_tensor_parallel_ranks_plan_their_share_of_the_container(checkpoints, monkeypatch):
    """N ranks in one container share its memory limit: each plans 1/N of the limit for its 1/N of the experts (and
    of --host-memory), so together they fit where one process would."""
    from pathlib import Path

    from moe_offload import hostmem
    from moe_offload.engines.offload.runtime.build import _host_plan
    from moe_offload.engines.offload.runtime.kv_budget import KVCacheConfig

    path = Path(checkpoints("qwen3_moe"))
    monkeypatch.setattr(hostmem, "host_memory_limit", lambda: hostmem.HostMemory(8 << 30, "cgroup limit"))
    one = _host_plan(path, None, None, None, KVCacheConfig(), "cpu")
    two = _host_plan(path, None, None, None, KVCacheConfig(), "cpu", ranks=2)
    assert one.split()["limit_bytes"] == 8 << 30 and two.split()["limit_bytes"] == 4 << 30
    assert "2 tensor-parallel ranks" in two.split()["limit_source"]
    assert two.experts == -(-one.experts // 2)
    given = _host_plan(path, None, None, 1000, KVCacheConfig(), "cpu", ranks=2)
    assert given.host_cache == 500  # --host-memory 1000 bytes for the worker: 500 a rank (experts on disk)
