"""Why the batch-256 engines are where they are: compile variants side by side, and a kernel profile.

For ResNet-50 (fp16, channels_last) and BERT-base (seq 128) at batch 256 on one GPU, times in the
same run: eager (the baseline; cudnn.benchmark off, as plain PyTorch runs), eager with
cudnn.benchmark, and the engine's compile path (torch.export -> torch.compile) with and without
Inductor's freezing (constant-folds weights: conv+BN folding, weight layouts fixed at build time).
Then torch.profiler over a few calls of eager and of the best variant: GPU time per kernel class
(convolution, GEMM, attention, Triton-generated, other elementwise, copies) and the top kernels,
with the achieved TFLOP/s of the whole step against the measured matmul ceiling.

    python benchmarks/engine_profile.py                 # H200: about 4 minutes
    python benchmarks/engine_profile.py --models bert   # one model
    python benchmarks/engine_profile.py --models bert_ids --engines-only --engines bf16   # BERT without a mask input
Writes benchmarks/results/engine_profile.json and .md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, gpu_kernels, write_results  # noqa: E402

# forward FLOPs per sample (multiply-add = 2): ResNet-50 at 224 is 4.09 GMAC; BERT-base seq 128:
# 2 * 85.0M encoder weights * 128 tokens + attention (2 * 2 * 128^2 * 768 per layer, 12 layers)
FLOPS = {"resnet50": 2 * 4.09e9, "bert": 2 * 85.0e6 * 128 + 12 * 4 * 128 * 128 * 768}
FLOPS["bert_ids"] = FLOPS["bert"]  # BERT called with input_ids alone (eager and engine alike): no mask input

KERNEL_CLASSES = [  # first match wins
    ("int8/fp8 conv (overdrive Triton)", re.compile(r"^_conv_kernel")),  # overdrive::conv2d_q
    ("triton (inductor fused)", re.compile(r"^triton_", re.I)),  # before conv: "triton_poi_fused_add_convolution_relu"
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa", re.I)),
    ("convolution", re.compile(r"conv|fprop|dgrad|implicit_gemm|cudnn|winograd|nchwToNhwc|nhwcToNchw", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|cublas|sm90_xmma|_mm_|matmul|splitK", re.I)),
    ("copy / layout", re.compile(r"copy|memcpy|memset|transpose|permute", re.I)),
    ("elementwise / reduce (aten)", re.compile(r"elementwise|reduce|softmax|layer_norm|norm|gelu|relu|add|mul", re.I)),
]


def classify(name: str) -> str:
    for cls, rx in KERNEL_CLASSES:
        if rx.search(name):
            return cls
    return "other"


def time_fn(fn: Callable[[], Any], iters: int = 30, warmup: int = 5) -> float:
    """Median seconds per call by CUDA events (overdrive's own timer)."""
    from overdrive._utils.timing import time_fn as timer

    ts = sorted(timer(fn, torch.device("cuda"), warmup=warmup, repeat=iters))
    return ts[len(ts) // 2]


def kernel_profile(fn: Callable[[], Any], calls: int = 5) -> dict[str, Any]:
    """GPU time per kernel class and the top 12 kernels, per call, from torch.profiler."""
    kernels = gpu_kernels(fn, calls)
    total = sum(sum(v) for v in kernels.values()) / calls / 1e3  # ms per call
    by_class: dict[str, float] = {}
    for name, ds in kernels.items():
        c = classify(name)
        by_class[c] = by_class.get(c, 0.0) + sum(ds) / calls / 1e3
    top = sorted(((sum(ds) / calls / 1e3, len(ds) // calls, name[:90]) for name, ds in kernels.items()), reverse=True)[:12]
    return {"gpu_ms_per_call": total, "kernels_per_call": sum(len(v) for v in kernels.values()) // calls,
            "by_class_ms": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "top": [{"ms": ms, "count": n, "kernel": k} for ms, n, k in top]}


def resnet50(batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.dtype]:
    import torchvision

    m = torchvision.models.resnet50(weights=None).eval().cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)
    return m, (x,), torch.float16


def bert(batch: int, dtype: torch.dtype = torch.float16) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.dtype]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    m = BertModel(BertConfig()).eval().cuda().to(dtype)
    ids = torch.randint(0, 30522, (batch, 128), device="cuda")
    return m, (ids, torch.ones(batch, 128, dtype=torch.int64, device="cuda")), dtype


def compiled(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], freezing: bool, mode: str = "default",
             **inductor: Any) -> Callable:
    """The engine's path: torch.export, then torch.compile of the exported module (fresh compile)."""
    torch.compiler.reset()
    with torch.no_grad():
        ep = torch.export.export(model, inputs, strict=False)
    with torch._inductor.config.patch(freezing=freezing, **inductor):
        fn = torch.compile(ep.module(), mode=mode, fullgraph=True)
        with torch.inference_mode():
            fn(*inputs)  # compile now, under the patched config
    return fn


class _IdsOnly(torch.nn.Module):
    """BERT called with input_ids alone (no attention mask): every token attends to every token."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> Any:
        return self.m(input_ids=ids)


def plans(name: str, batch: int, quick_only: bool, autotune: bool = False) -> list[tuple[str, Callable[[], tuple[Callable, tuple]], bool]]:
    """(label, () -> (callable, inputs), cudnn.benchmark) for each variant of ``name``."""
    out: list[tuple[str, Callable[[], tuple[Callable, tuple]], bool]] = []
    if name == "resnet50":
        m, x, _ = resnet50(batch)
        out += [("eager fp16", lambda: (m, x), False)]
        if not quick_only:
            out += [("eager fp16 + cudnn.benchmark", lambda: (m, x), True),
                    ("export+compile fp16", lambda: (compiled(m, x, False), x), False)]
        out += [("export+compile fp16 + freezing (the engine)", lambda: (compiled(m, x, True), x), False),
                ("... + conv_1x1_as_mm", lambda: (compiled(m, x, True, conv_1x1_as_mm=True), x), False),
                ("... + cudnn.benchmark", lambda: (compiled(m, x, True), x), True)]
    elif name == "bert_ids":  # eager drops the all-ones mask at run time; the engine's mask pass drops it at build
        m16, (ids, _), _ = bert(batch)
        out += [("eager fp16, input_ids only", lambda: (_IdsOnly(m16).eval(), (ids,)), False)]
    else:
        m16, (ids, mask), _ = bert(batch)
        mb, _, _ = bert(batch, torch.bfloat16)
        n16, nb = _IdsOnly(m16).eval(), _IdsOnly(mb).eval()
        out += [("eager fp16", lambda: (m16, (ids, mask)), False)]
        if not quick_only:
            out += [("export+compile fp16", lambda: (compiled(m16, (ids, mask), False), (ids, mask)), False),
                    ("export+compile fp16 + freezing", lambda: (compiled(m16, (ids, mask), True), (ids, mask)), False),
                    ("eager bf16", lambda: (mb, (ids, mask)), False)]
        out += [("export+compile bf16 + freezing (the engine)", lambda: (compiled(mb, (ids, mask), True), (ids, mask)), False),
                ("eager fp16, input_ids only (no mask)", lambda: (n16, (ids,)), False),
                ("export+compile bf16 + freezing, input_ids only", lambda: (compiled(nb, (ids,), True), (ids,)), False)]
        if autotune:  # minutes of Triton GEMM autotuning (it was still tuning after ~100 s on the H200)
            out += [("export+compile bf16 + freezing + max-autotune (GEMM templates, epilogue fusion)",
                     lambda: (compiled(mb, (ids, mask), True, "max-autotune-no-cudagraphs"), (ids, mask)), False)]
    return out


def variants(name: str, batch: int, quick_only: bool = False, autotune: bool = False,
             eager_only: bool = False) -> list[dict[str, Any]]:
    rows = []
    base = None
    for label, get, bench in plans(name, batch, quick_only, autotune)[:1 if eager_only else None]:
        torch.backends.cudnn.benchmark = bench
        t0 = time.perf_counter()
        try:
            fn, inputs = get()
        except Exception as exc:  # one failing variant must not hide the others
            rows.append({"model": name, "batch": batch, "config": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(rows[-1], flush=True)
            continue
        build_s = time.perf_counter() - t0
        with torch.inference_mode():
            sec = time_fn(lambda: fn(*inputs))
        tput = batch / sec
        base = base or tput
        row = {"model": name, "batch": batch, "config": label, "throughput": tput, "median_ms": sec * 1e3,
               "vs_eager_fp16": tput / base, "tflops": FLOPS[name] * batch / sec / 1e12, "build_s": build_s,
               "_fn": fn, "_inputs": inputs, "_bench": bench}
        rows.append(row)
        print({k: v for k, v in row.items() if not k.startswith("_")}, flush=True)
    torch.backends.cudnn.benchmark = False
    return rows


def engine_rows(name: str, batch: int, precisions: list[str], base: float, io: str = "",
                gemm_gelu: bool = False, device: str = "cuda") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """overdrive Engines for ``precisions`` (fp32 I/O, as `overdrive exec` runs them; and with the ``io`` input
    formats too, e.g. fp16:hwc, when given; and with --gemm-gelu too when ``gemm_gelu``): time and kernel
    profile each."""
    from overdrive.engine import Builder, ShapeProfile

    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).eval()
        inputs: tuple[torch.Tensor, ...] = (torch.randn(batch, 3, 224, 224),)
        names = ["x"]
    else:
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        model = BertModel(BertConfig()).eval()
        inputs = (torch.randint(0, 30522, (batch, 128)), torch.ones(batch, 128, dtype=torch.int64))
        names = ["input_ids", "attention_mask"]
        if name == "bert_ids":
            inputs, names = inputs[:1], names[:1]
    rows, profiles = [], {}
    builds = [(p, f, g) for p in precisions for f in ([""] + ([io] if io else [])) for g in ([False, True] if gemm_gelu else [False])]
    for prec, fmt, gelu in builds:
        label = f"overdrive Engine {prec} ({fmt or 'fp32:chw'} I/O{', --gemm-gelu' if gelu else ''})"
        try:
            t0 = time.perf_counter()
            eng = Builder(precision=prec, device=device, profiles=[ShapeProfile.fixed(n, tuple(x.shape)) for n, x in zip(names, inputs)],
                          input_io_formats=[fmt] if fmt else [], gemm_gelu=gelu).build(model, inputs, input_names=names,
                                                                                        calib=[inputs])
            build_s = time.perf_counter() - t0
            dev = tuple(eng.check_inputs(inputs, {}))  # on the GPU, in the bindings' types and layouts
            sec = time_fn(lambda: eng(*dev))
            profiles[f"{name}: {label}"] = kernel_profile(lambda: eng(*dev))
        except Exception as exc:  # one failing build must not hide the others
            rows.append({"model": name, "batch": batch, "config": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        rows.append({"model": name, "batch": batch, "config": label, "throughput": batch / sec, "median_ms": sec * 1e3,
                     "vs_eager_fp16": batch / sec / base, "tflops": FLOPS[name] * batch / sec / 1e12, "build_s": build_s,
                     "float_remainder": eng.header["backend_meta"].get("float_remainder"),
                     "attention_masks_dropped": eng.header["backend_meta"].get("attention_masks_dropped"),
                     "gemm_gelu_fused": eng.header["backend_meta"].get("gemm_gelu_fused"),
                     "lowp_conv": eng.header["backend_meta"].get("lowp_conv"),
                     "layers_kept_float": eng.header["backend_meta"].get("layers_kept_float")})
        print(rows[-1], flush=True)
        eng = dev = None  # free this engine before the next build
        torch.compiler.reset()
        torch.cuda.empty_cache()
    return rows, profiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--name", default="engine_profile", help="results file name under benchmarks/results/")
    ap.add_argument("--engines-only", action="store_true", help="eager baseline plus the --engines builds, no compile variants")
    ap.add_argument("--engine-io", default="", help="also build each --engines precision with these input formats, e.g. fp16:hwc")
    ap.add_argument("--autotune", action="store_true", help="add BERT with max-autotune (minutes of tuning)")
    ap.add_argument("--engines", default="", help="also build, time and profile overdrive Engines at these precisions, "
                    "e.g. fp16,fp8,int8")
    ap.add_argument("--new-only", action="store_true", help="skip the variants measured in the first profile run")
    ap.add_argument("--gemm-gelu", action="store_true", help="also build each --engines precision with --gemm-gelu")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_profile.py profiles GPU kernels: run it on a CUDA machine")
    facts = device_facts(torch.device("cuda"))
    rows, profiles, notes = [], {}, []
    for name in args.models.split(","):
        rs = variants(name, args.batch, args.new_only, args.autotune, eager_only=args.engines_only)
        ok = [r for r in rs if "throughput" in r]
        eager, best = ok[0], max(ok, key=lambda r: r["throughput"])
        for r in (eager, best):
            torch.backends.cudnn.benchmark = r["_bench"]
            with torch.inference_mode():
                profiles[f"{name}: {r['config']}"] = kernel_profile(lambda: r["_fn"](*r["_inputs"]))
        torch.backends.cudnn.benchmark = False
        rows += [{k: v for k, v in r.items() if not k.startswith("_")} for r in rs]
        if args.engines:
            more, profs = engine_rows(name, args.batch, args.engines.split(","), eager["throughput"], args.engine_io,
                                      args.gemm_gelu)
            rows += more
            profiles.update(profs)
        del rs, ok, eager, best
        torch.compiler.reset()
        torch.cuda.empty_cache()
    for key, p in profiles.items():
        cls = ", ".join(f"{c} {ms:.2f} ms ({ms / p['gpu_ms_per_call']:.0%})" for c, ms in p["by_class_ms"].items())
        notes.append(f"profile {key}: {p['gpu_ms_per_call']:.2f} GPU ms per call in {p['kernels_per_call']} kernels; {cls}")
        notes.append("  top kernels: " + "; ".join(f"{t['kernel']} x{t['count']} {t['ms']:.2f} ms" for t in p["top"][:6]))
    notes.append("tflops: model forward FLOPs / median time; the H200's measured fp16/bf16 matmul ceiling is ~736/765 "
                 "TFLOP/s and its copy bandwidth 4.19 TB/s (ANCHORS.md).")
    write_results(args.name, facts, rows, ["model", "batch", "config", "throughput", "median_ms", "vs_eager_fp16",
                                                   "tflops", "build_s", "error"], notes, {"profiles": profiles})
    print("\n".join(notes))


if __name__ == "__main__":
    main()
