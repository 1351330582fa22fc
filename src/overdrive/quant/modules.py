"""Quantized module swaps (Linear, Conv1d/2d/3d, ConvTranspose2d), the residual-add quantizer and
the attention-matmul quantizers.

Each quantized layer keeps the original parameters (same tensors, so an optimizer built before the
swap still trains them) and adds ``input_quantizer`` and ``weight_quantizer``. ``QuantAdd`` holds
the quantizer for the residual input of ``a + b``; ``QuantMatmul`` the quantizers of both operands
of an activation-by-activation matmul (QK^T, PV); ``QuantSDPA`` those of q, k, v of
``F.scaled_dot_product_attention``. :func:`insert_graph_quantizers` puts them in place with
torch.fx (forward code cannot be seen by a module swap).
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


class QuantMatmul(nn.Module):
    """``a @ b`` (``torch.matmul`` / ``torch.bmm`` / ``Tensor.matmul``) between two activations, each
    operand through its own per-tensor quantizer (TensorRT's rule: Q/DQ on both BMM inputs).

    Example:
        >>> from overdrive.quant.config import INT8_DEFAULT
        >>> mm = QuantMatmul(INT8_DEFAULT)
        >>> mm.input_quantizer.set_amax(torch.tensor(1.0)); mm.other_quantizer.set_amax(torch.tensor(1.0))
        >>> mm(torch.ones(1, 2), torch.ones(2, 1)).tolist()
        [[2.0]]
    """

    def __init__(self, config: QuantConfig, op: str = "matmul") -> None:
        super().__init__()
        if op not in ("matmul", "bmm"):
            raise ValueError(f"QuantMatmul op {op!r} must be 'matmul' or 'bmm'")
        self.op = op
        self.input_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)
        self.other_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        fn = torch.bmm if self.op == "bmm" else torch.matmul
        return fn(self.input_quantizer(a), self.other_quantizer(b))

    def extra_repr(self) -> str:
        return f"op={self.op}"


class QuantSDPA(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, ...)`` with per-tensor quantizers on q, k and v (the
    inputs of its two BMMs that exist outside the fused kernel; the softmax output P stays float).
    Other arguments (mask, dropout_p, is_causal, scale) pass through unchanged.
    """

    def __init__(self, config: QuantConfig) -> None:
        super().__init__()
        self.q_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)
        self.k_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)
        self.v_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object,
                **kwargs: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q_quantizer(q), self.k_quantizer(k), self.v_quantizer(v),
                                              *args, **kwargs)


GRAPH_QUANT_MODULES = (QuantAdd, QuantMatmul, QuantSDPA)
"""Modules inserted by torch.fx into forward code (not swaps of a float layer)."""


class _OwnCodeTracer(torch.fx.Tracer):
    """Traces only a module's own forward code: every submodule is a leaf."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


def _is_tensor_add(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add)
            and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args) and not node.kwargs)


_MATMUL_FUNCS = {torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "bmm"}
_MATMUL_METHODS = {"matmul": "matmul", "bmm": "bmm"}


def _depends_on_inputs(node: torch.fx.Node) -> bool:
    """True when ``node`` is computed from a forward argument (an activation), not only from attributes."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder" or n.op == "call_module":  # a submodule's output is an activation too
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def _matmul_op(node: torch.fx.Node) -> str | None:
    """'matmul' / 'bmm' when ``node`` multiplies two activations (not a parameter/buffer), else None."""
    if node.kwargs or len(node.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    if not all(_depends_on_inputs(a) for a in node.args):  # x @ self.weight.t(): a weight matmul, not attention
        return None
    if node.op == "call_function":
        return _MATMUL_FUNCS.get(node.target)  # type: ignore[call-overload]
    if node.op == "call_method":
        return _MATMUL_METHODS.get(node.target)  # type: ignore[call-overload]
    return None


def _is_sdpa(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is F.scaled_dot_product_attention and len(node.args) >= 3
            and all(isinstance(a, torch.fx.Node) for a in node.args[:3]))


def _has_none_defaults(module: nn.Module) -> bool:
    """True when ``module.forward`` has a parameter whose default is None (an optional input)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is None for p in params)


def insert_graph_quantizers(module: nn.Module, config: QuantConfig, prefix: str = "") -> tuple[nn.Module, list[str], list[str]]:
    """Rewrite tensor ``a + b`` adds in forward code into :class:`QuantAdd` modules (``config.residual_add``)
    and activation matmuls / SDPA into :class:`QuantMatmul` / :class:`QuantSDPA` (``config.quantize_matmuls``)
    with torch.fx.

    Each module's own forward is traced with its submodules as leaves, so only modules that add
    tensors themselves are replaced (by a GraphModule with the same class name, submodules and
    parameter names); a module that cannot be traced (data-dependent control flow) keeps its adds
    (and matmuls) unquantized and is reported. The residual operand is the one not produced by a submodule call
    (``x + self.conv2(...)``: ``x``); when both are, the second operand.
    Returns (module, names of modules inserted, names of modules with adds/matmuls that could not be traced).
    """
    added: list[str] = []
    untraced: list[str] = []
    for name, child in list(module.named_children()):
        if isinstance(child, (*GRAPH_QUANT_MODULES, TensorQuantizer)) or type(child) in QUANT_MODULES.values():
            continue
        new, a, u = insert_graph_quantizers(child, config, f"{prefix}{name}.")
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
        adds = config.residual_add and (" + " in src or "+=" in src or "torch.add" in src)
        mms = config.quantize_matmuls and any(t in src for t in (" @ ", "matmul", "bmm", "scaled_dot_product"))
        if adds or mms:
            untraced.append(prefix.rstrip(".") or "<root>")
        return module, added, untraced
    adds = [n for n in graph.nodes if _is_tensor_add(n)] if config.residual_add else []
    mms = [n for n in graph.nodes if _matmul_op(n) or _is_sdpa(n)] if config.quantize_matmuls else []
    if not adds and not mms:
        return module, added, untraced
    gm = torch.fx.GraphModule(module, graph, class_name=type(module).__name__)
    # adds first: their residual operand is chosen from the original graph, as with matmuls off
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
    for i, node in enumerate(mms):
        op = _matmul_op(node)
        qname = f"matmul{i}" if op else f"sdpa{i}"
        gm.add_submodule(qname, QuantMatmul(config, op) if op else QuantSDPA(config))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(qname, node.args, dict(node.kwargs))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        added.append(prefix + qname)
    gm.graph.lint()
    gm.recompile()
    gm.train(module.training)
    return gm, added, untraced


insert_residual_quantizers = insert_graph_quantizers  # the name before matmuls were covered
