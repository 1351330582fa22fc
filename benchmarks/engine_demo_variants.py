"""The demo's engine (its ResNet-18 on one-channel 224x224 digits, batch 256, static profile) built with each default
CUDA pass turned off in turn, and saved and loaded as the demo does, each timed against
torch.compile(mode="reduce-overhead") in the same run, with the top GPU kernels of each: which build option or step
makes the demo's engine slow.

    python benchmarks/engine_demo_variants.py   # CUDA only; one JSON line per variant, results in
                                                # benchmarks/results/engine_demo_variants.{json,md}
    python benchmarks/engine_demo_variants.py --variants "static default,static loaded" --name engine_demo_variants_x
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from _common import device_facts, gpu_kernels, median, time_steps, write_results

from overdrive.demo.workloads import choose_workload
from overdrive.engine import Builder, Engine, ShapeProfile

VARIANTS = {  # name: (build options, precision, saved and loaded as the demo does)
    "static default": ({}, "fp16", False),
    "static loaded": ({}, "fp16", True),
    "static no conv fusion": ({"conv_fusion": False}, "fp16", True),  # no stem padding either
    "static no freezing": ({"freezing": False}, "fp16", True),
    "fp8 loaded": ({}, "fp8", True),
    "dynamic default": ({"dynamic": True}, "fp16", False),
}


def _ms(fn, x) -> float:  # noqa: ANN001 - median ms of 30 calls after 5 warm-up calls (CUDA events)
    return 1e3 * median(time_steps(lambda: fn(x), torch.device("cuda"), warmup=5, iters=30))


def _top(step, n: int = 4) -> str:  # noqa: ANN001 - the n kernels with the most GPU time per call
    k = gpu_kernels(step, calls=3)
    tot = sorted(((sum(v) / 3e3, len(v) // 3, name) for name, v in k.items()), reverse=True)
    all_ms = sum(t for t, _, _ in tot)
    return f"{all_ms:.2f} GPU ms; " + "; ".join(f"{name[:70]} x{c} {t:.2f} ms" for t, c, name in tot[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    ap.add_argument("--name", default="engine_demo_variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    w = choose_workload(torch.device("cuda"), quick=False)
    model = w.make_model().eval()
    B, shape = w.infer_batch, w.input_shape
    x = torch.rand(B, *shape, device="cuda")
    m16 = model.cuda().half().to(memory_format=torch.channels_last)
    ro = torch.compile(m16, mode="reduce-overhead")

    def ro_step(t: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return ro(t.half().contiguous(memory_format=torch.channels_last))

    with torch.no_grad():
        ro_ms = _ms(ro_step, x)
        rows = [{"variant": "compile_ro", "ms": round(ro_ms, 3), "x_vs_ro": 1.0, "top": _top(lambda: ro_step(x))}]
    print(json.dumps(rows[0]), flush=True)
    fixed = [ShapeProfile.fixed("x", (B, *shape))]
    dyn = [ShapeProfile("x", (1, *shape), (B, *shape), (B, *shape))]
    model = model.float().cpu()
    calib = [(torch.rand(64, *shape),) for _ in range(8)]  # the demo calibrates on 8 batches of 64
    for name in args.variants.split(","):
        kw, prec, reload = VARIANTS[name.strip()]
        kw = dict(kw)
        profiles = dyn if kw.pop("dynamic", False) else fixed
        eng = Builder(precision=prec, device="cuda", profiles=profiles, **kw).build(
            model, calib=calib if prec != "fp16" else None)
        if reload:
            with tempfile.TemporaryDirectory() as tmp:
                eng.save(Path(tmp) / "m.engine")
                eng = Engine.load(Path(tmp) / "m.engine")
        ms = _ms(eng, x)  # the call a user (and the demo) makes
        meta = eng.header["backend_meta"]
        rows.append({"variant": name, "ms": round(ms, 3), "x_vs_ro": round(ro_ms / ms, 3),
                     **{k: meta.get(k) for k in ("compile_mode", "freezing", "conv_relu_fused", "stem_channels_padded",
                                                  "cuda_graph")},
                     "via": eng.runner.via, "accuracy_on": (eng.info.get("accuracy") or {}).get("on"),
                     "top": _top(lambda: eng(x))})
        print(json.dumps(rows[-1]), flush=True)
        del eng
    write_results(args.name, device_facts(torch.device("cuda")), rows,
                  ["variant", "ms", "x_vs_ro", "compile_mode", "freezing", "conv_relu_fused", "stem_channels_padded",
                   "cuda_graph", "via", "accuracy_on", "top"],
                  ["ms: median of 30 engine calls (CUDA events; engine(x), the call the demo times), batch 256 fp32 "
                   "one-channel input on the GPU; x_vs_ro: torch.compile(mode='reduce-overhead') fp16 channels_last "
                   "ms / variant ms, same run; top: GPU kernel time per call and its largest kernels"],
                  title="The demo's ResNet-18 engine: which build option or step makes it slow")


if __name__ == "__main__":
    main()
