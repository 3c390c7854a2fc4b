"""The ai-rm runner's serve path, and the rm_core conformance kit run against npu-offload."""

import socket
import threading
import urllib.request

import pytest

from rm_core import ContractError, Workload, registry


@pytest.fixture
def runner():
    return registry.load("airm.workloads", "npu-offload")


def test_conformance_on_mock(airm_conformance):
    airm_conformance("npu-offload", {"backend": "mock", "mock_ms": 0})


def test_conformance_on_cpu(airm_conformance, demo_model_dir):
    airm_conformance("npu-offload", {"backend": "cpu", "model": str(demo_model_dir), "fraction": 0.5})


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_serve_exports_tiers_and_a_metrics_port(runner):
    handle = runner(Workload("serve"), mock=True, mock_ms=0, block=False, port=0, metrics_port=0)
    try:
        status, text = _get(f"{handle.url}/metrics")
        assert status == 200
        assert 'moe_offload_memory_tier_capacity_bytes{accelerator=' in text
        assert "mock:0" in text and 'kind="host-dram"' in text
        assert "airm_power_w{" not in text  # no card power to read on the mock: absent, not zero
        status, only = _get(handle.metrics_url)
        assert status == 200 and "moe_offload_memory_tier_capacity_bytes" in only
    finally:
        handle.stop()


def test_port_in_use_is_a_contract_error_and_nothing_is_left_running(runner):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    threads_before = threading.active_count()
    try:
        with pytest.raises(ContractError, match="config.port"):
            runner(Workload("serve"), mock=True, block=False, port=port)
    finally:
        taken.close()
    assert threading.active_count() == threads_before


def test_gateway_without_token_is_refused(runner, monkeypatch):
    monkeypatch.delenv("MOE_OFFLOAD_GATEWAY_TOKEN", raising=False)
    threads_before = threading.active_count()
    with pytest.raises(ContractError, match="config.gateway"):
        runner(Workload("serve"), mock=True, block=False, port=0, gateway="http://127.0.0.1:9")
    assert threading.active_count() == threads_before


def test_gateway_role(runner):
    handle = runner(Workload("serve"), role="gateway", block=False, port=0)
    try:
        status, body = _get(f"{handle.url}/gateway/workers")
        assert status == 200 and "workers" in body
    finally:
        handle.stop()


def test_decode_kpis_match_the_engines_own_stats(runner, demo_model_dir, monkeypatch):
    from moe_offload import backends

    cpu = backends.get_backend("cpu")
    built = []
    original = type(cpu).build_engine

    def spy(self, *a, **kw):
        built.append(original(self, *a, **kw))
        return built[-1]

    monkeypatch.setattr(type(cpu), "build_engine", spy)
    ms = {m.name: m for m in runner(Workload("decode"), backend="cpu", model=str(demo_model_dir), max_new=16, repeat=3)}
    own = built[0].stats()
    # The engine's cumulative numbers over the same three runs: 15 timed decode steps each.
    steps = own["completion_tokens"] - 3
    engine_tok_s = 1000 * steps / own["decode_ms"]
    assert abs(ms["airm_tok_s"].value - engine_tok_s) / engine_tok_s < 0.05
    assert abs(ms["moe_offload_expert_hit_rate"].value - own["hit_rate"]) < 1e-6
