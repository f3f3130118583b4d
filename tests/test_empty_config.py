"""A config file that configures nothing is refused (issue 24): `python -m labutils run` on an empty, whitespace-only,
comment-only, bare `---` or `null` YAML used to train with the defaults and exit 0, so a student who saved the
wrong (empty) file believed their settings had run. Now: exit 2, one line naming the file, before any work.

Breakage that fails these tests: `_read_yaml` turning a None document into {} again (the run would start, the
`no_work` guard would raise), or the refusal growing a traceback / second line.
"""
from __future__ import annotations

import importlib

import pytest

from labutils.tools import cli


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if training starts (the entry point the CLI calls, replaced; the config code is real)."""
    def forbidden(*a, **k):
        raise AssertionError("training started although the config file was empty")
    monkeypatch.setattr(importlib.import_module("labutils.core.train"), "run", forbidden)


@pytest.mark.parametrize("text", ["", "   \n\n  \n", "# only a comment\n# and another\n", "---\n", "null\n", "~\n",
                                  "--- # a document marker and a comment\n...\n"])
def test_run_refuses_a_config_that_holds_nothing(tmp_path, capsys, monkeypatch, no_work, text):
    monkeypatch.setenv("LAB_SMOKE", "1")
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    code = cli.main(["run", str(path)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "no settings" in lines[0], err
    assert "Traceback" not in err


def test_a_file_with_one_real_setting_still_loads(tmp_path):
    """The refusal is for files with nothing in them, not for short ones (a too-eager check would fail this)."""
    path = tmp_path / "short.yaml"
    path.write_text("# a comment\ntrain:\n  steps: 3\n")
    from labutils.core.config import load_config
    assert load_config(path, mode="smoke").train.steps == 3
