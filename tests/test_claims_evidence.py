"""A verdict is only as strong as its evidence (issue 24, item 1): speed is never judged from CPU timing or from a
handful of timed steps, noise as large as the effect is "not decided", C1 is judged over a batch sweep, C5 only on
models of >= 8 layers and it can fail, and lab 03 never ranks an option that does nothing on this hardware.

The claim builders under test are the labs' real ones (labutils.labs.lab01.amp_speed_memory, labutils.labs.lab03.checkpoint_report);
their inputs are RunResult / Measured records (plain data) or, for C5's physics, peak memory measured by torch's
own storage counting (cm.peak_during) on chains built here."""
from __future__ import annotations

import math
import re
import statistics

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import labutils.labs.lab01.amp_speed_memory as am
import labutils.labs.lab03.checkpoint_measure as cm
import labutils.labs.lab03.checkpoint_report as cr
from labutils.verdicts import claims as cl
from labutils.core.config import load_config
from labutils.core.train import RunResult

CPU_ENV = {"device": "cpu", "cpu": "test cpu"}
GPU_ENV = {"device": "cuda", "gpu_name": "NVIDIA Fixture GPU"}
SMOKE = cl.conditions(model="tiny", batch="4 x 1", sequence=64, precision="fp16 vs fp32", hardware="cpu",
                      mode="smoke")
FULL = cl.conditions(model="gpt2", batch="8 x 1", sequence=512, precision="fp16 vs fp32",
                     hardware="NVIDIA Fixture GPU", mode="full")


def _run(env, step_s, peak, *, steps=4, warmup=1, precision="fp32", micro_batch=4, jitter=0.0):
    """A finished run's record: ``steps`` step times around ``step_s`` (alternating +-jitter), ``peak`` bytes."""
    times = [step_s * 3] * warmup + [step_s * (1 + (jitter if i % 2 else -jitter)) for i in range(steps - warmup)]
    return RunResult(config={"train": {"timing_warmup_steps": warmup, "precision": precision,
                                       "micro_batch_size": micro_batch}},
                     env=dict(env), step_times=times, peak_memory_bytes=peak,
                     step_time_seconds=sum(times[warmup:]) / (steps - warmup))


def _runs(env, *, steps=4, jitter=0.0, fp16_step=0.5):
    return {"fp32": _run(env, 1.0, 1000, steps=steps, jitter=jitter),
            "fp16": _run(env, fp16_step, 600, steps=steps, jitter=jitter, precision="fp16")}


SWEEP_ROWS = [{"micro_batch": 1, "memory_saving": 0.45}, {"micro_batch": 4, "memory_saving": 0.5}]


# ------------------------------------------------------------------------------------------------ speed claims
@pytest.mark.parametrize("cid, q", sorted(cl.SPEED_QUANTITIES))
def test_no_speed_quantity_is_judged_from_cpu_timing_however_many_steps(cid, q):
    """Breaks if any claim's time part (C2, C3 time, C4 time, C6 slowdown) takes a verdict from CPU timing, even
    with many quiet timed steps: CPU timing says nothing about GPU speed."""
    claim = cl.CLAIMS[cid]
    values = {x.name: (2.5 if x.unit == "x" else 0.01) for x in claim.quantities}
    ev = cl.Evidence(timed_steps=100, spread=0.0, sweep={1: 0.6, 2: 0.6}, layers=64, micro_batches=(4, 4))
    e = cl.claim_entry(cid, values, SMOKE, evidence=ev)
    assert e["parts"][q]["verdict"] == cl.NOT_JUDGED, e["why"]
    assert "timed on a CPU" in e["parts"][q]["why"]
    row = cl.table_rows([e])[0]
    assert "CPU timing, not judged" in row["measured"]
    # the same numbers on a GPU with >= 10 quiet timed steps are judged: the check is on the evidence, not the number
    gpu = cl.claim_entry(cid, values, FULL, evidence=ev)
    assert gpu["parts"][q]["verdict"] in cl.JUDGED, gpu["why"]


def test_lab01_c2_in_smoke_is_not_judged_and_shows_the_cpu_ratio():
    """Lab 01's own builder on CPU runs: C2 'not judged', the measured CPU speed-up shown and labelled as CPU.
    Breaks if C2 is judged from CPU fp16 (an emulation), as it was before issue 24."""
    c1, c2 = am.c1_c2_claims(_runs(CPU_ENV, fp16_step=1.25), SMOKE, amp="fp16", sweep_rows=SWEEP_ROWS)
    assert c2["verdict"] == cl.NOT_JUDGED
    assert "0.80x on CPU" in c2["why"] and "timed on a CPU" in c2["parts"]["speedup"]["why"]
    assert c2["compares"] == {"speedup": "fp32 vs fp16"}
    assert c2["measured"]["speedup"]["value"] == pytest.approx(0.8)
    assert cl.table_rows([c2])[0]["measured"].startswith("speed-up 0.80x (CPU timing, not judged)")
    assert c1["verdict"] == cl.NOT_JUDGED  # smoke: the tiny model's state dominates its peak (issue 27)
    assert "tiny model" in c1["why"] and c1["measured"]["memory_saving"]["value"] is not None


def test_lab01_c2_on_a_gpu_needs_ten_timed_steps_and_a_quiet_timing():
    """Breaks if a GPU speed-up is judged from 3 timed steps, or if noise larger than the effect still gives a
    verdict ('not decided (noise +-x %)' instead)."""
    few = am.c1_c2_claims(_runs(GPU_ENV, steps=4), FULL, amp="fp16", sweep_rows=SWEEP_ROWS)[1]
    assert few["verdict"] == cl.NOT_JUDGED and "only 3 timed steps" in few["why"]
    enough = am.c1_c2_claims(_runs(GPU_ENV, steps=14), FULL, amp="fp16", sweep_rows=SWEEP_ROWS)[1]
    assert enough["verdict"] == cl.HOLDS and enough["evidence"]["speedup"]["timed_steps"] == 13
    # 1.05x measured with +-30 % jitter on each run: the noise swamps a 5 % effect
    noisy = am.c1_c2_claims(_runs(GPU_ENV, steps=14, jitter=0.3, fp16_step=1 / 1.05), FULL, amp="fp16",
                            sweep_rows=SWEEP_ROWS)[1]
    assert noisy["verdict"] == cl.NOT_DECIDED and "not decided (noise +-" in noisy["why"]


def test_timed_ratio_reports_median_and_spread():
    """Median, not mean: one slow outlier step must not move the ratio. Breaks if the mean is used."""
    t = cl.timed_ratio([1.0] * 9 + [10.0], [2.0] * 10)
    assert t["ratio"] == pytest.approx(2.0) and t["timed_steps"] == 10 and t["spread"] == pytest.approx(0.0)


# ------------------------------------------------------------------------------------------------ C1 over a sweep
def test_c1_is_judged_over_the_batch_sweep_not_one_batch():
    """Breaks if C1 takes a verdict from one batch size, or if a sweep whose points disagree says 'holds'."""
    one = cl.claim_entry("C1", {"memory_saving": 0.5}, FULL, evidence=cl.Evidence(sweep={4: 0.5}))
    assert one["verdict"] == cl.NOT_JUDGED and "one batch size" in one["why"]
    mixed = cl.claim_entry("C1", {"memory_saving": 0.3}, FULL, evidence=cl.Evidence(sweep={1: 0.05, 8: 0.45}))
    assert mixed["verdict"] == cl.PARTLY and "5 % at 1" in mixed["why"] and "45 % at 8" in mixed["why"]
    c1 = am.c1_c2_claims(_runs(CPU_ENV), FULL, amp="bf16",
                         sweep_rows=[{"micro_batch": 1, "memory_saving": 0.1}, {"micro_batch": 8, "memory_saving": 0.15}])[0]
    assert c1["verdict"] == cl.DOES_NOT_HOLD and c1["evidence"]["memory_saving"]["sweep"] == {"1": 0.1, "8": 0.15}


def test_c1_and_c2_conditions_name_the_pair_and_batches_each_compares():
    """The first GPU run (H200) recorded C1 under "precision: fp16 vs fp32, batch 8 x 1" while it compared bf16 with
    fp32 over micro-batches 1 and 8. Breaks if a claim's conditions name another pair or batch than its compares."""
    sweep = [{"micro_batch": 1, "memory_saving": 0.06}, {"micro_batch": 8, "memory_saving": 0.05}]
    c1, c2 = am.c1_c2_claims(_runs(GPU_ENV, steps=14), FULL, amp="bf16", sweep_rows=sweep)
    assert c1["conditions"]["precision"] == "bf16 vs fp32" and "bf16" in c1["compares"]["memory_saving"]
    assert c1["conditions"]["batch"] == "1 x 1 / 8 x 1"
    assert c2["conditions"]["precision"] == "fp16 vs fp32" and c2["compares"]["speedup"] == "fp32 vs fp16"
    assert c2["conditions"]["batch"] == "8 x 1"
    assert cl.table_rows([c1])[0]["conditions"].count("bf16 vs fp32") == 1


def test_c1_shows_the_saving_of_a_micro_batch_the_sweep_has_and_names_it():
    """Issue 44: C1 showed the sweep's median (11 %, at no micro-batch) and its reason cited micro-batch 4, which the
    sweep (1 and 8) had not. Breaks if C1's value is not the sweep's at section 4's micro-batch (4 here), or, where
    the sweep lacks it, at the sweep's largest, with that micro-batch named in the why and its FP32 peak's share."""
    runs = _runs(CPU_ENV)  # section 4's pair at micro-batch 4, peaks 1000 and 600
    _, sweep = am.batch_sweep({}, {}, runs, "cpu", "fp16")  # section 4's pair is a point of the sweep, not run again
    assert [(r["micro_batch"], r["section_4_pair"], r["memory_saving"]) for r in sweep] == [(4, True,
                                                                                             pytest.approx(0.4))]
    sweep = [{"micro_batch": 1, "memory_saving": 0.05, "fp32_peak_bytes": 500}, *sweep,
             {"micro_batch": 8, "memory_saving": 0.5, "fp32_peak_bytes": 2000}]
    c1 = am.c1_c2_claims(runs, SMOKE, amp="fp16", sweep_rows=sweep, model_state=300)[0]
    assert c1["measured"]["memory_saving"]["value"] == pytest.approx(0.4) and c1["extra"]["shown_at_micro_batch"] == 4
    assert "micro-batch 4 of the sweep, where FP32 weights" in c1["why"] and "are 30% of the FP32 peak" in c1["why"]
    c1 = am.c1_c2_claims(runs, SMOKE, amp="fp16", sweep_rows=[sweep[0], sweep[2]], model_state=300)[0]
    assert c1["measured"]["memory_saving"]["value"] == 0.5 and c1["extra"]["shown_at_micro_batch"] == 8
    assert "micro-batch 8 of the sweep" in c1["why"] and "micro-batch 4" not in c1["why"], c1["why"]


# ------------------------------------------------------------------------------------------------ lab 03: C4
def _measured(name, env, step_s, peak, steps=4):
    return cm.Measured(name, "baseline" if name.startswith("no") else "every_n", None,
                       _run(env, step_s, peak, steps=steps))


def _info(device="cpu"):
    return {"gpu_name": "NVIDIA Fixture GPU" if device == "cuda" else None, "device": torch.device(device),
            "mode": "smoke" if device == "cpu" else "full", "gpu": None}


def test_c4_time_is_not_judged_on_cpu_and_its_reason_cites_the_flops_of_the_model_measured():
    """Breaks if C4's time overhead enters the verdict on CPU, or its reason cites a FLOP overhead other than
    the one passed for the model as trained (with its dropout)."""
    cfg = load_config("configs/lab03_checkpointing.yaml", mode="smoke")
    pair = [_measured("no checkpointing", CPU_ENV, 1.0, 1000), _measured("checkpointing", CPU_ENV, 1.88, 600)]
    e = cr.claim_c4(cfg, _info(), pair=pair, b0=4, b1=8, budget=900, state_bytes=200,
                    flops_ratio=1.309, hw="CPU", dropout=0.1)
    assert e["parts"]["memory_saving"]["verdict"] == cl.NOT_JUDGED   # smoke: the tiny model (issue 27)
    assert e["parts"]["time_overhead"]["verdict"] == cl.NOT_JUDGED
    assert e["verdict"] == cl.NOT_JUDGED
    assert "+31% FLOPs on the model measured (dropout 0.1)" in e["why"]
    assert "step-time overhead +88 % on CPU" in e["why"] and "is only shown" in e["why"]
    assert "+88 % on CPU (shown, not judged)" in e["parts"]["time_overhead"]["why"] and "the step +88% time" not in e["why"]
    assert set(e["compares"]) == {"memory_saving", "time_overhead"}


# ------------------------------------------------------------------------------------------------ lab 03: C5
def _chain_best_k(n_layers, widen, ks):
    """Measured best segment length of a chain of ``n_layers`` layers, each of which saves a tensor ``widen``
    times its input (widen=1: Chen's equal-sized layers). Peak memory by torch's storage counting (CPU)."""
    def layer(x):
        return torch.sin(x.repeat(1, widen)).view(x.shape[0], widen, x.shape[1]).sum(1)

    def run(h, a, b):
        for _ in range(a, b):
            h = layer(h)
        return h

    def peak(k):
        x = torch.randn(8, 64, requires_grad=True)

        def step():
            h = x
            for s in range(0, n_layers, k):
                h = checkpoint(run, h, s, min(s + k, n_layers), use_reentrant=False)
            h.sum().backward()
        return cm.peak_during(step, "cpu")

    peaks = {k: peak(k) for k in ks}
    return min(peaks, key=peaks.get)


KS64 = [1, 2, 4, 8, 16, 32, 64]


def _c5(k_chain, chain_layers, k_seg, n_blocks):
    cfg = load_config("configs/lab03_checkpointing.yaml", mode="smoke")
    return cr.claim_c5(cfg, _info(), k_chain=k_chain, chain_layers=chain_layers, k_seg=k_seg, n_blocks=n_blocks,
                       gpt2_model="test model")


def test_c5_holds_on_equal_layers_and_does_not_hold_on_a_chain_built_to_violate_it():
    """The check can fail: a 64-layer chain whose layers each save 64x their input is best at k = 1 (1/8 of
    sqrt L), so C5 does not hold; the same measurement on equal-sized layers finds k ~ sqrt L and holds. Breaks if
    the C5 rule, its thresholds or claim_c5's arithmetic cannot tell the two apart."""
    k_equal = _chain_best_k(64, 1, KS64)
    k_wide = _chain_best_k(64, 64, KS64)
    assert k_wide == 1 and 4 <= k_equal <= 16
    good = _c5(k_equal, 64, k_equal, 64)
    bad = _c5(k_wide, 64, k_wide, 64)
    assert good["verdict"] == cl.HOLDS, good["why"]
    assert bad["verdict"] == cl.DOES_NOT_HOLD, bad["why"]
    assert f"is best at k = {k_wide} (sqrt(L) = 8.0)" in bad["why"] and "within the claimed" not in bad["why"]
    # a wrong segment rule (no checkpointing: one segment of all L layers) does not hold either
    assert _c5(64, 64, 64, 64)["verdict"] == cl.DOES_NOT_HOLD


def test_c5_records_the_layers_of_every_model_and_does_not_judge_a_shallow_one():
    """At L = 2 both possible segment lengths are within 0.5-2 sqrt(L): that half cannot fail and must not be
    judged. Breaks if the 2-block GPT-2 half is judged, or a judged model's layer count is not recorded."""
    e = _c5(8, 64, 1, 2)
    assert e["parts"]["gpt2_optimum_over_sqrt_L"]["verdict"] == cl.NOT_JUDGED
    assert "2 layers, too few" in e["why"]
    assert e["conditions"]["layers"] == {"chain of equal layers": 64, "test model": 2}
    judged = [n for n, p in e["parts"].items() if p["verdict"] in cl.JUDGED]
    assert judged == ["chain_optimum_over_sqrt_L"]
    assert all(e["evidence"][n]["layers"] >= cl.MIN_LAYERS for n in judged)
    deep = _c5(8, 64, 1, 16)
    assert all(p["verdict"] in cl.JUDGED for p in deep["parts"].values())
    assert all(v >= cl.MIN_LAYERS for v in deep["conditions"]["layers"].values())
    assert "16 layers" in cl.table_rows([deep])[0]["conditions"]


def test_c5_why_never_contradicts_its_verdict():
    """Before issue 24 the why said 'not sqrt(L)' while the verdict said 'holds'. The lab's own clause now states the
    measured optima only (no verdict words of its own); the verdict's words come from the claims rule. Breaks if the
    clause judges, or the why's words disagree with the verdict."""
    for k, L in [(1, 16), (2, 16), (4, 16), (8, 16), (16, 16)]:
        e = _c5(8, 64, k, L)
        v = e["parts"]["gpt2_optimum_over_sqrt_L"]["verdict"]
        assert f"test model (16 blocks) at k = {k} (sqrt(L) = 4.0)" in e["why"], (k, e["why"])
        assert not re.search(r"within \dx|more than \dx|away from", e["why"]), e["why"]
        clause = e["parts"]["gpt2_optimum_over_sqrt_L"]["why"]
        assert ("within the claimed" in clause) == (v == cl.HOLDS), (k, v, clause)


# ------------------------------------------------------------------------------------------------ lab 03: Pareto
def test_cpu_offload_is_never_ranked_on_a_cpu():
    """CPU offload on a CPU moves host memory to host memory: shown, never ranked nor recommended. Breaks if the
    Pareto front (and so the recommendation) includes it on a CPU; on a GPU it is a real option and is ranked."""
    counted = lambda flops, blocks: {"extra_flops_pct": flops, "recomputed_blocks": blocks}  # noqa: E731 (a CPU's cost)
    base = cm.Measured("no checkpointing", "baseline", None, _run(CPU_ENV, 1.0, 1000), info=counted(0.0, 0))
    full = cm.Measured("full", "every_n", 1, _run(CPU_ENV, 1.3, 600), info=counted(32.0, 4))
    offl = cm.Measured("offload", "offload", None, _run(CPU_ENV, 0.9, 500), info=counted(0.0, 0))  # smallest
    assert offl not in cr.pareto_front([base, full, offl], "cpu")
    assert [m.variant for m in cr.pareto_front([base, full, offl], "cpu")] == ["no checkpointing", "full"]
    rec = cr.recommendation(cr.pareto_front([base, full, offl], "cpu"), base, 800)
    assert all("offload" not in str(r["use"]) for r in rec)
    assert offl in cr.pareto_front([base, full, offl], "cuda")


def test_lab03_step_time_reason_follows_its_numbers_and_flags_cpu_time():
    """Section 7's spec table compared CPU time with the course as if it meant something, and its reason did not
    follow the measured sign. Breaks if CPU time is interpreted, or the GPU reason says "below" the FLOP overhead
    for a step that cost more than it (or the other way round), or calls a negative overhead anything but noise."""
    cfg = load_config("configs/lab03_checkpointing.yaml", mode="smoke")
    off, on = _measured("no checkpointing", CPU_ENV, 1.0, 1000), _measured("checkpointing", CPU_ENV, 1.2, 700)
    kw = dict(off=off, on=on, saving=0.3, flops_ratio=1.3, block_ratio=38, k_seg=1, k_star=0.2, state_bytes=200)

    def why(overhead, device):
        rows = cr.spec_check(cfg, _info(device), overhead=overhead, **kw)
        return next(r["why"] for r in rows if r["quantity"].startswith("step time"))
    assert why(0.2, "cpu") == "not judged (CPU timing)"
    assert why(0.2, "cuda").startswith("below the +30% FLOPs")
    assert why(0.5, "cuda").startswith("above the +30% FLOPs")
    assert why(-0.05, "cuda").startswith("negative: timing noise")


def test_timed_step_times_are_the_steps_the_loop_timed(tmp_path):
    """The claims read the steps the training loop itself timed (RunResult.timed_steps), not a count of their own:
    with torch.compile the compiling step is never timed, and a run whose steps are all warm-up has no timed step
    (the old rule handed the last warm-up step to the verdict). Oracle: a real run of the loop on the CPU."""
    from conftest import tiny_config

    import labutils as lu

    r = lu.run(tiny_config(train__steps=3, train__timing_warmup_steps=1), "cpu", progress=False, verbose=False)
    n = r.timed_steps  # on the CPU the memory-tracked steps are left out too, when a step remains
    assert n >= 1 and cl.timed_step_times(r) == r.step_times[-n:]
    assert statistics.median(cl.timed_step_times(r)) == pytest.approx(r.step_time_seconds)
    none = lu.run(tiny_config(train__steps=2, train__timing_warmup_steps=2), "cpu", progress=False, verbose=False)
    assert none.timed_steps == 0 and none.step_time_seconds is None and cl.timed_step_times(none) == []
    # a compiled run: step 1 compiled again (the loop saw dynamo's graph counter move), so only step 2 is timed
    compiled = RunResult(config={"train": {"timing_warmup_steps": 1}}, env={}, step_times=[9.0, 5.0, 0.1],
                         timed_steps=1, step_time_seconds=0.1)
    assert cl.timed_step_times(compiled) == [0.1]


def test_c4_headline_is_the_batch_it_buys_and_its_numbers_are_the_pairs():
    """Issue 27: C4 leads with what checkpointing buys (the largest micro-batch within the budget, b0 -> b1), and its
    saving and overhead are the pair's own numbers (the ratio of the median timed steps that the tables show), judged
    in full mode. Breaks if the headline sits only in 'extra' or the overhead comes from other runs."""
    cfg = load_config("configs/lab03_checkpointing.yaml", mode="full")
    pair = [_measured("no checkpointing", GPU_ENV, 1.0, 1000, steps=14),
            _measured("checkpointing", GPU_ENV, 1.25, 600, steps=14)]
    e = cr.claim_c4(cfg, _info("cuda"), pair=pair, b0=1, b1=6, budget=8 * 2**30, state_bytes=200,
                    flops_ratio=1.31, hw="NVIDIA Fixture GPU", dropout=0.1)
    assert e["why"].startswith("What it buys: within 8.00 GiB the largest micro-batch is 1 without checkpointing and 6")
    assert e["extra"]["largest_micro_batch_within_budget"] == {"no checkpointing": 1, "checkpointing": 6}
    assert e["measured"]["memory_saving"]["value"] == pytest.approx(0.4)
    assert e["measured"]["time_overhead"]["value"] == pytest.approx(pair[1].step_time / pair[0].step_time - 1)
    assert e["verdict"] == cl.HOLDS, e["why"]


def test_a_host_bound_gpu_step_takes_no_speed_verdict():
    """The first GPU run (GPT-2 small, 8 x 256, H200): the profiled bf16 step's kernels took 16.5 ms of its 38.1 ms
    median step, so the host (Python, launches) set the pace and the course table said "speed: does not hold".
    Breaks if a host-bound speed-up is judged, or if a GPU-bound one (94 %) is no longer judged."""
    prof = am.OpProfile("GPU kernel time", True, 2, [{"op": "aten::mm", "group": "matmul", "ms": 16.5}])
    busy = am.gpu_busy(prof, 0.0381)
    assert busy == pytest.approx(0.433, abs=1e-3)
    assert am.gpu_busy(am.OpProfile("CPU time", False, 2, prof.ops), 0.0381) is None  # CPU: not known
    runs = _runs(GPU_ENV, steps=14, fp16_step=1 / 1.26)
    c2 = am.c1_c2_claims(runs, FULL, amp="fp16", sweep_rows=SWEEP_ROWS, gpu_busy=busy)[1]
    assert c2["verdict"] == cl.NOT_JUDGED and "filled only 43%" in c2["why"] and "1.26x" in c2["why"]
    assert c2["evidence"]["speedup"]["gpu_busy"] == busy
    row = am.course_rows(runs, am.speedup_rows(runs), {"fp32": (8.0, 1.0), "fp16": (4.5, 2.2)}, gpu_busy=busy)[1]
    assert row["speed_verdict"] == cl.NOT_JUDGED
    bound = am.c1_c2_claims(runs, FULL, amp="fp16", sweep_rows=SWEEP_ROWS, gpu_busy=0.94)[1]
    assert bound["verdict"] == cl.DOES_NOT_HOLD  # 1.26x, judged: the GPU set the pace


def test_a_memory_saving_the_state_leaves_no_room_for_is_not_judged():
    """The first GPU run (GPT-2 medium, fp32, micro-batch 1 within an 8 GB card's budget): the FP32 state was 92 % of
    the baseline peak, so checkpointing "saved 0 %" and C4 said "does not hold" on a run that could not have shown
    30 %. Breaks if such a saving is judged, or if one with room (C1's 40 % state share on the H200) is not."""
    c4_mem = cl.CLAIMS["C4"].quantities[0]
    stuck = cl.Evidence(pair=("no checkpointing, micro-batch 1", "checkpointing, micro-batch 1"),
                        hardware="NVIDIA H200", mode="full", model="gpt2-medium", state_share=0.92)
    verdict, why = cl.judge_quantity(c4_mem, 0.0, stuck)
    assert verdict == cl.NOT_JUDGED and "92%" in why and "at most 8%" in why
    roomy = cl.Evidence(pair=stuck.pair, hardware="NVIDIA H200", mode="full", model="gpt2-medium", state_share=0.40)
    assert cl.judge_quantity(c4_mem, 0.0, roomy)[0] == cl.DOES_NOT_HOLD
    assert cl.judge_quantity(c4_mem, 0.35, roomy)[0] == cl.HOLDS


def test_a_noise_range_across_a_verdict_bound_is_not_decided():
    """The H200 run's C4 time overhead, +70 % +-30 %, spans 'partly' (<= +60 %) and 'does not hold' and was called
    'does not hold'. Breaks if a value whose noise range crosses a bound of the claim takes a verdict, or if one whose
    range stays inside a band (+70 % +-5 %) does not."""
    time_q = cl.CLAIMS["C4"].quantities[1]
    ev = cl.Evidence(pair=("no checkpointing", "checkpointing"), hardware="NVIDIA H200", timed_steps=10,
                     spread=0.30, mode="full", model="gpt2-medium")
    verdict, why = cl.judge_quantity(time_q, 0.70, ev)
    assert verdict == cl.NOT_DECIDED and "+40 % to +100 %" in why
    tight = cl.Evidence(pair=ev.pair, hardware=ev.hardware, timed_steps=10, spread=0.05, mode="full",
                        model="gpt2-medium")
    assert cl.judge_quantity(time_q, 0.70, tight)[0] == cl.DOES_NOT_HOLD


def test_lab03_baseline_oom_names_the_emulated_cards_budget(monkeypatch):
    """A GPU-only branch (the baseline runs out of memory at the config's batch): the H200 run said "OOM on NVIDIA
    H200" and "did not fit on this device" of a 140 GiB card capped to an 8 GB card's share. Breaks if either
    text names the device again, or if the branch fails (CI's smoke baseline always fits, so only this test runs it)."""
    from types import SimpleNamespace

    import labutils.core.device as dev

    monkeypatch.setattr(dev, "current_budget", lambda: {"card_gib": 8.0})
    cfg = load_config("configs/lab03_checkpointing.yaml", mode="full")
    off = SimpleNamespace(ok=False, peak=None)
    on = _measured("checkpointing", GPU_ENV, 1.2, 700)
    info = _info("cuda")
    rows = cr.spec_check(cfg, info, off=off, on=on, saving=None, overhead=None, flops_ratio=1.3, block_ratio=29,
                         k_seg=1, k_star=0.2, state_bytes=200)
    assert rows[0]["this run"] == "OOM within the 8 GB card's memory budget"
    switch = {(4, False): cm.Measured("no checkpointing", "baseline", None,
                                      RunResult(config={"train": {"micro_batch_size": 4}}, env={}, status="oom")),
              (4, True): on}
    text = "\n".join(cr.switch_lines(switch, {}, "cuda", (989.0, "datasheet"), 1.3))
    assert "did not fit within the 8 GB card's memory budget" in text and "this device" not in text
