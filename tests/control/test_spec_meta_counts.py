"""`moe-offload spec`, `budget` and `plan` on published config.json files, against what transformers instantiates.

For each config the model is built on the meta device (no memory, no weights) with the class the engine loads it
with; its parameter count (plus the routing-correction buffers checkpoints store) is the reference for the spec's
total, within 1 %. The MoE layers must be exactly those whose experts modules the model builds.
"""

import json

import pytest

from moe_offload.cli import main
from moe_offload.control.spec import ModelSpec

from .published_configs import PUBLISHED
from .test_spec_published import GPT_OSS_120B

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = {**PUBLISHED, "gpt-oss-120b": GPT_OSS_120B}
_counts: dict[str, tuple[int, list[int]]] = {}


def transformers_count(name: str) -> tuple[int, list[int]]:
    """(parameters + e_score_correction_bias elements, MoE layers) of the meta model transformers builds."""
    if name not in _counts:
        from moe_offload.engines.offload.loading.architecture import experts_modules, model_class, text_path

        cfg = {k: v for k, v in CONFIGS[name].items() if k != "quantization_config"}  # count weights, not scales
        config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        with torch.device("meta"):
            model = text_path(model_class(config)._from_config(config))
        n = sum(p.numel() for p in model.parameters())
        n += sum(b.numel() for k, b in model.named_buffers() if k.endswith("e_score_correction_bias"))
        _counts[name] = n, [e.layer for e in experts_modules(model)[0]]
    return _counts[name]


@pytest.fixture
def config_dir(tmp_path):
    def write(name: str):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CONFIGS[name]))
        return d

    return write


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_spec_total_within_one_percent_of_transformers(name, config_dir, capsys):
    total, moe_layers = transformers_count(name)
    assert main(["spec", "--model", str(config_dir(name)), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["total_params"] == pytest.approx(total, rel=0.01), \
        f"{name}: spec {got['total_params'] / 1e9:.3f}B vs transformers {total / 1e9:.3f}B"
    assert got["moe_layers"] == moe_layers


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_budget_and_plan_accept_it(name, config_dir, tmp_path, capsys):
    d = config_dir(name)
    argv = ["budget", "--model", str(d), "--accelerator", "80GiB", "--accelerator", "80GiB", "--context", "8192", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    budget = json.loads(capsys.readouterr().out)
    assert budget["experts_per_layer"] == ModelSpec.from_hf_config(d).num_experts
    out = tmp_path / f"{name}.placement.json"
    assert main(["plan", "--model", str(d), "--slots", "8", "--out", str(out)]) == 0, capsys.readouterr().err
    spec = ModelSpec.from_hf_config(d)
    assert len(json.loads(out.read_text())["layers"]) == spec.num_moe_layers


def test_layer_kinds_of_the_hybrids():
    nano = ModelSpec.from_hf_config(PUBLISHED["nemotron-3-nano-30b-a3b"])
    assert nano.num_layers == 52  # from the pattern: the config has no num_hidden_layers
    # relu2 experts are up [I, H] and down [H, I]: quantized, each row carries its own scale
    H, I = nano.hidden_size, nano.expert_intermediate_size
    assert nano.stored_expert_bytes("int8") == (I * H + 4 * I) + (H * I + 4 * H)
    assert nano.stored_expert_bytes("bfloat16") == 2 * I * H * 2
    assert (nano.layer_types.count("linear_attention"), nano.layer_types.count("moe"),
            nano.layer_types.count("full_attention")) == (23, 23, 6)
    # only the 6 attention layers grow a KV cache; Mamba-2 layers keep a constant state
    assert nano.kv_bytes_per_token == 6 * 2 * 2 * 128 * 2
    assert nano.kv_cache_bytes(8192) > nano.kv_cache_bytes(4096) > 0
    next80 = ModelSpec.from_hf_config(PUBLISHED["qwen3-next-80b-a3b"])
    assert next80.layer_types.count("full_attention") == 12 and next80.linear_design == "gated_deltanet"
    kimi = ModelSpec.from_hf_config(PUBLISHED["kimi-linear-48b-a3b"])
    assert [i for i, t in enumerate(kimi.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert kimi.moe_layers == tuple(range(1, 27)) and kimi.linear_design == "kda"
    jamba = ModelSpec.from_hf_config(PUBLISHED["jamba-mini-1.5"])
    assert jamba.layer_types.count("full_attention") == 4 and jamba.moe_layers == tuple(range(1, 32, 2))
    assert jamba.dense_intermediate_size == 14336  # its dense layers use intermediate_size like its experts
    v32 = ModelSpec.from_hf_config(PUBLISHED["deepseek-v3.2"])
    # MLA latent + rope key + the indexer's 128-wide key, per layer and token
    assert set(v32.layer_types) == {"indexed_attention"} and v32.kv_bytes_per_token == 61 * (512 + 64 + 128) * 2
    assert all(not s.kv_unknown_kinds for s in (nano, next80, kimi, jamba, v32))


def test_unknown_layer_kinds_are_carried_through_and_reported(config_dir):
    # A kind this release of the spec does not know: the spec still reads the config, prices the layer as
    # attention, leaves its KV out, and says both; the budget repeats it.
    cfg = dict(CONFIGS["glm-4.5"], num_hidden_layers=4, first_k_dense_replace=1,
               layer_types=["full_attention", "compressed_sparse_attention", "full_attention", "hybrid"])
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.layer_types[1] == "compressed_sparse_attention"
    assert spec.kv_unknown_kinds == ("compressed_sparse_attention", "hybrid")
    assert spec.kv_bytes_per_token == 2 * spec.kv_bytes_per_token_layer(0)
    assert any("compressed_sparse_attention" in e for e in spec.estimated)
    from moe_offload.control.budget import plan_budget

    text = plan_budget(spec, ["80GiB"], context=4096).text()
    assert "KV cache of layer kinds compressed_sparse_attention, hybrid (2 layers) unknown: not counted" in text
