"""Lab 03 as a reader meets it (issue 36, item 4): what tripped a student, each checked where it can fail.

Unit tests feed the lab's own sentence and table builders (labutils.labs.lab03.checkpoint_report) runs whose numbers are set
here, with the estimator (labutils.estimator.estimate, lab 04's, not the code under test) saying where a peak falls. The
tests marked ``regen_labs("03")`` read the session's one ``regenerate --smoke`` run of the real notebook.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import labutils as lu
import labutils.labs.lab03.checkpoint_measure as cm
import labutils.labs.lab03.checkpoint_report as cr
from labutils.core.cards import card_total_bytes
from labutils.estimator.estimate import estimate_memory, fits
from labutils.core.train import RunResult

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "lab03_checkpointing.yaml"
STEM = "03-Gradient_Checkpointing"
GiB = 2**30


def _run(peak, step_s=1.0, *, status="ok", mfu=None, batch=4, device="cpu"):
    res = RunResult(config={"train": {"timing_warmup_steps": 1, "micro_batch_size": batch, "precision": "fp32"},
                            "data": {"seq_length": 64}},
                    env={"device": device}, step_times=[3 * step_s] + [step_s] * 4, timed_steps=4,
                    step_time_seconds=step_s, peak_memory_bytes=peak if status == "ok" else None, status=status,
                    mfu=mfu, hfu=None if mfu is None else mfu * 1.3)
    return res


def _pair(b, off_peak, on_peak, **kw):
    return {(b, False): cm.Measured("no checkpointing", "baseline", None, _run(off_peak, 1.0, batch=b, **kw)),
            (b, True): cm.Measured("checkpointing", "every_n", 1, _run(on_peak, 1.2, batch=b, **kw))}


# ------------------------------------------------------------------------------------------------ the config
def test_config_comment_is_what_the_estimator_says_for_an_8gb_card():
    """The comment said "with checkpointing up to 8 fits" while the estimator said 6.70 GiB at 8 does not. Breaks if
    a number or a fit/no-fit in the comment is not the estimator's (full mode, the card table's 8 GB total)."""
    text = CONFIG.read_text()
    cfg = lu.load_config(str(CONFIG), mode="full")
    card, _ = card_total_bytes(8)
    comment = " ".join(l.lstrip("# ") for l in text.splitlines() if l.startswith("#"))
    off = re.search(r"without checkpointing micro-batch (\d+) fits \(([\d.]+) GiB\), (\d+) does not \(([\d.]+) GiB\), "
                    r"(\d+) does not \(([\d.]+) GiB", comment)
    on = re.search(r"with checkpointing up to (\d+) fits \(([\d.]+) GiB at \d+\), (\d+) does not \(([\d.]+) GiB\)",
                   comment)
    assert off and on, "the comment no longer states the 8 GB plan in the form this test reads"
    claims = [(int(off[1]), False, float(off[2]), True), (int(off[3]), False, float(off[4]), False),
              (int(off[5]), False, float(off[6]), False), (int(on[1]), True, float(on[2]), True),
              (int(on[3]), True, float(on[4]), False)]
    for b, ckpt, gib, fit in claims:
        e = estimate_memory(cfg, micro=b, checkpointing=ckpt)
        assert round(e["peak_bytes"] / GiB, 2) == gib and fits(e, card) == fit, (b, ckpt, e["peak_bytes"] / GiB)
    assert int(on[3]) == int(on[1]) + 1  # "up to N": N + 1 is the first that does not fit


# ------------------------------------------------------------------------------------------------ section 2
def test_a_zero_saving_says_why_when_the_peak_holds_no_activation():
    """The 0 % saving at batch 1 had no reason. The estimator (lab 04's replay) puts that peak where only weights,
    gradients and AdamW state are live; the sentence must say so. Breaks if the reason is missing there, or if it
    is given for a batch where checkpointing did save memory."""
    cfg = lu.load_config(str(CONFIG), mode="smoke")
    est = {b: estimate_memory(cfg, device="cpu", micro=b) for b in (1, 4)}
    assert est[1]["peak_breakdown"]["activations"] == 0 and est[4]["peak_breakdown"]["activations"] > 0
    switch = {**_pair(1, 1000, 1000), **_pair(4, 2000, 1500)}
    one, four, mfu = cr.switch_lines(switch, est, "cpu", (None, "no GPU: MFU is defined against a GPU's peak"), 1.31)
    assert one.startswith("batch 1: checkpointing saves 0%") and "Why 0 %" in one
    # a CPU's cost is the FLOP count it is given, its step time not judged (the pair's +20 % is CPU timing)
    assert "for +31% FLOPs" in one and "+20%" not in one and "not judged (CPU timing)" in one
    assert est[1]["peak_phase"] in one and "no activation is live" in one
    assert four.startswith("batch 4: checkpointing saves 25%") and "Why" not in four
    assert mfu == "MFU / HFU: - (no GPU: MFU is defined against a GPU's peak)"


def test_mfu_line_never_gives_the_peak_flops_derivation_as_the_reason():
    """Full mode on an 8 GB card: the baseline ran out of memory at the config's batch, and the cell printed the
    peak-FLOPs derivation as the reason MFU was missing. Breaks if the MFU line does not fall back to the batch where
    both ran, or names the derivation when the reason is that no batch ran both."""
    derivation = (989.0, "NVIDIA H100 SXM datasheet, dense")
    switch = {**_pair(1, 1000, 1000, mfu=0.30, device="cuda"), **_pair(4, 2000, 1500, mfu=0.40, device="cuda")}
    switch[4, False] = cm.Measured("no checkpointing", "baseline", None, _run(None, status="oom", batch=4))
    lines = cr.switch_lines(switch, {}, "cuda", derivation, 1.31)
    assert lines[0].endswith("for +20% step time") and lines[1].startswith("batch 4: 'no checkpointing' did not fit")
    assert lines[-1].startswith("batch 1: MFU 30.0% -> 30.0%")
    switch[1, False] = cm.Measured("no checkpointing", "baseline", None, _run(None, status="oom", batch=1))
    last = cr.switch_lines(switch, {}, "cuda", derivation, 1.31)[-1]
    assert "no micro-batch ran both" in last and "datasheet" not in last


# ------------------------------------------------------------------------------------------------ section 7
def test_the_course_time_claim_is_set_against_time_not_flops():
    """The spec table put the course's "20-30% (time)" beside the FLOP count (+31 %). Breaks if the row holding the
    FLOP count carries a claim of the course, or the course's time claim is not in the step-time row."""
    cfg = lu.load_config(str(CONFIG), mode="smoke")
    info = {"mode": "smoke", "device": torch.device("cpu"), "gpu_name": None}
    off = cm.Measured("no checkpointing", "baseline", None, _run(2000, 1.0))
    on = cm.Measured("checkpointing", "every_n", 1, _run(1500, 1.2))
    rows = cr.spec_check(cfg, info, off=off, on=on, saving=0.25, overhead=0.2, flops_ratio=1.31, block_ratio=38,
                         k_seg=1, k_star=0.23, state_bytes=800)
    flops = [r for r in rows if "FLOP" in r["quantity"]]
    time = [r for r in rows if r["quantity"].startswith("step time")]
    assert len(flops) == 1 and flops[0]["this run"] == "+31%" and "%" not in flops[0]["course README"]
    assert len(time) == 1 and "20-30% time" in time[0]["course README"] and time[0]["this run"] == "120%"


def test_combine_section_points_to_the_capstone_loop():
    """Lab 03's "combine" section points to the course's one capstone loop, in lab 04's closing section."""
    nb = json.loads((REPO / f"{STEM}.ipynb").read_text(encoding="utf-8"))
    md = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "lab 04 的最後一節（capstone：one_loop）" in md


# ------------------------------------------------------------------------------------------------ the run
def _executed():
    from tests import regen_once

    run = regen_once.run_for(["03"])
    assert run.lab_ok(STEM), run.lab_failure(STEM)
    nb = json.loads((run.out / "executed" / f"{STEM}.ipynb").read_text(encoding="utf-8"))
    data = json.loads((run.out / f"{STEM}.json").read_text(encoding="utf-8"))
    cells = []
    for c in nb["cells"]:
        text = ""
        for o in c.get("outputs", []) if c["cell_type"] == "code" else []:
            t = o.get("text") or o.get("data", {}).get("text/markdown") or ""
            text += ("".join(t) if isinstance(t, list) else t).rstrip("\n") + "\n"
        cells.append(text)
    return cells, data


@pytest.mark.regen_labs("03")
def test_printed_recommendation_names_every_front_member_and_no_other_front_line():
    """The Pareto front line named "every 2", which the table above it did not show. Breaks if the printed
    recommendation table does not list the front the run recorded (up to its six evenly spaced rows), or if a
    sentence names the front apart from a table."""
    cells, data = _executed()
    # the front in its own order (on this CPU run: recomputed FLOPs, blocks re-run, then peak; cr.pareto_front): the
    # pareto table lists the runs in sweep order
    front = [r["variant"] for r in sorted((r for r in data["tables"]["pareto"] if r["on_front"]), key=lambda r: (
        r["extra_flops_pct"], r["recomputed_blocks"], r["peak_mib"]))]
    assert front and [r["use"] for r in data["tables"]["recommendation"]][:len(front)] == front
    text = next(t for t in cells if "| budget_at_least_mib |" in t)
    printed = [row.split("|")[2].strip() for row in text.splitlines() if re.match(r"\| [\d.]+ \|", row)]
    assert printed and set(printed) <= set(front) and (len(front) > 6 or printed == front), (printed, front)
    assert not any("Pareto front (" in t for t in cells)
    note = text.splitlines()[-1]  # a CPU run: its order is CPU time, so the note names no "fastest"
    assert "not a GPU ranking" in note and "fastest" not in note, note


@pytest.mark.regen_labs("03")
def test_torch_warning_is_printed_in_whole_sentences():
    """The use_reentrant warning was cut at 150 characters, mid-word, and followed by "...". Oracle: torch's own
    message, raised here. Breaks if the notebook prints less than its first two sentences whole, or an ellipsis."""
    from torch.utils.checkpoint import checkpoint

    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        checkpoint(torch.nn.Linear(2, 2), torch.randn(2, 2, requires_grad=True))
    message = next(str(w.message) for w in ws if "use_reentrant" in str(w.message))
    first_two = ". ".join(message.split(". ")[:2])
    cells, _ = _executed()
    line = next(l for t in cells for l in t.splitlines() if l.startswith("1. checkpoint(block, x)"))
    assert first_two in line and "..." not in line
    # issue 44 §6: "Starting in PyTorch 2.9 ... will raise an exception", printed under a later torch that only warns,
    # is annotated with what this torch did (it warned: the cell ran on)
    if "Starting in PyTorch" in first_two:
        assert f"torch {torch.__version__.split('+')[0]} here: a warning, not an exception" in line, line
    assert not any("the warning above" in t for t in cells)  # transformers warns once per process: maybe not above


@pytest.mark.regen_labs("03")
def test_batch_one_saving_is_explained_in_the_run():
    """In smoke, batch 1 saves 0 % (its peak is the optimizer step); the printed line must say why."""
    cells, data = _executed()
    b1 = next(r for r in data["tables"]["switch"] if r["micro_batch"] == 1 and r["variant"] == "checkpointing")
    assert abs(b1["memory_saving_pct"]) < 1, data["tables"]["switch"]
    line = next(l for t in cells for l in t.splitlines() if l.startswith("batch 1: checkpointing saves"))
    assert "Why 0 %" in line and "no activation is live" in line


def test_smoke_model_has_blocks_enough_for_three_k():
    """Issue 44 §1: smoke trained tiny's 2 blocks, so section 4's k (the divisors of L) could only be 1 or 2. The smoke
    model is the config's (its smoke: section), its depth the preset's (labutils.models.spec.PRESETS)."""
    name = lu.load_config(CONFIG, mode="smoke").model.name
    blocks = lu.spec_of(name).n_layer
    assert len([k for k in range(1, blocks + 1) if blocks % k == 0]) >= 3, (name, blocks)


@pytest.mark.regen_labs("03")
def test_smoke_k_sweep_and_pareto_front_have_three_points_each():
    """Issue 44 §1: in smoke the k-sweep had 2 points and the Pareto front 1. Whatever k and variants come out best,
    the run must show at least three of each; on a CPU the front is read from recomputed work (counted), never CPU
    time, and offload (host to host) is not on it."""
    _, data = _executed()
    sweep, front = data["tables"]["every_k"], [r for r in data["tables"]["pareto"] if r["on_front"]]
    assert len(sweep) >= 3 and all(r["every_n_status"] == "ok" for r in sweep), sweep
    assert len(front) >= 3, data["tables"]["pareto"]
    assert all(r["extra_flops_pct"] is not None for r in data["tables"]["pareto"])
    assert not any(r["variant"] == "offload" for r in front)
    costs = [(r["extra_flops_pct"], r["recomputed_blocks"]) for r in data["tables"]["recommendation"][:len(front)]]
    peaks = [r["budget_at_least_mib"] for r in data["tables"]["recommendation"][:len(front)]]
    assert costs == sorted(costs) and peaks == sorted(peaks, reverse=True), (costs, peaks)


SPEED = re.compile(r"faster|slower|speed-?up|quicker|[+-]\d+(\.\d+)? ?% (step )?time|time overhead", re.I)


@pytest.mark.regen_labs("03")
def test_no_smoke_sentence_states_a_cpu_speed_difference():
    """Issue 44 §1: "batch 1: checkpointing saves 0 % ... for -8 % step time (CPU timing)" and a printed
    time_overhead_pct of -13.1 read as "checkpointing is faster" from CPU noise. On a CPU every printed sentence that
    names a speed says it is not judged, and the printed recommendation has no time-overhead column (its cost is
    FLOPs); tables may show step times as measured."""
    cells, data = _executed()
    assert data["env"]["device"] == "cpu"
    sentences = [line for text in cells for line in text.splitlines() if line.strip() and not line.startswith("|")]
    assert [s for s in sentences if SPEED.search(s) and "not judged" not in s] == []
    rec = next(t for t in cells if "| budget_at_least_mib |" in t)
    assert "time_overhead_pct" not in rec and "extra_flops_pct" in rec.splitlines()[0], rec
    assert "for +" in next(s for s in sentences if s.startswith("batch 1: checkpointing saves"))  # FLOPs: a cost


def test_use_cache_prose_points_at_no_warning_a_rerun_may_not_show():
    """Issue 44 §6: section 3's prose said the next cell's "[transformers]" line is transformers' own warning; that
    warning comes once per process, so a re-run cell shows none. Breaks if the prose points at it again."""
    nb = json.loads((REPO / f"{STEM}.ipynb").read_text(encoding="utf-8"))
    md = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "4 在下一格" in md and "`[transformers]` 警告就是" not in md and "警告就是 transformers 自己印的" not in md


@pytest.mark.regen_labs("03")
def test_best_segment_length_below_one_block_is_said_as_one_block_per_segment():
    """Issue 44 §4: "smallest at k = sqrt(L*x/A) = 0.33 blocks" is a segment length no model has. Below one block the
    line keeps the number and says that one block per segment (full checkpointing) is the best segmenting."""
    cells, data = _executed()
    line = next(l for t in cells for l in t.splitlines() if "sqrt(L*x/A) = " in l)
    k_star = float(re.search(r"sqrt\(L\*x/A\) = ([\d.]+) blocks", line)[1])
    ratio = data["notes"]["block_saved_over_input"]
    blocks = lu.load_config(CONFIG, mode="smoke")
    assert abs(k_star - (lu.spec_of(blocks.model.name).n_layer / ratio) ** 0.5) < 0.01, (k_star, ratio)
    below = "below one block, so one block per segment (full checkpointing) is the best segmenting"
    assert (below in line) == (k_star < 1), line
