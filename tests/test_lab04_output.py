"""What a reader of lab 04's executed notebook trips on (issue 36, item 4), checked on the session's one
``regenerate --smoke`` run (tests/regen_once.py):

- one table cell held a paragraph (the claims table's "why", a column header of 110 characters);
- raw byte counts were printed ("12,087,940" in a table of the logits' share).

What would fail them: a table that shows a claim's reasons or the conditions dictionary again, a memory column
whose name carries no unit (show_table then prints the bytes as they are).
"""
from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def record():
    from tests import regen_once

    return json.loads((regen_once.run_for(["04"]).out / "04-Memory_Profiling.json").read_text())


def _lines(nb, needle: str) -> list[str]:
    return [line for cell in nb["cells"] for out in cell.get("outputs", []) for line in output_text(out).splitlines()
            if needle in line]


@pytest.mark.regen_labs("04")
def test_a_change_between_estimates_says_so(executed, record):
    """Issue 44 §4: "fp16 alone changes the peak by -8%" was an estimate divided by an estimate (in smoke the fp32
    and fp16 rows both ran out of memory) printed as a measurement. Breaks if a change whose row or baseline ran out
    of memory is printed without saying it is between estimates, or a measured one says it is."""
    status = {r["technique"]: r["status"] for r in record["tables"]["techniques"]}
    [line] = _lines(executed, "alone changes the peak by")
    amp = line.split(" alone ")[0]
    parts = {amp: line.split("changes the peak by")[1].split("checkpointing by")[0],
             "checkpointing": line.split("checkpointing by")[1].split(":")[0]}
    for row, said in parts.items():
        estimated = "oom" in (status[row], status["baseline (fp32)"])
        assert ("between estimates" in said) == estimated, (row, status, line)


@pytest.mark.regen_labs("04")
def test_a_chunked_loss_that_saves_nothing_is_not_shown_as_a_saving(executed, record):
    """Issue 44 §1, §4: in smoke the chunked loss "lowers it by 0 B = 0.0 x the logits" under a table of two equal
    peaks: the tiny model's peak comes where no logits are alive. Breaks if a zero (or negative) saving is worded as
    lowering the peak, or the table of equal peaks is printed (it stays in the results file)."""
    saved = record["tables"]["logits_memory"][1]["saved_bytes"]
    [line] = _lines(executed, "-row vocabulary): the whole fp32 logits") or ["not measured"]
    shown = _lines(executed, "| chunked |")
    assert ("lower it by" in line) == (saved is not None and saved > 0), (saved, line)
    assert bool(shown) == (saved != 0), (saved, shown)


SIZE = r"([\d.,]+) (B|KiB|MiB|GiB)"
UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@pytest.mark.regen_labs("04")
def test_why_fp32_with_checkpointing_can_peak_lower_is_said_by_its_sign(executed):
    """Issue 44 §4, §5: "fp32 + checkpointing 5.70 GiB" stood below "fp16 + checkpointing 5.81 GiB", and the CLI
    recommended FP32 for the config the course calls optimised, with no word of why. Breaks if the line is missing,
    or if its wording ("FP32 is lower" or "... is lower: its halved activations") contradicts its two numbers."""
    [line] = _lines(executed, "with checkpointing (estimates): FP32 ")
    (fp32, u32), (amp, uamp) = re.findall(SIZE, line)[:2]
    lower = float(fp32.replace(",", "")) * UNIT[u32] < float(amp.replace(",", "")) * UNIT[uamp]
    assert ("FP32 is lower" in line) == lower and ("halved activations outweigh" in line) == (not lower), line
