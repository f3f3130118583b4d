"""Lab 01, how fast each precision trains, and what the course claimed. Each precision's run is timed once:
:func:`speedup_rows` gives its median step time over the timed steps, the spread beside it, and its speed-up over
FP32 (median over median) -- the one number the comparison table (:func:`comparison_rows`), the expectations table
(:func:`course_rows`), claim C2 (:func:`c1_c2_claims`), the batch sweep and the Amdahl reading
(:func:`speedup_readings`) all read. Also: matmul throughput per dtype, the 2x2 figure, MFU readings.

Where one training step's memory goes is in :mod:`labutils.amp_memory`; one step op by op (profiler op time, a
different quantity from wall-clock step time) in :mod:`labutils.op_profile`. Their public names are re-exported
here, so lab 01 reaches all its measuring helpers as ``am.``. The numerics (formats, underflow, overflow, loss
scaling) are in :mod:`labutils.precision`. ``import labutils.amp_speed_memory as am``.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from . import claims as cl
from .amp_memory import (HALF_DTYPES, SavedTensorCensus, dtype_report, dtype_rows, measure_step_memory,  # noqa: F401
                         memory_breakdown_rows, saved_tensor_census)
from .env import matmul_precision
from .figures import step_axis, step_numbers
from .memory import fmt_bytes
from .op_profile import (MEMORY_BOUND, OP_GROUPS, SUSPECTS, OpProfile, aten_ops, gpu_busy, op_group,  # noqa: F401
                         op_group_rows, op_profile, profile_readings, slow_op_readings, slowest_op_rows,
                         step_time_rows, top_op_rows)
from .peaks import peak_info
from .precision import COLORS
from .results import byte_unit

PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SPEED_TABLE = "precision_comparison"   # the results table that holds the one speed-up per precision (rows keyed
SPEEDUP = "speedup_vs_fp32"            # by "run" = the precision), in this column; labutils.advise reads it too


# --------------------------------------------------------------------------------------------- each run timed once
def speed_evidence(base, r, names: tuple[str, str], gpu_busy: float | None = None) -> tuple[float | None, cl.Evidence]:
    """The speed-up of run ``r`` over ``base`` (median step time over median step time) and its evidence: the
    pair compared, the hardware, the timed steps behind each and the noise (from their inter-quartile ranges);
    ``gpu_busy``: the share of ``r``'s step its GPU kernels fill (:func:`labutils.op_profile.gpu_busy`), if known."""
    ratio, ev = cl.run_pair_evidence(base, r, names)
    ev = replace(ev, gpu_busy=gpu_busy)
    if ratio is None:
        return None, ev
    return 1 / ratio, replace(ev, spread=None if ev.spread is None else ev.spread / ratio ** 2)


def speedup_rows(runs: dict, baseline: str = "fp32") -> list[dict]:
    """One row per run ``{precision: RunResult}``: its median step time over the timed steps (warm-up left out),
    the noise beside it (+- half the inter-quartile range, relative), how many steps were timed and on what, and the
    speed-up over ``baseline`` (median over median, :func:`speed_evidence`) with its noise. The one measurement of
    each precision's speed: every other table, reading and claim of lab 01 reads these rows (:func:`speedups`)."""
    base = runs[baseline]
    rows = []
    for p, r in runs.items():
        row = {"precision": p, "status": r.status, "median_step_ms": None, "step_noise": None, "timed_steps": None,
               SPEEDUP: None, "speedup_noise": None, "timed_on": cl.hardware(r.env) if r.ok else None}
        times = cl.timed_step_times(r) if r.ok else []
        if times:
            med = statistics.median(times)
            q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else None
            row.update(median_step_ms=1e3 * med, step_noise=(q[2] - q[0]) / 2 / med if q else None,
                       timed_steps=len(times))
            if base.ok and cl.timed_step_times(base):
                x, ev = speed_evidence(base, r, (baseline, p))
                row.update({SPEEDUP: x, "speedup_noise": ev.spread if p != baseline else None})
        rows.append(row)
    return rows


def speedups(rows: list[dict]) -> dict:
    """``{precision: speed-up over FP32 or None}`` from :func:`speedup_rows`' rows (the recorded table)."""
    return {r["precision"]: r[SPEEDUP] for r in rows}


def speed_label(hardware: str) -> str:
    """What a speed number measured on ``hardware`` is: CPU timing is labelled as such wherever it is shown."""
    return "CPU timing, not a GPU result" if cl.on_cpu(hardware) else f"timed on {hardware}"


# --------------------------------------------------------------------------------------------- matmul speed
def matmul_tflops(m: int, k: int, n: int, precision: str, device: torch.device, min_run_time: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul in ``precision`` (tf32: FP32 tensors, TF32 math).

    Timed with ``torch.utils.benchmark`` (which synchronises CUDA); inputs are freed on return."""
    from torch.utils import benchmark

    dtype = PRECISION_DTYPES[precision]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    with matmul_precision(tf32=precision == "tf32"):
        t = benchmark.Timer("a @ b", globals={"a": a, "b": b}).blocked_autorange(min_run_time=min_run_time)
    del a, b
    return 2 * m * k * n / t.median / 1e12


def speedup_readings(speeds: dict, big: dict, small: dict, precisions: list, hardware: str, sweep_rows=(),
                     amp: str | None = None) -> list[str]:
    """What the step speed-ups ``speeds`` ({precision: x}, :func:`speedups`: the one measurement of section 4) say
    next to the matmul table (``big``/``small``: its largest and smallest rows) and the batch sweep (``sweep_rows``,
    ``amp`` against fp32, their ``speedup_vs_fp32``): no fast path, Amdahl's estimate of the matmul share, whether the speed-up grows with the
    batch. Timed on a CPU: one line saying that these readings are made on a GPU only (the CPU numbers stand in
    the tables, labelled); no paragraph reads CPU timing."""
    if cl.on_cpu(hardware):
        return [f"readings of these speeds (Amdahl's share of matmul work, the speed-up against the batch, MFU) are "
                f"made on a GPU only: this run timed a CPU ({speed_label(hardware)})."]
    lines = [f"{p} matmul vs fp32: {big[f'{p}_tflops'] / big['fp32_tflops']:.2f}x at '{big['matmul']}', "
             f"{small[f'{p}_tflops'] / small['fp32_tflops']:.2f}x at '{small['matmul']}'" for p in precisions[1:]]
    for p in ("tf32", "fp16", "bf16"):
        model_x = speeds.get(p)
        if model_x is None or p not in precisions:
            continue
        mm_x = big[f"{p}_tflops"] / big["fp32_tflops"]
        line = (f"{p}: whole training step {model_x:.2f}x FP32 speed (section 4, median step times), its largest "
                f"matmul {mm_x:.2f}x")
        if mm_x <= 1:
            line += " -> this device has no fast path for this precision: nothing to gain (or a loss)"
        elif model_x > 1 and mm_x > model_x:
            share = (1 - 1 / model_x) / (1 - 1 / mm_x)  # Amdahl: S = 1 / ((1 - f) + f / X)  =>  f
            line += (f" -> Amdahl's estimate: about {share:.0%} of the FP32 step time is matmul work that sped up "
                     f"(inferred from these two wall-clock speeds; the profiler below measures the matmul ops' share "
                     f"of op self time instead, a different quantity, so the two numbers differ)")
        elif model_x <= 1:
            line += " -> the faster matmuls did not make the step faster: the step is not matmul-bound here"
        lines.append(line)
    sw = [r for r in sweep_rows if r.get(SPEEDUP) is not None]
    if sw and amp:
        lines.append(f"{amp} speed-up vs FP32 by micro-batch (median step times): "
                     + ", ".join(f"{r['micro_batch']}: {r[SPEEDUP]:.2f}x" for r in sw))
        if len(sw) > 1 and sw[-1][SPEEDUP] > sw[0][SPEEDUP]:
            lines.append(f"the speed-up grows with the batch: at micro-batch {sw[0]['micro_batch']} the GPU waits on "
                         f"kernel launches (launch-bound), so faster math cannot help.")
        elif len(sw) > 1:
            lines.append("the speed-up did not grow with the batch on this device: either even the largest batch is "
                         "still launch-bound, or there is no fast half-precision path at all (see the matmul table).")
    return lines


def mfu_readings(points: list, amp: str, hardware: str, gpu_name: str | None) -> list[str]:
    """What the MFU of the ``amp`` runs ``[(micro_batch, result), ...]`` (smallest batch first) says: whether the
    small micro-batch leaves the card idle (launch-bound); or why no MFU was computed."""
    if not points:
        return [f"MFU not computed: {peak_info(gpu_name, amp)[1]}."]
    (b_lo, r_lo), (b_hi, r_hi) = points[0], points[-1]
    lines = [f"{amp} MFU on {hardware} (dense {amp} peak {r_hi.peak_tflops:g} TFLOP/s, "
             f"{peak_info(hardware, amp)[1]}): " + ", ".join(f"micro-batch {b}: {r.mfu:.1%}" for b, r in points)]
    if len(points) > 1 and r_hi.mfu > 1.5 * r_lo.mfu:
        lines.append(f"micro-batch {b_lo} keeps the card {r_lo.mfu:.1%} busy, micro-batch {b_hi} {r_hi.mfu:.1%} "
                     f"({r_hi.mfu / r_lo.mfu:.1f}x): the small batch is launch-bound, the big one feeds the tensor "
                     f"cores.")
    elif len(points) > 1:
        lines.append(f"MFU hardly changes with the batch here ({r_lo.mfu:.1%} -> {r_hi.mfu:.1%}): even micro-batch "
                     f"{b_lo} keeps this card as busy as the larger ones, or none of them is matmul-bound.")
    return lines


# --------------------------------------------------------------------------------------------- the four runs
def skipped_result(cfg, reason: str, device=None):
    """A RunResult row for an experiment this machine cannot run, with the reason."""
    from .env import environment
    from .train import RunResult

    return RunResult(config=cfg.to_dict(), env=environment(device, cfg.mode), status="skipped", error=reason,
                     effective_batch_size=cfg.effective_batch_size)


def comparison_rows(runs: dict, speed_rows: list[dict], baseline: str = "fp32") -> list[dict]:
    """One row per run: loss, time, throughput, TFLOP/s, peak memory (bytes), saving against ``baseline``, and its
    step time and speed-up as :func:`speedup_rows` measured them (``speed_rows``: read, not measured again)."""
    base = runs.get(baseline)
    base_ok = base is not None and base.ok
    speed = {r["precision"]: r for r in speed_rows}
    rows = []
    for label, r in runs.items():
        d = r.to_dict()
        ok = r.ok
        sp = speed.get(label, {})
        rows.append({
            "run": label, "status": r.status,
            "avg_loss": d["avg_loss"], "final_loss": d["final_loss"],
            # wall time of every step, warm-up included (the spec's "training time"); everything else below is
            # over the timed steps only (train.timing_warmup_steps left out)
            "time_all_steps_s": sum(r.step_times) if ok else None,
            "median_step_ms": sp.get("median_step_ms"), "step_noise": sp.get("step_noise"),
            "target_tokens_per_s": r.target_tokens_per_second, "tflops": r.achieved_tflops,
            "peak_memory_bytes": r.peak_memory_bytes if ok else None,
            SPEEDUP: sp.get(SPEEDUP), "speedup_noise": sp.get("speedup_noise"),
            "memory_saving_vs_fp32": 1 - r.peak_memory_bytes / base.peak_memory_bytes
            if ok and base_ok and r.peak_memory_bytes and base.peak_memory_bytes else None,
            "skipped_steps": r.skipped_steps if ok else None,
            "note": r.error or "",
        })
    return rows


def plot_comparison(runs: dict, title: str):
    """The spec's 2x2 figure: training time, throughput, peak memory, loss curves. Skipped runs are labelled."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    fig.suptitle(title, fontsize=13, fontweight="bold")
    labels = list(runs)
    colors = [COLORS.get(k, "gray") for k in labels]
    unit, size = byte_unit(r.peak_memory_bytes for r in runs.values() if r.ok)
    timing = ", CPU timing" if any(r.ok and cl.on_cpu(cl.hardware(r.env)) for r in runs.values()) else ""
    panels = [
        (axes[0, 0], f"Training time (all steps{timing})", "time [s]", lambda r: sum(r.step_times)),
        (axes[0, 1], f"Throughput (timed steps{timing})", "target tokens / s", lambda r: r.target_tokens_per_second),
        (axes[1, 0], "Peak memory", f"peak memory [{unit}]", lambda r: r.peak_memory_bytes / size),
    ]
    for ax, name, ylabel, get in panels:
        values = [get(runs[k]) if runs[k].ok else 0.0 for k in labels]
        bars = ax.bar(labels, values, color=colors)
        for bar, k in zip(bars, labels):
            if not runs[k].ok:
                ax.text(bar.get_x() + bar.get_width() / 2, 0, runs[k].status, ha="center", va="bottom",
                        rotation=90, fontsize=9, color="gray")
        ax.set_title(name)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.1 * max(values + [1e-12]))  # headroom: the tallest bar is never cut off
        ax.grid(axis="y", alpha=0.3)
    ax = axes[1, 1]
    for k in labels:
        if runs[k].ok:
            ax.plot(step_numbers(runs[k].losses), runs[k].losses, label=k, color=COLORS.get(k), lw=1.5)
    ax.set_title("Training loss")
    step_axis(ax)
    ax.set_ylabel("loss [nats / token]")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------- claims C1, C2
def course_rows(runs: dict, speed_rows: list[dict], expected: dict, baseline: str = "fp32",
                gpu_busy: float | None = None) -> list[dict]:
    """The original course's expected results (``expected``: {precision: (peak GB, speed vs FP32)}, quoted in the
    notebook from the Lab-1.4 course README) next to what this run measured: the peak-memory saving at the config's
    batch and the step speed-up of :func:`speedup_rows` (``speed_rows``: read, not measured again), with what the
    course's one rule (:mod:`labutils.claims`) makes of them: memory (C1) is "not judged" at one batch size (C1 is
    judged over the batch sweep), speed (C2) only on a GPU with enough timed steps whose half-precision step kept
    the GPU busy (``gpu_busy``, from the profiled AMP step; None: not known)."""
    base = runs[baseline]
    speed = {r["precision"]: r for r in speed_rows}
    claimed_base = expected[baseline][0]
    rows = []
    for p, (gb, claimed_speed) in expected.items():
        r = runs[p]
        ok = r.ok and base.ok
        saving = 1 - r.peak_memory_bytes / base.peak_memory_bytes if ok else None
        speedup = speed.get(p, {}).get(SPEEDUP) if ok else None
        if not r.ok:
            verdict = f"not measured: {r.status} ({r.error})"
        elif p == baseline:
            verdict = "baseline"
        else:
            hw = cl.hardware(base.env)
            ev = speed_evidence(base, r, (baseline, p), gpu_busy if p in ("fp16", "bf16") else None)[1]
            verdict = (f"memory: {cl.verdict('C1', {'memory_saving': saving}, cl.Evidence(sweep={0: saving}), hardware=hw)[0]} "
                       f"(one batch size; C1 is judged over the sweep); "
                       f"speed: {cl.verdict('C2', {'speedup': speedup}, ev)[0]}")
        rows.append({"precision": p, "course_peak_GB": gb,
                     "measured_peak_GB": r.peak_memory_bytes / 1e9 if r.ok else None,
                     "course_saving": 1 - gb / claimed_base, "measured_saving": saving,
                     "course_speedup": claimed_speed, "measured_speedup": speedup, "verdict": verdict})
    return rows


def c1_c2_claims(runs: dict, cond: dict, *, amp: str, speed_rows: list[dict] | None = None,
                 model_state: int | None = None, fp16_matmul_x: float | None = None, sweep_rows=(),
                 gpu_busy: float | None = None) -> list[dict]:
    """C1 (memory) and C2 (speed) as recorded claims.

    Each claim's ``conditions`` name its own pair and batches (the lab's ``cond`` gives model, sequence, hardware,
    mode). C1 is judged over the batch sweep (``sweep_rows``: ``amp`` against fp32 at each micro-batch; the value shown
    is the median saving, every point is judged), with the reason from the memory breakdown (``model_state``:
    weights + gradients + AdamW bytes, shown as a share of the FP32 peak: what autocast does not shrink). C2 is
    fp16 against fp32 at the config's batch: the speed-up of :func:`speedup_rows` (``speed_rows``, the one
    measurement, computed from ``runs`` when not given; its evidence is the same two runs' timed steps), judged only on a GPU with enough timed steps
    (CPU fp16 is an emulation: the CPU ratio is shown, not judged) and, where ``gpu_busy`` is known (the share of
    the profiled half-precision step that GPU kernels fill), only when the GPU, not the host, set the step's pace;
    with the matmul table's fp16 speed-up (``fp16_matmul_x``) as the reason."""
    base, r16 = runs["fp32"], runs["fp16"]
    sweep_savings = {r["micro_batch"]: r["memory_saving"] for r in sweep_rows if r["memory_saving"] is not None}
    if sweep_savings:
        median = statistics.median(sweep_savings.values())
        mem_reason = (f"FP32 weights, gradients and AdamW state ({fmt_bytes(model_state)}) are "
                      f"{model_state / base.peak_memory_bytes:.0%} of the FP32 peak at micro-batch "
                      f"{base.config.get('train', {}).get('micro_batch_size')} and autocast does not shrink them"
                      if model_state is not None and base.ok else None)
        bs = sorted(sweep_savings)
        accumulation = str(cond.get("batch") or "").partition(" x ")[2] or "1"
        c1_cond = {**cond, "precision": f"{amp} vs fp32", "batch": " / ".join(f"{b} x {accumulation}" for b in bs)}
        c1 = cl.claim_entry("C1", {"memory_saving": median}, c1_cond, reason=mem_reason,
                            evidence=cl.Evidence(pair=(f"fp32 at micro-batch {bs}", f"{amp} at micro-batch {bs}"),
                                                 sweep=sweep_savings, note="value shown: the median over the sweep"),
                            extra={f"{amp}_saving_by_micro_batch": sweep_savings,
                                   **({"model_state_share_of_fp32_peak": model_state / base.peak_memory_bytes}
                                      if model_state is not None and base.ok else {})})
    else:
        c1 = cl.not_measured("C1", f"no micro-batch of the sweep ran in both fp32 and {amp}",
                             {**cond, "precision": f"{amp} vs fp32"})
    cond = {**cond, "precision": "fp16 vs fp32"}  # C2: fp16 against fp32 at the config's batch
    if not (r16.ok and base.ok):
        failed = r16 if not r16.ok else base
        why = f"the {'fp16' if failed is r16 else 'fp32'} run ended with status {failed.status} ({failed.error})"
        return [c1, cl.not_measured("C2", why, cond)]
    x16 = speedups(speed_rows if speed_rows is not None else speedup_rows(runs)).get("fp16")
    ev = speed_evidence(base, r16, ("fp32", "fp16"), gpu_busy)[1]
    judged_here = cl.judge("C2", {"speedup": x16}, ev)[0] in cl.JUDGED
    speed_reason = (None if fp16_matmul_x is None or not judged_here else
                    f"this device's largest fp16 matmul runs at {fp16_matmul_x:.2f}x FP32"
                    + (" and the rest of the step speeds up less" if fp16_matmul_x > 1
                       else ": no fast half-precision path"))
    c2 = cl.claim_entry("C2", {"speedup": x16}, cond, reason=speed_reason, evidence=ev,
                        extra={"speedups_in": f"results table '{SPEED_TABLE}', column '{SPEEDUP}'"})
    return [c1, c2]


__all__ = ["PRECISION_DTYPES", "SPEED_TABLE", "SPEEDUP", "speed_evidence", "speedup_rows", "speedups", "speed_label",
           "matmul_tflops", "speedup_readings", "mfu_readings", "skipped_result", "comparison_rows",
           "plot_comparison", "course_rows", "c1_c2_claims",
           # re-exported from labutils.amp_memory and labutils.op_profile
           "HALF_DTYPES", "SavedTensorCensus", "saved_tensor_census", "dtype_report", "measure_step_memory",
           "memory_breakdown_rows", "dtype_rows", "OP_GROUPS", "MEMORY_BOUND", "op_group", "OpProfile", "op_profile",
           "op_group_rows", "top_op_rows", "profile_readings", "SUSPECTS", "aten_ops", "slowest_op_rows",
           "step_time_rows", "slow_op_readings", "gpu_busy"]
