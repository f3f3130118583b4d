"""Status that never hides a failure (issue 14, class 4 and the CPU OOM row of class 7).

One rule for every precision (labutils.core.train.divergence): a run is "diverged" when its loss is non-finite on
each of its last min(3, steps) steps, or when fp16 skipped every one of at least 5 steps. JSON output is strict:
non-finite numbers are written as null, never as a bare NaN that JSON parsers reject.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import labutils as lu
from labutils.core.results import write_json
from labutils.core.train import ALL_SKIPPED_MIN, STATUSES, divergence

from conftest import tiny_config


def strict_load(path: Path):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def poison_after(step_to_poison: int):
    def hook(step, result, model, optimizer, scaler):
        if step == step_to_poison:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
    return hook


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nonfinite_training_is_diverged_in_every_precision(ragged_corpus, tmp_path, precision):
    cfg = tiny_config(ragged_corpus, **{"train.precision": precision, "train.steps": 5})
    res = lu.run(cfg, "cpu", progress=False, verbose=False, on_step=poison_after(0))
    assert res.status == "diverged" and not res.ok, (res.status, res.losses)
    assert "non-finite" in res.error or "loss is nan" in res.error
    write_json(tmp_path / "r.json", res.to_dict())
    data = strict_load(tmp_path / "r.json")  # strict JSON: NaN losses become null
    assert data["status"] == "diverged"
    assert all(v is None or math.isfinite(v) for v in data["losses"])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before")  # step 0 skipped: expected
@pytest.mark.parametrize("steps", [ALL_SKIPPED_MIN, ALL_SKIPPED_MIN + 2])
def test_fp16_run_that_skipped_every_step_is_diverged(ragged_corpus, steps):
    cfg = tiny_config(ragged_corpus, **{"train.precision": "fp16", "train.steps": steps})
    res = lu.run(cfg, "cpu", progress=False, verbose=False, inject_overflow_at=set(range(steps)))
    assert res.skipped == list(range(steps))
    assert res.status == "diverged" and "no weight was updated" in res.error


@pytest.mark.parametrize("inject", [{1}, {1, 2}, {3}])
def test_fp16_transient_overflow_that_recovers_is_ok(ragged_corpus, inject):
    cfg = tiny_config(ragged_corpus, **{"train.precision": "fp16", "train.steps": 5})
    res = lu.run(cfg, "cpu", progress=False, verbose=False, inject_overflow_at=inject)
    assert res.status == "ok" and set(res.skipped) == inject


@pytest.mark.parametrize("losses, skipped, precision, diverged", [
    ([5.0, 4.0, 3.0], [], "fp32", False),
    ([5.0, float("nan"), float("nan"), float("nan")], [1, 2, 3], "fp16", True),
    ([5.0, float("nan"), 3.0, float("inf")], [1, 3], "fp16", False),  # recovered in between
    ([float("inf")], [0], "fp16", True),  # one step, non-finite: nothing to recover with
    ([5.0] * 5, [0, 1, 2, 3, 4], "fp16", True),
    ([5.0] * 4, [0, 1, 2, 3], "fp16", False),  # a short run may spend its steps calibrating the scale
    ([], [], "fp32", False),
])
def test_divergence_rule(losses, skipped, precision, diverged):
    assert (divergence(losses, skipped, precision) is not None) == diverged


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float32("nan"),
                                   torch.tensor(float("nan")), np.float64("inf")],
                         ids=["nan", "inf", "-inf", "np.float32 nan", "torch nan", "np.float64 inf"])
def test_write_json_is_strict(tmp_path, value):
    write_json(tmp_path / "x.json", {"loss": value, "losses": [1.0, value], "nested": {"v": value}})
    assert strict_load(tmp_path / "x.json") == {"loss": None, "losses": [1.0, None], "nested": {"v": None}}


def test_cpu_oom_row_has_the_memory_reached(ragged_corpus):
    with lu.MemoryTracker("cpu") as live:  # the CPU budget counts every CPU tensor of the process
        pass
    budget = live.start_bytes + 4 * 2**20
    res = lu.run(tiny_config(ragged_corpus), "cpu", progress=False, verbose=False, cpu_budget_bytes=budget)
    assert res.status == "oom"
    assert isinstance(res.peak_memory_bytes, int) and 0 < res.peak_memory_bytes <= budget


LABUTILS = Path(__file__).resolve().parent.parent / "labutils"
NOTEBOOKS = sorted(Path(__file__).resolve().parent.parent.glob("[0-9][0-9]-*.ipynb"))


# the doctor's checks (doctor.py, doctor_checks.py, doctor_speed.py) have their own status vocabulary (pass / fail / skip), not a run's
@pytest.mark.parametrize("path", sorted(p for p in LABUTILS.rglob("*.py") if not p.name.startswith("doctor")) + NOTEBOOKS,
                         ids=lambda p: p.name)
def test_status_values_are_one_spelling_everywhere(path):
    """Status values are lower case ("oom", "diverged"...) in labutils and in every lab: a comparison with
    "OOM" would never match. Prose and figure labels may say OOM; a status value may not."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code")
    values = re.findall(r"""status["']?\s*(?:=|==|!=|:)\s*["'](\w+)["']""", text)
    assert set(values) <= set(STATUSES), sorted(set(values) - set(STATUSES))
