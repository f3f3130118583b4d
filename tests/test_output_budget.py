"""A lesson, not a lab report (issue 36, shared/NOTEBOOKS.md "A lesson, not a report"), checked on the session's one
``regenerate --smoke`` run of the real notebooks (tests/regen_once.py):

- at most 100 printed lines per lab: stream output, text and markdown tables, table rows counted, separator lines
  not (a figure prints nothing);
- no cell prints more than 15 lines or 2,000 characters;
- at most 500 code lines per notebook (read from the committed notebooks, no run needed);
- no printed line wraps to more than 4 lines of JupyterLab's ~1,000-pixel output area (120 columns of its monospace
  font; an East Asian wide character takes 2): a longer sentence is a wall of text (issue 44 §6: C1-C6's verdicts
  ran to 560-735 characters, the memory budget's to 420);
- smoke is a scale model of the 8 GB run: every row a lab records in its ``scale_model`` table ran out of memory in
  smoke exactly when the estimator predicts that its full-mode config runs out on an 8 GB card.

What would fail them: a cell that prints a table of every sweep point, a raw profiler dump, a notebook that grows a
copy of a library loop; a smoke budget scaled by parameters alone (lab 03's two rows both ran out, lab 04's §8 all
fit); a lab that records a row's status from the prediction instead of from its run.
"""
from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest

from labutils.labs.registry import IDS

REPO = Path(__file__).resolve().parent.parent
LABS = IDS
MAX_LAB_LINES, MAX_CELL_LINES, MAX_CELL_CHARS, MAX_CODE_LINES = 100, 15, 2000, 500
LABS_WITH_BUDGET = IDS  # every lab runs rows under a memory budget that an 8 GB card sets
OUTPUT_COLUMNS, MAX_WRAPPED_LINES = 120, 4  # JupyterLab's output area (~1,000 px); a printed line wraps at most to 4
TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def output_text(output: dict) -> str:
    """What a reader reads of one cell output: a stream, a markdown table, plain text; a figure's text/plain
    ("<Figure size ...>") stands in for the picture, not beside it, so it counts nothing."""
    kind = output.get("output_type")
    if kind == "stream":
        return _text(output.get("text", ""))
    if kind == "error":
        return "\n".join(output.get("traceback", []))
    data = output.get("data", {})
    if "text/markdown" in data:
        return _text(data["text/markdown"])
    if any(k.startswith("image/") for k in data):
        return ""
    return _text(data.get("text/plain", ""))


def printed_lines(cell: dict) -> list[str]:
    """The lines a cell prints: blank lines and table separator rows do not count."""
    lines = []
    for output in cell.get("outputs", []):
        lines += [l for l in output_text(output).splitlines() if l.strip() and not TABLE_SEPARATOR.match(l)]
    return lines


def test_counting_rules():
    """The counter itself: table rows count, separators and figures do not."""
    cell = {"outputs": [
        {"output_type": "stream", "name": "stdout", "text": "one\n\ntwo\n"},
        {"output_type": "display_data", "data": {"text/markdown": "| a | b |\n|---|---|\n| 1 | 2 |\n",
                                                 "text/plain": "<IPython.core.display.Markdown object>"}},
        {"output_type": "display_data", "data": {"image/png": "...", "text/plain": "<Figure size 640x480>"}},
        {"output_type": "execute_result", "data": {"text/plain": "42"}},
    ]}
    assert printed_lines(cell) == ["one", "two", "| a | b |", "| 1 | 2 |", "42"]
    assert TABLE_SEPARATOR.match("|:---|---:|") and not TABLE_SEPARATOR.match("| -1 | 2 |")


def columns(line: str) -> int:
    """The width of a printed line in monospace columns: East Asian wide and fullwidth characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in line)


def overlong_lines(nb: dict) -> list[str]:
    """Every printed line of ``nb`` (streams, and results shown as plain text; a Markdown or HTML table wraps in its
    cells) wider than :data:`MAX_WRAPPED_LINES` lines of :data:`OUTPUT_COLUMNS`, named by cell and start."""
    over = []
    for i, cell in enumerate(nb["cells"]):
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            data = output.get("data", {})
            plain = output.get("output_type") == "stream" or set(data) == {"text/plain"}
            over += [f"cell {i}: {columns(l)} columns ({columns(l) / OUTPUT_COLUMNS:.1f} lines), starting {l[:100]!r}"
                     for l in (output_text(output) if plain else "").splitlines()
                     if columns(l) > MAX_WRAPPED_LINES * OUTPUT_COLUMNS]
    return over


def test_line_width_rules():
    """The width counter: a wide character is two columns; a line of exactly four output lines passes, one more fails."""
    assert columns("混合精度：ab") == 12
    stream = lambda text: {"cells": [{"cell_type": "code", "outputs": [  # noqa: E731
        {"output_type": "stream", "name": "stdout", "text": text}]}]}
    limit = MAX_WRAPPED_LINES * OUTPUT_COLUMNS
    assert not overlong_lines(stream("x" * limit + "\n" + "精" * (limit // 2)))
    assert overlong_lines(stream("short\n" + "精" * (limit // 2) + "x"))[0].startswith("cell 0: 481 columns")
    table = {"output_type": "display_data", "data": {"text/markdown": "| " + "x" * 600 + " |", "text/plain": "<Md>"}}
    assert not overlong_lines({"cells": [{"cell_type": "code", "outputs": [table]}]})


def notebook(lab: str, folder: Path = REPO) -> tuple[Path, dict]:
    paths = sorted(folder.glob(f"{lab}-*.ipynb"))
    assert len(paths) == 1, f"one notebook {lab}-*.ipynb expected in {folder}, found {paths}"
    return paths[0], json.loads(paths[0].read_text(encoding="utf-8"))


@pytest.mark.parametrize("lab", LABS)
def test_code_lines(lab):
    path, nb = notebook(lab)
    n = sum(len(_text(c["source"]).splitlines()) for c in nb["cells"] if c["cell_type"] == "code")
    assert n <= MAX_CODE_LINES, f"{path.name}: {n} code lines (at most {MAX_CODE_LINES})"


@pytest.mark.parametrize("lab", LABS)
def test_the_committed_notebook_is_valid_nbformat_without_outputs(lab):
    """nbformat's own validator (4.5: every cell has a unique id; a cell added without one is a warning now and "will
    become a hard error in future nbformat versions", as CI printed for two of lab 03's cells), and no outputs or
    execution counts committed. Breaks on a cell added by hand without an id, or a notebook saved after running."""
    import warnings

    import nbformat

    path, _ = notebook(lab)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MissingIDFieldWarning and its kin fail here
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
    ids = [c.get("id") for c in nb.cells]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: cell ids missing or repeated"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


def _regen(lab: str):
    from tests import regen_once

    run = regen_once.run_for([lab])
    path, _ = notebook(lab)
    assert run.lab_ok(path.stem), run.lab_failure(path.stem)
    return run, path.stem


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.regen_labs(lab)) for lab in LABS])
def test_printed_output_budget(lab):
    run, stem = _regen(lab)
    _, nb = notebook(lab, run.out / "executed")
    total, over = 0, []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        lines = printed_lines(cell)
        total += len(lines)
        chars = sum(len(l) for l in lines)
        if len(lines) > MAX_CELL_LINES or chars > MAX_CELL_CHARS:
            over.append(f"cell {i}: {len(lines)} lines, {chars} characters, starting {lines[0][:80]!r}")
    assert not over, f"{stem}: cells over {MAX_CELL_LINES} lines or {MAX_CELL_CHARS} characters:\n" + "\n".join(over)
    assert total <= MAX_LAB_LINES, f"{stem}: {total} printed lines (at most {MAX_LAB_LINES})"


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.regen_labs(lab)) for lab in LABS])
def test_no_printed_line_wraps_past_four_lines(lab):
    run, stem = _regen(lab)
    over = overlong_lines(notebook(lab, run.out / "executed")[1])
    assert not over, (f"{stem}: printed lines longer than {MAX_WRAPPED_LINES} lines of {OUTPUT_COLUMNS} columns "
                      f"(JupyterLab's output area):\n" + "\n".join(over))


@pytest.mark.regen_labs(*LABS_WITH_BUDGET)
def test_every_lab_states_the_same_8gb_card():
    """Issue 43: in smoke "an 8 GB card" was 30.91 / 29.58 / 15.04 / 13.59 MiB in labs 01-04, each lab scaling the
    card over its own rows (and lab 01 recorded no size at all). Each lab now records the same budget and the same
    sentence (labutils.labs.scale_model), and prints that sentence. Breaks if a lab computes or words its own."""
    seen = {}
    for lab in LABS_WITH_BUDGET:
        run, stem = _regen(lab)
        notes = json.loads((run.out / f"{stem}.json").read_text(encoding="utf-8"))["notes"]
        _, nb = notebook(lab, run.out / "executed")
        printed = "\n".join(output_text(o) for c in nb["cells"] for o in c.get("outputs", []))
        assert notes.get("card") and notes["card"] in printed, f"{stem}: the card's sentence not recorded and printed"
        seen[lab] = (notes.get("budget_bytes"), notes["card"])
    assert len(set(seen.values())) == 1, f"the labs state different cards: {seen}"


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.regen_labs(lab)) for lab in LABS_WITH_BUDGET])
def test_smoke_is_a_scale_model_of_8gb(lab):
    """The oracle is the estimator's full-mode prediction for the card (labutils.estimator.estimate.fits with the card table's
    total), recomputed here from each row's recorded full-mode config, against the status the smoke run measured."""
    import labutils as lu
    from labutils.core.cards import card_total_bytes
    from labutils.estimator.estimate import estimate_memory, fits

    run, stem = _regen(lab)
    results = json.loads((run.out / f"{stem}.json").read_text(encoding="utf-8"))
    rows = results["tables"].get("scale_model")
    assert rows, f"{stem}: no 'scale_model' table in its results (rows run under the smoke budget, with status)"
    card_bytes, _ = card_total_bytes(8)
    fit_seen = oom_seen = False
    for r in rows:
        cfg = lu.load_config(None, overrides=r["full_config"], mode="full")
        expected = "ok" if fits(estimate_memory(cfg), card_bytes) else "oom"
        assert r["status"] == expected, (f"{stem}, row {r['row']!r}: smoke measured {r['status']!r}, the 8 GB card "
                                         f"(estimator, full mode) {expected!r}")
        fit_seen |= expected == "ok"
        oom_seen |= expected == "oom"
    assert fit_seen and oom_seen, f"{stem}: its rows show no boundary (every row {'fits' if fit_seen else 'OOMs'})"
