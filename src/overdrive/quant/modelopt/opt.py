"""ModelOpt's ``modelopt.torch.opt`` save / restore for quantized models: ``import overdrive.quant.modelopt.opt as mto``.

``mto.save(model, path)`` writes the quantization recipe (the QuantConfig and every quantizer's settings) with
the state_dict; ``mto.restore(fresh_model, path)`` quantizes a freshly built float model the same way and loads
the weights and amax, so no calibration data is needed. The file holds only plain Python values and tensors
(``torch.load(path, weights_only=True)`` reads it) and is written atomically.

Example:
    >>> import os, tempfile, torch
    >>> import overdrive.quant.modelopt as mtq, overdrive.quant.modelopt.opt as mto
    >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> model = mtq.quantize(make(), mtq.INT8_DEFAULT_CFG, forward_loop=lambda m: m(torch.randn(16, 8)))
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pth"); mto.save(model, path)
    >>> restored = mto.restore(make(), path)
    >>> bool(restored[0].input_quantizer.amax == model[0].input_quantizer.amax)
    True
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_torch_save
from overdrive.quant import api
from overdrive.quant.config import QuantConfig, QuantizerConfig
from overdrive.quant.modelopt.conversion import _insert_quantizers, _owners, _reconfigure

_VERSION = "overdrive.quant/1"


def modelopt_state(model: nn.Module) -> dict[str, Any]:
    """The recipe that rebuilds ``model``'s quantizers on a fresh float model (no tensors, no weights)."""
    meta = getattr(model, "_overdrive_quant", None)
    if meta is None:
        return {"modelopt_state_dict": [], "modelopt_version": _VERSION}
    quantizers = {}
    for name, q in api.quantizers(model):
        # ``enabled`` as the quantizer is now: disable_quantizer / enable_quantizer / fold_weight after quantize
        # change the quantizer, not its config (a restored model came back with them as the config had them)
        quantizers[name] = {**q.config.to_dict(), "enabled": bool(q.enabled), "axis": None if q.axis is None else int(q.axis),
                            "histogram": q.histogram, "quant_enabled": q.quant_enabled}
    return {"modelopt_state_dict": [("quantize", {"config": meta["config"].to_dict(), "quantizers": quantizers})],
            "modelopt_version": _VERSION}


def restore_from_modelopt_state(model: nn.Module, modelopt_state: dict[str, Any]) -> nn.Module:
    """Quantize the float ``model`` as the state says (weights max-calibrated, activations uncalibrated until
    their amax is loaded); returns the model."""
    if not isinstance(modelopt_state, dict) or "modelopt_state_dict" not in modelopt_state:
        raise UsageError("modelopt_state must be the dict mto.modelopt_state(model) returns")
    for mode, state in modelopt_state["modelopt_state_dict"]:
        if mode != "quantize":
            raise UsageError(f"mode {mode!r} in the saved state is not supported; only 'quantize' is")
        model = _insert_quantizers(model, QuantConfig.from_dict(state["config"]))  # registered classes too
        owners = _owners(model)
        missing = sorted(set(state["quantizers"]) - set(owners))
        if missing:
            raise UsageError(f"the saved state has quantizers {missing[:5]} that this model does not get; restore "
                             "onto a model built like the saved one")
        for name, saved in state["quantizers"].items():
            owner = owners[name][0]
            q = getattr(owner, name.rsplit(".", 1)[-1])
            keys = set(QuantizerConfig.__dataclass_fields__)
            _reconfigure(q, QuantizerConfig.from_dict({k: v for k, v in saved.items() if k in keys}), saved["axis"])
            q.histogram, q.quant_enabled = saved["histogram"], saved["quant_enabled"]
        for name in set(owners) - set(state["quantizers"]):  # a layer kind saved before it got quantizers (pools)
            getattr(owners[name][0], name.rsplit(".", 1)[-1]).enabled = False
        api._calibrate_weights(model, missing_only=True)
    return model


def save(model: nn.Module, f: str | os.PathLike[str]) -> None:
    """Write ``{"modelopt_state": ..., "model_state_dict": ...}`` to ``f`` atomically."""
    atomic_torch_save({"modelopt_state": modelopt_state(model), "model_state_dict": model.state_dict()}, f)


_MASK_SUFFIX = "_sparse_mask"  # the 2:4 mask buffers overdrive.sparsity adds (a package quant may not import)


def _refuse_pruned(model: nn.Module, sd: dict[str, Any], f: str | os.PathLike[str]) -> None:
    """A file saved from a 2:4-pruned model onto a model without its masks: say how to restore it. The masks are
    overdrive.sparsity's, which this package sits below, so restore cannot re-apply them itself; loading only the
    weights would compute the same outputs but drop the masks, and fine-tuning would then fill the pruned zeros."""
    have = set(model.state_dict())
    masks = [k for k in sd if isinstance(k, str) and k.endswith(_MASK_SUFFIX) and k not in have]
    if masks:
        more = f" and {len(masks) - 1} more" if len(masks) > 1 else ""
        raise UsageError(
            f"{os.fspath(f)} holds 2:4 sparsity masks ({masks[0]!r}{more}): it was saved from a model pruned with "
            f"overdrive.sparsity, and {type(model).__name__} has no such mask buffers. mto.restore rebuilds the "
            "quantization only; restore the pruning with it: ckpt = torch.load(path, weights_only=True); model = "
            "mto.restore_from_modelopt_state(model, ckpt['modelopt_state']); handle = "
            "overdrive.sparsity.api.load_pruned(model, ckpt['model_state_dict']); handle.attach(optimizer) keeps "
            "the masks in training")


def restore(model: nn.Module, f: str | os.PathLike[str]) -> nn.Module:
    """Rebuild the saved quantization on the freshly built float ``model`` and load its weights and amax.

    A file saved from a 2:4-pruned model (``*_sparse_mask`` keys) is refused, before ``model`` is touched, with the
    way to restore it: :func:`restore_from_modelopt_state`, then ``overdrive.sparsity.api.load_pruned``, which
    registers the masks and returns the handle that keeps them in training.

    Example:
        >>> import os, tempfile, torch
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 4))
        >>> from overdrive.quant.modelopt import INT8_DEFAULT_CFG, quantize
        >>> model = quantize(make(), INT8_DEFAULT_CFG, forward_loop=lambda m: m(torch.randn(16, 8)))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pth"); save(model, path)
        >>> type(restore(make(), path)[0]).__name__
        'QuantLinear'
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ckpt = torch.load(f, map_location=device, weights_only=True)
    if not isinstance(ckpt, dict) or "modelopt_state" not in ckpt:
        raise UsageError(f"{os.fspath(f)} is not a file written by mto.save (no 'modelopt_state'); a plain "
                         "state_dict loads with model.load_state_dict(torch.load(path, weights_only=True))")
    sd = ckpt["model_state_dict"]
    _refuse_pruned(model, sd, f)  # before the model is touched: it stays the float model the advice starts from
    model = restore_from_modelopt_state(model, ckpt["modelopt_state"])
    for name, q in api.quantizers(model):  # uncalibrated when saved (a disabled quantizer): no amax to expect
        if q.amax is not None and f"{name}.amax" not in sd:
            q.amax = None
    model.load_state_dict(sd)
    return model


_HF_STATE = "modelopt_state.pth"  # beside a Hugging Face checkpoint's weights, as ModelOpt names it


def _quantizer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    names = {name for name, _ in api.quantizers(model)}
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] in names}


def enable_huggingface_checkpointing() -> None:
    """ModelOpt's ``mto.enable_huggingface_checkpointing()``: from this call on, ``save_pretrained`` of a quantized
    Hugging Face model also writes ``modelopt_state.pth`` (the quantization recipe and every quantizer's amax) beside
    its weights, and ``from_pretrained`` (``AutoModelForCausalLM`` and the rest) of such a folder quantizes the model
    it loads the same way, with no calibration data. Call it once, before either (ModelOpt's hf_ptq and llm_qat
    examples call it at the top). It wraps transformers' ``PreTrainedModel.save_pretrained`` / ``from_pretrained``,
    as ModelOpt's does; torch is not touched. A folder without the file loads as before.

    Example:
        >>> # mto.enable_huggingface_checkpointing(); model = mtq.quantize(model, cfg, loop)
        >>> # model.save_pretrained("q"); AutoModelForCausalLM.from_pretrained("q")  # quantized again
    """
    import functools
    from pathlib import Path

    from overdrive._utils.optional import require

    transformers = require("transformers", "text", "Hugging Face checkpointing")
    base = transformers.PreTrainedModel
    if getattr(base, "_overdrive_modelopt_checkpointing", False):
        return
    save_orig = base.save_pretrained
    from_orig = base.from_pretrained.__func__

    @functools.wraps(save_orig)
    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        if not api.quantizers(self):
            return save_orig(self, save_directory, *args, **kwargs)
        qstate = _quantizer_state(self)
        # the quantizers' amax / pre_quant_scale go to modelopt_state.pth only: the weights file keeps the float
        # model's keys, so from_pretrained (with or without this call) finds no unexpected key in it
        sd = kwargs.get("state_dict")
        kwargs["state_dict"] = {k: v for k, v in (self.state_dict() if sd is None else sd).items() if k not in qstate}
        out = save_orig(self, save_directory, *args, **kwargs)
        atomic_torch_save({"modelopt_state": modelopt_state(self), "quantizer_state_dict": qstate},
                          Path(os.fspath(save_directory)) / _HF_STATE)
        return out

    @functools.wraps(from_orig)
    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        model = from_orig(cls, pretrained_model_name_or_path, *args, **kwargs)
        f = Path(os.fspath(pretrained_model_name_or_path)) / _HF_STATE
        if not f.is_file():
            return model
        device = next((q.device for q in model.parameters()), torch.device("cpu"))
        ckpt = torch.load(f, map_location=device, weights_only=True)
        model = restore_from_modelopt_state(model, ckpt["modelopt_state"])
        sd = ckpt["quantizer_state_dict"]
        for name, q in api.quantizers(model):  # uncalibrated when saved: no amax to expect
            if q.amax is not None and f"{name}.amax" not in sd:
                q.amax = None
        unexpected = model.load_state_dict(sd, strict=False).unexpected_keys
        if unexpected:
            raise UsageError(f"{f}: quantizer state for {unexpected[:3]} matches no quantizer of the loaded model; "
                             "load it with the model class it was saved from")
        return model

    base.save_pretrained = save_pretrained
    base.from_pretrained = classmethod(from_pretrained)
    base._overdrive_modelopt_checkpointing = True


__all__ = ["save", "restore", "modelopt_state", "restore_from_modelopt_state", "enable_huggingface_checkpointing"]
