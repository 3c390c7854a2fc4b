"""The ai-rm runner's decode KPI runs, through the registry and the CLI."""

import pytest

from moe_offload import cli
from moe_offload.airm.power import parse_furiosa_smi, parse_nvidia_smi
from rm_core import ContractError, Workload, registry


@pytest.fixture
def runner():
    return registry.load("airm.workloads", "npu-offload")


def test_decode_on_mock_measures_the_engine(runner):
    ms = runner(Workload("decode"), mock=True, mock_ms=2, mock_hit=0.5, max_new=6, repeat=2)
    by = {m.name: m for m in ms}
    assert set(by) >= {"airm_tok_s", "airm_tpot_p50_ms", "airm_tpot_p90_ms", "moe_offload_expert_hit_rate"}
    # The mock sleeps 2 ms per decode step, so the measured time per token cannot be below it.
    assert by["airm_tpot_p50_ms"].value >= 2.0
    assert by["airm_tpot_p90_ms"].value >= by["airm_tpot_p50_ms"].value
    assert by["airm_tok_s"].value <= 1000 / 2.0
    assert abs(by["moe_offload_expert_hit_rate"].value - 0.5) < 0.01
    assert by["airm_tok_s"].labels["backend"] == "mock"
    assert "airm_power_w" not in by  # the mock has no card to read power from: absent, not zero


@pytest.mark.parametrize("config, field", [({"prompt": ""}, "config.prompt"), ({"max_new": 5000}, "config.max_new")])
def test_a_decode_the_engine_refuses_is_a_contract_error(runner, config, field):
    # The engine's own check (empty prompt, beyond the context) used to leave as moe_offload's ConfigError.
    with pytest.raises(ContractError) as err:
        runner(Workload("decode"), mock=True, mock_ms=0, **config)
    assert err.value.field == field


def test_workload_must_be_a_workload(runner):
    with pytest.raises(ContractError, match="workload"):
        runner({"kind": "decode"})


def test_cli_prints_metric_lines(capsys):
    code = cli.main(["airm", "--kind", "decode", "mock=true", "mock_ms=1", "max_new=4"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("--metric ")]
    assert {line.split("=")[0] for line in lines} >= {"--metric airm_tok_s", "--metric airm_tpot_p50_ms"}


def test_cli_bad_config_is_one_line(capsys):
    code = cli.main(["airm", "--kind", "decode", "kv_transport=x"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "kv_transport" in err


def test_power_parsers():
    assert parse_nvidia_smi("0, 71.5\n1, [N/A]\n") == {"0": 71.5}
    table = "| RNGD | npu0   | 1.7.0, 4dfed1852e7b | 40.98°C |  38 W | 0000:03:00.0 |\n"
    assert parse_furiosa_smi(table) == {"npu0": 38.0}
