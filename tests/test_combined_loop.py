"""Lab 04's one loop with everything (section 8.1: autocast + GradScaler, accumulation normalised by the window's
target tokens, activation checkpointing) matches labutils.core.train for the same config (issue 24).

`one_loop` is compiled from the notebook's own cell (AST), and run from the same weights on the same ragged, padded
data as labutils.core.train (the loop the CLI and every lab use: the oracle). Breakage that fails it: dividing by the
accumulation steps instead of the window's tokens (ragged micro-batches: a different gradient norm), zeroing p.grad
per micro-batch, clipping before scaler.unscale_ (fp16: a norm S times too large), stepping the scheduler twice or
not at all (step 2's loss differs), or a loop that never switches checkpointing on (the model says so).
"""
from __future__ import annotations

import ast
import math
import re
import time
from pathlib import Path

import nbformat
import pytest
import torch

import labutils as lu
import labutils.labs.lab02.accumulation as acc
from labutils.core.train import train
from labutils.labs.registry import IDS

from conftest import tiny_config

NOTEBOOK = Path(__file__).resolve().parent.parent / "04-Memory_Profiling.ipynb"


def one_loop_from_notebook():
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
             if c.cell_type == "code" and "def one_loop(" in c.source]
    assert len(cells) == 1, "lab 04 defines one_loop in exactly one cell"
    fn = next(n for n in ast.parse(cells[0]).body if isinstance(n, ast.FunctionDef) and n.name == "one_loop")
    ns = {"torch": torch, "math": math, "time": time, "lu": lu}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(NOTEBOOK), "exec"), ns)
    return ns["one_loop"], ast.get_source_segment(cells[0], fn)


def test_the_cell_holds_all_three_techniques():
    _, body = one_loop_from_notebook()
    for part in ("torch.amp.autocast(", "torch.amp.GradScaler(", "scaler.unscale_(", "num_items_in_batch=N",
                 ".backward()", "enable_checkpointing("):
        assert part in body, part
    assert len(body.splitlines()) <= 40, "short enough to edit"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_loop_matches_labutils_train(ragged_corpus, precision):
    one_loop, _ = one_loop_from_notebook()
    cfg = tiny_config(ragged_corpus, data__pack=False, train__micro_batch_size=2, train__accumulation_steps=3,
                      train__steps=2, train__precision=precision, train__gradient_checkpointing=True,
                      train__warmup_steps=1)
    with acc.held_model(cfg, "cpu") as (model, dataset, device):
        w = next(dataset.windows(2, 3, cfg.train.seed))
        counts = [acc.count_targets([mb]) for mb in w.micro_batches]
        assert max(counts) > min(counts), f"the data must be ragged for the normalisation to matter: {counts}"
        mine = one_loop(cfg, model, dataset, device)
        on = model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") else model.is_gradient_checkpointing
        assert on, "checkpointing was switched on by the loop"
    with acc.held_model(cfg, "cpu") as (model, dataset, device):
        ref = train(cfg, model, dataset, device, progress=False, track_memory=False)
    assert len(mine["losses"]) == len(ref.losses) == 2 and len(mine["step_times"]) == 2
    assert mine["losses"] == pytest.approx(ref.losses, rel=1e-4)
    assert mine["grad_norms"] == pytest.approx(ref.grad_norms, rel=1e-3)


@pytest.mark.parametrize("lab", IDS)
def test_every_checkpointing_call_a_student_copies_is_non_reentrant(lab):
    """Lab 03 teaches to always pass use_reentrant=False (torch's reentrant variant drops gradients of inputs that do
    not require grad, and torch asks for the argument); lab 04's capstone swap table, what a student copies into their
    own loop, gave ``model.gradient_checkpointing_enable()`` without it (issue 44 §5). Every enable call and every
    ``torch.utils.checkpoint.checkpoint(`` in a code cell, and in lab 04's capstone text, passes it on the same line."""
    from tests.test_output_budget import notebook

    _, nb = notebook(lab)
    copied = [c for c in nb["cells"] if c["cell_type"] == "code" or "| 迴圈裡的 | 換成你的 |" in "".join(c["source"])]
    calls = [line for cell in copied for line in "".join(cell["source"]).splitlines()
             if re.search(r"checkpointing_enable\(|utils\.checkpoint\.checkpoint\(", line)]
    assert all("use_reentrant" in line for line in calls), [line for line in calls if "use_reentrant" not in line]
    assert lab != "04" or calls  # the capstone's swap table names the call
