"""MTP drafts as a user runs them: fresh `moe-offload generate` processes on a checkpoint that ships an MTP layer.

    python bench/train_mtp.py --out /tmp/demo-mtp      # the trained demo with an MTP layer trained for it
    python bench/bench_mtp.py --model /tmp/demo-mtp    # the table of docs/benchmarks/speculative.md's MTP section

Prompts: the first lines of held-out standard-library files (bench/train_demo.py's split: never trained on), decoded
greedily for --tokens tokens (--ignore-eos); per prompt and round, a fresh process each for: plain, MTP, prompt
lookup at k = 3 (the method the demo's docs measure), the order rotated per round. Every run's tokens must equal the
plain run's (checked). Reports the median decode ms/token per run kind, the acceptance rate and mean acceptance
length (the engine's own stats), the machine's ISA and read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RUNS = {"plain": None, "mtp": '{"method": "mtp"}', "ngram k=3": '{"method": "ngram", "num_speculative_tokens": 3}'}


def prompts(n: int) -> list[str]:
    from train_demo import corpus

    _, held = corpus()
    out = []
    for f in held:
        lines = [ln for ln in f.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()][:12]
        text = "\n".join(lines) + "\n"
        if 200 < len(text) < 1200:
            out.append(text)
        if len(out) == n:
            break
    return out


def generate(model: str, prompt: str, tokens: int, spec: str | None) -> dict:
    exe = Path(sys.executable).with_name("moe-offload")
    cmd = [str(exe), "generate", "--model", model, "--prompt", prompt, "--max-tokens", str(tokens), "--ignore-eos",
           "--json"] + (["--speculative-config", spec] if spec else [])
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)

    import time

    from bench_engine import read_bandwidth

    from moe_offload.engines.offload.kernels import jit

    jit.load()
    bw = [read_bandwidth() / 1e9]
    ps = prompts(a.prompts)
    ms = {k: [] for k in RUNS}
    spec = {k: {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0} for k in RUNS if RUNS[k]}
    names = list(RUNS)
    for r in range(a.rounds):
        for i, p in enumerate(ps):
            order = names[(r + i) % len(names):] + names[: (r + i) % len(names)]
            ids = {}
            for k in order:
                d = generate(a.model, p, a.tokens, RUNS[k])
                ids[k] = d["token_ids"]
                ms[k].append(d["stats"]["decode_ms_per_token"])
                s = d["stats"].get("speculative")
                for f in spec.get(k, ()):
                    spec[k][f] += s[f]
            assert all(v == ids["plain"] for v in ids.values()), f"round {r}, prompt {i}: output differs from plain"
    bw.append(read_bandwidth() / 1e9)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{stamp}, kernels {jit.info().get('variant')}, read bandwidth {min(bw):.1f}-{max(bw):.1f} GB/s, "
          f"{len(ps)} prompts x {a.rounds} rounds, {a.tokens} tokens, fresh processes\n")
    print("| run | decode ms/token (median) | / plain | acceptance rate | mean acceptance length |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(ms["plain"])
    for k in names:
        m = statistics.median(ms[k])
        s = spec.get(k)
        rate = f"{s['accepted_tokens'] / s['draft_tokens']:.2f}" if s and s["draft_tokens"] else ""
        length = f"{1 + s['accepted_tokens'] / s['drafts']:.2f}" if s and s["drafts"] else ""
        print(f"| {k} | {m:.3f} | {m / base:.2f}x | {rate} | {length} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
