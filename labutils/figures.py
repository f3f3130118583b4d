"""Conventions every lab's figures follow: optimizer steps are numbered from 1, as a person counts (the training
loop keeps 0-based indices; :func:`step_numbers` adds 1), step axes get integer ticks (:func:`step_axis`), and
legends hide no data (``loc="best"``, or :func:`legend_outside` where a panel has no free corner).
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
