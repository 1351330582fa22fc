"""The CLI: --help/--version, env --json schema, and one-line errors with exit codes 2 and 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from overdrive.cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overdrive.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "env" in out and "demo" in out and "Examples" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import overdrive

    assert main(["--version"]) == 0
    assert overdrive.__version__ in capsys.readouterr().out


def test_python_dash_m_overdrive_runs_the_cli() -> None:
    """`python -m overdrive` is the same CLI as the `overdrive` script, exit codes included."""
    import overdrive

    ok = subprocess.run([sys.executable, "-m", "overdrive", "--version"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and overdrive.__version__ in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "overdrive", "no-such-verb"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_env_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"overdrive", "python", "torch", "cpu", "cuda", "gpus", "backends"} <= set(report)
    assert {"available", "version", "driver"} <= set(report["cuda"])
    assert set(report["backends"]) >= {"onnx", "onnxruntime", "tensorrt", "torchvision", "cusparselt", "triton"}
    assert all("available" in b for b in report["backends"].values())
    for gpu in report["gpus"]:
        assert {"name", "compute_capability", "memory_gib", "fp8"} <= set(gpu)


def test_env_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    assert "torch" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["demo", "--opt-level", "O9"], 2, "O9"),
        (["demo", "--epochs", "0"], 2, "--epochs 0"),
        (["demo", "--epochs", "many"], 2, "many"),
        (["demo", "--no-such-flag"], 2, "--no-such-flag"),
        (["demo", "--stage", "warp"], 2, "warp"),
        (["demo", "--dtype", "int3"], 2, "int3"),
        (["no-such-verb"], 2, "no-such-verb"),
        (["demo", "--batch-size", "0"], 2, "--batch-size"),
        (["doctor", "--master-port", "70000"], 2, "--master-port"),
        (["doctor", "--bandwidth", "2", "--ops", "foo"], 2, "--ops foo"),
        (["doctor", "--bandwidth", "2", "--min-bytes", "100", "--max-bytes", "10"], 2, "--min-bytes 100"),
        (["doctor", "--bandwidth", "-1"], 2, "--bandwidth"),
        (["launch", "--rdzv-endpoint", "host:abc", "train.py"], 2, "host:abc"),
        (["launch", "--timeout", "0", "train.py"], 2, "--timeout"),
    ],
)
def test_bad_arguments_one_line_exit_2(args: list[str], code: int, needle: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == code, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and lines[0].startswith("error:")
    assert "Traceback" not in proc.stderr


def test_missing_gpu_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli("demo", "--device", "cuda")
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr and "--device cpu" in proc.stderr


def test_verbose_shows_the_traceback() -> None:
    proc = run_cli("demo", "--opt-level", "O9", "--verbose")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


def test_verbose_after_a_launched_script_belongs_to_the_script() -> None:
    from overdrive.cli.main import _own_args

    args = ["launch", "--nproc-per-node", "2", "train.py", "--verbose", "--lr", "1"]
    assert _own_args(args) == 3  # train.py's --verbose is not overdrive's
    assert _own_args(["demo", "--verbose"]) == 2
    assert _own_args(["--verbose", "launch", "-m", "pkg.train", "--verbose"]) == 3  # -m is launch's flag
    # the script is found by position, not by a .py suffix (a script without one lost its --verbose)
    assert _own_args(["launch", "--nproc-per-node", "2", "--no-check", "train", "--verbose"]) == 4
    assert _own_args(["launch", "--master-port=29501", "train", "--verbose"]) == 2


def test_missing_dependency_error_survives_a_worker_process() -> None:
    # `overdrive data make-dataset --processes 16` without scikit-image: the error raised in a worker is pickled
    # back to the parent; unpickling rebuilt it from its finished message, which was then wrapped a second time
    import pickle

    from overdrive._utils.errors import MissingDependencyError

    err = MissingDependencyError("skimage.data", extra="vision", feature="the sample dataset")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is MissingDependencyError
    assert str(back) == str(err) == ("the sample dataset needs the optional package 'skimage.data', which is not "
                                     "installed; run: pip install -e '.[vision]' in a clone of overdrive")
    assert (back.package, back.extra) == ("skimage.data", "vision")


def test_install_hints_name_what_pip_can_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hint names 'overdrive[...]' (overdrive is not on PyPI: that finds nothing), and the sample dataset's hint
    names its two packages, not the vision extra (whose torchvision replaced a CPU torch with a CUDA one)."""
    import re
    import sys
    from pathlib import Path

    from overdrive._utils.errors import MissingDependencyError
    from overdrive.data import samples

    root = Path(__file__).resolve().parents[2]
    files = [root / "README.md", *(root / "src").rglob("*.py"), *(root / "src").rglob("*.md")]
    bad = [f"{p.relative_to(root)}: {m.group(0)}" for p in files
           for m in re.finditer(r"pip install [^\n`]*overdrive\[", p.read_text(encoding="utf-8"))]
    assert not bad, bad
    # scikit-image missing, also where it is installed (the test extra has it) and already imported: a None entry
    # in sys.modules makes importlib.import_module raise ImportError, as for a package that is not there
    for name in [m for m in sys.modules if m == "skimage" or m.startswith("skimage.")] + ["skimage", "skimage.data"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError, match=r"run: pip install scikit-image pillow$"):
        samples._photos()


def test_launch_nproc_per_node_gpu_without_a_gpu_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the --help example `--nproc-per-node gpu` on a CPU machine ended in torchrun's traceback ("Cuda is not available.")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    proc = run_cli("launch", "--nproc-per-node", "gpu", str(script))
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--nproc-per-node gpu" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "ran" not in proc.stdout


def test_one_json_convention(tmp_path) -> None:
    """Every verb takes ``--json [FILE]``: bare --json prints JSON on stdout, --json FILE writes the file
    (env and doctor took only a flag; build, quantize and exec only a FILE)."""
    import json as _json

    from click.testing import CliRunner

    from overdrive.cli.main import cli

    verb = ["env"]
    res = CliRunner().invoke(cli, [*verb, "--json"])
    assert res.exit_code == 0, res.output
    assert isinstance(_json.loads(res.output), dict)  # JSON alone on stdout, no table
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, [*verb, "--json", str(out)])
    assert res.exit_code == 0 and _json.loads(out.read_text())
    res = CliRunner().invoke(cli, [*verb, "--json", str(tmp_path / "missing" / "r.json")])
    assert res.exit_code != 0 and "does not exist" in str(res.exception)


def test_every_verb_has_the_same_json_option() -> None:
    import click

    from overdrive.cli.main import cli

    seen = {}
    for name in cli.list_commands(None):  # type: ignore[arg-type]
        cmd = cli.get_command(None, name)  # type: ignore[arg-type]
        cmds = cmd.commands.values() if isinstance(cmd, click.Group) else [cmd]
        for c in cmds:
            for p in c.params:
                if "--json" in getattr(p, "opts", []):
                    seen[f"{name} {c.name}"] = (p.is_flag, p.flag_value, p.metavar)
    assert len(seen) >= 9, seen
    assert set(seen.values()) == {(False, "-", "[FILE]")}, seen


def test_an_unexpected_error_with_a_cpp_stack_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An Inductor engine given an out-of-range token id raised a RuntimeError whose message carried 20 lines of C++
    frames, all printed after ``error:``. The message is now cut at the stack."""
    import overdrive.cli.env as env_verb
    from overdrive.cli.main import main

    msg = ("index out of bounds: 0 <= tmp12 < 50L\nException raised from cpp_fused_0 at kernel.cpp:32 (most recent "
           "call first):\nframe #0: c10::Error::Error(...)\nframe #1: c10::detail::torchCheckFail(...)")

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError(msg)

    monkeypatch.setattr(env_verb.command, "callback", boom)
    assert main(["env"]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == ["error: RuntimeError: index out of bounds: 0 <= tmp12 < 50L  (run with --verbose for the "
                     "traceback)"]
