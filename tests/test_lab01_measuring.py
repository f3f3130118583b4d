"""Issue 44 §8: lab 01 shows once, in one cell (id ``how-we-measure``), how the course times a step and measures a
peak, and asserts the rule against a run's own record. The cell's code runs here on a tiny ``lu.run``: breaks if the
cell is removed, or if it and the library's rule (``first_timed_step`` / ``finish_timing``, the verdicts'
``median_spread``, ``MemoryTracker``) stop agreeing, or if the cell would let another step-time rule pass."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import labutils as lu
import labutils.labs.lab01.amp_speed_memory as am

from conftest import tiny_config

NOTEBOOK = Path(__file__).resolve().parent.parent / "01-Mixed_Precision.ipynb"


def cell_code() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    [code] = ["".join(c["source"]) for c in cells if c.get("id") == "how-we-measure"]
    return code


def run_cell(run) -> None:
    runs = {"fp32": run}
    exec(cell_code(), {"runs": runs, "speed_rows": am.speedup_rows(runs), "device": torch.device("cpu"),
                       "torch": torch, "lu": lu})


@pytest.mark.parametrize("steps, timed", [(6, "3-6"), (3, "3-3")])  # CPU: steps 1-2 under the tracker, untimed
def test_the_cell_recomputes_a_runs_step_time_spread_and_peak(steps, timed, capsys):
    run = lu.run(tiny_config(train__steps=steps, train__timing_warmup_steps=1), "cpu", progress=False, verbose=False)
    assert run.ok and run.memory["tracked_steps"] == 2
    capsys.readouterr()  # what lu.run said (e.g. memory an earlier test left in this process): not the cell's
    run_cell(run)
    time_line, peak_line = capsys.readouterr().out.splitlines()
    assert time_line.startswith(f"fp32 step time: median of steps {timed} = ")
    assert "steps 1-2 untimed (1 warm-up, 2 under the CPU memory tracker)" in time_line
    assert ("no spread" in time_line) == (steps == 3)
    assert peak_line.startswith(f"fp32 peak: {lu.fmt_bytes(run.peak_memory_bytes)} of live tensors over its first 2 steps (CPU tracker, "
                                 "LiveStorages)")
    assert peak_line.endswith("a 4 MiB tensor made and freed measures 4.00 MiB")


def test_the_cell_fails_when_the_library_times_by_another_rule():
    """A step time read as the mean of every step (warm-up included) is not the course's rule: the cell says so."""
    run = lu.run(tiny_config(train__steps=6, train__timing_warmup_steps=1), "cpu", progress=False, verbose=False)
    run.step_time_seconds = sum(run.step_times) / len(run.step_times)
    with pytest.raises(AssertionError, match="timing rule changed"):
        run_cell(run)
