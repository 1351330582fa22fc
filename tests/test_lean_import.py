"""Importing overdrive or any technique stays lean: no optional backend is imported and CUDA is not initialized."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("onnx", "onnxruntime", "torchvision", "transformers", "matplotlib", "tensorrt", "sklearn", "triton", "PIL",
         "tokenizers", "skimage")

# What users import eagerly, per technique: none of it may pull an optional backend or initialize CUDA.
IMPORTS = {
    "foundation": "import overdrive\nfrom overdrive import amp, train\nimport overdrive.cli.main",
    "engine": "import overdrive.engine, overdrive.engine.api, overdrive.engine.benchmark",
    "quant": "from overdrive import quant",
    "sparsity": "import overdrive.sparsity",
    "data": "import overdrive.data\nfrom overdrive.data import ImageLoader, tokenize",
}

CODE = """
import json, sys, torch
%s
print(json.dumps({"heavy": [m for m in %r if m in sys.modules],
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


@pytest.mark.parametrize("what", sorted(IMPORTS))
def test_import_is_lean(what: str) -> None:
    out = subprocess.run([sys.executable, "-c", CODE % (IMPORTS[what], HEAVY)], capture_output=True, text=True,
                         check=True).stdout
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
