"""Expert parallel on torch.distributed (``--tensor-parallel N``): N ranks, each computing its share of every layer's
experts, in lockstep with rank 0.

    worker / generate process = rank 0: the API, the scheduler, sampling
        --("start", prompt, params) | ("step", aborted sids) | ("stats",) | ("close",)  (broadcast_object_list)-->
    ranks 1..N-1 (python -m moe_offload.engines.offload.runtime.rank): the same engine calls in the same order
    every MoE layer, on every rank: its own experts' rows of [S, H] (the others zero)
        --sum over the ranks (over_ranks: send/recv on gloo, all_reduce on NCCL)--> the full rows on every rank
        --> the same combine as one process (the whole-step call does it in C++: DecodeStep.ranks)
    every forward: the step's hit / miss counters --over_ranks--> rank 0's per-request statistics cover every rank

Why it is exact: each (token, expert) row is computed on exactly one rank, by the kernel one process uses, and x + 0
is x, so every rank holds the one-process rows bit for bit; the dense layers are replicated (every rank computes
them from the same weights), so logits, sampling and therefore scheduling are identical on every rank. Rank 0 draws
a seed for a request that samples without one, so the ranks draw the same tokens. Expert e lives on rank e mod N
(its slots and its host share); transformers' modules are not split, so attention heads and dense MLPs are computed
on every rank (tensor parallel of the dense layers is not built).

The process group is torch.distributed's: gloo on the CPU (this file's ranks: threads_per_rank); CUDA ranks
(rank r on GPU r) sum the rows over NCCL and keep a gloo side group for the commands and counters, which live on the
CPU (written, not run here: no GPU). Rank 0 holds a lock around every collective sequence, so a
``/metrics`` scrape (stats) never interleaves with a step's collectives.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from moe_offload import settings

TIMEOUT = datetime.timedelta(seconds=600)  # a rank that does not answer a collective for this long is gone
THREADS: int | None = None  # torch threads per rank; None: threads_per_rank's choice
# OpenMP read its wait policy when torch loaded it (this module imports torch): PASSIVE, its threads sleep when idle
PASSIVE = (settings.get("OMP_WAIT_POLICY") or "").upper() == "PASSIVE"
_CPU_GROUP = None  # CUDA ranks: a gloo group for what travels on the CPU (commands, counters); gloo ranks: the default


def threads_per_rank(world: int) -> int:
    """Every core for each rank when OpenMP's threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, which the CLI sets
    for --tensor-parallel): a rank waiting for the others' rows leaves its cores to them. Else the cores / ranks:
    spinning threads of ranks sharing cores take the cores from the rank that works (docs/benchmarks/parallel.md)."""
    cores = os.cpu_count() or world
    return cores if PASSIVE else max(1, cores // world)


def cpu_group():
    """The group for CPU tensors and objects: a gloo side group when the rows go over NCCL, else None (the default)."""
    return _CPU_GROUP


def over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` summed over the ranks, for sums that do not depend on the order (rows each non-zero on one rank, integer
    counts). CPU tensors: sent to every other rank and theirs added (gloo's send/recv take a fraction of its
    all-reduce's time between processes of one host: docs/benchmarks/parallel.md); CUDA tensors: all_reduce (NCCL).
    The whole-step call does the same in C++ (DecodeStep.over_ranks)."""
    if t.device.type != "cpu":
        dist.all_reduce(t, group=group)
        return t
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t = t.contiguous()
    got = [torch.empty_like(t) for _ in range(world - 1)]
    ops = [op for i in range(1, world) for op in (dist.P2POp(dist.isend, t, (rank + i) % world, group),
                                                 dist.P2POp(dist.irecv, got[i - 1], (rank - i) % world, group))]
    for w in dist.batch_isend_irecv(ops) if ops else ():
        w.wait()
    for g in got:
        t = t + g
    return t


def agree(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (a collective: every rank calls it at the same point). The ranks' choices
    that must match (whether a decode step runs in the whole-step call) are made with it, not left to each rank."""
    t = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return bool(t.item())


def step_group():
    """The process group the whole-step call sums its rows over (its C++ object): the default one."""
    return dist.group.WORLD.boxed()


def _join(rank: int, world: int, port: int, cuda_base: int | None) -> None:
    """Join the ranks: gloo on the CPU; NCCL for the rows of CUDA ranks (rank r on GPU cuda_base + r) plus a gloo
    side group for the commands and counters, which stay on the CPU."""
    global _CPU_GROUP
    backend = "gloo" if cuda_base is None else "nccl"
    if cuda_base is not None:
        torch.cuda.set_device(cuda_base + rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    _CPU_GROUP = dist.new_group(backend="gloo") if cuda_base is not None else None


def _leave() -> None:
    global _CPU_GROUP
    _CPU_GROUP = None
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    out = dict(options)
    spec = out.get("speculative")
    if spec is not None and hasattr(spec, "to_dict"):
        out["speculative"] = spec.to_dict()
    return out


class Leader:
    """Rank 0's side: sends the engine calls, gathers per-rank statistics, shuts the ranks down."""

    def __init__(self, world: int, procs: list[subprocess.Popen]):
        self.world, self.procs = world, procs
        self.lock = threading.RLock()  # every collective sequence of rank 0 runs under it
        self.aborted: list[int] = []  # sequences aborted since the last step (the ranks abort them too)

    def send(self, cmd: tuple) -> None:
        dist.broadcast_object_list([cmd], src=0, group=_CPU_GROUP)

    def rank_stats(self, local: dict) -> list[dict]:
        """Each rank's executor snapshot (rank 0's is ``local``)."""
        with self.lock:
            self.send(("stats",))
            out: list = [None] * self.world
            dist.gather_object(local, out, dst=0, group=_CPU_GROUP)
            return out

    def close(self) -> None:
        with self.lock:
            try:
                self.send(("close",))
            except RuntimeError:  # a rank already gone
                pass
            for p in self.procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
            _leave()


def launch(world: int, build, model_path: str, placement, options: dict[str, Any], threads: int | None = None):
    """Start ranks 1..world-1, join them as rank 0 and build rank 0's engine with ``build(model_path, placement,
    expert_parallel=(0, world), **options)``; the engine drives the ranks (engine.ranks). ConfigError when a rank
    fails to build (its message), with every rank stopped."""
    from moe_offload.errors import ConfigError

    if dist.is_initialized():
        raise ConfigError("tensor parallel: this process already belongs to a torch.distributed group")
    threads = threads or THREADS or threads_per_rank(world)
    port = _free_port()
    device = torch.device(options.get("device") or "cpu")
    cuda_base = (device.index or 0) if device.type == "cuda" else None
    spec = json.dumps({"model": str(model_path), "options": _jsonable(options), "cuda_base": cuda_base,
                       "placement": placement.to_json() if hasattr(placement, "to_json") else None,
                       "placement_file": str(placement) if placement is not None and not hasattr(placement, "to_json")
                       else None})
    cmd = [sys.executable, "-m", "moe_offload.engines.offload.runtime.rank", "--world", str(world), "--port", str(port), "--threads", str(threads)]
    from moe_offload.log import chosen

    env = {**os.environ, **chosen()}  # the ranks log as this process does (quiet for generate, JSON for a worker)
    if PASSIVE:  # and wait as it does
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    procs = []
    for r in range(1, world):
        p = subprocess.Popen([*cmd, "--rank", str(r)], stdin=subprocess.PIPE, text=True, env=env)
        p.stdin.write(spec)
        p.stdin.close()
        procs.append(p)
    try:
        _join(0, world, port, cuda_base)
    except Exception:
        for p in procs:
            p.kill()
        raise
    torch.set_num_threads(threads)
    engine, failed = _built(lambda: build(model_path, placement, expert_parallel=(0, world), **options), world)
    if failed:
        for p in procs:
            p.wait(timeout=60)
        _leave()
        raise ConfigError("tensor parallel: " + "; ".join(failed))
    engine.ranks = Leader(world, procs)
    return engine


def _built(build, world: int):
    """(this rank's engine from ``build()``, ["rank r: its error"] of every rank whose build raised): every rank
    learns every outcome; where any failed, this rank's engine is closed (None)."""
    engine, err = None, None
    try:
        engine = build()
    except Exception as e:  # reported to every rank
        err = str(e) or type(e).__name__
    errors: list = [None] * world
    dist.all_gather_object(errors, err, group=_CPU_GROUP)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed and engine is not None:
        engine.close()
        engine = None
    return engine, failed


def share(placement, rank: int, world: int):
    """Rank ``rank``'s part of ``placement``: its experts (e mod world == rank) keep their tiers, the others' are
    not its to hold (homed on the host, never computed here); each accelerator keeps its pinned experts of this rank
    and a world-th of its dynamic slots (rounded up). Host slots over the disk tier stay as they are."""
    from rm_core import LayerPlacement, Placement

    host = placement.host_tier or "host"
    below = {t.name for t in placement.tiers if t.accelerator is None}
    layers = []
    for lp in placement.layers:
        home = tuple(h if e % world == rank or h in below else host for e, h in enumerate(lp.home))
        slots = {}
        for t, n in lp.slots.items():
            dynamic = n - len(lp.pinned(t))
            slots[t] = n if t in below else sum(h == t for h in home) + -(-dynamic // world)
        layers.append(LayerPlacement(lp.layer, home, slots))
    return Placement(model=placement.model, tiers=placement.tiers, layers=tuple(layers), policy=placement.policy,
                     profile=placement.profile)


def follow(build, rank: int, world: int, port: int, threads: int, spec: dict[str, Any]) -> int:
    """A rank's life (rank.py starts it): build its engine with ``build`` (build_offload_engine), then replay rank 0's
    calls until it says close."""
    cuda_base = spec.get("cuda_base")
    _join(rank, world, port, cuda_base)
    torch.set_num_threads(threads)
    from rm_core import Placement

    options = dict(spec["options"])
    if cuda_base is not None:  # each rank its own GPU
        options["device"] = f"cuda:{cuda_base + rank}"
    engine, failed = _built(lambda: build(spec["model"], Placement.from_json(spec["placement"]) if spec["placement"]
                                          else spec["placement_file"], expert_parallel=(rank, world), **options), world)
    if failed:
        _leave()
        return 1
    gens: dict[int, Any] = {}
    try:
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0, group=_CPU_GROUP)
            op, *args = box[0]
            if op == "start":
                prompt, params = args
                sid = engine.next_sid  # (before start: it takes this id)
                gens[sid] = engine.start(prompt, params)
            elif op == "step":
                for sid in args[0]:
                    if sid in gens:
                        gens[sid].close()
                engine.step()
                for sid, g in list(gens.items()):  # rank 0 serves the tokens; here they are only let go
                    g.drain()
                    if g.done:
                        del gens[sid]
            elif op == "stats":
                dist.gather_object(engine.executor.stats.snapshot(), None, dst=0, group=_CPU_GROUP)
            elif op == "close":
                break
    finally:
        engine.close()
        _leave()
    return 0
