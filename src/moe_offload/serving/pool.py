"""The gateway's view of its workers: health, load, and an EWMA of measured hit rate per (worker, class).

    score(worker, class, prompt) = affinity(worker, class) - lam x load(worker)
                                   + prefix_weight x (share of the prompt's leading chunks sent there before)

affinity starts at what the worker's placement predicts (its /affinity) and
moves toward each measured hit rate the worker reports: ``a <- a + alpha (x - a)``.
load is the requests the gateway has in flight there (queued + running).
The prefix term (prefix_index.py) keeps a conversation or an agent's system prompt on the worker whose prefix cache
holds it. Ties are broken at random so equal workers share the traffic.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from moe_offload.errors import ConfigError
from moe_offload.serving.classify import CLASSES
from moe_offload.serving.prefix_index import PrefixIndex

DEFAULT_AFFINITY = 0.5  # before anything is known about a worker


@dataclass
class WorkerEntry:
    url: str
    model: str | None = None
    healthy: bool = True
    failures: int = 0
    inflight: int = 0
    seed: dict[str, float] = field(default_factory=dict)
    ewma: dict[str, float] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)
    registered: bool = False  # registered itself (vs. given on the command line)
    last_error: str = ""
    last_seen: float = 0.0

    def affinity(self, cls: str) -> float:
        if cls in self.ewma:
            return self.ewma[cls]
        return self.seed.get(cls, self.seed.get("all", DEFAULT_AFFINITY))


class WorkerPool:
    def __init__(self, *, lam: float = 0.05, alpha: float = 0.2, fail_threshold: int = 3, rng: random.Random | None = None,
                 prefix_weight: float = 0.5):
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha: expected a fraction in (0, 1], got {alpha}")
        if lam < 0:
            raise ConfigError(f"lambda: expected a load penalty >= 0, got {lam}")
        if fail_threshold < 1:
            raise ConfigError(f"fail_threshold: expected >= 1, got {fail_threshold}")
        if prefix_weight < 0:
            raise ConfigError(f"prefix_weight: expected >= 0, got {prefix_weight}")
        self.lam, self.alpha, self.fail_threshold = lam, alpha, fail_threshold
        self.prefix_weight, self.prefixes = prefix_weight, PrefixIndex()
        self.rng = rng or random.Random()
        self.workers: dict[str, WorkerEntry] = {}

    def add(self, url: str, *, model: str | None = None, seed: dict[str, float] | None = None, registered: bool = False) -> WorkerEntry:
        url = url.rstrip("/")
        w = self.workers.get(url)
        if w is None:
            w = self.workers[url] = WorkerEntry(url, model=model, registered=registered)
        w.model = model or w.model
        if seed:
            w.seed = {k: float(v) for k, v in seed.items()}
        w.last_seen = time.time()
        return w

    def remove(self, url: str) -> bool:
        self.prefixes.forget(url.rstrip("/"))
        return self.workers.pop(url.rstrip("/"), None) is not None

    def score(self, w: WorkerEntry, cls: str, chunks: list[bytes] | None = None) -> float:
        s = w.affinity(cls) - self.lam * w.inflight
        if chunks and self.prefix_weight:
            s += self.prefix_weight * self.prefixes.matched(w.url, chunks) / len(chunks)
        return s

    def rank(self, cls: str, chunks: list[bytes] | None = None) -> list[WorkerEntry]:
        """Healthy workers, best score first (ties in random order); unhealthy ones last, as a last resort.
        ``chunks``: the request's prefix chunks (prefix_index.chain), for the prefix term."""
        ws = list(self.workers.values())
        self.rng.shuffle(ws)  # sort is stable: equal scores keep this random order
        healthy = sorted((w for w in ws if w.healthy), key=lambda w: self.score(w, cls, chunks), reverse=True)
        return healthy + [w for w in ws if not w.healthy]

    def feedback(self, w: WorkerEntry, cls: str, hit_rate: float) -> None:
        if not 0 <= hit_rate <= 1:
            return
        a = w.affinity(cls)
        w.ewma[cls] = a + self.alpha * (hit_rate - a)

    def failed(self, w: WorkerEntry, why: str) -> None:
        w.failures += 1
        w.last_error = why
        if w.failures >= self.fail_threshold:
            w.healthy = False

    def succeeded(self, w: WorkerEntry) -> None:
        w.failures = 0
        w.healthy = True
        w.last_seen = time.time()

    def describe(self) -> list[dict]:
        return [
            {
                "url": w.url, "model": w.model, "healthy": w.healthy, "failures": w.failures, "inflight": w.inflight,
                "registered": w.registered, "last_error": w.last_error,
                "affinity": {c: round(w.affinity(c), 6) for c in CLASSES},
                "score": {c: round(self.score(w, c), 6) for c in CLASSES},
                "measured": sorted(w.ewma), "routed": dict(w.routed),
                "prefix_chunks": len(self.prefixes.workers.get(w.url, ())),
            }
            for w in self.workers.values()
        ]
