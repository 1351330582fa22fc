"""Exceptions that teach: each names the bad value, what was expected, and the fix.

The CLI maps :class:`UsageError` to exit code 2 (bad arguments or input) and any other
:class:`OverdriveError` to exit code 1 (a failure while doing the work).
"""

from __future__ import annotations

from collections.abc import Iterable


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


def close_names(value: str, choices: Iterable[str]) -> list[str]:
    """The names among ``choices`` that ``value`` may be a misspelling of, closest first (at most 3): difflib's close
    matches within 0.1 of the best, or the same name in another case.

    Example:
        >>> close_names("make_mpl", ["make_mlp", "make_cnn", "Net"]), close_names("FP16", ["fp16", "fp32"])
        (['make_mlp'], ['fp16'])
    """
    import difflib

    names = sorted({str(c) for c in choices})

    def score(name: str) -> float:
        return difflib.SequenceMatcher(None, str(value), name).ratio()

    close = difflib.get_close_matches(str(value), names, n=3, cutoff=0.6)
    close = [c for c in close if score(c) >= score(close[0]) - 0.1]  # not 'make_cnn' beside 'make_mlp' for 'make_mpl'
    return close or [n for n in names if n.lower() == str(value).lower()]


def did_you_mean(value: str, choices: Iterable[str], what: str = "choices", list_up_to: int = 8) -> str:
    """The end of an error message about a misspelled name: the close matches among ``choices``
    (``"; did you mean 'make_mlp'?"``, :func:`close_names`), else, when there are at most ``list_up_to`` choices,
    all of them (``"; the choices are: a, b"``, ``what`` naming them), else nothing.

    Example:
        >>> did_you_mean("make_mpl", ["make_mlp", "make_cnn", "Net"])
        "; did you mean 'make_mlp'?"
        >>> did_you_mean("zzz", ["make_mlp", "make_cnn"], what="factories")
        '; the factories are: make_cnn, make_mlp'
    """
    close = close_names(value, choices)
    if close:
        return f"; did you mean {' or '.join(repr(c) for c in close)}?"
    names = sorted({str(c) for c in choices})
    if names and len(names) <= list_up_to:
        return f"; the {what} are: {', '.join(names)}"
    return ""
