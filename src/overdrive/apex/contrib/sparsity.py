"""apex.contrib.sparsity: the ASP surface of :mod:`overdrive.sparsity`."""

from overdrive.sparsity import ASP

__all__ = ["ASP"]
