"""ONNX Runtime backend (CPU provider; others where installed): all graph optimizations applied at
build time and the optimized model stored in the engine, so a load skips them. Runs fp32 and int8
Q/DQ models: ORT fuses QuantizeLinear/DequantizeLinear around Conv/MatMul into integer kernels where
they are exact (ARM; x86 with VNNI). On x86 without VNNI those kernels saturate, so the Q/DQ graph runs
as dequantize + fp32 there (``engine.info["backend_meta"]["int8_kernels"]`` says which). int8 with dynamic
activations (``int8_activations="dynamic"``) is ONNX Runtime's ``quantize_dynamic`` of the fp32 model: no Q/DQ pairs,
per-token activation scales computed in the integer MatMul kernels. For both modes ``backend_meta["int8_ops"]``
counts the integer kernels of the optimized graph by op type: an int8 engine whose GEMMs run in float shows ``{}``."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import is_available, require
from overdrive.engine.config import BuildConfig
from overdrive.engine.inputs import named_dim_groups
from overdrive.engine.sources import ModelSource

NAME = "onnxruntime"
PRECISIONS = ("fp32", "tf32", "int8")
INTEGER_KERNELS = ("MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm",
                   "QLinearConv", "ConvInteger", "QAttention", "DynamicQuantizeLSTM")
"""ONNX Runtime ops that compute a MatMul, Gemm, convolution or attention on int8/uint8 operands."""


def unavailable(device: torch.device) -> str | None:
    if not is_available("onnxruntime"):
        return "onnxruntime is not installed (pip install onnxruntime onnx)"
    if device.type == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return "this onnxruntime has no CUDAExecutionProvider (CPU only); use --backend inductor on CUDA"
    return None


def _providers(device: torch.device) -> list[str]:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.type == "cuda" else ["CPUExecutionProvider"]


def int8_dynamic_unavailable(src: ModelSource, device: torch.device) -> str | None:
    """None when this backend builds int8 with dynamic activations for ``src`` on ``device``, else why not."""
    if device.type == "cuda":
        return "dynamic int8 runs on ONNX Runtime's CPU provider; on CUDA build static int8 (--calib)"
    return None


FLOAT_CONVS = ("Conv", "FusedConv", "ConvTranspose")
"""Convolutions of an optimized int8 model that run in float. ONNX Runtime has no integer convolution with a float
output, so a DequantizeLinear -> Conv with no QuantizeLinear after it (the inputs-only layout, as QAT models export)
stays an fp32 convolution."""


def integer_ops(model_bytes: bytes) -> tuple[dict[str, int], int]:
    """How many nodes of each :data:`INTEGER_KERNELS` type the (optimized) model has, e.g.
    ``{"DynamicQuantizeMatMul": 7, "MatMulIntegerToFloat": 6}``, and how many :data:`FLOAT_CONVS` it has.

    Example:
        >>> # ops, float_convs = integer_ops(engine.sections["onnx"])
    """
    import onnx

    counts: dict[str, int] = {}
    floats = 0
    for node in onnx.load_from_string(model_bytes).graph.node:
        if node.op_type in INTEGER_KERNELS:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        floats += node.op_type in FLOAT_CONVS
    return dict(sorted(counts.items())), floats


def has_qdq(onnx_bytes: bytes) -> bool:
    import onnx

    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in onnx.load_from_string(onnx_bytes).graph.node)


_QDQ_FORMATS = {2: "int8", 3: "int8", 17: "fp8", 18: "fp8", 19: "fp8", 20: "fp8", 21: "int4", 22: "int4", 4: "int16",
                5: "int16"}  # ONNX TensorProto element types: (U)INT8, FLOAT8*, (U)INT4, (U)INT16


def qdq_formats(onnx_bytes: bytes) -> set[str]:
    """The integer / fp8 formats a Q/DQ model quantizes to (``{"int8"}``, ``{"fp8"}``, both), read from its
    QuantizeLinear zero points and output_dtype and its DequantizeLinear inputs stored as initializers. A
    QuantizeLinear with neither zero point nor output_dtype is uint8 (the ONNX default).

    Example:
        >>> import onnx
        >>> from onnx import TensorProto as T, helper as h
        >>> zp = h.make_tensor("zp", T.FLOAT8E4M3FN, [], [0.0])
        >>> s = h.make_tensor("s", T.FLOAT, [], [0.1])
        >>> g = h.make_graph([h.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
        ...                   h.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])], "g",
        ...                  [h.make_tensor_value_info("x", T.FLOAT, [2])], [h.make_tensor_value_info("y", T.FLOAT, [2])],
        ...                  [zp, s])
        >>> qdq_formats(h.make_model(g).SerializeToString())
        {'fp8'}
    """
    import onnx

    graph = onnx.load_from_string(onnx_bytes).graph
    inits = {t.name: t.data_type for t in graph.initializer}
    found = set()
    for n in graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        types = [inits[n.input[2]]] if len(n.input) > 2 and n.input[2] in inits else []
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            types.append(inits[n.input[0]])
        out = next((a.i for a in n.attribute if a.name == "output_dtype"), 0)
        if n.op_type == "QuantizeLinear":
            types += [out] if out else [] if types else [2]
        found |= {_QDQ_FORMATS[t] for t in types if t in _QDQ_FORMATS}
    return found


class Runner:
    def __init__(self, session: Any, device: torch.device) -> None:
        self.session, self.device = session, device
        self.input_names = [i.name for i in session.get_inputs()]
        self.via = "onnxruntime " + "/".join(session.get_providers())

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        feeds = {n: x.detach().cpu().numpy() for n, x in zip(self.input_names, xs)}
        try:
            outs = self.session.run(None, feeds)
        except Exception as exc:
            if not type(exc).__module__.startswith("onnxruntime"):
                raise
            # an input the checks before cannot see: an index past a table (Gather), a size the graph refuses
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"ONNX Runtime could not run the engine on these inputs: {why}; check their values "
                             "(token ids and indices within the model's tables) and sizes") from exc
        return [torch.from_numpy(np.asarray(o)) for o in outs]


def int8_kernels_exact() -> tuple[bool, str]:
    """Whether ONNX Runtime's fused int8 CPU kernels compute exactly here, and why.

    On x86 without VNNI, ONNX Runtime's u8s8 GEMMs (VPMADDUBSW) saturate int16 sums of product pairs:
    a quantized Linear on a 3-D input came out off by 30% of its range on an AVX2 machine, exact when
    the quantized values stayed small. ARM and x86 with VNNI (AVX512-VNNI, AVX-VNNI, AMX) are exact.

    Example:
        >>> ok, why = int8_kernels_exact()
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True, f"{platform.machine()}: integer dot-product kernels without saturation"
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(fh.read().split())
    except OSError:
        return False, "cannot read the CPU flags; assuming no VNNI"
    found = sorted(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    if found:
        return True, f"x86 with {', '.join(found)}"
    return False, ("x86 without VNNI: ONNX Runtime's u8s8 int8 kernels saturate there, so Q/DQ runs as "
                   "dequantize + fp32 (exact, no int8 speedup)")


def _session(model_bytes: bytes, device: torch.device, optimize_to: str | None = None, unfused_qdq: bool = False,
             profile_prefix: str | None = None, int8_matmuls: bool = False) -> Any:
    ort = require("onnxruntime", "onnx", "the onnxruntime backend")
    # int8_matmuls: a Q/DQ model with only its inputs quantized (overdrive.quant's layout) keeps each MatMul and
    # its bias Add apart, so DQ -> MatMul becomes MatMulIntegerToFloat (an int8 GEMM); fused into a Gemm first, it
    # ran in fp32 behind its Q/DQ pairs (a 2-layer BERT at batch 4: 0.43 ms against 0.16 ms here)
    disabled = ["MatMulAddFusion"] if int8_matmuls else []
    if "fp8" in qdq_formats(model_bytes):
        # ONNX Runtime (1.32) drops a Relu before a float8 QuantizeLinear (ReluQuantRewrite), as if float8's zero
        # point 0 were the lowest value as uint8's is: negative values then pass through Q/DQ, and a small fp8 CNN's
        # output was off by half its range
        disabled.append("ReluQuantRewrite")
    so = ort.SessionOptions()
    if profile_prefix:
        so.enable_profiling, so.profile_file_prefix = True, profile_prefix
    if unfused_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")  # keep Q/DQ out of the saturating kernels
    if optimize_to:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = optimize_to
    else:  # stored models are optimized already
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 4  # fatal only: errors reach the caller as exceptions (Runner words them), not log lines
    return ort.InferenceSession(model_bytes, sess_options=so, providers=_providers(device),
                                disabled_optimizers=disabled or None)


def _optimized(model_bytes: bytes, device: torch.device, unfused_qdq: bool = False, int8_matmuls: bool = False) -> bytes:
    """``model_bytes`` after every ONNX Runtime graph optimization, as a build stores it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        _session(model_bytes, device, optimize_to=path, unfused_qdq=unfused_qdq, int8_matmuls=int8_matmuls)
        with open(path, "rb") as fh:
            return fh.read()


def build(src: ModelSource, example: tuple[torch.Tensor, ...], cfg: BuildConfig, device: torch.device,
          calib: list[tuple[torch.Tensor, ...]] | None = None) -> tuple[dict[str, bytes], Runner, dict[str, Any]]:
    if cfg.precision not in PRECISIONS:
        raise UsageError(f"the onnxruntime backend runs {', '.join(PRECISIONS)} (int8 from a Q/DQ model), not "
                         f"{cfg.precision}; use --backend inductor for {cfg.precision}")
    t0 = time.perf_counter()
    dynamic = cfg.precision == "int8" and cfg.int8_activations == "dynamic"
    meta: dict[str, Any] = {}
    optimized: bytes | None = None
    if dynamic:
        why = int8_dynamic_unavailable(src, device)
        if why:
            raise UsageError(f"--int8-activations dynamic: {why}")
        from overdrive.engine.onnx import quantize_onnx_dynamic

        # the u8s8 kernels saturate on x86 without VNNI: 7-bit weights there (reduce_range), as ORT advises
        exact, why = int8_kernels_exact() if device.type == "cpu" else (True, "")
        model_bytes = quantize_onnx_dynamic(src.as_onnx(example, cfg.profiles, cfg.opset), reduce_range=not exact)
        meta["int8_kernels"] = "dynamic int8: " + ("8-bit weights, " if exact else "7-bit weights (reduce_range), ") + why
        meta["reduce_range"] = not exact
    elif cfg.precision == "int8" and src.onnx_bytes is None and _quantized_already(src):
        model_bytes = _quantized_onnx(src, example, calib or [example], cfg.profiles, cfg.opset)
    elif cfg.precision == "int8" and (src.onnx_bytes is None or not has_qdq(src.onnx_bytes)):  # a float model
        fp32 = src.onnx_bytes if src.onnx_bytes is not None else src.as_onnx(example, cfg.profiles, cfg.opset)
        model_bytes, chosen = choose_int8_layout(fp32, example, calib or [tuple(x.cpu() for x in example)], device)
        optimized = chosen.pop("optimized", None)  # timed already: ONNX Runtime's optimizations ran on it once
        meta.update(chosen)
    else:
        model_bytes = src.as_onnx(example, cfg.profiles, cfg.opset)
    qdq = not dynamic and has_qdq(model_bytes)  # parsed once, here: loads read the decision from the header
    exact, why = int8_kernels_exact() if qdq and device.type == "cpu" else (True, "")
    unfused = not exact
    if cfg.precision == "int8" and not qdq and not dynamic:
        raise UsageError("--precision int8 with an ONNX model needs QuantizeLinear/DequantizeLinear nodes in it; "
                         "quantize it with overdrive.quant (export_onnx) or build from the PyTorch model")
    t_export = time.perf_counter() - t0
    if optimized is None:
        try:
            optimized = _optimized(model_bytes, device, unfused_qdq=unfused, int8_matmuls=qdq and not unfused)
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"onnxruntime could not load the model: {exc}") from exc
    runner = Runner(_session(optimized, device, unfused_qdq=unfused), device)
    # dims the model names alike (ids and mask share "batch", or the exporter proved them equal): one size, checked at
    # each call; unlike sizes broadcast or failed deep in ONNX Runtime
    shared = named_dim_groups({i.name: list(i.shape) for i in runner.session.get_inputs()})
    meta.update(export_s=t_export, providers=_providers(device), shared_dims=shared)
    if qdq and device.type == "cpu":
        meta["int8_kernels"] = ("fused int8 kernels: " if exact else "not fused: ") + why
        meta["unfused_qdq"] = unfused
    if cfg.precision == "int8":
        meta["int8_ops"], floats = integer_ops(optimized)  # {} : labelled int8, computed in float
        if floats:
            meta["float_convs"] = floats
    return {"onnx": optimized}, runner, meta


def _quantized_onnx(src: ModelSource, example: tuple[torch.Tensor, ...], calib: list[tuple[torch.Tensor, ...]],
                    profiles: Any = (), opset: int = 18) -> bytes:
    """The int8 Q/DQ ONNX model of a PyTorch module quantized already (QAT, sparse-quantized), exported with
    its own ranges."""
    try:
        from overdrive import quant
    except ImportError as exc:
        from overdrive._utils.errors import OverdriveError

        raise OverdriveError("--precision int8 from a float model needs overdrive.quant, which is not installed in "
                             "this overdrive; build from a Q/DQ ONNX model instead") from exc

    fmts = {q.config.format for _, q in quant.quantizers(src.module) if q.enabled}
    if fmts and fmts != {"int8"}:
        raise UsageError(f"the model is quantized already to {sorted(fmts)}, not int8; the onnxruntime backend runs int8 "
                         "Q/DQ models: quantize the float model with quant.INT8_DEFAULT")
    model = src.module  # quantized already (QAT, sparse-quantized): exported as calibrated
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "qdq.onnx")
        from overdrive.engine.sources import by_name

        names = tuple(src.input_names) if len(src.input_names) == len(example) else ("input",)
        quant.export_onnx(by_name(model, list(names)), example, path, input_names=names)
        with open(path, "rb") as fh:
            return fh.read()


def _quantized_already(src: ModelSource) -> bool:
    """Whether ``src`` is a PyTorch module with overdrive.quant quantizers in it (QAT, sparse-quantized)."""
    try:
        from overdrive import quant
    except ImportError:
        return False
    return any(True for _ in quant.quantizers(src.module))


INTEGER_LAYOUT_GAIN = 1.05
"""How much faster (median time ratio) ONNX Runtime's integer layout must run than overdrive's inputs-only layout to
be chosen: a margin over the timing noise of a build-time measurement."""


def choose_int8_layout(fp32: bytes, example: tuple[torch.Tensor, ...], calib: list[tuple[torch.Tensor, ...]],
                       device: torch.device) -> tuple[bytes, dict[str, Any]]:
    """The int8 Q/DQ model of a float ONNX model that runs fastest here, chosen by timing, and what was measured.

    Two layouts are calibrated on ``calib``: overdrive.quant's (Q/DQ on the inputs of each Conv/Gemm/MatMul, never on
    their outputs; :func:`~overdrive.engine.onnx.quantize_onnx`) and, for a model with convolutions on a CPU whose
    int8 kernels are exact, ONNX Runtime's own (:func:`~overdrive.engine.onnx.quantize_onnx_integer`: outputs, adds
    and pooling quantized as well). The first keeps the residual stream float, and its MatMuls fuse into integer
    GEMMs; but ONNX Runtime has no integer convolution that returns float, so each of its convolutions runs in fp32
    behind a DequantizeLinear. The second fuses a CNN into integer kernels end to end (QLinearConv, QLinearAdd). The
    integer layout is kept when it runs faster on ``example`` (by :data:`INTEGER_LAYOUT_GAIN`) and its outputs on
    the first calibration batch stay accurate (:func:`integer_layout_accurate`); ``meta["int8_layouts"]`` has both.
    Each candidate is optimized once and timed as the engine runs it; ``meta["optimized"]`` is the chosen one.

    Example:
        >>> # q, meta = choose_int8_layout(fp32_bytes, (x,), [(x,)], torch.device("cpu")); meta["int8_layout"]
    """
    from overdrive.engine.onnx import calibration_feeds, quantize_onnx, quantize_onnx_integer

    t0 = time.perf_counter()
    batches = [tuple(x.detach().cpu() for x in b) for b in calib]
    inputs_layout = quantize_onnx(fp32, batches, "int8")
    meta: dict[str, Any] = {"int8_layout": "inputs"}
    exact, _ = int8_kernels_exact() if device.type == "cpu" else (False, "")
    import onnx

    graph = onnx.load_from_string(fp32).graph
    convs = any(n.op_type in ("Conv", "ConvTranspose") for n in graph.node)
    if not (exact and convs):
        meta["int8_layout_why"] = ("no convolutions: the inputs-only layout's MatMuls run as integer GEMMs" if exact
                                   else "ONNX Runtime's int8 kernels are not exact here (see int8_kernels)")
        meta["calibration"] = f"ONNX Runtime quantize_static (int8 Q/DQ) on {len(batches)} batch(es) in {time.perf_counter() - t0:.1f} s"
        return inputs_layout, meta
    layouts = {"inputs": inputs_layout}
    sessions: dict[str, Any] = {}
    try:  # a candidate only: whatever stops it (a model ONNX Runtime's quantizer or optimizer cannot take) is recorded
        layouts["integer"] = quantize_onnx_integer(fp32, batches)
        optimized = {k: _optimized(b, device, int8_matmuls=True) for k, b in layouts.items()}
        sessions = {k: _session(b, device) for k, b in optimized.items()}
    except Exception as exc:  # noqa: BLE001
        layouts.pop("integer", None)
        meta["int8_layout_why"] = f"ONNX Runtime's integer layout could not be made or loaded: {type(exc).__name__}: {exc}"[:400]
    t_cal = time.perf_counter() - t0
    if "integer" in layouts:
        feed = calibration_feeds(fp32, batches[:1])[0]
        ref = _float_outputs(_session(fp32, device).run(None, feed))  # the fp32 model as written
        names = [i.name for i in sessions["inputs"].get_inputs()]
        timing_feed = {n: x.detach().cpu().numpy() for n, x in zip(names, example)}
        measured = {k: {"cosine": _cosine(ref, _float_outputs(s.run(None, feed))), "ms": []} for k, s in sessions.items()}
        for s in sessions.values():
            s.run(None, timing_feed)  # warm-up
        t_run = time.perf_counter()
        for rnd in range(8):  # interleaved rounds, so that a noisy stretch of the machine hits both layouts
            for k, s in sessions.items():
                t = time.perf_counter()
                s.run(None, timing_feed)
                measured[k]["ms"].append((time.perf_counter() - t) * 1e3)
            if rnd >= 2 and time.perf_counter() - t_run > 2.0:
                break
        rows = {k: {"ms": round(statistics.median(v["ms"]), 4), "cosine": round(v["cosine"], 6)} for k, v in measured.items()}
        meta["int8_layouts"] = rows
        fast = rows["integer"]["ms"] * INTEGER_LAYOUT_GAIN < rows["inputs"]["ms"]
        good = integer_layout_accurate(measured["integer"]["cosine"], measured["inputs"]["cosine"])
        if fast and good:
            meta["int8_layout"] = "integer"
        meta["optimized"] = optimized[meta["int8_layout"]]  # the build stores it as it is
        why = (f"integer layout {rows['inputs']['ms'] / rows['integer']['ms']:.2f}x the inputs-only layout, cosine "
               f"{rows['integer']['cosine']:.4f} (inputs-only {rows['inputs']['cosine']:.4f})")
        meta["int8_layout_why"] = why + ("" if good else ": less accurate, not used")
    meta["calibration"] = (f"ONNX Runtime quantize_static (int8 Q/DQ, {'/'.join(layouts)} layout"
                           f"{'s' if len(layouts) > 1 else ''}) on {len(batches)} batch(es) in {t_cal:.1f} s")
    return layouts[meta["int8_layout"]], meta


def integer_layout_accurate(cos_integer: float, cos_inputs: float) -> bool:
    """Whether the integer layout's outputs are accurate enough to be chosen for speed: cosine >= 0.99 to the fp32
    model, and an error (1 - cosine) at most 4x the inputs-only layout's (or below 1e-4, where neither matters).
    The second keeps a transformer with one convolution (a ViT's patch embedding) on the inputs-only layout when
    quantizing its residual stream and attention costs it: 0.9991 against 0.9999 on a small ViT.

    Example:
        >>> integer_layout_accurate(0.99945, 0.9997), integer_layout_accurate(0.9991, 0.9999)
        (True, False)
        >>> integer_layout_accurate(0.98, 0.985), integer_layout_accurate(0.99995, 1.0)
        (False, True)
    """
    err_integer, err_inputs = 1.0 - cos_integer, 1.0 - cos_inputs
    return cos_integer >= 0.99 and err_integer <= max(4.0 * err_inputs, 1e-4)


def _float_outputs(outs: list[Any]) -> list[np.ndarray]:
    return [np.asarray(o, dtype=np.float64).ravel() for o in outs
            if isinstance(o, np.ndarray) and np.issubdtype(o.dtype, np.floating)]


def _cosine(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    """The lowest cosine similarity over the float outputs (1.0 where there are none)."""
    worst = 1.0
    for a, b in zip(ref, got):
        den = float(np.linalg.norm(a) * np.linalg.norm(b))
        worst = min(worst, float(a @ b) / den if den > 0 else float(np.array_equal(a, b)))
    return worst


def profile_nodes(model_bytes: bytes, header: dict[str, Any], device: torch.device, xs: list[torch.Tensor],
                  iterations: int) -> list[dict[str, Any]]:
    """Time per graph node over ``iterations`` runs, from ONNX Runtime's profiler, on a separate session of
    the engine's model (profiling slows every run, so the engine's own session is left alone).

    Example:
        >>> # rows = profile_nodes(engine.sections["onnx"], engine.header, engine.device, xs, 10)
    """
    import json

    with tempfile.TemporaryDirectory() as tmp:
        session = _session(model_bytes, device, unfused_qdq=_unfused_qdq(header), profile_prefix=os.path.join(tmp, "ort"))
        feeds = {i.name: x.detach().cpu().numpy() for i, x in zip(session.get_inputs(), xs)}
        session.run(None, feeds)  # warm-up: its first-run allocations are left out below
        for _ in range(iterations):
            session.run(None, feeds)
        with open(session.end_profiling()) as fh:
            events = json.loads(fh.read())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    warm_end = runs[0]["ts"] + runs[0]["dur"] if runs else float("-inf")
    nodes: dict[str, dict[str, Any]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith("_kernel_time") or e.get("ts", 0) < warm_end:
            continue
        node = name[: -len("_kernel_time")]
        row = nodes.setdefault(node, {"name": f"{node} ({e.get('args', {}).get('op_name', '?')})", "timeMs": 0.0, "count": 0})
        row["timeMs"] += float(e.get("dur", 0)) / 1e3  # dur in microseconds
        row["count"] += 1
    return [{**r, "averageMs": r["timeMs"] / iterations} for r in nodes.values()]


def _unfused_qdq(header: dict[str, Any]) -> bool:
    meta = header.get("backend_meta", {})
    # engines saved before "unfused_qdq" was stored carry the same decision in their "int8_kernels" text
    return meta.get("unfused_qdq", str(meta.get("int8_kernels", "")).startswith("not fused"))


def load(sections: dict[str, bytes], header: dict[str, Any], device: torch.device, trusted: bool = False,
         native_ok: bool = True) -> Runner:
    """The ONNX Runtime session (``trusted`` and ``native_ok`` change nothing: the section is a protobuf that
    runs no code, and one pointing at external data files is refused)."""
    _refuse_external_data(sections["onnx"])
    return Runner(_session(sections["onnx"], device, unfused_qdq=_unfused_qdq(header)), device)


def _refuse_external_data(model_bytes: bytes) -> None:
    """An engine's ONNX section holds its weights itself (build embeds them); one that points at external
    files would make ONNX Runtime read whatever those paths name, relative to the current folder."""
    onnx = require("onnx", "onnx", "the onnxruntime backend")
    from overdrive.engine.sources import external_data_names

    names = external_data_names(onnx.load_from_string(model_bytes))
    if names:
        raise UsageError(f"the engine's ONNX section points at external data files for {', '.join(names[:3])}; "
                         "overdrive never writes such engines, and loading it would read files from the current "
                         "folder: rebuild the engine with `overdrive build`")
