"""`moe-offload selftest`: the hardware-free checks, one line per area, in a few seconds.

Each check is a function that raises on failure; add an area with ``@check("name")``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CHECKS: list[tuple[str, Callable[[], str]]] = []


def check(area: str):
    def wrap(fn):
        CHECKS.append((area, fn))
        return fn

    return wrap


@check("contracts")
def _contracts() -> str:
    from rm_core import LayerPlacement, Measurement, MemoryTier, Placement, Workload
    from rm_core.schema import validate

    tier = MemoryTier("npu0", "device-hbm", 48 * 2**30, accelerator="node/furiosa:0")
    host = MemoryTier("host", "host-dram", 256 * 2**30)
    p = Placement("m", (tier, host), (LayerPlacement(0, ("npu0", "host")), ), "top", {"npu0": 0.5})
    for obj, stem in ((p, "placement"), (Workload("decode", "m"), "workload"), (Measurement("airm_tok_s", 1.0, "tok/s"), "measurement")):
        again = type(obj).from_json(obj.to_json())
        assert again == obj, f"{stem} does not round-trip"
        validate(stem, obj.to_dict())
    return "round-trip and schema ok"


@check("backends")
def _backends() -> str:
    from moe_offload import backends

    found = backends.backends()
    assert "mock" in found and found["mock"].availability().ok, "mock backend missing"
    return ", ".join(f"{n}={'yes' if b.availability().ok else 'no'}" for n, b in found.items())


@check("mock engine")
def _mock() -> str:
    from moe_offload.backends import get_backend
    from moe_offload.engines.params import SamplingParams

    engine = get_backend("mock").build_engine("mock", ms_per_token=0)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    a, b = list(engine.generate([1, 2, 3], params)), list(engine.generate([1, 2, 3], params))
    assert a == b and len(a) == 8, "mock engine is not deterministic"
    return "deterministic"


@check("executor")
def _executor() -> str:
    from moe_offload.engines.offload.tools.selfcheck import exactness

    return exactness("cpu", tokens=4, fractions=(0.5,))


@check("control plane")
def _control_plane() -> str:
    from moe_offload.control.budget import plan_budget
    from moe_offload.control.placement import plan, simulate
    from moe_offload.control.profile import Profile, synthetic_routes
    from moe_offload.control.spec import ModelSpec

    mixtral = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
               "num_experts_per_tok": 2, "tie_word_embeddings": False}
    spec = ModelSpec.from_hf_config(mixtral)
    assert abs(spec.total_params / 46.7e9 - 1) < 0.01, f"Mixtral-8x7B counts {spec.total_params / 1e9:.2f}B, published 46.7B"
    budget = plan_budget(spec, ["47.5GiB"], context=4096, reserve="2GiB")
    routes = synthetic_routes(500, spec.moe_layers, spec.num_experts, spec.top_k, skew=1.0, seed=0)
    prof = Profile.from_routes(routes)
    p = plan(spec, budget.tiers, budget.slots, "global", prof)
    predicted = 1 - p.predicted_hit_rate[p.host_tier]
    replayed = simulate(routes, p)["accelerator_hit_rate"]
    assert abs(predicted - replayed) < 1e-9, "static placement: prediction and replay disagree"
    return f"Mixtral 46.70B ok, 47.5GiB -> slots {budget.slots}, predicted hit {predicted:.2f}"


@check("demo model")
def _demo_model() -> str:
    import tempfile

    from moe_offload.demo import build_demo_model
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = build_demo_model(tmp)
        out = {}
        for policy, fraction in (("static", 0.25), ("lru", 0.25)):
            engine = build_offload_engine(path, policy=policy, fraction=fraction)
            gen = engine.generate(engine.tokenizer("The river runs")["input_ids"], SamplingParams(max_tokens=6, ignore_eos=True))
            out[(policy, fraction)] = (list(gen), gen.stats)
            engine.close()
    tokens = {k: v[0] for k, v in out.items()}
    assert len(set(map(tuple, tokens.values()))) == 1, f"greedy tokens depend on the placement: {tokens}"
    s = out[("static", 0.25)][1]
    assert s.hits + s.misses > 0 and s.host_expert_tokens == s.misses, "static: misses must be computed on the host"
    return f"built, greedy identical under static and lru, static 0.25 hit rate {s.hit_rate:.2f}"


@check("serving")
def _serving() -> str:
    import httpx

    from moe_offload.backends import get_backend
    from moe_offload.serving import gateway, server, worker

    w = server.start_server(worker.create_app(get_backend("mock").build_engine("mock", ms_per_token=0), model_name="mock"))
    g = server.start_server(gateway.create_app([w.url], health_interval=5.0))
    try:
        body = {"model": "mock", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(g.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        bad = httpx.post(w.url + "/v1/completions", content=b"{", timeout=10)
        assert bad.status_code == 400 and "error" in bad.json(), bad.text
        assert "# TYPE vllm:num_requests_waiting gauge" in httpx.get(w.url + "/metrics").text
    finally:
        g.stop()
        w.stop()
    return "worker + gateway on loopback: chat 200, bad JSON 400, metrics typed"


@check("cost model")
def _cost_model() -> str:
    # Assumed GPU-like numbers (no measurement: `moe-offload calibrate` measures); checks the model, in milliseconds.
    from moe_offload.control import placement as P
    from moe_offload.control.calibration import Calibration
    from moe_offload.control.costmodel import predict
    from moe_offload.control.spec import ModelSpec
    from rm_core import MemoryTier

    spec = ModelSpec.from_hf_config(dict(model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                                         moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4))
    cal = Calibration.assumed("cuda:0")
    tiers = [MemoryTier("acc", "device-hbm", 2**34, accelerator="selftest/acc:0"), MemoryTier("host", "host-dram", 2**34)]
    ms = [predict(spec, P.from_fraction(spec, tiers, f), "static", cal).ms_per_token for f in (0.25, 1.0)]
    assert ms[0] > ms[1] > 0, f"more resident experts must predict faster decode: {ms}"
    return f"predicted (assumed calibration) static 0.25/1.0: {ms[0]:.2f}/{ms[1]:.2f} ms/token"


@check("kernels")
def _kernels() -> str:
    import torch

    from moe_offload.engines.offload.kernels import jit, ops

    if not jit.load():  # a failed check: decode then runs transformers' modules, several times slower
        raise AssertionError(f"bf16 CPU kernels off ({jit.info().get('error') or 'disabled'}): decode falls back to "
                             "transformers' modules (slower); reinstall with a compiler (scripts/setup.sh)")
    w = (torch.randn(257, 1031) / 32).to(torch.bfloat16)  # odd sizes: masked tails, uneven thread split
    x = torch.randn(1031).to(torch.bfloat16)
    torch.testing.assert_close(ops.gemv_bf16(x, w).float(), w.float() @ x.float(), rtol=8e-3, atol=1e-2)
    return f"bf16 CPU GEMV ({jit.info()['variant']}, {jit.info()['source']}) matches the fp32 reference"


def run_all(echo: Callable[[str], None]) -> int:
    """Run every check; returns the number that failed."""
    failed = 0
    for area, fn in CHECKS:
        t0 = time.perf_counter()
        try:
            detail = fn()
            echo(f"PASS {area:14} {detail} ({(time.perf_counter() - t0) * 1000:.0f} ms)")
        except Exception as e:  # noqa: BLE001 - every failure becomes one line
            failed += 1
            echo(f"FAIL {area:14} {type(e).__name__}: {e}")
    return failed
