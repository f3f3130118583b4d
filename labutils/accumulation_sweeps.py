"""Lab 02 (gradient accumulation): reading the lab's training runs (``lu.run`` sweeps over the split of a batch
into micro-batches): per-run numbers (tail loss, loss at equal tokens, step-to-step noise), the stability and
learning-rate tables, least-squares fits of time and memory, the figures, the micro-batch recommendation per
card, and claim C3.

The accumulation loop and the gradient experiments are written out in the notebook; their bookkeeping is in
:mod:`labutils.accumulation`.
``import labutils.accumulation_sweeps as acs``.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from . import claims as cl
from .figures import step_axis, step_numbers
from .memory import fmt_bytes


# --------------------------------------------------------------------------- numbers of one run
def tail_loss(r) -> float | None:
    """Mean loss over the last 10% of steps: one number per run, less noisy than the last step."""
    n = max(1, len(r.losses) // 10)
    return float(np.mean(r.losses[-n:])) if r.losses else None


def median_step(r) -> tuple[float | None, float | None]:
    """(median step time over a run's timed steps, its noise: +- half the inter-quartile range, relative); Nones
    when no step was timed. The step time every table and fit of the lab reads."""
    times = cl.timed_step_times(r) if getattr(r, "ok", True) else []
    if not times:
        return None, None
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else None
    return med, ((q[2] - q[0]) / 2 / med if q else None)


def run_row(r, **extra) -> dict:
    """A finished run's table row (``RunResult.row``) with its step time as the lab reads it everywhere: the
    median of the timed steps (``median_step_s``) and its spread (``step_noise``), in place of the mean."""
    row = r.row(**extra)
    row.pop("step_time_s", None)
    med, noise = median_step(r)
    return {**row, "median_step_s": med, "step_noise": noise}


def moving_average(x, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (shorter at the start), same length as ``x``."""
    x = np.asarray(x, float)
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def step_noise(losses) -> float:
    """Step-to-step loss noise: std of consecutive differences / sqrt(2). A slow trend barely moves it, unlike
    the plain standard deviation, which mixes the downward trend of training into the 'noise'."""
    d = np.diff(np.asarray(losses, float))
    return float(np.std(d) / math.sqrt(2)) if len(d) >= 2 else math.nan


def loss_at_tokens(r, tokens: int, window: int) -> float:
    """The moving-average loss (over ``window`` steps) at the step where run ``r`` had seen ``tokens`` target tokens."""
    i = int(np.searchsorted(np.cumsum(r.target_tokens), tokens))
    return float(moving_average(r.losses, window)[min(i, len(r.losses) - 1)])


def at_equal_tokens(runs: dict, tokens: int, window: int, tolerance: float = 0.1) -> dict:
    """``{key: (moving-average loss, target tokens seen) or None}`` for each run in ``runs``, at its first step
    that had seen ``tokens`` target tokens; None when no step's count is within ``tolerance`` of it (a large batch's
    first step may already have seen many times more): such a run is not compared at equal tokens."""
    out = {}
    for key, r in runs.items():
        seen = np.cumsum(r.target_tokens)
        i = min(int(np.searchsorted(seen, tokens)), len(seen) - 1)
        out[key] = ((loss_at_tokens(r, tokens, window), int(seen[i])) if abs(seen[i] / tokens - 1) <= tolerance
                    else None)
    return out


# --------------------------------------------------------------------------- the sweep at a fixed micro-batch
def plot_sweep(runs: dict, micro: int, title: str):
    """The sweep ``{accumulation steps: finished run}`` at micro-batch ``micro``: loss per optimizer step, loss
    per target token seen, peak memory, throughput."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for k, r in runs.items():
        lbl = f"{micro} x {k} (B={micro * k})"
        axes[0, 0].plot(range(1, len(r.losses) + 1), r.losses, label=lbl, alpha=0.85)
        axes[0, 1].plot(np.cumsum(r.target_tokens), r.losses, label=lbl, alpha=0.85)
    axes[0, 0].set(xlabel="Optimizer step", ylabel="Training loss (nats/token)", title="Loss per optimizer step")
    axes[0, 1].set(xlabel="Target tokens seen (log scale)", ylabel="Training loss (nats/token)", xscale="log",
                   title="Loss per token seen (same data budget)")
    axes[0, 1].xaxis.set_minor_formatter(NullFormatter())
    names = [f"{micro} x {k}" for k in runs]
    axes[1, 0].bar(names, [r.peak_memory_bytes / 2**20 for r in runs.values()], color="tab:purple")
    axes[1, 0].set(ylabel="Peak memory (MiB)", title=f"Peak memory (micro-batch fixed at {micro})")
    axes[1, 1].bar(names, [micro * k / median_step(r)[0] for k, r in runs.items()], color="tab:gray")
    axes[1, 1].set(ylabel="Samples per second", title="Throughput (median step time)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].legend()
    axes[0, 1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def stability_rows(runs: dict, micro: int, max_grad_norm: float | None) -> list[dict]:
    """One row per run ``{accumulation steps: finished run}``: loss std and CV, step-to-step noise (and noise x
    sqrt(B), constant if the noise is sampling noise), grad-norm mean and std, steps above the clip threshold."""
    rows = []
    for k, r in runs.items():
        E, L, G = micro * k, np.array(r.losses), np.array(r.grad_norms)
        noise = step_noise(L)
        rows.append({"run": f"{micro} x {k}", "effective_batch": E, "loss_std": float(L.std()),
                     "loss_cv": float(L.std() / L.mean()), "step_noise": noise, "noise_x_sqrtB": noise * math.sqrt(E),
                     "grad_norm_mean": float(G.mean()), "grad_norm_std": float(G.std()),
                     "clipped_steps": int((G > (max_grad_norm or math.inf)).sum())})
    return rows


def plot_stability(runs: dict, rows: list[dict], micro: int, window: int, max_grad_norm: float | None):
    """Moving-average loss and gradient norm per step of each run, and the step-to-step noise against 1/sqrt(B)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for k, r in runs.items():
        lbl = f"B={micro * k}"
        axes[0].plot(step_numbers(r.losses), moving_average(r.losses, window), label=lbl)  # steps from 1
        axes[1].plot(step_numbers(r.grad_norms), r.grad_norms, label=lbl, alpha=0.8)
    Es, noises = np.array([s["effective_batch"] for s in rows]), np.array([s["step_noise"] for s in rows])
    axes[2].loglog(Es, noises, "o-", label="measured step-to-step noise")
    axes[2].loglog(Es, noises[0] * np.sqrt(Es[0] / Es), "k--", label="1/sqrt(B) from the smallest B")
    axes[0].set(xlabel="Optimizer step", ylabel="Loss, moving average",
                title=f"Loss, trailing mean over {window} steps")
    axes[1].set(xlabel="Optimizer step", ylabel="Gradient L2 norm (before clipping)", title="Gradient norm per step")
    axes[1].axhline(max_grad_norm or np.nan, color="red", ls=":", label="clip threshold")
    axes[2].set(xlabel="Effective batch B (samples, log scale)", ylabel="Loss noise (nats/token, log scale)",
                title="Step-to-step loss noise")
    axes[2].set_xticks(Es, [str(e) for e in Es])
    axes[2].xaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        step_axis(ax, "Optimizer step")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- learning-rate scaling
def lr_rows(runs: dict, plan: dict) -> list[dict]:
    """One row per run ``{name: result}`` of the learning-rate plan ``{name: config}``: lr, warm-up, effective
    batch, steps, samples seen, tail loss, largest grad norm."""
    return [r.row(run=name, lr=plan[name].train.lr, warmup_steps=plan[name].train.warmup_steps,
                  effective_batch=plan[name].effective_batch_size, steps=len(r.losses),
                  samples_seen=plan[name].effective_batch_size * len(r.losses), tail_loss=tail_loss(r),
                  max_grad_norm_seen=max(r.grad_norms) if r.grad_norms else None) for name, r in runs.items()]


def plot_lr_scaling(runs: dict, plan: dict, window: int, b0: int, b1: int):
    """Moving-average loss against samples seen for each run of the plan; the window (``window`` steps at
    batch ``b0``) shrinks with the batch so that every curve averages over the same number of samples."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in runs.items():
        if r.ok:
            B = plan[name].effective_batch_size
            ax.plot(B * np.arange(1, len(r.losses) + 1), moving_average(r.losses, max(1, window * b0 // B)),
                    "o-" if len(r.losses) < 10 else "-", label=name)
    ax.set(xlabel="Samples seen", ylabel="Training loss, moving average (nats/token)",
           title=f"Learning-rate scaling from B={b0} to B={b1} at equal samples")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# --------------------------------------------------------------------------- time and memory fits, recommendation, C3
def linear_fit(x, y) -> tuple[float, float]:
    """Least-squares y = a + b x; returns (a, b). Needs two distinct x values."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(set(x.tolist())) < 2:
        raise ValueError("a line needs measurements at two or more distinct x values")
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def recommend(fixed_bytes: float, per_sample_bytes: float, budgets: dict, target_batch: int,
              headroom: float = 0.9, measured: dict | None = None) -> list[dict]:
    """Largest micro-batch that fits each budget by the fitted line peak = fixed + per_sample x micro, the
    power of two at or below it (capped at the target), and the accumulation that reaches ``target_batch``.

    ``budgets``: {label: bytes}; ``headroom``: share of the card the tensors may use (the CUDA context and the
    allocator's fragmentation take the rest); ``measured``: {micro: tokens/s} from the scan, shown alongside."""
    rows = []
    for label, budget in budgets.items():
        usable = headroom * budget
        max_micro = int((usable - fixed_bytes) // per_sample_bytes) if per_sample_bytes > 0 else target_batch
        if max_micro < 1:
            rows.append({"memory": label, "max_micro_batch": 0, "micro_batch": None, "accum_steps": None,
                         "effective_batch": None, "predicted_peak_bytes": fixed_bytes + per_sample_bytes,
                         "tokens_per_s_measured": None,
                         "advice": "micro-batch 1 does not fit: add checkpointing (lab 03) or a smaller model"})
            continue
        micro = 2 ** int(math.log2(min(max_micro, target_batch)))
        accum = -(-target_batch // micro)
        rows.append({"memory": label, "max_micro_batch": max_micro, "micro_batch": micro, "accum_steps": accum,
                     "effective_batch": micro * accum, "predicted_peak_bytes": fixed_bytes + per_sample_bytes * micro,
                     "tokens_per_s_measured": (measured or {}).get(micro),
                     "advice": "no accumulation needed" if accum == 1 else f"accumulate {accum} micro-batches"})
    return rows


def accumulation_cost(runs: dict, micro: int) -> dict:
    """The cost of accumulating, measured once: the sweep ``{accumulation steps: RunResult}`` at the FIXED
    micro-batch ``micro``, its fewest (k_lo) against its most (k_hi) accumulation steps. Time: each micro-batch's
    share of a step (median step time over the timed steps / k), the same micro-batch on both sides, so a
    difference is the accumulating itself, not a small micro-batch (``time_cost`` = k_hi's / k_lo's - 1, with its
    noise from the two runs' inter-quartile ranges). Memory: the two peaks (``memory_increase``). One row: the
    lab's results table ``accumulation_cost``, which the notebook's lines and C3 (:func:`c3_claim`) read."""
    k_lo, k_hi = min(runs), max(runs)
    lo, hi = runs[k_lo], runs[k_hi]
    t = cl.timed_ratio([x / k_lo for x in cl.timed_step_times(lo)], [x / k_hi for x in cl.timed_step_times(hi)])
    return {"compares": f"{micro} x {k_lo} vs {micro} x {k_hi}", "micro_batch": micro, "k_lo": k_lo, "k_hi": k_hi,
            "time_cost": t["ratio"] - 1 if t["ratio"] else None, "time_cost_noise": t["spread"],
            "timed_steps": t["timed_steps"], "seconds_per_micro_batch_lo": t["median_a"],
            "seconds_per_micro_batch_hi": t["median_b"],
            "peak_lo_bytes": lo.peak_memory_bytes, "peak_hi_bytes": hi.peak_memory_bytes,
            "memory_increase": hi.peak_memory_bytes / lo.peak_memory_bytes - 1
            if lo.peak_memory_bytes and hi.peak_memory_bytes else None,
            "hardware": cl.hardware(lo.env)}


def time_fit_reading(runs: dict, micro: int, a: float, b: float) -> str:
    """What the fit step time = ``a`` + k x ``b`` over the sweep ``runs`` at micro-batch ``micro`` says, decided by
    the runs' own rows and their noise: each sample is cheaper when accumulating only if the time per micro-batch
    at the most accumulation steps is below the one at the fewest by more than the noise, and the fitted per-step
    overhead is positive. Otherwise it says which of the two is not so."""
    k_lo, k_hi = min(runs), max(runs)
    t = cl.timed_ratio([x / k_lo for x in cl.timed_step_times(runs[k_lo])],
                       [x / k_hi for x in cl.timed_step_times(runs[k_hi])])
    if t["ratio"] is None:
        return "  -> no timed steps: nothing to read from the fit"
    change = t["ratio"] - 1
    noise = t["spread"]
    rows = (f"time per micro-batch {1e3 * t['median_a']:.1f} ms at {micro} x {k_lo} -> {1e3 * t['median_b']:.1f} ms at "
            f"{micro} x {k_hi} ({100 * change:+.0f} %, noise "
            + (f"+-{100 * noise:.0f} %)" if noise is not None else "unknown)"))
    if noise is None or abs(change) <= noise:
        return f"  -> {rows}: within the noise; the fit's split into overhead and per-micro-batch time is not decided"
    if change < 0 and a > 0:
        return (f"  -> {rows}: the per-step overhead ({1e3 * a:.1f} ms) is shared by more micro-batches, so "
                f"accumulating at a fixed micro-batch makes each sample cheaper")
    if change < 0:
        return f"  -> {rows}: cheaper per sample, but the fit puts no positive overhead per step: the line does not explain it"
    return (f"  -> {rows}: each sample got MORE expensive with more accumulation steps, against the fit's "
            f"amortised-overhead picture; the extra time is in the micro-batches themselves")


def cost_readings(runs: dict, micro: int, cost: dict) -> list[str]:
    """The cost of accumulating as section 6 prints it: ``cost`` (:func:`accumulation_cost`, the one measurement),
    labelled with where it was timed. On a GPU also the fit step time = overhead + k x per-micro-batch over the sweep
    ``runs`` and what it says (:func:`time_fit_reading`). Timed on a CPU: that one number, labelled, and nothing
    read from it (CPU timing says nothing about a GPU)."""
    if cost["time_cost"] is None:
        return [f"the cost of accumulating ({cost['compares']}): no timed steps, not measured"]
    noise = f", noise +-{100 * cost['time_cost_noise']:.0f} %" if cost["time_cost_noise"] is not None else ""
    cpu = cl.on_cpu(cost["hardware"])
    head = (f"the cost of accumulating, measured once ({cost['compares']}: time per micro-batch, medians of "
            f"{cost['timed_steps']} timed steps): {1e3 * cost['seconds_per_micro_batch_lo']:.1f} -> "
            f"{1e3 * cost['seconds_per_micro_batch_hi']:.1f} ms, {100 * cost['time_cost']:+.0f} %{noise} "
            + ("(CPU timing, not a GPU result)" if cpu else f"(timed on {cost['hardware']})"))
    if cpu:
        return [head]
    a, b = linear_fit(list(runs), [median_step(r)[0] for r in runs.values()])
    return [head, f"micro-batch {micro}: step time = {a * 1e3:.1f} ms + k x {b * 1e3:.1f} ms (least-squares fit: "
                  f"per-step overhead, then per micro-batch)", time_fit_reading(runs, micro, a, b)]


def small_micro_batch_line(scan: dict, micro: int, target: int, cost: dict) -> str:
    """At a fixed effective batch ``target`` (``scan``: {micro-batch: finished run}): what micro-batch ``micro``
    costs against the fastest split that fits. Labelled as what it is, the price of a small micro-batch, not of
    accumulating (that is ``cost``, measured at one micro-batch). On a CPU: only that the table above is CPU timing."""
    if cl.on_cpu(cost["hardware"]):
        return ("the splits above are CPU timing: not read here (a CPU has no kernel launches to amortise); on a GPU "
                "this line gives the price of a small micro-batch at this effective batch.")
    best = max(scan, key=lambda m: scan[m].target_tokens_per_second)
    price = 1 - scan[micro].target_tokens_per_second / scan[best].target_tokens_per_second
    return (f"B={target}: {micro} x {target // micro} runs at {scan[micro].target_tokens_per_second:,.0f} target "
            f"tokens/s, the fastest split that fits ({best} x {target // best}) at "
            f"{scan[best].target_tokens_per_second:,.0f}: micro-batch {micro} gives up {price:.0%} of the throughput "
            f"at this effective batch -- the price of a small micro-batch, not of accumulating (that is "
            + (f"{100 * cost['time_cost']:+.0f} %, " if cost["time_cost"] is not None else "")
            + f"{cost['compares']} at one micro-batch)")


def c3_claim(cost: dict, cond: dict, *, grad_buffer: int) -> dict:
    """C3, "accumulation costs 0 % memory and ~5 % time", judged by the course's one rule (labutils.claims) on the
    lab's one measurement of the cost of accumulating (``cost``: :func:`accumulation_cost`'s row, at a FIXED
    micro-batch). Memory: the two peaks, with the measured extra set beside one FP32 gradient buffer
    (``grad_buffer`` bytes). Time: per micro-batch, judged only from a GPU with enough timed steps (else "not
    judged", the value shown labelled)."""
    micro = cost["micro_batch"]
    pair = tuple(cost["compares"].split(" vs "))
    values, evidence = {"memory_increase": cost["memory_increase"]}, {}
    if cost["time_cost"] is not None:
        values["time_cost"] = cost["time_cost"]
        hw = cond.get("hardware")
        evidence = {"time_cost": cl.Evidence(pair=pair, hardware=hw, timed_steps=cost["timed_steps"],
                                             spread=cost["time_cost_noise"], micro_batches=(micro, micro),
                                             note="median step time / accumulation steps, timed steps only"),
                    "memory_increase": cl.Evidence(pair=pair, hardware=hw, micro_batches=(micro, micro))}
    mem = cost["memory_increase"]
    extra = (cost["peak_hi_bytes"] - cost["peak_lo_bytes"]
             if cost.get("peak_hi_bytes") is not None and cost.get("peak_lo_bytes") is not None else None)
    # the words follow the measured extra: the H200 run said "at most one FP32 gradient buffer (474.70 MiB)" of a
    # measured +476.64 MiB
    reason = None if mem is None or mem <= 0 or extra is None else (
        f"the extra {fmt_bytes(extra)} is about one FP32 gradient buffer ({fmt_bytes(grad_buffer)}), which lives next "
        f"to the activations of micro-batches 2..k" if abs(extra - grad_buffer) <= 0.1 * grad_buffer else
        f"one FP32 gradient buffer ({fmt_bytes(grad_buffer)}) lives next to the activations of micro-batches 2..k; "
        f"the extra measured here is {fmt_bytes(extra)}")
    return cl.claim_entry("C3", values, cond, reason=reason, **({"evidence": evidence} if evidence else {}),
                          extra={"compares": f"{cost['compares']} (the same micro-batch)",
                                 "measured_in": "results table 'accumulation_cost'"})
