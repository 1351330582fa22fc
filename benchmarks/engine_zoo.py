"""The engine zoo (issue 15): timm and transformers models through eager fp16, torch.compile (default and
reduce-overhead) and overdrive engines (fp16, int8, fp8), all in one run, with build time and accuracy beside
every speed.

Models (random weights, no network): timm ``resnet50``, ``convnext_tiny``, ``efficientnet_b0``,
``vit_base_patch16_224``; a Hugging Face ``bert`` (BERT-base from BertConfig, input_ids + attention_mask) and
``llama`` (LlamaModel from LlamaConfig: 8 layers, hidden 1024, use_cache=False, input_ids). Each at a serving
batch (CNNs 256 or 128, ViT 128, BERT 32x128, Llama 16x512) and at batch 1. Accuracy: the output of each config
against the fp32 eager model on the same held-out inputs (TF32 off for the reference): the mean over samples of
the cosine of the flattened outputs, and the max abs error. Inputs: crops of scikit-image's sample photographs
(seeded random normal images when scikit-image is absent) and sentences of Python's help topics as bytes.

Times are CUDA-event medians (``_common.time_steps``) of calls timed in rounds interleaved with the anchors that
are alive (torch.compile reduce-overhead, and the fp16 engine for int8/fp8), so ``x_vs_ro`` and
``x_vs_engine_fp16`` compare calls made side by side. Results are rewritten after every row, so a run cut off
keeps what it measured; ``--merge`` joins the files of a split run and recomputes the zoo summary.

    python benchmarks/engine_zoo.py --models resnet50 --batches serving --out engine_zoo_resnet50_serving
    python benchmarks/engine_zoo.py --merge 'benchmarks/results/engine_zoo_*.json' --out engine_zoo
    python benchmarks/engine_zoo.py --device cpu --quick      # tiny stand-ins, batch 2, < 2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import glob
import json
import math
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _common import RESULTS, device_facts, gpu_kernels, kernel_breakdown, median, time_steps, write_results  # noqa: E402

CONFIGS = ("eager_fp16", "compile_default", "compile_ro", "engine_fp16", "engine_int8", "engine_fp8")
# also accepted by --configs, not run by default: int8 / fp8 engines built with quantize_residuals (ResNet blocks
# hand over 8-bit tensors only), and with lowp_linears="cublas" (Linear layers on cuBLAS or float only, no Triton)
EXTRA_CONFIGS = ("engine_int8_qres", "engine_fp8_qres", "engine_int8_cublas", "engine_fp8_cublas", "engine_int8_siblings",
                 "engine_fp8_siblings")
LOWP = ("engine_int8", "engine_fp8", *EXTRA_CONFIGS)
TIMM = {"resnet50": 256, "convnext_tiny": 128, "efficientnet_b0": 256, "vit_base_patch16_224": 128}
ALIASES = {"vit": "vit_base_patch16_224", "convnext": "convnext_tiny", "efficientnet": "efficientnet_b0"}
COLUMNS = ["model", "batch", "shape", "config", "precision", "ms", "gpu_ms", "throughput", "x_vs_ro", "x_vs_engine_fp16",
           "x_vs_eager", "build_s", "cosine", "max_abs_err", "layers", "error"]
TARGETS = {"fp16_vs_ro": 1.3, "lowp_vs_fp16": 1.4, "min_cosine": 0.99, "build_s": 120.0}


@dataclass
class Zoo:
    """One model at one batch: the fp32 CPU master, its input names, and the data built for it."""

    name: str
    desc: str
    module: torch.nn.Module
    names: list[str]
    image: bool  # 4-D float input: channels_last and fp16:hwc engine I/O on CUDA
    calib: list[tuple[torch.Tensor, ...]]
    evals: list[tuple[torch.Tensor, ...]]  # held-out batches for accuracy; evals[0] is the timing input
    mask_index: int | None = None  # which input masks padded tokens out of the accuracy


# ---------------------------------------------------------------------------------------------- inputs
def _images(n: int, size: int, seed: int) -> tuple[torch.Tensor, str]:
    """(n, 3, size, size) ImageNet-normalised crops of scikit-image's sample photographs, or seeded normals."""
    g = torch.Generator().manual_seed(seed)
    pics = []
    try:
        import skimage.data as sk

        for name in ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "moon", "page", "text", "clock",
                     "horse", "immunohistochemistry", "hubble_deep_field", "retina", "cat", "motorcycle_left"):
            try:  # some need a download (pooch) on newer scikit-image: no network, skip them
                a = torch.as_tensor(getattr(sk, name)()).float()
            except Exception:  # noqa: BLE001
                continue
            a = a / (255.0 if a.max() > 1.5 else 1.0)
            a = a.unsqueeze(-1).expand(*a.shape, 3) if a.dim() == 2 else a[..., :3]
            pics.append(a.permute(2, 0, 1).contiguous())  # (3, H, W) in [0, 1]
    except ImportError:
        pass
    if not pics:
        return torch.randn(n, 3, size, size, generator=g), "seeded random normal images (scikit-image absent)"
    out = torch.empty(n, 3, size, size)
    for i in range(n):  # random resized crop (35-100% of the short side) and flip, as an ImageNet eval loader sees
        p = pics[int(torch.randint(len(pics), (1,), generator=g))]
        h, w = p.shape[1:]
        side = int(min(h, w) * (0.35 + 0.65 * torch.rand(1, generator=g).item()))
        y, x = (int(torch.randint(d - side + 1, (1,), generator=g)) for d in (h, w))
        crop = torch.nn.functional.interpolate(p[None, :, y:y + side, x:x + side], size=(size, size), mode="bilinear",
                                               antialias=True, align_corners=False)[0]
        out[i] = crop.flip(-1) if torch.rand(1, generator=g).item() < 0.5 else crop
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return (out - mean[:, None, None]) / std[:, None, None], f"crops of {len(pics)} scikit-image sample photographs"


def _bytes_ids(text: str, vocab: int) -> list[int]:
    """A byte tokenizer: UTF-8 byte b -> token 4 + b mod (vocab - 4); 0 is padding."""
    return [4 + b % (vocab - 4) for b in text.encode()]


def _text_rows(n: int, seq: int, vocab: int, offset: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, mask) of ``n`` rows of ``seq`` tokens from Python's help topics, and the next sentence offset.

    ``packed``: sentences run on across rows (a decoder's prefill, no padding); else one sentence a row, cut or
    padded to ``seq`` (an encoder's batch).
    """
    from _pretrained import sentences

    ids = torch.zeros(n, seq, dtype=torch.int64)
    mask = torch.zeros(n, seq, dtype=torch.int64)
    if packed:
        stream: list[int] = []
        while len(stream) < n * seq:  # 64 sentences at a time: sentences() parses the help topics on each call
            for sent in sentences(64, offset):
                offset += 1
                stream += _bytes_ids(sent + " ", vocab)
                if len(stream) >= n * seq:
                    break
        ids[:] = torch.tensor(stream[:n * seq]).view(n, seq)
        mask[:] = 1
        return ids, mask, offset
    for i, s in enumerate(sentences(n, offset)):
        t = _bytes_ids(s, vocab)[:seq]
        ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
    return ids, mask, offset + n


# ---------------------------------------------------------------------------------------------- models
def _make(name: str, batch: int, args: argparse.Namespace) -> Zoo:
    n_cal = max(args.calib_batches, math.ceil(args.calib_samples / batch))
    n_acc = max(1, math.ceil(args.acc_samples / batch))
    torch.manual_seed(0)
    if name in TIMM:
        size = 32 if args.quick else 224
        if args.quick:  # a stand-in whatever timm says: seconds, not minutes, on a CPU
            from overdrive.recipes.models import ResNet

            module, desc = ResNet(width=8, depths=(1, 1), stem="small", in_ch=3, num_classes=10), "tiny ResNet stand-in"
        else:
            try:
                import timm
            except ImportError as exc:
                raise RuntimeError("timm is not installed (pip install timm); the timm models need it") from exc
            module, desc = timm.create_model(name, pretrained=False), f"timm {name}, random init"
        xs, how = _images((n_cal + n_acc) * batch, size, seed=1)
        batches = [(xs[i * batch:(i + 1) * batch],) for i in range(n_cal + n_acc)]
        return Zoo(name, f"{desc}; inputs: {how}", module.eval(), ["x"], True, batches[:n_cal], batches[n_cal:])
    import transformers

    if name == "bert":
        kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                  vocab_size=1024) if args.quick else {}
        module = transformers.BertModel(transformers.BertConfig(**kw)).eval()
        seq, packed, names, desc = args.bert_seq, False, ["input_ids", "attention_mask"], "BertModel"
    elif name == "llama":
        kw = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=1024) if args.quick else dict(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=32000)
        cfg = transformers.LlamaConfig(**kw, max_position_embeddings=max(2048, args.llama_seq), use_cache=False)
        module = transformers.LlamaModel(cfg).eval()
        seq, packed, names, desc = args.llama_seq, True, ["input_ids"], "LlamaModel (last_hidden_state)"
    else:
        raise ValueError(f"unknown model {name!r}: pick from {', '.join([*TIMM, 'bert', 'llama'])}")
    c = module.config
    desc += f" ({c.num_hidden_layers} layers, hidden {c.hidden_size}, random init); inputs: help-topic sentences as bytes"
    vocab, off, batches = c.vocab_size, 0, []
    for _ in range(n_cal + n_acc):  # calibration and accuracy sentences are disjoint
        ids, mask, off = _text_rows(batch, seq, vocab, off, packed)
        batches.append((ids, mask) if len(names) == 2 else (ids,))
    return Zoo(name, desc, module, names, False, batches[:n_cal], batches[n_cal:], 1 if len(names) == 2 else None)


def _serving(name: str, args: argparse.Namespace) -> int:
    if args.quick:
        return 2
    return {"bert": args.bert_batch, "llama": args.llama_batch}.get(name) or (
        args.vit_batch if name.startswith("vit") else (args.cnn_batch or TIMM[name]))


# ---------------------------------------------------------------------------------------------- helpers
class OverBudget(Exception):
    pass


class Skipped(Exception):
    """A config that cannot run here (fp8 below compute capability 8.9): its row says so, not as a failure."""


@contextlib.contextmanager
def _budget(seconds: float) -> Iterator[None]:
    """Raise OverBudget in this (main) thread after ``seconds`` (SIGALRM; 0 or no SIGALRM: no guard)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(*_: Any) -> None:
        raise OverBudget(f"build over budget (> {seconds:g} s, --max-build-s)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _ieee_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions without TF32 for the reference, put back afterwards."""
    saved = []
    for mod, key in ((torch.backends.cuda.matmul, "fp32_precision"), (torch.backends.cudnn.conv, "fp32_precision")):
        try:
            saved.append((mod, key, getattr(mod, key)))
            setattr(mod, key, "ieee")
        except (AttributeError, RuntimeError):  # older torch: the legacy switches
            pass
    if not saved:
        saved = [(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32),
                 (torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)]
        for mod, key, _ in saved:
            setattr(mod, key, False)
    try:
        yield
    finally:
        for mod, key, value in saved:
            setattr(mod, key, value)


def _first(out: Any) -> torch.Tensor:
    """The first output tensor: last_hidden_state of a Hugging Face output, the logits of a CNN."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first(out[0])
    return out[0] if hasattr(out, "keys") else out.last_hidden_state


def _accuracy(zoo: Zoo, refs: list[torch.Tensor], fn: Callable[..., Any]) -> dict[str, float]:
    """Mean per-sample cosine of the flattened outputs to fp32's, and the max abs error (padding masked out)."""
    cos, err = [], 0.0
    for xs, ref in zip(zoo.evals, refs):
        got = _first(fn(*xs)).float().cpu()
        ref_, got_ = ref, got
        if zoo.mask_index is not None:
            m = xs[zoo.mask_index].to(got.dtype).reshape(*got.shape[:2], *[1] * (got.dim() - 2))
            ref_, got_ = ref * m, got * m
        cos.append(torch.nn.functional.cosine_similarity(ref_.flatten(1).double(), got_.flatten(1).double(), dim=1))
        err = max(err, (got_ - ref_).abs().max().item())
    return {"cosine": round(torch.cat(cos).mean().item(), 5), "max_abs_err": float(f"{err:.4g}")}


def _paired(fns: dict[str, Callable[[], Any]], device: torch.device, args: argparse.Namespace) -> dict[str, float]:
    """Median ms of each function, timed in ``--rounds`` rounds whose order rotates, so drift hits all alike."""
    keys, times = list(fns), {k: [] for k in fns}
    per = max(1, args.iters // args.rounds)
    with torch.no_grad():
        for r in range(args.rounds):
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                times[k] += time_steps(fns[k], device, warmup=args.warmup if r == 0 else 3, iters=per)
    return {k: 1e3 * median(v) for k, v in times.items()}


# ---------------------------------------------------------------------------------------------- one group
def run_group(name: str, kind: str, args: argparse.Namespace, device: torch.device, emit: Callable[[dict], None]) -> None:
    """Every config of ``--configs`` for one model at one batch; each result goes to ``emit`` as it lands."""
    batch = _serving(name, args) if kind == "serving" else int(kind)
    base = {"model": name, "batch": batch, "batch_kind": "serving" if kind == "serving" else str(batch)}
    torch.compiler.reset()
    try:
        zoo = _make(name, batch, args)
    except Exception as exc:  # noqa: BLE001 - a model that cannot be made is a row, not the end of the run
        emit({**base, "config": "setup", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        return
    base["shape"] = ",".join("x".join(map(str, x.shape)) for x in zoo.evals[0])
    base["desc"] = zoo.desc
    cuda = device.type == "cuda"
    half = torch.float16 if cuda else torch.float32  # CPU: the "fp16" configs run in fp32
    cl = zoo.image and cuda

    def dev(xs: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        out = tuple(x.to(device, dtype) if x.is_floating_point() and dtype else x.to(device) for x in xs)
        return tuple(x.contiguous(memory_format=torch.channels_last) if cl and x.dim() == 4 else x for x in out)

    def call(m: torch.nn.Module) -> Callable[..., Any]:
        return (lambda *xs: m(*xs)) if zoo.image else (lambda *xs: m(**dict(zip(zoo.names, xs))))

    try:
        ref_m = copy.deepcopy(zoo.module).to(device)
        with torch.no_grad(), _ieee_fp32():
            refs = [_first(call(ref_m)(*dev(xs, torch.float32))).float().cpu() for xs in zoo.evals]
        del ref_m
    except Exception as exc:  # noqa: BLE001
        emit({**base, "config": "reference", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        return
    anchors: dict[str, Callable[[], Any]] = {}  # alive for the group: compile_ro, engine_fp16
    ms_of: dict[str, float] = {}
    order = [c for c in ("compile_ro", "eager_fp16", "compile_default", "engine_fp16", *LOWP) if c in args.configs]
    done: dict[str, dict[str, Any]] = {}
    for cfg in order:
        row: dict[str, Any] = {**base, "config": cfg}
        if args.budget_s and time.perf_counter() - args.t_start > args.budget_s:
            emit({**row, "error": f"skipped: past --budget-s {args.budget_s:g} s of this run"})
            continue
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step, acc_fn, extra = _prepare(cfg, zoo, args, device, half, dev, call)
            row.update(extra)
            if cfg != "eager_fp16":
                row["build_s"] = round(time.perf_counter() - t0, 1)
            lowp = [str(w.message).split("\n")[0][:160] for w in caught if "accuracy" in str(w.message).lower()
                    or "float" in str(w.message).lower()]
            if lowp:
                row["build_warning"] = lowp[0]
            with torch.no_grad():
                row.update(_accuracy(zoo, refs, acc_fn))
            live = {k: v for k, v in anchors.items() if k == "compile_ro" or cfg in LOWP}
            ms = _paired({cfg: step, **live}, device, args)
            row["ms"] = round(ms[cfg], 4)
            row["throughput"] = round(batch / (ms[cfg] / 1e3), 1)
            ms_of[cfg] = ms[cfg]
            if cuda and args.kernel_time:
                with torch.no_grad():
                    kernels = gpu_kernels(step, 5)
                row["gpu_ms"] = round(sum(sum(v) for v in kernels.values()) / 5 / 1e3, 4)
                row["kernels"] = kernel_breakdown(kernels, 5)  # where the GPU time goes (JSON only)
            if cfg == "compile_ro":
                row["x_vs_ro"] = 1.0
            elif "compile_ro" in ms:
                row["x_vs_ro"], row["ro_paired_ms"] = round(ms["compile_ro"] / ms[cfg], 3), round(ms["compile_ro"], 4)
            if "engine_fp16" in ms:
                row["x_vs_engine_fp16"] = round(ms["engine_fp16"] / ms[cfg], 3)
                row["engine_fp16_paired_ms"] = round(ms["engine_fp16"], 4)
            if cfg == "eager_fp16":  # the rows before it get their ratio now (written with the next row)
                for r in done.values():
                    r["x_vs_eager"] = round(ms[cfg] / r["ms"], 3)
            if "eager_fp16" in ms_of:
                row["x_vs_eager"] = round(ms_of["eager_fp16"] / ms[cfg], 3)
            done[cfg] = row
            if cfg in ("compile_ro", "engine_fp16"):
                anchors[cfg] = step
            del step, acc_fn
        except Skipped as exc:
            row["error"] = f"skipped: {exc}"
        except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others' numbers
            row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            if args.verbose:
                traceback.print_exc()
            if cuda and isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
        emit(row)
    anchors.clear()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _prepare(cfg: str, zoo: Zoo, args: argparse.Namespace, device: torch.device, half: torch.dtype,
             dev: Callable, call: Callable) -> tuple[Callable[[], Any], Callable[..., Any], dict[str, Any]]:
    """Build ``cfg`` and warm it up (inside the build budget): (timed step, accuracy fn, row fields)."""
    x0 = zoo.evals[0]
    if cfg in ("eager_fp16", "compile_default", "compile_ro"):
        m = copy.deepcopy(zoo.module).to(device, half)
        if zoo.image and device.type == "cuda":
            m = m.to(memory_format=torch.channels_last)
        fn = call(m)
        if cfg != "eager_fp16":
            fn = call(torch.compile(m, mode="reduce-overhead" if cfg == "compile_ro" else "default", dynamic=False))
        xs0 = dev(x0, half)
        mark = torch.compiler.cudagraph_mark_step_begin if cfg == "compile_ro" else (lambda: None)

        def acc(*xs: torch.Tensor) -> torch.Tensor:
            mark()  # a CUDA-graph output is overwritten by the next replay: copy it first
            return _first(fn(*dev(xs, half))).clone()
        with _budget(args.max_build_s if cfg != "eager_fp16" else 0), torch.no_grad():
            for _ in range(3):  # compiles (and records the CUDA graph) here, not in the timing
                fn(*xs0)
        return (lambda: fn(*xs0)), acc, {"precision": "fp16" if half == torch.float16 else "fp32"}
    from overdrive.engine import Builder, BuildConfig, ShapeProfile
    from overdrive.engine.runtime import fusions_summary

    prec = cfg.removeprefix("engine_").removesuffix("_qres").removesuffix("_cublas").removesuffix("_siblings")
    if prec == "fp16" and device.type == "cpu":
        prec = "fp32"
    if prec == "fp8":
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if cc is None or cc < (8, 9):
            raise Skipped(f"fp8 needs a CUDA GPU of compute capability >= 8.9 (here: {cc or 'CPU'})")
    prof = tuple(ShapeProfile.fixed(n, tuple(x.shape)) for n, x in zip(zoo.names, x0))
    io = {}
    if device.type == "cuda" and args.engine_io == "fp16":  # fp16 in and out, as the compile baselines take
        io = {"output_io_formats": ("fp16:chw",), **({"input_io_formats": ("fp16:hwc",)} if zoo.image else {})}
    if args.compile_mode:
        io["compile_mode"] = args.compile_mode
    bcfg = BuildConfig(precision=prec, device=str(device), backend=args.backend, profiles=prof,
                       quantize_residuals=cfg.endswith("_qres"),
                       lowp_linears="cublas" if cfg.endswith("_cublas") else "timed",
                       sibling_gemms=True if cfg.endswith("_siblings") else None, **io)
    calib = zoo.calib if prec in ("int8", "fp8") else None
    note = ""
    with _budget(args.max_build_s):
        try:
            eng = Builder(bcfg).build(zoo.module, x0, input_names=zoo.names, calib=calib)
        except OverBudget:
            raise
        except Exception as exc:  # noqa: BLE001 - fp16 I/O refused: the default fp32 bindings instead
            if not io:
                raise
            note = f"fp16 I/O failed ({type(exc).__name__}: {str(exc)[:80]}); fp32 I/O; "
            eng = Builder(bcfg.replace(input_io_formats=(), output_io_formats=())).build(
                zoo.module, x0, input_names=zoo.names, calib=calib)
        xs0 = eng.check_inputs(x0)  # on the device, in the binding's type and layout
        with torch.no_grad():
            for _ in range(3):
                eng.runner(*xs0)
    info = eng.info
    kept = eng.header.get("layers_kept_float") or {}
    ops = (info.get("int8") or {}).get("ops")
    meta = eng.header.get("backend_meta", {})
    fusions = fusions_summary(meta)  # the line overdrive build prints
    whole = info.get("whole_engine")  # the int8/fp8 engine timed whole against its float twin at build
    layers = note + (f"kept float: {len(kept)}" if kept else "") + (f" ops: {ops}" if ops else "") + \
        (f"; {fusions}" if fusions else "") + (f"; whole engine {whole['why']}: kept {whole['kept']}" if whole else "") + \
        ("; every layer timed faster in float: the float build" if info.get("float_build") else "")
    # the build kept its float program (whole-engine or per-layer timing): no low precision runs in this row
    runs_float = bool(info.get("float_build")) or bool(whole and whole["kept"] != info["precision"])
    extra = {"precision": info["precision"], "backend": info["backend"], "layers": layers.strip("; ") or None,
             "runs_float": runs_float,
             "builder_accuracy": (info.get("accuracy") or {}).get("cosine"),
             "fusion_timing": {k: meta[k] for k in ("conv_relu_timed", "sibling_gemms_timed") if meta.get(k)},
             "build_phases_s": meta.get("build_phases_s"),  # where the build time went (calibrate, layer timing, ...)
             # why each layer kept float did, and where every layer runs (engine.info['layers']): JSON only
             "kept_float": dict(kept) or None, "layer_placement": info.get("layers") or None}
    return (lambda: eng.runner(*xs0)), (lambda *xs: eng.run(*xs)[0]), extra


# ---------------------------------------------------------------------------------------------- summary
def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geomeans and minima over the zoo of engine fp16 / reduce-overhead and best int8/fp8 / fp16 engine."""
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        if r.get("ms") is not None:
            groups.setdefault((r["model"], r["batch_kind"]), {})[r["config"]] = r
    per: list[dict[str, Any]] = []
    for (model, kind), g in groups.items():
        e = {"model": model, "batch_kind": kind, "fp16_vs_ro": g.get("engine_fp16", {}).get("x_vs_ro")}
        low = [g[c] for c in LOWP if c in g and g[c].get("x_vs_engine_fp16")]
        ok = [r for r in low if (r.get("cosine") or -1) >= TARGETS["min_cosine"]]
        if low:  # the fastest accurate one; the fastest of all when none is accurate
            best = max(ok or low, key=lambda r: r["x_vs_engine_fp16"])
            e.update(best_lowp=best["config"], lowp_vs_fp16=best["x_vs_engine_fp16"], lowp_cosine=best.get("cosine"),
                     lowp_cosine_ok=bool(ok), lowp_runs_float=bool(best.get("runs_float")))
        builds = [r["build_s"] for c, r in g.items() if c.startswith("engine") and r.get("build_s") is not None]
        e["max_engine_build_s"] = max(builds) if builds else None
        per.append(e)
    out: dict[str, Any] = {"per_model": per, "by_batch": {}}
    for kind in ["all", *sorted({e["batch_kind"] for e in per})]:
        es = [e for e in per if kind == "all" or e["batch_kind"] == kind]
        s: dict[str, Any] = {}
        for key, target in (("fp16_vs_ro", TARGETS["fp16_vs_ro"]), ("lowp_vs_fp16", TARGETS["lowp_vs_fp16"])):
            vals = [(e[key], f"{e['model']}@{e['batch_kind']}") for e in es if e.get(key)]
            if not vals:
                s[key] = {"n": 0, "met": None}
                continue
            gm, (mn, where) = _geomean([v for v, _ in vals]), min(vals)
            met = gm >= target and mn >= 1.0
            if key == "lowp_vs_fp16":
                met = met and all(e.get("lowp_cosine_ok") for e in es if e.get(key))
            s[key] = {"n": len(vals), "geomean": round(gm, 3), "min": mn, "min_at": where, "target": target, "met": met}
            if key == "lowp_vs_fp16":  # rows whose int8/fp8 build kept its float program: no low precision runs
                s[key]["runs_float"] = sum(bool(e.get("lowp_runs_float")) for e in es if e.get(key))
        builds = [e["max_engine_build_s"] for e in es if e.get("max_engine_build_s") is not None]
        s["max_engine_build_s"] = max(builds) if builds else None
        out["by_batch"][kind] = s
    return out


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    kinds = summary["by_batch"]
    for kind, s in kinds.items():
        if kind != "all" and len(kinds) == 2:
            continue  # one batch kind: its lines would repeat "all"
        for key, what in (("fp16_vs_ro", "engine fp16 / torch.compile reduce-overhead"),
                          ("lowp_vs_fp16", f"best int8/fp8 engine (cosine >= {TARGETS['min_cosine']}) / fp16 engine")):
            v = s[key]
            if not v["n"]:
                lines.append(f"summary [{kind}] {what}: not measured")
                continue
            lines.append(f"summary [{kind}] {what}: geomean {v['geomean']:.3f}x over {v['n']}, min {v['min']:.3f}x "
                         f"({v['min_at']}); target >= {v['target']}x geomean and >= 1.0x everywhere"
                         + (" with cosine >= 0.99" if key == "lowp_vs_fp16" else "") + f": {'met' if v['met'] else 'NOT met'}"
                         + (f" ({v['runs_float']} of the {v['n']} run their float build: the whole-engine timing kept "
                            "it)" if v.get("runs_float") else ""))
        b = s["max_engine_build_s"]
        if b is not None:
            lines.append(f"summary [{kind}] slowest engine build {b:.0f} s; target <= {TARGETS['build_s']:.0f} s: "
                         f"{'met' if b <= TARGETS['build_s'] else 'NOT met'}")
    return lines


def write(name: str, out_dir: Path, facts: dict[str, Any], rows: list[dict[str, Any]], notes: list[str],
          device_column: bool = False) -> Path:
    from overdrive._utils.table import Table

    summary = summarize(rows)
    t = Table("Zoo summary: per model and batch", ["model", "batch", "engine fp16 / compile RO", "best int8/fp8",
                                                   "best / engine fp16", "its cosine", "slowest engine build s"])
    t.rows = [[e["model"], e["batch_kind"], e.get("fp16_vs_ro"), e.get("best_lowp"), e.get("lowp_vs_fp16"),
               e.get("lowp_cosine"), e.get("max_engine_build_s")] for e in summary["per_model"]]
    columns = [*COLUMNS[:4], "device", *COLUMNS[4:]] if device_column else COLUMNS
    jpath, _ = write_results(name, facts, rows, columns, [*summary_lines(summary), *notes], {"summary": summary},
                             tables=[t], title="Engine zoo: engines vs torch.compile", out_dir=out_dir)
    return jpath


NOTES = [
    "ms: median of CUDA-event (CPU: wall-clock) times per call after warm-up, in rounds interleaved with "
    "torch.compile reduce-overhead and (for int8/fp8) the fp16 engine of the same model and batch; x_vs_ro = "
    "reduce-overhead ms / ms and x_vs_engine_fp16 = fp16 engine ms / ms from those paired rounds (> 1: faster); "
    "x_vs_eager from the unpaired eager fp16 row; gpu_ms (with --kernel-time): GPU kernel time per call "
    "(torch.profiler, 5 calls), so ms - gpu_ms is the time the GPU waits on the host (Python, launches, gaps); the JSON's "
    "kernels field then splits that time by kernel group (int8/fp8 Triton, attention, cuBLAS, cuDNN, Inductor) and "
    "lists the top kernels",
    "accuracy: first output (logits; last_hidden_state) on held-out inputs against the fp32 eager model with TF32 "
    "off: cosine = mean over samples of the cosine of the flattened outputs, max_abs_err over all elements; BERT's "
    "padded tokens are zeroed in both first",
    "inputs: images are random resized crops of scikit-image's sample photographs, ImageNet-normalised (seeded random "
    "normal images when scikit-image is absent; the desc field says which); text is Python's help topics through a "
    "byte tokenizer (token 4 + byte mod (vocab - 4), 0 = pad): one sentence a row for BERT (padded, masked), packed "
    "rows for Llama; calibration and accuracy sentences are disjoint, image crops differ but come from the same photographs",
    "engines: overdrive.engine Builder, backend auto (inductor on CUDA), a static profile at the batch's shape, fp16 "
    "I/O on CUDA (fp16:hwc images) unless --engine-io fp32; int8/fp8 calibrated on --calib-batches batches (at least "
    "--calib-samples samples); build_s: seconds to build (and for compile rows: to compile and record), warm-up "
    "included; layers: low-precision layers kept float by the build's timing, and int8 kernels; whole engine: the "
    "int8/fp8 engine timed at build against the same engine with every low-precision layer float, and the one kept",
    "torch.compile: fp16 model (channels_last for images on CUDA), dynamic=False, a fresh copy per config",
    "on CPU (--quick) the fp16 configs run in fp32 (eager, compile, and an fp32 engine), with one intra-op thread; "
    "--quick models are tiny stand-ins (a small ResNet for every timm name, 2-layer BERT and Llama), batch 2",
]


# ---------------------------------------------------------------------------------------------- main
def _merge(patterns: str, name: str, out_dir: Path) -> Path:
    """Join split runs: a later file's row replaces an earlier one of the same model, batch and config, except that
    an fp16 engine row measured without torch.compile beside it (no x_vs_ro) leaves one that has it (every ratio is
    paired within its own run, so the low-precision rows of a later run still compare with their own fp16 engine).
    Rows from runs on different GPUs carry a ``device`` column."""
    rows, sources, meta, devices = {}, [], {}, []
    for pat in patterns.split(","):
        for path in sorted(glob.glob(pat)):
            if Path(path).stem == name or Path(path).stem.endswith("_quick"):
                continue  # the merged file itself, and CPU smoke runs
            data = json.loads(Path(path).read_text())
            meta = meta or data["meta"]
            sources.append(Path(path).name)
            device = data["meta"].get("device", "?")
            devices += [device] if device not in devices else []
            for r in data["results"].get("rows", []):
                key = (r["model"], r.get("batch_kind"), r["config"])
                old = rows.get(key)
                if (old is not None and r["config"] == "engine_fp16" and r.get("x_vs_ro") is None
                        and old.get("x_vs_ro") is not None):
                    continue
                rows[key] = {**r, "device": r.get("device", device)}
    facts = {**device_facts(torch.device("cpu")), **{k: meta[k] for k in ("device", "compute_capability", "torch",
                                                                         "cuda", "python", "overdrive") if k in meta},
             "merged_from": sources}  # the measuring machine's facts, this checkout's commit and date
    if len(devices) > 1:
        facts["device"] = "; ".join(devices) + " (each row's device column says which)"
    return write(name, out_dir, facts, list(rows.values()), NOTES, device_column=len(devices) > 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help=f"comma list of {', '.join([*TIMM, 'bert', 'llama'])} (or vit, "
                   "convnext, efficientnet); default all (--quick: resnet50,bert,llama as tiny stand-ins)")
    p.add_argument("--batches", default=None, help="comma list: 'serving' (the model's serving batch) and/or "
                   "integers; default serving,1 (--quick: serving, which is 2)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {', '.join(CONFIGS + EXTRA_CONFIGS)} (default: the first six)")
    p.add_argument("--device", default=None, help="default cuda when present (--quick: cpu)")
    p.add_argument("--quick", action="store_true", help="tiny stand-in models, batch 2, few iterations (CPU smoke run)")
    p.add_argument("--cnn-batch", type=int, default=None, help="serving batch of the CNNs (default 256; ConvNeXt 128)")
    p.add_argument("--vit-batch", type=int, default=128)
    p.add_argument("--bert-batch", type=int, default=32)
    p.add_argument("--bert-seq", type=int, default=128)
    p.add_argument("--llama-batch", type=int, default=16)
    p.add_argument("--llama-seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=None, help="timed calls per config (default 60; --quick 6)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--calib-batches", type=int, default=2)
    p.add_argument("--calib-samples", type=int, default=32, help="at least this many calibration samples")
    p.add_argument("--acc-samples", type=int, default=16, help="at least this many held-out samples for accuracy")
    p.add_argument("--backend", default="auto")
    p.add_argument("--compile-mode", default=None, help="the engines' BuildConfig.compile_mode (default: the "
                   "builder's choice, reduce-overhead on CUDA); e.g. max-autotune (Inductor times GEMM tactics, Triton "
                   "templates with fused epilogues among them)")
    p.add_argument("--engine-io", choices=("fp16", "fp32"), default="fp16", help="engine bindings' float type on CUDA")
    p.add_argument("--max-build-s", type=float, default=120.0, help="per build or compile (SIGALRM; 0: no limit)")
    p.add_argument("--budget-s", type=float, default=0, help="skip configs that would start after this many seconds "
                   "of the run (0: none); keeps a run inside a wall-clock limit")
    p.add_argument("--out", default=None, help="results name (default engine_zoo; --quick engine_zoo_quick)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--merge", default=None, help="comma list of globs of results JSON files to join into --out")
    p.add_argument("--kernel-time", action="store_true", help="also profile each config (torch.profiler, 5 calls) for "
                   "gpu_ms, its GPU kernel time per call; off by default: in the one run with it on, the engines' "
                   "per-call times were 1.5-3x those of the runs without it, which is not yet explained")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing configs")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    name = args.out or ("engine_zoo_quick" if args.quick else "engine_zoo")
    if args.merge:
        print(f"wrote {_merge(args.merge, name, out_dir)}")
        return 0
    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    if args.quick:  # seconds per model on a 2-core CPU
        args.warmup, args.rounds = min(args.warmup, 2), min(args.rounds, 2)
        args.bert_seq, args.llama_seq = min(args.bert_seq, 32), min(args.llama_seq, 32)
    threads = torch.get_num_threads()
    if args.quick and device.type == "cpu":  # one intra-op thread: on a shared CPU two spinning threads stall each other
        torch.set_num_threads(1)
    args.iters = args.iters or (6 if args.quick else 60)
    models = [ALIASES.get(m, m) for m in (args.models or ("resnet50,bert,llama" if args.quick else
                                                         ",".join([*TIMM, "bert", "llama"]))).split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.configs if c not in CONFIGS + EXTRA_CONFIGS]
    if bad:
        p.error(f"--configs {bad}: pick from {', '.join(CONFIGS + EXTRA_CONFIGS)}")
    kinds = [k for k in (args.batches or ("serving" if args.quick else "serving,1")).split(",") if k]
    if any(k != "serving" and not k.isdigit() for k in kinds):
        p.error(f"--batches {args.batches!r}: give 'serving' and/or integers, like serving,1")
    facts = device_facts(device)
    facts.update(models=models, batches=kinds, configs=args.configs, iters=args.iters, rounds=args.rounds,
                 engine_io=args.engine_io, compile_mode=args.compile_mode, max_build_s=args.max_build_s,
                 budget_s=args.budget_s, quick=args.quick,
                 threads=torch.get_num_threads())
    rows: list[dict[str, Any]] = []
    t_start = args.t_start = time.perf_counter()

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        facts["wall_s"] = round(time.perf_counter() - t_start, 1)
        write(name, out_dir, facts, rows, NOTES)  # after every row: a run cut off keeps what it measured
        bits = [f"{row['model']} b{row['batch']} {row['config']}"]
        for k, fmt in (("ms", "{:.3f} ms"), ("x_vs_ro", "{:.2f}x RO"), ("x_vs_engine_fp16", "{:.2f}x fp16-eng"),
                       ("cosine", "cos {:.4f}"), ("max_abs_err", "maxerr {:.3g}"), ("build_s", "build {:.0f} s")):
            if row.get(k) is not None:
                bits.append(fmt.format(row[k]))
        if row.get("build_phases_s"):
            bits.append("(" + ", ".join(f"{k} {v:.0f} s" for k, v in row["build_phases_s"].items()) + ")")
        if row.get("error"):
            bits.append(f"ERROR {row['error'][:160]}")
        print(" | ".join(bits), flush=True)

    try:
        for model in models:
            for kind in kinds:
                run_group(model, kind, args, device, emit)
    finally:
        torch.set_num_threads(threads)  # main() may be called in-process (the test)
    jpath = write(name, out_dir, facts, rows, NOTES)
    for line in summary_lines(summarize(rows)):
        print(line)
    print(f"wrote {jpath} and .md ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
