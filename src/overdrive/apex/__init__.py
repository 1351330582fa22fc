"""NVIDIA apex's import paths over overdrive and torch: port an apex script by changing its imports only.

| apex                                                  | here                                                      |
|-------------------------------------------------------|-----------------------------------------------------------|
| ``from apex import amp``                              | ``from overdrive.apex import amp`` (:mod:`overdrive.amp`) |
| ``from apex.amp import _amp_state``                   | ``from overdrive.apex.amp import _amp_state``             |
| ``from apex.optimizers import FusedAdam, FusedLAMB``  | ``from overdrive.apex.optimizers import ...``: torch.optim.Adam/AdamW (fused where the device has it, else foreach) and a LAMB in torch |
| ``from apex.parallel import DistributedDataParallel`` | ``from overdrive.apex.parallel import ...``: torch DDP, apex's kwargs accepted |
| ``from apex.fp16_utils import FP16_Optimizer, ...``   | ``from overdrive.apex.fp16_utils import ...``: FP16_Optimizer on amp's LossScaler, network_to_half, the master-params helpers |
| ``from apex.normalization import FusedLayerNorm``     | ``from overdrive.apex.normalization import ...``: torch's LayerNorm / RMSNorm (``FusedRMSNorm``, ``Mixed...``), fp32 statistics, mixed dtypes |
| ``from apex.contrib.sparsity import ASP``             | ``from overdrive.apex.contrib.sparsity import ASP`` (:class:`overdrive.sparsity.ASP`) |
| ``import amp_C``, ``import apex_C``                   | ``from overdrive.apex import amp_C, apex_C``: ``multi_tensor_scale`` / ``axpby`` / ``l2norm`` and ``flatten`` / ``unflatten`` as torch ops |
| ``from apex.multi_tensor_apply import multi_tensor_applier`` | ``from overdrive.apex.multi_tensor_apply import ...`` |

Example:
    >>> from overdrive.apex import amp
    >>> amp.initialize is __import__("overdrive").amp.initialize
    True
    >>> from overdrive.apex.amp import _amp_state
    >>> _amp_state is amp._amp_state
    True
"""

import sys

from overdrive import amp

# apex.amp is a package: scripts also write `from apex.amp import _amp_state` (DeepLearningExamples BERT) and
# `import apex.amp as amp`. Those dotted paths must name a module, so `overdrive.apex.amp` is registered as the
# one overdrive.amp module (not a copy: `from overdrive.apex import amp` gives the same object).
sys.modules.setdefault(f"{__name__}.amp", amp)

__all__ = ["amp"]
