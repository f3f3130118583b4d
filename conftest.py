"""The lab notebooks as tests: ``pytest tests *.ipynb`` (the README's test command) collects each ``NN-*.ipynb``
of the repository root as one test that passes when the notebook ran top to bottom in smoke mode.

They run through the instructors' own command, once per session (tests/regen_once.py): ``regenerate --smoke``
executes each in a fresh kernel, fails it on the first cell that raises (naming the cell and the line), and keeps
only results recorded in the right mode. The same run serves the acceptance test of all four labs and the
worktree-unchanged test, so CI executes each notebook once (issue 29, §5). With nbval's own options
(``pytest --nbval-lax 02-*.ipynb``) nbval collects the notebooks instead, as before.

Tests that read that run say which labs they need with ``@pytest.mark.regen_labs("03")``; ``regen_labs("all")``
runs only when all four notebooks are collected or ``LAB_FULL_REGEN=1`` (``make test-regen-all``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
LAB_NOTEBOOK = re.compile(r"^(\d\d)-.+\.ipynb$")
ALL_LABS = ("01", "02", "03", "04")


def pytest_configure(config):
    config.addinivalue_line("markers", "regen_labs(*labs): reads the session's regenerate --smoke run of these labs "
                                       "(\"all\": all four, when all four notebooks are collected or LAB_FULL_REGEN=1)")


def _nbval_on(config) -> bool:
    return bool(getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False))


def pytest_collect_file(file_path: Path, parent):
    if file_path.parent == ROOT and LAB_NOTEBOOK.match(file_path.name) and not _nbval_on(parent.config):
        return LabNotebook.from_parent(parent, path=file_path)
    return None


class NotebookFailed(Exception):
    """A notebook did not run to the end: what regenerate said about it."""


class LabNotebook(pytest.File):
    def collect(self):
        yield LabNotebookRun.from_parent(self, name="smoke")


class LabNotebookRun(pytest.Item):
    """Passes when the session's regenerate run says this notebook ran to the end and its results were kept."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = self.path.stem
        self.lab = LAB_NOTEBOOK.match(self.path.name).group(1)

    def runtest(self):
        from tests import regen_once

        run = regen_once.run_for({self.lab})
        if not run.lab_ok(self.stem):
            raise NotebookFailed(f"{self.stem} (regenerate --smoke --only {','.join(run.labs)}):\n"
                                 f"{run.lab_failure(self.stem)}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, NotebookFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.stem}: runs top to bottom (regenerate --smoke)"


def pytest_collection_modifyitems(session, config, items):
    from tests import regen_once

    notebooks = {item.lab for item in items if isinstance(item, LabNotebookRun)}
    regen_once.want(notebooks)
    every = os.environ.get("LAB_FULL_REGEN") == "1" or set(ALL_LABS) <= notebooks
    regen_once.ALL = every
    for item in items:
        marker = item.get_closest_marker("regen_labs")
        if marker is None:
            continue
        if marker.args == ("all",):
            if not every:
                item.add_marker(pytest.mark.skip(reason="all four notebooks take minutes: collect them "
                                                        "(pytest tests *.ipynb) or set LAB_FULL_REGEN=1"))
                continue
            regen_once.want(ALL_LABS)
        else:
            regen_once.want(marker.args)
