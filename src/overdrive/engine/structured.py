"""A user's own ``@dataclass`` inputs and outputs around an engine build: torch.export and both ONNX exporters take
only the containers torch's pytree knows, and an engine file cannot rebuild a user's class, so for the length of a
build the model returns each dataclass output as a dict of its fields (the engine returns it by those names, as it
returns a dict) and takes a dataclass argument's tensors as flat inputs, packed back into the dataclass before its
forward runs. Both are hooks on the module, removed when the build ends: nothing is registered process-wide.

Example:
    >>> # with dataclass_outputs(model), dataclass_inputs(model, layout): ... build ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from overdrive._utils.trees import is_plain_dataclass, map_tensors


def dataclasses_as_dicts(out: Any) -> Any:
    """A model output with each ``@dataclass`` instance torch's pytree does not know (a user's ``Out(logits, feats)``,
    at any depth) turned into a dict of its fields, in field order; ``out`` itself when it holds none. torch.export
    and both ONNX exporters refuse such an output ("Found <class Out> in output, which is not a known type"), and
    an engine file could not rebuild the class anyway; a dict they take, and the engine returns it by its keys
    (an :class:`~overdrive.engine.runtime.EngineOutput`, read as the dataclass was: ``out.logits``).

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Out:
        ...     logits: torch.Tensor
        ...     aux: tuple
        >>> dataclasses_as_dicts((Out(torch.zeros(1), (torch.ones(1),)), torch.ones(2)))[0].keys()
        dict_keys(['logits', 'aux'])
    """
    from torch.utils._pytree import tree_flatten, tree_map

    if not any(is_plain_dataclass(x) for x in tree_flatten(out, is_leaf=is_plain_dataclass)[0]):
        return out

    def visit(x: Any) -> Any:
        if not is_plain_dataclass(x):
            return x
        # an init=False field never set is no output
        return {f.name: dataclasses_as_dicts(getattr(x, f.name)) for f in fields(x) if hasattr(x, f.name)}

    return tree_map(visit, out, is_leaf=is_plain_dataclass)


@contextmanager
def dataclass_outputs(module: nn.Module | None) -> Iterator[None]:
    """While in force, ``module`` returns :func:`dataclasses_as_dicts` of its output (a forward hook, removed on exit;
    copies made inside, such as the build's float32 or fp16 copy, keep it): the exporters and the engine's output
    names then see a dict. Nothing for a TorchScript module, whose outputs are never dataclasses.

    Example:
        >>> m = nn.Identity()
        >>> with dataclass_outputs(m):
        ...     len(m._forward_hooks)
        1
        >>> len(m._forward_hooks)
        0
    """
    if module is None or isinstance(module, torch.jit.ScriptModule):
        yield
        return

    def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
        new = dataclasses_as_dicts(out)
        return None if new is out else new

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def dataclass_inputs(module: nn.Module | None, layout: list[tuple[Any, int] | None] | None) -> Iterator[None]:
    """While in force, ``module`` called with an engine's flat inputs packs them back into the arguments its forward
    takes (``layout`` from :func:`overdrive.engine.inputs.unpack_dataclasses`: ``model(x, mask)`` runs as
    ``model(Batch(x, mask))``); a forward pre-hook, removed on exit (copies made inside keep it). A call with any
    other number of arguments, or with a dataclass among them, is left as it is.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...     scale: float = 2.0
        >>> class Net(nn.Module):
        ...     def forward(self, batch):
        ...         return batch.x * batch.scale
        >>> net = Net()
        >>> with dataclass_inputs(net, [(Batch(torch.zeros(1), 3.0), 1)]):
        ...     net(torch.ones(1))
        tensor([3.])
    """
    if module is None or not layout or isinstance(module, torch.jit.ScriptModule):
        yield
        return
    n = sum(1 if spec is None else spec[1] for spec in layout)

    def pack(_m: nn.Module, args: tuple[Any, ...]) -> Any:
        if len(args) != n or any(is_plain_dataclass(a) for a in args):
            return None
        it = iter(args)
        return tuple(next(it) if spec is None else
                     map_tensors(lambda v: next(it) if isinstance(v, torch.Tensor) else v, spec[0])
                     for spec in layout)

    handle = module.register_forward_pre_hook(pack)
    try:
        yield
    finally:
        handle.remove()
