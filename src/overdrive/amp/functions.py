"""apex's cast annotations for functions O1 should run in a chosen precision: the decorators
``half_function`` / ``float_function`` / ``promote_function`` and ``register_*_function(module, name)``.

Under apex these took effect while O1's patched torch was active; here, while torch.autocast is on for the
arguments' device (O1's forward, and the training step under the apex surface). Outside it they call the
function unchanged. The wrapped function runs with autocast off, on arguments cast as asked, which is how
``torch.amp.custom_fwd(cast_inputs=...)`` treats a custom autograd function.

torch's own functions are never patched (the style rule apex broke on): torch.autocast already runs the
matmul and convolution family in half, so ``register_half_function(torch, "bmm")`` and the like change nothing;
any other registration on a torch namespace (``register_float_function(torch, "sigmoid")``) is applied by
:class:`RegisteredCasts`, a TorchFunctionMode that O1's autocast region enters while it is open.

Example:
    >>> @float_function
    ... def norm(x):
    ...     return x / x.norm()
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     norm(torch.ones(4, dtype=torch.bfloat16)).dtype
    torch.float32
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from overdrive._utils.errors import UsageError
from overdrive.amp.casting import cast_floating, tensor_leaves

# torch functions that torch.autocast runs in the half dtype on CPU and CUDA alike
AUTOCAST_HALF = frozenset({
    "mm", "bmm", "matmul", "einsum", "addmm", "addbmm", "baddbmm", "linear", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "tensordot",
})
_HOW = ("half", "float", "promote")
# torch functions registered with register_*_function(torch, name) -> how; cast by RegisteredCasts in O1's region
TORCH_REGISTERED: dict[Callable[..., Any], str] = {}


def _device_type(args: Any, kwargs: Any) -> str | None:
    for x in tensor_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.device.type
    return None


def _cast_dtype(how: str, dev: str, args: Any, kwargs: Any) -> torch.dtype:
    if how == "half":
        return torch.get_autocast_dtype(dev)
    if how == "float":
        return torch.float32
    floats = [x.dtype for x in tensor_leaves((args, kwargs)) if x.is_floating_point()]
    return functools.reduce(torch.promote_types, floats)  # promote: the widest floating argument dtype


class RegisteredCasts(TorchFunctionMode):
    """While O1's autocast region is open, calls of the torch functions registered with ``register_*_function(torch,
    name)`` (apex patched ``torch.sigmoid`` itself) run with autocast off on arguments cast as registered. A
    TorchFunctionMode, torch's own interception point: no torch function is replaced. Only the function object
    registered is caught (``torch.sigmoid``, not ``Tensor.sigmoid``, as apex's patch caught only that name)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        how = TORCH_REGISTERED.get(func)
        dev = _device_type(args, kwargs) if how is not None else None
        if dev is None or not torch.is_autocast_enabled(dev):
            return func(*args, **kwargs)
        dtype = _cast_dtype(how, dev, args, kwargs)
        with torch.autocast(dev, enabled=False):
            return func(*cast_floating(args, dtype), **cast_floating(kwargs, dtype))


def _wrap(fn: Callable[..., Any], how: str) -> Callable[..., Any]:
    if getattr(fn, "__overdrive_cast__", None) == how:
        return fn  # registered twice: one cast

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dev = _device_type(args, kwargs)
        if dev is None or not torch.is_autocast_enabled(dev):
            return fn(*args, **kwargs)
        dtype = _cast_dtype(how, dev, args, kwargs)
        with torch.autocast(dev, enabled=False):
            return fn(*cast_floating(args, dtype), **cast_floating(kwargs, dtype))

    wrapper.__overdrive_cast__ = how  # type: ignore[attr-defined]
    return wrapper


def half_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """apex.amp.half_function: under O1's autocast, run ``fn`` on arguments cast to the half dtype."""
    return _wrap(fn, "half")


def float_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """apex.amp.float_function: under O1's autocast, run ``fn`` on float32 arguments."""
    return _wrap(fn, "float")


def promote_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """apex.amp.promote_function: under O1's autocast, run ``fn`` on arguments cast to their widest dtype."""
    return _wrap(fn, "promote")


def _register(module: Any, name: str, how: str) -> None:
    if not hasattr(module, name):
        raise UsageError(f"{getattr(module, '__name__', module)!r} has no attribute {name!r} to register")
    mod_name = getattr(module, "__name__", type(module).__module__) or ""
    if mod_name.split(".")[0] == "torch":
        if how == "half" and name in AUTOCAST_HALF:
            return  # torch.autocast already runs it in half
        # torch is never patched: O1's region runs a TorchFunctionMode that casts the calls of these functions
        TORCH_REGISTERED[getattr(module, name)] = how
        return
    # the user's own module or extension: rebinding the name there is what registering asks for
    setattr(module, name, _wrap(getattr(module, name), how))


def register_half_function(module: Any, name: str) -> None:
    """apex.amp.register_half_function: ``module.name`` runs in the half dtype under O1 (call before use)."""
    _register(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """apex.amp.register_float_function: ``module.name`` runs in float32 under O1."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """apex.amp.register_promote_function: ``module.name`` runs in its arguments' widest dtype under O1."""
    _register(module, name, "promote")
