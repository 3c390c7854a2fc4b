"""The CLI: commands listed and documented, JSON output, one-line errors, fast start without torch."""

import json
import subprocess
import sys

import pytest

from moe_offload import cli


def run(args, capsys):
    code = cli.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_every_command_with_a_line(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for name, command in cli.cli.commands.items():
        assert name in out
        assert (command.help or "").strip(), f"command {name} has no help"


def test_backends_json(capsys):
    code, out, _ = run(["backends", "--json"], capsys)
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert {"mock", "cpu", "cuda", "rngd"} <= set(rows)
    assert rows["mock"]["available"] and rows["cpu"]["available"]
    assert not rows["rngd"]["available"] and rows["rngd"]["reason"]


def test_selftest_passes(capsys):
    code, out, _ = run(["selftest"], capsys)
    assert code == 0, out
    assert out.count("PASS") >= 3 and "FAIL" not in out


def test_selftest_reports_failure(capsys, monkeypatch):
    from moe_offload import selftest

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(selftest, "CHECKS", selftest.CHECKS + [("broken", broken)])
    code, out, _ = run(["selftest"], capsys)
    assert code == 1
    assert "FAIL broken" in out and "boom" in out


def test_selftest_fails_its_kernels_line_without_the_kernels(capsys, monkeypatch):
    # a run without the compiled kernels is several times slower: selftest says so with a FAIL, not a PASS
    from moe_offload.engines.offload.kernels import jit

    monkeypatch.setattr(jit, "load", lambda: False)
    monkeypatch.setattr(jit, "info", lambda: {"ok": False, "error": "RuntimeError: no compiler here"})
    code, out, _ = run(["selftest"], capsys)
    assert code == 1
    line = next(x for x in out.splitlines() if "kernels" in x)
    assert line.startswith("FAIL kernels") and "no compiler here" in line and "transformers' modules" in line


def test_version(capsys):
    code, out, _ = run(["version"], capsys)
    assert code == 0 and "protocol 0.1" in out


def test_errors_are_one_line_without_traceback(capsys):
    code, _, err = run(["no-such-command"], capsys)
    assert code == 2 and "No such command" in err


def test_import_does_not_load_torch():
    code = "import sys, moe_offload, moe_offload.cli, moe_offload.backends; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_does_not_load_torch():
    code = (
        "import sys; from moe_offload import cli\n"
        "try:\n    cli.main(['--help'])\nfinally:\n    assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("args", [["backends", "--bogus"]])
def test_usage_errors_exit_2(args, capsys):
    code, _, err = run(args, capsys)
    assert code == 2 and "Traceback" not in err
