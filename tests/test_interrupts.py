"""An interrupted cell changes no later number (issue 38, §1).

- In IPython's own shell (what a notebook's kernel runs): a training cell interrupted mid-run by a real SIGINT, then
  the same ``lu.run`` again, measures what it measured before the interrupt (start of the tracked region and its
  peak), and says how much the interrupted cell had left alive. Before: IPython kept the interrupted cell's
  exception (``sys.last_*``, its last ``ExecutionResult``, its traceback formatter), whose frames held the run's
  model and data: every later CPU peak was that much higher.
- The CPU tracker counts a storage's death without running Python code in a finaliser: an interrupt landing there was
  printed as "Exception ignored in: <finalize object ...>" and swallowed, the cell going on with a wrong count.
  Every Python call inside a tracked region is tried as the place where the interrupt lands; each must stop it.
"""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch

import labutils as lu
from labutils.core.memory import LiveStorages, release_failed_cell


@contextlib.contextmanager
def ipython_shell(names: str):
    """IPython's own shell (what a notebook's kernel runs); afterwards ``names`` unbound, the shell and the last
    error (``sys.last_*``) gone, and memory released, so that nothing a test left is seen by the next one."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        yield shell
    finally:
        shell.run_cell(f"{names} = None")
        InteractiveShell.clear_instance()
        sys.last_type = sys.last_value = sys.last_traceback = None
        lu.release()

CELLS = """
import signal
import torch
import labutils as lu
from tests.conftest import tiny_config

cfg = tiny_config()  # 3 steps; the CPU tracker covers the first 2

def interrupt(step, *_):  # Ctrl-C inside the tracked steps: a real SIGINT, Python's own handler raises
    if step == 1:
        signal.raise_signal(signal.SIGINT)

def measure():
    r = lu.run(cfg, "cpu", progress=False, verbose=False)
    return r.memory["start_bytes"], r.peak_memory_bytes
"""


@pytest.mark.real_kernels
def test_a_run_after_an_interrupted_run_measures_the_clean_numbers(capsys):
    with ipython_shell("cfg = interrupt = measure") as shell:
        assert shell.run_cell(CELLS).success
        assert shell.run_cell("clean = measure()").success
        interrupted = shell.run_cell("lu.run(cfg, 'cpu', progress=False, verbose=False, on_step=interrupt)")
        assert isinstance(interrupted.error_in_exec, KeyboardInterrupt)
        capsys.readouterr()
        assert shell.run_cell("again = measure()").success
        out = capsys.readouterr().out
        clean, again = shell.user_ns["clean"], shell.user_ns["again"]
        assert again == clean, f"start and peak bytes: clean {clean}, after an interrupted run {again}"
        assert "interrupted cell" in out and "MiB" in out, out   # said, with its size
        assert shell.run_cell("lu.release()").success                    # said once: nothing is left to free
        assert "interrupted cell" not in capsys.readouterr().out


def _body(arm, disarm):
    """Operators that allocate and free storages (as a training step does), with the interrupt armed around them."""
    arm()
    for _ in range(3):
        x = torch.ones(1000)
        y = x * 2
        del x
        z = y + 1
        del y, z
    disarm()


def test_an_interrupt_inside_the_cpu_tracker_stops_the_block():
    """Breaks if a storage's death runs Python code (weakref.finalize): the interrupt landing in it is swallowed."""
    previous = sys.gettrace()
    k, landed = 0, []
    while True:  # the interrupt lands at the k-th Python call of the block, for every k until the block has fewer
        k, seen = k + 1, 0

        def interrupt_at_k(frame, event, arg):
            nonlocal seen
            seen += 1
            if seen == k:
                landed.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
                raise KeyboardInterrupt(f"call {k}")  # raised where the k-th Python call starts, as a SIGINT would

        try:
            with LiveStorages():
                _body(lambda: sys.settrace(interrupt_at_k), lambda: sys.settrace(previous))
        except KeyboardInterrupt:
            continue
        finally:
            sys.settrace(previous)
        assert seen < k, f"swallowed: the interrupt at call {k} of the block, in {landed[-1]}, did not stop it"
        break
    assert k > 20 and any("memory.py" in w for w in landed)  # it landed in the tracker's own code, many times


CLOSURE_CELLS = """
import functools
import torch

def logged(fn):                      # a decorator: its wrapper's closure (fn) outlives every call
    @functools.wraps(fn)
    def wrapper(*a):
        return fn(*a)
    return wrapper

def step(x):
    raise KeyboardInterrupt          # Ctrl-C partway

@logged
def measure(n):
    model = torch.zeros(n)           # what a lab's measuring function holds
    return {k: (lambda: step(model))() for k in "ab"}   # a comprehension and a lambda close over `model`
"""


def test_a_failed_cell_s_closures_release_what_they_closed_over(capsys):
    """Lab 02's equivalence cell after an interrupt (issue 46 §1): clearing the traceback's frames left the tiny
    model alive, as its comprehension's frame keeps its function, whose closure cell held ``model``. Breaks if
    release_failed_cell leaves such a cell full; and if it empties a cell the frame only borrowed (the decorator's
    ``fn``: the decorated function must still run)."""
    with ipython_shell("measure = logged = step") as shell:
        assert shell.run_cell(CLOSURE_CELLS).success
        assert isinstance(shell.run_cell("measure(2**20)").error_in_exec, KeyboardInterrupt)
        capsys.readouterr()
        assert 0 <= release_failed_cell() - 4 * 2**20 < 1024   # the model (+ the lambdas' scalars)
        assert "4.00 MiB" in capsys.readouterr().out
        assert isinstance(shell.run_cell("measure(10)").error_in_exec, KeyboardInterrupt)  # fn is still there


def test_a_leftover_is_said_after_a_failed_cell_even_when_release_freed_it_first(monkeypatch, capsys):
    """Lab 03's largest-batch cell after an interrupt: its memory_budget() called release() (which released the
    interrupted cell's frames) before the run's start check, which then said nothing of the 0.7 MiB still above the
    baseline while every peak read that much higher. Breaks if the check only speaks when it released a cell itself."""
    import labutils.core.memory as mem

    monkeypatch.setattr(mem, "_BASELINE", {})
    monkeypatch.setattr(mem, "LEFTOVERS", [])
    with ipython_shell("kept = f") as shell:
        lu.set_baseline("cpu")
        cell = "kept = torch.zeros(2**18)\ndef f(x):\n    raise KeyboardInterrupt\nf(torch.zeros(2**20))"
        assert isinstance(shell.run_cell("import torch\n" + cell).error_in_exec, KeyboardInterrupt)
        lu.release()  # frees the failed cell's 4 MiB; `kept` (1 MiB) stays bound
        capsys.readouterr()
        assert lu.start_check("cpu", "section 4") == 2**20
        assert "section 4 starts 1.00 MiB above the lab's baseline" in capsys.readouterr().out
        assert lu.start_check("cpu", "section 5") == 2**20 and capsys.readouterr().out == ""  # said once
        assert [x["where"] for x in mem.LEFTOVERS] == ["section 4", "section 5"]


def test_lab03_toy_peaks_do_not_depend_on_when_the_gc_runs():
    """Lab 03's toy table (sections 3 and 5) after an interrupt read its selective row 0.5 MiB higher than a clean
    re-run: its peak was measured inside FlopCounterMode, whose module hooks hold each autograd node in a reference
    cycle, so the memory they keep is freed whenever the gc happens to run (12.9, 13.4 or, without a collection,
    15 MiB). Breaks if a toy row's peak changes when the gc does not run."""
    import gc
    import json

    from tests.lab_kernel import code_cells, notebook_of

    cells = dict(code_cells(notebook_of("03")))

    def cell_with(text):  # the code cell that holds ``text``, found by what it defines, not by its place
        return next(src for src in cells.values() if text in src)
    ns = {"device": torch.device("cpu"), "MiB": 2**20, "TABLES": {}}
    exec(cell_with("info = lu.setup()").split("info = lu.setup()")[0], ns)  # the lab's imports
    exec(cell_with("def make_toy("), ns)
    for defines in ("def toy_step(", "def checkpointed_selectively("):  # section 3's and section 5's toy code
        exec(cell_with(defines).split("toy, x_toy = make_toy()")[0], ns)
    toy, x = ns["make_toy"]()
    forwards = [ns[f] for f in ("checkpointed", "checkpointed_selectively")]  # rows whose nodes the counter held
    peaks = []
    for collections in (True, False):
        gc.collect()
        if not collections:
            gc.disable()
        try:
            peaks.append([ns["toy_step"](toy, x, f)[0]["peak_above_start_mib"] for f in forwards])
        finally:
            gc.enable()
    assert peaks[0] == peaks[1], peaks


# --- Every lab in a real kernel (issue 46, item 1) ------------------------------------------------------------------
# A student's kernel runs a lab's cells in order; at a measuring cell (one that records a table with a peak or a
# time: tests/lab_kernel.py finds them from what each cell puts into TABLES, not from a list) the cell is run clean,
# run again clean (the reference), then run again and interrupted partway (Jupyter's stop button), then run once
# more: its memory columns must equal the clean re-run's, or the cell must say by how much its start was above the lab's baseline and the lab's record
# must carry it (labutils.core.memory.start_check). Before: lab 02's equivalence cell read every peak 2.2 MB higher
# after an interrupt (a lambda's closure kept the tiny model alive past release_failed_cell).
# CI runs the first measuring cell of each lab that lasts long enough to be interrupted; LAB_INTERRUPT_ALL=1
# (make test-interrupts) every measuring cell of every lab.

import os  # noqa: E402
import time  # noqa: E402

from labutils.labs.registry import IDS  # noqa: E402

from tests import lab_kernel as lk  # noqa: E402

ALL = os.environ.get("LAB_INTERRUPT_ALL") == "1"
MIN_SECONDS = 0.3  # a cell shorter than this is over before an interrupt can land partway; CI picks a longer one
FRACTIONS = (0.4, 0.25, 0.12, 0.05)  # of the clean run's duration: where the interrupt is tried, until one lands


def interrupt_partway(k: lk.LabKernel, source: str, seconds: float) -> lk.Reply | None:
    """Run the cell and interrupt it partway: the reply of the first run a KeyboardInterrupt stopped, or None."""
    for f in FRACTIONS:
        r = k.run(source, interrupt_after=seconds * f)
        if r.ename == "KeyboardInterrupt":
            return r
        assert r.status == "ok", f"the cell failed otherwise:\n{r.text[-1500:]}"
    return None


def on_screen(index: int, *replies: lk.Reply) -> list[str]:
    """What a student sees wrong after these runs of a cell (issue 44 §7): a widget (reopened from a saved notebook:
    "Error displaying widget: model not found"), or a progress bar left on screen, frozen where a run stopped."""
    return [f"cell {index}: {r.widget_views} widget view(s), bars left on screen {r.bars_left()}"
            for r in replies if r.widget_views or r.bars_left()]


def check_cell(k: lk.LabKernel, index: int, source: str, clean: lk.Reply, tables: dict) -> str | None:
    """None when the re-run after an interrupt gives the clean memory columns (or says and records why not)."""
    where = f"cell {index} ({', '.join(tables)})"
    if lk.LEFTOVER_LINE.search(clean.text):
        return f"{where}: the clean run said it started off the baseline:\n{clean.text[-800:]}"
    # the reference is a clean re-run: a cell may measure its first run differently (lab 03's toy table: its
    # selective row reads 0.5 MiB more on every re-run, interrupted or not), which is not what is tested here
    before = k.tables()
    assert k.run(source).status == "ok"
    reference = lk.added(before, k.tables(), tables)
    cut = interrupt_partway(k, source, clean.seconds)
    if cut is None:
        return None  # over before any interrupt landed: nothing was cut short
    before = k.tables()
    again = k.run(source)
    if screen := on_screen(index, cut, again):
        return "\n".join(screen)
    if again.status != "ok":
        return f"{where}: the re-run after an interrupt at {cut.interrupted_at:.2f} s failed:\n{again.text[-1500:]}"
    diff = lk.differences(reference, lk.added(before, k.tables(), tables))
    if not diff:
        return None
    if lk.LEFTOVER_LINE.search(again.text) and k.leftovers():
        return None  # not at the baseline: said in the cell, and recorded
    return (f"{where}, interrupted {cut.interrupted_at:.2f} s into a {clean.seconds:.2f} s cell, re-run: "
            f"{len(diff)} memory values differ from a clean re-run, and the cell did not say why:\n  "
            + "\n  ".join(diff[:8]) + f"\nre-run's output:\n{again.text[-1000:]}\nthe lab's last recorded "
            f"starts off its baseline (memory.LEFTOVERS, said or not): {k.leftovers()[-4:]}")


@pytest.mark.real_kernels
@pytest.mark.parametrize("lab", IDS)
def test_an_interrupted_measuring_cell_changes_no_number(lab, tmp_path, capsys):
    failures, checked, short = [], [], []
    start = time.monotonic()
    with lk.LabKernel(tmp_path) as k:
        before = k.tables()
        for index, source in lk.code_cells(lk.notebook_of(lab)):
            clean = k.run(source)
            assert clean.status == "ok", f"lab {lab} cell {index} failed in a clean run:\n{clean.text[-1500:]}"
            failures += on_screen(index, clean)
            after = k.tables()
            tables = lk.recorded(before, after)
            if tables and clean.seconds < MIN_SECONDS:
                short.append(index)
            elif tables:
                checked.append(index)
                if (failure := check_cell(k, index, source, clean, tables)) is not None:
                    failures.append(failure)
                after = k.tables()
                if not ALL:
                    break
            before = after
    with capsys.disabled():
        print(f"\nlab {lab}: measuring cells interrupted and re-run: {checked}; shorter than {MIN_SECONDS} s (not "
              f"interrupted): {short}; {len(failures)} failed; {time.monotonic() - start:.0f} s")
    assert checked, f"lab {lab}: no measuring cell found"
    assert not failures, "\n\n".join(failures)
