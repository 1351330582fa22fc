"""The digits dataset: it lives in :mod:`overdrive.recipes.data`."""

from overdrive.recipes.data import Digits, load_digits

__all__ = ["Digits", "load_digits"]
