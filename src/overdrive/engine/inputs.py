"""An engine's inputs: shape profiles resolved against the model, the I/O formats, and random inputs for
warm-ups, timing and compare (integer inputs as their names say: masks of ones, token ids in the vocabulary).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.trees import is_plain_dataclass, tensor_leaves
from overdrive._utils.inputs import forward_parameters, takes_names
from overdrive.engine.config import IO_DTYPES, BuildConfig, ShapeProfile, shapes_arg
from overdrive.engine.input_dtypes import integer_dtypes
from overdrive.engine.sources import ModelSource


def apply_io_formats(example: tuple[torch.Tensor, ...], cfg: BuildConfig, src: Any, backend: str) -> tuple[torch.Tensor, ...]:
    """The example inputs in the ``--inputIOFormats`` types and layouts: the engine's bindings take those."""
    fmts = cfg.input_io_formats
    if not fmts and not cfg.output_io_formats:
        return example
    if backend != "inductor":
        raise UsageError("--inputIOFormats/--outputIOFormats need the inductor backend (--backend inductor): the "
                         "onnxruntime backend takes the ONNX model's own input and output types")
    if not fmts:
        return example
    if len(fmts) not in (1, len(example)):
        raise UsageError(f"--inputIOFormats gives {len(fmts)} formats for {len(example)} inputs {src.input_names}; "
                         "give one per input, in order, or one for all")
    if len(fmts) == 1:
        dt = getattr(torch, IO_DTYPES[fmts[0].split(":")[0]])
        if not any(x.is_floating_point() == dt.is_floating_point for x in example):
            # one format for all applies to the inputs of its kind; with none, the flag changed nothing, silently
            kinds = ", ".join(f"{n} {x.dtype}" for n, x in zip(src.input_names, example))
            raise UsageError(f"--inputIOFormats {fmts[0]} applies to no input ({kinds}): give "
                             f"{'a floating' if not dt.is_floating_point else 'an integer'} type, e.g. "
                             f"{'fp16:chw' if not dt.is_floating_point else 'int64:chw'}, or leave the flag out")
    out = []
    for i, x in enumerate(example):
        dtype_name, layout = (fmts[i] if len(fmts) > 1 else fmts[0]).split(":")
        dt = getattr(torch, IO_DTYPES[dtype_name])
        if x.is_floating_point() != dt.is_floating_point:
            if len(fmts) == 1:  # one format for all: it applies to the float inputs (ids and masks keep their type)
                out.append(x)
                continue
            raise UsageError(f"--inputIOFormats {fmts[i]} for input {src.input_names[i]!r}, which is {x.dtype}: give a "
                             f"{'floating' if x.is_floating_point() else 'integer'} type for it")
        x = x.to(dt)
        if layout != "chw" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(x)
    return tuple(out)


def ordered(profiles: list[ShapeProfile], names: list[str]) -> list[ShapeProfile]:
    by = {p.name: p for p in profiles}
    return [by[n] for n in names]


def check_example_in_profiles(profiles: list[ShapeProfile], names: list[str],
                              example: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    """Refuse example inputs outside the shape profiles, before the build traces, calibrates and times with them
    (an engine built so refuses that very shape when called).

    Example:
        >>> check_example_in_profiles([ShapeProfile("x", (1, 8), (4, 8), (8, 8))], ["x"], (torch.zeros(16, 8),))
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: example input 'x' has shape (16, 8), outside its shape profile min (1, 8) max (8, 8); give an example inside it (its opt shape (4, 8)) or widen the profile (--minShapes/--maxShapes)
    """
    by = {p.name: p for p in profiles}
    for name, x in zip(names, example):
        p = by.get(name)
        if p is None or not isinstance(x, torch.Tensor):
            continue
        shape = tuple(x.shape)
        if len(shape) != len(p.min) or any(not lo <= d <= hi for d, lo, hi in zip(shape, p.min, p.max)):
            raise UsageError(f"example input {name!r} has shape {shape}, outside its shape profile min {p.min} max "
                             f"{p.max}; give an example inside it (its opt shape {p.opt}) or widen the profile "
                             "(--minShapes/--maxShapes)")


def resolve_profiles(profiles: list[ShapeProfile], src: ModelSource, example: tuple[torch.Tensor, ...] | None) -> list[ShapeProfile]:
    names = src.input_names
    if profiles:
        if src.onnx_bytes is None and len(names) == 1 == len(profiles) and profiles[0].name != names[0]:
            if names[0] in src.input_dtypes:  # its dtype (an index input of an embedding) goes with it
                src.input_dtypes = {profiles[0].name: src.input_dtypes[names[0]]}
            src.input_names = names = [profiles[0].name]  # a module's one input takes the profile's name
        elif (src.module is not None and {p.name for p in profiles} != set(names)
              and takes_names(src.module, [p.name for p in profiles])):
            # a module that takes the profiles' names (input_ids, attention_mask, ...) is called by those names
            src.input_names = names = [p.name for p in profiles]
            src.input_dtypes = {**integer_dtypes(names), **{k: v for k, v in src.input_dtypes.items() if k in names}}
        given = {p.name for p in profiles}
        fixed = {n: s for n, s in (src.onnx_shapes or {}).items() if n in names and n not in given and s and all(s)}
        if fixed:  # as trtexec: inputs whose dims the ONNX model fixes need no shapes
            profiles = [*profiles, *(ShapeProfile.fixed(n, tuple(s)) for n, s in fixed.items())]
            given |= set(fixed)
        if given != set(names):
            missing, unknown = sorted(set(names) - given), sorted(given - set(names))
            params = forward_parameters(src.module) if src.module is not None else None
            if unknown and params:  # a module: its forward's parameter names are what a profile may name
                takes = [n for n, q in params.items() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD,
                                                                     q.KEYWORD_ONLY)][:8]
                raise UsageError(f"shape profiles name {unknown}, which the model's forward does not take; it takes "
                                 f"{takes}: name the inputs as forward names them, e.g. {takes[0]}:"
                                 f"{'x'.join(map(str, profiles[0].opt))}")
            raise UsageError(f"shape profiles must name every model input {names}: missing {missing}, unknown {unknown}")
        return ordered(profiles, names)
    if example:
        return [ShapeProfile.fixed(n, tuple(x.shape)) for n, x in zip(names, example)]
    shapes = src.onnx_shapes
    if shapes and all(n in shapes and all(d for d in shapes[n]) for n in names):
        return [ShapeProfile.fixed(n, tuple(shapes[n])) for n in names]
    if not names:  # an empty .onnx file parses as a model with no graph: a hint of "--shapes ''" helped no one
        what = "ONNX model" if src.onnx_bytes is not None else "model"
        raise UsageError(f"the {what} declares no inputs (an empty or truncated file?); export or download it again")
    raise UsageError(f"give the input shapes: --shapes {_shapes_hint(names, shapes)} (or --min/--opt/--max-shapes), or "
                     "example inputs")


def _shapes_hint(names: list[str], shapes: dict[str, list[int | None]] | None) -> str:
    """A ``--shapes`` value for every input: the ONNX model's dims, its dynamic ones (0 or None) read as 1; an
    input whose dims are unknown (a PyTorch model's) gets a placeholder: an image shape when it is the only input.

    Example:
        >>> _shapes_hint(["x", "y"], {"x": [0, 3, 32, 32], "y": [None, 6]}), _shapes_hint(["x"], None)
        ('x:1x3x32x32,y:1x6', 'x:1x3x224x224')
        >>> _shapes_hint(["x", "idx"], None)
        'x:AxBx...,idx:AxBx...'
    """
    known = shapes or {}
    unknown = "1x3x224x224" if len(names) == 1 else "AxBx..."
    return shapes_arg({n: "x".join(str(d or 1) for d in known[n]) if known.get(n) else unknown for n in names})


def onnx_shared_dims(src: ModelSource) -> list[list[list[Any]]]:
    """The input dims an ONNX model names alike (``dim_param``: ``batch`` on input_ids and attention_mask), which
    ONNX declares equal: ``[[["x", 0], ["y", 0]], ...]``, the groups engines check at run time (as TensorRT 10's
    named dimensions). Unlike sizes fed to such dims broadcast or failed deep in ONNX Runtime.

    Example:
        >>> onnx_shared_dims(ModelSource(input_names=["x", "y"], onnx_dim_params={"x": ["B", None], "y": ["B"]}))
        [[['x', 0], ['y', 0]]]
    """
    return named_dim_groups({n: (src.onnx_dim_params or {}).get(n) or [] for n in src.input_names})


def named_dim_groups(dims: dict[str, list[Any]]) -> list[list[list[Any]]]:
    """The groups of input dims that carry one name (a string among each input's dims, as ONNX Runtime's
    ``session.get_inputs()[i].shape`` gives them; ints and None are not names).

    Example:
        >>> named_dim_groups({"ids": ["batch", "seq"], "mask": ["batch", "seq"], "x": ["batch", 8]})
        [[['ids', 0], ['mask', 0], ['x', 0]], [['ids', 1], ['mask', 1]]]
    """
    groups: dict[str, list[list[Any]]] = {}
    for n, ds in dims.items():
        for d, param in enumerate(ds):
            if isinstance(param, str) and param:
                groups.setdefault(param, []).append([n, d])
    return [g for g in groups.values() if len(g) > 1]


def check_onnx_dims(profiles: list[ShapeProfile], src: ModelSource) -> None:
    """Refuse a profile that an ONNX model's fixed input dims cannot run (it built, then failed at run time), or
    that gives dims the model names alike (one ``dim_param``) different ranges."""
    by = {p.name: p for p in profiles}
    params = src.onnx_dim_params or {}
    for group in onnx_shared_dims(src):
        ranges = {f"{n}[{d}]": tuple(getattr(by[n], end)[d] for end in ("min", "opt", "max"))
                  for n, d in group if n in by and d < len(by[n].opt)}
        if len(set(ranges.values())) > 1:
            n0, d0 = group[0]
            raise UsageError(f"inputs {', '.join(f'{k} {lo}/{mid}/{hi}' for k, (lo, mid, hi) in ranges.items())} "
                             f"(min/opt/max) share the ONNX model's dim {params[n0][d0]!r}, so they have one size; "
                             "give them the same min, opt and max")
    shapes = src.onnx_shapes or {}
    for p in profiles:
        fixed = shapes.get(p.name)
        if fixed is None:
            continue
        if len(fixed) != len(p.opt):
            raise UsageError(f"input {p.name!r} has rank {len(fixed)} in the ONNX model but the shape profile gives "
                             f"rank {len(p.opt)} ({'x'.join(map(str, p.opt))}); give {len(fixed)} dims")
        for d, (v, lo, hi) in enumerate(zip(fixed, p.min, p.max)):
            if v and (lo != v or hi != v):
                raise UsageError(f"input {p.name!r} dim {d} is fixed to {v} in the ONNX model, but the profile asks for "
                                 f"{lo}..{hi}; use {v} there, or re-export the model with that dim dynamic")


def random_input(name: str, shape: tuple[int, ...], dt: torch.dtype, g: torch.Generator,
                  vocab: int | None = None) -> torch.Tensor:
    """One input for timing or a warm-up: floats from N(0, 1); integer inputs as their names say (masks all
    ones, token types zeros, positions 0..n-1, token ids in the vocabulary when known, else 0/1)."""
    if dt.is_floating_point:
        return torch.randn(shape, generator=g)
    if name.endswith("attention_mask") or name == "pixel_mask":
        return torch.ones(shape, dtype=torch.int64)  # every token attended to
    if name == "token_type_ids":
        return torch.zeros(shape, dtype=torch.int64)
    if name == "position_ids" and shape:
        return torch.arange(shape[-1]).expand(shape).contiguous()
    return torch.randint(0, vocab if isinstance(vocab, int) and vocab > 0 else 2, shape, generator=g)


def random_inputs(profiles: list[ShapeProfile], src: ModelSource, device: torch.device, which: str = "opt",
                   seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(getattr(src.module, "config", None), "vocab_size", None)
    out = []
    for p in ordered(profiles, src.input_names):
        dt = src.input_dtypes.get(p.name, torch.float32)
        shape = getattr(p, which)
        x = random_input(p.name, tuple(shape), dt, g, vocab)
        out.append(x.to(dt).to(device))
    return tuple(out)


def _field_names(obj: Any) -> list[str]:
    """The names of a dataclass's tensors, in :func:`tensor_leaves` order: a tensor field by its name, the tensors
    of a field holding several (a tuple, a dict, a dataclass) as ``field.i``.

    Example:
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...     pair: tuple
        ...     mask: torch.Tensor | None = None
        >>> _field_names(Batch(torch.zeros(1), (torch.zeros(1), torch.zeros(1))))
        ['x', 'pair.0', 'pair.1']
    """
    names = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name, None)
        n = len(tensor_leaves(v))
        names += [f.name] if isinstance(v, torch.Tensor) else [f"{f.name}.{i}" for i in range(n)]
    return names


def unpack_dataclasses(example: Any, calib: Any, params: list[str]
                       ) -> tuple[Any, list[str] | None, Any, list[tuple[Any, int] | None] | None]:
    """Example inputs (and calibration batches) in which a model's argument is its own ``@dataclass`` of tensors
    (``model(Batch(x, mask))``), as the tensors an engine takes, and how to pack them back: the engine's inputs are
    the dataclass's tensors by field name (``x``, ``mask``), a tensor argument takes its name from ``params`` (the
    forward's positional parameters). ``layout`` holds per argument None (a tensor) or ``(dataclass, n)``: the
    example's instance, whose other fields (None, numbers, strings) every call keeps, and how many tensors it takes.
    Unchanged, with layout None, when no argument is such a dataclass.

    Example:
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...     mask: torch.Tensor
        >>> ex, names, cal, layout = unpack_dataclasses(Batch(torch.zeros(2, 3), torch.ones(2, 3)), None, ["batch"])
        >>> names, len(ex), layout[0][1]
        (['x', 'mask'], 2, 2)
    """
    args = (example,) if is_plain_dataclass(example) else example
    if not isinstance(args, (tuple, list)) or not any(is_plain_dataclass(a) for a in args):
        return example, None, calib, None
    flat: list[Any] = []
    names: list[str] = []
    layout: list[tuple[Any, int] | None] = []
    for i, a in enumerate(args):
        if is_plain_dataclass(a):
            own = _field_names(a)
            if not own:
                raise UsageError(f"example input {i} is a {type(a).__name__} that holds no tensor; an engine's inputs "
                                 "are tensors: give the model's tensors in it, or fix that argument in a wrapper module")
            flat += tensor_leaves(a)
            taken = set(names) | set(params[:len(args)])  # a name clash: the argument's name before the field's
            arg = params[i] if i < len(params) else type(a).__name__.lower()
            names += [n if n not in taken else f"{arg}.{n}" for n in own]
            layout.append((a, len(own)))
        else:
            flat.append(a)
            names.append(params[i] if i < len(params) else f"input{i}")
            layout.append(None)
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"two example inputs would both be named {dup!r}; give the dataclasses fields of distinct "
                         "names, or pass the tensors themselves")
    if calib is None or isinstance(calib, (torch.Tensor, dict)) or is_plain_dataclass(calib):
        return tuple(flat), names, calib, layout  # one batch, not a list: build_inputs says so
    batches = []
    for k, b in enumerate(calib):
        parts = (b,) if is_plain_dataclass(b) else b
        xs = [t for part in parts for t in tensor_leaves(part)] if isinstance(parts, (tuple, list)) else None
        if xs is None or len(xs) != len(flat):
            raise UsageError(f"calibration batch {k} is a {type(b).__name__} holding {len(xs or [])} tensor(s); the "
                             f"example holds {len(flat)} ({names}): give every batch in the example's form")
        batches.append(tuple(xs))
    return tuple(flat), names, batches, layout


def build_inputs(example: Any, input_names: list[str] | None, calib: Any
                 ) -> tuple[tuple[torch.Tensor, ...] | None, list[str] | None, list[tuple[torch.Tensor, ...]] | None]:
    """The example inputs, input names and calibration batches of a build in the one form the builder takes: a
    tuple of tensors, the names, a list of tuples in that order.

    A Hugging Face model is called with keyword arguments (``model(**batch)``), so its example is naturally a dict:
    its keys name the engine's inputs (the forward parameters they are, in the dict's order), and a dict batch of
    calibration data (a ``DataLoader`` over a tokenized dataset yields those) gives its values by those names; a key
    the example has no input for (``labels``) is left out. A single tensor, or a list, is one batch of positional
    inputs.

    Example:
        >>> ex, names, cal = build_inputs({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, None,
        ...                               [{"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2)}])
        >>> names, [tuple(x.shape) for x in cal[0]]
        (['input_ids'], [(2, 4)])
    """
    if isinstance(example, dict):
        bad = {k: type(v).__name__ for k, v in example.items() if not isinstance(v, torch.Tensor)}
        if bad:
            k, t = next(iter(bad.items()))
            raise UsageError(f"example input {k!r} is a {t}; an engine's inputs are tensors: leave {k!r} out of the "
                             "dict (a fixed setting belongs in the model, e.g. a wrapper module that passes it)")
        if not example:
            raise UsageError("the example inputs are an empty dict; give the model's inputs by name, e.g. "
                             "{'input_ids': ids, 'attention_mask': mask}")
        names = [str(k) for k in example]
        if input_names is not None and list(input_names) != names:
            raise UsageError(f"input_names {list(input_names)} differ from the example dict's keys {names}; give one "
                             "of them (the dict's keys name the inputs)")
        example, input_names = tuple(example.values()), names
    elif isinstance(example, list):
        example = tuple(example)
    elif isinstance(example, torch.Tensor):
        example = (example,)
    elif example is not None and not isinstance(example, tuple):
        raise UsageError(f"example inputs of type {type(example).__name__}; expected a tensor, a tuple of tensors "
                         "or a dict of tensors by input name")
    if example is not None:
        for i, x in enumerate(example):
            if not isinstance(x, torch.Tensor):
                raise UsageError(f"example input {i} is a {type(x).__name__}; an engine's inputs are tensors (give a "
                                 "tuple of tensors, or a dict of them by name)")
    if calib is None:
        return example, input_names, None
    if isinstance(calib, (torch.Tensor, dict)):
        raise UsageError(f"calib is one batch ({type(calib).__name__}); give a list of batches, e.g. [batch] or "
                         "list(itertools.islice(loader, 8))")
    batches = []
    for i, b in enumerate(calib):
        if isinstance(b, dict):
            if input_names is None:
                raise UsageError(f"calibration batch {i} is a dict, but the inputs are not named: give the example "
                                 "inputs as a dict too (or input_names), so its keys can be matched")
            missing = [n for n in input_names if n not in b]
            if missing:
                raise UsageError(f"calibration batch {i} has no {missing[0]!r} (keys: {sorted(map(str, b))}); every "
                                 f"batch needs the engine's inputs {list(input_names)}")
            b = tuple(b[n] for n in input_names)
        elif isinstance(b, torch.Tensor):
            b = (b,)
        elif isinstance(b, list):
            b = tuple(b)
        if not isinstance(b, tuple) or not all(isinstance(x, torch.Tensor) for x in b):
            raise UsageError(f"calibration batch {i} is a {type(b).__name__}; expected a tensor, a tuple of tensors "
                             "or a dict of tensors by input name")
        batches.append(b)
    return example, input_names, batches
