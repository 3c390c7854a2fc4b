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
    from moe_offload.airm.config import RunConfig

    readme = (ROOT / "README.md").read_text()
    missing = [k for k in RunConfig.keys() if f"`{k}`" not in readme]
    assert not missing, f"ai-rm config keys not documented in README.md: {missing}"


def test_every_hook_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in dir(hooks):
        if name.startswith("moe_offload_"):
            assert name in readme, f"hook {name} not documented in README.md"


def test_readme_family_table_lists_every_family_of_the_installed_transformers():
    # The table is written by scripts/family_table.py from the family tests; a transformers release that adds or
    # drops a MoE family makes it stale, and this says so without running the (minutes-long) family tests.
    import importlib.util

    spec = importlib.util.spec_from_file_location("families", ROOT / "tests/engines/offload/families.py")
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- family-table:begin", 1)[1].split("<!-- family-table:end -->", 1)[0]
    listed = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert listed[1:] == families.experts_families(), "README family table is stale: python scripts/family_table.py"
