"""What ``overdrive run`` does: polygraphy's ``run model.onnx --trt --onnxrt`` on overdrive's own parts.

``--trt`` builds an overdrive engine from the ONNX model in memory (TensorRT is not used: the engine backend is
chosen as ``overdrive build`` chooses it), ``--onnxrt`` runs the ONNX model as written in ONNX Runtime's CPU
provider, and the two are compared output by output on the same inputs (:func:`overdrive.engine.compare`), ONNX
Runtime as the reference.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from overdrive._utils.errors import UsageError


def polygraphy_shapes(values: tuple[str, ...] | list[str] | None) -> str | None:
    """Polygraphy's ``--input-shapes name:[1,3,224,224] other:[1,8]`` (one flag, several space-separated values,
    or the flag repeated) as trtexec's ``name:1x3x224x224,other:1x8``; ``name:1x3`` is taken as it is.

    Example:
        >>> polygraphy_shapes(["x:[1,3,8,8] mask:[1,8]"]), polygraphy_shapes(["x:1x3"]), polygraphy_shapes([])
        ('x:1x3x8x8,mask:1x8', 'x:1x3', None)
    """
    items: list[str] = []
    for value in values or ():
        # split on spaces outside brackets and quotes: a name may hold a space when quoted ('in put':[1,4])
        items += [m.group(0) for m in re.finditer(r"(?:'[^']*'|\"[^\"]*\"|\[[^\]]*\]|[^\s\[\]'\"])+", value)]
    out = []
    for item in items:
        name, sep, dims = item.rpartition(":")
        dims = dims.strip()
        if sep and dims.startswith("[") and dims.endswith("]"):
            inner = [d.strip() for d in dims[1:-1].split(",") if d.strip()]
            if not inner:
                raise UsageError(f"--input-shapes {item}: no dims between the brackets; give e.g. {name}:[1,3,224,224]")
            dims = "x".join(inner)
        out.append(f"{name}:{dims}" if sep else item)
    return ",".join(out) or None


def _save_inputs(path: str, names: list[str], xs: tuple[torch.Tensor, ...]) -> None:
    """The inputs run, by input name: an ``.npz`` of arrays or a ``.pt`` dict of tensors (what --load-inputs and
    ``overdrive compare --inputs`` read)."""
    import io

    from overdrive._utils.files import atomic_write

    buf = io.BytesIO()
    if path.endswith(".npz"):
        import numpy as np

        np.savez(buf, **{n: x.cpu().numpy() for n, x in zip(names, xs)})
    else:
        torch.save({n: x.cpu() for n, x in zip(names, xs)}, buf)
    atomic_write(path, buf.getvalue())


def check_inputs_file(flag: str, path: str | None) -> None:
    """Refuse an inputs file that is not ``.npz`` or ``.pt`` (polygraphy writes JSON, which is not read here).

    Example:
        >>> check_inputs_file("--load-inputs", "inputs.json")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --load-inputs inputs.json: polygraphy's JSON inputs are not read here; give an .npz of arrays by input name or a .pt (torch.save of a dict name -> tensor)
    """
    if path is None or path.endswith((".npz", ".pt")):
        return
    why = "polygraphy's JSON inputs are not read here" if path.endswith(".json") else "not an .npz or .pt file"
    raise UsageError(f"{flag} {path}: {why}; give an .npz of arrays by input name or a .pt (torch.save of a dict "
                     "name -> tensor)")


_WEIGHT_ENDINGS = (".weight", ".bias", ".running_mean", ".running_var", ".num_batches_tracked")


def _dims(shape: Any, params: list[str | None] | None = None) -> str:
    """A shape as ``1x3x224x224``; a dynamic dim (None) by its ONNX name, else ``?``."""
    params = params or [None] * len(shape)
    return "x".join(str(d) if d is not None else (p or "?") for d, p in zip(shape, params)) or "scalar"


def check_loaded_inputs(path: str, loaded: dict[str, torch.Tensor] | tuple[torch.Tensor, ...],
                        src: Any) -> dict[str, torch.Tensor]:
    """The inputs of a ``--load-inputs`` file by the model's input names, refused with the file's names and shapes
    beside the model's where they do not fit (names, count, rank or a dim the ONNX model fixes); a state_dict given
    there is named as weights.

    Example:
        >>> from types import SimpleNamespace
        >>> src = SimpleNamespace(input_names=["x"], onnx_shapes={"x": [None, 4]}, onnx_dim_params={})
        >>> check_loaded_inputs("in.pt", {"inp": torch.zeros(2, 4)}, src)
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --load-inputs in.pt holds inp (2x4), but the model takes x (?x4): no input named 'inp'; save the inputs by the model's input names, e.g. np.savez(path, x=...) or torch.save({'x': ...}, path)
    """
    names = list(src.input_names)
    shapes = getattr(src, "onnx_shapes", {}) or {}
    params = getattr(src, "onnx_dim_params", {}) or {}
    wants = ", ".join(f"{n} ({_dims(shapes[n], params.get(n))})" if n in shapes else n for n in names)
    holds = ", ".join(f"{k} ({_dims(tuple(v.shape))})" for k, v in (
        loaded.items() if isinstance(loaded, dict) else ((f"#{i}", x) for i, x in enumerate(loaded))))
    head = f"--load-inputs {path} holds {holds}, but the model takes {wants}"
    example = f"np.savez(path, {', '.join(f'{n}=...' for n in names)}) or torch.save({{{', '.join(repr(n) + ': ...' for n in names)}}}, path)"
    if isinstance(loaded, dict):
        unknown = [k for k in loaded if k not in names]
        if unknown and any(k.endswith(_WEIGHT_ENDINGS) for k in unknown):
            shown = ", ".join(repr(k) for k in list(loaded)[:4])
            raise UsageError(f"--load-inputs {path} holds weights (a state_dict: {shown}{' ...' if len(loaded) > 4 else ''}), "
                             f"not inputs; the model takes {wants}: save the inputs by name, e.g. {example}")
        missing = [n for n in names if n not in loaded]
        if unknown or missing:
            from overdrive._utils.errors import close_names

            def near(k: str) -> str:
                close = close_names(k, missing or names)
                return f" (did you mean {close[0]!r}?)" if close else ""

            why = "; ".join([*(f"no input named {k!r}{near(k)}" for k in unknown),
                             *([f"no array for {', '.join(map(repr, missing))}"] if missing and not unknown else [])])
            raise UsageError(f"{head}: {why}; save the inputs by the model's input names, e.g. {example}")
        named = dict(loaded)
    else:
        if len(loaded) != len(names):
            raise UsageError(f"{head}: {len(loaded)} tensor(s) for {len(names)} input(s); save one per input, in "
                             f"order, or by name: {example}")
        named = dict(zip(names, loaded))
    for n in names:
        want, got = shapes.get(n), tuple(named[n].shape)
        if want is None:
            continue
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if w is not None and g != w]
        if len(got) != len(want) or bad:
            why = (f"{n!r} has {len(got)} dims, the model's {len(want)}" if len(got) != len(want) else
                   f"{n!r} dim {bad[0]} is {got[bad[0]]}, which the model fixes at {want[bad[0]]}")
            raise UsageError(f"{head}: {why}; save inputs of the model's shape, or re-export the model with that "
                             "dim dynamic")
    return named


def run_runners(model: str, trt: bool, onnxrt: bool, atol: float = 1e-3, rtol: float = 1e-3, seed: int = 0,
                shapes: str | None = None, load_inputs: str | None = None, save_inputs: str | None = None,
                precision: str = "fp32", device: str = "auto") -> dict[str, Any]:
    """Build an engine from ``model`` (an .onnx file) and compare it with ONNX Runtime on the same inputs; the
    compare report, with ``"engine"`` (backend, precision) added.

    Example:
        >>> # r = run_runners("model.onnx", trt=True, onnxrt=True, shapes="input:1x3x224x224"); r["passed"]
    """
    from overdrive.engine import Builder, BuildConfig, compare
    from overdrive.engine.config import parse_shapes, profiles_from_shapes
    from overdrive.engine.sources import from_onnx

    if not (trt and onnxrt):
        given = "--trt" if trt else "--onnxrt" if onnxrt else "no runner"
        raise UsageError(f"overdrive run compares two runners, --trt (an overdrive engine built from the model) and "
                         f"--onnxrt (ONNX Runtime); got {given}: give both, e.g. overdrive run {model} --trt --onnxrt, "
                         "or time one engine with overdrive build + overdrive exec")
    if not model.endswith(".onnx"):
        raise UsageError(f"overdrive run {model}: expected an .onnx model (polygraphy's run here takes ONNX); compare "
                         f"engines, ONNX files and PyTorch factories with overdrive compare A B")
    if load_inputs and shapes:
        raise UsageError("give --load-inputs or --input-shapes, not both (the loaded inputs' shapes are the ones run)")
    check_inputs_file("--load-inputs", load_inputs)
    check_inputs_file("--save-inputs", save_inputs)
    if not (0 <= atol < float("inf") and 0 <= rtol < float("inf")):  # NaN and inf too: refused before the build
        raise UsageError(f"--atol {atol:g} / --rtol {rtol:g}: tolerances must be finite and >= 0 (for example "
                         "--atol 1e-3 --rtol 1e-3)")
    src = from_onnx(model)  # a missing or unreadable file is named here, before the build
    named = None
    if load_inputs:
        from overdrive.engine.compare import load_inputs as read_inputs

        if not Path(load_inputs).is_file():  # named by this verb's flag (compare's reader says --inputs)
            raise UsageError(f"--load-inputs {load_inputs!r} does not exist; give an .npz of arrays by input name "
                             "or a .pt (torch.save of a dict name -> tensor), e.g. one --save-inputs wrote")
        try:
            loaded = read_inputs(load_inputs)
        except UsageError as exc:
            raise UsageError(re.sub(r"^--inputs ", "--load-inputs ", str(exc))) from exc
        named = check_loaded_inputs(load_inputs, loaded, src)
        shapes_by = {n: tuple(x.shape) for n, x in named.items()}
    else:
        shapes_by = parse_shapes(shapes)
    profiles = profiles_from_shapes(shapes_by or None)
    engine = Builder(BuildConfig(precision=precision, device=device, profiles=profiles)).build(src)
    xs = engine.random_inputs(shapes_by or None, seed=seed) if named is None else tuple(
        named[n] for n in engine.input_names if n in named)
    if save_inputs:
        _save_inputs(save_inputs, list(engine.input_names), xs)
    report = compare(engine, model, inputs=xs if named is None else named, atol=atol, rtol=rtol, seed=seed)
    report["engine"] = {"backend": engine.header["backend"], "precision": engine.header["precision"]}
    return report


def is_factory(arg: str) -> bool:
    """Whether a compare argument names a PyTorch factory (``pkg.module:factory`` or ``file.py:factory``) rather
    than a file (an engine, an ONNX or TorchScript model).

    Example:
        >>> is_factory("models.py:make_model"), is_factory("no_such_model.engine")
        (True, False)
    """
    return ":" in arg and not Path(arg).exists()


def with_checkpoint(a: str, b: str, checkpoint: str | None) -> tuple[Any, Any]:
    """``a`` and ``b`` as :func:`overdrive.engine.compare` takes them, with ``checkpoint``'s weights loaded into
    the side (or sides) given as a PyTorch factory, read as every ``--checkpoint`` is
    (:func:`overdrive.recipes.model_spec.load_checkpoint`); unchanged without a checkpoint.

    Example:
        >>> # a, b = with_checkpoint("model.engine", "models.py:make_model", "trained.pt"); compare(a, b)
    """
    if checkpoint is None:
        return a, b
    from overdrive.recipes.model_spec import check_checkpoint_path, load_checkpoint, load_model

    if not (is_factory(a) or is_factory(b)):
        raise UsageError(f"--checkpoint {checkpoint} loads weights into a PyTorch factory's model, and neither A "
                         f"({a}) nor B ({b}) is one; engines, ONNX and TorchScript files carry their own weights: "
                         "drop --checkpoint, or compare against pkg.module:factory / file.py:factory")
    check_checkpoint_path(checkpoint)  # before either model is built

    def load(arg: str, flag: str) -> Any:
        if not is_factory(arg):
            return arg
        model = load_model(arg, flag)
        load_checkpoint(model, checkpoint)
        return model.eval()

    return load(a, "A"), load(b, "B")


def random_weights_note(a: str, b: str, checkpoint: str | None) -> str | None:
    """For a failed comparison: the side built by its factory without ``--checkpoint`` (its initial weights, unless
    the factory loads trained ones), which is the usual cause; None when there is none."""
    sides = [f"{which} ({arg})" for which, arg in (("A", a), ("B", b)) if is_factory(arg)]
    if checkpoint is not None or not sides:
        return None
    return (f"{' and '.join(sides)} ran with the weights {'its factory gives' if len(sides) == 1 else 'their factories give'} "
            "(random, unless the factory loads trained ones); to compare with the trained model, give its weights "
            "with --checkpoint FILE (as build --checkpoint takes them)")
