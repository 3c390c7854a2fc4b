"""The worker's /metrics: vLLM's names (read by llm-d's endpoint picker) plus ours. One registry per app.

Every family is typed (an untyped metric reads as 0 in the endpoint picker).
Hit rates are measured by the engine per request; ``..._predicted`` gauges
hold what the placement predicted and say so in their name.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from moe_offload.serving.classify import CLASSES
from rm_core.metrics import percentile

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
# vLLM's /metrics has no *_created series; scrapers and the endpoint picker do not expect them.
disable_created_metrics()
WINDOW = 256  # requests behind airm_tok_s / airm_tpot_*
WINDOW_STEPS = 65536  # ... and at most this many decode steps of them (bounds memory and the sort per scrape)


def predicted_overall(predicted: Mapping[str, float], host_tiers: Iterable[str] = ("host",)) -> float:
    """Predicted fraction served from accelerator memory: the sum over non-host tiers."""
    hosts = set(host_tiers)
    return min(sum(v for k, v in predicted.items() if k not in hosts), 1.0)


class WorkerMetrics:
    def __init__(self, model_name: str, *, max_model_len: int, tiers=(), predicted: Mapping[str, float] | None = None,
                 predicted_by_class: Mapping[str, float] | None = None, state: Callable[[], dict] | None = None,
                 cache_info: Mapping | None = None, approximate: str = ""):
        self.model = model_name
        r = self.registry = CollectorRegistry(auto_describe=True)
        m = {"model_name": model_name}
        state = state or (lambda: {"running": 0, "waiting": 0, "kv": 0.0})
        g = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", ["model_name"], registry=r)
        g.labels(**m).set_function(lambda: state()["running"])
        g = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", ["model_name"], registry=r)
        g.labels(**m).set_function(lambda: state()["waiting"])
        g = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", ["model_name"], registry=r)
        g.labels(**m).set_function(lambda: state()["kv"])
        # The engine's KV manager as it is (an engine without one: no blocks; max_model_len is still reported)
        ci = dict(cache_info or {})
        labels = {"block_size": str(ci.get("block_size", 0)), "num_gpu_blocks": str(ci.get("num_gpu_blocks", 0)),
                  "cache_dtype": str(ci.get("cache_dtype", "auto")),
                  "enable_prefix_caching": str(bool(ci.get("enable_prefix_caching", False))),
                  "kv_cache_memory_bytes": str(ci.get("kv_cache_memory_bytes", 0)),
                  "max_num_seqs": str(ci.get("max_num_seqs", 1)), "max_num_batched_tokens": str(ci.get("max_num_batched_tokens", 0)),
                  "max_model_len": str(ci.get("max_model_len", max_model_len))}
        info = Gauge("vllm:cache_config_info", "Information of the KV cache config (value 1).", ["model_name", *labels], registry=r)
        info.labels(model_name=model_name, **labels).set(1)
        self.prefix_caching = bool(ci.get("enable_prefix_caching", False))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ["model_name"], registry=r).labels(**m)
        # vLLM's prefix cache counters: prompt tokens asked for, and found cached (hits / queries: the hit rate)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                                      ["model_name"], registry=r).labels(**m)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   ["model_name"], registry=r).labels(**m)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", ["model_name"], registry=r).labels(**m)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.", ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r).labels(**m)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ["model_name"],
                             buckets=ITL_BUCKETS, registry=r).labels(**m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", ["model_name"],
                             buckets=E2E_BUCKETS, registry=r).labels(**m)
        self.hit_rate = Gauge("moe_offload_expert_hit_rate",
                              "Measured fraction 0..1 of routed token-expert pairs served from accelerator memory "
                              "(tier=<accelerator tier>: from that tier; tier=all: from any; class=all: every request "
                              "class). The host's share is the miss rate, 1 - tier=all.", ["model_name", "tier", "class"],
                              registry=r)
        pred = Gauge("moe_offload_expert_hit_rate_predicted", "Hit rate 0..1 per tier that the placement predicts (not measured).",
                     ["model_name", "tier"], registry=r)
        self.affinity = Gauge("moe_offload_expert_affinity",
                              "Routing signal for gateways: measured hit rate per request class, seeded with the predicted one "
                              "until the class has been measured (class=all: every class).", ["model_name", "class"], registry=r)
        self.bytes_moved = Counter("moe_offload_expert_bytes_moved", "Expert bytes copied host -> accelerator, per tier "
                                   "(tier=disk: read from the expert store file into host memory).",
                                   ["model_name", "tier"], registry=r)
        self.disk = {k: Counter(f"moe_offload_disk_{k}", h, ["model_name"], registry=r).labels(**m) for k, h in (
            ("demand_reads", "Experts read from the expert store file because a layer asked for them (host tier misses)."),
            ("prefetch_reads", "Experts read ahead of the router (predicted from the previous layer's hidden state)."),
            ("prefetch_hits", "Prefetched experts a layer then asked for."),
            ("host_hits", "Experts a layer asked for that were in host memory (disk tier on)."),
            ("stall_seconds", "Time the forward waited for expert reads."))}
        Gauge("moe_offload_approximate", "1: an opt-in approximate mode is on (mode: which; the output is not the "
              "model's exact output); 0: exact.", ["model_name", "mode"], registry=r).labels(
            model_name=model_name, mode=approximate or "exact").set(1 if approximate else 0)
        # speculative decoding: vLLM's spec_decode counters (zero without --speculative-config)
        self.spec = {k: Counter(f"vllm:spec_decode_{k}", h, ["model_name"], registry=r).labels(**m) for k, h in (
            ("num_drafts", "Number of spec decoding drafts (verify steps)."),
            ("num_draft_tokens", "Number of draft tokens."),
            ("num_accepted_tokens", "Number of accepted tokens."))}
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                    ["model_name", "position"], registry=r)
        self.host_tokens = Counter("moe_offload_host_expert_tokens", "Token-expert pairs computed on the host CPU.",
                                   ["model_name"], registry=r).labels(**m)
        cap = Gauge("moe_offload_memory_tier_capacity_bytes", "Capacity of each memory tier, bytes.", ["tier", "kind", "accelerator"], registry=r)
        for t in tiers:
            cap.labels(tier=t.name, kind=t.kind, accelerator=t.accelerator or "").set(t.capacity_bytes)
        kernels = ci.get("kernels")
        if kernels is not None:
            Gauge("moe_offload_cpu_kernels", "1: the compiled CPU kernels run (variant: the ISA build, source: prebuilt "
                  "at install | jit); 0: they are off (reason) and decode runs transformers' modules, slower.",
                  ["model_name", "variant", "source", "reason"], registry=r).labels(
                model_name=model_name, variant=kernels.get("variant", ""), source=kernels.get("source", ""),
                reason=(kernels.get("error") or "")[:200]).set(1 if kernels.get("ok") else 0)
        plan = ci.get("memory_plan") or {}
        if plan:
            split = Gauge("moe_offload_host_memory_plan_bytes",
                          "The host memory plan, weights first (planned at start, not measured): part=limit | reserve "
                          "(the runtime) | dense | experts (in host memory; experts_tier=disk: the disk tier's cache) "
                          "| kv (the KV budget).", ["model_name", "part", "experts_tier"], registry=r)
            for part in ("limit", "reserve", "dense", "experts", "kv"):
                split.labels(model_name=model_name, part=part,
                             experts_tier=plan["experts_tier"]).set(plan[f"{part}_bytes"])
        over = f"over the decode steps of the last {WINDOW} requests (at most {WINDOW_STEPS} steps)"
        Gauge("airm_tok_s", f"Decode throughput {over}, tokens per second.", ["model_name"],
              registry=r).labels(**m).set_function(lambda: self._decode_window()[0])
        Gauge("airm_tpot_p50_ms", f"Median time per output token {over}, ms.", ["model_name"],
              registry=r).labels(**m).set_function(lambda: self._decode_window()[1])
        Gauge("airm_tpot_p90_ms", f"90th percentile time per output token {over}, ms.", ["model_name"],
              registry=r).labels(**m).set_function(lambda: self._decode_window()[2])

        host_names = [t.name for t in tiers if t.kind != "device-hbm" and not t.accelerator] or ["host"]
        # None when nothing was predicted (no profile): the affinity then waits for a measurement.
        self.host_tiers = frozenset(host_names)
        for tier, v in (predicted or {}).items():
            if tier not in self.host_tiers:
                pred.labels(model_name=model_name, tier=tier).set(v)
        self.predicted = predicted_overall(predicted, host_names) if predicted else None
        by_class = dict(predicted_by_class or {})
        self.predicted_by_class = {c: by_class.get(c, self.predicted) for c in CLASSES}
        self._class_counts = {c: [0, 0] for c in CLASSES}  # hits, routed
        self._class_requests = {c: 0 for c in CLASSES}
        self._tier_sums: dict[str, list[float]] = {}  # tier -> [hit_rate x routed, routed]
        self._window: deque[list[float]] = deque(maxlen=WINDOW)  # per request: ms of each decode step
        self._window_steps = 0
        self._window_stats: tuple[float, float, float] | None = (0.0, 0.0, 0.0)  # None: recompute at the next scrape
        for c in CLASSES:
            if self.predicted_by_class[c] is not None:
                self.affinity.labels(model_name=model_name, **{"class": c}).set(self.predicted_by_class[c])
        if self.predicted is not None:
            self.affinity.labels(model_name=model_name, **{"class": "all"}).set(self.predicted)

    def class_hit_rate(self, cls: str) -> float | None:
        hits, routed = self._class_counts.get(cls, (0, 0))
        return hits / routed if routed else None

    def affinity_of(self, cls: str) -> float | None:
        measured = self.class_hit_rate(cls)
        return measured if measured is not None else self.predicted_by_class.get(cls, self.predicted)

    def observe(self, cls: str, stats, *, finish_reason: str, ttft_s: float | None, itl_s: list[float], e2e_s: float,
                completion_tokens: int | None = None) -> None:
        """Record one finished request (``stats``: the engine's GenerationStats). ``completion_tokens``: the tokens
        the client got, when fewer than the engine made (a stop string ends the completion before the engine stops)."""
        m = self.model
        self.prompt_tokens.inc(stats.prompt_tokens)
        if self.prefix_caching:
            self.prefix_queries.inc(stats.prompt_tokens)
            self.prefix_hits.inc(getattr(stats, "cached_tokens", 0))
        self.generation_tokens.inc(stats.completion_tokens if completion_tokens is None else completion_tokens)
        self.success.labels(model_name=m, finished_reason=finish_reason).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for x in itl_s:
            self.itl.observe(x)
        self.e2e.observe(e2e_s)
        for tier, b in stats.bytes_moved.items():
            self.bytes_moved.labels(model_name=m, tier=tier).inc(b)
        self.host_tokens.inc(stats.host_expert_tokens)
        if getattr(stats, "spec_drafts", 0):
            self.spec["num_drafts"].inc(stats.spec_drafts)
            self.spec["num_draft_tokens"].inc(stats.spec_draft_tokens)
            self.spec["num_accepted_tokens"].inc(stats.spec_accepted_tokens)
            for pos, v in enumerate(stats.spec_accepted_per_pos):
                self.spec_per_pos.labels(model_name=m, position=str(pos)).inc(v)
        d = getattr(stats, "disk", None) or {}
        for k, c in self.disk.items():
            v = d.get("stall_ms", 0.0) / 1000 if k == "stall_seconds" else d.get(k, 0)
            if v:
                c.inc(v)
        routed = stats.hits + stats.misses
        if routed:
            cc = self._class_counts.setdefault(cls, [0, 0])
            cc[0] += stats.hits
            cc[1] += routed
            self._class_requests[cls] = self._class_requests.get(cls, 0) + 1
            for tier, rate in stats.hit_rate_by_tier.items():
                if tier in self.host_tiers:  # its share is the misses: not a hit rate
                    continue
                s = self._tier_sums.setdefault(tier, [0.0, 0])
                s[0] += rate * routed
                s[1] += routed
                self.hit_rate.labels(model_name=m, tier=tier, **{"class": "all"}).set(s[0] / s[1])
            self.hit_rate.labels(model_name=m, tier="all", **{"class": cls}).set(cc[0] / cc[1])
            self.affinity.labels(model_name=m, **{"class": cls}).set(cc[0] / cc[1])
            hits = sum(h for h, _ in self._class_counts.values())
            total = sum(r for _, r in self._class_counts.values())
            self.hit_rate.labels(model_name=m, tier="all", **{"class": "all"}).set(hits / total)
            self.affinity.labels(model_name=m, **{"class": "all"}).set(hits / total)
        if stats.token_ms:
            if len(self._window) == WINDOW:
                self._window_steps -= len(self._window[0])
            self._window.append(list(stats.token_ms))
            self._window_steps += len(stats.token_ms)
            while self._window_steps > WINDOW_STEPS and len(self._window) > 1:
                self._window_steps -= len(self._window.popleft())
            self._window_stats = None

    def _decode_window(self) -> tuple[float, float, float]:
        """(tok/s, p50 ms, p90 ms) over the window's decode steps: the estimator of the ai-rm decode run."""
        if self._window_stats is None:
            steps = [ms for request in self._window for ms in request]
            total = sum(steps)
            self._window_stats = (1000 * len(steps) / total if total else 0.0, percentile(steps, 0.5), percentile(steps, 0.9))
        return self._window_stats

    def affinity_report(self) -> dict:
        return {
            "predicted": self.predicted,
            "classes": {c: {"predicted": self.predicted_by_class[c], "measured": self.class_hit_rate(c),
                            "requests": self._class_requests.get(c, 0), "affinity": self.affinity_of(c)} for c in CLASSES},
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
