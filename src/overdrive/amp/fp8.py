"""fp8 training of Linear layers behind the amp opt levels: choose the layers, swap them, explain the choice.

The fp8 GEMMs, the dynamic scaling and the autograd rules come from torchao's float8 training
(``torchao.float8.convert_to_float8_training``, installed by the ``fp8`` extra); this module decides
which layers it converts (the :class:`~overdrive.amp.config.Fp8` rule), swaps them in place before
the O-level casts the model (so O2's fp32 masters, loss scaling and the load hooks see the same
Parameter objects), and says when fp8 layers run outside ``torch.compile``, where they are slower
than bf16. A converted layer's ``state_dict`` has nn.Linear's keys (``weight``, ``bias``), so
checkpoints move freely between fp8 and non-fp8 models.

Example:
    >>> from torch import nn
    >>> from overdrive.amp.config import Fp8
    >>> model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    >>> [(c.name, c.fp8) for c in plan(model, Fp8())]
    [('0', True), ('2', False)]
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from overdrive._utils.optional import is_available as _importable
from overdrive._utils.optional import require
from overdrive._utils.table import Table
from overdrive.amp.config import FP8_ALIGN, Fp8

TORCHAO_MIN = (0, 10)
COMPILE_WARNING = (
    "overdrive.amp: fp8 layers are running outside torch.compile; eager fp8 casts are separate kernels and "
    "train slower than bf16, so compile the model after amp.initialize/prepare (model = torch.compile(model))"
)

# model -> the Fp8 rule that converted it, for summary(model). Weak keys: a dropped model is forgotten.
_RULES: weakref.WeakKeyDictionary[nn.Module, Fp8] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LayerChoice:
    """One Linear layer and whether it trains in fp8 (``why`` says why, or why not)."""

    name: str
    in_features: int
    out_features: int
    fp8: bool
    why: str


def is_available() -> bool:
    """True when torchao (the fp8 training machinery) can be imported here, without importing it.

    Example:
        >>> isinstance(is_available(), bool)
        True
    """
    return _importable("torchao")


@contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """torchao logs a warning per optional C++ kernel library it cannot load (its CUDA-only MX and CUTLASS
    kernels on a CPU build); float8 training needs none of them. Only torchao's own logger is quieted,
    for the import only."""
    # and torch's pytree logger warns once about a deprecated registration torchao makes on newer torch
    logs = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _torchao() -> ModuleType:
    with _quiet_torchao_import():
        ao = require("torchao", extra="fp8", feature="fp8 training (amp.Fp8 / fp8=...)")
        from torchao import float8  # noqa: F401  (the float8 training API)
    version = tuple(int(x) for x in ao.__version__.split("+")[0].split(".")[:2] if x.isdigit())
    if version < TORCHAO_MIN:
        from overdrive._utils.errors import MissingDependencyError

        raise MissingDependencyError("torchao>=0.10", "fp8", f"fp8 training (torchao {ao.__version__} is too old)")
    return ao


def torchao_config(fp8: Fp8, fsdp_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``fp8``'s recipe, emulated when asked; ``fsdp_all_gather`` (tensorwise
    only) makes FSDP2 all-gather the weights already cast to fp8, half the bytes of bf16."""
    _torchao()
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(fp8.recipe), emulate=fp8.emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather)


def _fp8_linear_type() -> type | None:
    """torchao's Float8Linear when torchao is already imported (never imports it)."""
    import sys

    mod = sys.modules.get("torchao.float8.float8_linear")
    return getattr(mod, "Float8Linear", None) if mod is not None else None


def _recipe_of(module: nn.Module) -> str:
    """'tensorwise' or 'rowwise' from a Float8Linear's config."""
    gran = getattr(getattr(module.config, "cast_config_input", None), "scaling_granularity", None)
    return "rowwise" if "AXISWISE" in str(gran).upper() else "tensorwise"


def plan(model: nn.Module, fp8: Fp8) -> list[LayerChoice]:
    """Every Linear layer of ``model`` (in ``named_modules`` order) with the rule's choice for it.

    Only plain ``nn.Linear`` layers are converted: a subclass has its own forward (and MultiheadAttention
    calls its ``out_proj``'s weight directly, never its forward), and the model itself is converted only
    when it is a container (a bare Linear cannot be swapped in place; wrap it in a Module).
    """
    f8 = _fp8_linear_type()
    out: list[LayerChoice] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        shape = (mod.in_features, mod.out_features)
        if f8 is not None and isinstance(mod, f8):
            out.append(LayerChoice(name, *shape, True, f"fp8 ({_recipe_of(mod)})"))
        elif type(mod) is not nn.Linear:
            out.append(LayerChoice(name, *shape, False, f"{type(mod).__name__} is an nn.Linear subclass with its own "
                                                        "forward"))
        elif name == "":
            out.append(LayerChoice(name, *shape, False,
                                   "the model itself is a Linear (wrap it in a Module to swap it)"))
        else:
            out.append(LayerChoice(name, *shape, *fp8.chooses(name, *shape)))
    return out


def convert(model: nn.Module, fp8: Fp8, fsdp_all_gather: bool = False) -> list[LayerChoice]:
    """Swap the Linear layers ``fp8`` chooses for torchao's Float8Linear, in place; returns the plan.

    The swapped layers keep the original Parameter objects (an optimizer built before still steps
    them). torchao's conversion also applies its process-wide inductor work-around for a Triton fp8
    store miscompile (a numerically identical min/max codegen), once per process. ``fsdp_all_gather``
    (before ``fully_shard``, tensorwise recipe): the weights travel in fp8 (see :func:`torchao_config`).
    """
    choices = plan(model, fp8)
    f8 = _fp8_linear_type()
    todo = {c.name for c in choices if c.fp8 and not (f8 is not None and isinstance(model.get_submodule(c.name), f8))}
    if todo:
        _torchao()
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=torchao_config(fp8, fsdp_all_gather),
                                   module_filter_fn=lambda _mod, fqn: fqn in todo)
    _RULES[model] = fp8
    return choices


def precompute_fsdp_scales(model: nn.Module) -> bool:
    """After an optimizer step under FSDP2 with fp8 all-gather: every fp8 weight's scale from one all-reduce of
    amaxes (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) instead of one per weight at the next forward.
    Returns whether there was anything to do (no fp8 all-gather layers: nothing, and torchao is not imported)."""
    if not any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False) for m in fp8_modules(model)):
        return False
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
    return True


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that train in fp8 (torchao Float8Linear)."""
    f8 = _fp8_linear_type()
    return [] if f8 is None else [m for m in model.modules() if isinstance(m, f8)]


def check_rows(modules: list[nn.Module]) -> list[Any]:
    """Forward pre-hooks on fp8 layers that refuse, in one line, a training batch whose token count (all input dims
    but the last) is not a multiple of 16: the weight-gradient GEMM's inner dim is that count, and fp8 GEMMs need
    multiples of 16 (torch._scaled_mm failed deep in the backward before). Returns the hook handles."""
    from overdrive._utils.errors import UsageError

    def hook(module: nn.Module, args: Any) -> None:
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and module.training and torch.is_grad_enabled()) or x.dim() == 0:
            return
        rows = x.numel() // max(1, x.shape[-1])
        if rows % FP8_ALIGN:
            raise UsageError(f"an fp8 layer ({module.in_features}x{module.out_features}) got {rows} tokens "
                             f"(input shape {tuple(x.shape)}); fp8 training needs a multiple of {FP8_ALIGN} tokens "
                             "per step (its weight-gradient GEMM runs over them): use a batch x sequence that is, or "
                             "exclude the layer (amp.Fp8(exclude=...))")

    return [m.register_forward_pre_hook(hook) for m in modules]


class CompileCheck:
    """Warns once (one line) when an fp8 layer's first training forward runs outside torch.compile.

    A forward pre-hook on each fp8 layer: under torch.compile the hook is traced as a no-op; in eager
    mode the first training forward (train mode, grad enabled) warns and removes every hook, so the
    check costs nothing after it. Layers compiled block by block count as compiled.
    """

    def __init__(self, modules: list[nn.Module], warn: bool = True) -> None:
        self.warn = warn
        self.warned = False
        self._handles = [m.register_forward_pre_hook(self) for m in modules]

    def __call__(self, module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation may run eagerly; training speed is what the warning is about
        self.remove()
        if self.warn:
            self.warned = True
            warnings.warn(COMPILE_WARNING, UserWarning, stacklevel=2)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's OptimizedModule and DistributedDataParallel wrappers (any nesting)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def summary(model: nn.Module, fp8: Fp8 | str | None = None) -> Table:
    """Which Linear layers of ``model`` train in fp8, and why the others do not.

    After ``amp.initialize(..., fp8=...)`` / ``amp.prepare`` the rule the model was prepared with is
    used; pass ``fp8`` to preview a rule on a model not yet prepared. The notes give the count and
    the share of the Linear layers' multiply-adds (in x out per token) that runs in fp8.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 10))
        >>> t = summary(model, "tensorwise")
        >>> [row[:2] + row[3:4] for row in t.rows]
        [['0', '4096x4096', 'fp8'], ['1', '4096x10', 'float32']]
        >>> t.notes[0]
        '1 of 2 Linear layers train in fp8 (tensorwise), 99.8% of their multiply-adds'
    """
    from overdrive.amp.config import parse_fp8

    model = _unwrapped(model)  # torch.compile / DDP wrap the prepared model: its rule is keyed on the model itself
    rule = parse_fp8(fp8) if fp8 is not None else _RULES.get(model)
    prepared = rule is not None and fp8 is None
    rule = rule or Fp8()
    choices = plan(model, rule)
    table = Table(f"fp8 layers ({rule.recipe}, min_features {rule.min_features})",
                  ["layer", "shape (in x out)", "MACs/token", "trains in", "why"], stage="amp")
    for c in choices:
        mod = model.get_submodule(c.name)
        dtype = "fp8" if c.fp8 else str(mod.weight.dtype).removeprefix("torch.")
        table.rows.append([c.name or "(model)", f"{c.in_features}x{c.out_features}", c.in_features * c.out_features,
                           dtype, c.why])
    total = sum(c.in_features * c.out_features for c in choices)
    fp8_macs = sum(c.in_features * c.out_features for c in choices if c.fp8)
    share = 100 * fp8_macs / total if total else 0.0
    n = sum(c.fp8 for c in choices)
    table.notes.append(f"{n} of {len(choices)} Linear layers train in fp8 ({rule.recipe}), {share:.1f}% of their "
                       "multiply-adds")
    if not prepared:
        converted = len(fp8_modules(model))
        table.notes.append("a preview of the rule: the model is not converted yet" if converted == 0 else
                           f"{converted} layer(s) are already converted")
    if rule.emulate:
        table.notes.append("emulated: the fp8 casts run, the GEMMs run in fp32 (for checking numerics, not speed)")
    return table
