"""Lab 02 (gradient accumulation): reading the lab's ``lu.run`` sweeps over the split of a batch into micro-batches:
their tables and figures, the cost of accumulating and claim C3, and the micro-batch advice per card. """
from __future__ import annotations

import math

import numpy as np

from ...verdicts import claims as cl
from ...estimator.estimate import HEADROOM
from ...core.figures import step_axis, step_numbers
from ...core.memory import fmt_bytes


def tail_loss(r) -> float | None:
    """Mean loss over the last 10% of steps: one number per run, less noisy than the last step."""
    n = max(1, len(r.losses) // 10)
    return float(np.mean(r.losses[-n:])) if r.losses else None


def median_step(r) -> tuple[float | None, float | None]:
    """(median of a run's timed step times, +- half their inter-quartile range, relative); Nones if none was timed."""
    return cl.median_spread(cl.timed_step_times(r) if getattr(r, "ok", True) else [])


def run_row(r, **extra) -> dict:
    """``RunResult.row`` with the median step time (``median_step_s``) and its spread (``step_noise``), not the mean."""
    row = {k: v for k, v in r.row(**extra).items() if k != "step_time_s"}
    return {**row, **dict(zip(("median_step_s", "step_noise"), median_step(r)))}


def moving_average(x, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (shorter at the start), same length as ``x``."""
    c, idx = np.cumsum(np.insert(np.asarray(x, float), 0, 0.0)), np.arange(1, len(x) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def step_noise(losses) -> float:
    """Std of consecutive loss differences / sqrt(2): unlike the plain std, a slow downward trend barely moves it."""
    d = np.diff(np.asarray(losses, float))
    return float(np.std(d) / math.sqrt(2)) if len(d) >= 2 else math.nan


def loss_comparison(runs: dict, micro: int, window: int, judge_steps: int, tolerance: float = 0.1) -> tuple[dict, str]:
    """The sweep ``{k: run}`` read at equal optimizer steps (tail loss) and at equal target tokens (the smallest batch's
    whole run, within ``tolerance``): ({k: {"loss_at_equal_tokens", "tokens_at_comparison"}}, one line; "not judged"
    under ``judge_steps`` steps)."""
    steps, tokens = min(len(r.losses) for r in runs.values()), int(np.sum(runs[min(runs)].target_tokens))
    values = {}
    for k, r in runs.items():
        seen = np.cumsum(r.target_tokens)
        i = min(int(np.searchsorted(seen, tokens)), len(seen) - 1)
        near = abs(seen[i] / tokens - 1) <= tolerance
        values[k] = {"loss_at_equal_tokens": float(moving_average(r.losses, window)[i]) if near else None,
                     "tokens_at_comparison": int(seen[i]) if near else None}
    if steps < judge_steps:
        return values, (f"equal steps or equal tokens: not judged ({steps} steps per run; needs >= {judge_steps}); "
                        f"the losses are in the results table 'sweep'")
    same = {k: v["loss_at_equal_tokens"] for k, v in values.items() if v["tokens_at_comparison"] is not None}
    best, low = min(runs, key=lambda k: tail_loss(runs[k])), min(same, key=same.get)
    return values, (f"after {steps} steps B={micro * best} has the lowest loss ({tail_loss(runs[best]):.3f}); at equal "
                    f"tokens ({tokens:,}) B={micro * low} is lowest ({same[low]:.3f}) of "
                    + ", ".join(f"B={micro * k}" for k in same)
                    + ("" if len(same) == len(runs) else " (the others' first step already saw more tokens)"))


def plot_sweep(runs: dict, micro: int, window: int, title: str):
    """The sweep ``{k: run}`` at micro-batch ``micro``: loss per optimizer step (thin: each step; thick: trailing mean
    over ``window`` steps) and per target token seen (peak memory and throughput are the sweep table's columns)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k, r in runs.items():
        (line,) = axes[0].plot(step_numbers(r.losses), r.losses, lw=1, alpha=0.35)
        axes[0].plot(step_numbers(r.losses), moving_average(r.losses, window), color=line.get_color(),
                     label=f"{micro} x {k} (B={micro * k})")
        axes[1].plot(np.cumsum(r.target_tokens), r.losses, label=f"{micro} x {k} (B={micro * k})", alpha=0.85)
    step_axis(axes[0], "Optimizer step")
    axes[0].set(ylabel="Training loss (nats/token)", title=f"Loss per optimizer step (thick: mean over {window} steps)")
    axes[1].set(xlabel="Target tokens seen (log scale)", ylabel="Training loss (nats/token)", xscale="log",
                title="Loss per token seen (same data budget)")
    axes[1].xaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def stability_rows(runs: dict, micro: int, max_grad_norm: float | None) -> list[dict]:
    """Per run ``{k: run}``: loss std and CV, step-to-step noise (x sqrt(B): constant for sampling noise), grad-norm
    mean and std, steps above the clip threshold."""
    rows = []
    for k, r in runs.items():
        noise, G = step_noise(r.losses), np.array(r.grad_norms)
        rows.append({"run": f"{micro} x {k}", "effective_batch": micro * k, "loss_std": float(np.std(r.losses)),
                     "loss_cv": float(np.std(r.losses) / np.mean(r.losses)), "step_noise": noise,
                     "noise_x_sqrtB": noise * math.sqrt(micro * k), "grad_norm_mean": float(G.mean()),
                     "grad_norm_std": float(G.std()), "clipped_steps": int((G > (max_grad_norm or math.inf)).sum())})
    return rows


def plot_stability(runs: dict, rows: list[dict], micro: int, max_grad_norm: float | None):
    """The gradient norm per step of each run, and the step-to-step loss noise against 1/sqrt(B)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k, r in runs.items():
        axes[0].plot(step_numbers(r.grad_norms), r.grad_norms, label=f"B={micro * k}", alpha=0.8)
    axes[0].axhline(max_grad_norm or np.nan, color="red", ls=":", label="clip threshold")
    step_axis(axes[0], "Optimizer step")
    axes[0].set(ylabel="Gradient L2 norm (before clipping)", title="Gradient norm per step")
    Es, noises = np.array([s["effective_batch"] for s in rows]), np.array([s["step_noise"] for s in rows])
    axes[1].loglog(Es, noises, "o-", label="measured step-to-step noise")
    axes[1].loglog(Es, noises[0] * np.sqrt(Es[0] / Es), "k--", label="1/sqrt(B) from the smallest B")
    axes[1].set(xlabel="Effective batch B (samples, log scale)", ylabel="Loss noise (nats/token, log scale)",
                title="Step-to-step loss noise")
    axes[1].set_xticks(Es, [str(e) for e in Es])
    axes[1].xaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def lr_rows(runs: dict, plan: dict) -> list[dict]:
    """Per run ``{name: result}`` of the plan ``{name: config}``: lr, warm-up, batch, steps, samples, tail loss."""
    return [r.row(run=name, lr=plan[name].train.lr, warmup_steps=plan[name].train.warmup_steps,
                  effective_batch=plan[name].effective_batch_size, steps=len(r.losses),
                  samples_seen=plan[name].effective_batch_size * len(r.losses), tail_loss=tail_loss(r),
                  max_grad_norm_seen=max(r.grad_norms) if r.grad_norms else None) for name, r in runs.items()]


def plot_lr_scaling(runs: dict, plan: dict, window: int, b0: int, b1: int):
    """Moving-average loss against samples seen, each curve averaged over the samples of ``window`` steps at ``b0``."""
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


def linear_fit(x, y) -> tuple[float, float]:
    """Least-squares y = a + b x; returns (a, b). Needs two distinct x values."""
    if len(set(x)) < 2:
        raise ValueError("a line needs measurements at two or more distinct x values")
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(a), float(b)


def recommend(fixed_bytes: float, per_sample_bytes: float, budgets: dict, target_batch: int,
              measured: dict | None = None) -> list[dict]:
    """Per budget ``{label: bytes the allocator gets}``: the largest micro-batch whose fitted peak plus HEADROOM fits,
    the power of two at or below it (<= ``target_batch``) and the accumulation to it; ``measured``: tokens/s."""
    rows = []
    for label, budget in budgets.items():
        max_micro = int((budget / (1 + HEADROOM) - fixed_bytes) // per_sample_bytes) if per_sample_bytes > 0 \
            else target_batch
        micro = 2 ** int(math.log2(min(max_micro, target_batch))) if max_micro >= 1 else None
        accum = -(-target_batch // micro) if micro else None
        rows.append({"memory": label, "max_micro_batch": max(0, max_micro), "micro_batch": micro, "accum_steps": accum,
                     "effective_batch": micro * accum if micro else None,
                     "predicted_peak_bytes": fixed_bytes + per_sample_bytes * (micro or 1),
                     "tokens_per_s_measured": (measured or {}).get(micro), "advice":
                     "micro-batch 1 does not fit: add checkpointing (lab 03) or a smaller model" if not micro else
                     "no accumulation needed" if accum == 1 else f"accumulate {accum} micro-batches"})
    return rows


def accumulation_cost(runs: dict, micro: int) -> dict:
    """The cost of accumulating, measured once: the sweep ``{k: run}`` at the FIXED micro-batch ``micro``, fewest
    against most accumulation steps: time per micro-batch (median step time / k, with its noise) and the two peaks."""
    (k_lo, lo), (k_hi, hi) = min(runs.items()), max(runs.items())
    t = cl.timed_ratio([x / k_lo for x in cl.timed_step_times(lo)], [x / k_hi for x in cl.timed_step_times(hi)])
    return {"compares": f"{micro} x {k_lo} vs {micro} x {k_hi}", "micro_batch": micro, "k_lo": k_lo, "k_hi": k_hi,
            "time_cost": t["ratio"] - 1 if t["ratio"] else None, "time_cost_noise": t["spread"],
            "timed_steps": t["timed_steps"], "seconds_per_micro_batch_lo": t["median_a"],
            "seconds_per_micro_batch_hi": t["median_b"], "peak_lo_bytes": lo.peak_memory_bytes,
            "peak_hi_bytes": hi.peak_memory_bytes, "hardware": cl.hardware(lo.env),
            "memory_increase": hi.peak_memory_bytes / lo.peak_memory_bytes - 1
            if lo.peak_memory_bytes and hi.peak_memory_bytes else None}


def cost_line(cost: dict) -> str:
    """``cost`` (:func:`accumulation_cost`), worded by its sign and noise on a GPU; from a CPU the number, labelled."""
    change, noise, where = cost["time_cost"], cost["time_cost_noise"], cost["hardware"]
    head = f"the cost of accumulating ({cost['compares']}, time per micro-batch"
    if change is None:
        return f"{head}): no timed steps, not measured"
    head += (f", medians of {cost['timed_steps']} timed steps): {1e3 * cost['seconds_per_micro_batch_lo']:.1f} -> "
             f"{1e3 * cost['seconds_per_micro_batch_hi']:.1f} ms, {100 * change:+.0f} %"
             + (f" +-{100 * noise:.0f} %" if noise is not None else ""))
    return head + (" (CPU timing, not a GPU result: not read)" if cl.on_cpu(where) else
                   f" on {where}: within the noise, no measurable cost" if noise is None or abs(change) <= noise else
                   f" on {where}: each micro-batch got cheaper, the step's fixed work (AdamW, clipping, zero_grad) "
                   f"shared by more of them" if change < 0 else
                   f" on {where}: each micro-batch got MORE expensive with more accumulation steps")


def small_micro_batch_line(scan: dict, micro: int, target: int, cost: dict) -> str:
    """At effective batch ``target`` (``scan``: {micro-batch: run}): the throughput micro-batch ``micro`` gives up
    against the fastest split, the price of a small micro-batch, not of accumulating (``cost``). Not read on a CPU."""
    if cl.on_cpu(cost["hardware"]):
        return "the splits above are CPU timing: not read here (on a GPU: the price of a small micro-batch)"
    best = max(scan, key=lambda m: scan[m].target_tokens_per_second)
    price = 1 - scan[micro].target_tokens_per_second / scan[best].target_tokens_per_second
    return (f"{micro} x {target // micro} gives up {price:.0%} of the throughput of the fastest split that fits "
            f"({best} x {target // best}): the price of a small micro-batch, not of accumulating (that is "
            + (f"{100 * cost['time_cost']:+.0f} %, " if cost["time_cost"] is not None else "")
            + f"{cost['compares']})")


def c3_claim(cost: dict, cond: dict, *, grad_buffer: int) -> dict:
    """C3, "accumulation costs 0 % memory and ~5 % time", judged on the one measured ``cost`` (at a FIXED
    micro-batch); the extra memory is set beside one FP32 gradient buffer (``grad_buffer`` bytes)."""
    micro, pair = cost["micro_batch"], tuple(cost["compares"].split(" vs "))
    values, evidence = {"memory_increase": cost["memory_increase"]}, {}
    if cost["time_cost"] is not None:
        values["time_cost"], hw = cost["time_cost"], cond.get("hardware")
        evidence = {"time_cost": cl.Evidence(pair=pair, hardware=hw, timed_steps=cost["timed_steps"],
                                             spread=cost["time_cost_noise"], micro_batches=(micro, micro),
                                             note="median step time / accumulation steps, timed steps only"),
                    "memory_increase": cl.Evidence(pair=pair, hardware=hw, micro_batches=(micro, micro))}
    mem = cost["memory_increase"]
    extra = cost["peak_hi_bytes"] - cost["peak_lo_bytes"] if mem is not None else None
    reason = None if mem is None or mem <= 0 else (
        f"the extra {fmt_bytes(extra)} is about one FP32 gradient buffer ({fmt_bytes(grad_buffer)}), which lives next "
        f"to the activations of micro-batches 2..k" if abs(extra - grad_buffer) <= 0.1 * grad_buffer else
        f"one FP32 gradient buffer ({fmt_bytes(grad_buffer)}) lives next to the activations of micro-batches 2..k; "
        f"the extra measured here is {fmt_bytes(extra)}")
    return cl.claim_entry("C3", values, cond, reason=reason, **({"evidence": evidence} if evidence else {}),
                          extra={"compares": f"{cost['compares']} (the same micro-batch)",
                                 "measured_in": "results table 'accumulation_cost'"})
