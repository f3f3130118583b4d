"""The lab notebooks as tests: ``pytest tests *.ipynb`` (the README's test command) collects each ``NN-*.ipynb``
of the repository root as one test that passes when the notebook ran top to bottom in smoke mode.

They run through the instructors' own command, once per session (tests/regen_once.py): ``regenerate --smoke``
executes each in a fresh kernel, fails it on the first cell that raises (naming the cell and the line), and keeps
only results recorded in the right mode. The same run serves the acceptance test of all four labs and the
worktree-unchanged test, so CI executes each notebook once (issue 29, §5). When all four run, that run is the one
command for a lent GPU rehearsed at smoke sizes (``make gpu-results REHEARSE=1`` under the pretend H100,
tests/regen_once.py): the same notebooks, the same smoke results, plus the plan, the doctor and the bench. With nbval's own options
(``pytest --nbval-lax 02-*.ipynb``) nbval collects the notebooks instead, as before.

Tests that read that run say which labs they need with ``@pytest.mark.regen_labs("03")``; ``regen_labs("all")``
runs only when all four notebooks are collected or ``LAB_FULL_REGEN=1`` (``make test-regen-all``).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
LAB_NOTEBOOK = re.compile(r"^(\d\d)-.+\.ipynb$")
REGEN_GROUP = "regen-once"  # the xdist group of the tests that read the session's regenerate run


def pytest_configure(config):
    # No bytecode caches written during the session, by it or its subprocesses (xdist workers, the CLI, kernels): the
    # worktree-unchanged test brackets the regenerate run with the repository's file tree, and another worker
    # importing a labutils module for the first time meanwhile would write labutils/__pycache__ into it.
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True
    # pytest-xdist (`-n auto`, the README's test command): distribute by xdist_group, so that the tests reading the
    # session's regenerate run share one worker and the run happens once (pytest_collection_modifyitems).
    # A worker parses the command line again (dist "load" there) and decides by it whether to read the group
    # marks before this hook runs, so the controller's choice is handed to it (pytest_configure_node).
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("labutils_loadgroup"):
        config.option.loadgroup = True
    # Each worker and what it starts uses its share of the cores, not all of them, so that
    # N workers do not run N x cores threads (torch's intra-op threads spin while they wait for work).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
        import torch

        torch.set_num_threads(int(threads))
    config.addinivalue_line("markers", "regen_labs(*labs): reads the session's regenerate --smoke run of these labs "
                                       "(\"all\": all four, when all four notebooks are collected or LAB_FULL_REGEN=1)")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist (-p no:xdist) has none
def pytest_configure_node(node):
    node.workerinput["labutils_loadgroup"] = node.config.getvalue("dist") == "loadgroup"


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist (-p no:xdist) has none
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the README's test command): a worker per core, as many as memory allows (a test that trains
    GPT-2 small holds about 3 GiB), and none where torch can use a CUDA GPU: the tests there share one card, whose
    memory peaks and timings must not see another worker's kernels. One worker is no worker (0: no xdist)."""
    import torch

    if torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): cores decide
        memory_gib = 4.0 * cores
    workers = min(cores, int(memory_gib // 4))
    return workers if workers > 1 else 0


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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks this adds
def pytest_collection_modifyitems(session, config, items):
    from tests import regen_once

    notebooks = {item.lab for item in items if isinstance(item, LabNotebookRun)}
    regen_once.want(notebooks)
    every = os.environ.get("LAB_FULL_REGEN") == "1" or set(regen_once.LABS) <= notebooks
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
            regen_once.want(regen_once.LABS)
        else:
            regen_once.want(marker.args)
    # Under pytest-xdist (`-n auto`; pytest_configure picks --dist loadgroup): every test that reads the session's
    # run goes to ONE worker, so the run happens once; they are put first, so that the longest piece of work starts
    # first while the other workers take the rest.
    readers = [item for item in items if isinstance(item, LabNotebookRun) or item.get_closest_marker("regen_labs")]
    for item in readers:
        item.add_marker(pytest.mark.xdist_group(REGEN_GROUP))
    first = set(map(id, readers))
    items[:] = readers + [item for item in items if id(item) not in first]


def _warm_up() -> None:
    """What the first experiment would import lazily (transformers' GPT-2 and what its first forward and backward
    pull in, torch's compiler front end, pyplot), done once here so that it is frozen with the rest. A throwaway
    model of transformers' own classes: no labutils call, so no hub probe runs and nothing labutils keeps (its
    tokenizer record, the probe's answer) is set before the tests."""
    import matplotlib.pyplot  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its one-time notices belong to the tests that meet them
    try:
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=8, n_positions=8,
                                           bos_token_id=7, eos_token_id=7))
        ids = torch.zeros(1, 4, dtype=torch.long)
        model(input_ids=ids).logits.sum().backward()
        torch.optim.AdamW(model.parameters()).step()
    finally:
        hf_logging.set_verbosity(verbosity)


def pytest_collection_finish(session):
    # Every experiment calls gc.collect() (labutils.core.memory: before it measures, and when it releases), and a full
    # collection walks every object the process tracks: in a test process (all test modules, torch, transformers,
    # matplotlib) that was 0.3-0.4 s a call, a third of the time of the tests that train. What is alive once the
    # tests are collected and the lazy imports are done (modules, classes, parametrized arguments) lives to the
    # end of the session: gc.freeze() takes it out of every later collection (0.07 s a call). Tests create their
    # models, tensors and cycles later; those are collected, and seen by the CPU tracker, as before. The tensors
    # frozen with the rest (two test constants of a few hundred bytes, tests/test_causal_mask.py's IDS and a
    # parametrized NaN) are never inside a tracked region; gc.get_objects() no longer lists them.
    import gc

    _warm_up()
    gc.collect()
    gc.freeze()


def _repo_files() -> str | None:
    """``git status`` of the checkout, ignored files included (results/, build outputs): what the session wrote into
    it. None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return None if out.returncode else "\n".join(l for l in out.stdout.splitlines() if ".pytest_cache" not in l)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or the only process): the checkout before
        session.config.stash[_REPO_BEFORE] = _repo_files()


def pytest_sessionfinish(session, exitstatus):
    """No test writes into the repository (a test's full-mode regenerate wrote results/run.json, and it was
    committed): the checkout is the same after the session as before it, or the session fails, naming the files."""
    before = session.config.stash.get(_REPO_BEFORE, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    after = _repo_files()
    if after is not None and after != before:
        changed = sorted(set(after.splitlines()) ^ set(before.splitlines()))
        session.config.get_terminal_writer().line(
            "\nthe tests changed the repository (they write only under temp folders):\n  " + "\n  ".join(changed[:20]),
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_REPO_BEFORE = pytest.StashKey[str | None]()
