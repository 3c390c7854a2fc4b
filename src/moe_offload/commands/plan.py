"""`moe-offload spec | budget | plan`: the planning half, no torch."""

from __future__ import annotations

import click

from moe_offload.commands.options import MODEL_HELP, PROFILE_HELP, emit, expert_dtype_option
from moe_offload.errors import ConfigError


def _spec(model: str, expert_dtype: str | None = None):
    from moe_offload.control.spec import ModelSpec

    return ModelSpec.from_hf_config(model).with_expert_dtype(expert_dtype)


def _backend_tiers(name: str):
    """Accelerator tiers and the host tier a backend reports here."""
    from moe_offload import backends

    b = backends.get_backend(name)
    b.require()
    return list(b.tiers())


def _machine_tiers(backend: str | None, hardware: str | None):
    """The memory tiers of --backend (this machine) or of --hardware (a profile of another), or None."""
    if backend and hardware:
        raise ConfigError("give one of --backend NAME or --hardware NAME|FILE, not both")
    if backend:
        return _backend_tiers(backend)
    if hardware:
        from moe_offload.control.hardware import load_hardware

        return load_hardware(hardware).tiers()
    return None


def _budget_options(fn):
    fn = click.option("--layout", type=click.Choice(["first", "split"]), default="first", show_default=True,
                      help="first: non-expert weights and KV cache on the first accelerator; split: layers split over accelerators.")(fn)
    fn = click.option("--reserve", default="0", show_default=True, help="Kept free on every accelerator (e.g. 2GiB).")(fn)
    fn = click.option("--batch", type=click.IntRange(min=0), default=1, show_default=True, help="Sequences in the KV cache.")(fn)
    fn = click.option("--context", type=click.IntRange(min=0), default=4096, show_default=True, help="Tokens per sequence in the KV cache.")(fn)
    return fn


@click.command("spec")
@click.option("--model", required=True, help=MODEL_HELP)
@expert_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def spec_cmd(model: str, expert_dtype: str | None, as_json: bool) -> None:
    """Model shape: layers, experts, parameters (total/active) and bytes per component."""
    from moe_offload.control.units import format_count, format_size

    s = _spec(model, expert_dtype)
    fmt = s.expert_format or s.dtype
    stored = s.checkpoint_expert_format or s.dtype
    rows = [
        ("model", f"{s.name} ({s.model_type}, {s.dtype})"),
        ("layers", f"{s.num_layers} ({s.num_moe_layers} MoE; dense: {list(s.dense_layers) or 'none'})"),
        ("experts", f"{s.num_experts} routed, top-{s.top_k}, {s.num_shared_experts} shared"),
        ("attention", f"{s.attention}, {s.num_attention_heads} heads, "
                      + (f"kv_lora_rank {s.kv_lora_rank}, q_lora_rank {s.q_lora_rank}, qk head dim "
                         f"{s.qk_nope_head_dim}+{s.qk_rope_head_dim}, v head dim {s.v_head_dim}" if s.attention == "mla"
                         else f"{s.num_kv_heads} KV heads, head dim {s.head_dim}")
                      + (f", sliding window {s.sliding_window} on {s.layer_types.count('sliding_attention')} layers"
                         if "sliding_attention" in s.layer_types else "")),
        ("parameters", f"{format_count(s.total_params)} total, {format_count(s.active_params)} active"),
        ("experts held as", fmt + (f" (checkpoint: {stored})" if fmt != stored else "")),
        ("one expert", format_size(s.expert_bytes)),
        ("experts per layer", format_size(s.layer_expert_bytes)),
        ("all routed experts", format_size(s.routed_expert_bytes)),
        ("dense weights", f"{format_size(s.dense_bytes)} (attention, norms, routers, shared experts, dense MLPs)"),
        ("embeddings", format_size(s.embedding_bytes)),
        ("lm head", format_size(s.lm_head_bytes) + (" (tied: final norm only)" if s.tie_word_embeddings else "")),
        ("total", format_size(s.total_bytes) + " (loaded: non-expert weights in " + s.dtype + ", experts as held)"),
        ("checkpoint", format_size(s.checkpoint_bytes) + f" (as stored: experts {stored}"
                       + (", linears in block fp8" if stored == "fp8" else "") + ")"),
        ("disk tier", "reads the checkpoint's expert tensors in place (no copy)" if s.disk_in_place else
         f"an expert store copy of {format_size(s.disk_copy_bytes)} (experts re-laid out; when they do not fit in memory)"),
        ("kv cache / token", format_size(s.kv_bytes_per_token)
         + (f" (not counted: {', '.join(s.kv_unknown_kinds)} layers)" if s.kv_unknown_kinds else "")),
    ]
    kinds = {t: s.layer_types.count(t) for t in dict.fromkeys(s.layer_types)}
    rows.insert(2, ("layer kinds", ", ".join(f"{n} {t}" for t, n in kinds.items())
                    + (f" ({s.linear_design} linear attention)" if s.linear_design else "")))
    rows += [("estimated", e) for e in s.estimated]
    path, why = _decode_path(model)
    rows.append(("decode path", path + (f" ({why})" if why else "")))
    emit({**s.summary(), "decode_path": path, "decode_path_reason": why}, as_json,
         "\n".join(f"{k:20} {v}" for k, v in rows))


def _decode_path(model: str) -> tuple[str, str]:
    """The decode path a bf16 CPU engine takes for this checkpoint, from the family registry (control/families.py):
    ("fused" | "fused (MLA)" | "graph" | "module", why in words)."""
    from moe_offload.control.description import describe, fused_refusal
    from moe_offload.control.hf_config import load_config

    d = describe(load_config(model))
    if d.path == "module":
        return "module", f"transformers' modules: {d.why}"
    why = fused_refusal(d)
    if why:
        return "graph", f"the owned graph's blocks: {why}"
    return ("fused (MLA)" if d.attention == "mla" else "fused"), f"the registry's {d.model_type} entry, bf16 on the CPU"


@click.command("budget")
@click.option("--model", required=True, help=MODEL_HELP)
@click.option("--accelerator", "accelerators", multiple=True, help="Accelerator memory, repeatable (47.5GiB, 80GB, bytes).")
@click.option("--backend", default=None, help="Take the accelerators from this backend's tiers instead.")
@click.option("--hardware", default=None, help="Take the accelerators from a hardware profile (`moe-offload hardware`) or its JSON file.")
@_budget_options
@expert_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def budget_cmd(model, accelerators, backend, hardware, context, batch, reserve, layout, expert_dtype, as_json) -> None:
    """Per accelerator: what it holds, expert slots per layer, what stays on the host."""

    b = _budget(_spec(model, expert_dtype), accelerators, _machine_tiers(backend, hardware), context, batch, reserve, layout)
    emit(b.to_dict(), as_json, b.text())


def _budget(spec, accelerators, tiers, context, batch, reserve, layout):
    """plan_budget over the --accelerator sizes plus the accelerators of ``tiers`` (a backend's or a profile's)."""
    from moe_offload.control.budget import plan_budget
    from moe_offload.control.placement import accelerator_tiers, host_tier_name

    host = disk = None
    if tiers:
        host_name = host_tier_name(tiers)
        host = next((t for t in tiers if t.name == host_name), None)
        disk = next((t for t in tiers if t.kind == "disk"), None)
        accelerators = list(accelerators) + accelerator_tiers(tiers)
    if not accelerators:
        raise ConfigError("give --accelerator SIZE (repeatable), --backend NAME or --hardware NAME")
    return plan_budget(spec, list(accelerators), context=context, batch=batch, reserve=reserve, layout=layout, host=host,
                       disk=disk)


def _parse_slots(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 0 for v in vals):
        raise ConfigError(f"--slots: expected comma-separated integers >= 0 (one per accelerator), got {text!r}")
    return vals


def _slot_tiers(spec, slots: list[int]):
    from rm_core import MemoryTier

    per_slot = spec.expert_bytes * spec.num_moe_layers
    tiers = []
    for i, n in enumerate(slots):
        size = n * per_slot + (spec.non_expert_bytes if i == 0 else 0)
        tiers.append(MemoryTier(f"accel:{i}", "device-hbm", size, accelerator=f"local/accel:{i}", labels={"sized": "from slots"}))
    tiers.append(MemoryTier("host", "host-dram", spec.routed_expert_bytes, labels={"sized": "routed experts"}))
    return tiers


@click.command("plan")
@click.option("--model", required=True, help=MODEL_HELP)
@click.option("--profile", "profile_path", default=None, help="Routes file (.safetensors/.json) or profile counts JSON.")
@click.option("--class", "klass", default=None, help="Plan for one request class of the profile.")
@click.option("--slots", default=None, help="Expert slots per layer, one per accelerator: 24,32.")
@click.option("--fraction", type=float, default=None, help="Fraction of each layer's experts on the accelerator (GPU-style).")
@click.option("--budget", "budgets", multiple=True, help="Size slots from accelerator memory, repeatable (47.5GiB).")
@click.option("--backend", default=None, help="Use this backend's memory tiers; without --slots/--fraction/--budget, size slots from their free memory.")
@_budget_options
@click.option("--policy", default="top", show_default=True,
              help="top | mix:H | global | lru | uniform | random | auto (fastest predicted miss + placement policy)")
@click.option("--calibration", "calibration_path", default=None,
              help="Calibration JSON (`moe-offload calibrate`) for auto and the predicted ms/token (default: assumed numbers).")
@click.option("--hardware", default=None, help=f"Size from (and predict for) a hardware profile: {PROFILE_HELP}.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random policy.")
@click.option("--out", default=None, help="Write the rm-core Placement JSON here.")
@click.option("--simulate", "replay", is_flag=True, help="Also replay the routes file through the placement (LRU slots).")
@click.option("--host-memory", default=None,
              help="Host memory for the experts no accelerator holds (e.g. 8GiB); the rest go to a disk tier (the "
                   "expert store): host memory pins the profile's hottest of them, else caches them (LRU).")
@expert_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan_cmd(model, profile_path, klass, slots, fraction, budgets, backend, context, batch, reserve, layout, policy,
             calibration_path, hardware, seed, out, replay, host_memory, expert_dtype, as_json) -> None:
    """Place experts on accelerators and print the predicted hit rate per tier."""
    from moe_offload.control import placement as P
    from moe_offload.control.hitrates import host_slots_for
    from moe_offload.control.profile import Profile, load_routes
    from moe_offload.control.units import parse_size

    spec = _spec(model, expert_dtype)
    auto = policy == "auto"
    if not auto:
        P.parse_policy(policy)  # a bad policy fails before any file is read
    sizings = sum(x is not None and x != () for x in (slots, fraction, budgets or None))
    if sizings > 1:
        raise ConfigError("give one of --slots, --fraction, --budget")
    if sizings == 0 and not (backend or hardware):
        raise ConfigError("size the placement with --slots 24,32, --fraction 0.2, --budget 47.5GiB or --hardware NAME")
    machine = _machine_tiers(backend, hardware)
    profile = None
    if profile_path:
        profile = Profile.load(profile_path)
        if klass:
            profile = profile.for_class(klass)
        profile.check(spec)
    elif klass or replay:
        raise ConfigError("--class and --simulate need --profile")
    if slots is not None:
        vals = _parse_slots(slots)
        tiers = machine or _slot_tiers(spec, vals)
        acc = P.accelerator_tiers(tiers)
        if len(vals) > len(acc):
            raise ConfigError(f"--slots gives {len(vals)} accelerators, the tiers have {len(acc)}")
        slot_map = {t.name: v for t, v in zip(acc, vals)}
    elif fraction is not None:
        tiers = machine or _slot_tiers(spec, [spec.num_experts])
        acc = P.accelerator_tiers(tiers)
        slot_map = {acc[0].name: P.fraction_slots(spec, fraction)} if acc else {}  # as placement.from_fraction
    else:
        b = _budget(spec, budgets, machine, context, batch, reserve, layout)
        tiers, slot_map = list(b.tiers), b.slots
    cal, ranked = None, []
    if auto or calibration_path or hardware:
        from moe_offload.commands.options import load_calibration_option

        cal = load_calibration_option(calibration_path, "cpu" if backend == "cpu" else "cuda", hardware)
    host_slots = None if host_memory is None else host_slots_for(spec, parse_size(host_memory, "--host-memory"))
    if auto:
        if host_slots is not None:
            raise ConfigError("--host-memory places one policy across three tiers: give --policy top, global, mix:H "
                              "or lru, not auto")
        from moe_offload.control.costmodel import rank

        ranked = rank(spec, tiers, profile, cal, slots=slot_map, seed=seed)
        placement = ranked[0][1]
    else:
        placement = P.plan(spec, tiers, slot_map, policy, profile, seed, host_slots=host_slots)
    result = {"placement": placement.to_dict(), "predicted_hit_rate": dict(placement.predicted_hit_rate)}
    lines = [f"{spec.name}: policy {placement.policy if not auto else f'auto -> {placement.policy}'}, "
             f"profile {placement.profile or 'none (expert-id order)'}"]
    for t in P.accelerator_tiers(placement.tiers):
        per_layer = [lp.slots.get(t.name, 0) for lp in placement.layers]
        pinned = sum(len(lp.pinned(t.name)) for lp in placement.layers)
        lines.append(f"  {t.name}: slots per layer {min(per_layer)}..{max(per_layer)} (total {sum(per_layer)}, {pinned} pinned)")
    disk = P.disk_tier_name(placement.tiers)
    host = P.host_tier_name(placement.tiers)
    on_disk = sum(len(lp.pinned(disk)) for lp in placement.layers) if disk else 0
    if host_slots is not None:
        pinned = sum(len(lp.pinned(host)) for lp in placement.layers) if on_disk else 0
        lines.append(f"  {host}: {host_slots} expert slots per layer ({pinned} pinned in all, the rest an LRU cache); "
                     f"{disk}: {on_disk} experts in the expert store" if on_disk else
                     f"  {host}: holds every expert no accelerator holds ({host_slots} slots per layer): no disk tier")
    try:
        split = _host_split(spec, machine, host_memory, context, batch, backend)
        result["memory"] = split.split()
        lines.append(f"  host memory: {split.reason}")
    except ConfigError as e:  # planning for another machine: the shortfall is a finding, not a failure
        result["memory"] = {"error": str(e)}
        lines.append(f"  {e}")
        split = None
    if on_disk or (split is not None and split.experts_on_disk):
        result["disk"] = _disk_need(spec)
        lines.append(f"  disk: {result['disk']['reason']}")
    if placement.predicted_hit_rate:
        lines.append("  predicted hit rate: " + _rates(placement.predicted_hit_rate, disk if on_disk else host))
    else:
        lines.append("  predicted hit rate: none (no profile)")
    if cal is not None:
        lines += _predicted(spec, placement, profile, cal, ranked, result)
    if replay:
        sim = P.simulate(load_routes(profile_path), placement)
        result["simulated"] = {k: v for k, v in sim.items() if k != "per_layer"}
        lines.append("  replayed hit rate: " + _rates(sim["hit_rate"], P.host_tier_name(placement.tiers))
                     + (" (host memory and disk not replayed apart)" if on_disk else ""))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(placement.to_json(indent=1))
        lines.append(f"  wrote {out}")
    emit(result, as_json, "\n".join(lines))


def _host_split(spec, machine, host_memory, context: int, batch: int, backend: str | None):
    """The engine's host memory plan for this model (hostmem.plan_host, weights first): the host tier of
    ``machine`` (a backend's or a hardware profile's tiers) or this process's limit, the stated runtime reserve
    (RESERVE: the engine measures its own), the KV floor of ``batch`` sequences of ``context`` tokens. Dense weights
    and KV count on the host only for ``--backend cpu``; without a backend the accelerators hold them."""
    from moe_offload import hostmem
    from moe_offload.control.placement import host_tier_name
    from moe_offload.control.units import parse_size

    limit = None
    if machine:
        host = next((t for t in machine if t.name == host_tier_name(machine)), None)
        if host is not None and host.capacity_bytes:
            limit = hostmem.HostMemory(host.capacity_bytes, f"the {host.name} tier")
    on_cpu = backend == "cpu"  # else the accelerators hold the dense weights and the KV cache
    return hostmem.plan_host(spec.routed_expert_bytes, spec.non_expert_bytes,
                             host_memory=None if host_memory is None else parse_size(host_memory, "--host-memory"),
                             kv_default=hostmem.DEFAULT_KV_HOST if on_cpu else 0,
                             kv_floor=spec.kv_cache_bytes(context, batch), limit=limit, dense_on_host=on_cpu)


def _disk_need(spec) -> dict:
    """What the disk tier needs on disk (a prediction from the spec): nothing beyond the checkpoint when its files
    are read in place, else an expert store copy, set against the free space where it would be written."""
    from moe_offload import hostmem

    need = spec.disk_copy_bytes
    if need == 0:
        return {"in_place": True, "store_bytes": 0, "reason": "reads the checkpoint's expert tensors in place (no copy)"}
    free, where = hostmem.disk_free()
    short = need > free
    return {"in_place": False, "store_bytes": need, "free_bytes": free, "path": where, "short": short,
            "reason": f"an expert store copy of {need / 2**30:.2f} GiB (experts re-laid out) at {where}, "
                      f"{free / 2**30:.2f} GiB free" + (": too little, the engine will refuse it" if short else "")}


def _rates(rates, host: str | None) -> str:
    """Share of routed pairs per tier; the bottom tier's share is where the misses go, so it is not shown as a hit
    rate (the host's, or the disk's when there is one)."""
    text = ", ".join(f"{k} {v:.1%}" for k, v in rates.items() if k != host)
    return text + (f" (misses, on {host}: {rates[host]:.1%})" if host in rates else "")


def _predicted(spec, placement, profile, cal, ranked, result) -> list[str]:
    """Cost-model lines (labelled predicted): the ranking for auto, else each miss policy on this placement."""
    from moe_offload.commands.options import prediction_rows
    from moe_offload.control.costmodel import predict
    from moe_offload.control.vocab import MISS_POLICIES

    preds = [p for _, _, p in ranked] or [predict(spec, placement, m, cal, profile=profile) for m in MISS_POLICIES]
    result["calibration"] = cal.label()
    result["predictions"] = [p.to_dict() for p in preds]
    lines = [f"  PREDICTED decode ms/token (calibration {cal.label()}):"] + ["  " + r for r in prediction_rows(preds)]
    if ranked:
        best = ranked[0][2]
        result["chosen"] = {"policy": best.policy, "placement_policy": best.placement_policy, "ms_per_token": best.ms_per_token}
        lines.append(f"  auto chose {best.policy} misses on placement {best.placement_policy} "
                     f"(predicted {best.ms_per_token:.3f} ms/token): run the engine with --policy {best.policy}")
    return lines


commands = [spec_cmd, budget_cmd, plan_cmd]
