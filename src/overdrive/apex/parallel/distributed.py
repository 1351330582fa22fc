"""``apex.parallel.distributed``: :class:`~overdrive.apex.parallel.DistributedDataParallel` under its module path."""

from overdrive.apex.parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
