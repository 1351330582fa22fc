"""Exceptions that teach: each names the bad value, what was expected, and the fix.

The CLI maps :class:`UsageError` to exit code 2 (bad arguments or input) and any other
:class:`OverdriveError` to exit code 1 (a failure while doing the work).
"""

from __future__ import annotations


class OverdriveError(RuntimeError):
    """A failure overdrive detected and can explain (CLI exit code 1)."""


class UsageError(OverdriveError, ValueError):
    """Bad input from the user: a value, a file, or a combination of options (CLI exit code 2).

    Example:
        >>> raise UsageError("opt_level 'O4' is not one of O0, O1, O2, O3; pick one of those")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: opt_level 'O4' is not one of O0, O1, O2, O3; pick one of those
    """


class MissingDependencyError(OverdriveError, ImportError):
    """An optional package is needed for this feature but is not installed."""

    def __init__(self, package: str, extra: str | None = None, feature: str = "this feature",
                 pip: str | None = None) -> None:
        # overdrive is not on PyPI: its extras install from a clone (the requirement overdrive[x] finds nothing there);
        # ``pip`` names the packages themselves where an extra would bring more (torchvision can replace a CPU torch)
        hint = (f"pip install {pip}" if pip else f"pip install -e '.[{extra}]' in a clone of overdrive" if extra
                else f"pip install {package}")
        super().__init__(f"{feature} needs the optional package '{package}', which is not installed; run: {hint}")
        self.package = package
        self.extra = extra
        self.feature = feature
        self.pip = pip

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # pickling (a worker process's error, re-raised in the parent) must rebuild from the arguments,
        # not from the finished message, which __init__ would wrap a second time
        return (type(self), (self.package, self.extra, self.feature, self.pip))
