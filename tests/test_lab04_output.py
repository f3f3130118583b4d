"""What a reader of lab 04's executed notebook trips on (issue 36, item 4), checked on the session's one
``regenerate --smoke`` run (tests/regen_once.py):

- one table cell held a paragraph (the claims table's "why", a column header of 110 characters);
- raw byte counts were printed ("12,087,940" in a table of the logits' share).

What would fail them: a table that shows a claim's reasons or the conditions dictionary again, a memory column
whose name carries no unit (show_table then prints the bytes as they are).
"""
from __future__ import annotations

import re

import pytest

from tests.test_output_budget import notebook, output_text

MAX_CELL = 100                                                      # characters in one table cell
RAW_BYTES = re.compile(r"^\d{1,3}(,\d{3}){2,}$")                     # a table cell of 1,000,000 or more, no unit
RAW_BYTES_TEXT = re.compile(r"\b\d{1,3}(,\d{3})+ (B|bytes)\b")       # "12,087,940 B" in a sentence


@pytest.fixture(scope="module")
def executed():
    from tests import regen_once

    run = regen_once.run_for(["04"])
    path, _ = notebook("04")
    assert run.lab_ok(path.stem), run.lab_failure(path.stem)
    return notebook("04", run.out / "executed")[1]


def _tables(nb):
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            for line in output_text(out).splitlines():
                if line.startswith("|") and not re.match(r"^\|[-:| ]+\|$", line):
                    yield i, [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.regen_labs("04")
def test_no_table_cell_holds_a_paragraph(executed):
    long = [(i, c[:60]) for i, cells in _tables(executed) for c in cells if len(c) > MAX_CELL]
    assert not long, f"lab 04: table cells over {MAX_CELL} characters: {long}"


@pytest.mark.regen_labs("04")
def test_no_raw_byte_counts(executed):
    raw = [(i, c) for i, cells in _tables(executed) for c in cells if RAW_BYTES.match(c)]
    for i, cell in enumerate(executed["cells"]):
        raw += [(i, m.group(0)) for out in cell.get("outputs", []) for m in RAW_BYTES_TEXT.finditer(output_text(out))]
    assert not raw, f"lab 04 prints byte counts without a unit: {raw}"
