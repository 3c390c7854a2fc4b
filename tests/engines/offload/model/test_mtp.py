"""MTP drafts (model/mtp.py): a checkpoint's multi-token-prediction layer drafts on the owned graph, and the output
stays the plain run's.

Why these could fail: the MTP layer reads the token *after* each row and the target's final-normed hidden state of
that row, keeps its own KV in the pool as one layer more, and must have run over every position of the sequence
(prefill chunks, accepted drafts, the rows after a rejection) for its attention to see the right past. A shift by one,
a KV row written to the wrong slot or skipped, the target's pre-norm state, or the enorm / hnorm halves swapped give
drafts other than the ones transformers' own modules compute from the same weights (the oracle here: the decoder
layer transformers loads from the same tensors as layer N of an N+1-layer model).
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import _configs, build_with_mtp, staggered

from moe_offload.engines.offload.model import mtp
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams, SpeculativeConfig
from moe_offload.errors import ConfigError

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23, 11, 4, 90, 33, 7, 2, 19, 64, 71, 8], [7, 7, 100, 2], [50, 51, 52, 53, 54])
LENGTHS = (12, 9, 14)
MTP = {"method": "mtp", "disable_by_batch_size": None}


# MLA with grouped routing; GQA with partial rotary (families.py's config); a softmax router (the trained demo's kind)
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):
    """family -> a tiny checkpoint of it that ships an MTP layer, built once."""
    from families import tiny_config

    root, cache = tmp_path_factory.mktemp("mtp"), {}

    def get(family: str) -> str:
        if family not in cache:
            config = _configs()[family]() if family != "glm4_moe" else tiny_config(family)
            cache[family] = build_with_mtp(config, root / family)
        return cache[family]

    return get


@pytest.fixture
def mtp_checkpoint(mtp_checkpoints):
    return mtp_checkpoints("deepseek_v3")


class Oracle:
    """transformers' modules over a whole sequence: the target's final-normed hidden rows, then the MTP layer (the
    N+1-layer model's last decoder layer, its enorm / hnorm / eh_proj / shared_head read from the checkpoint) ->
    the MTP logits at every position [L - 1, V] (row p: the token after p+1)."""

    def __init__(self, path: str):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        self.full = AutoModelForCausalLM.from_pretrained(f"{path}/full", attn_implementation="eager").eval()
        n = self.target.config.num_hidden_layers
        sd = load_file(f"{path}/model.safetensors")
        self.w = {k.removeprefix(f"model.layers.{n}."): v for k, v in sd.items() if k.startswith(f"model.layers.{n}.")}
        self.eps = self.target.config.rms_norm_eps

    def _norm(self, name, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(v + self.eps))

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        h = self.target.model(input_ids=ids).last_hidden_state[0, :-1]  # [L - 1, H]
        L = h.shape[0]
        e = self.full.model.embed_tokens(ids[:, 1:])[0]
        e[0] = 0.0  # position 0's embedding masked, as vLLM's DeepSeek MTP does
        x = torch.cat([self._norm("enorm.weight", e), self._norm("hnorm.weight", h)], -1) @ self.w["eh_proj.weight"].T
        pos = torch.arange(L).unsqueeze(0)
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        out = self.full.model.layers[-1](x.unsqueeze(0), attention_mask=mask, position_ids=pos,
                                         position_embeddings=self.full.model.rotary_emb(x.unsqueeze(0), pos))
        out = out[0] if isinstance(out, tuple) else out
        return self._norm("shared_head.norm.weight", out[0]) @ self.w["shared_head.head.weight"].T


def _record(engine):
    """Spy on the drafter: every draft it makes, with the sequence's tokens then and the MTP logits it came from."""
    seen, after, forward, out = [], engine.mtp.after, engine.mtp.forward, []

    def spy_forward(*args):
        out[:] = [forward(*args)]
        return out[0]

    def spy(last):
        after(last)
        rows = iter(out[0])
        for seq, *_ in last[3]:
            d = engine.mtp.drafts.get(seq.sid)
            if d is not None and d[0] == len(seq.tokens) and seq.state != "finished":
                seen.append((tuple(seq.tokens), d[1], next(rows)))

    engine.mtp.forward, engine.mtp.after = spy_forward, spy
    return seen


def _oracle_logits(path, recorded) -> list[torch.Tensor]:
    """The oracle's MTP logits at the row each recorded draft came from (the position before its last token)."""
    oracle, seqs = Oracle(path), {t for t, *_ in recorded}
    longest = [t for t in seqs if not any(len(o) > len(t) and o[: len(t)] == t for o in seqs)]
    logits = {t: oracle.logits(list(t)) for t in longest}
    return [logits[next(t for t in longest if t[: len(tokens)] == tokens)][len(tokens) - 2] for tokens, *_ in recorded]


class Every:
    """Drafts the plain run's next token, every other one off by one: verify steps accept and reject both."""

    def __init__(self, prompts, refs):
        self.cont, self.calls = {tuple(p): r for p, r in zip(prompts, refs)}, 0

    def propose(self, sid, tokens, k):
        self.calls += 1
        for p, ref in self.cont.items():
            if tuple(tokens[: len(p)]) == p and len(tokens) - len(p) < len(ref):
                t = ref[len(tokens) - len(p)]
                return [t if self.calls % 2 else (t + 1) % 128]
        return []

    def release(self, sid):
        pass


@pytest.mark.parametrize("family,policy,fraction", [("deepseek_v3", "static", 1.0), ("deepseek_v3", "lru", 0.5),
                                                     ("glm4_moe", "hybrid", 0.5), ("qwen3_moe", "static", 0.5)])
def test_mtp_drafts_are_the_layer_transformers_computes(mtp_checkpoints, family, policy, fraction):
    """fp32, three sequences staggered (prefill chunks beside decode rows); the first run drafts itself, the second
    verifies drafts that are right and wrong in turn while the MTP layer keeps up: every draft's MTP logits are the
    oracle's at that position, and the draft their argmax."""
    mtp_checkpoint = mtp_checkpoints(family)
    plain = build_offload_engine(mtp_checkpoint, max_num_batched_tokens=16)
    try:
        expected, _ = staggered(plain, PROMPTS, LENGTHS)
    finally:
        plain.close()
    for verified in (False, True):
        engine = build_offload_engine(mtp_checkpoint, max_num_batched_tokens=16, speculative=MTP, policy=policy,
                                      fraction=fraction)
        try:
            if verified:
                engine.proposer = Every(PROMPTS, expected)
            seen = _record(engine)
            out, gens = staggered(engine, PROMPTS, LENGTHS)
        finally:
            engine.close()
        assert out == expected
        assert all(g.stats.spec_drafts > 0 for g in gens)
        if verified:
            s = [g.stats for g in gens]
            assert sum(x.spec_accepted_tokens for x in s) > 0 and any(x.spec_accepted_tokens < x.spec_drafts for x in s)
        # a draft after every step of a sequence but its last: every token but its last, less the steps an accepted
        # draft saved
        assert len(seen) == sum(LENGTHS) - len(PROMPTS) - sum(g.stats.spec_accepted_tokens for g in gens)
        want = _oracle_logits(mtp_checkpoint, seen)
        for (tokens, draft, logits), ref in zip(seen, want):
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
            assert draft == int(ref.argmax()), tokens


def test_mtp_logits_of_a_prompt_match_the_oracle(mtp_checkpoint):
    prompt = PROMPTS[0]
    engine = build_offload_engine(mtp_checkpoint, speculative=MTP)
    got, forward = [], engine.mtp.forward

    def spy(ids, pos, hidden, step, rows):
        out = forward(ids, pos, hidden, step, rows)
        got.append((pos[rows].tolist(), out))
        return out

    engine.mtp.forward = spy
    try:
        g = engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        tokens = list(prompt) + list(g)
    finally:
        engine.close()
    positions, logits = got[0]  # the prompt's step: the draft after its first token
    assert positions == [len(prompt) - 1]
    torch.testing.assert_close(logits[0], Oracle(mtp_checkpoint).logits(tokens)[len(prompt) - 1], rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_with_mtp_drafts_are_the_plain_runs(mtp_checkpoints, family, dtype):
    mtp_checkpoint = mtp_checkpoints(family)
    plain = build_offload_engine(mtp_checkpoint, dtype=dtype, max_num_batched_tokens=16)
    try:
        expected, _ = staggered(plain, PROMPTS, LENGTHS)
        assert plain.runner.fast is not None or dtype == "float32"
    finally:
        plain.close()
    engine = build_offload_engine(mtp_checkpoint, dtype=dtype, max_num_batched_tokens=16, speculative=MTP)
    try:
        assert engine.runner.graph.keep_hidden
        fast = engine.runner.fast
        assert (fast is not None) == (dtype == "bfloat16")
        steps = fast.steps if fast else 0
        out, gens = staggered(engine, PROMPTS, LENGTHS)
        if fast:  # decode and verify steps on the fused call, its hidden rows feeding the MTP layer
            assert fast.steps > steps + 5
        assert engine.stats()["speculative"]["method"] == "mtp"
    finally:
        engine.close()
    assert out == expected
    assert all(g.stats.spec_drafts > 0 for g in gens)


def test_mtp_refuses_what_it_cannot_draft_for(checkpoints, mtp_checkpoint):
    with pytest.raises(ConfigError, match="one draft a step"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2})
    assert SpeculativeConfig.parse('{"method": "mtp"}').num_speculative_tokens == 1
    # the config names an MTP layer (DeepseekV3Config's default) but the checkpoint holds no tensors of it
    with pytest.raises(ConfigError, match="ships no MTP layer"):
        build_offload_engine(checkpoints("deepseek_v3"), speculative=MTP)
    with pytest.raises(ConfigError, match="ships no MTP layer"):
        build_offload_engine(checkpoints("qwen3_moe"), speculative=MTP)


def test_the_mtp_layer_is_read_as_transformers_reads_a_decoder_layer(mtp_checkpoint):
    """load(): the per-expert linears stacked as transformers' fused experts, every tensor of the layer the
    N+1-layer model's last one holds."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(mtp_checkpoint)
    full = AutoModelForCausalLM.from_pretrained(f"{mtp_checkpoint}/full")
    w = mtp.load(mtp_checkpoint, target, torch.device("cpu"))
    assert w.index == target.config.num_hidden_layers
    want = full.model.layers[-1].state_dict()
    got = w.layer.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_bf16_drafts_from_the_fused_call_are_the_graphs(mtp_checkpoint):
    """bf16: decode steps on the fused call hand the MTP layer their final norm's rows; its drafts and logits are
    those of the same run with every step on the graph (the two round within a bf16 place)."""
    runs = []
    for fused in (True, False):
        engine = build_offload_engine(mtp_checkpoint, dtype="bfloat16", max_num_batched_tokens=16, speculative=MTP)
        try:
            assert engine.runner.fast is not None
            if not fused:
                engine.runner.fast = None
            seen = _record(engine)
            runs.append((staggered(engine, PROMPTS, LENGTHS)[0], seen))
        finally:
            engine.close()
    (out_a, a), (out_b, b) = runs
    assert out_a == out_b and len(a) == len(b)
    for (ta, da, la), (tb, db, lb) in zip(a, b):
        assert ta == tb
        torch.testing.assert_close(la.float(), lb.float(), rtol=0.02, atol=0.02)
    assert sum(da == db for (_, da, _), (_, db, _) in zip(a, b)) >= 0.9 * len(a)


def test_the_mtp_layers_routed_experts_in_one_kernel_call_are_the_loops():
    """bf16 on the CPU: the pairs in expert order through one fused-experts call and the executor's combine, against
    the per-expert loop in fp32 (the same weights): within bf16 rounding, every row."""
    from moe_offload.engines.offload.kernels import ops

    torch.manual_seed(0)
    E, H, I, T, K = 8, 64, 32, 6, 3
    gate_up, down = 0.1 * torch.randn(E, 2 * I, H), 0.1 * torch.randn(E, H, I)
    x, w = torch.randn(T, H), torch.rand(T, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ref = mtp.routed(x, ids, w, gate_up, down)  # fp32: the loop
    bf = torch.bfloat16
    if not ops.native(x.to(bf)):
        pytest.skip("no compiled CPU kernels here")
    got = mtp.routed(x.to(bf), ids, w, gate_up.to(bf), down.to(bf))
    torch.testing.assert_close(got.float(), ref, rtol=0.02, atol=0.01)
    ids[0, 0] = ids[0, 1]  # a pair routed to the wrong expert changes its row
    assert not torch.allclose(mtp.routed(x.to(bf), ids, w, gate_up.to(bf), down.to(bf)).float()[0], ref[0], atol=0.01)


def test_mtp_kv_lives_in_the_cached_blocks(mtp_checkpoint):
    """Prefix caching: a second request with the same prompt reuses its full blocks, the MTP layer's KV rows with
    them (one pool layer more), and its drafts are the oracle's though it never ran the layer over those positions."""
    engine = build_offload_engine(mtp_checkpoint, speculative=MTP, enable_prefix_caching=True, block_size=4)
    try:
        seen = _record(engine)
        runs, outs = [], []
        for _ in range(2):  # one after the other: the second finds the first's blocks
            runs.append(engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True)))
            outs.append(list(runs[-1]))
        assert runs[0].stats.cached_tokens == 0 and runs[1].stats.cached_tokens == 16
    finally:
        engine.close()
    assert outs[0] == outs[1]
    second = seen[len(seen) // 2:]
    assert len(second) == 5 and second[0][0][: len(PROMPTS[0])] == tuple(PROMPTS[0])
    for (tokens, draft, logits), ref in zip(second, _oracle_logits(mtp_checkpoint, second)):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)


def test_the_kv_budget_counts_the_mtp_layer(mtp_checkpoint):
    sizes = []
    for spec in (None, MTP):
        engine = build_offload_engine(mtp_checkpoint, speculative=spec)
        try:
            sizes.append((engine.kv_bytes_per_token, len(engine.description.layers)))
        finally:
            engine.close()
    (plain, n), (with_mtp, _) = sizes
    assert with_mtp == plain + plain // n
