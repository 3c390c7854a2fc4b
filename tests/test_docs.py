"""Every CLI command and every hook is documented where users look."""

from pathlib import Path

from moe_offload import cli, hooks

ROOT = Path(__file__).resolve().parents[1]


def test_every_cli_command_is_in_the_readme():
    cli._load_commands()
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in cli.cli.commands if f"moe-offload {name}" not in readme]
    assert not missing, f"commands not shown in README.md: {missing}"


def test_every_runner_config_key_is_named_in_the_readme():
    from moe_offload.runconfig import RunConfig

    readme = (ROOT / "README.md").read_text()
    missing = [k for k in RunConfig.keys() if f"`{k}`" not in readme]
    assert not missing, f"ai-rm config keys not documented in README.md: {missing}"


def test_every_hook_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in dir(hooks):
        if name.startswith("moe_offload_"):
            assert name in readme, f"hook {name} not documented in README.md"
