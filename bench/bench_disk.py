"""A model bigger than the memory a process may use (issue 20): this engine's disk tier against llama.cpp's mmap.

    python bench/bench_disk.py --model-dir /tmp/benchmodel --limit-gib 1.8            # bf16, prefetch A/B, 2 rounds
    python bench/bench_disk.py --model-dir /tmp/benchmodel --limit-gib 1.8 --int8-limit-gib 1.0

    per round, interleaved, each run in a fresh process with the page cache dropped first:
      llama-bench bf16 GGUF (mmap)      in a cgroup v1 memory group limited to --limit-gib
      moe-offload generate (bf16)       in the same group: the engine reads the limit itself (cgroup -> host tier)
      moe-offload generate --no-prefetch                                        (prefetch A/B)
      [int8: moe-offload --expert-dtype int8 --dense-dtype int8 vs llama-bench q8_0 under --int8-limit-gib]
    then, without a limit: moe-offload (all in memory) and llama-bench, for output identity, peak RSS and start-up

Every number is measured in this run: decode ms/token (ours: the engine's own per-step times; llama.cpp: llama-bench
-n N -r 1 --no-warmup), wall time, time from process start to the first token (wall - decode of the other tokens),
the process's peak RSS (/usr/bin/time) and the cgroup's peak usage (page cache included), the disk tier's reads.
The machine's memory bandwidth and the disk's read bandwidth (O_DIRECT, 8 threads) are measured too. Needs root
(cgroup v1 at /sys/fs/cgroup/memory, /proc/sys/vm/drop_caches). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = HERE.parent
CGROUP = Path("/sys/fs/cgroup/memory")
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the forest until night falls"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


COLD: list[Path] = []  # the model files each run starts without in the page cache (the software stays warm)


def drop_caches() -> None:
    """Evict the model's files (checkpoint, GGUFs, expert stores) from the page cache: every run starts the model
    cold, as a first start after a reboot or with other work having used the memory; the interpreter, torch and
    llama.cpp's binary stay cached (a global drop would charge our start-up with re-reading torch's libraries)."""
    subprocess.run(["sync"], check=True)
    for f in COLD:
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Group:
    """A cgroup v1 memory group with a limit; ``cmd(argv)`` runs argv inside it."""

    def __init__(self, name: str, limit: int | None):
        self.path = CGROUP / name
        self.limit = limit
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit) if limit else "-1")

    def reset(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def cmd(self, argv: list[str]) -> list[str]:
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *map(str, argv)]


def timed(group: Group, argv: list[str], env: dict | None = None) -> dict:
    """Run ``argv`` in ``group`` from a cold page cache: {"rc", "out", "err", "wall_s", "maxrss", "cgroup_peak"}."""
    drop_caches()
    group.reset()
    t0 = time.perf_counter()
    r = subprocess.run(group.cmd(["/usr/bin/time", "-f", "MAXRSS_KB %M", *argv]), capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    rss = [int(line.split()[1]) * 1024 for line in r.stderr.splitlines() if line.startswith("MAXRSS_KB")]
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr, "wall_s": wall, "maxrss": rss[-1] if rss else 0,
            "cgroup_peak": group.max_usage()}


def ours(group: Group, model: Path, tokens: int, *extra: str) -> dict:
    r = timed(group, [ROOT / ".venv/bin/moe-offload", "generate", "--model", model, "--prompt", PROMPT, "--max-tokens",
                      tokens, "--ignore-eos", "--json", "--policy", "static", *extra])
    if r["rc"] != 0:
        return {**r, "ok": False, "why": _why(r["err"])}
    d = json.loads(r["out"])
    s = d["stats"]
    ms = s["decode_ms_per_token"]
    # start to first token: the wall time less the engine's own measured decode steps after the first token
    return {**r, "ok": True, "ms_per_token": ms, "tokens": d["token_ids"], "disk": s.get("disk", {}),
            "first_token_s": r["wall_s"] - s["decode_ms"] / 1000, "prefill_ms": s["prefill_ms"],
            "prompt_tokens": len(d["prompt_ids"])}


def llama(group: Group, gguf: Path, tokens: int, tools, prompt: int) -> dict:
    """llama-bench decode (-p 0 -n tokens), then, in a second cold process, the start to the first token: load and a
    ``prompt``-token prompt (-p prompt -n 0), the same prompt length the engine's run prefills."""
    r = timed(group, [tools.bench, "-m", gguf, "-p", "0", "-n", tokens, "-t", "2", "-r", "1", "--no-warmup",
                      "-o", "json"])
    if r["rc"] != 0:
        return {**r, "ok": False, "why": _why(r["err"])}
    rec = [x for x in json.loads(r["out"]) if x.get("n_gen", 0) > 0][0]
    first = timed(group, [tools.bench, "-m", gguf, "-p", prompt, "-n", "0", "-t", "2", "-r", "1", "--no-warmup",
                          "-o", "json"])
    return {**r, "ok": True, "ms_per_token": 1000 / rec["avg_ts"], "first_token_s": first["wall_s"]}


def _why(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("MAXRSS_KB")]
    return (lines or ["?"])[-1][:300]


def disk_bandwidth(store: Path, reads: int = 64) -> float:
    """GB/s of expert reads from the expert store, 8 threads (what the disk tier's demand reads do: O_DIRECT records
    of a copy, or buffered extents of the checkpoint read in place)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from moe_offload.engines.offload.experts import diskstore

    man = diskstore.read_manifest(store)
    f = diskstore.StoreFile(man)
    layers = list(man.layers.values())
    bufs = [diskstore.aligned_empty(layers[0].record_bytes) for _ in range(8)]
    picks = [(random.choice(layers), random.randrange(layers[0].num_experts)) for _ in range(reads)]
    drop_caches()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        n = sum(ex.map(lambda i: f.read(picks[i][0], picks[i][1], bufs[i % 8]), range(reads)))
    return n / (time.perf_counter() - t0) / 1e9


def row(name: str, runs: list[dict], ref: list[dict] | None = None) -> str:
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return f"| {name} | failed: {runs[0].get('why', '?')} | | | | | |"
    ms = statistics.median(r["ms_per_token"] for r in ok)
    ratio = ""
    if ref:
        ref_ok = [r for r in ref if r.get("ok")]
        if ref_ok:
            ratio = f"{statistics.median(r['ms_per_token'] for r in ref_ok) / ms:.2f}x"
    ft = statistics.median(r["first_token_s"] for r in ok)
    rss = max(r["maxrss"] for r in ok) / 2**30
    peak = max(r["cgroup_peak"] for r in ok) / 2**30
    disk = ok[0].get("disk") or {}
    extra = (f"host hits {disk.get('host_hit_rate', 0):.0%}, {disk.get('disk_bytes_per_token', 0) / 1e6:.1f} MB read/token, "
             f"stall {disk.get('stall_ms_per_token', 0):.1f} ms/token, prefetch P/R "
             f"{disk.get('prefetch_precision', 0):.2f}/{disk.get('prefetch_recall', 0):.2f}" if disk else "")
    each = " / ".join(f"{r['ms_per_token']:.1f}" for r in ok)
    return f"| {name} | {ms:.1f} ({each}) | {1000 / ms:.2f} | {ratio} | {ft:.1f} | {rss:.2f} / {peak:.2f} | {extra} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--limit-gib", type=float, required=True, help="memory limit of each process (cgroup v1)")
    ap.add_argument("--int8-limit-gib", type=float, help="also int8 experts vs llama.cpp q8_0 under this limit")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-unlimited", action="store_true", help="skip the runs without a limit")
    args = ap.parse_args(argv)
    from bench_engine import read_bandwidth
    from bench_llamacpp import ensure_llamacpp, to_gguf

    tools = ensure_llamacpp()
    from transformers import AutoTokenizer

    # llama-bench's start-up run prefills as many tokens as the engine's prompt has (checked against its run below)
    prompt_tokens = len(AutoTokenizer.from_pretrained(args.model_dir)(PROMPT)["input_ids"])
    gguf = to_gguf(args.model_dir, "bf16", tools=tools)
    q8 = to_gguf(args.model_dir, "q8_0", tools=tools) if args.int8_limit_gib else None
    # the expert stores, written once (their cost is a one-time step, reported here)
    conv = {}
    for label, extra in (("bf16", []), ("int8", ["--dtype", "bfloat16", "--expert-dtype", "int8"])):
        if label == "int8" and not args.int8_limit_gib:
            continue
        t0 = time.perf_counter()
        out = subprocess.run([ROOT / ".venv/bin/moe-offload", "convert", "--model", args.model_dir, "--json", *extra],
                             capture_output=True, text=True, check=True).stdout
        conv[label] = {**json.loads(out), "wall_s": time.perf_counter() - t0}
    COLD.extend([*args.model_dir.glob("*.safetensors"), gguf, *([q8] if q8 else []),
                 *(Path(c["store"]) / "experts.bin" for c in conv.values())])
    bw = read_bandwidth()
    dbw = disk_bandwidth(Path(conv["bf16"]["store"]))
    limit = int(args.limit_gib * 2**30)
    lim, free = Group("moe-bench-limited", limit), Group("moe-bench-free", None)
    ckpt = sum(f.stat().st_size for f in args.model_dir.glob("*.safetensors"))
    runs: dict[str, list] = {k: [] for k in ("llama", "ours", "ours_nopf", "llama_q8", "ours_int8")}
    for i in range(args.rounds):
        log(f"round {i + 1}/{args.rounds}")
        runs["llama"].append(llama(lim, gguf, args.tokens, tools, prompt_tokens))
        runs["ours"].append(ours(lim, args.model_dir, args.tokens))
        runs["ours_nopf"].append(ours(lim, args.model_dir, args.tokens, "--no-prefetch"))
        if q8 is not None:
            l8 = Group("moe-bench-int8", int(args.int8_limit_gib * 2**30))
            runs["llama_q8"].append(llama(l8, q8, args.tokens, tools, prompt_tokens))
            runs["ours_int8"].append(ours(l8, args.model_dir, args.tokens, "--dtype", "bfloat16", "--expert-dtype",
                                          "int8", "--dense-dtype", "int8"))
        for k, v in runs.items():
            if v:
                r = v[-1]
                log(f"  {k}: " + (f"{r['ms_per_token']:.1f} ms/token, first token {r['first_token_s']:.1f} s, "
                                  f"maxrss {r['maxrss'] / 2**30:.2f} GiB, cgroup peak {r['cgroup_peak'] / 2**30:.2f} GiB"
                                  if r.get("ok") else f"FAILED rc={r['rc']}: {r.get('why')}"))
    free_runs = {}
    if not args.no_unlimited:
        free_runs["ours"] = [ours(free, args.model_dir, args.tokens)]
        free_runs["llama"] = [llama(free, gguf, args.tokens, tools, prompt_tokens)]
    same = None
    if free_runs and all(r.get("ok") for r in runs["ours"] + free_runs["ours"]):
        same = all(r["tokens"] == free_runs["ours"][0]["tokens"] for r in runs["ours"] + runs["ours_nopf"] if r["ok"])
    print(f"\nmemory bandwidth {bw / 1e9:.1f} GB/s (fp32 sum), disk {dbw:.2f} GB/s (the store's expert reads, 8 threads); "
          f"checkpoint {ckpt / 2**30:.2f} GiB, limit {args.limit_gib} GiB ({ckpt / limit:.2f}x below the checkpoint); "
          f"{args.tokens} tokens, {args.rounds} rounds\n")
    print("| run | ms/token (median; each round) | tok/s | vs llama.cpp | start to first token, s | peak RSS / cgroup peak, GiB | disk tier |")
    print("|---|---|---|---|---|---|---|")
    print(row(f"llama.cpp bf16 GGUF, mmap, {args.limit_gib} GiB limit", runs["llama"]))
    print(row(f"moe-offload bf16, disk tier, {args.limit_gib} GiB limit", runs["ours"], runs["llama"]))
    print(row("moe-offload bf16, disk tier, --no-prefetch", runs["ours_nopf"], runs["llama"]))
    if q8 is not None:
        print(row(f"llama.cpp q8_0 GGUF, mmap, {args.int8_limit_gib} GiB limit", runs["llama_q8"]))
        print(row(f"moe-offload int8 experts + dense, {args.int8_limit_gib} GiB limit", runs["ours_int8"], runs["llama_q8"]))
    if free_runs:
        print(row("llama.cpp bf16, no limit", free_runs["llama"]))
        print(row("moe-offload bf16, no limit (all in memory)", free_runs["ours"], free_runs["llama"]))
    print(f"\noutput identical to the unlimited run: {same}")
    seen = {r.get("prompt_tokens") for v in runs.values() for r in v if r.get("prompt_tokens")}
    print(f"prompt tokens: engine {sorted(seen)}, llama-bench -p {prompt_tokens}")
    for label, c in conv.items():
        held = (f"in place, {c['disk_bytes'] / 2**10:.0f} KiB on disk ({100 * c['disk_bytes'] / ckpt:.4f} % of the "
                "checkpoint)" if c.get("in_place") else f"a copy, {c['bytes'] / 2**30:.2f} GiB")
        print(f"expert store {label}: {held}, {'written' if c['written'] else 'found'} in {c['wall_s']:.1f} s "
              f"({c['store']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
