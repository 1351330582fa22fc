"""The library's imports point one way:
``_utils`` <- ``amp``, ``quant``, ``data`` <- ``sparsity``, ``engine``, ``distributed`` <- ``train``, ``apex`` <- ``recipes``
<- ``demo`` <- ``cli``. Checked on the source (every import statement, module level or inside a function;
``if TYPE_CHECKING:`` blocks, which never run, are left out), so that a technique package can never again
import the demo, the recipes or the CLI. Deprecated aliases of moved names live in modules named
``_deprecated.py``, which nothing in the library imports and which this check leaves out."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "overdrive"
RANK = {"_utils": 0, "amp": 1, "quant": 1, "data": 1, "sparsity": 2, "engine": 2, "distributed": 2, "train": 3, "apex": 3,
        "recipes": 4, "demo": 5, "cli": 6}
# siblings of one rank that may import each other: none
SIBLINGS: set[tuple[str, str]] = set()


def _package(path: Path) -> str | None:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else None  # overdrive/__init__.py, __main__.py: the top, may import anything


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.append((child.lineno, child.module))
            visit(child)

    visit(tree)
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        pkg = _package(path)
        if pkg is None or path.name == "_deprecated.py":
            continue
        assert pkg in RANK, f"{path}: package {pkg!r} has no place in the layering; add it to RANK"
        for line, mod in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            parts = mod.split(".")
            if parts[0] != "overdrive" or len(parts) < 2 or parts[1] == pkg:
                continue
            target = parts[1]
            if target not in RANK:  # overdrive.__version__ and the like, from the top package
                continue
            if RANK[target] > RANK[pkg] or (RANK[target] == RANK[pkg] and (pkg, target) not in SIBLINGS):
                bad.append(f"{path.relative_to(SRC.parent)}:{line}: {pkg} imports {mod}")
    return bad


def test_imports_point_one_way() -> None:
    bad = violations()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The checker itself: an import of the demo from quant, inside a function, is found."""
    tree = ast.parse("def f():\n    from overdrive.demo.data import load_digits\n")
    assert _imports(tree) == [(2, "overdrive.demo.data")]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from overdrive.train import Trainer\n")
    assert _imports(tree) == [(1, "typing")]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_cycles() -> list[list[str]]:
    """Cycles among the modules of one package (every import statement but TYPE_CHECKING ones, as above;
    a package's ``__init__`` re-exporting its modules is left out: importing a submodule runs it anyway)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name in ("_deprecated.py", "__init__.py"):
            continue
        me = _module_name(path)
        pkg = me.rsplit(".", 1)[0]
        deps = set()
        for _, mod in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if mod.startswith(pkg + ".") and mod != me and mod.count(".") == me.count("."):
                deps.add(mod)
        graph[me] = deps
    cycles, state = [], {}

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt in graph and not state.get(nxt):
                dfs(nxt, stack)
        stack.pop()
        state[node] = 2

    for n in sorted(graph):
        if not state.get(n):
            dfs(n, [])
    return cycles


def test_no_import_cycles_inside_packages() -> None:
    cycles = module_cycles()
    assert not cycles, "modules that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)
