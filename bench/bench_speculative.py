"""Speculative decoding on the trained demo model (issue 34): acceptance, speedup, and what a verify step costs per tier.

    python bench/bench_speculative.py            # the tables of docs/benchmarks/speculative.md (~10 min on 2 cores)
    python bench/bench_speculative.py --quick    # proves it works (~2 min)

Prompts: windows of the held-out standard-library files (never trained on), decoded greedily (the output is the plain
run's, token for token: checked here on every run). Tiers, as the executor serves experts: resident (every expert in
accelerator slots), host (none resident: every expert computed on the host path), lru 25 % (a quarter of each layer's
experts in slots, misses copied in), disk (a host budget of a quarter of the experts: the rest read from the expert
store file as layers ask for them). Per tier:
  1. the cost of a verify step of k drafts against a one-token step (an oracle draft of the plain run's own tokens,
     so every draft is accepted and each step carries exactly k + 1 tokens), and the experts the step reads per token
     (the union of the rows' routed experts per layer, captured by the executor; the disk tier: store reads);
  2. prompt lookup (ngram) at several k: ms per token, mean acceptance length, speedup against the plain run.
Then 8 streams at once, and `moe-offload generate` in fresh processes (start-up included), as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TIERS = ("resident", "host", "lru 25 %", "disk")


class Replay:
    """Drafts the plain run's own continuation (every draft accepted): a verify step of exactly k + 1 tokens."""

    def __init__(self, runs: dict):
        self.runs = runs

    def propose(self, sid, tokens, k):
        for prompt, out in self.runs.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return list(out[done : done + k])
        return []

    def release(self, sid):
        pass


def tier_options(tier: str, expert_bytes: int) -> dict:
    return {"resident": {"fraction": 1.0}, "host": {"fraction": 0.0, "policy": "static"},
            "lru 25 %": {"fraction": 0.25, "policy": "lru"},
            "disk": {"host_memory": expert_bytes // 4}}[tier]


def run(engine, prompts, tokens: int, *, capture: bool = False, passes: int = 2) -> dict:
    """Each prompt alone, greedy: tokens, decode ms per token (the best of ``passes`` timed passes, without route
    capture), speculative counters, and (``capture``: one more pass with the executor capturing routes) experts read
    per token."""
    from moe_offload.engines.params import SamplingParams

    ex = engine.executor

    def one_pass(cap: bool) -> dict:
        outs, decode_ms, decoded, drafts, accepted, drafted, reads, disk_reads = [], 0.0, 0, 0, 0, 0, 0, 0.0
        for ids in prompts:
            if cap:
                ex.capture(True)
            g = engine.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
            outs.append(list(g))
            if cap:
                recs = ex.captured()
                ex.capture(False)
                # every forward after the prefill: the distinct experts each layer's rows routed to
                reads += sum(len({e for row in rec[lay] for e in row}) for rec in recs[1:] for lay in rec)
            s = g.stats
            decode_ms += s.decode_ms
            decoded += s.completion_tokens - 1
            drafts, drafted = drafts + s.spec_drafts, drafted + s.spec_draft_tokens
            accepted += s.spec_accepted_tokens
            disk_reads += s.disk.get("demand_reads", 0.0)
        return {"outs": outs, "ms_per_token": decode_ms / decoded, "drafts": drafts, "accepted": accepted,
                "drafted": drafted, "mal": 1 + accepted / drafts if drafts else 1.0,
                "reads_per_token": reads / decoded, "disk_reads_per_token": disk_reads / decoded}

    timed = min((one_pass(False) for _ in range(passes)), key=lambda r: r["ms_per_token"])
    if capture:
        counted = one_pass(True)
        assert counted["outs"] == timed["outs"]
        timed |= {"reads_per_token": counted["reads_per_token"], "disk_reads_per_token": counted["disk_reads_per_token"]}
    return timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args(argv)

    import torch
    import train_demo
    from bench_routing import windows
    from transformers import AutoTokenizer

    from moe_offload import demo
    from moe_offload.backends import get_backend
    from moe_offload.engines.offload.loading.inspection import inspect_checkpoint
    from moe_offload.engines.params import SamplingParams

    torch.set_num_threads(2)
    store = tempfile.mkdtemp(prefix="spec-bench-store-")
    os.environ["MOE_OFFLOAD_STORE_DIR"] = store  # the disk tier's expert store: a scratch directory
    path = demo.trained_dir()
    tok = AutoTokenizer.from_pretrained(path)
    _, held = train_demo.corpus()
    n_prompts, tokens = (3, 48) if a.quick else (8, a.tokens)
    prompts = windows(held, tok, n_prompts, 64, 3)
    expert_bytes = sum(i.expert_bytes * i.num_experts for i in inspect_checkpoint(Path(path), None)[1])
    backend = get_backend("cpu")
    ks = (1, 2, 3, 4, 6) if not a.quick else (2, 4)
    from bench_engine import read_bandwidth

    from moe_offload.engines.offload.kernels import jit

    jit.load()
    print(f"# Speculative decoding on the trained demo model\n\n{n_prompts} held-out windows of 64 tokens, {tokens} "
          f"tokens decoded greedily each; bf16, 2 threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{read_bandwidth() / 1e9:.1f} GB/s memory read bandwidth, kernels {jit.info().get('variant')}\n")

    def build(tier, spec=None, **kw):
        return backend.build_engine(str(path), **tier_options(tier, expert_bytes), speculative=spec, **kw)

    verify_rows, ngram_rows = [], []
    for tier in TIERS:
        plain = build(tier)
        run(plain, prompts[:1], tokens, passes=1)  # warm
        base = run(plain, prompts, tokens, capture=True)
        plain.close()
        runs = {tuple(p): o for p, o in zip(prompts, base["outs"])}
        row = {"tier": tier, "plain": base}
        for k in ks:
            e = build(tier, {"num_speculative_tokens": k})
            e.proposer = Replay(runs)
            run(e, prompts[:1], tokens, passes=1)  # warm
            r = run(e, prompts, tokens, capture=True)
            e.close()
            assert r["outs"] == base["outs"], f"{tier}, k={k}: speculative output differs from the plain run"
            row[k] = r
        verify_rows.append(row)
        nrow = {"tier": tier, "plain": base}
        for k in ks:
            e = build(tier, {"method": "ngram", "num_speculative_tokens": k})
            run(e, prompts[:1], tokens, passes=1)  # warm
            r = run(e, prompts, tokens)
            e.close()
            assert r["outs"] == base["outs"], f"{tier}, ngram k={k}: output differs from the plain run"
            nrow[k] = r
        ngram_rows.append(nrow)
        print(f"  {tier}: done", file=sys.stderr, flush=True)

    print("## What a verify step costs (every draft accepted: k + 1 tokens a step)\n")
    print("ms per step of k + 1 tokens over ms per one-token step (the plain run), and experts read per token "
          "(distinct routed experts per layer per step, summed, over tokens; disk: store reads per token)\n")
    print("| tier | plain ms/token | " + " | ".join(f"k={k}: step cost, ms/token, reads/token" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for row in verify_rows:
        p = row["plain"]
        cells = []
        for k in ks:
            r = row[k]
            step = r["ms_per_token"] * (k + 1)
            reads = r["disk_reads_per_token"] if row["tier"] == "disk" else r["reads_per_token"]
            cells.append(f"{step / p['ms_per_token']:.2f}x, {r['ms_per_token']:.2f}, {reads:.1f}")
        reads0 = p["disk_reads_per_token"] if row["tier"] == "disk" else p["reads_per_token"]
        print(f"| {row['tier']} | {p['ms_per_token']:.2f} ({reads0:.1f} reads) | " + " | ".join(cells) + " |")

    print("\n## Prompt lookup (ngram, prompt_lookup_max 4, min 2)\n")
    print("| tier | plain ms/token | " + " | ".join(f"k={k}: ms/token, accept len, speedup" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for row in ngram_rows:
        p = row["plain"]
        cells = [f"{row[k]['ms_per_token']:.2f}, {row[k]['mal']:.2f}, {p['ms_per_token'] / row[k]['ms_per_token']:.2f}x"
                 for k in ks]
        print(f"| {row['tier']} | {p['ms_per_token']:.2f} | " + " | ".join(cells) + " |")

    # several streams at once (resident): tokens per second of the whole batch, drafting at every batch size
    def batch(n, spec):
        e = build("resident", spec, max_num_seqs=n)
        gens = [e.start(ids, SamplingParams(max_tokens=tokens, ignore_eos=True)) for ids in (prompts * 2)[:n]]
        t0 = time.perf_counter()
        while e.step():
            pass
        wall = time.perf_counter() - t0
        outs = [g.drain() for g in gens]
        st = e.stats()
        e.close()
        return outs, sum(len(o) for o in outs) / wall, st.get("speculative")

    print("\n## Several streams at once (resident, prompt lookup, drafting at every batch size)\n")
    print("| streams | plain tokens/s | k=2: tokens/s, speedup, accept len | k=3: tokens/s, speedup, accept len |")
    print("|---|---|---|---|")
    for n in (2, 4, 8):
        batch(n, None)  # warm
        o0, tps0, _ = batch(n, None)
        cells = []
        for k in (2, 3):
            o, tps, sp = batch(n, {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": None})
            assert o == o0, "batched speculative output differs from the plain batch"
            cells.append(f"{tps:.0f}, {tps / tps0:.2f}x, {sp['mean_acceptance_length']:.2f}")
        print(f"| {n} | {tps0:.0f} | " + " | ".join(cells) + " |")
    print()

    # as a user runs it: a fresh process per run
    exe = Path(sys.executable).with_name("moe-offload")
    prompt = "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n        "
    print("## `moe-offload generate` in a fresh process (start-up included), 128 tokens\n")
    print("| run | wall s | decode ms/token | accept len |\n|---|---|---|---|")
    ref = None
    for name, extra in (("plain", []), ("ngram k=3", ["--speculative-config", '{"num_speculative_tokens": 3}'])):
        t0 = time.perf_counter()
        out = subprocess.run([str(exe), "generate", "--prompt", prompt, "--max-tokens", "128", "--ignore-eos", "--json",
                              *extra], capture_output=True, text=True, check=True).stdout
        wall = time.perf_counter() - t0
        d = json.loads(out)
        ref = ref or d["token_ids"]
        assert d["token_ids"] == ref
        sp = d["stats"].get("speculative", {})
        print(f"| {name} | {wall:.2f} | {d['stats']['decode_ms_per_token']:.2f} | "
              f"{sp.get('mean_acceptance_length', 1.0):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
