"""Quantized module swaps (Linear, Conv1d/2d/3d, ConvTranspose2d, Hugging Face's GPT-2 ``Conv1D``), the
residual-add quantizer and the attention-matmul quantizers.

Each quantized layer keeps the original parameters (same tensors, so an optimizer built before the
swap still trains them) and adds ``input_quantizer`` and ``weight_quantizer``. ``QuantAdd`` holds
the quantizer for the residual input of ``a + b``; ``QuantMatmul`` the quantizers of both operands
of an activation-by-activation matmul (QK^T, PV); ``QuantSDPA`` those of q, k, v of
``F.scaled_dot_product_attention``. :func:`insert_graph_quantizers` puts them in place with
torch.fx (forward code cannot be seen by a module swap).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import linecache
import operator
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import hf_conv1d_class
from overdrive.quant.config import QuantConfig
from overdrive.quant.quantizer import TensorQuantizer


def grouped_transpose_reason(mod: nn.Module, config: QuantConfig) -> str | None:
    """Why ``mod`` cannot get per-output-channel weight scales (a ConvTranspose with groups > 1), else None.

    A ConvTranspose weight is (C_in, C_out / groups, kH, kW): output channel ``g * C_out/groups + j``
    is the slice ``weight[g * C_in/groups:(g + 1) * C_in/groups, j]``. Per-channel scales along axis 1
    would give C_out / groups scales, each shared by the j-th channel of every group (one scale for
    the whole layer when depthwise), and ONNX DequantizeLinear's per-axis form (one scale per slice
    of one axis) cannot express one scale per output channel. torch.ao refuses this case too.

    Example:
        >>> from overdrive.quant.config import INT8_DEFAULT
        >>> grouped_transpose_reason(nn.ConvTranspose2d(4, 4, 2, groups=2), INT8_DEFAULT) is not None
        True
    """
    if not (isinstance(mod, nn.ConvTranspose2d) and mod.groups > 1):
        return None
    if not (config.weight.per_channel and config.weight.enabled):
        return None
    return (f"ConvTranspose2d with groups={mod.groups}: per-output-channel weight scales cannot be expressed "
            f"(its weight is (C_in, C_out/groups, kH, kW) = {tuple(mod.weight.shape)}, and ONNX "
            "DequantizeLinear takes one scale per slice of one axis); to quantize it, "
            "use per-tensor weights: QuantConfig(weight=QuantizerConfig(per_channel=False, narrow_range=True))")


def name_selected(name: str, config: QuantConfig) -> bool:
    """True when the dotted ``name`` matches one of ``config.include`` and none of ``config.exclude``."""
    return (any(fnmatch.fnmatch(name, p) for p in config.include)
            and not any(fnmatch.fnmatch(name, p) for p in config.exclude))


class _QuantMixin:
    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer
    weight_axis = 0  # output channels of the weight (per-channel scales)
    in_axis = 1  # input channels of the weight (SmoothQuant's factors)

    @classmethod
    def from_float(cls, mod: nn.Module, config: QuantConfig) -> nn.Module:
        """Swap the class of ``mod`` (sharing its parameters and hooks) and add the two quantizers."""
        reason = grouped_transpose_reason(mod, config)
        if reason is not None:
            raise UsageError(f"cannot quantize this layer: {reason}")
        new = cls.__new__(cls)
        new.__dict__.update(mod.__dict__)
        new._modules = dict(mod._modules)
        new.input_quantizer = TensorQuantizer(config.input, num_bins=config.num_bins, histogram=True)
        new.weight_quantizer = TensorQuantizer(config.weight, axis=cls.weight_axis, num_bins=config.num_bins,
                                               pre_quant_axis=cls.in_axis)
        return new

    def to_float(self) -> nn.Module:
        """The plain float layer (same parameters), quantizers dropped."""
        # the float class in the MRO: (QuantX, _QuantMixin, nn.X, ...), also for subclasses of QuantX
        base = next(b for b in type(self).__mro__ if not issubclass(b, _QuantMixin))
        new = base.__new__(base)
        new.__dict__.update(self.__dict__)
        new._modules = {k: v for k, v in self._modules.items() if k not in ("input_quantizer", "weight_quantizer")}
        return new

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        rename_legacy_quantizer_keys(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]


def rename_legacy_quantizer_keys(state_dict: dict, prefix: str) -> None:
    """A pytorch-quantization checkpoint names a layer's quantizers ``_input_quantizer`` / ``_weight_quantizer``
    (``conv1._input_quantizer._amax``): rename them to this package's ``input_quantizer`` / ``weight_quantizer``
    in ``state_dict`` (the quantizer itself takes ``_amax``, in the keep-dims shape)."""
    for old in ("_input_quantizer.", "_weight_quantizer."):
        for key in [k for k in state_dict if k.startswith(prefix + old)]:
            state_dict[prefix + old[1:] + key[len(prefix + old):]] = state_dict.pop(key)


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
    # weight is (C_in, C_out / groups, kH, kW): output channels on axis 1 when groups == 1 (per-channel
    # weights with groups > 1 are refused in from_float, see grouped_transpose_reason)
    weight_axis = 1
    in_axis = 0

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2,
                                              self.dilation)
        return F.conv_transpose2d(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias, self.stride,
                                  self.padding, output_padding, self.groups, self.dilation)


class QuantConvTranspose1d(_QuantMixin, nn.ConvTranspose1d):
    """ConvTranspose1d with quantized input and weight (weight (C_in, C_out / groups, kW): output channels on
    axis 1). Built directly (pytorch-quantization's ``quant_nn.QuantConvTranspose1d``); ``quantize`` does not
    swap ConvTranspose1d.

    Example:
        >>> from overdrive.quant.config import INT8_DEFAULT
        >>> layer = QuantConvTranspose1d.from_float(nn.ConvTranspose1d(4, 2, 3), INT8_DEFAULT)
        >>> layer.weight_quantizer.axis
        1
    """

    weight_axis = 1
    in_axis = 0

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 1,
                                              self.dilation)
        return F.conv_transpose1d(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias, self.stride,
                                  self.padding, output_padding, self.groups, self.dilation)


class QuantConvTranspose3d(_QuantMixin, nn.ConvTranspose3d):
    """ConvTranspose3d with quantized input and weight (output channels on axis 1 of the weight), built directly
    as :class:`QuantConvTranspose1d`; ``quantize`` does not swap ConvTranspose3d."""

    weight_axis = 1
    in_axis = 0

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 3,
                                              self.dilation)
        return F.conv_transpose3d(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias, self.stride,
                                  self.padding, output_padding, self.groups, self.dilation)


QUANT_MODULES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: QuantLinear, nn.Conv1d: QuantConv1d, nn.Conv2d: QuantConv2d, nn.Conv3d: QuantConv3d,
    nn.ConvTranspose2d: QuantConvTranspose2d,
}
"""The torch.nn layers quantize swaps; Hugging Face's ``Conv1D`` is found by :func:`quant_class`."""


@functools.cache
def _quant_hf_conv1d(base: type[nn.Module]) -> type[nn.Module]:
    """The quantized class of Hugging Face's ``Conv1D`` (made once per Conv1D class; a subclass of it, so
    ``isinstance(m, Conv1D)`` still holds for transformers' own code such as ``_init_weights``)."""

    class QuantConv1D(_QuantMixin, base):  # type: ignore[misc, valid-type]
        """GPT-2's ``Conv1D``: a Linear whose weight is stored transposed, (in, out) = (nx, nf), computed as
        ``addmm(bias, x, weight)``. Per-channel weight scales are per output channel: axis 1."""

        weight_axis = 1
        in_axis = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            size_out = x.size()[:-1] + (self.nf,)
            x2 = self.input_quantizer(x).reshape(-1, x.size(-1))  # (B*T, nx)
            # in ONNX: Gemm with DequantizeLinear(axis=1) on its (nx, nf) weight input
            return torch.addmm(self.bias, x2, self.weight_quantizer(self.weight)).view(size_out)  # (B, T, nf)

    QuantConv1D.__module__, QuantConv1D.__qualname__ = __name__, "QuantConv1D"  # pickled as modules.QuantConv1D
    return QuantConv1D


def quant_class(mod: nn.Module) -> type[nn.Module] | None:
    """The quantized class ``quantize`` swaps ``mod`` to (exact type match; subclasses are not swapped), or None.

    Example:
        >>> quant_class(nn.Linear(2, 2)).__name__, quant_class(nn.ReLU())
        ('QuantLinear', None)
    """
    cls = QUANT_MODULES.get(type(mod))
    if cls is not None:
        return cls
    conv1d = hf_conv1d_class()
    if conv1d is not None and type(mod) is conv1d:
        return _quant_hf_conv1d(conv1d)
    return None


def __getattr__(name: str) -> type[nn.Module]:
    # overdrive.quant.modules.QuantConv1D, made on first use (it subclasses transformers' Conv1D), so that
    # pickle finds the class of a quantized Conv1D by name
    if name == "QuantConv1D":
        conv1d = hf_conv1d_class()
        if conv1d is None:
            import transformers.pytorch_utils  # noqa: F401 - explicitly asked for: needs transformers

            conv1d = hf_conv1d_class()
        if conv1d is not None:
            return _quant_hf_conv1d(conv1d)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            # an add of numbers that tracing could not tell from a tensor add (e.g. sizes returned by
            # a helper function): there is nothing to quantize, so it stays a plain add
            return a + b
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


# Tensor methods and attributes whose value is a Python number, bool or torch.Size (shape arithmetic).
_NON_TENSOR_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride",
                                 "element_size", "storage_offset", "get_device", "is_contiguous",
                                 "is_floating_point", "is_complex"})
_NON_TENSOR_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"})
# Operators that give a number when all their operands are numbers (x.size(1) + 4, n * 2, ...).
_ARITHMETIC = frozenset({operator.add, operator.iadd, operator.sub, operator.isub, operator.mul, operator.imul,
                         operator.floordiv, operator.ifloordiv, operator.truediv, operator.itruediv, operator.mod,
                         operator.pow, operator.neg, abs, max, min})


def _is_non_tensor(node: torch.fx.Node) -> bool:
    """True when ``node`` certainly computes a Python number / torch.Size, not a tensor
    (``x.size(1)``, ``x.shape[1]``, ``x.size(1) + self.prefix.size(1)``). Unknown nodes count as tensors."""
    if node.op == "call_method":
        return node.target in _NON_TENSOR_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _NON_TENSOR_ATTRS
    if node.target is operator.getitem:  # indexing a torch.Size gives an int; indexing a tensor a tensor
        return isinstance(node.args[0], torch.fx.Node) and _is_non_tensor(node.args[0])
    if node.target in _ARITHMETIC:
        operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
        return bool(operands) and all(_is_non_tensor(a) for a in operands)
    return False


def _is_tensor_add(node: torch.fx.Node) -> bool:
    """``a + b`` / ``a += b`` / ``torch.add(a, b)`` of two traced values that are not shape arithmetic."""
    return (node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add)
            and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args) and not node.kwargs
            and not any(_is_non_tensor(a) for a in node.args))


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


def insert_graph_quantizers(module: nn.Module, config: QuantConfig, prefix: str = "",
                            left_out: list[str] | None = None) -> tuple[nn.Module, list[str], list[str]]:
    """Rewrite tensor ``a + b`` adds in forward code into :class:`QuantAdd` modules (``config.residual_add``)
    and activation matmuls / SDPA into :class:`QuantMatmul` / :class:`QuantSDPA` (``config.quantize_matmuls``)
    with torch.fx.

    Each module's own forward is traced with its submodules as leaves, so only modules that add
    tensors themselves are replaced: by an object of a subclass of their own class whose forward
    is the rewritten graph (see :func:`_with_traced_forward`), so every submodule, parameter,
    buffer, attribute and method stays; a module that cannot be traced (data-dependent control
    flow) keeps its adds (and matmuls) unquantized and is reported. The residual operand is the one
    not produced by a submodule call (``x + self.conv2(...)``: ``x``); when both are, the second
    operand. A module registered under several names is rewritten once; every name gets the result.
    Returns (module, names of modules inserted, names of modules with adds/matmuls that could not be traced);
    ``left_out`` (a list) gets the names of the adds / matmuls that include / exclude kept in float.
    """
    return _insert(module, config, prefix, {}, [] if left_out is None else left_out)


def _insert(module: nn.Module, config: QuantConfig, prefix: str,
            done: dict[int, tuple[nn.Module, nn.Module]], left_out: list[str]) -> tuple[nn.Module, list[str], list[str]]:
    """insert_graph_quantizers below ``module``; ``done``: id(original) -> (original, replacement)."""
    added: list[str] = []
    untraced: list[str] = []
    for name, child in list(module._modules.items()):  # _modules: shared modules under every name
        if child is None or isinstance(child, (*GRAPH_QUANT_MODULES, TensorQuantizer, _QuantMixin)):
            continue
        if id(child) in done:
            new = done[id(child)][1]
        else:
            new, a, u = _insert(child, config, f"{prefix}{name}.", done, left_out)
            done[id(child)] = (child, new)  # the original is kept alive so its id is not reused
            added += a
            untraced += u
        if new is not child:
            setattr(module, name, new)
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
    quant_modules: dict[str, nn.Module] = {}
    taken: set[str] = set()  # names given out, also to ops left float, so names do not depend on include/exclude

    def free_name(base: str) -> str:  # residual_add0, residual_add1, ... not clashing with the module's own names
        i = 0
        while f"{base}{i}" in taken or hasattr(module, f"{base}{i}"):
            i += 1
        taken.add(f"{base}{i}")
        return f"{base}{i}"

    # adds first: their residual operand is chosen from the original graph, as with matmuls off
    for node in adds:
        a, b = node.args
        residual_first = a.op != "call_module" and b.op == "call_module"
        qname = free_name("residual_add")
        if not name_selected(prefix + qname, config):  # QuantConfig's include / exclude apply here too
            left_out.append(prefix + qname)
            continue
        quant_modules[qname] = QuantAdd(config, residual_first=residual_first)
        with graph.inserting_after(node):
            new_node = graph.call_module(qname, (a, b))
        node.replace_all_uses_with(new_node)
        graph.erase_node(node)
    for node in mms:
        op = _matmul_op(node)
        qname = free_name("matmul" if op else "sdpa")
        if not name_selected(prefix + qname, config):
            left_out.append(prefix + qname)
            continue
        quant_modules[qname] = QuantMatmul(config, op) if op else QuantSDPA(config)
        with graph.inserting_after(node):
            new_node = graph.call_module(qname, node.args, dict(node.kwargs))
        node.replace_all_uses_with(new_node)
        graph.erase_node(node)
    if not quant_modules:  # every add / matmul here was left out by include / exclude
        return module, added, untraced
    try:
        new = _with_traced_forward(module, graph, quant_modules)
    except Exception:  # noqa: BLE001 - e.g. a class that refuses subclassing: keep it float, reported
        untraced.append(prefix.rstrip(".") or "<root>")
        return module, added, untraced
    added += [prefix + q for q in quant_modules]
    return new, added, untraced


def _with_traced_forward(module: nn.Module, graph: torch.fx.Graph, extra: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``module`` whose forward runs ``graph``, with the ``extra`` submodules added.

    The copy is an instance of a subclass of ``type(module)`` (same class name), made per module
    as torch.fx makes one GraphModule class per module, sharing the original's parameters,
    buffers, submodules, attributes and hooks: only ``forward`` differs. A GraphModule would keep
    only what forward touches, dropping unused parameters and buffers (their state_dict keys),
    plain attributes and the class's other methods. The original module is not modified.
    """
    base = type(module)
    new = base.__new__(base)
    new.__dict__.update(module.__dict__)
    # own dicts: the quantizers are added to the copy only
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    for qname, qmod in extra.items():
        new.add_module(qname, qmod)
    graph.owning_module = new  # lint checks every call_module / get_attr target exists on the copy
    graph.lint()
    code = graph.python_code(root_module="self")
    new.__class__ = _traced_class(base, code.src, code.globals)
    return new


def _traced_class(base: type, src: str, namespace: dict[str, Any]) -> type:
    """The per-module subclass of ``base`` whose forward is the torch.fx-generated ``src`` (``namespace``: its globals).

    It pickles (``torch.save(model)``, ``copy.deepcopy``) as its base class, the source and the import statements
    of its globals: the class itself is made at run time and cannot be found by name, so :func:`_rebuild_traced`
    makes it again when loading (as torch.fx pickles a GraphModule)."""
    filename = f"<overdrive.quant traced {base.__qualname__}.forward at {id(src):#x}>"
    # registered like torch.fx does for GraphModule code, so tracebacks and inspect show the source
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope = dict(namespace)
    exec(compile(src, filename, "exec"), scope)  # noqa: S102 - code generated by torch.fx

    def __reduce_ex__(self: nn.Module, protocol: int) -> tuple[Any, ...]:
        return _rebuild_traced, (base, _import_block(namespace, base), src), self.__dict__

    return type(base)(base.__name__, (base,), {"forward": scope["forward"], "__module__": base.__module__,
                                               "__qualname__": base.__qualname__, "_overdrive_fx_code": src,
                                               "__reduce_ex__": __reduce_ex__})


def _import_block(namespace: dict[str, Any], base: type) -> str:
    """Statements that rebuild the generated code's globals: literals as assignments (an annotation kept as a
    string under ``from __future__ import annotations``), everything else imported by name, as torch.fx does."""
    from torch.fx.graph_module import _format_import_statement, sys_importer

    lines = []
    for name, obj in namespace.items():
        if obj is None or isinstance(obj, (str, bool, int)):
            lines.append(f"{name} = {obj!r}")
            continue
        try:
            lines.append(_format_import_statement(name, obj, sys_importer))
        except Exception as exc:  # noqa: BLE001 - e.g. a function defined inside another one
            raise pickle.PicklingError(
                f"cannot pickle the quantized {base.__qualname__}: its traced forward uses {name}={obj!r}, which "
                "cannot be imported by name; save model.state_dict() and load it into quant.quantize(float_model, "
                "config)") from exc
    return "\n".join(sorted(set(lines)))


def _rebuild_traced(base: type, imports: str, src: str) -> nn.Module:
    """An empty object of the traced class (the unpickler then restores its ``__dict__``)."""
    namespace: dict[str, Any] = {}
    exec(compile(imports, f"<overdrive.quant traced {base.__qualname__} imports>", "exec"), namespace)  # noqa: S102
    namespace.pop("__builtins__", None)
    obj = base.__new__(base)
    obj.__class__ = _traced_class(base, src, namespace)
    return obj


insert_residual_quantizers = insert_graph_quantizers  # the name before matmuls were covered


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model.eval()`` inside the block; afterwards every submodule gets back its own training flag.

    ``model.train(was_training)`` would not do: it sets one flag on all submodules, so a BatchNorm
    the user froze in eval mode inside a training model would come back in training mode."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in flags:
            m.training = training
