"""What ``overdrive build`` does with its flags, kept out of the CLI module so it stays thin."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.api import Builder
from overdrive.engine.runtime import Engine
from overdrive.engine.config import BuildConfig, parse_io_formats, profiles_from_shapes
from overdrive.engine.sources import ModelSource, from_exported, from_module, from_onnx, from_torchscript
from overdrive.recipes.calib_formats import ImageOptions


def _calibration(path: str | None, src: ModelSource, images: ImageOptions | None = None,
                 profiles: list[Any] | None = None) -> list[tuple[torch.Tensor, ...]] | None:
    """--calib batches in the order of the model's inputs (the format: :mod:`overdrive.recipes.calibration`); an
    image folder is read at the first input's --shapes (opt shape) unless ``images`` gives a shape. Keys the
    engine's inputs lack (a tokenized dataset's ``labels``) are left out with a warning; float token ids and
    batches outside the shape profiles are refused here, before the export."""
    if path is None:
        return None
    from overdrive.recipes.calibration import load_calibration

    first = src.input_names[0] if src.input_names else None
    shape = next((p.opt for p in profiles or [] if p.name == first), profiles[0].opt if profiles else None)
    names = list(src.input_names) if src.input_names else None
    extra = _extra_keys(path, names)
    batches = load_calibration(path, "--calib", model=src.module, input_names=[*names, *extra] if extra else names,
                               images=images, input_shape=shape).batches
    if extra and names:
        how = "to calibrate with one, name it in --shapes too" if src.module is not None else "the ONNX model takes none"
        warnings.warn(f"--calib {path}: left out {extra}, which are not inputs of the engine (its inputs: {names}); "
                      f"{how}", UserWarning, stacklevel=3)
        batches = [b[:len(names)] for b in batches]
    if names:
        if src.module is not None:  # an ONNX model declares its input types, and ONNX Runtime checks them
            _check_index_dtypes(path, names, batches[0])
        _check_in_profiles(path, profiles or [], names, batches)
    return batches


def _extra_keys(path: str, names: list[str] | None) -> list[str]:
    """The keys of a calibration file of dicts (``torch.save(list(loader))``, an ``.npz``) that are no input of the
    engine, when it holds every input the engine takes (an ``attention_mask`` may be derived from the ids); [] for
    other files, which :func:`~overdrive.recipes.calibration.load_calibration` checks as they are."""
    from overdrive.recipes.calib_formats import TEXT_SUFFIXES
    from overdrive.recipes.calibration import load_calibration

    if not names or not Path(path).is_file() or Path(path).suffix.lower() in TEXT_SUFFIXES:
        return []
    keys = load_calibration(path, "--calib", max_batches=1).names  # dict keys; None for tensors and tuples
    if keys is None:
        return []
    extra = [k for k in keys if k not in names]
    # a derived attention_mask only where no extra key could be a misnamed one ("mask": refused as unknown, not dropped)
    derivable = "input_ids" in keys and not any("mask" in k for k in extra)
    held = all(n in keys or (n == "attention_mask" and derivable) for n in names)
    return extra if held else []


def _check_index_dtypes(path: str, names: list[str], batch: tuple[torch.Tensor, ...]) -> None:
    """Refuse float calibration data for a module's input that its name says indexes an embedding (token ids,
    positions): the batches' dtypes become the engine's, and the export failed on float ids far from the cause.
    Masks may be float (Hugging Face takes either)."""
    from overdrive.engine.input_dtypes import INTEGER_INPUTS

    for name, x in zip(names, batch):
        ids = name in INTEGER_INPUTS and "mask" not in name and name != "labels"
        if ids and x.is_floating_point():
            raise UsageError(f"--calib {path}: input {name!r} is {str(x.dtype).removeprefix('torch.')}, but it holds "
                             "token ids, which the model takes as integers (int64); save it as integers, e.g. "
                             f"np.savez(..., {name}=ids.astype(np.int64)) or torch.save({{'{name}': ids.long()}}, ...)")


def _check_in_profiles(path: str, profiles: list[Any], names: list[str], batches: list[tuple[torch.Tensor, ...]]) -> None:
    """Refuse calibration batches whose rank, or a dim past the batch dim, lies outside the input's shape profile
    (a static --shapes fixes every dim; the batch dim is free, as batches are joined and cut to the engine's)."""
    by = {p.name: p for p in profiles}
    for k, batch in enumerate(batches):
        for name, x in zip(names, batch):
            p = by.get(name)
            if p is None:
                continue
            got = tuple(x.shape)
            bad = len(got) != len(p.min) or any(not lo <= d <= hi for d, lo, hi in zip(got[1:], p.min[1:], p.max[1:]))
            if not bad:
                continue
            if x.dim() == len(p.min) + 1:
                fix = (f"batches of batches? give one array of samples (N, ...): {name}.reshape(-1, "
                       f"*{name}.shape[2:]), or a list of per-batch dicts")
                where = f"the profile gives it {len(p.min)} dims"
            elif p.static:
                fix = (f"give samples of (N, {', '.join(map(str, p.opt[1:]))}) (pad to the --shapes length, with an "
                       "attention_mask marking the padding), or let the dims vary: --minShapes/--optShapes/--maxShapes")
                where = f"--shapes {name}:{'x'.join(map(str, p.opt))} fixes it at (N, {', '.join(map(str, p.opt[1:]))})"
            else:
                fix = "give samples inside the profile, or widen --minShapes/--maxShapes"
                where = (f"the profile takes {'x'.join(map(str, p.min[1:]))} to {'x'.join(map(str, p.max[1:]))} "
                         "past the batch dim")
            raise UsageError(f"--calib {path}: batch {k}'s input {name!r} is {'x'.join(map(str, got))}, but {where}; "
                             f"{fix}")


def _exported_example(path: str, src: ModelSource) -> tuple[torch.Tensor, ...]:
    """The example inputs a torch.export archive holds (``torch.export.save`` stores the ones it was exported
    with): the engine is built at their shapes when no --shapes are given."""
    from overdrive.engine.sources import load_exported

    stored = getattr(load_exported(path, f"exported program {path}"), "example_inputs", None)
    args, kwargs = stored if isinstance(stored, tuple) and len(stored) == 2 else ((), {})
    xs = [*args, *(kwargs or {}).values()]
    if not xs or len(xs) != len(src.input_names) or not all(isinstance(x, torch.Tensor) for x in xs):
        raise UsageError(f"--exported {path} holds no example input tensors for its inputs {src.input_names}; give "
                         f"--shapes {src.input_names[0] if src.input_names else 'x'}:AxBxC (or --min/--opt/--max-shapes)")
    src.input_dtypes = {**{n: x.dtype for n, x in zip(src.input_names, xs)}, **src.input_dtypes}
    return tuple(x.detach().cpu() for x in xs)


def io_formats(flag: str, spec: str | list[str] | None) -> list[str]:
    """:func:`~overdrive.engine.config.parse_io_formats` for one flag, whose name a bad value's message carries.

    Example:
        >>> io_formats("--inputIOFormats", "fp16:hwc")
        ['fp16:hwc']
    """
    try:
        return parse_io_formats(spec)
    except UsageError as exc:
        why = str(exc).replace(" (--inputIOFormats / --outputIOFormats)", "")
        raise UsageError(f"{flag} {spec if isinstance(spec, str) else ','.join(spec or [])}: {why}") from exc


def build_config(max_autotune: bool = False, input_io_formats: str | list[str] | None = None,
                 output_io_formats: str | list[str] | None = None, **options: Any) -> BuildConfig:
    """The :class:`~overdrive.engine.config.BuildConfig` of ``overdrive build``'s flags (``max_autotune``: the
    compile mode; the I/O formats as trtexec spells them), checked before any model is read.

    Example:
        >>> build_config(precision="fp16", max_autotune=True).compile_mode
        'max-autotune'
    """
    return BuildConfig(compile_mode="max-autotune" if max_autotune else None,
                       input_io_formats=io_formats("--inputIOFormats", input_io_formats),
                       output_io_formats=io_formats("--outputIOFormats", output_io_formats), **options)


def build_engine(onnx: str | None = None, model: str | None = None, torchscript: str | None = None,
                 exported: str | None = None, save_engine: str = "model.engine", precision: str = "fp32",
                 shapes: str | None = None, min_shapes: str | None = None, opt_shapes: str | None = None,
                 max_shapes: str | None = None, backend: str = "auto", device: str = "auto", max_autotune: bool = False,
                 aot: bool | None = None, int8_activations: str | None = None, calib: str | None = None,
                 layer_precision: str = "timed", accept_low_accuracy: bool = False, checkpoint: str | None = None,
                 timing_cache: str | None = None,
                 trust_timing_cache: bool = False,
                 freezing: bool | None = None, input_io_formats: str | None = None,
                 output_io_formats: str | None = None, gemm_gelu: bool | None = None,
                 conv_fusion: bool | None = None, sibling_gemms: bool | None = None,
                 quantize_residuals: bool = False, lowp_linears: str = "timed", calib_samples: int = 512,
                 calib_normalize: str | None = None, allow_tf32: bool = True) -> Engine:
    """Build and save an engine from CLI-style arguments.

    An int8/fp8 engine whose outputs on the calibration data fall below the accuracy tolerance raises
    :class:`~overdrive.OverdriveError` and is not saved, unless ``accept_low_accuracy``. ``calib`` may be a folder
    of images (``calib_samples`` of them, normalized as ``calib_normalize`` says, at the --shapes size) or a
    ``.txt`` file (:mod:`overdrive.recipes.calib_formats`). Calibration inputs go by the --shapes names (a T5's
    ``input_ids`` and ``decoder_input_ids``); keys the engine does not take (``labels``) are left out with a
    warning, and float token ids or samples outside the shape profiles are refused before the export.

    Example:
        >>> # build_engine(onnx="m.onnx", save_engine="m.engine", shapes="input:1x3x224x224")
    """
    given = [n for n, v in (("--onnx", onnx), ("--model", model), ("--torchscript", torchscript), ("--exported", exported)) if v]
    if checkpoint and not model:
        raise UsageError(f"--checkpoint {checkpoint} loads weights into a --model factory's model; the {given[0] if given else 'source'} "
                         "given carries its own weights: drop --checkpoint, or build from --model with it")
    if checkpoint and not Path(checkpoint).is_file():
        raise UsageError(f"--checkpoint {checkpoint!r} does not exist")
    if len(given) != 1:
        raise UsageError(f"give exactly one of --onnx, --model, --torchscript, --exported (got {given or 'none'})")
    profiles = profiles_from_shapes(shapes, min_shapes, opt_shapes, max_shapes)
    # bad --precision, --backend or I/O formats are refused here, before the model is imported or read
    cfg = build_config(precision=precision, backend=backend, device=device, profiles=profiles,
                       max_autotune=max_autotune, aot=aot, int8_activations=int8_activations,
                       layer_precision=layer_precision, timing_cache=timing_cache,
                       trust_timing_cache=trust_timing_cache, freezing=freezing, gemm_gelu=gemm_gelu,
                       conv_fusion=conv_fusion, sibling_gemms=sibling_gemms, quantize_residuals=quantize_residuals,
                       lowp_linears=lowp_linears, input_io_formats=input_io_formats,
                       output_io_formats=output_io_formats, allow_tf32=allow_tf32)
    images = ImageOptions(normalize=calib_normalize, samples=calib_samples)  # bad values refused before the build
    example: tuple[torch.Tensor, ...] | None = None
    if torchscript:
        if not profiles:
            raise UsageError("--torchscript needs --shapes (TorchScript files do not record input shapes)")
        if any(not p.static for p in profiles):  # before the export, which can take a while
            raise UsageError("--torchscript builds static shapes only (the TorchScript->ONNX export fixes them); use --shapes")
        src = from_torchscript(torchscript, profiles)
    elif onnx:
        src = from_onnx(onnx)
    elif exported:
        src = from_exported(exported)
        if not profiles:
            example = _exported_example(exported, src)
    else:
        from overdrive.recipes.model_spec import load_checkpoint, load_model

        module = load_model(model)
        if checkpoint:  # its weights: a state_dict, a Trainer checkpoint or a .sparse24.pt from overdrive sparsify
            load_checkpoint(module, checkpoint)
        src = from_module(module.eval())
    if calib and profiles and src.module is not None:
        # the --shapes names are the engine's inputs (a T5's input_ids and decoder_input_ids, not forward's first
        # two): the batches are read and checked by them, and the builder resolves them again the same way
        from overdrive.engine.inputs import resolve_profiles

        resolve_profiles(profiles, src, None)
    batches = _calibration(calib, src, images, profiles)
    if batches and src.module is not None:
        # a module does not say its input dtypes: the calibration data does (int64 token ids, not random floats),
        # over what the names and the forward's uses suggest
        src.input_dtypes = {**src.input_dtypes, **{n: x.dtype for n, x in zip(src.input_names, batches[0])}}
        if len(profiles) == 1 == len(batches[0]):
            src.input_dtypes[profiles[0].name] = batches[0][0].dtype
    engine = Builder(cfg, on_low_accuracy="warn" if accept_low_accuracy else "raise").build(src, example, calib=batches, onnx_path=str(Path(save_engine).with_suffix(".onnx")))
    engine.save(save_engine)
    return engine
