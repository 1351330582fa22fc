"""The ONNX importer's package layout: imports among ``overdrive.engine.onnx``'s modules point one way (no
cycle, TYPE_CHECKING imports included), and the old module paths still import, with a DeprecationWarning."""

from __future__ import annotations

import ast
import pathlib
import sys
import warnings
from types import ModuleType

import pytest

import overdrive.engine.onnx as onnx_pkg

PKG = "overdrive.engine.onnx"
DIR = pathlib.Path(onnx_pkg.__file__).parent
MODULES = sorted(p.stem for p in DIR.glob("*.py"))
# lowest first: a module may import only modules before it (the package's __init__, the facade, comes last)
LAYERS = ["values", "ops", "shape", "layers", "qdq", "rnn", "select", "vision", "dynamic", "integer", "qlinear", "qfused",
          "contrib", "quantize", "importer", "__init__"]
OPERATOR_MODULES = ("ops", "shape", "layers", "qdq", "rnn", "select", "vision", "dynamic")
# standard-domain operators built on an operator module (the integer ops reuse the layers' convolution)
DERIVED_OPERATOR_MODULES = ("integer",)
# the old flat modules, now shims that re-export from the package, and a name each must still give
SHIMS = {"onnx_import": "import_onnx", "onnx_ops": "_OPS", "onnx_qdq": "_quantize", "onnx_values": "_tensor",
         "onnx_quant": "quantize_onnx"}


def _imports(name: str) -> set[str]:
    """Modules of the package that ``name`` imports: absolute (``overdrive.engine.onnx.x``, ``from
    overdrive.engine.onnx import x``) and relative, at any depth (inside functions and ``if TYPE_CHECKING``)."""
    tree = ast.parse((DIR / f"{name}.py").read_text(), filename=f"{name}.py")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .x import y
                assert node.level == 1, f"{name}.py: a relative import reaching outside the package"
                mod = f"{PKG}.{node.module}" if node.module else PKG
            else:
                mod = node.module or ""
            # from the package itself: its submodules by name, anything else from its __init__
            targets = [f"{mod}.{a.name}" for a in node.names] if mod == PKG else [mod]
        else:
            continue
        for t in targets:
            if t == PKG:
                found.add("__init__")
            elif t.startswith(PKG + "."):
                found.add(t[len(PKG) + 1:].split(".")[0])
    found.discard(name)
    return {m if m in MODULES else "__init__" for m in found}  # a non-module name of the package: its __init__


def _graph() -> dict[str, set[str]]:
    return {m: _imports(m) for m in MODULES}


def test_layers_cover_the_package() -> None:
    assert sorted(LAYERS) == MODULES


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, str] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep):], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [m])


def test_imports_point_down_the_layers() -> None:
    graph = _graph()
    for m, deps in graph.items():
        up = {d for d in deps if LAYERS.index(d) >= LAYERS.index(m)}
        assert not up, f"{m}.py imports {sorted(up)}, which sit above it in {LAYERS}"
    assert graph["values"] == set()
    # the operator modules: not each other
    assert all(graph[m] == {"values"} for m in OPERATOR_MODULES)


def test_op_table_holds_every_operator_module() -> None:
    import importlib

    from overdrive.engine.onnx import importer

    tables = [set(importlib.import_module(f"{PKG}.{m}").OPS) for m in (*OPERATOR_MODULES, *DERIVED_OPERATOR_MODULES)]
    assert set(importer._OPS) == set().union(*tables)
    assert sum(len(t) for t in tables) == len(set().union(*tables))  # no op in two modules
    assert importer.SUPPORTED_OPS == tuple(sorted([*set().union(*tables), "Constant", "Split"]))


def test_public_names() -> None:
    for name in onnx_pkg.__all__:
        assert getattr(onnx_pkg, name) is not None


def _fresh_import(old: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``overdrive.engine.<old>`` imported afresh (its body, and so its warning, runs again) by a plain import
    statement's machinery (``__import__``: no Python frame between this file and the module)."""
    full = f"overdrive.engine.{old}"
    monkeypatch.delitem(sys.modules, full, raising=False)  # put back after the test
    __import__(full)
    return sys.modules[full]


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_old_paths_import_and_warn(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    match = rf"overdrive\.engine\.{old} is deprecated; import from overdrive\.engine\.onnx"
    with pytest.warns(DeprecationWarning, match=match) as rec:
        mod = _fresh_import(old, monkeypatch)
    # stacklevel=2: the warning names the line that imported the old path, not the shim
    assert [pathlib.Path(w.filename).name for w in rec] == [pathlib.Path(__file__).name]
    assert getattr(mod, SHIMS[old]) is not None
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_shims_reexport_the_same_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.engine.onnx import importer, ops, qdq, quantize, values

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        shim = {old: _fresh_import(old, monkeypatch) for old in SHIMS}
    assert shim["onnx_import"].import_onnx is importer.import_onnx
    assert shim["onnx_import"].ONNXModule is importer.ONNXModule
    assert shim["onnx_ops"]._OPS is importer._OPS and shim["onnx_ops"].SUPPORTED_OPS == importer.SUPPORTED_OPS
    assert shim["onnx_ops"]._div_np is ops._div_np and shim["onnx_ops"]._quantize is qdq._quantize
    assert shim["onnx_qdq"]._dequantize is qdq._dequantize and shim["onnx_values"]._tensor is values._tensor
    assert shim["onnx_quant"].quantize_onnx is quantize.quantize_onnx


def test_src_and_tests_use_the_new_paths() -> None:
    """No module of src/ or tests/ imports the shims (they are for users' old imports only)."""
    root = DIR.parents[3]  # src/overdrive/engine/onnx -> the repository root
    old = {f"overdrive.engine.{m}" for m in SHIMS}
    bad = []
    for path in [*(root / "src").rglob("*.py"), *(root / "tests").rglob("*.py")]:
        if path.parent == DIR.parent and path.stem in SHIMS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
            else:
                continue
            if names & old:
                bad.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bad, f"imports of the deprecated onnx_* shims: {bad}"
