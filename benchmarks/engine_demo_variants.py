"""The demo's engine (ResNet-18, batch 256, dynamic batch profile 1..256) built with each default CUDA pass turned off
in turn, and with a static profile, each timed against torch.compile(mode="reduce-overhead") in the same run: which
build option makes the dynamic-profile engine slow.

    python benchmarks/engine_demo_variants.py   # CUDA only; one JSON line per variant, results in
                                                # benchmarks/results/engine_demo_variants.{json,md}
"""

from __future__ import annotations

import json

import torch
import torchvision
from _common import device_facts, median, time_steps, write_results

from overdrive.engine import Builder, ShapeProfile


def _ms(fn, x) -> float:  # noqa: ANN001 - median ms of 30 calls after 5 warm-up calls (CUDA events)
    return 1e3 * median(time_steps(lambda: fn(x), torch.device("cuda"), warmup=5, iters=30))


def main() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(256, 3, 224, 224, device="cuda")
    m16 = model.cuda().half().to(memory_format=torch.channels_last)
    ro = torch.compile(m16, mode="reduce-overhead")
    with torch.no_grad():
        ro_ms = _ms(lambda t: (torch.compiler.cudagraph_mark_step_begin(), ro(t.half()))[1], x)
    rows = [{"variant": "compile_ro", "ms": round(ro_ms, 3), "x_vs_ro": 1.0}]
    print(json.dumps(rows[0]), flush=True)
    dyn = [ShapeProfile("x", (1, 3, 224, 224), (256, 3, 224, 224), (256, 3, 224, 224))]
    fixed = [ShapeProfile.fixed("x", (256, 3, 224, 224))]
    model = model.float().cpu()
    for name, kw in (("dynamic default", {}), ("dynamic no conv fusion", {"conv_fusion": False}),
                     ("dynamic no freezing", {"freezing": False}), ("static default", {"profiles": fixed})):
        eng = Builder(precision="fp16", device="cuda", **{"profiles": dyn, **kw}).build(model)
        xs = eng.check_inputs((x,))
        ms = _ms(lambda t: eng.runner(t), xs[0])
        meta = eng.header["backend_meta"]
        rows.append({"variant": name, "ms": round(ms, 3), "x_vs_ro": round(ro_ms / ms, 3),
                     **{k: meta.get(k) for k in ("compile_mode", "freezing", "conv_relu_fused", "cuda_graph")}})
        print(json.dumps(rows[-1]), flush=True)
        del eng
    write_results("engine_demo_variants", device_facts(torch.device("cuda")), rows,
                  ["variant", "ms", "x_vs_ro", "compile_mode", "freezing", "conv_relu_fused", "cuda_graph"],
                  ["ms: median of 30 runner calls (CUDA events), batch 256 fp32 input on the GPU; x_vs_ro: "
                   "torch.compile(mode='reduce-overhead') fp16 channels_last ms / variant ms, same run"],
                  title="The demo's ResNet-18 engine: which default build pass makes the dynamic profile slow")


if __name__ == "__main__":
    main()
