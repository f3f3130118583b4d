"""Lab 02 leaves nothing behind (issue 27, item 2).

Before: ``with acc.held_model(...) as (model, dataset, device)`` in a notebook cell left ``model`` bound after the
block, and the gradient "copies" of ``acc.grads_to_cpu`` were ``p.grad`` itself on the CPU: about 12.8 MiB of
sections 2-3 sat in every later CPU peak (the fitted "fixed cost" read 22.5 MiB where the training state is 8.6 MiB).

- the session's run of the notebook (tests/regen_once.py) records, at section 4's check, memory in use equal to the
  lab's baseline, and no leftover anywhere in the lab;
- the memory line of a training run at two micro-batches has a fixed part of about the training state, 16 bytes a
  parameter (FP32 weights 4 + gradients 4 + AdamW m and v 8), the oracle being labutils' own count of the model and
  optimizer tensors (``RunResult.memory``), not a number from the notebook;
- on the pretend GPU the check reads the allocator (torch.cuda.memory_allocated): a leftover allocation is reported
  with its size, and the start of a section after its release equals the baseline.
"""
from __future__ import annotations

import json

import pytest
import torch

import labutils as lu
import labutils.labs.lab02.accumulation as acc
import labutils.labs.lab02.accumulation_sweeps as acs
from labutils.core.memory import memory_in_use
from labutils.estimator.estimate import parameter_count

from conftest import tiny_config

def test_gradient_copies_are_copies_on_the_cpu():
    """Breaks if grads_to_cpu hands back p.grad itself (``.float().cpu()`` of an FP32 CPU tensor is a no-op):
    then zero_grad frees nothing while the 'copies' are held."""
    model = torch.nn.Linear(256, 256)
    model(torch.randn(4, 256)).sum().backward()
    grads = acc.grads_to_cpu(model)
    assert all(g.data_ptr() != p.grad.data_ptr() for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


@pytest.fixture
def no_lab_baseline(monkeypatch):
    """The lab's baseline is the kernel's state (lu.setup() in a notebook): a test's own, gone after it."""
    import labutils.core.memory as mem

    monkeypatch.setattr(mem, "_BASELINE", {})
    monkeypatch.setattr(mem, "LEFTOVERS", [])
    return mem


def test_the_start_check_says_and_records_a_leftover_on_the_cpu(no_lab_baseline, capsys):
    """issue 46 §1: a measurement that cannot start at the lab's baseline returns by how much, and the lab's record
    keeps it (memory.LEFTOVERS, written by lu.record_results)."""
    base = lu.set_baseline("cpu")
    leftover = torch.zeros(2**20)                       # 4 MiB kept by a name
    assert lu.start_check("cpu", "section 4") == 4 * 2**20
    assert lu.start_check("cpu", "section 6") == 4 * 2**20
    assert capsys.readouterr().out == ""  # said only in the cell after a failed one (tests/test_interrupts.py)
    assert [(x["where"], x["bytes"], x["baseline_bytes"]) for x in no_lab_baseline.LEFTOVERS] == [
        ("section 4", 4 * 2**20, base), ("section 6", 4 * 2**20, base)]
    del leftover
    assert lu.start_check("cpu", "section 7") == 0 and capsys.readouterr().out == ""


def test_the_check_reads_the_allocator_on_the_pretend_gpu(monkeypatch, no_lab_baseline, capsys):
    """On CUDA the lab's baseline and its check at the start of section 4 are torch.cuda.memory_allocated: an
    allocation an earlier section did not free (GPT-2 small's FP32 weights, ~0.46 GiB) shows with its size; freed,
    the start of section 4 equals the baseline."""
    from tests import fake_cuda

    gpu = fake_cuda.install(monkeypatch)
    base = lu.set_baseline("cuda")
    assert base == torch.cuda.memory_allocated()
    addr = gpu.alloc(460 * 2**20)  # a model's weights left bound by a name (a 2 MiB multiple: torch rounds blocks)
    assert lu.start_check("cuda", "section 4") == 460 * 2**20 == no_lab_baseline.LEFTOVERS[-1]["bytes"]
    gpu.free(addr)
    assert lu.start_check("cuda", "section 4") == 0 and base == torch.cuda.memory_allocated()


@pytest.mark.regen_labs("02")
def test_sections_2_and_3_leave_nothing_in_the_notebooks_own_run():
    """The session's run of the real notebook (a kernel, as a student runs it; tests/regen_once.py): at the start of
    section 4, after the setup, the written-out loop and its check, section 2's proof, section 3's padding pitfall and
    the figure, the memory in use equals the lab's baseline, so every later peak starts where a clean kernel does; no
    check of the lab recorded a leftover (notes["leftovers"], memory.start_check). Breaks if a section leaves its
    model, dataset or gradient copies bound (before the fix: +12.8 MiB at section 4 and in every later peak)."""
    from tests import regen_once

    stem = "02-Gradient_Accumulation"
    run = regen_once.run_for(["02"])
    assert run.lab_ok(stem), run.lab_failure(stem)
    data = json.loads((run.out / f"{stem}.json").read_text(encoding="utf-8"))
    checks = {r["where"]: r["bytes_in_use"] for r in data["tables"]["baseline_checks"]}
    assert checks.get("section 4") == 0, checks
    assert all(v == 0 for v in checks.values()), checks  # and no leftover at all: tests/test_labs.py
    # issue 36: section 2 held the previous gradient copy while it measured the next peak (2 x 8 and 2 x 4 read
    # 2.09 MiB above 2 x 16). The accumulated windows differ only in a few token ids, so their peaks agree to well
    # under half of one gradient copy (FP32, 4 bytes a parameter)
    acc_peaks = [r["peak_memory_bytes"] for r in data["tables"]["equivalence"] if r["kind"] == "accumulated"]
    half_copy = 2 * parameter_count(data["tables"]["sweep"][0]["model"])
    assert len(acc_peaks) >= 2 and max(acc_peaks) - min(acc_peaks) < half_copy, acc_peaks


@pytest.mark.real_kernels
def test_the_fitted_fixed_memory_is_the_training_state():
    """Section 6's line peak = fixed + per sample x micro-batch, fitted to runs at two micro-batches: the fixed part
    is the training state, about 16 bytes a parameter (what labutils counts in the runs' model and optimizer),
    not 40 (the leftovers of earlier sections were in it). The data the run holds (a few hundred KiB of token ids)
    is in it too, hence the tolerance."""
    cfg = tiny_config(None, train__steps=2)
    # what this test process holds already (other tests' fixtures) is in every CPU peak: the lab measures from its
    # baseline, and so does this test
    base = memory_in_use("cpu")
    runs = {m: lu.run(cfg.override({"train.micro_batch_size": m, "train.accumulation_steps": 16 // m}),
                      device="cpu", verbose=False, progress=False) for m in (2, 4)}
    assert all(r.ok for r in runs.values())
    fixed, per_sample = acs.linear_fit(list(runs), [r.peak_memory_bytes - base for r in runs.values()])
    r = runs[2]
    n_params = parameter_count(cfg.model.name)
    state = 2 * r.memory["params"] + r.memory["optimizer"]
    assert state / n_params == pytest.approx(16, rel=0.01)
    assert per_sample > 0
    assert fixed == pytest.approx(state, rel=0.25), (fixed / n_params, state / n_params)


def test_cublas_workspaces_are_not_called_leftovers(monkeypatch, no_lab_baseline):
    """On the H200, lab 02 said "33.00 MiB more: left over from an earlier section": the cuBLAS workspaces torch
    allocates (through the caching allocator, counted as allocated) at the first matmul of the main thread and of
    autograd's thread. Breaks if the baseline line counts them as a leftover again (torch frees them with
    clearCublasWorkspaces, which the pretend driver implements as CublasHandlePool.cpp does)."""
    from tests import fake_cuda
    gpu = fake_cuda.install(monkeypatch, "h100")
    cuda = torch.device("cuda")
    baseline = lu.set_baseline(cuda)
    gpu.cublas_workspace("main")      # the first forward's matmul
    gpu.cublas_workspace("autograd")  # the first backward, on autograd's thread
    assert gpu.allocated == baseline + 2 * fake_cuda.cublas_workspace_bytes(9)
    assert lu.start_check(cuda, "section 4") == 0, no_lab_baseline.LEFTOVERS


def test_the_replay_of_the_notebook_loop_leaves_no_model_for_its_second_side(no_lab_baseline):
    """``acc.replay`` trains the same steps with lu.train, then with the notebook's loop. The names of its first
    ``with held_model(...) as (model, ...)`` outlived the block, so the second side's start check found the first
    side's model alive and recorded it as a leftover (2.3 MB, twice, in every clean run of lab 02)."""
    def step(model, optimizer, window, autocast, scaler=None, max_grad_norm=1.0):
        loss = sum(model(**mb, use_cache=False).loss for mb in window.micro_batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), 0.0

    lu.set_baseline("cpu")
    rep = acc.replay(tiny_config(None, train__steps=1), step, device="cpu")
    assert len(rep["notebook_losses"]) == len(rep["labutils_losses"]) == 1
    assert no_lab_baseline.LEFTOVERS == []


@pytest.mark.regen_labs("02")
def test_the_learning_rate_runs_train_past_their_warm_up():
    """issue 44 §1: in smoke the learning-rate table was all warm-up (8 warm-up steps of 8 at B=8, 2 of 2 at B=32), so
    every rule trained at the same ramped rates and "linear, no warm-up" tied the baseline. Each run now trains at
    least 2 optimizer steps at its full rate, the B=8 baseline over the same samples (steps x 4)."""
    from tests import regen_once

    stem = "02-Gradient_Accumulation"
    run = regen_once.run_for(["02"])
    assert run.lab_ok(stem), run.lab_failure(stem)
    rows = json.loads((run.out / f"{stem}.json").read_text(encoding="utf-8"))["tables"]["lr_scaling"]
    assert len(rows) == 5 and all(r["steps"] >= r["warmup_steps"] + 2 for r in rows), rows
    assert rows[0]["samples_seen"] == rows[1]["samples_seen"] and rows[-1]["warmup_steps"] == 0
