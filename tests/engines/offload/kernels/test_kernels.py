"""The bf16 CPU decode kernels (csrc/cpu/gemm.cpp, moe.cpp) against plain fp32 references, and their wiring.

References are written here as plain loops in fp32. The kernels accumulate in fp32 and round
their outputs (and the expert's intermediates) to bf16 as the F.linear path does, so they differ
from an fp32 reference by bf16 rounding (relative 2^-8 per rounding), not more.
Legend: H hidden (input features), N output rows, I expert intermediate, E experts, K selected experts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels import dispatch, jit
from moe_offload.engines.offload.kernels.ops import token_experts

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def ops():
    # Built once per machine (cache dir), loaded once per session; a failure here is a real build error.
    assert jit.load(), jit.info()
    return torch.ops.moe_offload


def _w(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(BF)  # rows of unit norm: outputs ~ N(0, 1)


def ref_gemv(x, w, b=None):
    y = w.float() @ x.float().reshape(-1)  # [N]
    return y + b.float() if b is not None else y


def ref_expert(x, up, down, up_b=None, down_b=None):
    gu = ref_gemv(x, up, up_b)  # [2I]
    gate, u = gu.chunk(2)
    return ref_gemv(F.silu(gate) * u, down, down_b)  # [H]


@pytest.mark.parametrize("N,H", [(1, 1), (7, 33), (64, 1024), (1000, 77), (2048, 1024), (5, 4097), (31, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_fp32_reference(ops, N, H, bias):
    w, x = _w(N, H, seed=1), torch.randn(H, generator=torch.Generator().manual_seed(2)).to(BF)
    b = _w(N, 1, seed=3).reshape(N) if bias else None
    ref = ref_gemv(x, w, b)
    for xs in (x, x.reshape(1, H), x.reshape(1, 1, H)):  # [H], [1, H] (a token row), [1, 1, H] (a linear layer's input)
        y = ops.gemv_bf16(xs, w, b)
        assert y.dtype == BF and y.shape == (*xs.shape[:-1], N)
        torch.testing.assert_close(y.float().reshape(N), ref, rtol=8e-3, atol=1e-2)


# (16, 300, 1030), (7, 40, 2056), (40, 9, 4097): more tokens than one tile, with a scalar, an 8-wide and a 1-element
# tail after the 32-wide steps
@pytest.mark.parametrize("M,N,H", [(2, 7, 33), (3, 64, 1024), (16, 1000, 77), (5, 31, 32), (40, 9, 4097), (16, 300, 1030),
                                   (7, 40, 2056)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_fp32_reference_and_each_row_is_the_gemv_alone(ops, M, N, H, bias):
    """A token's row must not depend on the other tokens in the call: batched decode relies on it."""
    w = _w(N, H, seed=1)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2)).to(BF)
    b = _w(N, 1, seed=3).reshape(N) if bias else None
    y = ops.gemm_bf16(x, w, b)
    assert y.dtype == BF and y.shape == (M, N)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T + (b.float() if bias else 0), rtol=8e-3, atol=1e-2)
    for t in range(M):
        assert torch.equal(y[t], ops.gemv_bf16(x[t], w, b))
    assert ops.gemm_bf16(x.reshape(1, M, H), w, b).shape == (1, M, N)
    assert ops.gemm_bf16(x[:0], w, b).shape == (0, N)


def test_expert_forward_batches_a_few_bf16_tokens_through_gemm(ops):
    module = _experts_module()
    up, down = _w(32, 48, seed=5), _w(48, 16, seed=6)
    x = torch.randn(6, 48).to(BF)
    y = dispatch.expert_forward(module, x, up, down)
    for t in range(6):  # each token's row equals that token through the one-token path
        assert torch.equal(y[t], dispatch.expert_forward(module, x[t : t + 1], up, down)[0])


@pytest.mark.parametrize("T,K,E,H,I", [(1, 2, 4, 48, 24), (5, 2, 4, 33, 17), (16, 8, 64, 128, 64), (16, 1, 1, 1040, 600)])
def test_moe_experts_rows_equal_each_token_through_its_expert_alone(ops, T, K, E, H, I):
    """One call per layer: pair (t, k) lands in out[t * K + k] and equals the call of token t alone."""
    ups = [_w(2 * I, H, seed=10 + e) for e in range(E)]
    downs = [_w(H, I, seed=100 + e) for e in range(E)]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(BF)
    top = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)])  # [T, K]
    sorted_ids, perm = torch.sort(top.reshape(-1), stable=True)
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = [0, *torch.cumsum(counts, 0)[:-1].tolist()]
    experts = uniq.tolist()
    out = torch.full((T * K, H), float("nan")).to(BF)
    ops.moe_experts_bf16(x, [ups[e] for e in experts], [downs[e] for e in experts], perm // K, perm, starts,
                         counts.tolist(), out)
    for t in range(T):
        for k in range(K):
            e = int(top[t, k])
            assert torch.equal(out[t * K + k], token_experts(x[t], [ups[e]], [downs[e]])[0]), (t, k)


@pytest.mark.parametrize("gate", [0, 1])
def test_moe_experts_with_biases_and_gpt_oss_gate_equal_each_token_alone(ops, gate):
    """Biased experts (gpt-oss's, gate 1: clamped SwiGLU over interleaved rows) in one call: pair (t, k) equals
    the call of token t alone with the same biases and gate."""
    T, K, E, H, I = 5, 2, 4, 40, 24
    ups = [_w(2 * I, H, seed=10 + e) for e in range(E)]
    downs = [_w(H, I, seed=100 + e) for e in range(E)]
    ub = [torch.randn(2 * I, generator=torch.Generator().manual_seed(200 + e)).to(BF) for e in range(E)]
    db = [torch.randn(H, generator=torch.Generator().manual_seed(300 + e)).to(BF) for e in range(E)]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(BF)
    top = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)])
    sorted_ids, perm = torch.sort(top.reshape(-1), stable=True)
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = [0, *torch.cumsum(counts, 0)[:-1].tolist()]
    ex = uniq.tolist()
    out = torch.full((T * K, H), float("nan")).to(BF)
    g = (gate, 1.702, 7.0) if gate else (0, 0.0, 0.0)
    ops.moe_experts_bf16(x, [ups[e] for e in ex], [downs[e] for e in ex], perm // K, perm, starts, counts.tolist(), out,
                         [ub[e] for e in ex], [db[e] for e in ex], *g)
    for t in range(T):
        for k in range(K):
            e = int(top[t, k])
            alone = token_experts(x[t], [ups[e]], [downs[e]], None, None, [ub[e]], [db[e]], *g)[0]
            assert torch.equal(out[t * K + k], alone), (t, k)
    # the biases are read: without them the rows differ
    plain = torch.empty_like(out)
    ops.moe_experts_bf16(x, [ups[e] for e in ex], [downs[e] for e in ex], perm // K, perm, starts, counts.tolist(), plain,
                         None, None, *g)
    assert not torch.equal(plain, out)


def test_moe_experts_rejects_out_of_range_pairs(ops):
    up, down = _w(8, 4), _w(4, 4)
    x, out = torch.randn(2, 4).to(BF), torch.empty(4, 4).to(BF)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.moe_experts_bf16(x, [up], [down], torch.tensor([0, 5]), torch.tensor([0, 1]), [0], [2], out)
    with pytest.raises(RuntimeError, match="out of bounds"):
        ops.moe_experts_bf16(x, [up], [down], torch.tensor([0, 1]), torch.tensor([0, 1]), [1], [2], out)


def test_gemv_reads_strided_rows(ops):
    # Slot and store views are rows of a larger [E, N, H] tensor; a [N, H] slice of a wider matrix has stride(0) > H.
    big = _w(16, 80, seed=4)
    w = big[:, 8:72]  # [16, 64], row stride 80
    x = torch.randn(64).to(BF)
    torch.testing.assert_close(ops.gemv_bf16(x, w).float(), ref_gemv(x, w), rtol=8e-3, atol=1e-2)


def test_gemv_rejects_bad_input(ops):
    w = _w(8, 16)
    with pytest.raises(RuntimeError, match="one bf16 CPU token"):
        ops.gemv_bf16(torch.randn(2, 16).to(BF), w)  # two tokens
    with pytest.raises(RuntimeError, match="2-D bf16 CPU tensor"):
        ops.gemv_bf16(torch.randn(16).to(BF), w.float())
    # a 1-D down projection was an IndexError "Dimension out of range" from reading its sizes before checking
    with pytest.raises(RuntimeError, match="down: expected a 2-D bf16 CPU tensor"):
        token_experts(torch.randn(16).to(BF), [_w(16, 16)], [torch.randn(16).to(BF)])


@pytest.mark.parametrize("H,I", [(32, 16), (77, 45), (1024, 512), (33, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_expert_of_one_token_matches_reference(ops, H, I, bias):
    up, down = _w(2 * I, H, seed=5), _w(H, I, seed=6)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(7)).to(BF)
    ub, db = (_w(2 * I, 1, seed=8).reshape(-1), _w(H, 1, seed=9).reshape(-1)) if bias else (None, None)
    y = token_experts(x, [up], [down], None, None, None if ub is None else [ub], None if db is None else [db])
    assert y.shape == (1, H) and y.dtype == BF
    # fp32 reference: differs by the bf16 roundings of gate/up, silu, their product and the output
    torch.testing.assert_close(y.float().reshape(H), ref_expert(x, up, down, ub, db), rtol=3e-2, atol=3e-2)
    # transformers' bf16 path (F.linear, silu, F.linear) rounds at the same points: closer still
    g, u = (F.linear(x, up) + (ub if bias else 0)).chunk(2, dim=-1)
    chain = F.linear(F.silu(g) * u, down) + (db if bias else 0)
    torch.testing.assert_close(y.float(), chain.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("H,I,E,K", [(64, 32, 8, 2), (77, 45, 6, 3), (1024, 512, 16, 8), (33, 17, 5, 5)])
def test_a_tokens_experts_in_one_call_equal_each_alone(ops, H, I, E, K):
    gate_up, down = _w(E, 2 * I, H, seed=10), _w(E, H, I, seed=11)  # the fused [E, ...] layout of a layer
    x = torch.randn(H, generator=torch.Generator().manual_seed(12)).to(BF)
    ids = torch.randperm(E, generator=torch.Generator().manual_seed(13))[:K].tolist()
    y = token_experts(x, [gate_up[e] for e in ids], [down[e] for e in ids])
    assert y.shape == (K, H)
    for k, e in enumerate(ids):
        # row k is the one-expert call bit for bit: rows never depend on how they were split over threads
        assert torch.equal(y[k], token_experts(x, [gate_up[e]], [down[e]])[0]), (k, e)
        torch.testing.assert_close(y[k].float(), ref_expert(x, gate_up[e], down[e]), rtol=3e-2, atol=3e-2)


def test_ops_are_opaque_to_torch_compile(ops):
    # The fake kernels give output shapes without running the op; fullgraph=True fails on any graph break.
    w, x = _w(24, 40), torch.randn(1, 40).to(BF)
    compiled = torch.compile(lambda a: ops.gemv_bf16(a, w) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), ops.gemv_bf16(x, w) * 2, rtol=0, atol=0)


# -- wiring: expert_forward and the model's linears --------------------------------------------------------------
def _experts_module(H=48, I=24, E=4):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2)
    m = Qwen3MoeExperts(cfg)
    m.gate_up_proj.data = _w(E, 2 * I, H, seed=20)
    m.down_proj.data = _w(E, H, I, seed=21)
    return m.requires_grad_(False)


def _linear_chain(m, x, e):
    g, u = F.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(m.act_fn(g) * u, m.down_proj[e])


def test_expert_forward_uses_the_kernel_for_one_bf16_token(ops, monkeypatch):
    m = _experts_module()
    x = torch.randn(1, 48).to(BF)
    calls = []
    real = dispatch._few_tokens
    monkeypatch.setattr(dispatch, "_few_tokens", lambda *a: calls.append(1) or real(*a))
    y = dispatch.expert_forward(m, x, m.gate_up_proj[1], m.down_proj[1])
    assert calls and torch.equal(y, token_experts(x, [m.gate_up_proj[1]], [m.down_proj[1]]))
    torch.testing.assert_close(y.float(), _linear_chain(m, x, 1).float(), rtol=2e-2, atol=2e-2)
    # a few tokens take the GEMM kernel (rows equal to F.linear's here); fp32 keeps F.linear
    x3 = torch.randn(3, 48).to(BF)
    assert torch.equal(dispatch.expert_forward(m, x3, m.gate_up_proj[1], m.down_proj[1]), _linear_chain(m, x3, 1))
    calls.clear()
    dispatch.expert_forward(m, x.float(), m.gate_up_proj[1].float(), m.down_proj[1].float())
    assert not calls


def test_expert_forward_custom_gate_uses_gemv_around_it(ops):
    m = _experts_module()
    m._apply_gate = lambda h: torch.tanh(h[..., :24]) * h[..., 24:]  # not transformers' default gate: no fused op
    assert not dispatch._is_silu_concat(m)
    x = torch.randn(1, 48).to(BF)
    y = dispatch.expert_forward(m, x, m.gate_up_proj[0], m.down_proj[0])
    assert torch.equal(y, ops.gemv_bf16(m._apply_gate(ops.gemv_bf16(x, m.gate_up_proj[0])), m.down_proj[0]))


def test_experts_one_token_rows_equal_expert_forward(ops):
    m = _experts_module()
    x = torch.randn(1, 48).to(BF)
    weights = [(m.gate_up_proj[e], m.down_proj[e], None, None) for e in (3, 0, 2)]
    y = dispatch.experts_one_token(m, x, weights)
    assert y.shape == (3, 48)
    for k, w in enumerate(weights):  # bit for bit: a caller may group some experts and not others
        assert torch.equal(y[k : k + 1], dispatch.expert_forward(m, x, *w)), k
    # biases go into the same call, bit for bit as well
    biased = [(*weights[0][:2], torch.randn(48).to(BF), None)]
    assert torch.equal(dispatch.experts_one_token(m, x, biased), dispatch.expert_forward(m, x, *biased[0]))
    # not applicable: several tokens, fp32, some experts biased and some not -> None (the caller loops)
    assert dispatch.experts_one_token(m, torch.randn(2, 48).to(BF), weights) is None
    assert dispatch.experts_one_token(m, x.float(), [tuple(t.float() if t is not None else None for t in w) for w in weights]) is None
    assert dispatch.experts_one_token(m, x, biased + weights[:1]) is None


def test_disabled_kernels_fall_back_to_f_linear(ops):
    m = _experts_module()
    x = torch.randn(1, 48).to(BF)
    lin = torch.nn.Linear(48, 16, dtype=BF).requires_grad_(False)
    assert dispatch.patch_linears(lin) == 1
    try:
        assert jit.set_enabled(False) is False and not jit.load()  # as MOE_OFFLOAD_KERNELS=0
        assert torch.equal(dispatch.expert_forward(m, x, m.gate_up_proj[2], m.down_proj[2]), _linear_chain(m, x, 2))
        assert dispatch.experts_one_token(m, x, [(m.gate_up_proj[2], m.down_proj[2], None, None)]) is None
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # a patched layer follows the switch
        assert dispatch.patch_linears(torch.nn.Linear(48, 16, dtype=BF)) == 0
    finally:
        assert jit.set_enabled(True)
    assert torch.equal(lin(x), ops.gemv_bf16(x, lin.weight, lin.bias))


def test_env_zero_disables_in_a_fresh_process():
    code = ("from moe_offload.engines.offload.kernels import dispatch, jit; import torch\n"
            "assert not jit.load() and not jit.info()['built'], jit.info()\n"
            "assert dispatch.patch_linears(torch.nn.Linear(8, 8, dtype=torch.bfloat16)) == 0\n")
    env = {**__import__("os").environ, jit.ENV: "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_failed_build_warns_once_and_falls_back(monkeypatch, capsys):
    import torch.utils.cpp_extension as ext

    saved = dict(jit._state)
    monkeypatch.setattr(ext, "load", lambda **kw: (_ for _ in ()).throw(RuntimeError("no compiler here")))
    monkeypatch.setattr(jit, "_prebuilt", lambda: None)  # as an install without the prebuilt libraries
    jit._state.clear()
    try:
        assert jit.load() is False and jit.load() is False  # second call: cached, no second warning
        assert "no compiler here" in jit.info()["error"]
        err = capsys.readouterr().err
        assert err.count("cpu_kernels_unavailable") == 1
        m = _experts_module()
        x = torch.randn(1, 48).to(BF)
        assert torch.equal(dispatch.expert_forward(m, x, m.gate_up_proj[0], m.down_proj[0]), _linear_chain(m, x, 0))
    finally:
        jit._state.clear()
        jit._state.update(saved)


def test_patch_linears_one_token_only(ops):
    model = torch.nn.Sequential(torch.nn.Linear(40, 24, dtype=BF), torch.nn.Linear(24, 8, bias=False, dtype=BF),
                                torch.nn.Linear(8, 8))  # the fp32 layer is left alone
    model.requires_grad_(False)
    x1, x5 = torch.randn(1, 1, 40).to(BF), torch.randn(1, 5, 40).to(BF)
    want1 = model[1](model[0](x1))
    assert dispatch.patch_linears(model) == 2
    assert "forward" not in model[2].__dict__
    got1 = model[1](model[0](x1))
    torch.testing.assert_close(got1.float(), want1.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got1, ops.gemv_bf16(ops.gemv_bf16(x1, model[0].weight, model[0].bias), model[1].weight))
    y5 = model[0](x5)  # a batched decode step: the multi-token kernel
    assert torch.equal(y5, ops.gemm_bf16(x5, model[0].weight, model[0].bias))
    x40 = torch.randn(1, 40, 40).to(BF)  # prefill beyond GEMM_MAX_TOKENS: F.linear, unchanged
    assert torch.equal(model[0](x40), F.linear(x40, model[0].weight, model[0].bias))


def test_bf16_model_is_exact_across_fractions(ops, checkpoints):
    # With the kernels, every tier computes each expert with the same op: greedy tokens and logits are
    # identical for every resident fraction and policy (as the fp32 exactness tests show for F.linear).
    from offload_helpers import greedy, moe_layers, placement

    from moe_offload.engines.offload.loading.loader import load_model

    path = checkpoints("qwen3_moe")
    layers, num_experts = moe_layers(path)
    prompt = [3, 17, 42, 9, 88]
    runs = {}
    for policy, fraction in (("static", 1.0), ("static", 0.0), ("lru", 0.5), ("hybrid", 0.5)):
        om = load_model(path, placement(layers, num_experts, fraction, policy), policy=policy, dtype="bfloat16",
                        hybrid_threshold=2 if policy == "hybrid" else None)
        assert "forward" not in om.model.lm_head.__dict__  # loading patches nothing (the engine's fallback would)
        runs[(policy, fraction)] = greedy(om.model, prompt, 8)
    first = runs[("static", 1.0)]
    for key, (tokens, logits) in runs.items():
        assert tokens == first[0], key
        assert torch.equal(logits, first[1]), key


@pytest.mark.parametrize("variant", [v[0] for v in jit.VARIANTS[1:]])
def test_lesser_isa_variants(variant):
    # Each ISA path (AVX2, portable), built in its own process, against the fp32 reference.
    from offload_helpers import run_in_variant

    run_in_variant(variant, """
for N, H in ((5, 77), (64, 1024), (3, 8)):
    g = torch.Generator().manual_seed(N)
    w = (torch.randn(N, H, generator=g) / H ** 0.5).to(torch.bfloat16); x = torch.randn(H, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(ops.gemv_bf16(x, w).float(), w.float() @ x.float(), rtol=8e-3, atol=1e-2)
up = (torch.randn(2 * 45, 77) / 77 ** 0.5).to(torch.bfloat16); dn = (torch.randn(77, 45) / 45 ** 0.5).to(torch.bfloat16)
x = torch.randn(77).to(torch.bfloat16)
g, u = (up.float() @ x.float()).chunk(2)
from moe_offload.engines.offload.kernels.ops import token_experts
torch.testing.assert_close(token_experts(x, [up], [dn])[0].float(), dn.float() @ (torch.nn.functional.silu(g) * u), rtol=3e-2, atol=3e-2)
""")


def test_first_use_build_goes_on_past_a_dead_builders_lock(tmp_path):
    # The first-use build (no matching library from the install: an edited checkout, another torch), in a fresh build
    # directory where a builder killed mid-build left torch's `lock` file: torch's builder would wait on it forever.
    # Ours holds an flock (dropped by the kernel when its holder dies), so the `lock` is known stale, removed, and the
    # build runs. The portable variant: the quickest to compile (~45 s on 2 cores), the same build code as the others.
    code = """
import torch
from moe_offload.engines.offload.kernels import jit
variant, _, name = jit.build_spec()
assert variant == "portable", variant
d = jit.build_dir(name)
d.mkdir(parents=True)
(d / "lock").write_text("")
info = jit.build()
assert info["ok"] and info["source"] == "jit", info
assert not (d / "lock").exists() and list(d.glob(name + "*.so")), sorted(p.name for p in d.iterdir())
g = torch.Generator().manual_seed(0)
w = (torch.randn(24, 64, generator=g) / 8).to(torch.bfloat16)
x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
torch.testing.assert_close(torch.ops.moe_offload.gemm_bf16(x, w).float(), x.float() @ w.float().T, rtol=8e-3, atol=1e-2)
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), jit.ENV: "portable"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]  # a hang on the lock ends in TimeoutExpired


@pytest.mark.parametrize("gate", [0, 1])
def test_a_decode_steps_experts_split_whole_over_threads_equal_the_two_pass_loops(ops, gate):
    """One token per expert and experts that divide among the threads: each thread runs whole experts (gate|up, gate,
    down) without a barrier between the passes. Rows equal the one-thread (two-pass) call and each expert alone,
    bit for bit, for an even and an odd number of experts, one-token and pair-list calls alike."""
    H, I = 72, 40
    g = (gate, 1.702, 7.0) if gate else (0, 0.0, 0.0)
    saved = torch.get_num_threads()
    try:
        for K in (2, 3, 4):
            ups, downs = [_w(2 * I, H, seed=20 + e) for e in range(K)], [_w(H, I, seed=40 + e) for e in range(K)]
            ub = [torch.randn(2 * I, generator=torch.Generator().manual_seed(60 + e)).to(BF) for e in range(K)]
            db = [torch.randn(H, generator=torch.Generator().manual_seed(80 + e)).to(BF) for e in range(K)]
            x = torch.randn(1, H, generator=torch.Generator().manual_seed(K)).to(BF)
            rows, pairs = {}, {}
            for n in (1, 2):
                torch.set_num_threads(n)
                rows[n] = token_experts(x[0], ups, downs, None, None, ub, db, *g)
                pairs[n] = torch.full((K, H), float("nan")).to(BF)
                ops.moe_experts_bf16(x, ups, downs, torch.zeros(K, dtype=torch.long), torch.arange(K).flip(0),
                                     list(range(K)), [1] * K, pairs[n], ub, db, *g)
            for e in range(K):
                alone = token_experts(x[0], [ups[e]], [downs[e]], None, None, [ub[e]], [db[e]], *g)[0]
                assert torch.equal(rows[1][e], alone) and torch.equal(rows[2][e], alone), (K, e)
                assert torch.equal(pairs[1][K - 1 - e], alone) and torch.equal(pairs[2][K - 1 - e], alone), (K, e)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("H", [1, 31, 33, 77, 1025])
def test_results_do_not_depend_on_thread_count(ops, H):
    # Rows are split over threads by at::parallel_for; each row's sum must not depend on the split, and tails
    # (H not a multiple of the vector width) read from an odd storage offset must stay inside the row.
    g = torch.Generator().manual_seed(H)
    flat = torch.randn(3 + 96 * H, generator=g).to(BF)
    w = flat[3:].view(96, H)  # [96, H], storage offset 3: not vector-aligned
    x = torch.randn(H + 1, generator=g).to(BF)[1:]  # [H], offset 1
    gu, dn = _w(4, 2 * 40, H, seed=H), _w(4, H, 40, seed=H + 1)  # [E, 2I, H], [E, H, I] with I = 40
    saved = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = (ops.gemv_bf16(x, w), token_experts(x, list(gu), list(dn)))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(out[1][0], out[2][0]) and torch.equal(out[1][1], out[2][1])
    torch.testing.assert_close(out[1][0].float(), ref_gemv(x, w), rtol=8e-3, atol=2e-2)
