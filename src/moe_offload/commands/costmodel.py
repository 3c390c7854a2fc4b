"""`moe-offload calibrate | predict | hardware`: measure a machine for the cost model, or describe one from its
datasheets (hardware profiles); predict ms/token of a placement."""

from __future__ import annotations

import click

from moe_offload.commands.options import (
    MODEL_HELP,
    PROFILE_HELP,
    emit,
    expert_dtype_option,
    load_calibration_option,
    prediction_rows,
)
from moe_offload.control.vocab import MISS_POLICIES
from moe_offload.errors import ConfigError

UNITS = {"bytes_per_s": (1e9, "GB/s"), "flops_per_s": (1e9, "GFLOP/s"), "ms": (1.0, "ms")}


def _fmt(name: str, value: float) -> str:
    for suffix, (scale, unit) in UNITS.items():
        if name.endswith(suffix):
            return f"{value / scale:10.3f} {unit}"
    return f"{value:10.3f}"


def calibration_text(cal, spec=None) -> str:
    from moe_offload.control.calibration import FIELD_HELP
    from moe_offload.control.costmodel import NEVER, hybrid_threshold

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


def parse_expert_dtype(value: str | None):
    """--expert-dtype: a format name (bf16 spelled out: bfloat16) or bytes per parameter."""
    if value is None:
        return None
    from moe_offload.control.costmodel import expert_bytes_per_param

    try:
        number = float(value)
    except ValueError:
        number = None
    expert_bytes_per_param(value if number is None else number)  # one-line ConfigError when it is neither
    return value if number is None else number


@click.command("calibrate")
@click.option("--device", default="cpu", show_default=True, help="Device to measure: cpu or cuda[:N].")
@click.option("--model", default=None, help=MODEL_HELP + " Its expert shape and dtype are measured (default: H 1024, I 512, bf16).")
@click.option("--out", default=None, help="Write the calibration JSON here (for plan/predict --calibration).")
@click.option("--quick", is_flag=True, help="Small buffers: faster, less exact.")
@expert_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def calibrate_cmd(device: str, model: str | None, out: str | None, quick: bool, expert_dtype: str | None, as_json: bool) -> None:
    """Measure read bandwidth, expert kernel, host->device copy and per-layer overhead (a few seconds)."""
    from moe_offload.control.spec import ModelSpec

    if expert_dtype and not model:
        raise ConfigError("--expert-dtype needs --model (the expert shape to measure in that format)")
    spec = ModelSpec.from_hf_config(model).with_expert_dtype(expert_dtype) if model else None
    from transformers.utils import logging

    logging.disable_progress_bar()
    from moe_offload.engines.offload.tools.calibrate import calibrate

    cal = calibrate(device, spec, quick=quick)
    text = calibration_text(cal, spec)
    if out:
        cal.save(out)
        text += f"\n  wrote {out}"
    emit(cal.to_dict(), as_json, text)


@click.command("predict")
@click.option("--model", required=True, help=MODEL_HELP)
@click.option("--placement", "placement_path", default=None, help="Placement JSON (from `moe-offload plan --out`).")
@click.option("--fraction", type=float, default=None, help="Or: this fraction of each layer's experts resident, as `generate --fraction` places them.")
@click.option("--policy", type=click.Choice([*MISS_POLICIES, "all"]), default="all", show_default=True, help="Miss policy.")
@click.option("--calibration", "calibration_path", default=None, help="Calibration JSON from `moe-offload calibrate` (default: assumed numbers, labelled so).")
@click.option("--hardware", default=None, help=f"A hardware profile instead of --calibration: {PROFILE_HELP}; its numbers are datasheet peaks x "
              "stated efficiencies (assumed).")
@click.option("--device", default="cuda", show_default=True, help="Device type of the assumed calibration when neither --calibration nor --hardware is given.")
@click.option("--profile", "profile_path", default=None, help="Routes file or profile counts: hit rates from it (default: uniform routing).")
@click.option("--hit-rate", type=click.FloatRange(0, 1), default=None, help="Use this accelerator hit rate (e.g. a measured one).")
@click.option("--tokens", type=click.IntRange(min=1), default=1, show_default=True, help="Tokens per step (1 = decode).")
@click.option("--context", type=click.IntRange(min=0), default=0, show_default=True, help="Tokens in the KV cache (read every step).")
@click.option("--expert-dtype", default=None,
              help="Price the routed experts as stored in this format: int8, fp8, bf16 as the engine's --expert-dtype "
                   "holds them; bfloat16, float16, q8_0, q4_0, mxfp4; or bytes per parameter (default: as the "
                   "checkpoint stores them).")
@click.option("--host-memory", default=None,
              help="Host memory for routed experts (e.g. 6GiB) when they live on disk: predicts the disk tier's reads.")
@click.option("--host-hit-rate", type=click.FloatRange(0, 1), default=None,
              help="With --host-memory: use this host-tier hit rate (e.g. the measured `stats.disk.host_hit_rate`).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def predict_cmd(model, placement_path, fraction, policy, calibration_path, hardware, device, profile_path, hit_rate, tokens,
                context, expert_dtype, host_memory, host_hit_rate, as_json) -> None:
    """Predicted ms/token of a placement under each miss policy, with its breakdown (a prediction, not a measurement)."""
    from moe_offload.control import placement as P
    from moe_offload.control.costmodel import predict
    from moe_offload.control.profile import Profile
    from moe_offload.control.spec import ModelSpec
    from moe_offload.control.vocab import EXPERT_DTYPES
    from rm_core import Placement

    spec = ModelSpec.from_hf_config(model)
    if expert_dtype in EXPERT_DTYPES:  # what the engine's --expert-dtype holds: the spec prices it
        spec, expert_dtype = spec.with_expert_dtype(expert_dtype), None
    if (placement_path is None) == (fraction is None):
        raise ConfigError("give one of --placement FILE or --fraction F")
    cal = load_calibration_option(calibration_path, device, hardware)
    expert_dtype = parse_expert_dtype(expert_dtype)  # any other format (q8_0, q4_0, ...) or bytes per parameter
    profile = Profile.load(profile_path).check(spec) if profile_path else None
    policies = MISS_POLICIES if policy == "all" else (policy,)
    host_slots = None
    if host_memory is not None:
        from moe_offload.control.hitrates import host_slots_for
        from moe_offload.control.units import parse_size

        host_slots = host_slots_for(spec, parse_size(host_memory, "--host-memory"))
    elif host_hit_rate is not None:
        raise ConfigError("--host-hit-rate needs --host-memory (the disk tier)")
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
        preds.append(predict(spec, placement, pol, cal, hit_rates=hit_rate, profile=profile, tokens=tokens, context=context,
                             expert_dtype=expert_dtype, host_slots=host_slots, host_hit_rate=host_hit_rate))
    lines = [f"{spec.name}: PREDICTED ms/token ({tokens} token{'s' if tokens > 1 else ''} per step, context {context}); "
             f"calibration {cal.label()}"]
    lines += prediction_rows(preds)
    notes = sorted({a for p in preds for a in p.assumptions})
    lines += [f"  assumed: {a}" for a in notes]
    emit({"label": "predicted", "calibration": cal.to_dict(), "predictions": [p.to_dict() for p in preds]}, as_json,
         "\n".join(lines))


@click.command("hardware")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def hardware_cmd(name: str | None, as_json: bool) -> None:
    """The built-in hardware profiles, or one profile (a name or a JSON file) with the source of every number."""
    from moe_offload.control.hardware import ASSUMPTIONS, BUILTIN, load_hardware

    if name is None:
        lines = ["hardware profiles (datasheet peaks x assumed efficiencies; `moe-offload hardware NAME` for sources):"]
        for p in BUILTIN.values():
            cal = p.calibration()
            lines.append(f"  {p.name:18} {p.title}")
            lines.append(f"  {'':18} -> accelerator {cal.value('device_expert_bytes_per_s') / 1e9:.0f} GB/s, "
                         f"host experts {cal.value('host_expert_bytes_per_s') / 1e9:.0f} GB/s, "
                         f"bus {cal.value('bus_bytes_per_s') / 1e9:.1f} GB/s")
        emit({"profiles": [p.to_dict() for p in BUILTIN.values()], "assumptions": ASSUMPTIONS}, as_json, "\n".join(lines))
        return
    p = load_hardware(name)
    lines = [f"{p.name}: {p.title}"]
    for f, text in p.sources.items():
        lines.append(f"  {f:20} {_figure(p, f):>14}  {text}")
    lines.append("  assumed efficiencies:")
    for f in ("device_efficiency", "bus_efficiency", "host_efficiency", "core_bytes_per_s", "flops_efficiency"):
        lines.append(f"  {f:20} {_figure(p, f):>14}  {ASSUMPTIONS[f]}")
    lines.append(f"  {'overheads':20} {p.layer_overhead_ms:g} ms/layer, {p.step_overhead_ms:g} ms/step  {ASSUMPTIONS['overhead']}")
    lines += [f"  note: {n}" for n in p.notes]
    lines.append(calibration_text(p.calibration()))
    emit({"profile": p.to_dict(), "calibration": p.calibration().to_dict(), "assumptions": ASSUMPTIONS}, as_json,
         "\n".join(lines))


def _figure(p, name: str) -> str:
    v = getattr(p, name, None)
    if name == "accelerators":
        return " + ".join(f"{a / 2**30:.1f} GiB" for a in v)
    if name.endswith("_memory_bytes"):
        return f"{v / 2**30:.0f} GiB"
    if name.endswith("flops_per_s"):
        return f"{v / 1e12:.1f} TFLOP/s"
    if name.endswith("bytes_per_s"):
        return f"{v / 1e9:.1f} GB/s"
    return f"{v:g}" if isinstance(v, (int, float)) else ""


def _fraction_tiers(spec):
    from rm_core import MemoryTier

    return [MemoryTier("accel:0", "device-hbm", spec.total_bytes, accelerator="local/accel:0", labels={"sized": "fraction"}),
            MemoryTier("host", "host-dram", spec.routed_expert_bytes, labels={"sized": "routed experts"})]


commands = [calibrate_cmd, predict_cmd, hardware_cmd]
