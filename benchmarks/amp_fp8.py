"""fp8 training throughput and convergence: overdrive O2 + fp8 (tensorwise, rowwise) against O2 bf16 and the
hand-written bf16 autocast loop, all under torch.compile, in one process.

Sections (each written to benchmarks/results/ as soon as it is measured, so a cut-off run keeps what it has):
- ``sweep``: one Linear layer's forward + backward (M tokens x K in -> N out), bf16 vs fp8, per shape, next to
  what the amp.Fp8 shape rule decides for that shape: the measurement behind the rule.
- ``speed``: tokens/s, peak memory and MFU (against the 989 TFLOP/s dense bf16 and 1979 TFLOP/s fp8 peaks of an
  H200/H100 SXM) of a Llama-style decoder (transformers LlamaConfig, random init: hidden 2048, 16 layers, SwiGLU,
  RMSNorm, RoPE, about 1.1B parameters) and GPT-2 124M (benchmarks/gpt2.py, nanoGPT's nn.Linear layers: the
  transformers GPT-2 uses Conv1D modules, which no fp8 Linear swap touches, so the shape rule would not be
  what decides), on synthetic tokens; every row's ratio to O2 bf16 + compile of the same run.
- ``--convergence STEPS``: bf16 vs fp8 training loss on real text (Python's help topics, bytes as tokens:
  vocabulary 256, no tokenizer files), the final losses compared (within 1%?) and the curves as a PNG.

    python benchmarks/amp_fp8.py                              # sweep + llama1b + gpt2 on one H200 (~8 minutes)
    python benchmarks/amp_fp8.py --models llama1b --sections speed            # or split the run in parts:
    python benchmarks/amp_fp8.py --models gpt2 --sections speed --append      # rows of the earlier parts kept
    python benchmarks/amp_fp8.py --convergence 1000 --curves bf16,tensorwise   # ~6 minutes; add rowwise later:
    python benchmarks/amp_fp8.py --convergence 1000 --curves rowwise           # merged with the curves saved
    python benchmarks/amp_fp8.py --quick                      # tiny models on CPU, fp8 emulated (< 1 minute)

fp8 needs torchao (pip install -e '.[fp8]') and a GPU of compute capability 8.9+; elsewhere only --quick runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, device_facts, median, time_steps, write_results  # noqa: E402

from overdrive import amp  # noqa: E402
from overdrive.amp import Fp8  # noqa: E402

PEAK_BF16 = 989e12  # H200/H100 SXM, dense
PEAK_FP8 = 1979e12
CONFIGS = {  # key -> (row label, kind, fp8 recipe)
    "hand": ("hand-written bf16 autocast + compile", "hand", None),
    "o2": ("O2 bf16 + compile", "overdrive", None),
    "tensorwise": ("O2 bf16 + fp8 tensorwise + compile", "overdrive", "tensorwise"),
    "rowwise": ("O2 bf16 + fp8 rowwise + compile", "overdrive", "rowwise"),
}


# --- models -------------------------------------------------------------------------------------
class CausalLM(nn.Module):
    """Token ids (B, T) and targets (B, T) -> mean cross-entropy (fp32); the loss is inside the compiled region."""

    def __init__(self, lm: nn.Module, hf: bool) -> None:
        super().__init__()
        self.lm, self.hf = lm, hf

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=idx, use_cache=False).logits if self.hf else self.lm(idx)  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def build(name: str, args: argparse.Namespace, vocab: int | None = None) -> tuple[CausalLM, dict[str, Any]]:
    """(model, facts: n_layer, d, params, linear_params) for ``llama1b``, ``gpt2`` or ``gpt2-hf``."""
    if name == "llama1b":
        from transformers import LlamaConfig, LlamaForCausalLM

        q = args.quick
        cfg = LlamaConfig(hidden_size=64 if q else args.hidden, num_hidden_layers=2 if q else args.layers,
                          num_attention_heads=4 if q else args.heads, num_key_value_heads=2 if q else args.kv_heads,
                          intermediate_size=128 if q else args.intermediate, vocab_size=vocab or args.vocab,
                          max_position_embeddings=max(args.seq, 64), tie_word_embeddings=False)
        lm, hf, n_layer, d = LlamaForCausalLM(cfg), True, cfg.num_hidden_layers, cfg.hidden_size
    elif name == "gpt2":
        from gpt2 import GPT, GPTConfig

        c = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=vocab or 512) if args.quick else \
            GPTConfig(block_size=max(args.seq, 1024), vocab_size=vocab or 50304)
        lm, hf, n_layer, d = GPT(c), False, c.n_layer, c.n_embd
    elif name == "gpt2-hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        c = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=vocab or 512) if args.quick else \
            GPT2Config(n_positions=max(args.seq, 1024), vocab_size=vocab or 50304)
        lm, hf, n_layer, d = GPT2LMHeadModel(c), True, c.n_layer, c.n_embd
    else:
        raise SystemExit(f"--models: unknown model {name!r}; use llama1b, gpt2 or gpt2-hf")
    linear = sum(m.weight.numel() for m in lm.modules() if isinstance(m, nn.Linear))
    linear += sum(m.weight.numel() for m in lm.modules() if type(m).__name__ == "Conv1D")  # transformers GPT-2
    params = sum(p.numel() for p in lm.parameters())
    return CausalLM(lm, hf), {"n_layer": n_layer, "d": d, "params": params, "linear_params": linear}


def flops_per_token(facts: dict[str, Any], T: int) -> float:
    """6 x the GEMM weights (forward + backward) + 12·L·d·T for attention scores and values (PaLM / nanoGPT)."""
    return 6 * facts["linear_params"] + 12 * facts["n_layer"] * facts["d"] * T


def fp8_rule(recipe: str, args: argparse.Namespace) -> Fp8:
    kw: dict[str, Any] = {"recipe": recipe, "emulate": args.emulate}
    if args.min_features is not None:
        kw["min_features"] = args.min_features
    elif args.quick:
        kw.update(min_features=0, min_weight=0)  # tiny layers: convert them all, to run the fp8 path end to end
    if args.exclude:
        kw["exclude"] = tuple(args.exclude.split(","))
    return Fp8(**kw)


def make_step(key: str, model: CausalLM, args: argparse.Namespace, device: torch.device) -> tuple[Callable[..., torch.Tensor], Any, list[str]]:
    """(step(x, y) -> loss, the amp handle or None, the fp8 layer names) for config ``key``."""
    label, kind, recipe = CONFIGS[key]
    lr, compile_ = args.lr, device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    if kind == "hand":
        fwd = torch.compile(model) if compile_ else model

        def hand_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fwd(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return hand_step, None, []
    policy = amp.Policy(opt_level="O2", dtype=torch.bfloat16, fp8=fp8_rule(recipe, args) if recipe else None)
    mp = amp.prepare(model, opt, policy, device=device, autocast_hooks=False)
    fwd = torch.compile(model) if compile_ else model

    def od_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = fwd(x, y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        return loss.detach()

    return od_step, mp, [c.name for c in mp.fp8_layers if c.fp8]


def cleanup(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- sections -------------------------------------------------------------------------------------
def sweep(args: argparse.Namespace, device: torch.device, flush: Callable[[], None], out: list[dict[str, Any]]) -> None:
    """One Linear layer, forward + backward, bf16 against each fp8 recipe, at the shapes of --sweep-shapes."""
    from overdrive.amp import fp8 as fp8_mod

    M = 256 if args.quick else args.sweep_tokens
    shapes = [(64, 128), (128, 64)] if args.quick else [tuple(map(int, s.split("x"))) for s in args.sweep_shapes.split(",")]
    for K, N in shapes:
        times: dict[str, float] = {}
        for recipe in [None, *args.recipes]:
            torch.manual_seed(0)
            layer = nn.Sequential(nn.Linear(K, N, bias=False)).to(device, torch.bfloat16)
            if recipe:
                fp8_mod.convert(layer, fp8_rule(recipe, args).replace(min_features=0, min_weight=0))
            fwd = torch.compile(layer) if device.type == "cuda" else layer
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(M, N, device=device, dtype=torch.bfloat16)

            def step() -> None:
                fwd(x).backward(g)
                layer[0].weight.grad = None
                x.grad = None

            try:
                times[recipe or "bf16"] = median(time_steps(step, device, warmup=args.warmup, iters=args.steps))
            except Exception as exc:  # reported, not hidden
                times[recipe or "bf16"] = float("nan")
                print(f"sweep {K}x{N} {recipe}: {type(exc).__name__}: {exc}"[:300], flush=True)
            del layer, fwd, x, g
            cleanup(device)
        rule = Fp8().chooses("layer", K, N)
        row: dict[str, Any] = {"M": M, "K (in)": K, "N (out)": N, "bf16_ms": 1e3 * times["bf16"],
                               "bf16_tflops": 6 * M * K * N / times["bf16"] / 1e12, "rule": "fp8" if rule[0] else "bf16"}
        for r in args.recipes:
            row[f"{r}_ms"] = 1e3 * times[r]
            row[f"{r}_vs_bf16"] = times["bf16"] / times[r] if times[r] == times[r] else None
        print(row, flush=True)
        out.append(row)
        flush()


def speed(args: argparse.Namespace, device: torch.device, flush: Callable[[], None], out: list[dict[str, Any]]) -> None:
    B, T = (2, 64) if args.quick else (args.batch, args.seq)
    for name in args.models:
        base = len(out)
        for key in args.configs:
            torch.manual_seed(0)
            model, facts = build(name, args)
            model = model.to(device)
            vocab = model.lm.config.vocab_size
            data = torch.randint(0, vocab, (B, T + 1), device=device, generator=None)
            x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            row: dict[str, Any] = {"model": name, "config": CONFIGS[key][0], "B x T": f"{B}x{T}",
                                   "params_M": facts["params"] / 1e6}
            try:
                t0 = time.perf_counter()
                step, mp, fp8_layers = make_step(key, model, args, device)
                losses: list[torch.Tensor] = []
                times = time_steps(lambda: losses.append(step(x, y)), device, warmup=args.warmup, iters=args.steps)
                t = median(times)
                tput = B * T / t
                fpt = flops_per_token(facts, T)
                n_lin = sum(isinstance(m, nn.Linear) for m in model.modules())
                row.update(step_ms=1e3 * t, tokens_per_s=tput,
                           mfu_bf16_pct=100 * tput * fpt / PEAK_BF16 if device.type == "cuda" else None,
                           mfu_fp8_pct=100 * tput * fpt / PEAK_FP8 if device.type == "cuda" else None,
                           peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                           fp8_layers=f"{len(fp8_layers)}/{n_lin}" if CONFIGS[key][2] else None,
                           last_loss=float(losses[-1]), spread_pct=100 * (max(times) - min(times)) / t,
                           wall_s=time.perf_counter() - t0)
                if mp is not None and CONFIGS[key][2] and not args.quick and name == args.models[0]:
                    print(amp.summary(model).to_markdown(), flush=True)
            except Exception as exc:  # a config that fails is reported, not hidden
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(row, flush=True)
            out.append(row)
            del model
            cleanup(device)
            ref = next((r for r in out[base:] if r["config"] == CONFIGS["o2"][0] and "tokens_per_s" in r), None)
            for r in out[base:]:
                r["vs_o2_bf16"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref and "tokens_per_s" in r else None
            flush()


def text_tokens(n_sentences: int) -> torch.Tensor:
    """Python's help topics (benchmarks/_pretrained.py), one sentence a line, as bytes: token ids 0..255."""
    from _pretrained import sentences

    return torch.frombuffer(bytearray("\n".join(sentences(n_sentences)).encode()), dtype=torch.uint8).long()


def convergence(args: argparse.Namespace, device: torch.device) -> None:
    steps, (B, T) = args.convergence, ((2, 64) if args.quick else (args.batch_conv, args.seq_conv))
    tokens = text_tokens(300 if args.quick else args.sentences)
    split = int(0.95 * len(tokens))
    train, val = tokens[:split].to(device), tokens[split:].to(device)
    name = "amp_fp8_convergence" + ("_quick" if args.quick else "")
    with torch.device("meta"):
        _, facts = build(args.conv_model, args, vocab=256)
    settings = {"model": args.conv_model, "params_M": round(facts["params"] / 1e6, 1), "hidden": facts["d"],
                "layers": facts["n_layer"], "steps": steps, "B x T": f"{B}x{T}", "lr": f"{args.lr:g}",
                "text_bytes": len(tokens), "quick": args.quick, "emulate": args.emulate,
                "fp8_rule": fp8_rule("tensorwise", args).replace(recipe="tensorwise").to_dict()}
    curves: dict[str, dict[str, Any]] = {}
    saved = RESULTS / f"{name}.json"
    if saved.exists():  # curves from an earlier invocation with the same settings are kept (split runs)
        old = json.loads(saved.read_text())["results"]
        if old.get("settings") == settings:
            curves = old.get("curves", {})

    def batch(g: torch.Generator, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(src) - T - 1, (B,), generator=g).to(src.device)
        rows = torch.stack([src[j:j + T + 1] for j in i.tolist()])  # (B, T+1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    for curve in args.curves:
        torch.manual_seed(0)
        model, _ = build(args.conv_model, args, vocab=256)
        model = model.to(device)
        key = "o2" if curve == "bf16" else curve
        t0 = time.perf_counter()
        step, mp, fp8_layers = make_step(key, model, args, device)
        opt = mp.optimizers[0]
        warm = max(1, steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine to 10%
            opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
        g = torch.Generator().manual_seed(1234)  # the same batches for every curve
        losses = []
        for _ in range(steps):
            losses.append(step(*batch(g, train)))
            sched.step()
        gv = torch.Generator().manual_seed(99)
        with torch.no_grad():
            val_loss = float(torch.stack([model(*batch(gv, val)) for _ in range(8)]).mean())
        train_loss = [float(v) for v in torch.stack(losses).cpu()]
        tail = max(1, steps // 20)
        curves[curve] = {"train_loss": train_loss, "final_train_loss": sum(train_loss[-tail:]) / tail,
                         "val_loss": val_loss, "fp8_layers": len(fp8_layers), "wall_s": time.perf_counter() - t0}
        print(curve, {k: v for k, v in curves[curve].items() if k != "train_loss"}, flush=True)
        del model, step, mp, opt
        cleanup(device)
        write_convergence(name, settings, curves, device)


def write_convergence(name: str, settings: dict[str, Any], curves: dict[str, dict[str, Any]], device: torch.device) -> None:
    rows, notes = [], []
    ref = curves.get("bf16")
    for c, v in curves.items():
        row = {"curve": c, "final_train_loss": v["final_train_loss"], "val_loss": v["val_loss"],
               "fp8_layers": v["fp8_layers"], "wall_s": v["wall_s"]}
        if ref is not None and c != "bf16":
            row["train_vs_bf16_pct"] = 100 * (v["final_train_loss"] / ref["final_train_loss"] - 1)
            row["val_vs_bf16_pct"] = 100 * (v["val_loss"] / ref["val_loss"] - 1)
            row["within_1pct"] = abs(row["train_vs_bf16_pct"]) <= 1.0
        rows.append(row)
    notes.append("final_train_loss: mean of the last 5% of steps; val_loss: 8 batches of the held-out last 5% of the "
                 "text after training; within_1pct compares final_train_loss with bf16's.")
    png = plot(name, curves)
    if png:
        notes.append(f"curves: {png.name} (beside this file)")
    write_results(name, {**device_facts(device), **settings}, rows,
                  ["curve", "final_train_loss", "val_loss", "train_vs_bf16_pct", "val_vs_bf16_pct", "within_1pct",
                   "fp8_layers", "wall_s"], notes, extra={"settings": settings, "curves": curves})


def plot(name: str, curves: dict[str, dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for c, v in curves.items():
        ys = v["train_loss"]
        k = max(1, len(ys) // 50)  # a running mean over 2% of the run, for a readable curve
        smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), smooth, label=f"{c} (final {v['final_train_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (bytes, nats)")
    ax.set_title("bf16 vs fp8 (O2 + torch.compile), Python help topics")
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    import os
    import shutil

    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    return path


# --- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models on CPU, fp8 emulated: proves the script")
    ap.add_argument("--sections", default="sweep,speed", help="sweep,speed (default both)")
    ap.add_argument("--models", default="llama1b,gpt2", help="llama1b, gpt2 (nanoGPT), gpt2-hf (transformers, Conv1D)")
    ap.add_argument("--configs", default="hand,o2,tensorwise,rowwise", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--recipes", default="tensorwise,rowwise", help="fp8 recipes for the sweep")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps, compile included (default 5; quick 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-features", type=int, default=None, help="amp.Fp8 min_features (default: Fp8's)")
    ap.add_argument("--exclude", default="", help="comma-separated amp.Fp8 exclude patterns, e.g. lm_head")
    ap.add_argument("--emulate", action="store_true", help="fp8 emulated (GEMMs in fp32); on by default without fp8 hardware")
    ap.add_argument("--sweep-shapes", default="768x3072,3072x768,1024x1024,1024x4096,2048x2048,2048x8192,8192x2048,4096x4096")
    ap.add_argument("--sweep-tokens", type=int, default=16384)
    ap.add_argument("--convergence", type=int, default=None, metavar="STEPS", help="bf16 vs fp8 loss curves instead")
    ap.add_argument("--curves", default="bf16,tensorwise", help="for --convergence: bf16, tensorwise, rowwise")
    ap.add_argument("--conv-model", default="llama1b")
    ap.add_argument("--batch-conv", type=int, default=8)
    ap.add_argument("--seq-conv", type=int, default=1024)
    ap.add_argument("--sentences", type=int, default=3000, help="sentences of text for --convergence")
    ap.add_argument("--name", default=None, help="results file name (default amp_fp8, or amp_fp8_quick)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of an earlier run in the same results file (split runs): models and shapes "
                         "measured now replace theirs")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    from overdrive._utils.device import supports_fp8

    if not supports_fp8(device) and not args.emulate:
        if not args.quick:
            raise SystemExit(f"fp8 needs a CUDA GPU of compute capability 8.9+ (here: {device}); run with --quick "
                             "(or --emulate, which times fp32 GEMMs and says nothing about speed)")
        args.emulate = True
    args.models, args.configs = args.models.split(","), args.configs.split(",")
    args.recipes, args.curves = args.recipes.split(","), args.curves.split(",")
    for k in args.configs:
        if k not in CONFIGS:
            raise SystemExit(f"--configs: unknown {k!r}; use {', '.join(CONFIGS)}")
    args.steps = args.steps or (2 if args.quick else 20)
    args.warmup = args.warmup or (1 if args.quick else 5)
    if args.convergence:
        convergence(args, device)
        return
    name = args.name or ("amp_fp8_quick" if args.quick else "amp_fp8")
    sweep_rows: list[dict[str, Any]] = []
    speed_rows: list[dict[str, Any]] = []
    kept_speed: list[dict[str, Any]] = []
    kept_sweep: list[dict[str, Any]] = []
    saved = RESULTS / f"{name}.json"
    sections = args.sections.split(",")
    if args.append and saved.exists():
        old = json.loads(saved.read_text())["results"]
        kept_speed = [r for r in old.get("rows", []) if "speed" not in sections or r.get("model") not in args.models]
        kept_sweep = [] if "sweep" in sections else old.get("sweep", [])
    notes = [
        "speed: median of timed steps (CUDA events) after warm-up (torch.compile included in warm-up); every row "
        "starts from the same seed, synthetic tokens, fused AdamW, loss inside the compiled region.",
        "vs_o2_bf16: tokens/s over O2 bf16 + compile of the same model in this run. MFU: 6 x GEMM weights + "
        "12·L·d·T FLOPs per token against the dense peaks 989 TFLOP/s (bf16) and 1979 TFLOP/s (fp8) of an H200 SXM.",
        "fp8_layers: Linear layers training in fp8 / all Linear layers, by amp.Fp8's shape rule "
        f"(min_features {fp8_rule('tensorwise', args).min_features}, min_weight {fp8_rule('tensorwise', args).min_weight}); "
        "the rest train in bf16.",
        "sweep: one Linear layer forward + backward (3 GEMMs) at M tokens, compiled; rule: what amp.Fp8's default "
        "rule picks for that shape; *_vs_bf16 > 1: fp8 faster.",
    ]
    if args.emulate:
        notes.insert(0, "fp8 EMULATED (GEMMs in fp32): these times say nothing about fp8 speed; they prove the script.")
    B, T = (2, 64) if args.quick else (args.batch, args.seq)
    facts = {**device_facts(device, argv), "torchao": _torchao_version(), "tokens_per_step": f"{B}x{T}",
             "warmup_steps": args.warmup, "timed_steps": args.steps}
    if device.type == "cpu":
        notes.insert(0, "CPU: the rows run eagerly (no torch.compile on CPU); their labels are the GPU run's.")

    def flush() -> None:
        cols = ["model", "config", "B x T", "params_M", "step_ms", "tokens_per_s", "vs_o2_bf16", "mfu_bf16_pct",
                "mfu_fp8_pct", "peak_mem_gib", "fp8_layers", "last_loss", "spread_pct", "error"]
        scols = ["M", "K (in)", "N (out)", "rule", "bf16_ms", "bf16_tflops"] + \
                [f"{r}_{s}" for r in args.recipes for s in ("ms", "vs_bf16")]
        speed_all, sweep_all = kept_speed + speed_rows, kept_sweep + sweep_rows
        body = ["## speed", ""] + _md(speed_all, cols) + ["", "## sweep: one Linear layer, fwd + bwd", ""] + \
            _md(sweep_all, scols)
        write_results(name, facts, speed_all, cols, notes, extra={"sweep": sweep_all}, body=body)

    if "sweep" in sections:
        sweep(args, device, flush, sweep_rows)
    if "speed" in sections:
        speed(args, device, flush, speed_rows)
    flush()
    print((RESULTS / f"{name}.md").read_text())


def _md(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    from _common import _fmt

    if not rows:
        return ["(not run)"]
    cols = [c for c in cols if any(r.get(c) is not None for r in rows)]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + \
        ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]


def _torchao_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchao")
    except Exception:
        return None


if __name__ == "__main__":
    main()
