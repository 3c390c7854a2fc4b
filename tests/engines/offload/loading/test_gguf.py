"""GGUF files (gguf_helpers.py writes them as llama.cpp's converter does) loaded with their experts kept as ggml blocks.

The exactness contract per format: with fp32 compute the engine's greedy tokens equal transformers running the model
the file means (experts dequantized by the gguf package, everything else as written) for every policy and fraction,
every supported architecture and every supported block type. With bf16 compute the block kernels quantize
activations to 8 bits as llama.cpp does; that error is bounded below against the same model with its experts
dequantized to bf16 (--expert-dtype bf16).
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf_helpers import FAMILIES, reference_dequantize, write
from offload_helpers import greedy, moe_layers, placement
from quant_helpers import assert_activation_rounding_bounded

from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.engines.offload.loading.quant import BlockLinear
from moe_offload.errors import ConfigError, ModelError

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]
RUNS = (("static", 1.0), ("static", 0.0), ("lru", 0.25), ("hybrid", 0.5))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(family, qtype, down qtype, expert intermediate) -> (GGUF path, reference model), written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(family: str, qtype: str = "q4_k", down: str | None = None, inter: int = 256):
        if (family, qtype, down, inter) not in cache:
            cache[(family, qtype, down, inter)] = write(family, root, qtype, down_qtype=down, inter=inter)
        return cache[(family, qtype, down, inter)]

    return get


def _load(path, policy="static", fraction=1.0, **kw):
    view_layers, num_experts = moe_layers(str(_view(path)))
    return load_model(str(path), placement(view_layers, num_experts, fraction, policy), policy=policy,
                      hybrid_threshold=2 if policy == "hybrid" else None, **kw)


def _view(path):
    from moe_offload.engines.offload.loading.gguf_load import view_dir

    return view_dir(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_architecture_matches_the_dequantized_model(files, family):
    path, ref = files(family)
    want = greedy(ref, PROMPT, 10)
    runs = RUNS if family in ("qwen3_moe", "gpt_oss", "deepseek_v3") else RUNS[:2]
    for policy, fraction in runs:
        om = _load(path, policy, fraction, dtype="float32")
        store = om.executor.layers[0].store
        assert store.format == "q4_k" and store.tensors[0].dtype == torch.bits8
        # the attention projections (where the family has q/k/v/o) and the LM head stay the file's blocks too
        assert isinstance(om.model.lm_head, BlockLinear)
        attn = om.model.model.layers[0].self_attn
        assert isinstance(getattr(attn, "q_proj", None), BlockLinear) == (family != "deepseek_v3")
        got = greedy(om.model, PROMPT, 10)
        assert got[0] == want[0], (family, policy, fraction)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype,down", [("q8_0", None), ("q4_0", None), ("gguf_mxfp4", None), ("q5_k", None),
                                        ("q6_k", None), ("q4_k", "q6_k"), ("q4_1", None), ("q5_0", None),
                                        ("q5_1", None), ("iq4_xs", None), ("iq4_xs", "q4_1"), ("q2_k", "q3_k"),
                                        ("q3_k", None)])
def test_every_block_type_matches_the_dequantized_model(files, qtype, down):
    path, ref = files("qwen3_moe", qtype, down)
    want = greedy(ref, PROMPT, 10)
    for policy, fraction in (("static", 1.0), ("lru", 0.25)):
        om = _load(path, policy, fraction, dtype="float32")
        assert om.executor.layers[0].store.format == qtype
        got = greedy(om.model, PROMPT, 10)
        assert got[0] == want[0], (qtype, down, policy)


@pytest.mark.parametrize("qtype,down", [("q4_k", "q5_0"), ("q5_k", "q5_1")])
def test_llama_quantize_fallback_types(files, qtype, down):
    # experts 288 wide (as 1408): their down rows hold no whole 256-block, so llama-quantize's Q4_K_M / Q5_K_M writes
    # them q5_0 / q5_1 beside q4_k / q5_k gate and up. fp32: tokens = transformers for every policy and fraction;
    # bf16 (the q5 dots, 9 blocks a row; their error is bounded in the kernel tests): the same tokens and logits for
    # every policy and fraction (one kernel per expert for every tier)
    path, ref = files("qwen3_moe", qtype, down, inter=288)
    want = greedy(ref, PROMPT, 10)
    bf16 = []
    for policy, fraction in RUNS:
        om = _load(path, policy, fraction, dtype="float32")
        store = om.executor.layers[0].store
        assert store.format == qtype and store.tensors[1].shape[-2:] == (288 // 32, 22 if down == "q5_0" else 24)
        got = greedy(om.model, PROMPT, 10)
        assert got[0] == want[0], (qtype, down, policy, fraction)
        bf16.append(greedy(_load(path, policy, fraction, dtype="bfloat16").model, PROMPT, 10))
    assert all(r[0] == bf16[0][0] and torch.equal(r[1], bf16[0][1]) for r in bf16)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_decode_fuses_the_block_layers(files, family):
    # bf16 on the CPU: the fused decode layer reads the file's attention blocks; the tokens do not depend on the
    # fraction or policy (one kernel per expert for every tier); --dense-dtype bf16 dequantizes them instead
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    path, _ = files(family)
    outs = []
    for policy, fraction in (("static", 1.0), ("lru", 0.25)):
        e = build_offload_engine(str(path), policy=policy, fraction=fraction, dtype="bfloat16")
        try:
            fast = e.runner.fast
            assert fast is not None and fast.layers[0].kernel.sq.numel() == 0  # the blocks carry their own scales
            outs.append(list(e.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))))
        finally:
            e.close()
    assert outs[0] == outs[1]
    om = load_model(str(path), None, dtype="bfloat16", dense_dtype="bf16")
    assert type(om.model.lm_head) is torch.nn.Linear


def test_host_store_holds_the_files_bytes(files):
    # the experts are the file's blocks, byte for byte; the loader priced them at the file's sizes
    import gguf as gguf_pkg

    path, _ = files("qwen3_moe", "q4_k", "q6_k")
    om = _load(path, dtype="float32")
    reader = gguf_pkg.GGUFReader(path)
    t = {x.name: x for x in reader.tensors}
    for st in om.executor.layers:
        layer = st.layer
        gate, up, down = (t[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        I = gate.data.shape[1]
        assert torch.equal(st.store.tensors[0][:, :I].reshape(gate.data.shape).view(torch.uint8),
                           torch.from_numpy(gate.data.copy()))
        assert torch.equal(st.store.tensors[1].reshape(down.data.shape).view(torch.uint8), torch.from_numpy(down.data.copy()))
        assert st.store.expert_bytes == (gate.n_bytes + up.n_bytes + down.n_bytes) // gate.data.shape[0]


@pytest.mark.parametrize("family,qtype,down", [("qwen3_moe", "q4_k", "q6_k"), ("gpt_oss", "gguf_mxfp4", None),
                                               ("deepseek_v3", "q8_0", None)])
def test_disk_tier_reads_the_files_blocks(files, family, qtype, down, tmp_path, monkeypatch):
    # host memory smaller than the experts: the experts go to an expert store whose records are the file's blocks
    # (written once, found again); tokens in fp32 equal transformers on the dequantized model for every policy with
    # nearly every step reading from disk, and in bf16 equal the all-in-memory engine's tokens and logits
    from moe_offload.engines.offload.loading.convert import convert_checkpoint, existing_store

    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    path, ref = files(family, qtype, down)
    want = greedy(ref, PROMPT, 10)
    assert existing_store(str(path), "float32") is None
    man, written = convert_checkpoint(str(path), "float32")
    assert written and convert_checkpoint(str(path), "float32") == (man, False)
    assert man.fmt == "gguf-blocks" and existing_store(str(path), "float32") == man
    import gguf as gguf_pkg

    t = {x.name: x for x in gguf_pkg.GGUFReader(path).tensors}
    first = man.layers[min(man.layers, key=lambda n: man.layers[n].layer)]
    down_t = t[f"blk.{first.layer}.ffn_down_exps.weight"]
    # a record's down tensor is the file's expert 1 byte for byte; the file's blocks are read in place (no copy on
    # disk, the manifest alone) except gpt-oss's, whose gate and up rows the engine interleaves
    from moe_offload.engines.offload.experts import diskstore

    assert man.in_place == (family != "gpt_oss") and man.data_path.exists() == (family == "gpt_oss")
    if man.in_place:
        assert man.disk_bytes < 0.05 * os.path.getsize(path)
    f = diskstore.StoreFile(man)
    buf = diskstore.aligned_empty(first.record_bytes)
    assert f.read(first, 1, buf) == first.read_bytes
    f.close()
    raw = buf[first.tensors[1].offset:][:first.tensors[1].nbytes].numpy().tobytes()
    assert raw == down_t.data[1].tobytes()
    view_layers, E = moe_layers(str(_view(path)))
    slot = first.record_bytes
    top_k = 2
    for policy, fraction in (("static", 0.0), ("lru", 0.25), ("hybrid", 0.5)):
        pinned = round(fraction * E) if policy == "static" else (round(fraction * E) // 2 if policy == "hybrid" else 0)
        budget = slot * len(view_layers) * (pinned + top_k)
        om = _load(path, policy, fraction, dtype="float32", host_cache=budget)
        got = greedy(om.model, PROMPT, 10)
        assert got[0] == want[0], (family, policy, fraction)
        assert om.executor.stats.snapshot()["disk"]["disk_reads"] > 0
        assert om.executor.layers[0].store.format == qtype
        om.executor.close()
    mem = greedy(_load(path, "lru", 0.25, dtype="bfloat16").model, PROMPT, 10)
    om = _load(path, "lru", 0.25, dtype="bfloat16", host_cache=slot * len(view_layers) * (top_k + 1))
    disk = greedy(om.model, PROMPT, 10)
    om.executor.close()
    assert disk[0] == mem[0] and torch.equal(disk[1], mem[1])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bf16_activation_rounding_is_bounded(files, family):
    path, _ = files(family)
    base = load_model(str(path), None, dtype="bfloat16", expert_dtype="bf16")
    assert base.executor.layers[0].store.format == "bfloat16"
    assert_activation_rounding_bounded(base, load_model(str(path), None, dtype="bfloat16"), PROMPT, 32, family)


def test_bad_files_fail_at_load_with_one_line(files, tmp_path):
    import gguf as gguf_pkg
    import numpy as np

    path, _ = files("qwen3_moe")
    # truncated: the last tensor's bytes are missing
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelError, match=r"cut.gguf: tensor .* ends at byte \d+, past the file's \d+ bytes"):
        load_model(str(cut), None, dtype="float32")
    # not a GGUF at all
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ModelError, match="junk.gguf: not a readable GGUF file"):
        load_model(str(junk), None)
    # an architecture without routed experts
    dense = tmp_path / "dense.gguf"
    w = gguf_pkg.GGUFWriter(dense, "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelError, match=r"GGUF architecture 'qwen2' is not supported; expected one of qwen3moe, "):
        load_model(str(dense), None)
    # --expert-dtype other than bf16
    with pytest.raises(ConfigError, match="a GGUF file's experts stay in its quant types"):
        load_model(str(path), None, expert_dtype="int8")


def test_unsupported_expert_type_names_it(tmp_path, monkeypatch):
    # an iq2_xxs expert tensor: the loader names the type and the ones it computes
    import gguf_helpers

    from moe_offload.engines.offload.loading import ggml

    real = gguf_helpers._blocks

    def iq2xxs(R, K, qtype, seed):  # 66-byte iq2_xxs blocks (a type the engine does not compute), written raw
        return torch.zeros(R, K // 256, 66, dtype=torch.uint8).view(torch.bits8)

    monkeypatch.setattr(gguf_helpers, "_blocks", iq2xxs)
    real_deq, real_layout = gguf_helpers.reference_dequantize, ggml.layout_of
    monkeypatch.setattr(gguf_helpers, "reference_dequantize",
                        lambda t: torch.zeros(*t.shape[:-2], t.shape[-2] * 256) if t.shape[-1] == 66 else real_deq(t))
    monkeypatch.setattr(ggml, "layout_of", lambda t: type("L", (), {"qtype": 16})() if t.shape[-1] == 66 else real_layout(t))
    path, _ = gguf_helpers.write("qwen3_moe", tmp_path, "q4_k")
    monkeypatch.undo()
    assert gguf_helpers._blocks is real
    with pytest.raises(ModelError, match=r"ffn_gate_exps.weight is IQ2_XXS; the engine computes Q8_0, Q4_0, Q4_1, Q5_0, "
                                         r"Q5_1, GGUF_MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS experts"):
        load_model(str(path), None)


# -- --expert-dtype int4: group-wise symmetric 4-bit (group 32), llama.cpp's q4_0 blocks, for float checkpoints --------
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_int4_at_load(tmp_path, family):
    from gguf_helpers import float_checkpoint
    from transformers import AutoModelForCausalLM

    path = float_checkpoint(family, tmp_path)
    layers, num_experts = moe_layers(path)
    runs = {}
    for policy, fraction in RUNS:
        om = load_model(path, placement(layers, num_experts, fraction, policy), policy=policy, dtype="bfloat16",
                        expert_dtype="int4", hybrid_threshold=2 if policy == "hybrid" else None)
        store = om.executor.layers[0].store
        assert store.format == "q4_0" and store.expert_bytes == (2 * 256 * 256 + 256 * 256) // 32 * 18 + (
            (3 * 256) * 2 if family == "gpt_oss" else 0)  # biases keep bf16
        runs[(policy, fraction)] = greedy(om.model, PROMPT, 10)
    first = runs[("static", 1.0)]
    assert all(r[0] == first[0] and torch.equal(r[1], first[1]) for r in runs.values())
    # fp32: transformers on the q4_0-dequantized experts, token for token
    om = load_model(path, None, dtype="float32", expert_dtype="int4")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer, st in zip((m for m in ref.model.layers if hasattr(m.mlp, "experts")), om.executor.layers):
        up, down = (reference_dequantize(t) for t in st.store.tensors[:2])  # [E, R, K]
        with torch.no_grad():
            if family == "gpt_oss":
                layer.mlp.experts.gate_up_proj.copy_(up.transpose(1, 2))
                layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))
            else:
                layer.mlp.experts.gate_up_proj.copy_(up)
                layer.mlp.experts.down_proj.copy_(down)
    assert greedy(om.model, PROMPT, 10)[0] == greedy(ref, PROMPT, 10)[0]


def test_int4_needs_whole_groups(checkpoints):
    with pytest.raises(ConfigError, match="expert_dtype int4: groups of 32 weights need expert input sizes divisible"):
        load_model(checkpoints("qwen3_moe"), None, expert_dtype="int4")


def test_spec_prices_the_files_exact_sizes(files):
    # spec (control plane, no torch) reads the sizes from the file: Q4_K_M-style mixed layers, every tensor
    import gguf as gguf_pkg

    from moe_offload.control.spec import ModelSpec

    path, _ = files("qwen3_moe", "q4_k", "q6_k")
    spec = ModelSpec.from_hf_config(path)
    tensors = gguf_pkg.GGUFReader(path).tensors
    per_layer = {}
    for t in tensors:
        if "_exps." in t.name:
            layer = int(t.name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes // t.data.shape[0]
    assert spec.stored_layer_expert_bytes == tuple(per_layer[i] for i in sorted(per_layer))
    assert spec.expert_bytes == max(per_layer.values()) == (2 * 256 * 256) // 256 * 144 + 256 * 256 // 256 * 210
    assert spec.routed_expert_bytes == 8 * sum(per_layer.values())
    assert spec.checkpoint_bytes == sum(t.n_bytes for t in tensors)
    assert spec.expert_format == "q4_k+q6_k" and spec.name == path.stem
    assert spec.with_expert_dtype("bf16").expert_bytes == 3 * 256 * 256 * 2
    with pytest.raises(ConfigError, match="a GGUF file's experts stay in its quant types"):
        spec.with_expert_dtype("int8")
