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

import sys

import pytest
import torch

import labutils as lu
from labutils.core.memory import LiveStorages

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
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
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
    finally:
        shell.run_cell("cfg = interrupt = measure = None")
        InteractiveShell.clear_instance()
        sys.last_type = sys.last_value = sys.last_traceback = None
        lu.release()


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
