"""Write docs/families.md's supported-family table from the results of tests/engines/offload/test_families.py.

    python scripts/family_table.py                   # run the family tests (a few minutes), then rewrite the table
    python scripts/family_table.py --results F.json  # from a results file written by an earlier run
    python scripts/family_table.py --check           # exit 1 if the doc's table differs from what the results give

The tests write their results when MOE_OFFLOAD_FAMILY_RESULTS names a file; the table sits in docs/families.md between
the BEGIN and END markers below, and nothing else in it is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- family-table:begin (scripts/family_table.py writes this table; do not edit by hand) -->"
END = "<!-- family-table:end -->"
# transformers model_type -> the GGUF architecture that loads as it (control/gguf_meta.ARCHS, inverted)
GGUF = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss",
        "glm4_moe": "glm4moe", "mixtral": "llama"}


def run_tests(out: Path) -> int:
    env = dict(os.environ, MOE_OFFLOAD_FAMILY_RESULTS=str(out))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", str(ROOT / "tests/engines/offload/test_families.py")]
    return subprocess.call(cmd, cwd=ROOT, env=env)


def _spec_cell(r: dict) -> str:
    if "spec_params" not in r:
        return "-"
    dev = (r["spec_params"] - r["transformers_params"]) / r["transformers_params"]
    cell = "exact" if abs(dev) < 5e-4 else f"{dev * 100:+.1f} %"
    notes = [n.split(":")[0] for n in r.get("spec_estimated", [])]
    return cell + (f" ({'; '.join(notes)} estimated)" if notes else "")


def table(payload: dict) -> str:
    results, skipped = payload["results"], payload["not_generative"]
    lines = [
        f"Generated from `tests/engines/offload/test_families.py` with transformers {payload['transformers']}: every family "
        "whose modeling file uses the experts interface, as a tiny random checkpoint; greedy tokens of the engine "
        "at `--fraction 0.25` against transformers' `generate`, fp32. *spec* compares `moe-offload spec`'s "
        "parameter count of the tiny config with transformers' (tiny widths magnify what it only estimates). "
        "*GGUF*: the llama.cpp architecture whose GGUF files load as this family, experts kept in the file's "
        "block types (tests/engines/offload/loading/test_gguf.py).",
        "",
        "| family | loaded as | layer kinds | MoE layers | static | lru | KV cache | spec | GGUF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in payload["families"]:
        gguf = GGUF.get(fam, "")
        if fam in skipped:
            lines.append(f"| {fam} | out of scope: {skipped[fam]} | | | | | | | {gguf} |")
            continue
        r = results.get(fam)
        if r is None or "cls" not in r:
            lines.append(f"| {fam} | not run | | | | | | | {gguf} |")
            continue
        ok = {p: "match" if r.get(p) else ("**differs**" if p in r else "not run") for p in ("static", "lru")}
        moe = f"{len(r['moe_layers'])} of {r['layers']}"
        lines.append(f"| {fam} | {r['cls']} | {', '.join(r['layer_kinds'])} | {moe} | {ok['static']} | {ok['lru']} "
                     f"| {r.get('cache', '-')} | {_spec_cell(r)} | {gguf} |")
    return "\n".join(lines)


def replace(readme: str, body: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"docs/families.md has no family table markers ({BEGIN!r} ... {END!r})")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, help="results JSON of an earlier run (default: run the tests now)")
    ap.add_argument("--readme", type=Path, default=ROOT / "docs" / "families.md")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when the doc's table is stale")
    args = ap.parse_args(argv)
    results = args.results
    if results is None:
        results = Path(tempfile.mkdtemp(prefix="families-")) / "results.json"
        rc = run_tests(results)
        if not results.is_file():
            print(f"error: the family tests wrote no results (pytest exit {rc})", file=sys.stderr)
            return 1
    payload = json.loads(results.read_text(encoding="utf-8"))
    readme = args.readme.read_text(encoding="utf-8")
    new = replace(readme, table(payload))
    if args.check:
        if new != readme:
            print(f"{args.readme}: the family table is stale; run python scripts/family_table.py", file=sys.stderr)
            return 1
        return 0
    args.readme.write_text(new, encoding="utf-8")
    print(f"{args.readme}: family table written ({len(payload['families'])} families)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
