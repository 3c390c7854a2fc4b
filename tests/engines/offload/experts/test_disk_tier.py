"""The disk tier: experts in an expert store file, host memory an LRU of slots over it, reads prefetched.

Exactness: whatever the host budget, the engine computes every expert from the same stored bytes with the same
kernels, so greedy tokens equal transformers' (fp32, every family, policy and fraction) and the in-memory engine's
(quantized formats: the same tokens and logits). Budgets here hold the pinned experts plus one token's top-k per
layer, so nearly every step reads from disk.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from offload_helpers import FAMILIES, greedy, moe_layers, placement, stock

from moe_offload.engines.offload.experts import diskstore
from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.errors import ConfigError, ModelError

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]
N_TOKENS = 16
TOP_K = 2  # every tiny family routes 2 experts per token


@pytest.fixture(autouse=True)
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    return tmp_path / "stores"


def records(path, **kw) -> int:
    """Bytes of one host slot in every MoE layer (the unit host budgets are counted in)."""
    om = load_model(path, None, host_cache=10**12, **kw)
    om.executor.close()
    return sum(s.store.entry.record_bytes for s in om.executor.layers)


def load_tight(path, fraction, policy, extra=0, **kw):
    """The smallest host budget for this placement (pinned + top-k slots per layer) plus ``extra`` slots."""
    layers, E = moe_layers(path)
    pl = placement(layers, E, fraction, policy)
    pinned = round(fraction * E) if policy == "static" else (round(fraction * E) // 2 if policy == "hybrid" else 0)
    budget = records(path, **{k: v for k, v in kw.items() if k in ("dtype", "expert_dtype")}) * (pinned + TOP_K + extra)
    return load_model(path, pl, policy=policy, host_cache=budget, hybrid_threshold=2 if policy == "hybrid" else None, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_with_experts_on_disk(checkpoints, family):
    path = checkpoints(family)
    ref_tokens, ref_logits = greedy(stock(path), PROMPT, N_TOKENS)
    for policy in ("static", "lru", "hybrid"):
        for fraction in (0.0, 0.25):
            om = load_tight(path, fraction, policy)
            tokens, logits = greedy(om.model, PROMPT, N_TOKENS)
            where = f"{family} {policy} fraction={fraction}"
            assert tokens == ref_tokens, where
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5, msg=where)
            d = om.executor.stats.snapshot()["disk"]
            # a budget of top-k slots per layer cannot hold a 16-token run's experts: reads happen every few steps
            assert d["demand_reads"] > N_TOKENS // 2 and d["disk_bytes"] > 0, where
            om.executor.close()


@pytest.mark.parametrize("extra", [0, 1, 3, 100])
def test_every_host_budget_gives_the_same_tokens(checkpoints, extra):
    path = checkpoints("qwen3_moe")
    ref = greedy(load_model(path, None).model, PROMPT, N_TOKENS)
    om = load_tight(path, 0.0, "static", extra=extra)
    tokens, logits = greedy(om.model, PROMPT, N_TOKENS)
    assert tokens == ref[0]
    assert torch.equal(logits, ref[1])  # same bytes, same kernels: bit for bit
    d = om.executor.stats.snapshot()["disk"]
    if extra >= 100:  # every expert fits: each is read once at most, never evicted
        assert d["disk_reads"] <= sum(s.store.num_experts for s in om.executor.layers)


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "deepseek_v3_fp8"])
def test_quantized_checkpoints_from_disk_equal_in_memory(quantized_checkpoints, name):
    path = quantized_checkpoints(name)
    ref = greedy(load_model(path, None, dtype="float32").model, PROMPT, N_TOKENS)
    om = load_tight(path, 0.25, "static", dtype="float32")
    assert om.executor.layers[0].store.format == {"gpt_oss_mxfp4": "mxfp4", "deepseek_v3_fp8": "fp8"}[name]
    tokens, logits = greedy(om.model, PROMPT, N_TOKENS)
    assert tokens == ref[0]
    torch.testing.assert_close(logits, ref[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("expert_dtype", ["int8", "fp8", "bf16"])
def test_expert_dtype_store_equals_in_memory(checkpoints, expert_dtype):
    """--expert-dtype quantizes once, into the store file: the records hold what the in-memory store would."""
    path = checkpoints("qwen3_moe")
    mem = load_model(path, None, dtype="bfloat16", expert_dtype=expert_dtype)
    ref = greedy(mem.model, PROMPT, N_TOKENS)
    om = load_tight(path, 0.0, "static", dtype="bfloat16", expert_dtype=expert_dtype)
    assert om.executor.layers[0].store.format == mem.executor.layers[0].store.format
    for a, b in zip(mem.executor.layers, om.executor.layers):  # expert 5's bytes, as stored
        for x, y in zip(a.store.expert(5), b.store.expert(5)):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    tokens, logits = greedy(om.model, PROMPT, N_TOKENS)
    assert tokens == ref[0]
    assert torch.equal(logits, ref[1])


def test_prefetch_is_measured_and_changes_no_token(checkpoints, monkeypatch):
    from moe_offload.engines.offload.experts import prefetch

    monkeypatch.setattr(prefetch, "USEFUL", 0.0)  # the gate open: every decode step's next layer is read ahead
    path = checkpoints("qwen3_moe")
    on = load_tight(path, 0.0, "static", extra=2, prefetch=True)
    off = load_tight(path, 0.0, "static", extra=2, prefetch=False)
    a, b = greedy(on.model, PROMPT, N_TOKENS), greedy(off.model, PROMPT, N_TOKENS)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    d_on, d_off = on.executor.stats.snapshot()["disk"], off.executor.stats.snapshot()["disk"]
    assert d_off["prefetch_reads"] == 0 and d_off["predicted"] == 0
    assert d_on["prefetch_reads"] > 0 and d_on["predicted"] > 0
    assert 0 < d_on["prefetch_precision"] <= 1 and 0 < d_on["prefetch_recall"] <= 1
    assert d_on["prefetch_hits"] <= d_on["prefetch_reads"]
    # each read is one expert: the bytes are reads times its size (in place: its tensors, not the padded record)
    rb = {s.store.entry.read_bytes for s in on.executor.layers}
    assert len(rb) == 1 and d_on["disk_bytes"] == d_on["disk_reads"] * rb.pop()


def test_prefetch_that_does_not_pay_is_reduced_to_probes(checkpoints, monkeypatch):
    from moe_offload.engines.offload.experts import prefetch

    monkeypatch.setattr(prefetch, "USEFUL", 1.01)  # never useful enough: one probe read per PROBE layer calls
    om = load_tight(checkpoints("qwen3_moe"), 0.0, "static", extra=2, prefetch=True)
    greedy(om.model, PROMPT, N_TOKENS)
    calls = om.executor.prefetcher.calls
    assert calls == N_TOKENS - 1  # decode steps (the prefill's 8 tokens are too many to guess for), 2 MoE layers
    assert om.executor.stats.snapshot()["disk"]["prefetch_reads"] <= calls // prefetch.PROBE


def test_budget_below_the_working_set_names_the_minimum(checkpoints):
    path = checkpoints("qwen3_moe")
    rb = records(path)
    with pytest.raises(ConfigError, match=r"expected at least 2 \(the experts one token routes to\): 0\.000 GiB"):
        load_model(path, placement(*moe_layers(path), 0.0, "static"), host_cache=rb * TOP_K - 1)
    with pytest.raises(ConfigError, match="pinned"):
        load_model(path, placement(*moe_layers(path), 0.5, "static"), host_cache=rb * (TOP_K + 1))


def test_a_damaged_store_is_written_again_never_read_and_a_vanished_one_fails_the_request(checkpoints, store_dir):
    from moe_offload.engines.offload.loading.convert import convert_checkpoint

    path = checkpoints("qwen3_moe")  # fp32 weights computed in bf16: a cast at load, so the store is a copy
    want = greedy(load_model(path, placement(*moe_layers(path), 1.0, "static"), dtype="bfloat16").model,
                  PROMPT, N_TOKENS)[0]
    om = load_tight(path, 0.0, "static", dtype="bfloat16")
    om.executor.close()
    (store,) = list(store_dir.iterdir())
    data = store / diskstore.DATA
    good = data.read_bytes()
    os.truncate(data, len(good) - 4096)  # truncated: found at open by its size, written again, then served exactly
    om = load_tight(path, 0.0, "static", dtype="bfloat16")
    assert data.read_bytes() == good and greedy(om.model, PROMPT, N_TOKENS)[0] == want
    om.executor.close()
    os.truncate(data, len(good) - 4096)
    os.truncate(data, len(good))  # the size is back but the last record is zeros: the checksum finds it
    assert not diskstore.verify(diskstore.read_manifest(store))
    man, written = convert_checkpoint(path, "bfloat16")  # `moe-offload convert` verifies what it finds
    assert written and diskstore.verify(man) and data.read_bytes() == good
    # a store of another checkpoint under this name (a directory copied over): written again, not read
    doc = json.loads((store / diskstore.MANIFEST).read_text())
    (store / diskstore.MANIFEST).write_text(json.dumps({**doc, "checkpoint": "/elsewhere/model"}))
    om = load_tight(path, 0.0, "static", dtype="bfloat16")
    assert json.loads((store / diskstore.MANIFEST).read_text())["checkpoint"] == str(Path(path).resolve())
    os.truncate(data, 0)  # mid-run: the next read is short
    with pytest.raises(ModelError, match=r"model\.layers\.\d+\.mlp\.experts expert \d+: read 0 of"):
        greedy(om.model, PROMPT, N_TOKENS)


def test_a_checkpoint_that_needs_no_new_layout_is_read_in_place(checkpoints, store_dir, tmp_path):
    """fp32 safetensors computed in fp32: the store is a manifest of the checkpoint's extents (< 5 % of it on disk,
    no experts.bin); a checkpoint file changed after makes it stale (written again), and one cut mid-run fails the
    request with a message naming the file, not the process."""
    import shutil

    src = Path(checkpoints("qwen3_moe"))
    path = tmp_path / "model"
    shutil.copytree(src, path)  # changed below: a copy of its own
    want = greedy(load_model(str(path), placement(*moe_layers(str(path)), 1.0, "static")).model, PROMPT, N_TOKENS)[0]
    om = load_tight(str(path), 0.0, "static")
    assert greedy(om.model, PROMPT, N_TOKENS)[0] == want
    om.executor.close()
    (store,) = list(store_dir.iterdir())
    man = diskstore.read_manifest(store)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert man.in_place and not man.data_path.exists() and man.disk_bytes < 0.05 * weights
    entry = next(iter(man.layers.values()))
    assert len(entry.extents) == entry.num_experts and len(entry.extents[0]) == 3  # gate, up, down
    shard = next(path.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the file changed
    assert diskstore.read_manifest(store) is None  # stale: never read (the store of the changed file is another)
    om = load_tight(str(path), 0.0, "static")  # written again (in place again), same tokens
    assert greedy(om.model, PROMPT, N_TOKENS)[0] == want
    assert [diskstore.read_manifest(d) is not None for d in sorted(store_dir.iterdir(), key=lambda d: d != store)] \
        == [False, True]
    om.executor.close()
    # a file cut under the engine: the read names the file, the layer and the expert (the dense weights of a
    # truncated file are memory-mapped, so the cut is made on a copy the store's descriptor is pointed at)
    man = diskstore.read_manifest(next(d for d in store_dir.iterdir() if d != store))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(shard.read_bytes()[:4096])
    f = diskstore.StoreFile(man)
    os.close(f.fds[0])
    f.fds[0] = os.open(cut, os.O_RDONLY)
    entry = max(man.layers.values(), key=lambda x: x.layer)
    with pytest.raises(ModelError, match=r"model\.safetensors: model\.layers\.\d+\.mlp\.experts expert 7: read 0 of"):
        f.read(entry, 7, diskstore.aligned_empty(entry.record_bytes))
    f.close()


def test_a_store_copy_the_disk_cannot_hold_is_refused_before_a_byte_is_written(checkpoints, store_dir, monkeypatch):
    from moe_offload.engines.offload.loading import convert

    path = checkpoints("qwen3_moe")
    from moe_offload import hostmem

    monkeypatch.setattr(hostmem, "disk_free", lambda where=None: (4096, str(where)))
    with pytest.raises(ConfigError, match=r"disk tier: the expert store copy needs 0\.\d+ GiB at .*4096|has 0\.00 GiB free"):
        convert.convert_checkpoint(path, "bfloat16")
    assert not store_dir.exists() or not any(store_dir.rglob(diskstore.DATA))
    man, written = convert.convert_checkpoint(path)  # in place needs no room: written
    assert written and man.in_place


def test_a_copy_says_why_the_checkpoint_is_not_read_in_place(checkpoints, store_dir):
    from structlog.testing import capture_logs

    from moe_offload.engines.offload.loading import convert

    with capture_logs() as logs:
        man, written = convert.convert_checkpoint(checkpoints("mixtral"), "bfloat16")  # fp32 files, bf16 compute
    assert written and not man.in_place
    (why,) = [e["why"] for e in logs if e["event"].startswith("expert store copied")]
    assert "is float32, the engine computes in bfloat16" in why, why


def test_store_records_are_aligned_views(tmp_path):
    from moe_offload.engines.offload.experts.store_writer import StoreWriter

    w = StoreWriter(tmp_path, "bfloat16")
    w.begin_layer("m.experts", 1, 3)
    experts = [(torch.randn(6, 5).bfloat16(), torch.randn(5, 3).bfloat16(), None, None) for _ in range(3)]
    for t in experts:
        w.add_expert(t)
    w.end_layer()
    w.close()
    man = diskstore.read_manifest(tmp_path)
    entry = man.layers["m.experts"]
    assert entry.record_bytes % diskstore.ALIGN == 0 and entry.offset % diskstore.ALIGN == 0
    assert entry.tensors[1].offset % diskstore.TENSOR_ALIGN == 0
    f = diskstore.StoreFile(man)
    buf = diskstore.aligned_empty(2 * entry.record_bytes).view(2, entry.record_bytes)
    assert buf.data_ptr() % diskstore.ALIGN == 0
    f.read(entry, 2, buf[1])
    up, down, us, ds = diskstore.views(entry, buf)
    assert torch.equal(up[1], experts[2][0]) and torch.equal(down[1], experts[2][1]) and us is None and ds is None
    f.close()
    (tmp_path / diskstore.MANIFEST).write_text("{not json")
    with pytest.raises(ModelError, match="not an expert store manifest"):
        diskstore.read_manifest(tmp_path)


def test_engine_reports_the_disk_tier_and_survives_a_store_cut_mid_run(checkpoints, store_dir):
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams
    from moe_offload.errors import EngineError

    path = checkpoints("qwen3_moe")  # in bf16: a store copy (cast at load)
    ref = list(build_offload_engine(path, dtype="bfloat16").generate(PROMPT, SamplingParams(max_tokens=8,
                                                                                             ignore_eos=True)))
    engine = build_offload_engine(path, dtype="bfloat16", host_memory=records(path, dtype="bfloat16") * (TOP_K + 1))
    try:
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        assert list(gen) == ref
        d = gen.stats.to_dict()["disk"]
        assert d["disk_reads"] > 0 and d["disk_bytes_per_token"] > 0 and 0 <= d["host_hit_rate"] < 1
        assert gen.stats.bytes_moved["disk"] == d["disk_bytes"] > 0
        assert engine.stats()["disk"]["disk_bytes"] == d["disk_bytes"]  # the engine's totals carry it too
        (store,) = list(store_dir.iterdir())
        data = store / diskstore.DATA
        saved = data.read_bytes()
        data.unlink()  # vanished: the open descriptor still reads the old file, so truncate what it points at
        with open(data, "wb"):
            pass
        os.truncate(f"/proc/self/fd/{engine.executor.layers[0].store.file.fd}", 0)
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        with pytest.raises(EngineError, match="expert store is truncated"):
            list(gen)
        os.truncate(f"/proc/self/fd/{engine.executor.layers[0].store.file.fd}", 0)
        with open(f"/proc/self/fd/{engine.executor.layers[0].store.file.fd}", "wb") as f:
            f.write(saved)  # the bytes are back: the next request is served, and no slot kept a failed read
        assert list(engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))) == ref
    finally:
        engine.close()


def test_a_written_store_is_read_lazily_when_every_expert_fits(checkpoints, monkeypatch):
    """With an expert store on disk and room for every expert, the engine reads them in the background from the
    store (one copy in memory, a forward waits only for what it routes to): same tokens, every expert read once."""
    from moe_offload.engines.offload.loading.convert import convert_checkpoint
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    path = checkpoints("qwen3_moe")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = build_offload_engine(path)
    assert plain.executor.disk is None  # no store yet: the in-memory load
    ref = list(plain.generate(PROMPT, params))
    plain.close()
    man, written = convert_checkpoint(path)
    assert written and convert_checkpoint(path)[1] is False  # written once, found after
    dropped = []
    monkeypatch.setattr(diskstore.os, "posix_fadvise", lambda *a: dropped.append(a), raising=False)
    engine = build_offload_engine(path)
    layers = engine.executor.layers
    assert all(s.store.num_slots == s.store.num_experts == len(s.cache.pinned) for s in layers)
    # every expert has its slot for the run: reads leave the page cache be (a restart reads from memory, as mmap)
    assert engine.executor.store_file.keep_cache and not engine.executor.store_file.direct
    assert list(engine.generate(PROMPT, params)) == ref
    stores = [s.store for s in layers]
    engine.close()  # waits for the background reads
    assert dropped == []
    # a --host-memory budget (here one that holds every expert) keeps the host cache the only copy: pages dropped
    budgeted = build_offload_engine(path, host_memory=10 * 2**30)
    assert budgeted.executor.store_file.keep_cache is False
    assert list(budgeted.generate(PROMPT, params)) == ref
    budgeted.close()
    assert dropped
    # every slot holds its expert's record: the bytes the in-memory engine computed with
    mem = load_model(path, None)
    for st, ref_layer in zip(stores, mem.executor.layers):
        assert all(f.done() and f.exception() is None for f in st.pending.values())
        for e in range(st.num_experts):
            assert torch.equal(st.views(e)[0], ref_layer.store.expert(e)[0])


def test_a_three_tier_placement_pins_its_host_experts_and_keeps_the_tokens(checkpoints):
    # plan --host-memory's placement: the accelerator's pinned experts, host-pinned experts (never evicted from the
    # host slots), the rest homed on the disk tier; tokens as the in-memory engine's
    import numpy as np

    from moe_offload import backends
    from moe_offload.control import placement as P
    from moe_offload.control.profile import Profile
    from moe_offload.control.spec import ModelSpec

    path = checkpoints("qwen3_moe")
    spec = ModelSpec.from_hf_config(path)
    counts = [[(e * 7 + layer) % spec.num_experts + 1 for e in range(spec.num_experts)] for layer in spec.moe_layers]
    prof = Profile(spec.name, spec.moe_layers, np.array(counts), source="counts")
    acc = P.accelerator_tiers(backends.get_backend("cpu").tiers())
    pl = P.plan(spec, acc, {acc[0].name: 1}, "top", prof, host_slots=TOP_K + 2)
    host = pl.host_tier
    assert all(len(lp.pinned(host)) == 2 and lp.pinned("disk") for lp in pl.layers)
    ref = greedy(load_model(path, None).model, PROMPT, N_TOKENS)
    om = load_model(path, pl, policy="static", host_cache=records(path) * (1 + TOP_K + 2))
    try:
        for state in om.executor.layers:  # host slots: the accelerator's pinned expert (a CPU alias) + the plan's two
            lp = pl.layer(state.layer)
            assert set(state.store.pinned) == set(lp.pinned(acc[0].name)) | set(lp.pinned(host))
        tokens, logits = greedy(om.model, PROMPT, N_TOKENS)
        assert tokens == ref[0]
        torch.testing.assert_close(logits, ref[1], rtol=0, atol=1e-5)
    finally:
        om.executor.close()


def test_host_pins_only_where_a_layer_keeps_experts_on_disk():
    # a layer whose remaining experts all fit in host memory homes them on host as "on no accelerator": pinning all
    # of them (plus top-k for reads) would refuse a placement that fits
    from moe_offload.engines.offload.loading.loader import host_pins
    from rm_core import LayerPlacement, MemoryTier, Placement

    tiers = (MemoryTier("acc", "device-hbm", 1 << 30, accelerator="n0/cpu:0"), MemoryTier("host", "host-dram", 1 << 30),
             MemoryTier("disk", "disk", 1 << 30))
    pl = Placement("m", tiers, (LayerPlacement(0, ("acc", "host", "host", "disk"), {"acc": 1, "host": 3}),
                                LayerPlacement(1, ("acc", "acc", "host", "host"), {"acc": 2})), "top")
    assert host_pins(pl) == {0: [1, 2]}
    assert host_pins(Placement("m", tiers[:2], (LayerPlacement(0, ("acc", "host", "host", "host"), {"acc": 1}),),
                               "top")) == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_registry_names_the_expert_layout_the_modules_have(checkpoints, family):
    """spec's in-place prediction reads the registry's expert_layout; the engine reads the module: they agree."""
    from transformers import AutoConfig

    from moe_offload.control.families import family_of
    from moe_offload.engines.offload.loading.architecture import meta_model

    path = checkpoints(family)
    experts = [m for m in meta_model(AutoConfig.from_pretrained(path), torch.float32).modules()
               if hasattr(m, "is_transposed")]
    assert experts and all((family_of(family).expert_layout == "transposed") == m.is_transposed for m in experts)


def _experts(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g).bfloat16(), torch.randn(5, 3, generator=g).bfloat16(), None, None)
            for _ in range(n)]


def test_a_store_is_never_half_read_and_a_failed_write_leaves_nothing(tmp_path):
    from moe_offload.engines.offload.loading.direct import write_store

    info = type("Info", (), {"name": "m.experts", "layer": 1, "num_experts": 3})()
    old = write_store(tmp_path, "bfloat16", "ckpt", [info], lambda: "a copy", lambda i: ((t, False) for t in _experts(3, 0)))
    reader = open(old.data_path, "rb")  # a running worker's open store
    before = reader.read()

    def cut(_info):  # the disk fills after the first record
        yield _experts(1, 1)[0], False
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_store(tmp_path, "bfloat16", "other ckpt", [info], lambda: "a copy", cut)
    assert sorted(p.name for p in tmp_path.iterdir()) == [diskstore.LOCK]  # no partial file (the old data: unlinked)
    assert diskstore.read_manifest(tmp_path) is None  # the old store is not taken for the new checkpoint's
    new = write_store(tmp_path, "bfloat16", "other ckpt", [info], lambda: "a copy",
                      lambda i: ((t, False) for t in _experts(3, 2)))
    assert new.meta["checkpoint"] == "other ckpt" and diskstore.verify(new)
    reader.seek(0)
    assert reader.read() == before  # the reader still has the store it opened, whole: the new one was renamed in
    reader.close()


def test_processes_opening_one_store_at_once_write_it_once(tmp_path):
    # every --tensor-parallel rank runs ensure_store on the same directory: one writes, the others wait and read it
    import threading

    from moe_offload.engines.offload.loading.direct import write_store

    info = type("Info", (), {"name": "m.experts", "layer": 1, "num_experts": 3})()
    writes, mans = [], []

    def records(_info):
        writes.append(1)
        for t in _experts(3, 0):
            time.sleep(0.05)  # a write that takes a while: the others arrive meanwhile
            yield t, False

    threads = [threading.Thread(target=lambda: mans.append(write_store(tmp_path, "bfloat16", "ckpt", [info],
                                                                        lambda: "a copy", records))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(writes) == 1 and len(mans) == 3 and all(m.data_bytes == mans[0].data_bytes for m in mans)
    assert diskstore.verify(mans[0])


def test_a_flipped_byte_or_an_io_error_fails_the_read_never_serves_it(tmp_path, monkeypatch):
    """A same-size experts.bin with one byte changed keeps its size (the open finds nothing wrong): the record's
    CRC-32 fails its first read, every time, so its bytes are never computed with; EIO fails the read too. Reads
    failing in a row make the store unhealthy; a good read in between resets the count."""
    import errno

    from moe_offload.engines.offload.loading.direct import write_store

    info = type("Info", (), {"name": "m.experts", "layer": 1, "num_experts": 3})()
    man = write_store(tmp_path, "bfloat16", "ckpt", [info], lambda: "a copy", lambda i: ((t, False) for t in _experts(3, 0)))
    entry = man.layers["m.experts"]
    with open(man.data_path, "r+b") as f:  # one bit of expert 1's up weights
        f.seek(entry.record_offset(1) + 5)
        b = f.read(1)
        f.seek(entry.record_offset(1) + 5)
        f.write(bytes([b[0] ^ 0x10]))
    man = diskstore.read_manifest(tmp_path)
    assert man is not None and not diskstore.verify(man)  # same size: found, but not what was written
    file = diskstore.StoreFile(man, direct=False)
    buf = diskstore.aligned_empty(entry.record_bytes)
    try:
        assert file.read(entry, 0, buf) == entry.record_bytes and file.health() is None
        for _ in range(2):
            with pytest.raises(ModelError, match="m.experts expert 1 does not match its checksum"):
                file.read(entry, 1, buf)
        assert file.health() is None  # two in a row: not yet
        file.read(entry, 2, buf)
        assert file.failed_in_row == 0  # a good read resets the count

        def eio(fd, views, offset):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(diskstore.os, "preadv", eio)
        for _ in range(diskstore.FAILURES_IN_ROW):
            with pytest.raises(ModelError, match="reading m.experts expert 0 failed: .*Input/output error"):
                file.read(entry, 0, buf)
        assert "failed 3 reads in a row" in file.health() and "Input/output error" in file.health()
    finally:
        file.close()


def test_an_engine_over_a_corrupt_store_fails_requests_and_then_its_health(checkpoints, tmp_path):
    """Every record of the store changed in place (same size): requests fail (the engine lives, no token computed
    from the bad bytes), and the engine reports itself unhealthy, naming the checksum (the reads at start fail
    already)."""
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    path = checkpoints("qwen3_moe")
    budget = records(path, dtype="bfloat16") * (TOP_K + 1)
    build_offload_engine(path, dtype="bfloat16", host_memory=budget).close()  # fp32 -> bf16: a store copy written
    (man,) = [diskstore.read_manifest(d) for d in Path(os.environ["MOE_OFFLOAD_STORE_DIR"]).iterdir()
              if diskstore.read_manifest(d) is not None and not diskstore.read_manifest(d).in_place]
    with open(man.data_path, "r+b") as f:
        for entry in man.layers.values():
            for e in range(entry.num_experts):
                f.seek(entry.record_offset(e))
                b = f.read(1)
                f.seek(entry.record_offset(e))
                f.write(bytes([b[0] ^ 0x01]))
    engine = build_offload_engine(path, dtype="bfloat16", host_memory=budget)
    try:
        assert engine.executor.disk is not None
        for _ in range(2):
            gen = engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
            with pytest.raises(Exception, match="generation failed"):
                list(gen)
        assert "does not match its checksum" in engine.health()
    finally:
        engine.close()


def test_a_checkpoint_truncated_under_a_running_engine_fails_requests_not_the_process(checkpoints, tmp_path):
    """safetensors loads tensors as views of its memory map: a file truncated under a running worker would kill it
    with SIGBUS at the next touch of a dense weight. The loader copies them out of the map, and the disk tier reads
    experts with pread, so the truncation fails requests (a short read) and the process lives."""
    import shutil
    import subprocess
    import sys

    src = Path(checkpoints("qwen3_moe"))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    budget = records(str(src)) * (TOP_K + 1)  # 3 slots a layer: nearly every step reads experts from the file
    code = f"""
import os, sys
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
path = {str(ckpt)!r}
engine = build_offload_engine(path, host_memory={budget})
p = SamplingParams(max_tokens=4, ignore_eos=True)
assert len(list(engine.generate([3, 17, 42], p))) == 4
f = os.path.join(path, "model.safetensors")
os.truncate(f, os.path.getsize(f) // 4)
for _ in range(3):
    gen = engine.generate([5, 6, 7, 8], p)
    try:
        list(gen)
    except Exception as e:
        print("request failed:", type(e).__name__)
print("alive", engine.health() is not None)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MOE_OFFLOAD_STORE_DIR": str(tmp_path / "stores")})
    assert r.returncode == 0, (r.returncode, r.stderr[-1500:])  # -7 would be SIGBUS
    assert r.stdout.count("request failed") == 3 and "alive True" in r.stdout, r.stdout
