"""apex.contrib: ``from overdrive.apex.contrib.sparsity import ASP``."""
