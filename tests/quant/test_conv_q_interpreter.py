"""The int8 / fp16 convolution kernel (quant/_triton_conv.py) on the Triton interpreter (CPU, no GPU): the persistent
and GEMM forms, the activation epilogues and 16-bit operands against the op's fp32 reference, each in a fresh process
(the interpreter is switched on by an environment variable read at import)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _interpret(script: str, *args: object, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``script`` run with ``args`` in a fresh Python on the Triton interpreter (skipped where Triton is absent)."""
    pytest.importorskip("triton")
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": SRC})


_INTERPRETED = """
import os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference

def rint(x, _semantic=None):  # the interpreter has no libdevice.rint: numpy's (round half to even, as cvt.rni)
    return tl.core.tensor(TensorHandle(np.rint(x.handle.data), x.handle.dtype.scalar), x.type)

tc._conv_tile.fn.__globals__["libdevice"] = types.SimpleNamespace(rint=rint)
torch.manual_seed(0)
cfg = int(sys.argv[1])
n, c, h, co = 4, 64, 16, 160  # M = 1024 pixels: more tiles than the interpreter's persistent programs (4 per SM)
x = (torch.randn(n, c, h, h) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 1, 1) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
scale, bias = torch.rand(co) * 1e-3, torch.randn(co)
res = (torch.randn(n, co, h, h) * 30).clamp(-127, 127).to(torch.int8).contiguous(memory_format=torch.channels_last)
rs, osc = torch.tensor(0.03), torch.tensor(0.05)
ref = _reference(x, w, scale, bias, res, True, osc, torch.int8, -128, [1, 1], [0, 0], [1, 1], rs)
out = torch.empty(n, h, h, co, dtype=torch.int8)
tc.launch(_nhwc(x), _nhwc(w), scale, bias, _nhwc(res), True, out, osc.reshape(1), 2, -128, [1, 1], [0, 0], [1, 1],
          cfg, res_scale=rs.reshape(1))
print("MISMATCH", (out.permute(0, 3, 1, 2) != ref).float().mean().item())
"""


_GEMM_INTERPRETED = """
import os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference

def rint(x, _semantic=None):
    return tl.core.tensor(TensorHandle(np.rint(x.handle.data), x.handle.dtype.scalar), x.type)

tc._conv_tile.fn.__globals__["libdevice"] = types.SimpleNamespace(rint=rint)
torch.manual_seed(0)
cfg, act = int(sys.argv[1]), int(sys.argv[2])
m, c, co = 300, 96, 160  # M and N not multiples of the tiles, K not a multiple of the K tile
x = (torch.randn(m, c, 1, 1) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 1, 1) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
scale, bias = torch.rand(co) * 1e-3, torch.randn(co)
res = (torch.randn(m, co, 1, 1) * 30).clamp(-127, 127).to(torch.int8).contiguous(memory_format=torch.channels_last)
rs, osc = torch.tensor(0.03), torch.tensor(0.05)
ref = _reference(x, w, scale, bias, res, act == 0, osc, torch.int8, -128, [1, 1], [0, 0], [1, 1], rs, act)
out = torch.empty(m, 1, 1, co, dtype=torch.int8)
assert tc.gemm_applies(_nhwc(x), _nhwc(w), [1, 1], [0, 0])
tc.launch(_nhwc(x), _nhwc(w), scale, bias, _nhwc(res), act == 0, out, osc.reshape(1), 2, -128, [1, 1], [0, 0],
          [1, 1], cfg, res_scale=rs.reshape(1), act=act)
d = (out.permute(0, 3, 1, 2).float() - ref.float()).abs()
print("MISMATCH", (d > 0).float().mean().item(), d.max().item())
"""


@pytest.mark.parametrize("cfg,act", [(26, 2), (28, 0), (29, 1)])
def test_gemm_form_matches_the_reference_in_the_interpreter(cfg: int, act: int) -> None:
    # the GEMM form on the Triton interpreter: TMA loads zero-filling past M, N and K, the persistent tile loop, the
    # split and whole epilogues; int8 with an 8-bit residual, ReLU / SiLU / GELU and an int8 output: equal to the fp32
    # reference (exact: int32 sums, the same fp32 epilogue)
    done = _interpret(_GEMM_INTERPRETED, cfg, act, timeout=900)
    if act != 2:
        assert "MISMATCH 0.0 0.0" in done.stdout, done.stderr[-2000:]
    else:  # GELU into an 8-bit output takes its tanh form (within 4.8e-4 of erf's): a rare one-step flip
        share, worst = (float(v) for v in done.stdout.split("MISMATCH")[1].split())
        assert worst <= 1.0 and share < 0.01, (share, worst, done.stderr[-2000:])


@pytest.mark.parametrize("cfg", [21, 22])
def test_persistent_tiles_match_the_reference_in_the_interpreter(cfg: int) -> None:
    # the persistent kernel (each program loops over several tiles, N tiles partly masked) on the Triton interpreter,
    # int8 with an 8-bit residual and an int8 output: equal to the fp32 reference (reference: _reference, exact)
    from overdrive.quant.conv_tiles import PERSISTENT

    assert cfg in PERSISTENT
    done = _interpret(_INTERPRETED, cfg)
    assert "MISMATCH 0.0" in done.stdout, done.stderr[-2000:]


_INTERPRETED_ACT = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference
torch.manual_seed(0)
n, c, h, co = 2, 64, 8, 48
x = (torch.randn(n, c, h, h) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 3, 3) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
scale, bias = torch.rand(co) * 2e-4, torch.randn(co)
res = torch.randn(n, co, h, h).half().contiguous(memory_format=torch.channels_last)
for act in (1, 2):
    ref = _reference(x, w, scale, bias, res, False, None, torch.float16, -128, [1, 1], [1, 1], [1, 1], None, act)
    out = torch.empty(n, h, h, co, dtype=torch.float16)
    tc.launch(_nhwc(x), _nhwc(w), scale, bias, _nhwc(res), False, out, None, 0, -128, [1, 1], [1, 1], [1, 1], 15,
              act=act)
    assert ref.min() < 0  # the activation's negative lobe is in the data
    print("ACT", act, (out.permute(0, 3, 1, 2).float() - ref.float()).abs().max().item())
"""


def test_activation_epilogue_in_the_interpreter() -> None:
    # the kernel's SiLU and GELU (erf) epilogue after an fp16 residual, on the Triton interpreter, against the op's
    # fp32 reference in fp16 (tolerance: one fp16 step at the outputs' size, 8 here)
    done = _interpret(_INTERPRETED_ACT)
    diffs = [float(d) for d in re.findall(r"ACT \d ([0-9.e-]+)", done.stdout)]
    assert len(diffs) == 2 and max(diffs) <= 8 / 1024, (done.stdout, done.stderr[-2000:])


_INTERPRETED_FP16 = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference
torch.manual_seed(0)
n, c, h, co = 2, 48, 8, 40
x = torch.randn(n, c, h, h).half().contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 3, 3) / 20).half().contiguous(memory_format=torch.channels_last)
bias, res = torch.randn(co), torch.randn(n, co, h, h).half().contiguous(memory_format=torch.channels_last)
ones = torch.ones(co)
ref = _reference(x, w, ones, bias, res, True, None, torch.float16, -128, [1, 1], [1, 1], [1, 1])
out = torch.empty(n, h, h, co, dtype=torch.float16)
tc.launch(_nhwc(x), _nhwc(w), ones, bias, _nhwc(res), True, out, None, 0, -128, [1, 1], [1, 1], [1, 1], 15)
print("FP16", (out.permute(0, 3, 1, 2).float() - ref.float()).abs().max().item(), ref.float().abs().max().item())
"""


def test_fp16_operands_in_the_interpreter() -> None:
    # a 3x3 fp16 convolution (C 48: the K tile masked in its last step) with bias, fp16 residual and ReLU on the
    # Triton interpreter, against the op's fp32 reference rounded to fp16 (tolerance: two fp16 steps at the output's
    # size, as the interpreter's dot sums in another order)
    done = _interpret(_INTERPRETED_FP16)
    got = re.findall(r"FP16 ([0-9.e-]+) ([0-9.e-]+)", done.stdout)
    assert got, (done.stdout, done.stderr[-2000:])
    diff, size = map(float, got[0])
    assert diff <= 2 * size / 1024, (diff, size)
