"""Expert parallel on torch.distributed (``--tensor-parallel N``): N ranks, each computing its share of every layer's
experts, in lockstep with rank 0.

    worker / generate process = rank 0: the API, the scheduler, sampling
        --("step", aborted sids): a header of int64s (send/recv) | ("start", prompt, params) | ("stats",) |
          ("close",): the header, then broadcast_object_list-->
    ranks 1..N-1 (python -m moe_offload.engines.offload.ranks.rank): the same engine calls in the same order
    every MoE layer, on every rank: its own experts' rows of [S, H] (the others zero)
        --sum over the ranks (over_ranks: send/recv on gloo, all_reduce on NCCL)--> the full rows on every rank
        --> the same combine as one process (the whole-step call does it in C++: DecodeStep.ranks)
    the LM head: each rank its rows of the vocabulary (dense_split.py) --gathered (send/recv; all_gather)--> logits
    every forward: the step's hit / miss counters --to_leader: sent, never waited for--> rank 0's per-request
        statistics cover every rank

Why it is exact: each (token, expert) row is computed on exactly one rank, by the kernel one process uses, and x + 0
is x, so every rank holds the one-process rows bit for bit; so is each logit (the LM head is split by vocabulary rows,
dense_split.py). Where the fused decode path runs (bf16 on the CPU), attention and dense MLPs are replicated (every
rank computes them from the same weights), so logits, sampling and therefore scheduling are identical on every
rank and bit for bit one process's. Wherever the fused decode path is off (CUDA, fp32, a family it does not take), each rank keeps its heads and
its part of every dense MLP (dense_split.py), their partial outputs summed in rank order: the same sum on every rank,
not one process's rounding (the tests hold the greedy tokens to transformers'). Rank 0 draws a seed for a request
that samples without one, so the ranks draw the same tokens. Expert e lives on rank e mod N (its slots and its host
share).

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
# a step's command travels as a fixed header of int64s, rank 0 sending it to each rank (one message, not
# broadcast_object_list's two collectives and a pickle): [1, n, n aborted ids] a step, [2] a pickled command follows
HEADER, _STEP, _OBJECT = 64, 1, 2
_CMD_TAG, _COUNT_TAG = 7, 8  # their own tags: never matched with the rows' messages
_sent: list = []  # this rank's counters on their way to rank 0 (to_leader), with the work that sends them


def threads_per_rank(world: int) -> int:
    """Every core for each rank when OpenMP's threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, which the CLI sets
    for --tensor-parallel): a rank waiting for the others' rows leaves its cores to them. Else the cores / ranks:
    spinning threads of ranks sharing cores take the cores from the rank that works (docs/benchmarks/parallel.md)."""
    cores = os.cpu_count() or world
    return cores if PASSIVE else max(1, cores // world)


def cpu_group():
    """The group for CPU tensors and objects: a gloo side group when the rows go over NCCL, else None (the default)."""
    return _CPU_GROUP


def exchange(t: torch.Tensor, group, width=None) -> list[torch.Tensor]:
    """Every rank's ``t`` in rank order (CPU tensors, gloo): this rank's sent to every other and theirs received, by
    send/recv (gloo's send/recv take a fraction of its all-reduce's time between processes of one host:
    docs/benchmarks/parallel.md). ``width(r)``: rank r's last dimension where the ranks' differ."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t = t.contiguous()
    got = {rank: t}
    ops = []
    for i in range(1, world):
        src = (rank - i) % world
        got[src] = t.new_empty(t.shape if width is None else (*t.shape[:-1], width(src)))
        ops += [dist.P2POp(dist.isend, t, (rank + i) % world, group), dist.P2POp(dist.irecv, got[src], src, group)]
    for w in dist.batch_isend_irecv(ops) if ops else ():
        w.wait()
    return [got[r] for r in range(world)]


def over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` summed over the ranks: CPU tensors by exchange, added in rank order; CUDA tensors by all_reduce (NCCL,
    in its own order). Either way every rank gets the same sum; it is one process's bits only where the order does
    not matter (rows each non-zero on one rank, integer counts), not for dense_split.RankSum's partial products. The whole-step call does the same in C++
    (DecodeStep.over_ranks)."""
    if t.device.type != "cpu":
        dist.all_reduce(t, group=group)
        return t
    parts = exchange(t, group)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def to_leader(t: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: ``t`` (float64 counts) summed with every other rank's; another rank: its ``t`` sent to rank 0 without
    waiting for it (None). A forward's counters (accounting.py): only rank 0 reports them, and a rank never waits
    for its own message, only rank 0 for theirs, sent as their forwards ended, when its own did."""
    rank, world = dist.get_rank(_CPU_GROUP), dist.get_world_size(_CPU_GROUP)
    if rank == 0:
        got = [torch.empty_like(t) for _ in range(1, world)]
        for w in [dist.irecv(g, r, group=_CPU_GROUP, tag=_COUNT_TAG) for r, g in enumerate(got, 1)]:
            w.wait()
        for g in got:
            t = t + g
        return t
    while _sent:  # the last forward's, long delivered: its buffer is free to go
        _sent.pop()[0].wait()
    t = t.contiguous()
    _sent.append((dist.isend(t, 0, group=_CPU_GROUP, tag=_COUNT_TAG), t))
    return None


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
    _sent.clear()  # delivered (rank 0 received every forward's), or rank 0 is gone
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
        """``cmd`` to every other rank (command(), there): a step with its aborted ids in the header alone."""
        h = torch.zeros(HEADER, dtype=torch.int64)
        small = cmd[0] == "step" and len(cmd[1]) <= HEADER - 2
        h[0] = _STEP if small else _OBJECT
        if small:
            h[1] = len(cmd[1])
            h[2:2 + len(cmd[1])] = torch.tensor(cmd[1], dtype=torch.int64)
        for w in [dist.isend(h, r, group=_CPU_GROUP, tag=_CMD_TAG) for r in range(1, self.world)]:
            w.wait()
        if not small:
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
    cmd = [sys.executable, "-m", "moe_offload.engines.offload.ranks.rank", "--world", str(world), "--port", str(port), "--threads", str(threads)]
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


def command() -> tuple:
    """The next command rank 0 sent (Leader.send)."""
    h = torch.empty(HEADER, dtype=torch.int64)
    dist.recv(h, 0, group=_CPU_GROUP, tag=_CMD_TAG)
    if h[0] == _STEP:
        return ("step", h[2:2 + int(h[1])].tolist())
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=_CPU_GROUP)
    return box[0]


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
            op, *args = command()
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
