"""architecture.py and the engine's cache choice on real tiny checkpoints: which class loads a config, what the text
path is, which experts the executor serves, how the others run, and which KV cache a model gets."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from moe_offload.engines.offload.experts.executor import RESIDENT
from moe_offload.engines.offload.loading import architecture as arch
from moe_offload.engines.offload.loading.inspection import inspect_model
from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.errors import ModelError


def _path(family_checkpoints, family):
    path = family_checkpoints(family)
    if isinstance(path, Exception):
        pytest.fail(f"{family}: cannot build its tiny checkpoint: {path}")
    return path


def test_model_class_follows_architectures_then_the_auto_mappings():
    vl = AutoConfig.for_model("qwen3_vl_moe")
    assert arch.model_class(vl).__name__ == "Qwen3VLMoeForConditionalGeneration"  # image-text-to-text first
    assert arch.model_class(AutoConfig.for_model("qwen3_moe")).__name__ == "Qwen3MoeForCausalLM"
    # dots3_note has both: a checkpoint that names its text-only class gets it
    dots = AutoConfig.for_model("dots3_note", architectures=["Dots3NoteForCausalLM"])
    assert arch.model_class(dots).__name__ == "Dots3NoteForCausalLM"
    assert arch.model_class(AutoConfig.for_model("dots3_note")).__name__ == "Dots3NoteForConditionalGeneration"


def test_a_model_without_a_generating_class_is_a_model_error():
    config = AutoConfig.for_model("openai_privacy_filter")
    with pytest.raises(ModelError, match="'openai_privacy_filter': transformers has no text-generating class"):
        inspect_model(config)


def test_omni_text_path_is_the_thinker(family_checkpoints):
    config = AutoConfig.from_pretrained(_path(family_checkpoints, "qwen3_omni_moe"))
    with torch.device("meta"):
        model = arch.model_class(config)._from_config(config)
    assert arch.text_path(model) is model.thinker  # the wrapper has no forward of its own
    served, _ = arch.experts_modules(arch.text_path(model))
    assert [e.name for e in served] == ["model.language_model.layers.0.mlp.experts",
                                        "model.language_model.layers.1.mlp.experts"]


def test_image_token_experts_stay_resident_and_run_as_transformers(family_checkpoints, one_thread):
    # ernie4_5_vl_moe: each MoE layer has experts for text tokens and experts for image tokens. The executor
    # serves the text ones; the image ones keep their weights and must compute what stock transformers does.
    path = _path(family_checkpoints, "ernie4_5_vl_moe")
    om = load_model(path, None)
    served = {s.layer: s for s in om.executor.layers}
    modules = dict(om.model.named_modules())
    _, others = arch.experts_modules(om.model)
    assert others and all("vision_moe" in n for n in others)
    assert all(getattr(modules[n], "_moe_offload") is RESIDENT for n in others)
    assert list(served) == [1]
    stock = dict(arch.text_path(arch.model_class(om.config).from_pretrained(path)).named_modules())
    name = others[0]
    E = modules[name].gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, om.config.get_text_config().hidden_size, generator=g)
    idx = torch.randint(0, E, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(modules[name](x, idx, w), stock[name](x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family, paged", [("qwen3_moe", True), ("gpt_oss", True), ("qwen3_next", True),
                                           ("qwen3_5_moe", True), ("deepseek_v32", False), ("minimax", False)])
def test_paged_kv_only_where_every_layer_keeps_just_attention_kv(family_checkpoints, family, paged):
    """The load-time probe: a model whose layers all store through cache.update, or keep their state in the pool's
    seats (Qwen3-Next's and Qwen3.5's gated-DeltaNet linear attention, model/deltanet.py), gets the paged block pool; a
    sparse-attention indexer (DeepSeek-V3.2) or lightning-attention state (MiniMax) take the per-sequence path on the
    model's own cache."""
    engine = build_offload_engine(_path(family_checkpoints, family))
    try:
        assert engine.paged is paged
    finally:
        engine.close()


def test_omni_talker_is_left_out():
    # The default Qwen3-Omni config asks for the speech talker (whose default config this transformers cannot even
    # build); the text path never runs it, so inspection and loading leave it out.
    config = AutoConfig.for_model("qwen3_omni_moe")
    assert config.enable_audio_output and arch.text_only(config) == {"enable_audio_output": False}
    experts, _ = inspect_model(config)
    assert experts and all(e.name.startswith("model.language_model.layers.") for e in experts)
    assert config.enable_audio_output  # the caller's config is not changed


def test_gated_deltanet_convolutions_run_in_fp32_in_bf16_engines(family_checkpoints):
    # Qwen3-Next's linear attention: on the CPU in bf16 its short convolution holds fp32 weights (torch's bf16
    # depthwise path is slow); the first DeltaNet layer's output stays bf16 and equals the stock bf16 layer's to bf16
    # rounding, as does its one-token convolution update; an fp32 engine is untouched. (The whole model in bf16
    # against transformers in bf16: test_bf16_transformers.py.)
    from transformers import AutoModelForCausalLM

    path = _path(family_checkpoints, "qwen3_next")
    om = load_model(path, None, dtype="bfloat16")
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    delta = [(name, m) for name, m in om.model.named_modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert delta and all(m.conv1d.weight.dtype == torch.float32 for _, m in delta)
    name, mine = delta[0]
    x = torch.randn(1, 5, om.model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        y, ref = mine(x), stock.get_submodule(name)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    # the one-token decode update the layer calls, with the widened weights: the stock bf16 result to bf16 rounding
    import inspect

    update = inspect.getmodule(type(mine)).causal_conv1d_update
    ch, taps = mine.conv1d.weight.shape[0], mine.conv1d.weight.shape[-1]
    g = torch.Generator().manual_seed(1)
    xt, state = (torch.randn(1, ch, n, generator=g).to(torch.bfloat16) for n in (1, taps - 1))
    w_bf16 = stock.get_submodule(name).conv1d
    got = update(xt, state.clone(), mine.conv1d.weight.squeeze(1), mine.conv1d.bias, mine.activation)
    want = update(xt, state.clone(), w_bf16.weight.squeeze(1), w_bf16.bias, mine.activation)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    fp32 = load_model(path, None, dtype="float32")
    assert all(m.conv1d.weight.dtype == torch.float32 for m in fp32.model.modules()
               if type(m).__name__.endswith("GatedDeltaNet"))
