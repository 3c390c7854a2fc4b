"""Executor statistics: per MoE layer and tier counts, bytes moved, time per stage.

Counts are of routed token-expert pairs: ``hits`` were served from an accelerator
slot that held the expert when the step began, ``misses`` were not (their home is
the host tier) and were either computed on the host (``host_tokens``) or fetched
(``fetches`` expert copies, ``bytes_copied`` host->accelerator). So
hits + misses = routed pairs, and misses = host_tokens + pairs served by fetches.
Times are wall-clock ms measured on the host thread (on CUDA, launch-to-launch
unless the stage synchronises).
"""

from __future__ import annotations

from typing import Any

STAGES = ("router", "device_experts", "host_experts", "fetch", "other")
COUNTERS = ("hits", "misses", "host_tokens", "fetches", "bytes_copied")


class ExecutorStats:
    """Cumulative numbers since the last ``reset()``; ``snapshot()`` is JSON-able."""

    def __init__(self, layers: list[int], accelerator_tier: str, host_tier: str, disk=None, devices=None):
        self.disk = disk  # hostcache.DiskStats when the experts live on disk (host DRAM caches them)
        self.layers = list(layers)
        self.accelerator_tier = accelerator_tier
        self.host_tier = host_tier
        # several accelerators (--devices): their tiers; each layer's hits are counted per device as well
        self.devices = tuple(devices) if devices and len(devices) > 1 else ()
        self.copied_fn = None  # several accelerators: () -> {tier: bytes copied into its slots since load}
        self.reset()

    def reset(self) -> None:
        # one row of counters per MoE layer, indexed by position in self.layers (lists: cheap to bump per step)
        self.counts = [[0] * len(COUNTERS) for _ in self.layers]
        self.device_hits = [[0] * len(self.devices) for _ in self.layers]  # [layer][device] hit pairs (several only)
        self._copied0 = self.copied_fn() if self.copied_fn is not None else {}
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self.forwards = 0
        self.whole_steps = 0  # forwards booked from the whole-step call (book_resident)
        self.forward_s = 0.0
        if self.disk is not None:
            self.disk.reset()

    def add(self, pos: int, hits: int, misses: int, host_tokens: int, fetches: int, bytes_copied: int,
            device_hits=None) -> None:
        """Book a layer's pairs; ``device_hits``: its hits per device (several accelerators; None with one)."""
        if device_hits is not None:
            drow = self.device_hits[pos]
            for i, n in enumerate(device_hits):
                drow[i] += n
        row = self.counts[pos]
        row[0] += hits
        row[1] += misses
        row[2] += host_tokens
        row[3] += fetches
        row[4] += bytes_copied

    def totals(self) -> dict[str, int]:
        return {name: sum(row[i] for row in self.counts) for i, name in enumerate(COUNTERS)}

    def hits_by_device(self) -> dict[str, int]:
        """{accelerator tier: hit pairs} with several accelerators; {} with one (its hits are ``hits``)."""
        return {d: sum(row[i] for row in self.device_hits) for i, d in enumerate(self.devices)}

    def copied_by_device(self) -> dict[str, int]:
        """{accelerator tier: bytes copied into its slots since the last reset} with several accelerators, else {}."""
        if self.copied_fn is None:
            return {}
        return {d: n - self._copied0.get(d, 0) for d, n in self.copied_fn().items()}

    def snapshot(self) -> dict[str, Any]:
        """Cumulative stats. Keys: hits, misses, hit_rate, host_expert_tokens, fetches, bytes_copied,
        hit_rate_by_tier {tier: fraction}, bytes_moved {tier: bytes}, stage_ms {stage: ms},
        forwards, whole_step_forwards (of those, run in the whole-step call), layers {layer: {hits, misses,
        host_tokens, fetches, bytes_copied, by_tier {tier: pairs}}}."""
        t = self.totals()
        routed = t["hits"] + t["misses"]
        known = sum(v for k, v in self.stage_s.items() if k != "other")
        stage_ms = {k: v * 1000 for k, v in self.stage_s.items()}
        stage_ms["other"] = max(0.0, self.forward_s - known) * 1000
        layers = {}
        for layer, row in zip(self.layers, self.counts):
            d = dict(zip(COUNTERS, row))
            d["by_tier"] = {self.accelerator_tier: row[0], self.host_tier: row[1]}
            if self.devices:
                d["by_tier"] = {**dict(zip(self.devices, self.device_hits[len(layers)])), self.host_tier: row[1]}
            layers[str(layer)] = d
        out = {
            "hits": t["hits"],
            "misses": t["misses"],
            "hit_rate": t["hits"] / routed if routed else 0.0,
            "host_expert_tokens": t["host_tokens"],
            "fetches": t["fetches"],
            "bytes_copied": t["bytes_copied"],
            "hit_rate_by_tier": {
                self.accelerator_tier: t["hits"] / routed if routed else 0.0,
                self.host_tier: t["misses"] / routed if routed else 0.0,
            },
            "bytes_moved": {self.accelerator_tier: t["bytes_copied"]},
            "stage_ms": stage_ms,
            "forwards": self.forwards,
            "whole_step_forwards": self.whole_steps,
            "layers": layers,
        }
        if self.devices:  # several accelerators: each one's share of the routed pairs
            per = self.hits_by_device()
            out["hit_rate_by_tier"] = {**{d: n / routed if routed else 0.0 for d, n in per.items()},
                                       self.host_tier: out["hit_rate_by_tier"][self.host_tier]}
            out["hits_by_tier"] = per
            if self.copied_fn is not None:
                out["bytes_moved"] = self.copied_by_device()
        if self.disk is not None:
            d = out["disk"] = self.disk.snapshot()
            out["bytes_moved"]["disk"] = d["disk_bytes"]
            out["stage_ms"]["disk_stall"] = d["stall_ms"]  # inside host_experts (and fetch): the wait for reads
        return out
