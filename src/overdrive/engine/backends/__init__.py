"""Engine backends, one module each. Each module provides::

    NAME: str
    unavailable(device) -> str | None          # None when usable here, else why not
    build(src, example, cfg, device) -> (sections: dict[str, bytes], runner, meta: dict)
    load(sections, header, device, trusted, native_ok) -> runner   # runner(*tensors) -> list[torch.Tensor]

``trusted`` is False for an engine not signed with the user's key (and not loaded with --trust): the backend
then loads nothing that can run code (no native library, no unpickling cache); ``native_ok`` is False when
the engine was built on a CPU of another kind, whose native code may not run here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from overdrive._utils.errors import UsageError

NAMES = ("inductor", "onnxruntime", "tensorrt")


def get(name: str) -> ModuleType:
    if name not in NAMES:
        raise UsageError(f"backend {name!r} is not one of {', '.join(NAMES)}")
    return importlib.import_module(f"overdrive.engine.backends.{name}")
