"""settings.py is the only reader of the environment, and declares every MOE_OFFLOAD_* name the project uses.

Why these could fail: a module that reads os.environ itself (a new switch nobody can find), a MOE_OFFLOAD_* name
used in code, a script, the chart or a doc but not declared, a third code-path switch, a setting missing from
docs/settings.md, or a value that parses silently into something else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_offload import settings
from moe_offload.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("src", "engines", "plugins", "contracts")
# docs/benchmarks/ is history: a dated run may name a variable of its day
EVERYWHERE = PACKAGE + ("bench", "scripts", "tests", "helm", "docs", "Makefile", "README.md", ".ci")
HISTORY = ("docs/benchmarks",)
NAME = re.compile(r"MOE_OFFLOAD_[A-Z0-9_]*[A-Z0-9]")
# an environment read: os.environ.get(..), os.getenv(..), os.environ[..] not assigned to, `in os.environ`
READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=[^=])|in os\.environ\b")
# reads that are not settings: the child PATH a kernel build extends
ALLOWED_READS = {("engines/offload/kernels/jit.py", 'os.environ.get("PATH", "")')}


def _files(roots):
    for r in roots:
        p = ROOT / r
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from (f for f in p.rglob("*") if f.is_file() and f.suffix in (".py", ".sh", ".md", ".yaml", ".tpl", "")
                        and "__pycache__" not in f.parts and ".egg-info" not in str(f))


def test_no_module_but_settings_reads_the_environment():
    found = []
    for f in _files(PACKAGE):
        if f.suffix != ".py" or f == ROOT / "src/moe_offload/settings.py":
            continue
        rel = str(f.relative_to(ROOT))
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in READ.finditer(line):
                if not any(rel == a and frag in line for a, frag in ALLOWED_READS):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "read these through moe_offload.settings:\n" + "\n".join(found)


def test_every_name_used_anywhere_is_declared():
    used = {}
    for f in _files(EVERYWHERE):
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if str(f.relative_to(ROOT)).startswith(HISTORY):
            continue
        for name in NAME.findall(text):
            used.setdefault(name, str(f.relative_to(ROOT)))
    undeclared = {n: where for n, where in used.items() if n not in settings.SETTINGS}
    assert not undeclared, f"declare these in src/moe_offload/settings.py: {undeclared}"


def test_at_most_three_code_path_switches():
    switches = [s.name for s in settings.DECLARED if s.switch]
    assert switches == ["MOE_OFFLOAD_KERNELS", "MOE_OFFLOAD_GRAPH", "MOE_OFFLOAD_HUGEPAGES"]


def test_every_setting_is_documented_for_users():
    doc = (ROOT / "docs/settings.md").read_text(encoding="utf-8")
    missing = [s.name for s in settings.DECLARED if f"`{s.name}`" not in doc]
    assert not missing, missing


def test_defaults_parse_and_resolve_under_the_cache_dir(monkeypatch, tmp_path):
    for s in settings.DECLARED:
        monkeypatch.delenv(s.name, raising=False)
    monkeypatch.setenv("MOE_OFFLOAD_CACHE_DIR", str(tmp_path))
    assert settings.get("MOE_OFFLOAD_STORE_DIR") == tmp_path / "stores"
    assert settings.get("TORCH_EXTENSIONS_DIR") == tmp_path / "kernels"
    assert settings.get("MOE_OFFLOAD_HUGEPAGES") is True and settings.get("MOE_OFFLOAD_KERNELS") == ""
    assert settings.get("MOE_OFFLOAD_SWITCH_INTERVAL") == 0.0005
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "big-disk"))
    assert settings.get("MOE_OFFLOAD_STORE_DIR") == tmp_path / "big-disk"
    monkeypatch.setenv("MOE_OFFLOAD_HUGEPAGES", " Off ")
    assert settings.get("MOE_OFFLOAD_HUGEPAGES") is False
    monkeypatch.setenv("MOE_OFFLOAD_KERNELS", "avx2")
    assert settings.kernels_isa() == "avx2" and not settings.kernels_off()
    monkeypatch.setenv("MOE_OFFLOAD_KERNELS", "0")
    assert settings.kernels_off() and settings.kernels_isa() == ""


@pytest.mark.parametrize("name, value, says", [
    ("MOE_OFFLOAD_HUGEPAGES", "maybe", "1/0"),
    ("MOE_OFFLOAD_KERNELS", "avx9000", "avx2"),
    ("MOE_OFFLOAD_SWITCH_INTERVAL", "fast", "a number"),
    ("MOE_OFFLOAD_LOG", "loud", "warning"),
])
def test_a_value_that_does_not_parse_is_a_config_error(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"\\${name}=.*{re.escape(says)}"):
        settings.get(name)


def test_undeclared_names_cannot_be_read():
    with pytest.raises(KeyError):
        settings.get("MOE_OFFLOAD_" + "FAST_DECODE")  # a switch that was removed
