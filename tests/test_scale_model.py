"""Issue 43: "an 8 GB card" means one thing in every lab. Each lab used to scale the card over its own rows, so in
smoke the card was 30.91 / 29.58 / 15.04 / 13.59 MiB in labs 01-04; now labutils.labs.scale_model computes one size
from every lab's budgeted runs, and a config's ``smoke:`` section (labs 03 and 04: GPT-2 medium's larger state, as
data on the device) is what makes one size possible. Estimator arithmetic only: no training here (the session's
smoke run checks what the labs measured: tests/test_output_budget.py)."""
from __future__ import annotations

import pytest
import torch

import labutils as lu
import labutils.labs.scale_model as sm
from labutils.labs.registry import IDS
from labutils.core.cards import CUDA_CONTEXT_BYTES, card_total_bytes

CPU = torch.device("cpu")
LABS = IDS


def test_a_configs_smoke_section_applies_in_smoke_mode_only(root, tmp_path):
    """The file's own smoke sizes come after the caps, only in smoke mode; --set still wins; a bad key names the
    file's smoke section."""
    path = root / "configs/lab04_techniques.yaml"
    assert lu.load_config(path, mode="smoke").data.num_samples == 12000
    assert lu.load_config(path, mode="full").data.num_samples == 256
    assert lu.load_config(path, ["data.num_samples=7"], mode="smoke").data.num_samples == 7
    bad = tmp_path / "bad.yaml"
    bad.write_text("smoke:\n  data.num_sample: 3\n", encoding="utf-8")
    with pytest.raises(lu.ConfigError, match="smoke:"):
        lu.load_config(bad, mode="smoke")


def test_the_four_labs_state_the_same_card():
    """The acceptance: the same budget and the same sentence in every lab, and every lab's budgeted run fits the
    scale model in smoke exactly when the estimator says its full-mode config fits the card."""
    got = {lab: sm.lab_budget(lab, CPU) for lab in LABS}
    assert len({g["bytes"] for g in got.values()}) == 1 and len({g["line"] for g in got.values()}) == 1
    budget = got["01"]["bytes"]
    assert f"in smoke its scale model: {budget / 2**20:.2f} MiB" in got["01"]["line"]
    assert got["01"]["card_bytes"] == card_total_bytes(8)[0]  # the card table's 8 GB card, less the estimator's context
    assert f"{(card_total_bytes(8)[0] - CUDA_CONTEXT_BYTES) / 2**30:.2f} GiB for tensors" in got["01"]["line"]
    for lab, g in got.items():
        rows = g["scale_rows"]
        assert [r["row"] for r in rows] == list(g["rows"]) and {r["lab"] for r in rows} == {lab}
        assert any(r["full_fits"] for r in rows) and not all(r["full_fits"] for r in rows), lab  # a boundary
        for r in rows:
            assert (r["smoke_peak_bytes"] <= budget) == r["smoke_fits"] == r["full_fits"], (lab, r["row"])


def test_without_labs_03_04_smoke_sections_no_one_size_exists(root, tmp_path, monkeypatch):
    """What the smoke sections are for: without them lab 04's 2 x 2 accumulation, which does not fit the card, needs
    less smoke memory than lab 02's 8 x 4, which does, so no one size reproduces both. Breaks if the rule quietly
    picks a size that misclassifies a run instead of naming the two."""
    (tmp_path / "configs").mkdir()
    for f in (root / "configs").glob("*.yaml"):
        text = f.read_text(encoding="utf-8")
        (tmp_path / "configs" / f.name).write_text(text.split("\nsmoke:")[0] + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the registry names its configs as the notebooks do: configs/NAME.yaml
    sm.course.cache_clear()
    try:
        with pytest.raises(ValueError, match="lab 02 '8 x 4' fits the card and lab 04 'accumulation x2' does not"):
            sm.course("fp16", "fp32")
    finally:
        sm.course.cache_clear()
