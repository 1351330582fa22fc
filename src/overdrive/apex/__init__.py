"""NVIDIA apex's import paths over overdrive and torch: port an apex script by changing its imports only.

| apex                                                  | here                                                      |
|-------------------------------------------------------|-----------------------------------------------------------|
| ``from apex import amp``                              | ``from overdrive.apex import amp`` (:mod:`overdrive.amp`) |
| ``from apex.optimizers import FusedAdam, FusedLAMB``  | ``from overdrive.apex.optimizers import ...``: torch.optim.Adam/AdamW (fused where the device has it, else foreach) and a LAMB in torch |
| ``from apex.parallel import DistributedDataParallel`` | ``from overdrive.apex.parallel import ...``: torch DDP, apex's kwargs accepted |
| ``from apex.fp16_utils import to_python_float``       | ``from overdrive.apex.fp16_utils import ...``: ``.item()`` |
| ``from apex.contrib.sparsity import ASP``             | ``from overdrive.apex.contrib.sparsity import ASP`` (:class:`overdrive.sparsity.ASP`) |

Example:
    >>> from overdrive.apex import amp
    >>> amp.initialize is __import__("overdrive").amp.initialize
    True
"""

from overdrive import amp

__all__ = ["amp"]
