"""apex.contrib.sparsity: the ASP surface of :mod:`overdrive.sparsity` (``ASP``, ``create_mask``), with apex's
submodules ``asp`` and ``sparse_masklib`` so that ``from apex.contrib.sparsity.asp import ASP`` ports too."""

from overdrive.apex.contrib.sparsity.sparse_masklib import create_mask
from overdrive.sparsity import ASP

__all__ = ["ASP", "create_mask"]
