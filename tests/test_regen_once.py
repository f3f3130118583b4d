"""The shared run's reading of regenerate's own output (tests/regen_once.py): a notebook item passes only on the
run's "ok" line for that notebook, and a failure shows what regenerate said about it (cell, error, executed copy).
The output is made by regenerate's own summary_line, so a change in its wording breaks this test, not the gate."""
from __future__ import annotations

from pathlib import Path

from labutils.tools import regenerate as rg
from labutils.tools.notebook_runner import Outcome
from tests.regen_once import Run


def run_with(outcomes) -> Run:
    head = "\n".join(f"[{i}/{len(outcomes)}] {o.stem:<28} {'ok' if o.ok else 'FAILED'}   1.0 s"
                     for i, o in enumerate(outcomes, 1))
    return Run([o.stem[:2] for o in outcomes], Path("/nowhere"), 1, head + "\n" + rg.summary_line(outcomes, 2.0) + "\n", "", {}, {}, "", "")


def test_a_notebook_passes_only_on_its_own_ok_line():
    broken = Outcome("02-Gradient_Accumulation", ok=False, seconds=1.0, cell_index=14, execution_count=9,
                     error="ValueError: boom", executed_path=Path("/tmp/out/executed/02-Gradient_Accumulation.ipynb"))
    run = run_with([Outcome("01-Mixed_Precision", ok=True, seconds=1.0), broken])
    assert run.lab_ok("01-Mixed_Precision") and not run.lab_ok("02-Gradient_Accumulation")
    assert not run.lab_ok("01-Mixed")  # a prefix of another notebook's name is not that notebook
    why = run.lab_failure("02-Gradient_Accumulation")
    assert "at cell 14, In [9]: ValueError: boom" in why and "executed/02-Gradient_Accumulation.ipynb" in why


def test_a_second_worker_starting_the_run_is_an_error(tmp_path):
    """Breaks if two xdist workers may each run the notebooks (what happened while conftest.py added the group
    marks after xdist had read them): the second process to claim the session's run is refused, naming why; the
    first may claim again (a second, wider run in the same worker), and without xdist nothing is claimed."""
    import os
    import subprocess
    import sys

    import pytest

    from tests import regen_once

    regen_once.claim("uid-1", tmp_path)
    regen_once.claim("uid-1", tmp_path)  # the same process again: allowed
    other = subprocess.run([sys.executable, "-c", "from pathlib import Path; from tests import regen_once; "
                            f"regen_once.claim('uid-1', Path({str(tmp_path)!r}))"],
                           cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
    assert other.returncode == 1 and f"already started by process {os.getpid()}" in other.stderr
    assert "xdist_group" in other.stderr
    regen_once.claim("uid-2", tmp_path)  # another test run: its own claim
    regen_once.claim(None, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labutils-regen-once-uid-1", "labutils-regen-once-uid-2"]
    with pytest.raises(RuntimeError, match="more than one xdist worker"):
        (tmp_path / "labutils-regen-once-uid-3").write_text("1")
        regen_once.claim("uid-3", tmp_path)
