"""Lab 04's figures: each function takes the rows a cell already measured and returns the figure. Bytes are drawn in GiB
from 1 GiB up, else MiB; steps are counted from 1, as in every lab's figures (:mod:`labutils.core.figures`). """
from __future__ import annotations

import numpy as np

from ...core.figures import legend_outside
from ..lab01.op_profile import GROUP_COLORS, OTHER

GiB, MiB = 2**30, 2**20
KIND_COLORS = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
               "logits": "#8172b3", "half_weights": "#937860", "temporaries": "#da8bc3", "data": "#8c8c8c",
               "workspace": "#ccb974"}


def _axes(title: str, ncols: int = 1, figsize=(8, 4.5), **kw):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize, **kw)
    (axes[0] if ncols > 1 else axes).set_title(title)
    return fig, axes


def _unit(max_bytes: float) -> tuple[int, str]:
    return (GiB, "GiB") if max_bytes >= GiB else (MiB, "MiB")


def _finish(fig, ax, grid: str = "both", **legend):
    """Legend (``legend``: its keyword arguments) and grid of a finished single-panel figure."""
    ax.legend(**legend)
    ax.grid(axis=grid, alpha=0.3)
    return fig


def plot_stacked(labels: list[str], parts: dict, ylabel: str, title: str, budget: float | None = None,
                 colors: dict | None = None):
    """One stacked bar per label, a segment per ``{part: [value per label]}`` (parts that are all zero left out),
    the budget as a dashed line: where the memory goes, bar by bar."""
    fig, ax = _axes(title, figsize=(10, 4.2))
    bottom = np.zeros(len(labels))
    for part, vals in parts.items():
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, color=(colors or {}).get(part), label=part.replace("_", " "))
            bottom += np.array(vals, dtype=float)
    if budget is not None:
        ax.axhline(budget, color="gray", ls="--", label="budget")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelsize=8)
    legend_outside(ax, fontsize=8)
    return fig


def plot_block_bytes(rows: list[dict], title: str):
    """What one transformer block saves for backward (rows: ``tensor`` and bytes per token x hidden unit per
    precision column), one stacked bar per precision, a segment per part of the block."""
    groups = {"attention": ("qkv", "sdpa", "attn"), "MLP (gelu chain)": ("gelu", "fc", "mlp"), "LayerNorm": ("ln",),
              "residual stream, dropout masks": ("block", "mid", "resid")}
    precisions = [k for k in rows[0] if k != "tensor"]
    return plot_stacked(precisions, {g: [sum(r.get(p) or 0 for r in rows if r["tensor"].startswith(pre))
                                         for p in precisions] for g, pre in groups.items()},
                        "bytes per (token x hidden unit)", title)


def plot_peak_breakdown(estimates: dict, budget_bytes: int, title: str):
    """Where the memory goes at the peak: one stacked bar per ``{label: estimate}`` (the estimator's
    ``peak_breakdown`` by kind), and the budget, in GiB."""
    return plot_stacked(list(estimates), {k: [e["peak_breakdown"].get(k, 0) / GiB for e in estimates.values()]
                                          for k in KIND_COLORS}, "GiB at the peak (estimate)", title,
                        budget_bytes / GiB, KIND_COLORS)


def plot_stages(rows: list[dict], peak_bytes: int, title: str):
    """One training step, stage by stage (rows with ``estimate`` and ``other``): allocated memory measured and
    estimated with the peak so far; and the same memory stacked by kind."""
    fig, (ax1, ax2) = _axes(title, 2, figsize=(10, 4.2))
    labels = [f"step {r['step'] + 1}: {r['stage']}" for r in rows]
    x = np.arange(len(rows))
    div, unit = _unit(peak_bytes)
    ax1.plot(x, [r["allocated"] / div for r in rows], "o-", label="measured allocated")
    ax1.plot(x, [r["peak so far"] / div for r in rows], "--", color="gray", label="measured peak so far")
    ax1.plot(x, [r["estimate"] / div for r in rows], "x", ms=9, color="red", label="estimate")
    bottom = np.zeros(len(rows))
    for key, kind, label in (("params", "weights", "weights"), ("grads", "grads", "grads"),
                             ("optimizer", "optimizer", "AdamW state"),
                             ("other", "activations", "activations + data + temporaries")):
        vals = np.array([r[key] / div for r in rows])
        ax2.bar(x, vals, bottom=bottom, color=KIND_COLORS[kind], label=label)
        bottom += vals
    ax2.set_title("Allocated memory by kind")
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        legend_outside(ax, fontsize=8)
    fig.tight_layout()
    return fig


def plot_batch_sweep(sweep: list[dict], fixed: float, per_sample: float, estimate_peak, budget_bytes: int, title: str):
    """Measured peaks against micro-batch size, the fitted line, the estimator (``estimate_peak(batch)``), OOM rows
    hollow at their estimate (not measured), and the budget."""
    ok = [r for r in sweep if r["status"] == "ok"]
    oom = [r for r in sweep if r["status"] != "ok"]
    fig, ax = _axes(title)
    grid = np.arange(1, max(r["micro_batch"] for r in sweep) + 1)
    div, unit = _unit(max([r["peak (GiB)"] * GiB for r in ok] + [budget_bytes]))
    ax.plot([r["micro_batch"] for r in ok], [r["peak (GiB)"] * GiB / div for r in ok], "o", ms=8, label="measured peak")
    ax.plot(grid, (fixed + per_sample * grid) / div, "-",
            label=f"fit: {fixed / div:.3g} {unit} + {per_sample / MiB:.3g} MiB/sample")
    ax.plot(grid, [estimate_peak(b) / div for b in grid], ":", color="red", label="estimator")
    if oom:
        ax.plot([r["micro_batch"] for r in oom], [r["estimate (GiB)"] * GiB / div for r in oom], "o", mfc="none",
                mec="black", ms=10, ls="none", label="OOM: not measured (drawn at its estimate)")
    ax.axhline(budget_bytes / div, color="gray", ls="--", lw=1, label="budget (an 8 GB card)")
    ax.set(xlabel="micro-batch size (sequences)", ylabel=f"peak allocated ({unit})")
    return _finish(fig, ax, fontsize=8)


def plot_profile_ops(rows: list[dict], title: str, n: int = 8):
    """Two panels from :func:`labutils.labs.lab04.profiling.profiler_op_rows`: the ``n`` ops with the most self time, and the
    ``n`` that allocate the most memory they do not free themselves (self memory), coloured by op group."""
    from matplotlib.patches import Patch

    fig, axes = _axes(title, 2, figsize=(10, 3.6))
    for ax, key, xlabel in ((axes[0], "self time (ms)", "self time per step (ms)"),
                            (axes[1], "self memory (MiB)", "self memory per step (MiB): not freed in the op")):
        top = sorted(rows, key=lambda r: -r[key])[:n][::-1]
        ax.barh([r["op"].replace("aten::", "") for r in top], [r[key] for r in top],
                color=[GROUP_COLORS.get(r["group"], GROUP_COLORS[OTHER]) for r in top])
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    axes[1].legend(handles=[Patch(color=c, label=g) for g, c in GROUP_COLORS.items()], fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_op_changes(rows: list[dict], title: str):
    """The slowest ops before and after the fix (:func:`labutils.labs.lab04.profiling.op_change_rows`): median self time per
    step, each op's own noise as error bars; ``*``: the fix changed the op's calls."""
    fig, ax = _axes(title, figsize=(9, 0.35 * len(rows) + 1.2))
    y = np.arange(len(rows))[::-1]
    for dy, side, color in ((0.2, "before", "#c44e52"), (-0.2, "after", "#4c72b0")):
        ms, noise = np.array([[r[f"{side} (ms)"], r[f"{side} noise (ms)"] or 0.0] for r in rows]).T
        # a time is never below 0: its error bar stops there, without caps the frame at 0 would cut (figures.unseen)
        ax.barh(y + dy, ms, height=0.4, xerr=[np.minimum(noise, ms), noise], color=color, label=side, capsize=0)
    ax.set_yticks(y, [r["op"].replace("aten::", "") + (" *" if "call" in r["reading"] or "fix" in r["reading"] else "")
                      for r in rows], fontsize=8)
    ax.set_xlabel("self time per step (ms): median of the profiled steps, +/- its own noise; *: calls changed")
    return _finish(fig, ax, "x", loc="lower right")


def plot_snapshot(summary: dict, title: str):
    """A memory snapshot's two offline views (:func:`labutils.labs.lab04.profiling.trace_summary`): allocated memory over time
    with the peak marked, and the largest holders at the peak."""
    fig, (ax1, ax2) = _axes(title, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    div, unit = _unit(max(summary["bytes"], default=0))
    ys = [b / div for b in summary["bytes"]]
    ax1.plot(summary["t"], ys, lw=1.2, label="allocated")
    if ys:
        i = summary["peak_index"]
        ax1.scatter([summary["t"][i]], [ys[i]], color="red", zorder=3, label=f"peak {ys[i]:.3g} {unit}")
    ax1.set(xlabel=f"time ({summary['time_unit']})", ylabel=f"allocated ({unit})")
    _finish(fig, ax1, loc="upper left")
    top = summary["top_at_peak"][::-1]
    ax2.barh([r["site"][:45] for r in top], [r["bytes"] / MiB for r in top], color="#8172b3")
    ax2.set(xlabel="MiB held at the peak", title="Who holds memory at the peak")
    ax2.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    return fig


def plot_techniques(rows: list[dict], budget_bytes: int, title: str):
    """One bar per technique row: its measured peak, or a hatched bar at its estimate where it ran out of memory;
    the estimator's peak of every row as a cross, and the budget."""
    fig, ax = _axes(title, figsize=(10, 4.5))
    div, unit = _unit(max(r["estimate (GiB)"] for r in rows) * GiB)
    est = [r["estimate (GiB)"] * GiB / div for r in rows]   # the estimator's crosses: each label goes above its own
    for i, r in enumerate(rows):
        ok = r["status"] == "ok"
        h, color = (r["peak (GiB)"] * GiB / div if ok else est[i]), "#4c72b0" if ok else "#c44e52"
        ax.bar(i, h, color=color if ok else "white", edgecolor=color, hatch="" if ok else "//")
        ax.annotate(f"{h:.3g}" if ok else "OOM\n(estimate)", (i, max(h, est[i])), xytext=(0, 7),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.plot(range(len(rows)), est, "x", color="red", ms=9, label="estimator")
    ax.axhline(budget_bytes / div, color="gray", ls="--", label="budget (an 8 GB card)")
    ax.set_xticks(range(len(rows)), [r["technique"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel(f"peak allocated ({unit})")
    return _finish(fig, ax, "y")


def plot_leak(curves: dict, variants):
    """Allocated memory above the start after each training step, one line per way of keeping the loss."""
    fig, ax = _axes("Keeping loss tensors: only graphs without backward leak", figsize=(8, 4))
    for name, style in zip(variants, ("o-", "s--", "^:", "v-.")):  # two flat lines at 0 MiB: told apart by style
        ax.plot(range(1, len(curves[name]) + 1), [y / MiB for y in curves[name]], style, label=name)
    ax.set(xlabel="training step", ylabel="allocated above start (MiB)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _finish(fig, ax, fontsize=8)


def plot_estimate_vs_measured(rows: list[dict], title: str):
    """Each run's estimate against its measurement, the diagonal and a +/-10 % band."""
    fig, ax = _axes(title, figsize=(5.5, 5))
    m = np.array([r["measured_bytes"] for r in rows]) / MiB
    e = np.array([r["estimated_bytes"] for r in rows]) / MiB
    ax.plot(m, e, "o")
    lim = [0, max(m.max(), e.max()) * 1.1]
    ax.plot(lim, lim, "k-", lw=1, label="estimate = measured")
    ax.fill_between(lim, [v * 0.9 for v in lim], [v * 1.1 for v in lim], color="gray", alpha=0.2, label="+/-10%")
    ax.set(xlabel=f"measured ({rows[0]['basis']}, MiB)", ylabel="estimated (MiB)")
    return _finish(fig, ax)
