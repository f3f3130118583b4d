"""Lab 04's figures: each function takes the rows a cell already measured and returns the figure (the cell keeps
``figures[...] = fig`` and ``plt.show()``). Bytes are drawn in GiB from 1 GiB up, else MiB (:func:`byte_unit`).

* :func:`plot_stages`: one training step, stage by stage, measured next to the estimate, and by kind (section 4);
* :func:`plot_batch_sweep`: peak memory against micro-batch size, the fitted line and the estimator (section 5);
* :func:`plot_trace`: allocated memory over time from a memory snapshot's trace (section 7);
* :func:`plot_techniques`: the peak of each technique under the 8 GB budget, OOM rows as estimates (section 8);
* :func:`plot_leak`: allocated memory step after step for each way of keeping the loss (section 9);
* :func:`plot_estimate_vs_measured`: every run's estimate against its measurement (section 10).
"""
from __future__ import annotations

import numpy as np

from .figures import legend_outside

GiB, MiB = 2**30, 2**20


def byte_unit(max_bytes: float) -> tuple[int, str]:
    """(divisor, name) for plotting: GiB from 1 GiB up, else MiB."""
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def plot_stages(rows: list[dict], peak_bytes: int, title: str):
    """Two panels from the stage-by-stage rows (with ``estimate`` and ``other``): allocated memory at each stage,
    measured and estimated, with the peak so far; and the same memory stacked by kind (weights, gradients, AdamW
    state, everything else)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
    labels = [f"step {r['step'] + 1}: {r['stage']}" for r in rows]  # steps numbered from 1 in every figure
    x = np.arange(len(rows))
    div, unit = byte_unit(peak_bytes)
    ax1.plot(x, [r["allocated"] / div for r in rows], "o-", label="measured allocated")
    ax1.plot(x, [r["peak so far"] / div for r in rows], "--", color="gray", label="measured peak so far")
    ax1.plot(x, [r["estimate"] / div for r in rows], "x", ms=9, color="red", label="estimate")
    ax1.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
    ax1.set_ylabel(unit)
    ax1.set_title(title)
    legend_outside(ax1)  # off the data: right of each panel (the stage names fill the space below)
    ax1.grid(alpha=0.3)
    bottom = np.zeros(len(rows))
    for key, color in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868"), ("other", "#c44e52")):
        vals = np.array([r[key] / div for r in rows])
        ax2.bar(x, vals, bottom=bottom, color=color,
                label={"optimizer": "AdamW state", "other": "activations + data + temporaries"}.get(key, key))
        bottom += vals
    ax2.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
    ax2.set_ylabel(unit)
    ax2.set_title("Allocated memory by kind")
    legend_outside(ax2, fontsize=8)
    fig.tight_layout()
    return fig


def plot_batch_sweep(sweep: list[dict], fixed: float, per_sample: float, estimate_peak, budget_bytes: int,
                     title: str):
    """The batch sweep's measured peaks, the fitted line ``fixed + per_sample x batch``, the estimator's peak
    (``estimate_peak(batch)`` in bytes) for every batch up to the largest, OOM rows drawn hollow at their estimate
    (labelled: not measured), and
    the budget."""
    import matplotlib.pyplot as plt

    ok = [r for r in sweep if r["status"] == "ok"]
    bs = np.array([r["micro_batch"] for r in ok], dtype=float)
    peaks = np.array([r["peak (GiB)"] * GiB for r in ok])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    grid = np.arange(1, max(r["micro_batch"] for r in sweep) + 1)
    div, unit = byte_unit(max(peaks.max(), budget_bytes))
    ax.plot(bs, peaks / div, "o", ms=8, label="measured peak")
    ax.plot(grid, (fixed + per_sample * grid) / div, "-",
            label=f"fit: {fixed / div:.3g} {unit} + {per_sample / MiB:.3g} MiB/sample")
    ax.plot(grid, [estimate_peak(b) / div for b in grid], ":", color="red", label="estimator")
    oom = [r for r in sweep if r["status"] != "ok"]
    if oom:  # nothing was measured for these: drawn hollow, at the estimator's size, and labelled so
        ys = [r["estimate (GiB)"] * GiB / div for r in oom]
        ax.plot([r["micro_batch"] for r in oom], ys, "o", mfc="none", mec="black", ms=10, ls="none",
                label="OOM: not measured (drawn at its estimate)")
        for r, y in zip(oom, ys):
            ax.annotate("OOM (estimate)", (r["micro_batch"], y), textcoords="offset points", xytext=(6, -4), fontsize=8)
    ax.axhline(budget_bytes / div, color="gray", ls="--", lw=1, label="budget")
    ax.set_xlabel("micro-batch size (sequences)")
    ax.set_ylabel(f"peak allocated ({unit})")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def plot_trace(summary: dict, ax=None, title: str = "Allocated memory over time", budget_bytes=None):
    """Allocated memory over time from :func:`labutils.profiling.trace_summary`, the peak marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    div, unit = byte_unit(max(summary["bytes"], default=0))
    ys = [b / div for b in summary["bytes"]]
    ax.plot(summary["t"], ys, lw=1.2, label="allocated")
    if ys:
        i = summary["peak_index"]
        ax.scatter([summary["t"][i]], [ys[i]], color="red", zorder=3, label=f"peak {ys[i]:.3g} {unit}")
    if budget_bytes:
        ax.axhline(budget_bytes / div, color="gray", ls="--", lw=1, label="budget")
    ax.set_xlabel(f"time ({summary['time_unit']})")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_title(title)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return ax


def plot_techniques(rows: list[dict], budget_bytes: int, title: str):
    """One bar per technique row: its measured peak, or a hatched bar at the estimate where it ran out of memory;
    the estimator's peak of every row as a cross, and the budget."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = np.arange(len(rows))
    div, unit = byte_unit(max(r["estimate (GiB)"] for r in rows) * GiB)
    for i, r in enumerate(rows):
        if r["status"] == "ok":
            ax.bar(i, r["peak (GiB)"] * GiB / div, color="#4c72b0")
            ax.text(i, r["peak (GiB)"] * GiB / div, f"{r['peak (GiB)'] * GiB / div:.3g}", ha="center", va="bottom",
                    fontsize=8)
        else:
            ax.bar(i, r["estimate (GiB)"] * GiB / div, color="white", edgecolor="#c44e52", hatch="//")
            ax.text(i, r["estimate (GiB)"] * GiB / div, "OOM\n(estimate)", ha="center", va="bottom", fontsize=8,
                    color="#c44e52")
    ax.plot(xs, [r["estimate (GiB)"] * GiB / div for r in rows], "x", color="red", ms=9, label="estimator")
    ax.axhline(budget_bytes / div, color="gray", ls="--", label="budget")
    ax.set_xticks(xs, [r["technique"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel(f"peak allocated ({unit})")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_leak(curves: dict, variants):
    """Allocated memory above the start after each training step, one line per way of keeping the loss
    (``curves[variant]``: bytes after step 1, 2, ...)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in variants:
        ys = curves[name]
        ax.plot(range(1, len(ys) + 1), [y / MiB for y in ys], "o-", label=name)
    ax.set_xlabel("training step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("allocated above start (MiB)")
    ax.set_title("Keeping loss tensors: only graphs without backward leak")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def plot_estimate_vs_measured(rows: list[dict], title: str):
    """Each run's estimate against its measurement (rows with ``measured_bytes``, ``estimated_bytes`` and
    ``basis``), the diagonal and a +/-10 % band."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    m = np.array([r["measured_bytes"] for r in rows]) / MiB
    e = np.array([r["estimated_bytes"] for r in rows]) / MiB
    ax.plot(m, e, "o")
    lim = [0, max(m.max(), e.max()) * 1.1]
    ax.plot(lim, lim, "k-", lw=1, label="estimate = measured")
    ax.fill_between(lim, [v * 0.9 for v in lim], [v * 1.1 for v in lim], color="gray", alpha=0.2, label="+/-10%")
    ax.set_xlabel(f"measured ({rows[0]['basis']}, MiB)")
    ax.set_ylabel("estimated (MiB)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig
