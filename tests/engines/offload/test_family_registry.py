"""The family registry (control/families.py) against the installed transformers: the only place a module's source
is read.

    every registered model_type --transformers.models.<family>.modeling_<family>--> the classes and functions the
      fused path replaces (decoder layer, attention, norms, router, MoE block, rotary, gated DeltaNet and helpers),
      each ``forward`` source with the family's class prefix taken out
      --sha256--> compared with data/registry_sources.json (what the fused path was checked against)
    one-line families --same parts--> the registered family they borrow from (source equal, prefixes exchanged)

Why these could fail: a transformers release that changes a registered family's ``forward`` (the fused path would
then compute what the module used to): the test names the family and the class; run that family's exactness test
(test_fastpath.py, test_mla.py, test_deltanet.py), then ``python tests/engines/offload/test_family_registry.py --update``.
A family transformers drops, or a one-line family whose borrowed part diverges, fails too.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest

from moe_offload.control.description import Attention, LinearMixer, MoEBlock, describe
from moe_offload.control.families import FAMILIES

DATA = Path(__file__).parent / "data" / "registry_sources.json"
# the roles the fused path replaces (a family has some of them), and module-level functions it reproduces
ROLES = ("DecoderLayer", "Attention", "RMSNorm", "RMSNormGated", "TopKRouter", "TopkRouter", "SparseMoeBlock",
         "SparseMoEBlock", "MoE", "Moe", "MLP", "Experts", "GatedDeltaNet", "RotaryEmbedding", "TextRotaryEmbedding",
         "TextAttention", "MoeStatics")
FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "rotate_half", "causal_conv1d_update",
             "torch_recurrent_gated_delta_rule", "l2norm", "apply_mask_to_padding_states")
# families registered by one line: the parts they share with the family they borrow from
SAME_PARTS = {
    "mellum": ("qwen3_moe", ("DecoderLayer", "Attention", "RMSNorm", "SparseMoeBlock", "TopKRouter", "Experts", "MLP")),
    "exaone_moe": ("dots1", ("DecoderLayer", "RMSNorm", "TopkRouter", "Experts", "MLP")),
    "glm4_moe_lite": ("deepseek_v3", ("DecoderLayer", "Attention", "RMSNorm", "MoE", "TopkRouter", "Experts", "MLP")),
    "solar_open": ("glm4_moe", ("DecoderLayer", "RMSNorm", "MoE", "TopkRouter", "Experts", "MLP")),
}


def _module(model_type: str):
    from transformers.models.auto import configuration_auto as ca

    folder = ca.model_type_to_module_name(model_type)
    return importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")


def _prefix(mod) -> str:
    names = [n for n, c in vars(mod).items() if inspect.isclass(c) and c.__module__ == mod.__name__
             and n.endswith("DecoderLayer") and "Vision" not in n]
    return min(names, key=len)[: -len("DecoderLayer")]


def sources(model_type: str) -> dict[str, str]:
    """role -> the source the fused path depends on (``forward`` with the class prefix as X; functions as written)."""
    mod = _module(model_type)
    prefix = _prefix(mod)
    out = {}
    for role in ROLES:
        cls = getattr(mod, prefix + role, None)
        if inspect.isclass(cls) and "forward" in cls.__dict__:
            out[role] = inspect.getsource(cls.forward).replace(prefix, "X")
            if role == "GatedDeltaNet" and "fix_query_key_value_ordering" in cls.__dict__:
                out[role] += inspect.getsource(cls.fix_query_key_value_ordering)
    for fn in FUNCTIONS:
        f = getattr(mod, fn, None)
        if inspect.isfunction(f):
            out[fn] = inspect.getsource(f)
    return out


def fingerprints() -> dict[str, dict[str, str]]:
    return {mt: {role: hashlib.sha256(src.encode()).hexdigest()[:16] for role, src in sorted(sources(mt).items())}
            for mt in sorted(FAMILIES)}


def test_every_registered_family_is_in_the_installed_transformers():
    from transformers.models.auto import configuration_auto as ca

    missing = [mt for mt in FAMILIES if mt not in ca.CONFIG_MAPPING_NAMES]
    assert not missing, missing


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_registered_sources_are_the_ones_the_fused_path_was_checked_against(model_type):
    recorded = json.loads(DATA.read_text())
    now = fingerprints()[model_type]
    was = recorded.get(model_type)
    assert was is not None, f"{model_type}: not recorded; run its exactness tests, then {__file__} --update"
    changed = sorted(r for r in set(was) | set(now) if was.get(r) != now.get(r))
    assert not changed, (f"transformers changed {model_type}'s {', '.join(changed)}: the fused path may no longer "
                         f"compute what the module does; run its exactness tests, then {__file__} --update")


@pytest.mark.parametrize("model_type", sorted(SAME_PARTS))
def test_one_line_families_share_the_parts_they_borrow(model_type):
    ref, roles = SAME_PARTS[model_type]
    mine, theirs = sources(model_type), sources(ref)
    differ = [r for r in roles if mine.get(r) is None or mine.get(r) != theirs.get(r)]
    assert not differ, f"{model_type}'s {differ} are no longer {ref}'s"


def test_the_gated_deltanet_families_share_qwen3_next_helpers():
    # the kernel reproduces the conv update, the delta rule and l2norm of Qwen3-Next; Qwen3.5 keeps them
    a, b = sources("qwen3_5_moe"), sources("qwen3_next")
    for fn in ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "l2norm", "apply_mask_to_padding_states"):
        assert a.get(fn) == b.get(fn) and a.get(fn) is not None, fn


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_describes_from_its_own_config(model_type):
    # the description reads the family's config class (its defaults, made MoE where they are dense, as the tiny
    # checkpoints are): the fused path's families describe as fused with every layer a kind it computes, the
    # module-path entries say why
    import families

    desc = describe(families.tiny_config(model_type).to_dict())
    fam = FAMILIES[model_type]
    if fam.attention == "module":
        assert desc.path == "module" and desc.why
        return
    assert desc.path == "fused", desc.why
    assert all(isinstance(lay.mixer, (Attention, LinearMixer)) for lay in desc.layers)
    assert {lay.mixer.kind for lay in desc.layers if isinstance(lay.mixer, Attention)} == {fam.attention}
    assert any(isinstance(lay.ffn, MoEBlock) for lay in desc.layers)


def test_an_unregistered_family_describes_as_the_module_path():
    from transformers import AutoConfig

    desc = describe(AutoConfig.for_model("phimoe").to_dict())
    assert desc.path == "module" and desc.why == "family not in the registry" and desc.layers == ()


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(fingerprints(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DATA}")
