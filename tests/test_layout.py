"""The tree's shape, checked: the control plane stays pure, no import circle, modules stay small.

The import graph is read from the sources (every import statement, including the lazy ones inside functions),
so a circle that only closes at run time fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# where each import name lives in the tree (pyproject's package-dir)
PACKAGES = {"moe_offload.engines": ROOT / "engines", "moe_offload.plugins": ROOT / "plugins",
            "rm_core": ROOT / "contracts" / "rm_core", "moe_offload": ROOT / "src" / "moe_offload"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((pkg, *parts[:-1])) if parts[-1] == "__init__" else ".".join((pkg, *parts))
            found.setdefault(name, path)  # moe_offload.engines lives in engines/, not src/moe_offload/engines
    return found


MODULES = _modules()


def _nodes(tree: ast.AST):
    """Every node, but not the bodies of ``if TYPE_CHECKING:`` (annotations only: nothing runs them)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(name: str, path: Path) -> set[str]:
    """Project modules ``name`` imports anywhere in its body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # import a.b.c where only a.b is ours: a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _edges_without_parents(name: str) -> set[str]:
    # Importing a submodule runs its packages' __init__; a package re-exporting its own submodule is not a circle.
    return {t for t in GRAPH[name] if not name.startswith(t + ".")}


def test_the_graph_is_read():
    # The checks below are vacuous if the scan finds nothing: the known edges must be there.
    assert "moe_offload.control.vocab" in GRAPH["moe_offload.control.spec"]
    assert "moe_offload.engines.offload.experts.executor" in GRAPH["moe_offload.engines.offload.loading.loader"]


def test_control_plane_imports_no_torch_and_no_engine():
    for name, path in MODULES.items():
        if not name.startswith("moe_offload.control"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert not roots & {"torch", "transformers"}, f"{name} imports {sorted(roots & {'torch', 'transformers'})}"
        engines = sorted(t for t in GRAPH[name] if t.startswith(("moe_offload.engines", "moe_offload.plugins",
                                                                  "moe_offload.serving", "moe_offload.backends")))
        assert not engines, f"{name} reaches out of the control plane: {engines}"


def test_no_import_circle():
    # Tarjan's strongly connected components over the module graph: any component of two or more is a circle.
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v, counter=[0]):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in _edges_without_parents(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = MODULES[name].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)}: {lines} lines (split it by what it holds)"


# The kernels' front door: the compiled ops are reached through kernels/ops.py; only the kernels' own modules (the
# build in jit.py, the wiring in dispatch.py and gemm.py) sit beside it. Comments and docstrings may name the ops.
KERNELS = ROOT / "engines" / "offload" / "kernels"


def _code_mentions(path: Path, needle: str) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sorted({n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n) == needle})


@pytest.mark.parametrize("needle", ["torch.ops.moe_offload", "torch.classes.moe_offload"])
def test_the_kernels_are_called_through_ops_py(needle):
    outside = {str(p.relative_to(ROOT)): lines for p in MODULES.values() if KERNELS not in p.parents
               and (lines := _code_mentions(p, needle))}
    assert not outside, f"{needle} called outside kernels/ (use kernels/ops.py): {outside}"
    inside = {p.name for p in KERNELS.glob("*.py") if _code_mentions(p, needle)}
    assert inside <= {"ops.py", "jit.py"}, inside
