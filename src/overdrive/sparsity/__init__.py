"""2:4 structured sparsity (ASP): prune, fine-tune with masks kept, permute channels, export.

Native API (no global state, several models per process):
    >>> import torch
    >>> from overdrive import sparsity
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    >>> handle = sparsity.sparsify(model, sparsity.SparsityConfig(pattern="2:4"))
    >>> opt = torch.optim.AdamW(model.parameters()); _ = handle.attach(opt)
    >>> round(handle.report().weight_fraction_pruned, 2)
    0.49

apex surface: ``from overdrive.sparsity import ASP; ASP.prune_trained_model(model, optimizer)``.
``Config`` is the deprecated old name of ``SparsityConfig``.
"""

from typing import Any

from overdrive.sparsity.api import from_pruned, sparsify
from overdrive.sparsity.asp import ASP
from overdrive.sparsity.config import (ASP_DEFAULT, MASK_CALCULATORS, PERMUTED, PRESETS, TRANSPOSABLE, SparsityConfig,
                                       _deprecated_config)
from overdrive.sparsity.export import compress, decompress, load_compressed, save_compressed, to_semi_structured
from overdrive.sparsity.handle import SparseHandle
from overdrive.sparsity.layers import shape_rule
from overdrive.sparsity.masks import compute_mask, is_2to4, m4n2_1d, m4n2_2d_best, m4n2_2d_greedy, retained_magnitude
from overdrive.sparsity.pruned import PrunedLayer
from overdrive.sparsity.quantized import onnx_weight_sparsity, sparse_quantize
from overdrive.sparsity.report import SparsityReport

__all__ = [
    # native
    "SparsityConfig", "PRESETS", "ASP_DEFAULT", "TRANSPOSABLE", "PERMUTED", "MASK_CALCULATORS",
    "sparsify", "from_pruned", "SparseHandle", "PrunedLayer", "SparsityReport",
    # masks
    "compute_mask", "m4n2_1d", "m4n2_2d_greedy", "m4n2_2d_best", "is_2to4", "retained_magnitude", "shape_rule",
    # with quantization
    "sparse_quantize", "onnx_weight_sparsity",
    # export
    "save_compressed", "load_compressed", "compress", "decompress", "to_semi_structured",
    # apex-compatible
    "ASP",
]


def __getattr__(name: str) -> Any:
    # not in __all__: ``from overdrive.sparsity import *`` must not warn
    if name == "Config":
        return _deprecated_config("overdrive.sparsity.Config")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
