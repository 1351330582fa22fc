"""`import overdrive` stays lean: no optional backend is imported and CUDA is not initialized."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("onnx", "onnxruntime", "torchvision", "transformers", "matplotlib", "tensorrt", "sklearn", "triton")

CODE = """
import json, sys, torch
import overdrive
from overdrive import amp, train  # the foundation's modules, imported eagerly by users
import overdrive.cli.main
print(json.dumps({"heavy": [m for m in %r if m in sys.modules],
                  "cuda_initialized": torch.cuda.is_initialized()}))
""" % (HEAVY,)


def test_import_overdrive_is_lean() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["heavy"] == []
    assert report["cuda_initialized"] is False


def test_lazy_submodule_access() -> None:
    import overdrive

    assert overdrive.amp.Policy is not None
    try:
        overdrive.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")
