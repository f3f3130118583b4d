"""The 8 GB plan written in configs/lab04_techniques.yaml's comment is the estimator's (issue 36: the comment promised
a step-down to "(4, 2, 1)" the code never did, and "fits up to micro-batch 7" where the notebook printed 6). Every
"plan:" line and the "largest micro-batch" line are recomputed here with labutils.estimator.estimate for the full-size config
on an 8 GB card (the card table's 7.78 GiB). Breaks when the config, the estimator or the comment changes alone."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import labutils as lu
from labutils.estimator import estimate as est
from labutils.core.cards import card_total_bytes

PATH = Path(__file__).resolve().parent.parent / "configs" / "lab04_techniques.yaml"
PLAN = re.compile(r"^#\s+plan: (?P<what>[a-z0-9 +]+), (?P<m>\d+) x (?P<a>\d+): peak (?P<gib>[0-9.]+) GiB, "
                  r"(?P<verdict>OOM|fits)$", re.M)
LARGEST = re.compile(r"^#\s+largest micro-batch that fits: fp32 (?P<fp32>\d+), mixed precision \+ checkpointing "
                     r"(?P<amp>\d+)$", re.M)


def overrides(what: str) -> dict:
    """The estimator's keyword overrides for a plan line's words ("mixed precision" is bf16: fp16's memory too)."""
    words = what.split(" + ")
    allowed = {"fp32", "fp16", "mixed precision", "checkpointing", "accumulation"}
    assert set(words) <= allowed, f"unknown words in plan line: {what!r}"
    over = {"precision": "fp16" if "fp16" in words else "bf16" if "mixed precision" in words else "fp32"}
    if "checkpointing" in words:
        over["checkpointing"] = True
    return over


def test_every_plan_line_is_the_estimators():
    text = PATH.read_text(encoding="utf-8")
    full = lu.load_config(PATH, mode="full")
    card = card_total_bytes(8)[0]
    lines = list(PLAN.finditer(text))
    assert len(lines) >= 6, "the comment's plan lines are missing or malformed"
    for m in lines:
        e = est.estimate_memory(full, micro=int(m["m"]), accum=int(m["a"]), **overrides(m["what"]))
        assert e["peak_bytes"] / 2**30 == pytest.approx(float(m["gib"]), abs=0.006), m.group(0)
        assert ("fits" if est.fits(e, card) else "OOM") == m["verdict"], m.group(0)
    largest = LARGEST.search(text)
    assert largest, "the 'largest micro-batch that fits' line is missing"
    assert est.largest_batch(full, card, limit=64) == int(largest["fp32"])
    assert est.largest_batch(full, card, limit=64, precision="bf16", checkpointing=True) == int(largest["amp"])
