"""Mixed precision with apex's opt levels on torch.amp: ``initialize``/``scale_loss`` or ``prepare``.

Example (apex surface):
    >>> import torch
    >>> from overdrive import amp
    >>> model = torch.nn.Linear(4, 2); opt = torch.optim.AdamW(model.parameters())
    >>> model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)

Example (native):
    >>> mp = amp.prepare(torch.nn.Linear(4, 2), policy=amp.Policy(opt_level="O1", dtype=torch.bfloat16))

fp8 on a Hopper/Ada GPU (the large Linear layers; needs the ``fp8`` extra, torchao):
    >>> model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, fp8="tensorwise")  # doctest: +SKIP
    >>> print(amp.summary(model).to_markdown())  # doctest: +SKIP
"""

from overdrive.amp.apex import (_amp_state, disable_casts, initialize, load_state_dict, master_params,
                                mixed_precision_of, scale_loss, state_dict)
from overdrive.amp.casting import NORM_TYPES, param_dtypes
from overdrive.amp.config import FP8_RECIPES, OPT_LEVELS, Fp8, Policy
from overdrive.amp.api import prepare
from overdrive.amp.core import MixedPrecision
from overdrive.amp.fp8 import LayerChoice, summary
from overdrive.amp.functions import (float_function, half_function, promote_function, register_float_function,
                                     register_half_function, register_promote_function)
from overdrive.amp.scaler import LossScaler

__all__ = [
    # native
    "Policy", "OPT_LEVELS", "prepare", "MixedPrecision", "LossScaler",
    # fp8 training of the large Linear layers
    "Fp8", "FP8_RECIPES", "summary", "LayerChoice",
    # apex-compatible
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "mixed_precision_of", "disable_casts",
    "half_function", "float_function", "promote_function",
    "register_half_function", "register_float_function", "register_promote_function",
    # helpers
    "NORM_TYPES", "param_dtypes",
]
