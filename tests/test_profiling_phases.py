"""Lab 04's snapshot with stacks="python": backward's allocations (autograd's own thread, no Python frames) are
attributed to the phase of the step they happened in, not lumped into one "(no stack)" row.

The traces come from the pretend GPU's allocator (tests/fake_cuda.py records alloc/free entries the way
``torch.cuda.memory._snapshot()`` lays them out: ``action``, ``addr``, ``size``, ``frames``, ``time_us``); the
markers use the snapshot's clock."""
from __future__ import annotations

import pytest

import fake_cuda
from labutils.core import device as dev
from labutils.labs.lab04.profiling import PhaseMarks, trace_summary

MiB = 2**20
MODEL_FRAME = [{"filename": "/home/student/lab/model.py", "line": 12, "name": "forward"}]
OPTIM_FRAME = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 40, "name": "step"}]


def one_step(gpu, mark):
    """A step's allocations as a real one makes them: forward from Python, backward from autograd's thread (no
    frames, with stacks="python"), the optimizer from Python again but also frameless (fused kernels)."""
    mark("before forward")
    act = gpu.alloc(64 * MiB, MODEL_FRAME)                 # activations, saved for backward
    mark("after forward")
    grads = [gpu.alloc(32 * MiB, []) for _ in range(2)]    # gradients: autograd thread, no frames
    gpu.free(act)
    mark("after backward")
    state = gpu.alloc(8 * MiB, [])                         # optimizer temporaries without frames
    gpu.free(state)
    mark("after optimizer step")
    return grads


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(dev, "_state", {})
    return fake_cuda.install(monkeypatch, "rtx3070-8gb")


def test_frameless_allocations_are_named_by_their_phase(gpu):
    """Breaks if backward's allocations are one '(no stack)' row, or if the optimizer's frameless ones are
    charged to backward: the phases must come from where the step was when they were allocated."""
    assert dev.record_history(True, stacks="python")
    marks = PhaseMarks(clock=lambda: len(gpu.trace))   # the pretend allocator's clock: one tick per event
    one_step(gpu, marks)
    summary = trace_summary(dev.snapshot(), phases=marks.phases)
    allocated = {r["site"]: r["bytes"] for r in summary["top_allocated"]}
    assert allocated["backward (no Python frames)"] == 64 * MiB
    assert allocated["optimizer step (no Python frames)"] == 8 * MiB
    assert allocated["lab/model.py:12 (forward)"] == 64 * MiB
    at_peak = {r["site"] for r in summary["top_at_peak"]}
    assert "backward (no Python frames)" in at_peak
    # without markers: the old single label, for every frameless allocation
    plain = {r["site"] for r in trace_summary(dev.snapshot())["top_allocated"]}
    assert plain == {"backward (autograd thread: no Python frames)", "lab/model.py:12 (forward)"}


def test_markers_use_the_snapshots_clock():
    """A CUDA snapshot's time_us is Unix time in microseconds (c10/cuda/CUDACachingAllocator.cpp converts the TSC
    clock to "epoch time in microseconds"): the default marker clock must be that one."""
    import time

    marks = PhaseMarks()
    marks("after forward")
    (when, label), = marks.phases
    assert label == "backward" and abs(when - time.time() * 1e6) < 5e6


def test_operator_table_leaves_the_ranges_out():
    """The first GPU run's lab 04 "top operators" table was headed by `forward` (a record_function span, 570 % of the
    device time). Breaks if a range the step opened stays among the operators, or an operator is dropped."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from labutils.labs.lab04.profiling import operators_only

    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("forward"):
            loss = model(x).sum()
        with record_function("backward"):
            loss.backward()
    keys = {e.key for e in operators_only(prof.key_averages())}
    assert not keys & {"forward", "backward"}
    assert {e.key for e in prof.key_averages() if e.key.startswith("aten::")} <= keys and "aten::addmm" in keys
    assert "aten::addmm" in operators_only(prof.key_averages()).table(sort_by="self_cpu_time_total", row_limit=50)


def test_operator_table_keeps_the_memory_columns():
    """Issue 36: lab 04's "top operators by self cpu memory" table had no memory column: operators_only rebuilt the
    event list without the profile's profile_memory flag. Oracle: torch's own table of the same profile, whose
    memory columns ("Self CPU Mem") are there before the ranges are filtered out."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from labutils.labs.lab04.profiling import operators_only, profiler_op_rows

    model, x = torch.nn.Linear(64, 64), torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("forward"):
            loss = model(x).sum()
        loss.backward()
    assert "Self CPU Mem" in prof.key_averages().table(row_limit=5)
    assert "Self CPU Mem" in operators_only(prof.key_averages()).table(sort_by="self_cpu_memory_usage", row_limit=5)
    rows = {r["op"]: r for r in profiler_op_rows(prof.key_averages(), 1, on_gpu=False)}
    assert "forward" not in rows and rows["aten::addmm"]["self memory (MiB)"] * 2**20 >= 32 * 64 * 4   # its output
