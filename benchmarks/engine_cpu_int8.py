"""CPU int8 engines on ONNX Runtime: the int8 layout chosen at build time against the inputs-only layout (the only
one before), the fp32 engine, torch.compile and eager fp32, all in one run.

Models (random weights, BN statistics set, no network): the CPU demo's ResNet (width 16, one block per stage) on
32x32 digits at batch 128; a ResNet-18 (width 64) on 112x112 digits at batch 16; a MobileNet-style stack of
depthwise-separable blocks on 64x64 digits at batch 32; a 4-layer BERT-style encoder (transformers' BertModel
from a config, hidden 256) at 16x128. Calibration and accuracy use scikit-learn's handwritten digits, upscaled
(calibration: 4 batches of training images; accuracy: the cosine of the outputs to eager fp32 on a held-out
batch); the encoder reads token ids of Python's help text.

Times are medians of calls timed in interleaved rounds (every configuration once per round), so the ratios
compare calls made side by side on a shared machine.

    python benchmarks/engine_cpu_int8.py                       # all models, about 3 minutes on 2 cores
    python benchmarks/engine_cpu_int8.py --models demo_resnet --rounds 10
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _common import device_facts, write_results  # noqa: E402

MODELS = ("demo_resnet", "resnet18_112", "mobilenet_64", "bert_mini")
COLUMNS = ["model", "batch", "config", "ms", "x_vs_eager", "x_vs_compile", "x_vs_engine_fp32", "cosine", "build_s",
           "layout", "int8_ops"]


class _DepthwiseSeparable(nn.Sequential):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin), nn.ReLU(),
                         nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def _mobilenet() -> nn.Module:
    chans = [(32, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 512, 2)]
    return nn.Sequential(nn.Conv2d(1, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         *[_DepthwiseSeparable(a, b, s) for a, b, s in chans],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))


def _set_bn(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 0.4 - 0.2)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
    return model.eval()


def _digits(size: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (x - 0.3) / 0.4


def _text_ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    import pydoc

    text = pydoc.render_doc(str, renderer=pydoc.plaintext).encode()
    ids = torch.tensor(list(text[: batch * seq * 2]), dtype=torch.long) % vocab
    return ids[: batch * seq * 2].view(2 * batch, seq)


def _make(name: str) -> tuple[nn.Module, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(model, calibration batches, timing batch, held-out batch)."""
    torch.manual_seed(0)
    if name == "bert_mini":
        from transformers import BertConfig, BertModel

        cfg = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                         vocab_size=256, max_position_embeddings=128)
        model = BertModel(cfg, add_pooling_layer=False).eval()
        ids = _text_ids(16, 128, 256)
        return model, [ids[:16]], ids[:16], ids[16:]
    from overdrive.recipes.models import ResNet

    model, size, batch = {"demo_resnet": (lambda: ResNet(16, (1, 1, 1, 1), "small"), 32, 128),
                          "resnet18_112": (lambda: ResNet(64, (2, 2, 2, 2), "imagenet"), 112, 16),
                          "mobilenet_64": (_mobilenet, 64, 32)}[name]
    x = _digits(size)
    calib = [x[i * batch:(i + 1) * batch] for i in range(4)]
    return _set_bn(model()), calib, x[-2 * batch:-batch], x[-batch:]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, (list, tuple)):
        return out[0]
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def run_model(name: str, rounds: int) -> list[dict[str, Any]]:
    from overdrive.engine import Builder, ShapeProfile
    from overdrive.engine.backends import onnxruntime as ortb

    model, calib, x, held = _make(name)
    pname = "input_ids" if name == "bert_mini" else "x"
    profile = [ShapeProfile.fixed(pname, tuple(x.shape))]
    fns: dict[str, Callable[[torch.Tensor], Any]] = {"eager fp32": model}
    built: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(x)
    built["torch.compile"] = {"build_s": time.perf_counter() - t0}
    fns["torch.compile"] = compiled
    calib_batches = [(c,) for c in calib]
    for label, prec, gain in (("engine fp32", "fp32", None), ("engine int8 (inputs-only layout)", "int8", math.inf),
                              ("engine int8 (chosen layout)", "int8", ortb.INTEGER_LAYOUT_GAIN)):
        saved = ortb.INTEGER_LAYOUT_GAIN
        if gain is not None:
            ortb.INTEGER_LAYOUT_GAIN = gain
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                eng = Builder(precision=prec, backend="onnxruntime", device="cpu", profiles=profile).build(
                    model, (x,), calib=calib_batches if prec == "int8" else None)
        finally:
            ortb.INTEGER_LAYOUT_GAIN = saved
        meta = eng.header["backend_meta"]
        built[label] = {"build_s": time.perf_counter() - t0, "layout": meta.get("int8_layout"),
                        "int8_ops": meta.get("int8_ops"), "layouts": meta.get("int8_layouts")}
        fns[label] = eng
    with torch.no_grad():
        ref = _first(model(held))
        cos = {k: _cos(_first(f(held)), ref) for k, f in fns.items()}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f(x)
        for _ in range(rounds):
            for k, f in fns.items():
                t = time.perf_counter()
                f(x)
                times[k].append((time.perf_counter() - t) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for k in fns:
        b = built.get(k, {})
        rows.append({"model": name, "batch": tuple(x.shape)[0], "config": k, "ms": ms[k],
                     "x_vs_eager": ms["eager fp32"] / ms[k], "x_vs_compile": ms["torch.compile"] / ms[k],
                     "x_vs_engine_fp32": ms["engine fp32"] / ms[k], "cosine": cos[k], "build_s": b.get("build_s"),
                     "layout": b.get("layout"), "int8_ops": b.get("int8_ops"),
                     **({"layouts_at_build": b["layouts"]} if b.get("layouts") else {})})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per model")
    ap.add_argument("--out", default="engine_cpu_int8")
    args = ap.parse_args(argv)
    facts = device_facts(torch.device("cpu"))
    from overdrive._utils.device import cpu_summary

    facts["cpu"] = cpu_summary()
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows += run_model(name, args.rounds)
        for r in rows[-5:]:
            print(f"{r['model']:>13} {r['config']:<34} {r['ms']:8.2f} ms  x{r['x_vs_engine_fp32']:.2f} fp32 engine  "
                  f"x{r['x_vs_compile']:.2f} compile  cos {r['cosine']:.5f}  {r['layout'] or ''}", flush=True)
    notes = ["x_vs_*: the row's speed over that configuration's (median times of the same interleaved rounds)",
             "layout: the onnxruntime backend's int8 layout; inputs-only = Q/DQ on the inputs of Conv/Gemm/MatMul "
             "(convolutions run in fp32 behind DequantizeLinear), integer = ONNX Runtime's own layout (QLinearConv, "
             "QLinearAdd, ...); 'chosen' is the build's timed choice (engine/backends/onnxruntime.py)",
             "cosine: outputs on a held-out batch against eager fp32"]
    write_results(args.out, facts, rows, COLUMNS, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
