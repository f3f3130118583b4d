"""The shared run's reading of regenerate's own output (tests/regen_once.py): a notebook item passes only on the
run's "ok" line for that notebook, and a failure shows what regenerate said about it (cell, error, executed copy).
The output is made by regenerate's own summary_line, so a change in its wording breaks this test, not the gate."""
from __future__ import annotations

from pathlib import Path

from labutils import regenerate as rg
from labutils.notebook_runner import Outcome
from tests.regen_once import Run


def run_with(outcomes) -> Run:
    head = "\n".join(f"[{i}/{len(outcomes)}] {o.stem:<28} {'ok' if o.ok else 'FAILED'}   1.0 s"
                     for i, o in enumerate(outcomes, 1))
    return Run(["01", "02"], Path("/nowhere"), 1, head + "\n" + rg.summary_line(outcomes, 2.0) + "\n", "", {}, {}, "", "")


def test_a_notebook_passes_only_on_its_own_ok_line():
    broken = Outcome("02-Gradient_Accumulation", ok=False, seconds=1.0, cell_index=14, execution_count=9,
                     error="ValueError: boom", executed_path=Path("/tmp/out/executed/02-Gradient_Accumulation.ipynb"))
    run = run_with([Outcome("01-Mixed_Precision", ok=True, seconds=1.0), broken])
    assert run.lab_ok("01-Mixed_Precision") and not run.lab_ok("02-Gradient_Accumulation")
    assert not run.lab_ok("01-Mixed")  # a prefix of another notebook's name is not that notebook
    why = run.lab_failure("02-Gradient_Accumulation")
    assert "at cell 14, In [9]: ValueError: boom" in why and "executed/02-Gradient_Accumulation.ipynb" in why
