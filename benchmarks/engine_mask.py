"""What the engine's constant-attention-mask pass buys: BERT called with input_ids alone.

Hugging Face BERT builds an all-ones padding mask when no attention_mask is given. Eager drops it at run
time (a data-dependent check); an exported graph keeps it, so the engine ran masked attention kernels that
eager does not (on the H200, `engine_profile_variants.md`: 0.75x eager for that variant). The pass
(`overdrive.engine.passes.drop_constant_attention_masks`) removes such masks at build. Same run, same
inputs: eager, the Engine with the pass, and the Engine with the pass switched off.

    python benchmarks/engine_mask.py --device cpu --layers 4 --batch 8          # this 2-core CPU: ~3 minutes
    python benchmarks/engine_mask.py --device cuda --batch 256 --precision bf16   # H200: ~1 minute
Writes benchmarks/results/engine_mask[_<device>].json and .md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, time_steps, write_results  # noqa: E402

HALF = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12, help="BERT-base has 12")
    ap.add_argument("--precision", default="bf16", choices=list(HALF))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--name", default="")
    args = ap.parse_args()

    from transformers import BertConfig, BertModel

    from overdrive.engine import Builder, ShapeProfile

    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = BertModel(BertConfig(num_hidden_layers=args.layers)).eval()
    ids = torch.randint(0, 30522, (args.batch, args.seq))
    eager = copy.deepcopy(model).to(dev, HALF[args.precision] if dev.type == "cuda" else torch.float32)
    precision = args.precision if dev.type == "cuda" else "fp32"
    ids_dev = ids.to(dev)
    rows = []

    def record(config: str, fn, build_s: float | None = None, dropped: int | None = None) -> None:
        with torch.inference_mode():
            ts = time_steps(fn, dev, warmup=3, iters=args.iters)
        sec = statistics.median(ts)
        flops = args.batch * args.seq * args.layers * (2 * 7.08e6 + 4 * args.seq * 768)
        rows.append({"config": config, "seq_per_s": args.batch / sec, "median_ms": sec * 1e3, "tflops": flops / sec / 1e12,
                     "vs_eager": None, "build_s": build_s, "masks_dropped": dropped})
        print(rows[-1], flush=True)

    record(f"eager {precision}, input_ids only [baseline]", lambda: eager(input_ids=ids_dev))
    for label, on in (("Engine, mask pass on (default)", True), ("Engine, mask pass off", False)):
        t0 = time.perf_counter()
        eng = Builder(precision=precision, device=args.device, backend="inductor", drop_constant_masks=on,
                      profiles=[ShapeProfile.fixed("input_ids", tuple(ids.shape))]).build(
            model, (ids,), input_names=["input_ids"])
        build_s = time.perf_counter() - t0
        x = tuple(eng.check_inputs((ids,), {}))
        record(f"{label}, {precision}", lambda: eng(*x), build_s, eng.header["backend_meta"]["attention_masks_dropped"])
        eng = None
        torch.compiler.reset()
    base = rows[0]["seq_per_s"]
    for r in rows:
        r["vs_eager"] = r["seq_per_s"] / base
    name = args.name or ("engine_mask" if dev.type == "cuda" else "engine_mask_cpu")
    notes = [f"BERT ({args.layers} layers, hidden 768) seq {args.seq}, batch {args.batch}, called with input_ids only; "
             f"median of {args.iters} timed calls after 3 warm-up calls ({'CUDA events' if dev.type == 'cuda' else 'wall clock'})",
             "the pass-off Engine is the same build with BuildConfig(drop_constant_masks=False)",
             "tflops: BERT forward FLOPs (2 x 7.08M linear weights per layer per token + 4 x seq x 768 per layer per "
             "token for QK^T and PV) / median time; the H200's measured bf16 matmul ceiling is ~765 TFLOP/s (ANCHORS.md)"]
    write_results(name, device_facts(dev), rows, ["config", "seq_per_s", "median_ms", "vs_eager", "tflops", "build_s", "masks_dropped"],
                  notes)


if __name__ == "__main__":
    main()
