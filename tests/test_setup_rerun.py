"""A lab's setup cell run again after the experiments (issue 38 §6): lab 01 with its setup cell re-run after cell 30
recorded 5 tables and 2 figures instead of 11 and 9, without a word. record_results now says so, on the screen and in
the record's notes, when the setup cell (which starts TABLES and FIGS afresh) ran after cells that have not run
since. Cells run for real in IPython's InteractiveShell, the machinery of a notebook's kernel; the setup cell calls
the real ``lu.setup()``."""
import json

import pytest

SETUP = "import labutils as lu\nTABLES, FIGS = {}, {}\ninfo = lu.setup(verbose=False)"
CELLS = {"a": "TABLES['a'] = [{'x': 1}]", "b": "TABLES['b'] = [{'x': 2}]"}
RECORD = ("lu.record_results('97-Rerun', tables=TABLES, figures=FIGS, mode='smoke', out_dir={out!r},\n"
          "                  env={{'device': 'cpu'}})")


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.clear_instance()
    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


def run_cells(shell, cells: list[str], out) -> dict:
    for cell in cells + [RECORD.format(out=str(out))]:
        result = shell.run_cell(cell, store_history=True)
        assert result.success, result.error_in_exec or result.error_before_exec
    return json.loads((out / "97-Rerun.json").read_text())


def test_a_setup_cell_run_again_after_the_experiments_is_said(shell, tmp_path, capsys):
    data = run_cells(shell, [SETUP, CELLS["a"], SETUP, CELLS["b"]], tmp_path)
    err = capsys.readouterr().err
    assert sorted(data["tables"]) == ["b"]  # cell a's table is gone: the record is partial
    assert "warning: the setup cell ran again (In [3]) after 1 cells that have not run since (In [2] first)" in err
    assert data["notes"]["incomplete"].startswith("the setup cell ran again (In [3])")


def test_setup_run_again_then_every_cell_again_is_a_whole_record(shell, tmp_path, capsys):
    data = run_cells(shell, [SETUP, CELLS["a"], SETUP, SETUP, CELLS["a"], CELLS["b"]], tmp_path)
    assert sorted(data["tables"]) == ["a", "b"]
    assert "warning" not in capsys.readouterr().err and "incomplete" not in data["notes"]
