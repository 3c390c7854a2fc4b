"""Every MoE family of the installed transformers, run by the offload engine against transformers' own greedy tokens.

The family list is generated from transformers (modeling files that use the experts interface), so a release
that adds a family adds a test case here; the families that cannot be built are asserted to be exactly
``EXPECTED_UNBUILDABLE`` (with reasons), so none is skipped silently. Per family:

    tiny checkpoint (families.py) --stock transformers, generate()--> reference tokens
                                  --experts zeroed--> other tokens (else the comparison proves nothing)
                                  --build_offload_engine(policy static | lru, fraction 0.25)--> the same tokens
    ModelSpec of its config: same MoE layers as the model's experts modules; budget and plan accept it

fp32 throughout. MOE_OFFLOAD_FAMILY_RESULTS=path writes each family's outcome as JSON (scripts/family_table.py
turns it into docs/families.md's table).
"""

from __future__ import annotations

import json

import families as F
import pytest
import torch

from moe_offload import settings

FAMILIES = F.experts_families()
RUNNABLE = [f for f in FAMILIES if f not in F.NOT_GENERATIVE]
# Families that cannot be built, with the reason. A new transformers release that breaks the builder for a
# family, or adds a family it cannot build, fails test_unbuildable_families until this is updated.
EXPECTED_UNBUILDABLE = dict(F.NOT_GENERATIVE)
PROMPT = [5, 17, 42, 9, 88, 61, 23, 7]  # from families.PROMPT_IDS: no special token among them
N_TOKENS = 6
POLICIES = ("static", "lru")
FRACTION = 0.25

_results: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_results():
    # Tiny matrices: one thread is fastest, and on a busy 2-core machine a second thread costs milliseconds per
    # matmul in wake-ups (measured: 2.4 us vs 3.8 ms for [8, 64] x [64, 64]).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    out = settings.get("MOE_OFFLOAD_FAMILY_RESULTS")
    if out:
        from transformers import __version__

        payload = {"transformers": __version__, "families": FAMILIES, "not_generative": F.NOT_GENERATIVE,
                   "results": _results}
        with open(out, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, sort_keys=True)


def test_family_list_comes_from_transformers():
    # Fails when the enumeration finds nothing or loses the families the executor was first written for.
    assert len(FAMILIES) >= 60, FAMILIES
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "jamba", "qwen3_vl_moe"} <= set(FAMILIES)
    assert set(F.NOT_GENERATIVE) <= set(FAMILIES), "a family listed as out of scope is gone from transformers"


def test_out_of_scope_families_still_have_no_next_token_generation():
    # The reasons in NOT_GENERATIVE are checked against transformers, so a release that gives one of them a
    # causal LM class fails here instead of staying skipped.
    from moe_offload.engines.offload.loading.architecture import generative_class_name

    assert F.model_type("openai_privacy_filter") is None
    assert generative_class_name("diffusion_gemma").endswith("ForBlockDiffusion")


def test_unbuildable_families(family_checkpoints):
    failed = {f: family_checkpoints(f) for f in RUNNABLE}
    failed = {f: f"{type(e).__name__}: {e}" for f, e in failed.items() if isinstance(e, Exception)}
    unbuildable = {**F.NOT_GENERATIVE, **failed}
    assert set(unbuildable) == set(EXPECTED_UNBUILDABLE), "\n".join(f"{f}: {r}" for f, r in sorted(unbuildable.items()))


@pytest.mark.parametrize("family", RUNNABLE)
def test_family_matches_transformers(family_checkpoints, family):
    from transformers import AutoConfig

    from moe_offload.engines.offload.loading.architecture import model_class, text_path
    from moe_offload.engines.offload.loading.inspection import inspect_checkpoint
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    path = family_checkpoints(family)
    if isinstance(path, Exception):
        pytest.fail(f"{family}: cannot build its tiny checkpoint: {type(path).__name__}: {path}")
    record = _results.setdefault(family, {"model_type": F.model_type(family)})
    config = AutoConfig.from_pretrained(path)
    cls = model_class(config)
    stock = text_path(cls.from_pretrained(path)).eval()
    ref = _generate(stock)
    _zero_experts(stock)
    # The experts must change the answer, or matching transformers would prove nothing about them.
    assert _generate(stock) != ref, f"{family}: zeroing the routed experts leaves transformers' tokens unchanged"
    del stock

    _, experts, _ = inspect_checkpoint(path)
    text = config.get_text_config()
    record.update(cls=cls.__name__, layers=int(getattr(text, "num_hidden_layers", 0) or len(text.layer_types)),
                  layer_kinds=sorted(set(getattr(text, "layer_types", None) or ["full_attention"])),
                  moe_layers=[i.layer for i in experts], num_experts=experts[0].num_experts, reference=ref)
    for policy in POLICIES:
        engine = build_offload_engine(path, policy=policy, fraction=FRACTION)
        try:
            record["cache"] = "paged" if engine.paged else "per-sequence"
            tokens = list(engine.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)))
            stats = engine.stats()
        finally:
            engine.close()
        record[policy] = tokens == ref
        assert tokens == ref, f"{family} {policy} fraction={FRACTION}: {tokens} != transformers' {ref}"
        # at 0.25 some routed experts are not resident: the miss path ran
        assert stats["misses"] > 0, f"{family} {policy}: no misses at fraction {FRACTION}"
    _check_spec(family, config, record)


def _generate(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=N_TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def _zero_experts(model) -> None:
    from moe_offload.engines.offload.loading.architecture import experts_modules

    with torch.no_grad():
        for e in experts_modules(model)[0]:
            for p in e.module.parameters(recurse=False):
                p.zero_()


def _check_spec(family: str, config, record: dict) -> None:
    """The control plane on the same config: MoE layers agree with the model; budget and plan accept it; the
    parameter count against the meta model is recorded (tiny widths exaggerate what the spec does not price)."""
    from moe_offload.control import placement
    from moe_offload.control.budget import plan_budget
    from moe_offload.control.hf_config import PRICED
    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.loading.architecture import model_class, text_path
    from rm_core import MemoryTier

    spec = ModelSpec.from_hf_config(config.to_dict(), name=family)
    assert list(spec.moe_layers) == record["moe_layers"], f"{family}: spec MoE layers {spec.moe_layers}"
    assert spec.num_experts == record["num_experts"]
    budget = plan_budget(spec, [spec.total_bytes], context=64)
    tiers = (MemoryTier("acc", "device-hbm", spec.total_bytes, accelerator="test/acc:0"),
             MemoryTier("host", "host-dram", spec.total_bytes))
    plan = placement.plan(spec, tiers, {"acc": placement.fraction_slots(spec, FRACTION)}, "top")
    assert budget.experts_per_layer == spec.num_experts and len(plan.layers) == spec.num_moe_layers
    with torch.device("meta"):
        meta = text_path(model_class(config)._from_config(config))
    counted = sum(p.numel() for p in meta.parameters()) + sum(
        b.numel() for n, b in meta.named_buffers() if n.endswith("e_score_correction_bias"))
    record.update(spec_params=spec.total_params, transformers_params=counted, spec_estimated=list(spec.estimated),
                  kv_unknown=list(spec.kv_unknown_kinds))
    # spec.PRICED must be truthful both ways: what it claims is exact, and what is exact it claims.
    # (Where a tower or a layer kind is not priced at all, the total cannot tell: no check.)
    exact = abs(spec.total_params - counted) <= 5e-4 * counted
    priced = spec.model_type in PRICED
    if all("not checked" in note for note in spec.estimated):
        assert exact == priced, (f"{family}: spec {spec.total_params} vs transformers {counted} parameters, but "
                                 f"{spec.model_type!r} is {'' if priced else 'not '}in spec.PRICED")
