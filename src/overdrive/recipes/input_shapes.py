"""``--input-shape`` of ``overdrive quantize`` and ``overdrive sparsify``: the shape of a model's input in any rank
(``1,16`` for a tabular MLP, ``1,80,3000`` for audio, ``1x3x224x224`` for an image), or its inputs by name in the
form ``overdrive build --shapes`` takes (``input_ids:1x128,attention_mask:1x128``).

Token inputs (``input_ids``, ``attention_mask``, ``token_type_ids``, ``position_ids``) are integers; an unnamed
input of a model with an ``nn.Embedding`` is token ids too. Random example inputs are made with a seeded
generator, so two runs report the same numbers.

Example:
    >>> parse_input_shapes("1,16")
    {None: (1, 16)}
    >>> parse_input_shapes("input_ids:1x8,attention_mask:1x8")
    {'input_ids': (1, 8), 'attention_mask': (1, 8)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.inputs import forward_parameters

FORM = ("comma- or x-separated sizes of one input in any rank (1,16 or 1x3x224x224), or inputs by name as "
        "overdrive build --shapes takes them (input_ids:1x128,attention_mask:1x128)")

# Inputs whose values are integers (a tokenizer's outputs), with how an example of each is filled.
INTEGER_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "decoder_input_ids")

Shapes = dict[str | None, tuple[int, ...]]


def parse_input_shapes(text: str | None, flag: str = "--input-shape") -> Shapes | None:
    """``--input-shape`` text -> ``{None: shape}`` for one unnamed input, or ``{name: shape, ...}``; None stays None.

    Example:
        >>> parse_input_shapes("2x5x16")
        {None: (2, 5, 16)}
    """
    if text is None:
        return None
    text = text.strip()
    if ":" in text:
        from overdrive.engine.config import parse_shapes

        try:
            named: Shapes = dict(parse_shapes(text))
        except UsageError as exc:
            raise UsageError(f"{flag} {text!r}: {exc}; give {FORM}") from None
    else:
        try:
            named = {None: tuple(int(s) for s in text.lower().replace("x", ",").split(","))}
        except ValueError:
            raise UsageError(f"{flag} {text!r} must be {FORM}") from None
    for name, shape in named.items():
        if not shape or min(shape) < 1:
            raise UsageError(f"{flag} {text} must be positive integers: give {FORM}")
    return named


def show(shapes: Mapping[str | None, tuple[int, ...]]) -> str:
    """The shapes as the user typed them (``1,16`` or ``input_ids:1x8``), for messages.

    Example:
        >>> show({None: (1, 16)}), show({"input_ids": (1, 8)})
        ('1,16', 'input_ids:1x8')
    """
    if list(shapes) == [None]:
        return ",".join(map(str, shapes[None]))
    return ",".join(f"{n}:{'x'.join(map(str, s))}" for n, s in shapes.items())


def _vocab_size(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def example_inputs(model: nn.Module, shapes: Mapping[str | None, tuple[int, ...]], seed: int = 0,
                   flag: str = "--input-shape") -> dict[str | None, torch.Tensor]:
    """Random inputs of ``shapes`` for ``model``: token ids below its vocabulary size for ``input_ids`` (and for an
    unnamed input of a model with an ``nn.Embedding``), ones for ``attention_mask``, zeros for ``token_type_ids``,
    positions for ``position_ids``, standard normal floats otherwise.

    Example:
        >>> x = example_inputs(nn.Linear(16, 4), {None: (2, 16)})
        >>> tuple(x[None].shape), x[None].dtype
        ((2, 16), torch.float32)
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = _vocab_size(model)
    out: dict[str | None, torch.Tensor] = {}
    for name, shape in shapes.items():
        ids = name in ("input_ids", "decoder_input_ids") or (name is None and vocab is not None)
        if ids:
            if vocab is None:
                raise UsageError(f"{flag} {name}:{'x'.join(map(str, shape))}: {type(model).__name__} has no "
                                 "nn.Embedding or config.vocab_size to draw token ids below; name its float inputs "
                                 "instead, e.g. x:1x16")
            out[name] = torch.randint(0, vocab, shape, generator=gen)
        elif name == "attention_mask":
            out[name] = torch.ones(shape, dtype=torch.long)
        elif name == "token_type_ids":
            out[name] = torch.zeros(shape, dtype=torch.long)
        elif name == "position_ids":
            out[name] = torch.arange(shape[-1]).expand(shape).contiguous()
        else:
            out[name] = torch.randn(shape, generator=gen)
    return out


def by_position(model: nn.Module, shapes: Mapping[str | None, tuple[int, ...]]) -> Shapes:
    """``shapes`` with a lone named input that ``model.forward`` has no parameter for as unnamed (build's
    ``--shapes x:1x16`` names a lone input anything, as an ONNX input name may differ from forward's).

    Example:
        >>> by_position(nn.Linear(16, 4), {"x": (1, 16)})
        {None: (1, 16)}
    """
    if len(shapes) == 1 and None not in shapes:
        params = forward_parameters(model) or {}
        name = next(iter(shapes))
        if name not in params:
            return {None: shapes[name]}
    return dict(shapes)


def positional(model: nn.Module, inputs: Mapping[str | None, torch.Tensor], text: str,
               flag: str = "--input-shape") -> tuple[Any, ...]:
    """``inputs`` as a positional call of ``model.forward``: by name in forward's order, None for the optional
    parameters between them (``bert(input_ids, None, token_type_ids)``). A name forward does not take positionally
    is refused, naming the parameters it does take.

    Example:
        >>> class Two(nn.Module):
        ...     def forward(self, a, b=None, c=None): return a
        >>> positional(Two(), {"c": 1, "a": 0}, "a:1,c:1")
        (0, None, 1)
    """
    if list(inputs) == [None]:
        return (inputs[None],)
    params = forward_parameters(model) or {}
    pos = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [n for n in inputs if n not in pos]
    if unknown:
        raise UsageError(f"{flag} {text!r} names {unknown} but {type(model).__name__}.forward takes "
                         f"{pos[:8] or 'no named inputs'}; name the inputs after its parameters, e.g. "
                         f"{(pos or ['x'])[0]}:1x16")
    last = max(pos.index(n) for n in inputs)  # type: ignore[arg-type]
    missing = [n for n in pos[:last + 1] if n not in inputs and params[n].default is params[n].empty]
    if missing:
        raise UsageError(f"{flag} {text!r} gives no shape for {missing}, which {type(model).__name__}.forward needs; "
                         f"add {missing[0]}:AxB")
    return tuple(inputs.get(n) for n in pos[:last + 1])


def check_batches(shapes: Mapping[str | None, tuple[int, ...]], names: tuple[str, ...] | None,
                  first: tuple[torch.Tensor, ...], where: str, flag: str = "--input-shape") -> None:
    """Refuse calibration inputs whose shape (past the batch dim) or rank is not the ``--input-shape`` given.
    ``names``/``first``: the calibration's input names (None: by position) and its first batch.

    Example:
        >>> check_batches({None: (1, 16)}, None, (torch.zeros(4, 16),), "calib.npy")
    """
    text = show(shapes)
    if list(shapes) == [None]:
        if len(first) != 1:
            raise UsageError(f"{flag} {text} gives one input but {where} holds {len(first)} per batch; name each, "
                             f"e.g. {','.join(f'{n}:1x8' for n in (names or ['input_ids', 'attention_mask']))}")
        pairs = [(None, shapes[None], first[0])]
    else:
        by_name = dict(zip(names, first)) if names is not None else {}
        absent = [n for n in shapes if n not in by_name]
        if absent:
            raise UsageError(f"{flag} {text} names {absent} but {where} holds inputs "
                             f"{list(names) if names else f'{len(first)} unnamed'}; save them by those names "
                             "(np.savez('calib.npz', input_ids=ids, ...) or torch.save({'input_ids': ids}, ...))")
        pairs = [(n, s, by_name[n]) for n, s in shapes.items()]
    for name, want, got in pairs:
        if got.dim() != len(want) or tuple(got.shape[1:]) != tuple(want[1:]):
            what = f"input {name!r}" if name else "its input"
            raise UsageError(f"{flag} {text} says {what} is (N, {', '.join(map(str, want[1:]))}) but {where} holds "
                             f"batches of {tuple(got.shape)}; save samples of the shape the model takes, or fix "
                             f"{flag}")
