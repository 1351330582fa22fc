"""Warnings reach CLI users as one line, ``warning: <message>``, with no source path (unless --verbose),
and the CLI's formatter does not outlive the call."""

from __future__ import annotations

import warnings

import click
import pytest

from overdrive.cli import main as main_mod


@pytest.fixture
def warning_verb(monkeypatch: pytest.MonkeyPatch) -> None:
    @click.command("warns")
    def warns() -> None:
        warnings.warn("the thing is\n  deprecated", UserWarning, stacklevel=1)
        click.echo("done")

    monkeypatch.setattr(main_mod._Verbs, "get_command", lambda self, ctx, name: warns if name == "warns" else None)


def test_warning_is_one_line_without_a_source_path(warning_verb: None, capsys: pytest.CaptureFixture[str]) -> None:
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main_mod.main(["warns"]) == 0
    err = capsys.readouterr().err
    assert err.strip() == "warning: the thing is deprecated"
    assert warnings.showwarning is before  # restored after the verb


def test_verbose_keeps_pythons_format(warning_verb: None, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(record=True) as seen:  # Python's (here pytest's) own handling, untouched
        warnings.simplefilter("always")
        assert main_mod.main(["--verbose", "warns"]) == 0
    assert "warning:" not in capsys.readouterr().err
    assert [str(w.message) for w in seen] == ["the thing is\n  deprecated"] and seen[0].filename.endswith("test_warnings.py")


@pytest.fixture
def library_deprecation_verb(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's compiler deep-copies its deprecated LeafSpec on every CPU engine build, and the FutureWarning is
    raised from copyreg.py: it printed as a warning on each `overdrive build`."""
    import copyreg

    import overdrive.engine.api as ours

    @click.command("warns")
    def warns() -> None:
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, copyreg.__file__, 105)
        warnings.warn_explicit("a library's advice", UserWarning, copyreg.__file__, 105)
        warnings.warn_explicit("overdrive calls a deprecated API", FutureWarning, ours.__file__, 1)
        click.echo("done")

    monkeypatch.setattr(main_mod._Verbs, "get_command", lambda self, ctx, name: warns if name == "warns" else None)


def test_deprecations_inside_libraries_are_not_shown(library_deprecation_verb: None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main_mod.main(["warns"]) == 0
    assert capsys.readouterr().err.splitlines() == ["warning: a library's advice",
                                                    "warning: overdrive calls a deprecated API"]


def test_verbose_shows_deprecations_inside_libraries(library_deprecation_verb: None) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main_mod.main(["--verbose", "warns"]) == 0
    assert [str(w.message) for w in seen][0] == "`isinstance(treespec, LeafSpec)` is deprecated"
