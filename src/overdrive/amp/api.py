"""The public verb of overdrive.amp: :func:`prepare` checks its arguments and builds the
:class:`~overdrive.amp.core.MixedPrecision` that runs the policy."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.amp import casting
from overdrive.amp.config import Policy
from overdrive.amp.core import MixedPrecision, _prepared_by


def prepare(
    models: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    policy: Policy | str = "O1",
    device: torch.device | str | None = None,
    autocast_hooks: bool = True,
    num_losses: int = 1,
    autocast_scope: str = "forward",
) -> MixedPrecision:
    """Prepare models and optimizers for mixed precision under ``policy``.

    ``autocast_hooks=False`` leaves O1's autocast to you (``with mp.autocast():``), which is what
    a compiled training step wants. ``num_losses`` gives each loss its own scaler (``scale_loss(...,
    loss_id=i)``). ``autocast_scope="step"`` keeps O1's autocast on from a training forward until
    ``scale_loss`` (or the optimizer step), so the loss and other functions called outside the model run
    under it too, as under apex's O1 (the apex surface's choice); the default ``"forward"`` covers the
    model's forward only.

    Example:
        >>> mp = prepare(nn.Linear(4, 2), policy="O0")
        >>> mp.policy.opt_level
        'O0'
    """
    if isinstance(policy, str):
        policy = Policy.from_opt_level(policy)
    elif not isinstance(policy, Policy):
        raise UsageError(f"policy={policy!r} is not an amp.Policy or an opt level; pass 'O0'..'O3' or "
                         "amp.Policy(opt_level=..., dtype=...) (a saved dict: amp.Policy.from_dict(d))")
    models_l = casting.flatten(models)
    opts_l = [] if optimizers is None else casting.flatten(optimizers)
    for m in models_l:
        if not isinstance(m, nn.Module):
            raise UsageError(f"expected torch.nn.Module model(s), got {type(m).__name__}")
    for o in opts_l:
        if not isinstance(o, torch.optim.Optimizer):
            raise UsageError(f"expected torch.optim.Optimizer(s), got {type(o).__name__}")
    mine = {id(q) for m in models_l for q in m.parameters()}
    for k, o in enumerate(opts_l):
        held = [q for g in o.param_groups for q in g["params"]]
        if mine and held and _prepared_by(o) is None and not any(id(q) in mine for q in held):
            # after mp.remove() at O2 the model stays half and the optimizer holds the fp32 masters: preparing the
            # two again trained nothing, silently (the half parameters' gradients reach no optimizer)
            warnings.warn(
                f"amp.prepare: optimizer {k} ({type(o).__name__}) holds none of the models' {len(mine)} parameters, so "
                "its steps change no model given here; build it on the model's parameters (after an O2 prepare was "
                "removed, the model stays half and the optimizer holds the fp32 masters: start from the fp32 model "
                "and a new optimizer)", RuntimeWarning, stacklevel=2)
    if device is None:
        first = next((q for m in models_l for q in m.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device={device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' or 'cpu'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        # the policy resolved for CUDA (fp16, a dynamic scale) while torch disabled autocast: fp32 training, silently
        raise UsageError(f"device={str(device)!r} but this torch sees no CUDA GPU ({torch.__version__}); pass "
                         "device='cpu' (bf16) or run where torch.cuda.is_available()")
    elsewhere = sorted({str(q.device) for m in models_l for q in m.parameters()
                        if q.device.type not in (device.type, "meta")})
    if elsewhere:
        raise UsageError(f"device={str(device)!r} but the model's parameters are on {', '.join(elsewhere)}; move the "
                         f"model first (model.to({str(device)!r})), then build the optimizer and prepare")
    return MixedPrecision(models_l, opts_l, policy, device, autocast_hooks=autocast_hooks,
                          num_losses=num_losses, autocast_scope=autocast_scope)
