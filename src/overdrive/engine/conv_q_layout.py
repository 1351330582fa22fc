"""The argument layout of ``overdrive::conv2d_q`` / ``conv2d_q_dual`` nodes as the engine's graph passes read and
write them (``lowp_conv_fusion``, ``lowp_siblings``): each argument's position, and a node's arguments with the
trailing defaults that export leaves out filled in.

Example:
    >>> X, ACT, len(full_args(type("N", (), {"args": tuple(range(13))})()))
    (0, 14, 15)
"""

from __future__ import annotations

from typing import Any

# conv2d_q's arguments, by position
X, W, SCALE, BIAS, RES, RELU, OUT_SCALE, OUT_DTYPE, QMIN, STRIDE, PADDING, DILATION, CONFIG, RES_SCALE, ACT = range(15)
DUAL_RES_SCALE, DUAL_ACT = 14, 15  # conv2d_q_dual's res_scale and act (its first six arguments are conv2d_q's)


def full_args(conv: Any) -> list[Any]:
    """A conv2d_q node's arguments, all 15 (export leaves the trailing defaults ``res_scale`` and ``act`` out)."""
    return [*conv.args, *[None] * (RES_SCALE + 1 - len(conv.args)), *([0] if len(conv.args) <= ACT else [])]


def full_dual_args(node: Any) -> list[Any]:
    """A conv2d_q_dual node's arguments, all 16."""
    a = list(node.args)
    return [*a, *[None] * (DUAL_RES_SCALE + 1 - len(a)), *([0] if len(a) <= DUAL_ACT else [])]
