"""Expert parallel on this machine (issue 33): `--tensor-parallel 2` (two ranks, one thread each, gloo) against one
process with two threads, decode ms/token on the benchmark model.

    python bench/bench_parallel.py --model-dir /tmp/benchmodel             # 3 interleaved rounds, 64 tokens
    python bench/bench_parallel.py --model-dir /tmp/benchmodel --quick     # 1 round, 16 tokens
    python bench/bench_parallel.py --model-dir /tmp/bmtok --as-user        # fresh CLI processes (needs a tokenizer)

Each configuration runs in a fresh Python process (start-up, rank launch and the first tokens included in its wall
time; decode ms/token as the engine measures it, the mean over the decode steps), all experts resident, bf16, greedy
from a 32-token prompt. The benchmark model is bench_engine.py's (built there when --model-dir is empty).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN = r"""
import json, sys, time, torch
t0 = time.perf_counter()
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
opts = json.loads(sys.argv[2])
threads = opts.pop("threads")
torch.set_num_threads(threads)
if opts.get("tensor_parallel"):
    from moe_offload.engines.offload.ranks import parallel
    parallel.THREADS = threads
e = build_offload_engine(sys.argv[1], dtype="bfloat16", fraction=1.0, **opts)
t1 = time.perf_counter()
def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import os
rss = [rss(p) for p in [os.getpid()] + [p.pid for p in (e.ranks.procs if e.ranks is not None else [])]]
g = e.generate(list(range(100, 132)), SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True))
toks = list(g)
t2 = time.perf_counter()
s = g.stats
print(json.dumps({"load_s": t1 - t0, "generate_s": t2 - t1, "decode_ms": s.decode_ms_per_token,
                  "prefill_ms": s.prefill_ms, "tokens": toks, "rss": rss}))
e.close()
"""

LATENCY = r"""
import sys, time, torch, torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
out = {}
for name, x in (("all_reduce fp32 [8, 1024] (a decode layer's rows)", torch.randn(8, 1024)),
                ("all_reduce int64 [4] (a step's counters)", torch.zeros(4, dtype=torch.int64))):
    for _ in range(50):
        dist.all_reduce(x)
    t = time.perf_counter()
    for _ in range(500):
        dist.all_reduce(x)
    out[name] = (time.perf_counter() - t) / 500 * 1e6
from moe_offload.engines.offload.ranks.parallel import over_ranks
x = torch.randn(8, 1024).to(torch.bfloat16)
for _ in range(50):
    over_ranks(x)
t = time.perf_counter()
for _ in range(500):
    over_ranks(x)
out["send/recv exchange bf16 [8, 1024] (over_ranks: what a decode layer's rows take now)"] = (time.perf_counter() - t) / 500 * 1e6
t = time.perf_counter()
for _ in range(200):
    dist.broadcast_object_list([("step", [])] if rank == 0 else [None], src=0)
out["broadcast_object_list (a step command before 2026-12-05)"] = (time.perf_counter() - t) / 200 * 1e6
h = torch.zeros(64, dtype=torch.int64)
dist.barrier()
t = time.perf_counter()
for _ in range(200):
    dist.send(h, 1, tag=7) if rank == 0 else dist.recv(h, 0, tag=7)
out["send/recv int64 [64] (a step command now: parallel.Leader.send)"] = (time.perf_counter() - t) / 200 * 1e6
if rank == 0:
    print(out)
dist.destroy_process_group()
"""


def gloo_latency() -> dict:
    """Mean microseconds of the collectives a decode step makes, two ranks on this machine, one thread each."""
    import ast
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", LATENCY, str(r), str(port)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate()[0] for p in procs]
    return ast.literal_eval(outs[0].strip().splitlines()[-1])


PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
CONFIGS = (("one process, 2 threads", {"threads": 2}),
           ("one process, 1 thread", {"threads": 1}),
           ("--tensor-parallel 2, 1 thread per rank (the default without PASSIVE)", {"threads": 1, "tensor_parallel": 2}),
           ("--tensor-parallel 2, 2 threads per rank, OMP_WAIT_POLICY=PASSIVE (the CLI's default)",
            {"threads": 2, "tensor_parallel": 2, "env": PASSIVE}),
           ("--tensor-parallel 2, 2 threads per rank, spinning waits (oversubscribed)", {"threads": 2, "tensor_parallel": 2}))


def run(model: Path, opts: dict, tokens: int) -> dict:
    import os

    env = {**os.environ, **opts.pop("env", {})}
    out = subprocess.run([sys.executable, "-c", RUN, str(model), json.dumps(opts), str(tokens)], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


AS_USER = (("one process", 1, {}), ("--tensor-parallel 2 (the CLI's default: PASSIVE, every core per rank)", 2, {}),
           ("--tensor-parallel 2, OMP_WAIT_POLICY=ACTIVE (1 thread per rank)", 2, {"OMP_WAIT_POLICY": "ACTIVE"}))


def as_user(model: Path, rounds: int) -> int:
    """Fresh `moe-offload generate` processes, as a user runs them (the model directory needs a tokenizer)."""
    import os
    import shutil

    from bench_engine import read_bandwidth

    cli = shutil.which("moe-offload") or str(Path(sys.executable).with_name("moe-offload"))
    bw = read_bandwidth()
    results = {name: [] for name, _, _ in AS_USER}
    for _ in range(rounds):
        for name, tp, env in AS_USER:
            t = time.perf_counter()
            out = subprocess.run([cli, "generate", "--model", str(model), "--prompt", "The quick brown fox jumps over "
                                  "the lazy dog and then", "--max-tokens", "64", "--ignore-eos", "--json",
                                  "--tensor-parallel", str(tp)], capture_output=True, text=True, check=True,
                                 env={**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}, **env})
            d = json.loads(out.stdout)
            results[name].append((d["stats"]["decode_ms_per_token"], time.perf_counter() - t, d["token_ids"]))
    first = results[AS_USER[0][0]][0][2]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {bw / 1e9:.1f} GB/s memory read bandwidth, "
          f"{rounds} interleaved rounds of fresh `moe-offload "
          f"generate --max-tokens 64 --ignore-eos --json` processes; identical tokens: "
          f"{all(r[2] == first for rs in results.values() for r in rs)}\n")
    print("| configuration | decode ms/token (each round) | median | vs one process | process wall s (median) |")
    print("|---|---|---|---|---|")
    base = statistics.median(r[0] for r in results[AS_USER[0][0]])
    for name, rs in results.items():
        d = statistics.median(r[0] for r in rs)
        print(f"| {name} | {', '.join(f'{r[0]:.1f}' for r in rs)} | {d:.1f} | {d / base:.2f}x | "
              f"{statistics.median(r[1] for r in rs):.1f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--as-user", action="store_true", help="fresh `moe-offload generate` processes instead")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    if a.as_user:
        return as_user(a.model_dir, 1 if a.quick else 3)
    if not (a.model_dir / "config.json").exists():
        import bench_engine

        bench_engine.build_model(a.model_dir)
    from bench_engine import read_bandwidth

    rounds, tokens = (1, 16) if a.quick else (3, 64)
    bw = read_bandwidth()
    results = {name: [] for name, _ in CONFIGS}
    for _ in range(rounds):  # interleaved: both see the same machine
        for name, opts in CONFIGS:
            results[name].append(run(a.model_dir, dict(opts), tokens))
    ref = results[CONFIGS[0][0]]
    same = all(r["tokens"] == ref[0]["tokens"] for rs in results.values() for r in rs)
    base = statistics.median(r["decode_ms"] for r in ref)
    print(f"# Expert parallel on this machine\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{bw / 1e9:.1f} GB/s memory read bandwidth, {rounds} interleaved rounds, {tokens} tokens after a 32-token "
          f"prompt, bf16, all experts resident; greedy tokens identical across configurations: {same}\n")
    print("| configuration | decode ms/token (median) | vs one process | prefill ms | load s | generate s | "
          "resident GiB per process |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        d = statistics.median(r["decode_ms"] for r in rs)
        print(f"| {name} | {d:.1f} | {d / base:.2f}x | {statistics.median(r['prefill_ms'] for r in rs):.0f} | "
              f"{statistics.median(r['load_s'] for r in rs):.1f} | {statistics.median(r['generate_s'] for r in rs):.2f} | "
              + " + ".join(f"{b / 2**30:.2f}" for b in rs[-1]["rss"]) + " |")
    print("\n| gloo collective, 2 ranks on this machine | mean us |\n|---|---|")
    for name, us in gloo_latency().items():
        print(f"| {name} | {us:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
