"""How close an int8/fp8 engine is to the float model it was built from, measured at build time.

The float reference (the fp32 ONNX model through ONNX Runtime, or the PyTorch module) and the built engine run on
up to :data:`MAX_BATCHES` calibration batches (the example inputs when there are none); the record goes into the
engine header (``header["accuracy"]``). Metrics, per float output, then the worst over outputs:

- ``cosine``: the mean over samples (dim 0) of the cosine similarity between the flattened reference and engine
  outputs of one sample (a 0-d or 1-d output counts as one sample).
- ``worst_cosine``: the lowest cosine of one sample (samples of near-zero norm left out): one wrong sample among
  many right ones moves the mean little (one at 0.5 among 64 leaves it at 0.992) but shows here.
- ``rel_max_err``: max |engine - reference| over the range (max - min) of the reference output.
- ``top1``: for one 2-D output (a classifier's logits, shape (B, C)), the fraction of samples whose argmax agrees.
- ``agreement``: per integer or bool output (an argmax, a mask), the fraction of equal elements; for a model with
  no floating-point output it stands in for the cosine (``record["by"] == "agreement"``) against ``min_cosine``.

A build whose ``cosine`` is below ``min_cosine`` (:data:`DEFAULT_MIN_COSINE` unless given), or whose
``worst_cosine`` is below :func:`worst_floor` of it (0.9 for 0.99: a sample far off, not int8 rounding), warns, or raises with
``on_low_accuracy="raise"`` (``overdrive build``'s default: it saves no such engine unless ``--accept-low-accuracy``),
and ``--best`` refuses it. The cosine is measured on the data the engine was calibrated with, so it catches a wrong Q/DQ layout
or a broken kernel, not calibration data that is unlike the real inputs. Calibration data that cannot tell a right
engine from a wrong one (every input one constant, such as all-zero images, or every sample a copy of one) fails
the check (``record["degenerate"]`` says why): such scales fit that one input only.

Example:
    >>> a = [[torch.tensor([[1.0, 0.0], [0.0, 2.0]])]]
    >>> r = compare_outputs(a, a, ["logits"])
    >>> r["cosine"], r["rel_max_err"], r["top1"]
    (1.0, 0.0, 1.0)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.fidelity import compare_outputs
from overdrive._utils.trees import tensor_leaves

DEFAULT_MIN_COSINE = 0.99
"""The output cosine an int8/fp8 engine must reach: about a 14% relative RMS error (1 - cos ~ err**2 / 2)."""
MAX_BATCHES = 4
"""Calibration batches the float reference and the engine run on at build time."""

WORST_SLACK = 10
"""How much further than the mean one sample may fall: the worst sample's floor is ``1 - WORST_SLACK * (1 -
min_cosine)``. A healthy int8 engine's samples sit near its mean (the int8 engines of overdrive's tests, BERT with
massive activations included: worst sample within 0.0005 of the mean); a sample at 0.9 has about 45% relative RMS
error, which is no rounding."""

Reference = Callable[[tuple[torch.Tensor, ...]], list[torch.Tensor]]
ON_LOW_ACCURACY = ("warn", "raise")
"""What a build below the tolerance does (``Builder(on_low_accuracy=...)``): warn and return the engine, or raise."""
REFUSED = (". The engine was not kept (overdrive build saves no engine below the tolerance); to keep it anyway "
           "pass --accept-low-accuracy (Builder(on_low_accuracy='warn'))")


def check_min_cosine(value: float | None) -> float:
    """``value`` checked (a number in [-1, 1]), or :data:`DEFAULT_MIN_COSINE` for None.

    Example:
        >>> check_min_cosine(None), check_min_cosine(0.95)
        (0.99, 0.95)
    """
    if value is None:
        return DEFAULT_MIN_COSINE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= float(value) <= 1.0:
        raise UsageError(f"min_cosine={value!r} must be a number in [-1, 1] (e.g. 0.99; -1 turns the check off)")
    return float(value)


def worst_floor(min_cosine: float) -> float:
    """The cosine the worst sample must reach for a tolerance of ``min_cosine`` on the mean (see
    :data:`WORST_SLACK`); -1 (no check) where the mean's check is off.

    Example:
        >>> worst_floor(0.99), worst_floor(-1.0)
        (0.9, -1.0)
    """
    return round(max(-1.0, 1.0 - WORST_SLACK * (1.0 - min_cosine)), 6)


def check_on_low_accuracy(value: str) -> str:
    """``value`` checked: one of :data:`ON_LOW_ACCURACY`.

    Example:
        >>> check_on_low_accuracy("raise")
        'raise'
    """
    if value not in ON_LOW_ACCURACY:
        raise UsageError(f"on_low_accuracy={value!r}: expected one of {', '.join(map(repr, ON_LOW_ACCURACY))} (what an "
                         "int8/fp8 build below min_cosine does)")
    return value


def meaningful(record: dict[str, Any], dynamic: bool) -> bool:
    """Whether a failed record says the engine is wrong, not only that its ranges were placeholders: measured on
    calibration data, or an engine whose activation scales are computed per call (dynamic int8 needs no calibration,
    so its check on the example inputs holds). A static engine built without calibration data is fit for timing.

    Example:
        >>> meaningful({"on": "calibration data"}, False), meaningful({"on": "example inputs"}, False)
        (True, False)
        >>> meaningful({"on": "calibration data (5 samples repeated to the engine's batch of 8)"}, False)
        True
    """
    return str(record.get("on", "")).startswith("calibration data") or dynamic


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode inside the block (no dropout in the reference); each submodule's flag put back."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in flags:
            m.training = training


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, tuple, dict, Hugging Face ModelOutput, a user's ``@dataclass``), in
    pytree order (a dataclass's in field order): the order in which torch.export and the ONNX exporters flatten
    them. A dataclass output was one opaque leaf to pytree: the reference gave no tensor, and the check was skipped."""
    return tensor_leaves(out)


def module_reference(module: nn.Module) -> Reference:
    """Runs ``module`` as given (eval mode, no grad, on its own device), in IEEE fp32 math whatever the caller's
    TF32 / ``set_float32_matmul_precision`` settings: the reference an engine is judged against is exact fp32."""
    from overdrive.engine.fp32_flags import fp32_flags, precision_flags

    dev = next((p.device for p in module.parameters()), torch.device("cpu"))

    def run(batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        with torch.no_grad(), _eval(module), precision_flags(fp32_flags("fp32")):
            return [t.detach().cpu() for t in _tensors(module(*(x.to(dev) for x in batch)))]

    return run


_ORT_NP = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
           "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
           "tensor(bool)": "bool"}


def onnx_reference(onnx_bytes: bytes) -> Reference:
    """Runs an ONNX model with ONNX Runtime's CPU provider at ORT_ENABLE_BASIC (no fused approximations; Q/DQ
    pairs computed as written), or with overdrive's importer in eager PyTorch where onnxruntime is missing."""
    from overdrive._utils.optional import is_available

    if not is_available("onnxruntime"):
        from overdrive.engine.onnx import import_onnx

        return module_reference(import_onnx(onnx_bytes))
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 3
    session = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
    feeds = [(i.name, _ORT_NP.get(i.type, "float32")) for i in session.get_inputs()]

    def run(batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        xs = {}
        for (n, dt), x in zip(feeds, batch):
            x = x.detach().cpu()
            xs[n] = (x.float() if x.is_floating_point() else x).numpy().astype(dt)  # numpy has no bfloat16
        return [torch.from_numpy(np.asarray(o)) for o in session.run(None, xs)]

    return run


def measure(engine: Any, reference: Reference, vs: str, calib: Sequence[tuple[torch.Tensor, ...]] | None,
            example: tuple[torch.Tensor, ...], min_cosine: float) -> dict[str, Any]:
    """The accuracy record of ``engine`` (an :class:`overdrive.engine.Engine`) against ``reference``, on up to
    :data:`MAX_BATCHES` of ``calib`` that fit the engine's profiles (else on ``example``).

    ``passed`` is True or False against ``min_cosine``, and None (with ``skipped``, the reason) when nothing
    could be compared."""
    t0 = time.perf_counter()
    on = "calibration data"
    batches = [c for b in (calib or []) for c in _fitting(engine, b)][:MAX_BATCHES]
    if not batches and calib:  # batches smaller than a fixed-batch engine's (a DataLoader of 64 for a 256 engine)
        size = max((p.opt[0] for p in engine.profiles if p.opt), default=1)
        pooled = _pooled(calib, MAX_BATCHES * size)
        batches = _fitting(engine, pooled)[:MAX_BATCHES]
        n = int(pooled[0].shape[0]) if pooled else 0
        if not batches and 0 < n < size:  # fewer samples than one batch: repeated to fill it (real data all the same)
            batches = _fitting(engine, tuple(x.repeat(-(-size // n), *[1] * (x.dim() - 1))[:size] for x in pooled))
            on = f"calibration data ({n} samples repeated to the engine's batch of {size})" if batches else on
    if not batches:
        on = "example inputs" if not calib else "example inputs (no calibration batch fits the engine's shapes)"
        batches = [tuple(x.detach().cpu() for x in example)]
    record: dict[str, Any] = {"vs": vs, "on": on, "batches": len(batches), "min_cosine": min_cosine,
                              "min_worst_cosine": worst_floor(min_cosine)}
    refs, outs = [], []
    for batch in batches:
        ref = reference(batch)
        out = [o.detach().cpu() for o in engine.run(*batch)]
        if len(ref) != len(out):
            record.update(passed=None, skipped=f"the reference gives {len(ref)} output(s), the engine {len(out)}")
            return record
        refs.append(ref)
        outs.append(out)
    names = [o["name"] for o in engine.header["outputs"]]
    record.update(compare_outputs(refs, outs, names))
    exact = _agreement(refs, outs, names)
    record["outputs"].update(exact)
    if record["cosine"] is None and exact:  # only integer / bool outputs (an argmax, a mask): judged by agreement
        record.update(cosine=min(p["agreement"] for p in exact.values()), by="agreement", worst_cosine=None,
                      rel_max_err=max(p["rel_max_err"] for p in exact.values()))
    record["s"] = round(time.perf_counter() - t0, 3)
    if record["cosine"] is None:
        record.update(passed=None, skipped="the model has no output to compare")
    else:
        worst = record.get("worst_cosine")
        record["passed"] = bool(record["cosine"] >= min_cosine and (worst is None or worst >= record["min_worst_cosine"]))
    if calib and on.startswith("calibration data"):
        same = degenerate(calib)
        if same:  # the scales fit that one input only: agreement on it says nothing about real inputs
            record.update(passed=False, degenerate=same)
    return record


def _agreement(refs: list[list[torch.Tensor]], outs: list[list[torch.Tensor]],
               names: list[str]) -> dict[str, dict[str, Any]]:
    """Per integer or bool output (which ``compare_outputs`` leaves out): ``agreement``, the fraction of elements
    equal to the reference's (the cosine of their one-hot encodings; 0 where the shapes differ), and
    ``rel_max_err``.

    Example:
        >>> _agreement([[torch.tensor([1, 2, 3, 4])]], [[torch.tensor([1, 2, 3, 0])]], ["label"])
        {'label': {'agreement': 0.75, 'rel_max_err': 1.333333}}
    """
    eq: dict[str, list[int]] = {}
    err: dict[str, list[float]] = {}
    for ref_b, out_b in zip(refs, outs):
        for i, (r, o) in enumerate(zip(ref_b, out_b)):
            if r.is_floating_point() or r.is_complex():
                continue
            name = names[i] if i < len(names) else f"output{i}"
            got, e = eq.setdefault(name, [0, 0]), err.setdefault(name, [0.0, 0.0])
            if tuple(r.shape) != tuple(o.shape):
                got[1] += max(r.numel(), 1)
                e[0] = float("inf")
                continue
            got[0] += int((r.cpu() == o.cpu().to(r.dtype)).sum())
            got[1] += r.numel()
            if r.numel():
                rd, od = r.cpu().double(), o.cpu().double()
                e[0] = max(e[0], float((rd - od).abs().max()))
                e[1] = max(e[1], float(rd.max() - rd.min()))
    return {n: {"agreement": round(g[0] / g[1], 6) if g[1] else 1.0,
                "rel_max_err": round(min(err[n][0] / max(err[n][1], 1.0), 1e9), 6)} for n, g in eq.items()}


def degenerate(calib: Sequence[tuple[torch.Tensor, ...]]) -> str | None:
    """What makes ``calib`` unfit to judge an engine (None when it is fit): every input is one constant (all-zero
    or all-0.5 images), or every sample is a copy of the first. Static int8 scales calibrated on such data fit that
    one input; a model that agrees on it can be far off on real inputs (cosine 0.80 on random ones).

    Example:
        >>> degenerate([(torch.zeros(4, 3),)])
        'every calibration input is one constant (0.0)'
        >>> degenerate([(torch.ones(2, 3),), (torch.ones(2, 3),)]) is not None, degenerate([(torch.randn(4, 3),)])
        (True, None)
    """
    xs = [x.detach().cpu() for b in calib for x in b if isinstance(x, torch.Tensor)]
    if not xs or any(x.dtype in (torch.bool,) or x.is_complex() for x in xs):
        return None
    nonempty = [x for x in xs if x.numel()]
    if nonempty and all(bool((x == x.reshape(-1)[0]).all()) for x in nonempty):
        values = sorted({float(x.reshape(-1)[0]) for x in nonempty})
        return f"every calibration input is one constant ({', '.join(map(str, values[:3]))})"
    first = calib[0]
    if any(len(b) != len(first) for b in calib) or any(x.dim() == 0 for b in calib for x in b):
        return None
    n = sum(int(b[0].shape[0]) for b in calib)
    if n < 2 or any(int(x.shape[0]) != int(b[0].shape[0]) for b in calib for x in b):
        return None
    for k, x0 in enumerate(first):
        one = x0[:1].detach().cpu()
        for b in calib:
            x = b[k].detach().cpu()
            if x.shape[1:] != one.shape[1:] or not bool((x == one).all()):
                return None
    return f"the {n} calibration samples are copies of one sample"


def _fitting(engine: Any, batch: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """``batch`` as the engine can run it: itself when it fits the profiles, else split along dim 0 into the
    profiles' opt batch size when that fits (calibration samples saved as one (N, ...) tensor for an engine of
    fixed batch), else nothing."""
    if _fits(engine, batch):
        return [batch]
    n = {int(x.shape[0]) for x in batch if x.dim() > 0}
    opt = {p.opt[0] for p in engine.profiles if p.opt}
    if len(n) != 1 or len(opt) != 1 or not all(x.dim() > 0 for x in batch):
        return []
    (size,), (b,) = n, opt
    chunks = [tuple(x[i:i + b] for x in batch) for i in range(0, size - b + 1, b)] if 0 < b < size else []
    return [c for c in chunks if _fits(engine, c)]


def _pooled(calib: Sequence[tuple[torch.Tensor, ...]], limit: int) -> tuple[torch.Tensor, ...]:
    """The calibration batches joined along dim 0 (up to ``limit`` samples) when they agree in count, dtype and the
    shape of each sample, so that :func:`_fitting` can cut them into a fixed-batch engine's size; ``()`` when they
    do not.

    Example:
        >>> [x.shape[0] for x in _pooled([(torch.zeros(3, 2),), (torch.ones(3, 2),)], 5)]
        [5]
    """
    first = calib[0] if calib else ()
    same = all(len(b) == len(first) and all(x.dim() > 0 and x.shape[1:] == y.shape[1:] and x.dtype == y.dtype
                                            for x, y in zip(b, first)) for b in calib)
    if not first or not same:
        return ()
    n = sum(int(b[0].shape[0]) for b in calib)
    if any(int(x.shape[0]) != int(b[0].shape[0]) for b in calib for x in b):
        return ()
    take, got = [], 0
    for b in calib:
        if got >= min(n, limit):
            break
        take.append(b)
        got += int(b[0].shape[0])
    return tuple(torch.cat([b[i].detach().cpu() for b in take])[:limit] for i in range(len(first)))


def _fits(engine: Any, batch: tuple[torch.Tensor, ...]) -> bool:
    try:
        engine.check_inputs(tuple(batch), move=False)
    except UsageError:
        return False
    return True


def summary(record: dict[str, Any]) -> str:
    """One line for ``overdrive build``: what was compared and how close it came.

    Example:
        >>> summary({"vs": "fp32", "on": "calibration data", "batches": 4, "cosine": 0.99991, "rel_max_err": 0.0123,
        ...          "top1": 1.0, "min_cosine": 0.99, "passed": True})
        'vs fp32 on 4 batch(es) of calibration data: cosine 0.99991, max abs error 1.23% of the output range, top-1 agreement 100.0% (tolerance: cosine >= 0.99)'
        >>> summary({"vs": "fp32", "on": "calibration data", "batches": 1, "cosine": 0.99219, "worst_cosine": 0.5,
        ...          "min_worst_cosine": 0.9, "rel_max_err": 0.2, "min_cosine": 0.99, "passed": False})[44:]
        'cosine 0.99219 (worst sample 0.50000), max abs error 20.00% of the output range (tolerance: cosine >= 0.99, worst sample >= 0.9; BELOW the tolerance)'
    """
    if record.get("passed") is None or record.get("rel_max_err") is None:
        return f"vs {record['vs']}: not measured ({record.get('skipped', 'outputs of other shapes')})"
    top1 = f", top-1 agreement {record['top1']:.1%}" if record.get("top1") is not None else ""
    below = "; BELOW the tolerance" if not record["passed"] else ""
    if record.get("degenerate"):
        below = f"; NOT A CHECK: {record['degenerate']}"
    metric = "agreement (integer outputs)" if record.get("by") == "agreement" else "cosine"
    worst, floor = record.get("worst_cosine"), record.get("min_worst_cosine")
    sample = f" (worst sample {worst:.5f})" if worst is not None else ""
    tol = f"cosine >= {record['min_cosine']}" + (f", worst sample >= {floor}" if worst is not None and floor is not None else "")
    return (f"vs {record['vs']} on {record['batches']} batch(es) of {record['on']}: {metric} {record['cosine']:.5f}{sample}, "
            f"max abs error {record['rel_max_err']:.2%} of the output range{top1} (tolerance: {tol}{below})")


def warning(record: dict[str, Any], precision: str) -> str:
    """The warning for an engine below the tolerance (or checked on degenerate calibration data): the numbers, and
    what to try.

    Example:
        >>> warning({"vs": "fp32", "on": "calibration data", "batches": 1, "cosine": 1.0, "rel_max_err": 0.0,
        ...          "min_cosine": 0.99, "outputs": {}, "degenerate": "the 8 calibration samples are copies of one sample"},
        ...         "int8")[:75]
        'the int8 engine was calibrated and checked on degenerate data (the 8 calibr'
    """
    if record.get("degenerate"):
        return (f"the {precision} engine was calibrated and checked on degenerate data ({record['degenerate']}): its "
                "static int8 scales fit that one input, and its agreement with the "
                f"{record['vs']} model there (cosine {record['cosine']:.4f}) says nothing about real inputs, on which "
                "such an engine can be far off. Calibrate with real, varied samples (--calib, e.g. 64 to 512 inputs "
                "like those the engine will see)")
    if record.get("by") == "agreement":
        return (f"the {precision} engine's integer/bool outputs agree with the {record['vs']} model's on only "
                f"{record['cosine']:.2%} of elements on {record['batches']} batch(es) of {record['on']}, below the "
                f"tolerance {record['min_cosine']}: it is likely wrong for this model (an argmax or threshold moved). "
                "Try more or other calibration batches (--calib), keeping the last layers in float "
                "(overdrive.quant with QuantConfig(exclude=...)), fp16/bf16 instead, or return the logits so the "
                "build can measure their cosine; Builder(min_cosine=...) sets the tolerance")
    worst = min(((n, p["cosine"]) for n, p in record["outputs"].items() if "cosine" in p), key=lambda t: t[1], default=None)
    where = f" (worst output {worst[0]!r})" if worst and len(record["outputs"]) > 1 else ""
    sample, floor = record.get("worst_cosine"), record.get("min_worst_cosine")
    if sample is not None and floor is not None and sample < floor and record["cosine"] >= record["min_cosine"]:
        return (f"the {precision} engine is far off the {record['vs']} model on one sample at least: cosine "
                f"{sample:.4f} there, below the per-sample floor {floor} (mean cosine {record['cosine']:.4f} over "
                f"{record['batches']} batch(es) of {record['on']}, max abs error {record['rel_max_err']:.1%} of the "
                "output range): it is likely wrong for inputs like that one (an outlier that its scales clip, or a "
                "kernel fault on some rows). Check that sample, calibrate with more varied data (--calib), or keep "
                "the layers with outliers in float (overdrive.quant with QuantConfig(exclude=...)); "
                "Builder(min_cosine=...) sets the tolerance (the per-sample floor is 1 - 10 * (1 - min_cosine))")
    return (f"the {precision} engine's outputs have cosine {record['cosine']:.4f} to the {record['vs']} model{where} on "
            f"{record['batches']} batch(es) of {record['on']}, below the tolerance {record['min_cosine']} (max abs error "
            f"{record['rel_max_err']:.1%} of the output range): it is likely wrong for this model. Try more or other "
            "calibration batches (--calib), per-channel weight scales (a Q/DQ model made elsewhere), keeping the "
            "layers with outliers in float (overdrive.quant with QuantConfig(exclude=...), then build from that "
            "model), fp16/bf16 instead, or --best (which refuses engines below the tolerance); "
            "Builder(min_cosine=...) sets the tolerance")
