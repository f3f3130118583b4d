"""Lab 01, how fast each precision trains, and the course's claims C1, C2. Each precision's run is timed once
(:func:`speedup_rows`), and every table, reading and claim reads that number. Re-exports
:mod:`labutils.labs.lab01.amp_memory` and :mod:`labutils.labs.lab01.op_profile` (labs 01 and 04: ``am.``). """
from __future__ import annotations

from dataclasses import replace

import torch

from ...verdicts import claims as cl
from .amp_memory import (batch_sweep, dtype_rows, measure_step_memory, memory_breakdown_rows,  # noqa: F401
                         memory_saving, plot_batch_sweep, plot_memory_breakdown, saved_tensor_census, sweep_sentence)
from ...core.env import matmul_precision
from ...core.memory import fmt_bytes
from .op_profile import (OpProfile, gpu_busy, op_group, op_group_rows, op_profile, plot_op_groups,  # noqa: F401
                         profile_reading, step_time_rows, top_op_rows)
from ...core.peaks import peak_info
from ...core.precisions import BASELINE, get

SPEED_TABLE = "precision_comparison"   # the results table that holds the one speed-up per precision (rows keyed
SPEEDUP = "speedup_vs_fp32"            # by "run" = the precision), in this column; labutils.estimator.advise reads it too


def speed_evidence(base, r, names: tuple[str, str], gpu_busy: float | None = None) -> tuple[float | None, cl.Evidence]:
    """The speed-up of ``r`` over ``base`` (median over median step time), its evidence with noise and ``gpu_busy``."""
    ratio, ev = cl.run_pair_evidence(base, r, names)  # no ratio: no spread either
    spread = ev.spread / ratio ** 2 if ratio and ev.spread is not None else None
    return (1 / ratio if ratio else None), replace(ev, gpu_busy=gpu_busy, spread=spread)


def speedup_rows(runs: dict, baseline: str = "fp32") -> list[dict]:
    """One row per run ``{precision: RunResult}``: median step time over the timed steps, its noise (+- half the
    inter-quartile range, relative), the timed steps, the speed-up over ``baseline`` and its noise (+- in x)."""
    base = runs[baseline]
    rows = []
    for p, r in runs.items():
        row = {"precision": p, "status": r.status, "median_step_ms": None, "step_noise": None, "timed_steps": None,
               SPEEDUP: None, "speedup_noise": None, "timed_on": cl.hardware(r.env) if r.ok else None}
        times = cl.timed_step_times(r) if r.ok else []
        if times:
            med, noise = cl.median_spread(times)
            row.update(median_step_ms=1e3 * med, step_noise=noise, timed_steps=len(times))
            if base.ok and cl.timed_step_times(base):
                x, ev = speed_evidence(base, r, (baseline, p))
                row.update({SPEEDUP: x, "speedup_noise": ev.spread if p != baseline else None})
        rows.append(row)
    return rows


def speedups(rows: list[dict]) -> dict:
    """``{precision: speed-up over FP32 or None}`` from :func:`speedup_rows`' rows."""
    return {r["precision"]: r[SPEEDUP] for r in rows}


def speed_label(hardware: str) -> str:
    """What a speed number measured on ``hardware`` is: CPU timing is labelled as such wherever it is shown."""
    return "CPU timing, not a GPU result" if cl.on_cpu(hardware) else f"timed on {hardware}"


def speed_words(x: float | None, noise: float | None, judged: bool = True) -> str:
    """A speed-up with its noise (+- in x), worded by both: within its noise "not decided" (the run cannot tell it
    from 1.00x), never "no difference"; outside it, faster or slower; CPU timing (``judged`` False): neither."""
    if x is None:
        return "not measured"
    if noise is None:
        return f"{x:.2f}x (noise unknown)"
    verdict = "within its noise: not decided" if abs(x - 1) <= noise else "faster" if x > 1 else "slower"
    return f"{x:.2f}x +- {noise:.2f}, {verdict if judged else 'CPU timing: not judged'}"


def skipped_result(cfg, reason: str, device=None):
    """A RunResult row for an experiment this machine cannot run, with the reason."""
    from ...core.env import environment
    from ...core.train import RunResult

    return RunResult(config=cfg.to_dict(), env=environment(device, cfg.mode), status="skipped", error=reason,
                     effective_batch_size=cfg.effective_batch_size)


def comparison_rows(runs: dict, speed_rows: list[dict], baseline: str = "fp32") -> list[dict]:
    """One row per run: micro-batch, loss, time of all steps, throughput, TFLOP/s and MFU over the timed steps, peak
    memory and its saving against ``baseline``, the step time and speed-up of ``speed_rows`` (read, not measured)."""
    base = runs[baseline]
    speed = {r["precision"]: r for r in speed_rows}
    rows = []
    for label, r in runs.items():
        d, sp = r.to_dict(), speed.get(label, {})
        rows.append({"run": label, "status": r.status, "micro_batch": r.config["train"]["micro_batch_size"],
            "avg_loss": d["avg_loss"], "final_loss": d["final_loss"],
            "time_all_steps_s": sum(r.step_times) if r.ok else None,
            "median_step_ms": sp.get("median_step_ms"), "step_noise": sp.get("step_noise"),
            "target_tokens_per_s": r.target_tokens_per_second, "tflops": r.achieved_tflops, "mfu": r.mfu,
            "peak_memory_bytes": r.peak_memory_bytes if r.ok else None,
            SPEEDUP: sp.get(SPEEDUP), "speedup_noise": sp.get("speedup_noise"),
            "memory_saving_vs_fp32": memory_saving(base, r),
            "skipped_steps": r.skipped_steps if r.ok else None, "note": r.error or ""})
    return rows


def comparison_display(rows: list[dict], hardware: str) -> list[dict]:
    """:func:`comparison_rows` as read: times and speed-ups, noise beside them (on a CPU not worded faster/slower)."""
    pct, judged = (lambda v: "-" if v is None else f"{v:.0%}"), not cl.on_cpu(hardware)
    return [{"run": r["run"], "status": r["status"], "final loss": r["final_loss"],
             "median step [ms]": "-" if r["median_step_ms"] is None else
             f"{r['median_step_ms']:.3g} +- {pct(r['step_noise'])}", "speed-up vs FP32": "1 (baseline)"
             if r["run"] == BASELINE else speed_words(r[SPEEDUP], r["speedup_noise"], judged),
             "peak_memory_bytes": r["peak_memory_bytes"], f"saving at micro-batch {r['micro_batch']}":
             pct(r["memory_saving_vs_fp32"])}
            for r in rows]


def speed_sentence(rows: list[dict], timed_on: str, emulated: dict) -> str:
    """The line under the comparison: largest loss difference to FP32, where timed, the runs ``emulated`` here."""
    base = next(r for r in rows if r["run"] == BASELINE)
    diffs = [abs(r["final_loss"] - base["final_loss"]) for r in rows if r["status"] == "ok" and r["run"] != BASELINE]
    text = (f"final losses within {max(diffs):.4f} of FP32's (same data and seed)" if diffs and base["final_loss"]
            is not None else "no run to compare with FP32")
    text += f"; times: {timed_on}"
    slow = [f"{p} is emulated here ({why})" for p, why in emulated.items()
            if any(r["run"] == p and r["status"] == "ok" for r in rows)]
    return text + ("; " + "; ".join(slow) if slow else "") + "."


def matmul_tflops(m: int, k: int, n: int, precision: str, device: torch.device, min_run_time: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul in ``precision`` (tf32: TF32 math), by torch.utils.benchmark."""
    from torch.utils import benchmark

    dtype = get(precision).dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    with matmul_precision(tf32=get(precision).tf32):
        t = benchmark.Timer("a @ b", globals={"a": a, "b": b}).blocked_autorange(min_run_time=min_run_time)
    del a, b
    return 2 * m * k * n / t.median / 1e12


def speed_reading_rows(speed_rows: list[dict], big: dict, precisions: list, hardware: str) -> list[dict]:
    """Each step speed-up of ``speed_rows`` beside the largest matmul's (``big``), read: within its noise "not
    decided", no fast path, or Amdahl's share of matmul work in the FP32 step. [] when timed on a CPU."""
    if cl.on_cpu(hardware):
        return []
    rows = []
    for r in speed_rows:
        p, x, noise = r["precision"], r[SPEEDUP], r["speedup_noise"]
        if p == BASELINE or p not in precisions or x is None:
            continue
        mm_x = big[f"{p}_tflops"] / big["fp32_tflops"]
        if noise is not None and abs(x - 1) <= noise:
            reading = "step speed-up within its noise: not decided"
        elif mm_x <= 1:
            reading = "no fast path for this precision on this device"
        elif 1 < x < mm_x:  # Amdahl: S = 1 / ((1 - f) + f / X)  =>  f
            reading = f"Amdahl: about {(1 - 1 / x) / (1 - 1 / mm_x):.0%} of the FP32 step is matmul work that sped up"
        else:
            reading = "the faster matmuls did not make the step faster: not matmul-bound here"
        rows.append({"precision": p, "step speed-up": speed_words(x, noise), "largest matmul": f"{mm_x:.2f}x",
                     "reading": reading})
    return rows


def mfu_reading(points: list, amp: str, gpu_name: str | None) -> str:
    """The MFU of the ``amp`` runs ``[(micro_batch, result), ...]``: is the small batch launch-bound? (or why none)"""
    if not points:
        return f"MFU not computed: {peak_info(gpu_name, amp)[1]}."
    (b_lo, r_lo), (b_hi, r_hi) = points[0], points[-1]
    text = (f"{amp} MFU (dense peak {r_hi.peak_tflops:g} TFLOP/s, {peak_info(gpu_name, amp)[1]}): "
            + ", ".join(f"micro-batch {b}: {r.mfu:.1%}" for b, r in points))
    if len(points) > 1 and r_hi.mfu > 1.5 * r_lo.mfu:
        return text + f": micro-batch {b_lo} is launch-bound, micro-batch {b_hi} feeds the tensor cores."
    return text + (": hardly changes with the batch (none of them launch-bound, or none matmul-bound)."
                   if len(points) > 1 else ".")


def course_rows(runs: dict, speed_rows: list[dict], expected: dict, baseline: str = "fp32",
                gpu_busy: float | None = None) -> list[dict]:
    """The course's expected results (``expected``: {precision: (peak GB, speed vs FP32)}) beside this run's peak
    (GB = 1e9 bytes), saving at its micro-batch and speed-up (``speed_rows``), with C2's rule applied to each."""
    base = runs[baseline]
    speed = {r["precision"]: r for r in speed_rows}
    rows = []
    for p, (gb, claimed_speed) in expected.items():
        r = runs[p]
        speedup = speed.get(p, {}).get(SPEEDUP)  # None unless both ran
        if not r.ok:
            verdict = f"not measured: {r.status}"
        elif p == baseline:
            verdict = "baseline"
        else:
            ev = speed_evidence(base, r, (baseline, p), gpu_busy if get(p).amp else None)[1]
            verdict = cl.verdict("C2", {"speedup": speedup}, ev)[0]
        rows.append({"precision": p, "micro_batch": r.config["train"]["micro_batch_size"], "course_peak_GB": gb,
                     "measured_peak_GB": r.peak_memory_bytes / 1e9 if r.ok else None, "measured_saving":
                     memory_saving(base, r), "course_saving": 1 - gb / expected[baseline][0],
                     "course_speedup": claimed_speed, "measured_speedup": speedup, "speed_verdict": verdict})
    return rows


def c1_c2_claims(runs: dict, cond: dict, *, amp: str, speed_rows: list[dict] | None = None,
                 model_state: int | None = None, fp16_matmul_x: float | None = None, sweep_rows=(),
                 gpu_busy: float | None = None) -> list[dict]:
    """C1: ``amp`` vs fp32 over the batch sweep (``sweep_rows``), shown at section 4's micro-batch (else the sweep's
    largest) with ``model_state``'s share of that FP32 peak. C2: fp16 vs fp32 at the config's batch."""
    base, r16 = runs["fp32"], runs["fp16"]
    sweep = {r["micro_batch"]: r for r in sweep_rows if r["memory_saving"] is not None}
    if sweep:
        savings = {m: r["memory_saving"] for m, r in sweep.items()}
        b = next((m for m in (base.config["train"]["micro_batch_size"],) if m in sweep), max(sweep))  # section 4's
        share = model_state / sweep[b]["fp32_peak_bytes"] if model_state and sweep[b].get("fp32_peak_bytes") else None
        reason = f"that is micro-batch {b} of the sweep" + (f", where FP32 weights, gradients and AdamW state ("
                                                             f"{fmt_bytes(model_state)}) are {share:.0%} of the FP32 "
                                                             f"peak and autocast does not shrink them" if share else "")
        bs = sorted(savings)
        accumulation = str(cond.get("batch") or "").partition(" x ")[2] or "1"
        c1_cond = {**cond, "precision": f"{amp} vs fp32", "batch": " / ".join(f"{m} x {accumulation}" for m in bs)}
        c1 = cl.claim_entry("C1", {"memory_saving": savings[b]}, c1_cond, reason=reason,
                            evidence=cl.Evidence(pair=(f"fp32 at micro-batch {bs}", f"{amp} at micro-batch {bs}"),
                                                 sweep=savings, note=f"value shown: micro-batch {b}"),
                            extra={f"{amp}_saving_by_micro_batch": savings, "shown_at_micro_batch": b,
                                   **({"model_state_share_of_fp32_peak": share} if share is not None else {})})
    else:
        c1 = cl.not_measured("C1", f"no micro-batch of the sweep ran in both fp32 and {amp}",
                             {**cond, "precision": f"{amp} vs fp32"})
    cond = {**cond, "precision": "fp16 vs fp32"}
    if not (r16.ok and base.ok):
        failed = r16 if not r16.ok else base
        why = f"the {'fp16' if failed is r16 else 'fp32'} run ended with status {failed.status} ({failed.error})"
        return [c1, cl.not_measured("C2", why, cond)]
    x16 = speedups(speed_rows if speed_rows is not None else speedup_rows(runs)).get("fp16")
    ev = speed_evidence(base, r16, ("fp32", "fp16"), gpu_busy)[1]
    judged = cl.judge("C2", {"speedup": x16}, ev)[0] in cl.JUDGED
    reason = (None if fp16_matmul_x is None or not judged else f"this device's largest fp16 matmul runs at "
              f"{fp16_matmul_x:.2f}x FP32" + (" and the rest of the step speeds up less" if fp16_matmul_x > 1
                                               else ": no fast half-precision path"))
    c2 = cl.claim_entry("C2", {"speedup": x16}, cond, reason=reason, evidence=ev,
                        extra={"speedups_in": f"results table '{SPEED_TABLE}', column '{SPEEDUP}'"})
    return [c1, c2]
