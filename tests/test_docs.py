"""Every CLI command and every hook is documented where users look."""

from pathlib import Path

from moe_offload import cli, hooks

ROOT = Path(__file__).resolve().parents[1]


def test_every_cli_command_is_in_the_readme():
    cli._load_commands()
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in cli.cli.commands if f"moe-offload {name}" not in readme]
    assert not missing, f"commands not shown in README.md: {missing}"


def test_every_runner_config_key_is_named_in_the_airm_doc():
    from moe_offload.airm.config import RunConfig

    doc = (ROOT / "docs/airm.md").read_text()
    missing = [k for k in RunConfig.keys() if f"`{k}`" not in doc]
    assert not missing, f"ai-rm config keys not documented in docs/airm.md: {missing}"


def test_every_hook_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in dir(hooks):
        if name.startswith("moe_offload_"):
            assert name in readme, f"hook {name} not documented in README.md"


def test_family_table_lists_every_family_of_the_installed_transformers():
    # The table is written by scripts/family_table.py from the family tests; a transformers release that adds or
    # drops a MoE family makes it stale, and this says so without running the (minutes-long) family tests.
    import importlib.util

    spec = importlib.util.spec_from_file_location("families", ROOT / "tests/engines/offload/families.py")
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)
    readme = (ROOT / "docs/families.md").read_text()
    table = readme.split("<!-- family-table:begin", 1)[1].split("<!-- family-table:end -->", 1)[0]
    listed = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert listed[1:] == families.experts_families(), "docs/families.md's family table is stale: python scripts/family_table.py"


def test_the_registry_table_lists_every_registered_family_and_its_path():
    from moe_offload.control.families import FAMILIES

    doc = (ROOT / "docs/families.md").read_text()
    table = doc.split("<!-- registry-table:begin -->", 1)[1].split("<!-- registry-table:end -->", 1)[0]
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in table.splitlines() if r.startswith("| ")}
    rows.pop("model_type", None)
    assert set(rows) == set(FAMILIES), set(rows) ^ set(FAMILIES)
    for mt, fam in FAMILIES.items():
        path = {"module": "module", "mla": "fused (MLA)"}.get(fam.attention, "fused")
        assert rows[mt] == path, (mt, rows[mt], path)


def test_readme_is_short_and_no_doc_is_a_diary():
    # the README says what it is, how to start and where things are (the rest lives in docs/, each page one topic)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    long = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if len(p.read_text().splitlines()) > 500]
    assert not long, long


def test_every_doc_link_resolves():
    import re

    broken = []
    for md in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken
