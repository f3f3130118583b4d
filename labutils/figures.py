"""Conventions every lab's figures follow.

Steps: optimizer steps are numbered from 1 in every figure (the first update is step 1, as a person counts, and
as the x axis of a loss curve reads: after 1 step, after 2 steps...). The training loop keeps Python's 0-based
indices internally (``RunResult.skipped``, ``inject_overflow_at``); a figure adds 1 (:func:`step_numbers`).
Step axes get integer ticks only (:func:`step_axis`). Legends go where they hide no data: ``loc="best"``, or
outside the axes (:func:`legend_outside`) where a panel has no free corner.
"""
from __future__ import annotations

FIRST_STEP = 1  # the number of the first optimizer step in every figure


def step_numbers(values) -> range:
    """The x values of a per-step series: FIRST_STEP, FIRST_STEP + 1, ... one per value."""
    return range(FIRST_STEP, FIRST_STEP + len(values))


def step_axis(ax, label: str = "optimizer step"):
    """Label the x axis as a step axis and give it integer ticks only (no 1.5 steps). Returns ``ax``."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_label_text(label)
    return ax


def legend_outside(ax, **kwargs):
    """A legend to the right of the axes, where it covers no curve (for panels with no free corner)."""
    return ax.legend(bbox_to_anchor=(1.01, 1), loc="upper left", borderaxespad=0.0, **kwargs)


__all__ = ["FIRST_STEP", "step_numbers", "step_axis", "legend_outside"]
