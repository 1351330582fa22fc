"""apex.contrib.sparsity.asp: ``ASP``."""

from overdrive.sparsity import ASP

__all__ = ["ASP"]
