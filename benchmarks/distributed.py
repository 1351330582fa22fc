"""DDP / FSDP2 training throughput and scaling, plus all_reduce bus bandwidth (issue 8).

For each GPU count N (1, 2, 4, 8 clipped to the GPUs present) one torchrun launch runs every
(model, strategy) pair: the plain-PyTorch baseline (DDP + torch.autocast bf16, written by hand)
and overdrive's Trainer with strategy ddp / fsdp at O2 bf16. Per-step times are CUDA-event
medians after warm-up, the slowest rank's. Scaling efficiency = throughput(N) / (N x throughput(1)).
Then ``overdrive doctor``'s all_reduce busbw over 8 KiB - 4 GiB on all GPUs.

    python benchmarks/distributed.py                 # full, on the GPUs present
    python benchmarks/distributed.py --quick         # CPU, gloo, 2 ranks, tiny models (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import device_facts, write_results  # noqa: E402


# --- models ----------------------------------------------------------------------------------
class TinyConvNet(nn.Module):  # --quick stand-in for ResNet-50 (torchvision is absent on the CPU box)
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()) for c in (3, 16, 16)])
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 small shape (124M with L=12, d=768, V=50257, T=1024); random weights, tied embedding."""

    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList([GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.vocab = vocab

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.h:
            x = blk(x)
        return (self.ln_f(x) @ self.wte.weight.t()).view(-1, self.vocab)  # (B*T, V)


def build(name: str, quick: bool, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    """Model, one batch (inputs, targets) per rank, and samples (images or tokens) per batch."""
    g = torch.Generator().manual_seed(0)
    if name == "resnet50":
        if quick:
            model, b, hw = TinyConvNet(), 16, 16
        else:
            import torchvision

            model, b, hw = torchvision.models.resnet50(weights=None), 256, 224
        x = torch.randn(b, 3, hw, hw, generator=g)
        y = torch.randint(0, 10 if quick else 1000, (b,), generator=g)
        return model.to(device), x.to(device).contiguous(memory_format=torch.channels_last), y.to(device), b
    if name == "gpt2":
        cfg = dict(layers=2, d=64, heads=4, vocab=512, ctx=64) if quick else {}
        model = GPT(**cfg)
        b, t = (4, 64) if quick else (16, 1024)
        x = torch.randint(0, model.vocab, (b, t), generator=g)
        return model.to(device), x.to(device), torch.roll(x, -1, 1).reshape(-1).to(device), b * t
    raise SystemExit(f"unknown model {name!r}: use resnet50 or gpt2")


# --- worker: one torchrun launch, every (model, strategy) ------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from overdrive import distributed as odist
    from overdrive.amp import Policy
    from overdrive.train import Trainer

    env = odist.init(backend="gloo" if a.quick else None, device="cpu" if a.quick else None)
    rows = []
    for name in a.models.split(","):
        for strategy in a.strategies.split(","):
            torch.manual_seed(0)
            model, x, y, per_batch = build(name, a.quick, env.device)
            if name == "resnet50" and strategy != "fsdp":  # FSDP2 shards only contiguous parameters
                model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=env.device.type == "cuda")
            tr = ddp = None
            if strategy == "torch_ddp":  # the plain-PyTorch baseline
                from torch.nn.parallel import DistributedDataParallel as DDP

                ddp = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)

                def step() -> None:
                    with torch.autocast(env.device.type, dtype=torch.bfloat16):
                        loss = nn.functional.cross_entropy(ddp(x).float(), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            else:
                tr = Trainer(model, opt, policy=Policy(opt_level="O2", dtype=torch.bfloat16), progress=False,
                             strategy=strategy, device=env.device, channels_last=name == "resnet50")

                def step() -> None:
                    tr.train_step((x, y))
            times = []
            for i in range(a.warmup + a.steps):
                if env.device.type == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    step()
                    e.record()
                    e.synchronize()
                    t = s.elapsed_time(e) / 1e3
                else:
                    t0 = time.perf_counter()
                    step()
                    t = time.perf_counter() - t0
                if i >= a.warmup:
                    times.append(t)
            med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=env.device)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            mem = torch.cuda.max_memory_allocated() / 2**30 if env.device.type == "cuda" else float("nan")
            rows.append({"model": name, "strategy": strategy, "gpus": env.world_size, "step_ms": float(med) * 1e3,
                         "throughput": per_batch * env.world_size / float(med), "unit": "img/s" if name == "resnet50" else "tok/s",
                         "peak_mem_gib": mem})
            del model, opt, step
            tr = ddp = None  # noqa: F841 - drop the last config's state before the next one
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    if env.rank == 0:
        Path(a.worker_out).write_text(json.dumps(rows))
    dist.destroy_process_group()


# --- driver ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU (gloo), 2 ranks, tiny models")
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts to run (clipped to the GPUs present)")
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--strategies", default="torch_ddp,ddp,fsdp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-bytes", type=int, default=4 * 2**30, help="all_reduce busbw sweep: 8 KiB up to this")
    ap.add_argument("--out", default=None, help="path stem for .json/.md (default benchmarks/results/distributed[_quick])")
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker_out:
        return worker(a)
    from overdrive.distributed.launch import bandwidth

    a.out = a.out or str(ROOT / "benchmarks" / "results" / ("distributed_quick" if a.quick else "distributed"))
    if a.quick:
        counts, a.steps, a.warmup, a.max_bytes = [1, 2], min(a.steps, 5), 2, 1 << 20
    else:
        have = torch.cuda.device_count()
        if have == 0:
            raise SystemExit("no CUDA GPU: use --quick on CPU")
        counts = [n for n in (int(c) for c in a.gpus.split(",")) if n <= have]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    rows: list[dict] = []
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), __file__,
                   "--worker-out", out, "--models", a.models, "--strategies", a.strategies, "--steps", str(a.steps),
                   "--warmup", str(a.warmup)] + (["--quick"] if a.quick else [])
            rc = subprocess.run(cmd, env=env, check=False).returncode
            if rc != 0:
                raise SystemExit(f"the {n}-rank run failed (exit code {rc})")
            rows += json.loads(Path(out).read_text())
    one = {(r["model"], r["strategy"]): r["throughput"] for r in rows if r["gpus"] == 1}
    base = {(r["model"], r["gpus"]): r["throughput"] for r in rows if r["strategy"] == "torch_ddp"}
    for r in rows:
        r["scaling_efficiency"] = r["throughput"] / (r["gpus"] * one[(r["model"], r["strategy"])]) if (r["model"], r["strategy"]) in one else None
        r["vs_torch_ddp"] = r["throughput"] / base[(r["model"], r["gpus"])] if (r["model"], r["gpus"]) in base else None
    bw = bandwidth(max(counts), 8 * 1024, a.max_bytes, "all_reduce", iters=10 if a.quick else 20, backend="gloo" if a.quick else None)
    facts = device_facts(torch.device("cpu") if a.quick else torch.device("cuda", 0))
    if a.quick:
        facts["device"] = "cpu (gloo)"
    facts["quick"] = a.quick
    lines = ["| model | strategy | GPUs | step ms | throughput | scaling eff. | vs torch DDP | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = f"{r['scaling_efficiency']:.1%}" if r["scaling_efficiency"] is not None else "-"
        vs = f"{r['vs_torch_ddp']:.2f}x" if r["vs_torch_ddp"] is not None else "-"
        lines.append(f"| {r['model']} | {r['strategy']} | {r['gpus']} | {r['step_ms']:.1f} | {r['throughput']:,.0f} {r['unit']} | {eff} | {vs} | {r['peak_mem_gib']:.1f} |")
    lines += ["", f"all_reduce on {bw['world_size']} ranks ({bw['backend']}); busbw = algbw x 2(n-1)/n; peak busbw "
              f"{max(r['busbw_gbs'] for r in bw['rows']):.1f} GB/s", "", "| bytes | time us | algbw GB/s | busbw GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['bytes']:,} | {r['time_us']:.1f} | {r['algbw_gbs']:.2f} | {r['busbw_gbs']:.2f} |" for r in bw["rows"]]
    print("\n".join(lines))
    out = Path(a.out)
    write_results(out.name, facts, notes=[], body=lines, title=f"Distributed training: {facts['device']}", out_dir=out.parent,
                  extra={"training": rows, "all_reduce": bw,
                         "targets": {"ddp_scaling_8gpu": 0.90, "all_reduce_busbw_8xh200_gbs": 0.85 * 475}})


if __name__ == "__main__":
    main()
