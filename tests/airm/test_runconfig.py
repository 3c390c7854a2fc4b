"""The runner's config: typed keys, JSON-string values, ContractError for everything else."""

import pytest

from moe_offload.airm.config import RunConfig
from rm_core import ContractError


def test_json_strings_are_coerced():
    cfg = RunConfig.parse({"port": "8123", "priors": '{"latin-prose": 0.9}', "env": '{"A": "1"}', "mock": "true", "mock_ms": "2.5"})
    assert cfg.port == 8123 and cfg.priors == {"latin-prose": 0.9} and cfg.env == {"A": "1"}
    assert cfg.mock is True and cfg.mock_ms == 2.5 and cfg.backend_name == "mock"


def test_gateway_defaults_from_environment(monkeypatch):
    monkeypatch.setenv("LLMD_GATEWAY_URL", "http://gw:8080")
    assert RunConfig.parse({}).gateway == "http://gw:8080"
    assert RunConfig.parse({"gateway": ""}).gateway == ""


@pytest.mark.parametrize(
    "config, field",
    [
        ({"kv_transport": "x"}, "config.kv_transport"),
        ({"colour": "red"}, "config.colour"),
        ({"priors": "{bad"}, "config.priors"),
        ({"priors": '{"latin-prose": 1.5}'}, "config.priors[latin-prose]"),
        ({"priors": '{"latin": 0.9}'}, "config.priors[latin]"),  # not a class: it would seed nothing, silently
        ({"host": ""}, "config.host"),  # uvicorn would bind every interface, not the documented 127.0.0.1
        ({"log": "verbose"}, "config.log"),
        ({"role": "gateway", "metrics_port": 9090}, "config.metrics_port"),  # the gateway serves /metrics itself
        ({"port": "eighty"}, "config.port"),
        ({"port": 70000}, "config.port"),
        ({"backend": "tpu"}, "config.backend"),
        ({"role": "router"}, "config.role"),
        ({"max_new": 0}, "config.max_new"),
        ({"env": '{"A": 1}'}, "config.env[A]"),
        ({"mock_hit": 2}, "config.mock_hit"),
        ({"host_memory": "lots"}, "config.host_memory"),
        ({"kv_cache_memory": "2 parsecs"}, "config.kv_cache_memory"),
        ({"kv_cache_dtype": "fp4"}, "config.kv_cache_dtype"),
    ],
)
def test_bad_config(config, field):
    with pytest.raises(ContractError) as err:
        RunConfig.parse(config)
    assert err.value.field == field


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ContractError) as err:
        RunConfig.parse({"bogus": 1})
    for key in ("backend", "model", "placement", "kv_transport", "block"):
        assert key in str(err.value)


def test_host_memory_reaches_the_engine_options():
    from moe_offload.airm.build import engine_options

    cfg = RunConfig.parse({"backend": "cpu", "host_memory": "6GiB"})
    assert engine_options(cfg)["host_memory"] == 6 * 2**30
    assert "kv_cache_dtype" not in engine_options(cfg)  # the model dtype unless asked
    assert engine_options(RunConfig.parse({"backend": "cpu", "kv_cache_dtype": "fp8"}))["kv_cache_dtype"] == "fp8"


def test_devices_and_ranks_reach_the_engine_and_the_tiers():
    from moe_offload.airm.build import build, engine_options
    from moe_offload.log import get_logger

    cfg = RunConfig.parse({"backend": "cpu", "devices": "cpu,cpu", "tensor_parallel": 1, "fraction": 0.5})
    opts = engine_options(cfg)
    assert opts["devices"] == "cpu,cpu" and opts["tensor_parallel"] == 1
    _, engine, tiers, _ = build(cfg, get_logger("test"))
    try:
        assert [t.name for t in tiers if t.accelerator] == ["cpu:0", "cpu:1"]
        assert engine.executor.device_tiers == ("cpu:0", "cpu:1")
    finally:
        engine.close()
    for bad, field in (({"devices": "cpu,tpu"}, "config.devices"), ({"tensor_parallel": 0}, "config.tensor_parallel")):
        with pytest.raises(ContractError) as err:
            RunConfig.parse(bad)
        assert err.value.field == field
