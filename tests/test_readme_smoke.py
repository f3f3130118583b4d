"""The README's smoke row says what the notebooks run (issue 24: it said "步數 ≤ 4" while lab 01 runs 24 steps).

Oracles outside the README: the smoke caps labutils.core.config applies (SMOKE_CAPS), the tiny model's shape
(models.PRESETS), and the notebooks' own code: every literal `"train.steps": N` a code cell sets, and lab 02's
learning-rate plan, whose step counts are computed by the notebook's own assignments (executed here on the smoke
config). Breakage that fails it: a notebook (or the cap) running more steps than the README row says, a row that
drops the cap, or an exception the README forgets to name.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat

import labutils as lu
from labutils.core.config import SMOKE_CAPS
from labutils.models.gpt2 import PRESETS

ROOT = Path(__file__).resolve().parent.parent


def smoke_row() -> str:
    rows = [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if line.startswith("| smoke |")]
    assert len(rows) == 1, "the README's 模式 table has one smoke row"
    return rows[0]


def code(nb: Path) -> list[str]:
    return [c.source for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code"]


def literal_step_overrides(nb: Path) -> set[int]:
    return {int(n) for src in code(nb) for n in re.findall(r'"train\.steps":\s*(\d+)', src)}


def lab02_lr_steps() -> set[int]:
    """The optimizer steps lab 02's learning-rate section runs in smoke, by the notebook's own assignments."""
    names = {"ACCUM_STEPS", "MICRO", "TARGET", "B0", "B1", "ratio", "S0", "S1", "lr0", "w0", "w1"}
    from labutils.labs import registry

    ns = {"cfg": lu.load_config(ROOT / "configs/lab02_accumulation.yaml", mode="smoke"), "labs": registry}
    for src in code(ROOT / "02-Gradient_Accumulation.ipynb"):
        for node in ast.parse(src).body:
            if isinstance(node, ast.Assign) and {n.id for t in node.targets for n in ast.walk(t)
                                                 if isinstance(n, ast.Name)} <= names:
                exec(compile(ast.Module(body=[node], type_ignores=[]), "lab02", "exec"), ns)
    return {ns["S0"], ns["S1"]}


def test_readme_smoke_row_matches_the_caps_and_the_model():
    row = smoke_row()
    assert f"≤ {SMOKE_CAPS['train.steps']} 個 optimizer step" in row, row
    assert f"序列 ≤ {SMOKE_CAPS['data.seq_length']}" in row, row
    smoke_models = {lu.load_config(c, mode="smoke").model.name for c in sorted(ROOT.glob("configs/*.yaml"))}
    for name in sorted(smoke_models):  # tiny, and the deeper one a config's smoke: section picks (lab 03)
        assert f"`{name}`" in row and f"{PRESETS[name].n_layer} 層、寬 {PRESETS[name].d_model}" in row, (name, row)


def test_every_step_count_above_the_cap_is_named_in_the_readme():
    row, cap = smoke_row(), SMOKE_CAPS["train.steps"]
    named = {int(n) for n in re.findall(r"(\d+) 步", row)}
    for nb in sorted(ROOT.glob("0[1-4]-*.ipynb")):
        over = {n for n in literal_step_overrides(nb) if n > cap}
        if nb.name.startswith("02-"):
            over |= {n for n in lab02_lr_steps() if n > cap}
        for n in over:
            assert f"lab {nb.name[:2]}" in row and n in named, f"{nb.name} runs {n} steps in smoke; README: {row}"
