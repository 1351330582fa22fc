"""What quantization did to the model's outputs on the user's own data, measured by :func:`quantize`.

While ``forward_loop`` calibrates, the inputs of the model's first calls are kept (up to :data:`MAX_BATCHES`, within
:data:`MAX_ELEMENTS` output elements); after calibration the model runs on them twice, every quantizer off (the
float function, SmoothQuant factors included, which leave it unchanged) and on, and the outputs are compared:
mean per-sample cosine, max error over the output range, top-1 agreement for one 2-D output
(``overdrive._utils.fidelity``). ``summary(model)["fidelity"]`` holds the record; ``print_summary`` prints it.

Example:
    >>> import torch
    >>> from overdrive import quant
    >>> xs = [torch.randn(16, 8) for _ in range(2)]
    >>> m = quant.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)), quant.INT8_DEFAULT, lambda m: [m(x) for x in xs])
    >>> r = quant.summary(m)["fidelity"]
    >>> r["batches"], r["cosine"] > 0.99
    (2, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from overdrive._utils.fidelity import compare_outputs
from overdrive._utils.trees import map_tensors, tensor_leaves
from overdrive.quant.modules import eval_mode
from overdrive.quant.quantizer import TensorQuantizer

MAX_BATCHES = 4
"""Calibration calls whose inputs are kept to measure the quantized model on."""
MAX_ELEMENTS = 2**25
"""Output elements kept in all (128 MB in fp32): a language model's logits over a large batch keep fewer batches."""


def _detached(tree: Any) -> Any:
    """A copy of ``tree`` whose tensors are detached clones (in a user's ``@dataclass`` too: kept by reference, a batch
    whose buffers the loader reuses was measured on the last batch's values)."""
    return map_tensors(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Inside the block, the (args, kwargs) of the model's first calls, copied, go into the yielded list."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    budget = [MAX_ELEMENTS]

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        n = sum(t.numel() for t in tensor_leaves(out))
        if len(calls) < MAX_BATCHES and n <= budget[0]:
            budget[0] -= n
            calls.append(_detached((args, kwargs)))

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


class _Enough(BaseException):
    """Raised by the capture hook to end an extra pass once enough calls are kept. A BaseException, as
    ``GeneratorExit`` is: a user's forward loop that catches ``Exception`` around each batch does not swallow it."""


def run_until_captured(model: nn.Module, forward_loop: Callable[[nn.Module], Any]) -> None:
    """Run ``forward_loop(model)`` only until :data:`MAX_BATCHES` calls were kept by the enclosing :func:`capture`
    (for configs whose calibration runs no batch: dynamic activation scales, weight-only)."""
    seen = [0]

    def stop(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen[0] += 1
        if seen[0] >= MAX_BATCHES:
            raise _Enough

    handle = model.register_forward_hook(stop)  # registered after capture's hook: runs after it
    try:
        with eval_mode(model), torch.no_grad():
            forward_loop(model)
    except _Enough:
        pass
    finally:
        handle.remove()


@contextlib.contextmanager
def _quantizers_off(model: nn.Module) -> Iterator[None]:
    qs = [(q, q.enabled) for q in model.modules() if isinstance(q, TensorQuantizer)]
    for q, _ in qs:
        q.enabled = False
    try:
        yield
    finally:
        for q, was in qs:
            q.enabled = was


def measure(model: nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> dict[str, Any] | None:
    """The fidelity record of the quantized ``model`` against itself with every quantizer off, on ``calls``;
    None when nothing was captured or the model has no floating-point output."""
    if not calls:
        return None

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        return tensor_leaves(model(*args, **kwargs))  # a tuple, dict, ModelOutput or a user's @dataclass output

    with eval_mode(model), torch.no_grad():
        with _quantizers_off(model):
            refs = [run(a, k) for a, k in calls]
        outs = [run(a, k) for a, k in calls]
    record = compare_outputs(refs, outs, [f"output{i}" for i in range(len(refs[0]))])
    if record["cosine"] is None:
        return None
    return {"on": "calibration data", "batches": len(calls), **record}


def validated(validate: Callable[[nn.Module], float] | None, model: nn.Module) -> float | None:
    """``validate(model)`` as a float, in eval mode without gradients (None without a callback)."""
    if validate is None:
        return None
    with eval_mode(model), torch.no_grad():
        value = validate(model)
    return float(value)


def describe(record: dict[str, Any] | None, validation: dict[str, float] | None) -> list[str]:
    """The lines ``print_summary`` and ``overdrive quantize`` print for the fidelity record and the validation.

    Example:
        >>> describe({"batches": 2, "cosine": 0.99912, "rel_max_err": 0.0213, "top1": None}, None)
        ['on 2 calibration batch(es): output cosine 0.99912 to the float model, max abs error 2.13% of the output range']
        >>> describe(None, {"float": 0.91, "quantized": 0.905, "delta": -0.005})
        ['validate: 0.91 float -> 0.905 quantized (-0.005)']
    """
    lines = []
    if record is not None:
        top1 = f", top-1 agreement {record['top1']:.1%}" if record.get("top1") is not None else ""
        lines.append(f"on {record['batches']} calibration batch(es): output cosine {record['cosine']:.5f} to the float "
                     f"model, max abs error {record['rel_max_err']:.2%} of the output range{top1}")
    if validation is not None:
        lines.append(f"validate: {validation['float']:.4g} float -> {validation['quantized']:.4g} quantized "
                     f"({validation['delta']:+.4g})")
    return lines
