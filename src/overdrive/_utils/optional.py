"""Probe and import optional backends lazily, with errors that name the pip extra."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from overdrive._utils.errors import MissingDependencyError


def is_available(package: str) -> bool:
    """True when ``package`` can be imported here, without importing it.

    Example:
        >>> is_available("torch")
        True
    """
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, extra: str | None = None, feature: str = "this feature", pip: str | None = None) -> ModuleType:
    """Import ``package`` or raise :class:`MissingDependencyError` naming the extra to install.

    Example:
        >>> np = require("numpy")
    """
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise MissingDependencyError(package, extra, feature, pip) from exc


def hf_conv1d_class() -> type | None:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections: a Linear whose weight is stored (in, out)) when
    transformers is already imported, else None. A model holding a Conv1D has imported it, so this never imports
    transformers itself (``import overdrive`` stays lean).

    Example:
        >>> cls = hf_conv1d_class(); cls is None or cls.__name__ == "Conv1D"
        True
    """
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
