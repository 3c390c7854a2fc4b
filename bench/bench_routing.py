"""Placement on real routing (issue 34): hit rate against resident fraction on the trained demo model.

    python bench/bench_routing.py                 # the tables of docs/benchmarks/routing.md (~10 min on 2 cores)
    python bench/bench_routing.py --quick         # proves it works (~1 min)

The trained demo model (src/moe_offload/data/trained-demo) routes as it learned to. Profile: its routes over
windows of its training split (the standard-library files it was trained on), captured by the engine as
`moe-offload profile` does. Evaluation: windows of the held-out files, each decoded greedily by the engine for
--decode tokens; the hit rate is the engine's own count (routed token-expert pairs served by resident experts,
prompt and decode tokens) over the run. For each resident fraction: `plan --profile` (top: the hottest experts per
layer; mix: half pinned by the profile, half LRU), LRU alone, and a random placement; beside each measured hit rate
the planner's prediction from the training-split profile (`placement.hit_rates`, what `plan` and `predict` print).
Per layer at 44 % resident (the NPU design's share). Request classes (the affinity gateway's): prompts from two
groups of standard-library packages, each placed by its own class's profile against the mixed profile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CLASSES = {"text": ("email", "html", "xml", "json", "http", "urllib", "string", "textwrap", "csv", "gettext"),
           "system": ("asyncio", "concurrent", "multiprocessing", "os", "subprocess", "threading", "socket", "shutil",
                      "pathlib", "signal", "selectors")}
NPU_DESIGN = "82-89 % of routed tokens on the accelerator with 44 % of experts resident (profile-guided, 100B MoE)"


def windows(files, tok, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token windows of ``length`` from ``files`` (one stream, evenly spaced, offset by ``seed``)."""
    import train_demo

    data = train_demo.encode(tok, train_demo.read(files))
    step = max(1, (len(data) - length - 1) // n)
    return [data[i * step + seed % step: i * step + seed % step + length].tolist() for i in range(n)]


def klass(path: Path) -> str | None:
    import sysconfig

    top = path.relative_to(sysconfig.get_paths()["stdlib"]).parts[0].removesuffix(".py")
    return next((c for c, pkgs in CLASSES.items() if top in pkgs), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded per held-out prompt")
    ap.add_argument("--model", type=Path, help="default: the trained demo model shipped with the package")
    a = ap.parse_args(argv)

    import numpy as np
    import torch
    import train_demo
    from transformers import AutoTokenizer

    from moe_offload import demo
    from moe_offload.backends import get_backend
    from moe_offload.commands.engine import capture_routes
    from moe_offload.control import placement as pl
    from moe_offload.control.profile import Profile, Routes
    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.params import SamplingParams

    torch.set_num_threads(2)
    path = a.model or demo.trained_dir()
    tok = AutoTokenizer.from_pretrained(path)
    spec = ModelSpec.from_hf_config(str(path))
    backend = get_backend("cpu")
    tiers = backend.tiers()
    train_files, held_files = train_demo.corpus()
    n_prof, n_eval, length = (12, 6, 64) if a.quick else (96, 32, 96)
    prof_prompts = windows(train_files, tok, n_prof, length, 1)
    eval_prompts = windows(held_files, tok, n_eval, length, 2)
    fractions = (0.25, 0.44) if a.quick else (0.125, 0.25, 0.44, 0.5, 0.75)
    t0 = time.perf_counter()

    def build(placement=None, policy="static", fraction=None):
        return backend.build_engine(str(path), placement, policy=policy, fraction=fraction, dtype="float32")

    def routes_of(engine, prompts, tokens):
        layers, per_prompt = capture_routes(engine, prompts, tokens)
        ids = [row for rows in per_prompt for row in rows]
        return Routes(model=str(path), num_experts=spec.num_experts, layers=tuple(layers), ids=ids)

    base = build(None, "static", 1.0)
    profile = Profile.from_routes(routes_of(base, prof_prompts, 1), source="training split")
    eval_routes = routes_of(base, eval_prompts, a.decode)
    base.close()
    counts = profile.counts / profile.counts.sum(1, keepdims=True)
    top = np.sort(counts, axis=1)[:, ::-1]
    print(f"# Placement on real routing: the trained demo model ({spec.num_moe_layers} MoE layers x "
          f"{spec.num_experts} experts, top-{spec.top_k})\n")
    print(f"profile: {len(prof_prompts)} windows of {length} tokens from the training split "
          f"({profile.counts.sum() // spec.top_k} tokens); evaluation: {len(eval_prompts)} held-out windows, "
          f"{a.decode} tokens decoded each\n")
    print("routing skew (training-split profile): share of routed pairs taken by the hottest 25 % / 44 % of each "
          "layer's experts: " + ", ".join(
              f"layer {lay}: {top[i, :spec.num_experts // 4].sum():.0%} / {top[i, :round(0.44 * spec.num_experts)].sum():.0%}"
              for i, lay in enumerate(profile.layers)) + "\n")

    def measured(placement, policy, fraction=None):
        engine = build(placement, policy, fraction)
        engine.executor.stats.reset()
        for ids in eval_prompts:
            list(engine.generate(ids, SamplingParams(max_tokens=a.decode, ignore_eos=True)))
        snap = engine.executor.stats.snapshot()
        engine.close()
        return snap["hits"] / max(1, snap["hits"] + snap["misses"])

    rows = []
    for f in fractions:
        row = {"fraction": f, "slots": pl.fraction_slots(spec, f)}
        for name, policy in (("top", "top"), ("mix", f"mix:{pl.fraction_slots(spec, f) // 2}"), ("random", "random")):
            p = pl.from_fraction(spec, tiers, f, policy=policy, profile=profile)
            acc = pl.accelerator_tiers(p.tiers)[0].name
            row[name] = (measured(p, "static" if name != "mix" else "lru"), pl.hit_rates(profile, p).get(acc, 0.0))
        p = pl.from_fraction(spec, tiers, f, policy="lru", profile=profile)
        acc = pl.accelerator_tiers(p.tiers)[0].name
        row["lru"] = (measured(None, "lru", f), pl.hit_rates(profile, p).get(acc, 0.0))
        rows.append(row)
        print(f"  fraction {f}: done, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    print("| resident fraction (slots/layer) | plan --profile top: measured (predicted) | mix | LRU | random |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k][0]:.1%} ({r[k][1]:.1%})" for k in ("top", "mix", "lru", "random")]
        print(f"| {r['fraction']:.0%} ({r['slots']}) | " + " | ".join(cells) + " |")
    errs = [abs(r[k][0] - r[k][1]) / r[k][0] for r in rows for k in ("top", "mix", "lru") if r[k][0] > 0]
    print(f"\nprediction error (|predicted - measured| / measured) over top, mix and LRU: median "
          f"{statistics.median(errs):.1%}, max {max(errs):.1%}. The NPU design: {NPU_DESIGN}.\n")

    p44 = pl.from_fraction(spec, tiers, 0.44, policy="top", profile=profile)
    sim = pl.simulate(eval_routes, p44)
    print("per layer at 44 % resident (plan --profile top, replayed held-out routes): " + ", ".join(
        f"layer {x['layer']}: {x['hit_rate']:.1%}" for x in sim["per_layer"]) + "\n")

    # the affinity gateway's request classes: each class placed by its own profile against the mixed one
    # within each class, every 4th of its files is evaluated and the others profile it (disjoint files)
    files = {c: [f for f in train_files + held_files if klass(f) == c] for c in CLASSES}
    by_class = {c: [f for i, f in enumerate(fs) if i % 4 != 3] for c, fs in files.items()}
    held_class = {c: [f for i, f in enumerate(fs) if i % 4 == 3] for c, fs in files.items()}
    base = build(None, "static", 1.0)
    print("| class | prompts | hit rate, mixed profile | hit rate, its own class's profile | gain |")
    print("|---|---|---|---|---|")
    hr = {}
    for c in CLASSES:
        own = Profile.from_routes(routes_of(base, windows(by_class[c], tok, n_prof // 2, length, 3), 1))
        ev = routes_of(base, windows(held_class[c], tok, max(4, n_eval // 2), length, 5), a.decode)
        for name, prof in (("mixed", profile), ("own", own)):
            p = pl.from_fraction(spec, tiers, 0.25, policy="top", profile=prof)
            acc = pl.accelerator_tiers(p.tiers)[0].name
            hr[name] = pl.simulate(ev, p)["hit_rate"][acc]
        print(f"| {c} | {ev.num_tokens} tokens | {hr['mixed']:.1%} | {hr['own']:.1%} | {hr['own'] - hr['mixed']:+.1%} |")
    base.close()
    print(f"\n(classes at 25 % resident; a class's own profile and its evaluation come from disjoint files of its "
          f"packages: {', '.join(f'{c}: {len(by_class[c])} + {len(held_class[c])}' for c in CLASSES)}). "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
