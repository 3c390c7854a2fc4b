"""`moe-offload calibrate | predict`: measure a machine for the cost model; predict ms/token of a placement."""

from __future__ import annotations

import click

from moe_offload.commands.plan import expert_dtype_option
from moe_offload.errors import ConfigError

MODEL_HELP = "Checkpoint directory or config.json."
UNITS = {"bytes_per_s": (1e9, "GB/s"), "flops_per_s": (1e9, "GFLOP/s"), "ms": (1.0, "ms")}


def _fmt(name: str, value: float) -> str:
    for suffix, (scale, unit) in UNITS.items():
        if name.endswith(suffix):
            return f"{value / scale:10.3f} {unit}"
    return f"{value:10.3f}"


def calibration_text(cal, spec=None) -> str:
    from moe_offload.costmodel import FIELD_HELP, NEVER, hybrid_threshold

    lines = [f"calibration for {cal.device}: {cal.label()}"]
    for name in FIELD_HELP:
        q = getattr(cal, name)
        lines.append(f"  {name:27} {_fmt(name, q.value)}  {q.source:8}  {q.how}")
    if spec is not None:
        n = hybrid_threshold(cal, spec.expert_bytes, spec.expert_params)
        lines.append(f"  hybrid threshold for {spec.name}'s experts: "
                     + ("never (a fetch never pays here; hybrid acts as static)" if n >= NEVER else f"{n} tokens per expert"))
    lines.extend(f"  note: {n}" for n in cal.notes)
    return "\n".join(lines)


def load_calibration_option(path: str | None, device: str = "cuda"):
    """--calibration FILE, or the assumed defaults for ``device`` when none is given."""
    from moe_offload.costmodel import Calibration

    return Calibration.load(path) if path else Calibration.assumed(device)


@click.command("calibrate")
@click.option("--device", default="cpu", show_default=True, help="Device to measure: cpu or cuda[:N].")
@click.option("--model", default=None, help=MODEL_HELP + " Its expert shape and dtype are measured (default: H 1024, I 512, bf16).")
@click.option("--out", default=None, help="Write the calibration JSON here (for plan/predict --calibration).")
@click.option("--quick", is_flag=True, help="Small buffers: faster, less exact.")
@expert_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def calibrate_cmd(device: str, model: str | None, out: str | None, quick: bool, expert_dtype: str | None, as_json: bool) -> None:
    """Measure read bandwidth, expert kernel, host->device copy and per-layer overhead (a few seconds)."""
    from moe_offload.cli import emit
    from moe_offload.spec import ModelSpec

    if expert_dtype and not model:
        raise ConfigError("--expert-dtype needs --model (the expert shape to measure in that format)")
    spec = ModelSpec.from_hf_config(model).with_expert_dtype(expert_dtype) if model else None
    from transformers.utils import logging

    logging.disable_progress_bar()
    from moe_offload.engines.offload.calibrate import calibrate

    cal = calibrate(device, spec, quick=quick)
    text = calibration_text(cal, spec)
    if out:
        cal.save(out)
        text += f"\n  wrote {out}"
    emit(cal.to_dict(), as_json, text)


def prediction_rows(preds) -> list[str]:
    lines = []
    for p in preds:
        b = p.breakdown()
        lines.append(f"  {p.policy:6} on {p.placement_policy:8} {p.ms_per_token:9.3f} ms/token ({p.tokens_per_s:7.1f} tok/s)"
                     f"  device experts {b['device_experts_ms']:.3f}, host experts {b['host_experts_ms']:.3f}, "
                     f"fetch {b['fetch_ms']:.3f}, dense {b['dense_ms']:.3f}, overhead {b['overhead_ms']:.3f}"
                     + (f", overlap {b['overlap_ms']:.3f}" if b["overlap_ms"] else "")
                     + f"; hit rate {p.accelerator_hit_rate:.1%}")
    return lines


@click.command("predict")
@click.option("--model", required=True, help=MODEL_HELP)
@click.option("--placement", "placement_path", default=None, help="Placement JSON (from `moe-offload plan --out`).")
@click.option("--fraction", type=float, default=None, help="Or: this fraction of each layer's experts resident, as `generate --fraction` places them.")
@click.option("--policy", type=click.Choice(["static", "lru", "hybrid", "all"]), default="all", show_default=True, help="Miss policy.")
@click.option("--calibration", "calibration_path", default=None, help="Calibration JSON from `moe-offload calibrate` (default: assumed numbers, labelled so).")
@click.option("--device", default="cuda", show_default=True, help="Device type of the assumed calibration when no --calibration is given.")
@click.option("--profile", "profile_path", default=None, help="Routes file or profile counts: hit rates from it (default: uniform routing).")
@click.option("--hit-rate", type=click.FloatRange(0, 1), default=None, help="Use this accelerator hit rate (e.g. a measured one).")
@click.option("--tokens", type=click.IntRange(min=1), default=1, show_default=True, help="Tokens per step (1 = decode).")
@click.option("--context", type=click.IntRange(min=0), default=0, show_default=True, help="Tokens in the KV cache (read every step).")
@expert_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def predict_cmd(model, placement_path, fraction, policy, calibration_path, device, profile_path, hit_rate, tokens, context,
                expert_dtype, as_json) -> None:
    """Predicted ms/token of a placement under each miss policy, with its breakdown (a prediction, not a measurement)."""
    from moe_offload import placement as P
    from moe_offload.cli import emit
    from moe_offload.costmodel import MISS_POLICIES, predict
    from moe_offload.profile import Profile
    from moe_offload.spec import ModelSpec
    from rm_core import Placement

    spec = ModelSpec.from_hf_config(model).with_expert_dtype(expert_dtype)
    if (placement_path is None) == (fraction is None):
        raise ConfigError("give one of --placement FILE or --fraction F")
    cal = load_calibration_option(calibration_path, device)
    profile = Profile.load(profile_path).check(spec) if profile_path else None
    policies = MISS_POLICIES if policy == "all" else (policy,)
    preds = []
    for pol in policies:
        if placement_path:
            try:
                with open(placement_path, encoding="utf-8") as f:
                    placement = Placement.from_json(f.read())
            except OSError as e:
                raise ConfigError(f"--placement {placement_path}: cannot read ({e})") from None
        else:
            placement = P.from_fraction(spec, _fraction_tiers(spec), fraction,
                                        P.for_miss_policy(pol, P.fraction_slots(spec, fraction), spec.num_experts),
                                        profile)
        preds.append(predict(spec, placement, pol, cal, hit_rates=hit_rate, profile=profile, tokens=tokens, context=context))
    lines = [f"{spec.name}: PREDICTED ms/token ({tokens} token{'s' if tokens > 1 else ''} per step, context {context}); "
             f"calibration {cal.label()}"]
    lines += prediction_rows(preds)
    notes = sorted({a for p in preds for a in p.assumptions})
    lines += [f"  assumed: {a}" for a in notes]
    emit({"label": "predicted", "calibration": cal.to_dict(), "predictions": [p.to_dict() for p in preds]}, as_json,
         "\n".join(lines))


def _fraction_tiers(spec):
    from rm_core import MemoryTier

    return [MemoryTier("accel:0", "device-hbm", spec.total_bytes, accelerator="local/accel:0", labels={"sized": "fraction"}),
            MemoryTier("host", "host-dram", spec.routed_expert_bytes, labels={"sized": "routed experts"})]


commands = [calibrate_cmd, predict_cmd]
