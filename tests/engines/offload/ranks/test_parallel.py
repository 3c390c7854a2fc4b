"""Expert parallel on torch.distributed (--tensor-parallel 2, gloo): two processes, each with half of every layer's
experts, give transformers' greedy tokens for every family, solo and batched.

Why these could fail: a rank's rows of another rank's experts must be exactly zero before the rows are summed (an
uninitialised buffer adds garbage), in the per-layer loop and in the whole-step call alike; the ranks must run the
same forwards in the same order (a request started, aborted or sampled differently on one rank desynchronises every
collective after it); the statistics are summed over the ranks once per forward, so a rank that skips a forward
hangs or miscounts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from offload_helpers import FAMILIES, staggered
from offload_helpers import references as shared_references
from transformers import AutoConfig

from moe_offload.engines.offload.ranks.dense_split import split
from moe_offload.engines.offload.ranks.parallel import share
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61])
LENGTHS = (10, 6, 8)


def _params(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["static", "lru", "hybrid"])
def test_two_ranks_give_transformers_tokens_solo_and_batched(checkpoints, family, policy):
    path = checkpoints(family)
    expected = shared_references(path, PROMPTS, LENGTHS)
    engine = build_offload_engine(path, policy=policy, fraction=0.5, tensor_parallel=2, max_num_batched_tokens=16)
    try:
        assert engine.executor.ep == (0, 2)
        solo = [list(engine.generate(p, _params(n))) for p, n in zip(PROMPTS, LENGTHS)]
        assert solo == expected
        batched, gens = staggered(engine, PROMPTS, LENGTHS)
        assert batched == expected
        for g, n in zip(gens, LENGTHS):  # every rank's pairs: each token routes top-k pairs in every MoE layer
            s = g.stats
            assert s.hits + s.misses == (s.prompt_tokens + n - 1) * _pairs_per_token(engine)
        ranks = engine.stats()["ranks"]
        assert len(ranks) == 2 and all(r["hits"] + r["misses"] > 0 for r in ranks)
        assert engine.stats()["hits"] == sum(r["hits"] for r in ranks)
    finally:
        engine.close()


def _pairs_per_token(engine) -> int:
    cfg = engine.model.config.get_text_config()
    k = getattr(cfg, "num_experts_per_tok", None) or cfg.num_experts_per_token
    return k * len(engine.executor.layers)


def test_aborts_and_unseeded_sampling_keep_the_ranks_in_step(checkpoints):
    path = checkpoints("qwen3_moe")
    expected = shared_references(path, PROMPTS, LENGTHS)
    engine = build_offload_engine(path, fraction=0.5, tensor_parallel=2)
    try:
        gone = engine.start(PROMPTS[0], _params(30))
        engine.step()
        engine.step()
        gone.close()  # aborted on rank 0 between steps: the other rank must drop it before its next step
        sampled = list(engine.generate(PROMPTS[1], _params(8, temperature=1.0)))  # no seed: rank 0 picks one
        assert len(sampled) == 8
        assert [list(engine.generate(p, _params(n))) for p, n in zip(PROMPTS, LENGTHS)] == expected
    finally:
        engine.close()


def test_share_gives_each_rank_its_experts():
    from rm_core import LayerPlacement, MemoryTier, Placement

    tiers = (MemoryTier("cpu:0", "host-dram", 1, accelerator="n/cpu:0"), MemoryTier("host", "host-dram", 1))
    home = ("cpu:0", "cpu:0", "cpu:0", "host", "host", "host")
    p = Placement(model="m", tiers=tiers, layers=(LayerPlacement(0, home, {"cpu:0": 5}),), policy="mix:3")
    r0, r1 = share(p, 0, 2).layers[0], share(p, 1, 2).layers[0]
    assert r0.pinned("cpu:0") == [0, 2] and r1.pinned("cpu:0") == [1]
    assert r0.slots == {"cpu:0": 3} and r1.slots == {"cpu:0": 2}  # pinned of its own + half the 2 dynamic


def test_what_tensor_parallel_refuses(checkpoints):
    path = checkpoints("qwen3_moe")
    for bad, match in (({"tensor_parallel": 0}, "tensor_parallel"), ({"tensor_parallel": 2, "tail_skip": 1}, "tail_skip"),
                       ({"tensor_parallel": 2, "devices": "cpu,cpu"}, "devices"),
                       ({"tensor_parallel": 2, "device": "cuda:0"}, "one GPU per rank")):
        with pytest.raises(ConfigError, match=match):
            build_offload_engine(path, **bad)
    with pytest.raises(ConfigError, match="rank 0: .*rank 1: "):  # every rank's failure, and no rank left running
        build_offload_engine(path, tensor_parallel=2, placement=str(Path(path) / "config.json"))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_two_ranks_over_the_disk_tier(checkpoints, family, tmp_path, monkeypatch):
    # host memory for a few experts: each rank caches its own experts over the checkpoint read in place, in its half
    # of --host-memory (the ranks share the worker's memory)
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    path = checkpoints(family)
    expected = shared_references(path, PROMPTS, LENGTHS)
    engine = build_offload_engine(path, fraction=0.0, host_memory=80_000, tensor_parallel=2)
    try:
        assert engine.memory_plan["experts_tier"] == "disk"
        gens = [engine.generate(p, _params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        assert [list(g) for g in gens] == expected
        ranks = engine.stats()["ranks"]
        per_rank = [r["disk"]["disk_bytes"] for r in ranks]
        assert all(b > 0 for b in per_rank)  # both ranks read their experts from disk ...
        assert sum(g.stats.disk["disk_bytes"] for g in gens) == sum(per_rank)  # ... and the requests count both
    finally:
        engine.close()


@pytest.mark.parametrize("case", ["gpt_oss_mxfp4", "deepseek_v3_fp8", "int8", "fp8"])
def test_two_ranks_in_every_expert_format(checkpoints, quantized_checkpoints, case):
    # experts as shipped (MXFP4, FP8 blocks) or quantized at load: the ranks give the one-process tokens
    if case in ("int8", "fp8"):
        path, opts = checkpoints("qwen3_moe"), {"expert_dtype": case, "dtype": "bfloat16"}
    else:
        path, opts = quantized_checkpoints(case), {}
    outs = []
    for tp in (None, 2):
        engine = build_offload_engine(path, fraction=0.5, tensor_parallel=tp, **opts)
        try:
            outs.append([list(engine.generate(p, _params(n))) for p, n in zip(PROMPTS, LENGTHS)])
        finally:
            engine.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_two_ranks_take_the_whole_step_call_bit_for_bit(checkpoints, family):
    # bf16, every expert resident: each rank's decode steps run in one C++ call that computes its experts' pairs and
    # sums the rows over the ranks itself; the logprobs of every token must be the one-process ones bit for bit
    # (x + 0 = x: a rank's rows of another rank's experts must be exact zeros, the pairs grouped as one process does)
    path = checkpoints(family)
    outs = []
    for tp in (None, 2):
        engine = build_offload_engine(path, dtype="bfloat16", fraction=1.0, tensor_parallel=tp)
        try:
            gens, toks = [], []
            for p, n in zip(PROMPTS, LENGTHS):
                before = engine.runner.fast.step_call.calls
                gens.append(engine.generate(p, _params(n, logprobs=1)))
                toks.append(list(gens[-1]))
                assert engine.runner.fast.step_call.calls - before == n - 1  # every decode step in the one call
            outs.append((toks, [[(e.token, e.logprob) for e in g.logprobs] for g in gens]))
            for g, n in zip(gens, LENGTHS):  # every rank's pairs, each a slot hit
                assert (g.stats.hits, g.stats.misses) == ((g.stats.prompt_tokens + n - 1) * _pairs_per_token(engine), 0)
            if tp:  # rank 0 read its half of the LM head (parallel.VocabShard), the logits gathered from both
                assert engine.model.lm_head.sizes == split(engine.model.config.get_text_config().vocab_size, 2)
                assert engine.model.lm_head.part.out_features == engine.model.lm_head.sizes[0]
            assert engine.runner.graph.steps >= len(PROMPTS)  # every prefill through the owned graph
            if tp:  # rank 1 took the call at the same steps (the ranks agree; a rank's own choice could differ)
                assert [r["whole_step_forwards"] for r in engine.stats()["ranks"]] == [sum(LENGTHS) - len(LENGTHS)] * 2
        finally:
            engine.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("opts", [{}, {"expert_dtype": "int8"}], ids=["bf16", "int8"])
def test_two_ranks_run_several_sequences_in_the_whole_step_call(checkpoints, opts):
    # three sequences in every decode step (M = 3, then 2), bf16 or int8 experts: each rank's call computes its pairs
    # of every sequence; the tokens are the one-process ones, and every decode step on both ranks ran in the call
    path = checkpoints("qwen3_moe")
    outs = []
    for tp in (None, 2):
        engine = build_offload_engine(path, dtype="bfloat16", fraction=1.0, tensor_parallel=tp,
                                      max_num_batched_tokens=64, **opts)
        try:
            gens = [engine.start(p, _params(n)) for p, n in zip(PROMPTS, LENGTHS)]
            steps = 0
            while engine.step():
                steps += 1
            outs.append([g.drain() for g in gens])
            decode_steps = max(LENGTHS) - 1  # one prefill step for the three prompts, then one step a token
            assert steps == 1 + decode_steps
            calls = [r["whole_step_forwards"] for r in engine.stats()["ranks"]] if tp else [
                engine.executor.stats.snapshot()["whole_step_forwards"]]
            assert calls == [decode_steps] * (tp or 1)
        finally:
            engine.close()
    assert outs[0] == outs[1]


def test_ranks_agree_on_the_whole_step_call(monkeypatch):
    # the call is built on every rank or on none: a rank whose build worked drops it when another's failed, and a rank
    # whose build raised still takes part in the agreement before raising (the others would wait for it forever)
    from types import SimpleNamespace

    from moe_offload.engines.offload.model import decode_step
    from moe_offload.engines.offload.ranks import parallel

    votes = []
    plan = SimpleNamespace(executor=SimpleNamespace(ep=(0, 2)))
    monkeypatch.setattr(parallel, "agree", lambda ok: votes.append(ok) or False)  # another rank could not build it
    assert decode_step._guarded(lambda p: "call", plan) is None and votes == [True]

    def broken(p):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        decode_step._guarded(broken, plan)
    assert votes == [True, False]
    monkeypatch.setattr(parallel, "agree", lambda ok: votes.append(ok) or ok)
    assert decode_step._guarded(lambda p: "call", plan) == "call" and votes[-1] is True
    plan.executor.ep = None  # one process: no agreement
    assert decode_step._guarded(lambda p: "call", plan) == "call" and len(votes) == 3


def test_the_cli_lets_ranks_share_cores_only_before_torch_loads():
    # OpenMP reads OMP_WAIT_POLICY when torch loads it: the CLI sets PASSIVE for N > 1 before any torch import, keeps
    # a policy the user set, and leaves one process alone
    code = ("import os, sys\nfrom moe_offload.commands.options import ranks_share_cores\n"
            "ranks_share_cores(int(sys.argv[1]))\nassert 'torch' not in sys.modules\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def policy(n, **extra):
        out = subprocess.run([sys.executable, "-c", code, str(n)], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()

    assert policy(2) == "PASSIVE"
    assert policy(1) == "None"
    assert policy(2, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_ranks_take_every_core_only_when_their_threads_sleep(monkeypatch):
    from moe_offload.engines.offload.ranks import parallel

    cores = os.cpu_count()
    monkeypatch.setattr(parallel, "PASSIVE", False)
    assert parallel.threads_per_rank(2) == max(1, cores // 2)
    monkeypatch.setattr(parallel, "PASSIVE", True)
    assert parallel.threads_per_rank(2) == cores


_HEAD_RANK = r"""
import sys, torch, torch.distributed as dist
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.loading.quant import BlockLinear, QuantLinear
from moe_offload.engines.offload.loading import ggml
from moe_offload.engines.offload.ranks.dense_split import VocabShard, shard_head
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
torch.manual_seed(0)
V, H = 37, 64  # 37 rows over 3 ranks: 13, 12, 12
x = torch.randn(2, H).to(torch.bfloat16)
for kind in ("bf16", "bias", "tied", "int8", "q8_0"):
    model = torch.nn.Module()
    embed = torch.nn.Embedding(V, H).to(torch.bfloat16)
    model.get_input_embeddings = lambda: embed
    head = torch.nn.Linear(H, V, bias=kind == "bias").to(torch.bfloat16)
    if kind == "tied":
        head.weight = embed.weight
    dispatch.patch_linears(head)
    if kind == "int8":
        head = QuantLinear(head)
    elif kind == "q8_0":
        head = BlockLinear(ggml.quantize(head.weight.detach().float(), "q8_0"), None)
    model.lm_head = head
    want = head(x)
    shard_head(model, rank, 3, rehome=False)
    got = model.lm_head(x)
    part = model.lm_head.part
    assert isinstance(model.lm_head, VocabShard) and model.lm_head.sizes == [13, 12, 12], kind
    assert part.out_features == [13, 12, 12][rank] and head.out_features == V, kind
    rows, whole = (part.weight_q, head.weight_q) if kind in ("int8", "q8_0") else (part.weight, head.weight)
    if kind == "tied":  # a view of the embeddings' rows
        assert rows.data_ptr() == embed.weight.data_ptr() + 2 * H * [0, 13, 25][rank]
    else:  # a copy: the whole head can be freed
        assert rows.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), kind
    assert torch.equal(got, want), (kind, (got.float() - want.float()).abs().max())
print("ok", rank)
dist.destroy_process_group()
"""


def test_each_rank_reads_its_rows_of_the_lm_head_and_gathers_the_one_process_logits():
    # three ranks, a vocabulary that does not split evenly (13, 12, 12 rows), an LM head of bf16 (with a bias, or
    # tied to the embeddings: then the rank's rows are a view, not a copy), int8 rows or ggml blocks: the gathered
    # logits are the whole head's bit for bit, in vocabulary order (a part placed at the wrong offset fails it)
    from moe_offload.engines.offload.ranks.parallel import _free_port

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _HEAD_RANK, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    assert [o.split() for o, _ in outs] == [["ok", str(r)] for r in range(3)]


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_ranks_split_heads_and_dense_mlps_where_the_modules_decode(checkpoints, family):
    # fp32: transformers' modules decode, so rank 0 keeps its half of the heads (q/k/v rows; o_proj's columns, the
    # partial outputs summed over the ranks) and of the shared expert's intermediate, and its KV pools hold its KV
    # heads alone; OLMoE's q/k norms span the whole projection (not one head): its attention stays whole, its
    # pools whole. The split comes before the KV pool is sized: a budget of 4 blocks of one process's KV holds 8 of
    # the rank's. The tokens (transformers', both ways) are test_two_ranks_give_transformers_tokens_solo_and_batched's.
    from moe_offload.engines.offload.ranks.dense_split import RankSum

    path = checkpoints(family)
    cfg = AutoConfig.from_pretrained(path)
    whole = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    heads = family == "olmoe" or 2  # the share of the heads each rank keeps: 1, or 1/2
    engine = build_offload_engine(path, fraction=0.5, tensor_parallel=2, kv_cache_memory=4 * 16 * whole)
    try:
        assert engine.kv_bytes_per_token * heads == whole and engine.pool.num_blocks == 4 * heads
        list(engine.generate(PROMPTS[0], _params(3)))
        assert engine.runner.fast is None
        attn = engine.model.model.layers[0].self_attn
        assert isinstance(attn.o_proj, RankSum) == (heads == 2)
        assert attn.q_proj.out_features * heads == cfg.num_attention_heads * attn.head_dim
        assert attn.k_proj.out_features * heads == cfg.num_key_value_heads * attn.head_dim
        assert engine.pool.layers[0][0].shape[1:] == (cfg.num_key_value_heads // heads, attn.head_dim)
        if family == "qwen2_moe":
            shared = engine.model.model.layers[0].mlp.shared_expert
            assert isinstance(shared.down_proj, RankSum)
            assert shared.gate_proj.out_features * 2 == cfg.shared_expert_intermediate_size
    finally:
        engine.close()


def test_attention_with_another_per_head_part_stays_whole():
    # a gate projection per head beside q/k/v/o (AFMoE's gate_proj, Step3p7's g_proj) would no longer line up with
    # the rank's heads: such attention is left whole; plain q/k/v/o is cut to rank 1's heads (GQA: 4 heads, 2 KV)
    from moe_offload.engines.offload.ranks.dense_split import RankSum, _split_heads

    def attention(gated):
        a = torch.nn.Module()
        a.head_dim = 8
        a.q_proj, a.k_proj, a.v_proj = (torch.nn.Linear(32, n * 8) for n in (4, 2, 2))
        a.o_proj = torch.nn.Linear(32, 32)
        if gated:
            a.gate_proj = torch.nn.Linear(32, 32)
        return a

    gated = attention(True)
    assert not _split_heads(gated, 4, 2, 1, 2) and gated.q_proj.out_features == 32
    plain = attention(False)
    whole = [plain.q_proj.weight.detach().clone(), plain.o_proj.weight.detach().clone()]
    assert _split_heads(plain, 4, 2, 1, 2)
    assert torch.equal(plain.q_proj.weight, whole[0][16:]) and plain.k_proj.out_features == 8
    assert isinstance(plain.o_proj, RankSum) and torch.equal(plain.o_proj.part.weight, whole[1][:, 16:])


def test_a_vision_towers_attention_stays_whole():
    # split_dense cuts attention by the text config's head counts, so only the text decoder's layers take them: a
    # vision tower's self_attn (2 heads of 16 where the text has 4 of 8, KV 2) keeps every head on every rank
    from types import SimpleNamespace

    from moe_offload.engines.offload.ranks.dense_split import RankSum, split_dense

    def block(heads, kv_heads, head_dim):
        a = torch.nn.Module()
        a.head_dim = head_dim
        a.q_proj, a.k_proj, a.v_proj = (torch.nn.Linear(32, n * head_dim) for n in (heads, kv_heads, kv_heads))
        a.o_proj = torch.nn.Linear(heads * head_dim, 32)
        layer = torch.nn.Module()
        layer.self_attn = a
        return layer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1))
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([block(4, 2, 8)])
            self.vision = torch.nn.ModuleList([block(2, 2, 16)])

        def forward(self, x):
            return x

        def get_decoder(self):
            return self.model

    model = Model()
    assert split_dense(model, 1, 2)["attention"] == 1
    assert isinstance(model.model.layers[0].self_attn.o_proj, RankSum)
    vision = model.vision[0].self_attn
    assert type(vision.o_proj) is torch.nn.Linear and vision.q_proj.out_features == 32
