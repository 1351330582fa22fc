"""Scripts written for NVIDIA apex, ModelOpt and pytorch-quantization, each with only its import lines changed to
overdrive's (issue 20's promise), run as programs. The count of those that run is in README.md.

Every script under ``scripts/`` opens with a header of ``# key: value`` lines:

- ``source``: the public usage pattern it follows (which docs, example or repository, and which calls);
- ``library``: the libraries it was written for; ``group``: ``amp`` / ``asp`` / ``quant`` (the 13 / 8 / 4 split);
- ``xfail`` (optional): why it does not run with the imports changed, and how to port it; the test is then
  ``xfail(strict=True)``, so a script that starts working must have its header and README row updated;
  ``raises`` (optional, with ``xfail``): the exception it fails with, so it fails for the stated reason only;
- ``count: extra`` (optional): run and reported, but not one of the 25;
- ``device`` (optional): how the script stays device-agnostic where the original called ``.cuda()``.

Each script runs in-process (fast: torch is imported once) with ``runpy.run_path(..., run_name="__main__")``, a
fresh module namespace, in its own temporary directory, with ``sys.argv`` set to the script alone and the
process-wide state a script may leave behind (environment variables, ``quant_modules.initialize``, the
pytorch-quantization class defaults, a torch.distributed process group, objects kept alive only by reference
cycles) put back afterwards. The scripts end with their own assertions.
"""

from __future__ import annotations

import ast
import builtins
import gc
import os
import re
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from overdrive import UsageError

SCRIPTS_DIR = Path(__file__).parent / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.py"))
README = Path(__file__).parent / "README.md"
SPLIT = {"amp": 13, "asp": 8, "quant": 4}
# the modules whose import lines a port replaces
ORIGINAL = re.compile(r"^(apex|modelopt|pytorch_quantization|amp_C|apex_C)(\.|$)")
_HEADER = re.compile(r"^# (source|library|group|xfail|raises|count|device): (.+)$")


@dataclass(frozen=True)
class Header:
    source: str
    library: str
    group: str
    xfail: str | None = None
    raises: str | None = None
    count: str | None = None
    device: str | None = None

    @property
    def counted(self) -> bool:
        return self.count != "extra"


def read_header(path: Path) -> Header:
    """The leading ``# key: value`` lines of a script."""
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = _HEADER.match(line)
        if not match:
            break
        fields[match.group(1)] = match.group(2).strip()
    missing = {"source", "library", "group"} - fields.keys()
    if missing:
        raise AssertionError(f"{path.name}: header lacks {sorted(missing)} (see tests/ports/test_scripts.py)")
    return Header(**fields)


def _exception(name: str) -> type[BaseException]:
    return UsageError if name == "UsageError" else getattr(builtins, name)


def _params() -> list[object]:
    out = []
    for path in SCRIPTS:
        h = read_header(path)
        marks = []
        if h.xfail:
            raises = _exception(h.raises) if h.raises else None
            marks.append(pytest.mark.xfail(strict=True, reason=h.xfail, raises=raises))
        out.append(pytest.param(path, id=path.stem, marks=marks))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in the script, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh working directory and argv, and the process-wide state a script may change, restored after."""
    from overdrive.amp import functions as amp_functions
    from overdrive.quant.pytorch_quantization import nn as quant_nn
    from overdrive.quant.pytorch_quantization import quant_modules

    layer_classes = [getattr(quant_nn, n) for n in quant_nn.__all__ if n != "TensorQuantizer"]
    defaults = {c: (c.__dict__.get("default_quant_desc_input"), c.__dict__.get("default_quant_desc_weight"))
                for c in layer_classes}
    environ = dict(os.environ)
    registered = dict(amp_functions.TORCH_REGISTERED)  # amp.register_*_function(torch, ...) lasts for the process
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [])
    gc.collect()  # the previous script's models, optimizers and their amp/ASP entries
    yield
    quant_modules.deactivate()
    amp_functions.TORCH_REGISTERED.clear()
    amp_functions.TORCH_REGISTERED.update(registered)
    for c, (din, dw) in defaults.items():
        for attr, value in (("default_quant_desc_input", din), ("default_quant_desc_weight", dw)):
            if value is None:
                c.__dict__.get(attr) is not None and delattr(c, attr)
            else:
                setattr(c, attr, value)
    import torch.distributed as dist

    gc.collect()  # the script's DDP model goes before its process group (gloo's teardown hung now and then after it)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    gc.collect()


@pytest.mark.parametrize("script", _params())
def test_script_runs_with_only_its_imports_changed(script: Path, isolated: None) -> None:
    sys.argv[:] = [str(script)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except BaseException as e:
        # pytest keeps the traceback for the report, and the failed script's frames hold its models (in their
        # locals, and in the script's globals for code at module level): drop both, or the next script would see
        # this one's amp and ASP entries still alive
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(script):
                tb.tb_frame.f_globals.clear()
            tb = tb.tb_next
        traceback.clear_frames(e.__traceback__)
        raise


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_header_and_changed_imports(script: Path) -> None:
    h = read_header(script)
    assert h.group in SPLIT, f"{script.name}: group {h.group!r} is not one of {sorted(SPLIT)}"
    assert len(h.source) > 40, f"{script.name}: the source line should name the docs/example and the calls used"
    assert h.raises is None or h.xfail, f"{script.name}: 'raises' goes with 'xfail'"
    assert h.count in (None, "extra")
    prefix = {"amp": "apex_", "asp": "asp_", "quant": ("modelopt_", "pytorch_quantization_")}[h.group]
    assert script.name.removeprefix("extra_").startswith(prefix), f"{script.name}: name it by library and pattern"
    lines = script.read_text().splitlines()
    changed = 0
    for lineno, module in _imports(script):
        above = lines[lineno - 2].strip() if lineno >= 2 else ""
        if module.split(".")[0] == "overdrive":
            # every overdrive import replaces an original one, written in the comment right above it
            assert above.startswith("# was: "), f"{script.name}:{lineno}: no '# was:' comment above {module}"
            was = above.removeprefix("# was: ")
            assert ORIGINAL.match(was.split()[1]), f"{script.name}:{lineno}: '# was: {was}' is not an original import"
            changed += 1
        elif ORIGINAL.match(module):
            # an original import kept as it was: only where overdrive has no module to import instead (xfail)
            assert h.xfail, f"{script.name}:{lineno}: still imports {module}"
    assert changed, f"{script.name}: no import line was changed"


def test_the_25_patterns_keep_the_split() -> None:
    groups = [read_header(p).group for p in SCRIPTS if read_header(p).counted]
    assert {g: groups.count(g) for g in SPLIT} == SPLIT and len(groups) == 25


def test_readme_lists_every_script_and_the_count() -> None:
    text = README.read_text()
    counted = [p for p in SCRIPTS if read_header(p).counted]
    for p in SCRIPTS:
        assert f"`{p.name}`" in text, f"README.md has no row for {p.name}"
        row = next(line for line in text.splitlines() if line.startswith(f"| `{p.name}`"))
        runs = row.strip().strip("|").split("|")[3].strip()  # script | source | library | runs | why
        assert runs.startswith("**no**" if read_header(p).xfail else "yes"), f"README.md row of {p.name}: {runs!r}"
    runs = sum(not read_header(p).xfail for p in counted)
    assert f"**{runs} of 25**" in text, f"README.md should state **{runs} of 25**"
