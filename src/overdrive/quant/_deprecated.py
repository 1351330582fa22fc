"""Names that moved out of overdrive.quant, kept working with a DeprecationWarning (the layering test
leaves this module out: it reaches up to overdrive.recipes only when a deprecated name is called)."""

from __future__ import annotations

import warnings
from typing import Any


def qat(*args: Any, **kwargs: Any) -> Any:
    """Deprecated: use :func:`overdrive.recipes.quant.qat` (QAT runs on overdrive.train.Trainer, which sits
    above overdrive.quant). Same arguments and result.

    Example:
        >>> # from overdrive.recipes.quant import qat; result = qat(calibrated, train_loader, epochs=1, lr=1e-5)
    """
    warnings.warn("overdrive.quant.qat moved to overdrive.recipes.quant.qat; the old name will be removed",
                  DeprecationWarning, stacklevel=2)
    from overdrive.recipes.quant import qat as _qat

    return _qat(*args, **kwargs)
