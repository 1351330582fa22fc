"""Transformer encoders through engines at several sequence lengths: speed against eager PyTorch and
torch.compile in the same run, accuracy (cosine of last_hidden_state to the fp32 eager model) per precision.

One engine per precision is built with a dynamic profile (batch 1..B, sequence 1..max), then run at each
sequence length; the baselines run at the same shapes. On CPU, ONNX Runtime's dynamic int8 (per-channel
weights, per-token activations; ``onnxruntime.quantization.quantize_dynamic``) of the same ONNX model runs
beside the engines as the reference for CPU int8.

The model: a Hugging Face ``BertModel`` from a config (BERT-base sizes by default, random weights: no
network here), or ``--pretrained DIR`` (a local ``from_pretrained`` folder).

    python benchmarks/transformer_engines.py --device cpu --layers 4 --seqs 16,64,128
    python benchmarks/transformer_engines.py --device cuda --precisions fp16,int8,fp8
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_facts, median, time_steps, write_results  # noqa: E402

NAMES = ["input_ids", "attention_mask"]


def _model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    if args.pretrained:
        return transformers.AutoModel.from_pretrained(args.pretrained).eval()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                                  vocab_size=30522, max_position_embeddings=max(512, args.max_seq))
    return transformers.BertModel(cfg).eval()


def _batch(b: int, s: int, seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.int64)
    lens = torch.randint(max(1, s // 2), s + 1, (b,), generator=g)
    for i, n in enumerate(lens.tolist()):  # padded rows, as a tokenizer's batch has
        mask[i, n:] = 0
    return ids, mask


def _cos(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the attended tokens of the cosine between the two hidden states."""
    keep = mask.bool().reshape(-1)
    a, b = a.float().reshape(-1, a.shape[-1])[keep], b.float().reshape(-1, b.shape[-1])[keep]
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()


def _hidden(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "last_hidden_state", out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pretrained", default=None, help="a local from_pretrained folder (default: BERT from a config)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqs", default="16,64,128")
    p.add_argument("--precisions", default=None, help="default: fp32,int8 on CPU; fp16,int8,fp8 on CUDA")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--out", default=None, help="results name (default transformer_engines_<device>)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    from overdrive.engine import Builder, BuildConfig, ShapeProfile

    device = torch.device(args.device)
    seqs = [int(s) for s in args.seqs.split(",")]
    args.max_seq = max(seqs)
    precisions = (args.precisions or ("fp16,int8,fp8" if device.type == "cuda" else "fp32,int8")).split(",")
    model = _model(args)
    vocab = model.config.vocab_size
    ref_model = model.to(device)
    half = torch.float16 if device.type == "cuda" else None
    eager = {"fp32": ref_model}
    if half is not None:
        import copy

        eager["fp16"] = copy.deepcopy(ref_model).to(half)
    calib = [_batch(args.batch, args.max_seq, 1000 + i, vocab) for i in range(args.calib_batches)]
    tests = {s: [_batch(args.batch, s, 2000 + i, vocab) for i in range(4)] for s in seqs}
    with torch.no_grad():
        refs = {s: [_hidden(ref_model(input_ids=i.to(device), attention_mask=m.to(device))).float().cpu()
                    for i, m in tests[s]] for s in seqs}
    rows: list[dict[str, Any]] = []
    base_ms: dict[int, float] = {}

    def record(config: str, s: int, fn: Any, build_s: float | None = None) -> None:
        xs = [tuple(t.to(device) for t in pair) for pair in tests[s]]
        with torch.no_grad():
            cos = min(_cos(_hidden(fn(*x)).cpu(), r, x[1].cpu()) for x, r in zip(xs, refs[s]))
            ms = 1e3 * median(time_steps(lambda: fn(*xs[0]), device, warmup=5, iters=args.iters))
        if config.startswith("eager fp32" if device.type == "cpu" else "eager fp16"):
            base_ms[s] = ms
        rows.append({"config": config, "seq": s, "ms": round(ms, 3),
                     "x_vs_eager": round(base_ms.get(s, float("nan")) / ms, 2), "min_cosine": round(cos, 5),
                     "build_s": None if build_s is None else round(build_s, 1)})
        print(rows[-1], flush=True)

    base = "fp32" if device.type == "cpu" else "fp16"
    name = args.out or f"transformer_engines_{device.type}"
    facts = device_facts(device)
    facts.update(model=args.pretrained or f"BertModel(hidden {args.hidden}, {args.layers} layers, random init)",
                 batch=args.batch, seqs=seqs, precisions=precisions)

    def flush() -> None:  # after every section: a run cut short keeps what it measured
        write_results(name, facts, rows, ["config", "seq", "ms", "x_vs_eager", "min_cosine", "build_s", "error"],
                      [f"x_vs_eager: against eager {base} at the same shape in this run; min_cosine: the lowest mean "
                       "token cosine to eager fp32 over 4 held-out batches with padded rows",
                       f"engines are built once with a dynamic profile (batch 1..{args.batch}, sequence 1..{max(seqs)})"])

    for s in seqs:
        record(f"eager {base}", s, lambda i, m: eager[base](input_ids=i, attention_mask=m))
        if base != "fp32":
            record("eager fp32", s, lambda i, m: eager["fp32"](input_ids=i, attention_mask=m))
    compiled = torch.compile(eager[base], mode="reduce-overhead" if device.type == "cuda" else "default", dynamic=True)
    for s in seqs:
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(*[t.to(device) for t in tests[s][0]])
        record(f"torch.compile {base}", s, lambda i, m: compiled(input_ids=i, attention_mask=m), time.perf_counter() - t0)
    flush()
    profiles = tuple(ShapeProfile(n, (1, 1), (args.batch, max(seqs)), (args.batch, max(seqs))) for n in NAMES)
    for prec in precisions:
        t0 = time.perf_counter()
        try:
            eng = Builder(BuildConfig(precision=prec, device=str(device), backend="inductor", profiles=profiles)).build(
                model, input_names=NAMES, calib=calib if prec in ("int8", "fp8") else None)
        except Exception as exc:  # noqa: BLE001 - a failed candidate is a row, not the end of the run
            rows.append({"config": f"engine {prec}", "seq": None, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(rows[-1], flush=True)
            continue
        build_s = time.perf_counter() - t0
        for s in seqs:
            record(f"engine inductor {prec}", s, lambda i, m: eng.runner(i, m), build_s)
        flush()
    if device.type == "cpu":
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic

        from overdrive.engine.sources import from_module

        onnx = from_module(model, NAMES).as_onnx(calib[0], list(profiles))
        src, dst = io.BytesIO(onnx), io.BytesIO()
        import onnx as onnx_lib

        tmp = Path(f"/tmp/od_bench_{time.time_ns()}")
        tmp.mkdir()
        onnx_lib.save(onnx_lib.load_from_string(src.getvalue()), tmp / "m.onnx")
        quantize_dynamic(tmp / "m.onnx", tmp / "q.onnx", per_channel=True, weight_type=QuantType.QInt8)
        for label, path in (("onnxruntime fp32", tmp / "m.onnx"), ("onnxruntime dynamic int8", tmp / "q.onnx")):
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            run = (lambda sess: lambda i, m: torch.from_numpy(sess.run(None, {"input_ids": i.numpy(),
                                                                              "attention_mask": m.numpy()})[0]))(sess)
            for s in seqs:
                record(label, s, run)
        del dst
    flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
