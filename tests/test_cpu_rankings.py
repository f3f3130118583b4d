"""Lab 03's orders by step time say only what their run can support (issue 24, item 1: no speed verdict from CPU
timing; a sentence's wording follows its own numbers).

The functions under test are the lab's real ones (labutils.labs.lab03.checkpoint_report: ranking_label,
recommendation); their inputs are Measured records wrapping RunResult data whose step
times and peaks are set here, so which run is fastest, which fits and how noisy the timing is are known from the
fixture, not recomputed from the code under test."""
from __future__ import annotations

import labutils.labs.lab03.checkpoint_measure as cm
import labutils.labs.lab03.checkpoint_report as cr
from labutils.verdicts import claims as cl
from labutils.core.train import RunResult

BUDGET = 800


def _m(variant, device, step_s, peak, *, kind="every_n", k=None, steps=None, jitter=0.0, recompute=(0.0, 0)):
    """A finished run: one warm-up step, then ``steps`` timed steps around ``step_s`` (alternating +-jitter); what it
    recomputes, counted: (extra FLOPs %, blocks re-run)."""
    steps = cl.MIN_TIMED_STEPS + 2 if steps is None else steps
    times = [step_s * 3] + [step_s * (1 + (jitter if i % 2 else -jitter)) for i in range(steps)]
    env = {"device": "cuda", "gpu_name": "NVIDIA Fixture GPU"} if device == "cuda" else {"device": "cpu"}
    res = RunResult(config={"train": {"timing_warmup_steps": 1, "precision": "fp32", "micro_batch_size": 4}},
                    env=env, step_times=times, peak_memory_bytes=peak, step_time_seconds=sum(times[1:]) / steps)
    return cm.Measured(variant, kind, k, res, info=dict(zip(("extra_flops_pct", "recomputed_blocks"), recompute)))


def _front(device, **kw):
    runs = [_m("no checkpointing", device, 1.0, 1000, kind="baseline", **kw),
            _m("every_n 2", device, 1.1, 700, k=2, recompute=(16.0, 2), **kw),
            _m("full", device, 1.3, 500, k=1, recompute=(32.0, 4), **kw)]
    return cr.pareto_front(runs, device)


def test_cpu_order_is_labelled_cpu_time_not_a_gpu_ranking():
    """Before the fix lab 03 printed "Pareto front (fastest first)" and "the first row whose peak fits your budget
    is the fastest option" from CPU step times. Breaks if, on device "cpu", the front or the recommendation is
    presented as a ranking by speed instead of CPU time that is not judged."""
    front = _front("cpu")
    label = cr.ranking_label(front, "cpu")
    assert label == cr.CPU_ORDER and "recomputed FLOPs" in label and "not a GPU ranking" in label
    assert "not judged (CPU timing)" in label and "fastest" not in label
    # what it does say is memory: the two runs whose peak (700, 500) is within 800 bytes, not the 1000-byte one
    rec = cr.recommendation(front, _m("no checkpointing", "cpu", 1.0, 1000, kind="baseline"), BUDGET)
    assert [(r["use"], r["fits_this_budget"]) for r in rec[:3]] == [("no checkpointing", False), ("every_n 2", True),
                                                                    ("full", True)]


def test_cpu_front_is_read_from_recomputed_work_never_cpu_time():
    """Issue 44 §1: on a CPU the front was ordered by step time, so CPU noise (a checkpointed run timed faster than
    the baseline, offload faster than no offload) decided what the lab recommended. Breaks if, on device "cpu", a run
    whose CPU step time happens to be the shortest jumps ahead of one that recomputes less, or if selective
    checkpointing (no matmul recomputed, its blocks re-run) is not placed after the baseline and before full."""
    base = _m("no checkpointing", "cpu", 1.0, 1000, kind="baseline")
    runs = [base, _m("full", "cpu", 0.5, 500, k=1, recompute=(32.0, 4)),  # timed fastest: noise
            _m("selective", "cpu", 2.0, 700, kind="selective", k=1, recompute=(0.0, 4)),
            _m("offload", "cpu", 0.4, 1000, kind="offload")]
    assert [m.variant for m in cr.pareto_front(runs, "cpu")] == ["no checkpointing", "selective", "full"]
    assert [m.variant for m in cr.pareto_front(runs, "cuda")][0] == "offload"  # a GPU's time is what it measured


def test_gpu_order_is_a_measured_ranking_and_picks_the_first_fitting_row():
    """On a GPU with enough quiet timed steps the front is a ranking and the pick is the first (fastest) row that
    fits. Breaks if the GPU wording is lost, a caveat appears without noise, or the pick is not 'every_n 2' (the
    faster of the two runs that fit in the fixture)."""
    front = _front("cuda")
    assert cr.ranking_label(front, "cuda") == "fastest first, by measured GPU step time"  # nothing left undecided
    assert [m.variant for m in front if m.peak <= BUDGET][0] == "every_n 2"


def test_gpu_order_names_the_pairs_that_noise_or_too_few_steps_leave_open():
    """Breaks if a GPU ranking whose neighbours differ by less than their timing noise (+-30 % jitter against a
    10 % gap), or that rests on fewer than MIN_TIMED_STEPS timed steps, is printed without saying so."""
    noisy = cr.ranking_label(_front("cuda", jitter=0.3), "cuda")
    assert "order not decided for no checkpointing vs every_n 2 (noise" in noisy
    few = cr.ranking_label(_front("cuda", steps=3), "cuda")
    assert f"3 timed step(s), fewer than {cl.MIN_TIMED_STEPS}" in few
