"""Lab 03 writes out, in its cells, the GPT-2-scale checkpointing variants it measures (issue 44, item 8): Chen's
segments, selective checkpointing through the model's API, offload that leaves the weights in place. These tests run
the cells' own code (``ck.notebook_variants``: the definitions, read from the .ipynb and executed) and read the
session's smoke run of the notebook to check that the measurements it reports were made with those variants."""
from __future__ import annotations

import functools
import json

import pytest
import torch

import labutils.labs.lab03.checkpoint_measure as cm
import labutils.labs.lab03.checkpointing as ck
from test_checkpointing import _batch, _model, one_thread  # noqa: F401 (one_thread: its autouse fixture, here too)

STEM = "03-Gradient_Checkpointing"
TOL = 1e-5  # the notebook's gradient check: fp32, dropout 0


def _cell_variants(nb):
    return {"segments of 2": nb["segments"](2), "segments of 3": nb["segments"](3), "selective": nb["selective"](),
            "offload": nb["offload"](), "checkpoint + offload": nb["offload"](checkpointing=True)}


def test_the_cells_variants_give_the_gradients_of_no_checkpointing():
    """Each variant defined in lab 03's cells, on a tiny GPT-2 (fp32, dropout 0), gives the gradients of a step
    without checkpointing (relative difference < 1e-5), and is the cells' code, not a copy in labutils."""
    nb = ck.notebook_variants()
    model, batch = _model(), _batch()
    reference = cm.step_grads(model, batch)
    for name, v in _cell_variants(nb).items():
        assert v.name == name and v.apply.__code__.co_filename.endswith(f"{STEM}.ipynb"), name
        diff = cm.max_rel_diff(cm.step_grads(model, batch, v), reference)
        assert diff < TOL, (name, diff)
        assert cm.max_rel_diff(cm.step_grads(model, batch), reference) == 0.0  # switched off again
    # one home: labutils keeps the model's own API and Variant, not a second copy of the cells' variants
    assert not [n for n in ("Segment", "segments", "selective", "offload", "checkpoint_offload", "CountingSaveOnCPU",
                            "save_matmuls") if hasattr(ck, n)]


def test_a_broken_cell_variant_fails_the_same_check():
    """Negative control: the same check, on the cells' Segment with dropout on, passes when the recompute restores the
    RNG state (checkpoint's default) and fails when the cells' checkpoint call does not (preserve_rng_state=False)."""
    model, batch = _model(dropout=0.1), _batch()
    torch.manual_seed(1)
    reference = cm.step_grads(model, batch)
    diffs = {}
    for preserve in (True, False):
        nb = ck.notebook_variants()
        nb["checkpoint"] = functools.partial(nb["checkpoint"], preserve_rng_state=preserve)  # what Segment calls
        torch.manual_seed(1)  # the plain step's dropout masks, if the recompute replays them
        diffs[preserve] = cm.max_rel_diff(cm.step_grads(model, batch, nb["segments"](2)), reference)
    assert diffs[True] < TOL and diffs[False] > 1e-3, diffs


def test_offload_from_the_cells_moves_activations_and_leaves_the_weights():
    """The cells' offload counts what it moves per forward; the weights the matmuls save stay in place."""
    nb = ck.notebook_variants()
    model, batch = _model(), _batch()
    off = nb["offload"]()
    cm.step_grads(model, batch, off)
    block_weights = sum(p.numel() * 4 for n, p in model.named_parameters() if ".h." in n and p.dim() == 2)
    assert off.info["host_bytes"] > 0 and off.info["weights_not_moved_bytes"] >= block_weights


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloads_undo_puts_back_a_forward_the_model_had(checkpointing):
    """A model with a forward of its own (the chunked loss, labutils.models.loss_chunks.install, as lab 04 trains): the
    cells' offload wraps it, and its undo puts that forward back. Breaks if undo drops it (the model would silently
    train with the full loss afterwards)."""
    from labutils.models import loss_chunks

    nb = ck.notebook_variants()
    model = loss_chunks.install(_model())
    undo = nb["offload"](checkpointing).apply(model)
    assert not loss_chunks.installed(model)  # wrapped
    undo()
    assert loss_chunks.installed(model)


# ------------------------------------------------------------------------------------------------ the run
@pytest.mark.regen_labs("03")
def test_the_reported_measurements_were_made_with_the_cells_variants():
    """The smoke run's results record, per measured row, where its variant's code was (``Variant.defined_in``, read
    from the apply function's module: the kernel runs a cell as ``__main__``). The Pareto table (sections 4-6's
    runs) and the gradient check must have every segments / selective / offload row from the notebook's cells; the
    model's own API (every k) stays labutils'. Breaks if a reported row was measured with a labutils copy."""
    from tests import regen_once

    run = regen_once.run_for(["03"])
    assert run.lab_ok(STEM), run.lab_failure(STEM)
    tables = json.loads((run.out / f"{STEM}.json").read_text(encoding="utf-8"))["tables"]
    cells = ("segments of", "selective", "offload", "checkpoint + offload")
    for table in ("pareto", "gradients"):
        rows = [r for r in tables[table] if r["variant"].startswith(cells)]
        assert {next(c for c in cells if r["variant"].startswith(c)) for r in rows} == set(cells), (table, rows)
        assert all(r["defined_in"] == "notebook" for r in rows), (table, rows)
        every = [r for r in tables[table] if r["variant"].startswith("every ")]
        assert every and all(r["defined_in"] == ck.__name__ for r in every), (table, every)
