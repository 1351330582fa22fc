"""Quantized module swaps (Linear, Conv1d/2d/3d, ConvTranspose2d) and the residual-add quantizer.

Each quantized layer keeps the original parameters (same tensors, so an optimizer built before the
swap still trains them) and adds ``input_quantizer`` and ``weight_quantizer``. ``QuantAdd`` holds
the quantizer for the residual input of ``a + b``; :func:`insert_residual_quantizers` puts it in
place with torch.fx (forward code cannot be seen by a module swap).
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.nn.functional as F
from torch import nn

from overdrive.quant.config import QuantConfig
from overdrive.quant.quantizer import TensorQuantizer


class _QuantMixin:
    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer
    weight_axis = 0

    @classmethod
    def from_float(cls, mod: nn.Module, config: QuantConfig) -> nn.Module:
        """Swap the class of ``mod`` (sharing its parameters and hooks) and add the two quantizers."""
        new = cls.__new__(cls)
        new.__dict__.update(mod.__dict__)
        new._modules = dict(mod._modules)
        new.input_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)
        new.weight_quantizer = TensorQuantizer(config.weight, axis=cls.weight_axis, num_bins=config.num_bins)
        return new

    def to_float(self) -> nn.Module:
        """The plain float layer (same parameters), quantizers dropped."""
        base = type(self).__mro__[2]  # (QuantX, _QuantMixin, nn.X, ...)
        new = base.__new__(base)
        new.__dict__.update(self.__dict__)
        new._modules = {k: v for k, v in self._modules.items() if k not in ("input_quantizer", "weight_quantizer")}
        return new


class QuantLinear(_QuantMixin, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias)


class QuantConv1d(_QuantMixin, nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias)


class QuantConv2d(_QuantMixin, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias)


class QuantConv3d(_QuantMixin, nn.Conv3d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias)


class QuantConvTranspose2d(_QuantMixin, nn.ConvTranspose2d):
    weight_axis = 1  # weight is (C_in, C_out / groups, kH, kW): output channels on axis 1

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2,
                                              self.dilation)
        return F.conv_transpose2d(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias, self.stride,
                                  self.padding, output_padding, self.groups, self.dilation)


QUANT_MODULES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: QuantLinear, nn.Conv1d: QuantConv1d, nn.Conv2d: QuantConv2d, nn.Conv3d: QuantConv3d,
    nn.ConvTranspose2d: QuantConvTranspose2d,
}


class QuantAdd(nn.Module):
    """``a + b`` with a quantizer on the residual input ``b`` (TensorRT fuses the add into the conv
    producing ``a`` when ``b`` arrives quantized).

    Example:
        >>> from overdrive.quant.config import INT8_DEFAULT
        >>> add = QuantAdd(INT8_DEFAULT)
        >>> add.residual_quantizer.enabled = False
        >>> add(torch.ones(2), torch.ones(2)).tolist()
        [2.0, 2.0]
    """

    def __init__(self, config: QuantConfig, residual_first: bool = False) -> None:
        super().__init__()
        self.residual_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)
        self.residual_first = residual_first  # True: the residual is the first operand (b + a in source)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.residual_first:
            return self.residual_quantizer(a) + b
        return a + self.residual_quantizer(b)


class _OwnCodeTracer(torch.fx.Tracer):
    """Traces only a module's own forward code: every submodule is a leaf."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


def _is_tensor_add(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add)
            and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args) and not node.kwargs)


def _has_none_defaults(module: nn.Module) -> bool:
    """True when ``module.forward`` has a parameter whose default is None (an optional input)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is None for p in params)


def insert_residual_quantizers(module: nn.Module, config: QuantConfig, prefix: str = "") -> tuple[nn.Module, list[str], list[str]]:
    """Rewrite tensor ``a + b`` adds in forward code into :class:`QuantAdd` modules with torch.fx.

    Each module's own forward is traced with its submodules as leaves, so only modules that add
    tensors themselves are replaced (by a GraphModule with the same class name, submodules and
    parameter names); a module that cannot be traced (data-dependent control flow) keeps its adds
    unquantized and is reported. The residual operand is the one not produced by a submodule call
    (``x + self.conv2(...)``: ``x``); when both are, the second operand.
    Returns (module, names of QuantAdds inserted, names of modules with adds that could not be traced).
    """
    added: list[str] = []
    untraced: list[str] = []
    for name, child in list(module.named_children()):
        if isinstance(child, (QuantAdd, TensorQuantizer)) or type(child) in QUANT_MODULES.values():
            continue
        new, a, u = insert_residual_quantizers(child, config, f"{prefix}{name}.")
        if new is not child:
            setattr(module, name, new)
        added += a
        untraced += u
    if type(module).forward is nn.Module.forward or type(module).__module__.startswith("torch.nn"):
        return module, added, untraced  # containers and torch.nn layers do no residual adds themselves
    try:
        if _has_none_defaults(module):
            # fx makes every argument a Proxy, so `if arg is None:` branches are silently traced as
            # "not None" and the graph then fails when the default None is used (BERT's embeddings:
            # embedding(None)); such a forward cannot be captured faithfully by one trace
            raise TypeError("forward has arguments defaulting to None")
        graph = _OwnCodeTracer().trace(module)
    except Exception:  # noqa: BLE001 - data-dependent control flow etc.: leave this module as it is
        try:
            src = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            src = ""
        if " + " in src or "+=" in src or "torch.add" in src:
            untraced.append(prefix.rstrip(".") or "<root>")
        return module, added, untraced
    adds = [n for n in graph.nodes if _is_tensor_add(n)]
    if not adds:
        return module, added, untraced
    gm = torch.fx.GraphModule(module, graph, class_name=type(module).__name__)
    for i, node in enumerate(adds):
        a, b = node.args
        residual_first = a.op != "call_module" and b.op == "call_module"
        qname = f"residual_add{i}"
        gm.add_submodule(qname, QuantAdd(config, residual_first=residual_first))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(qname, (a, b))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        added.append(prefix + qname)
    gm.graph.lint()
    gm.recompile()
    gm.train(module.training)
    return gm, added, untraced
