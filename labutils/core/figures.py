"""Conventions every lab's figures follow: optimizer steps are numbered from 1, as a person counts (the training loop
keeps 0-based indices; :func:`step_numbers` adds 1), step axes get integer ticks (:func:`step_axis`), and legends hide
no data (``loc="best"``, or :func:`legend_outside` where a panel has no free corner)."""
from __future__ import annotations

import numpy as np

FIRST_STEP = 1  # the number of the first optimizer step in every figure


def step_numbers(values) -> range:
    """The x values of a per-step series: FIRST_STEP, FIRST_STEP + 1, ... one per value."""
    return range(FIRST_STEP, FIRST_STEP + len(values))


def step_axis(ax, label: str = "optimizer step"):
    """Label the x axis as a step axis and give it integer ticks only (no 1.5 steps). Returns ``ax``."""
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.xaxis.set_label_text(label)
    return ax


def legend_outside(ax, **kwargs):
    """A legend to the right of the axes, where it covers no curve (for panels with no free corner)."""
    return ax.legend(bbox_to_anchor=(1.01, 1), loc="upper left", borderaxespad=0.0, **kwargs)


def unseen(fig) -> list[str]:
    """What a reader could not see on ``fig`` as drawn: more than 10 in wide (JupyterLab shrinks it); a legend over a
    legend, or over a panel not its own (two legends side by side under the panels, or one set outside onto the next);
    a labelled curve drawn over another in the same style, within 0.5 % of its panel's height; a text over a marker;
    a marker cut by its panel's frame."""
    fig.canvas.draw()
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend()] + [(None, lg) for lg in fig.legends]
    boxes = [(own, lg.get_window_extent()) for own, lg in legends]
    found = [f"{w:g} in wide: shrunk to {10 / w:.0%} in a 1,000-px output area" for w in [fig.get_figwidth()] if w > 10]
    found += [f"legends {i + 1} and {j + 1} overlap" for i, (_, a) in enumerate(boxes)
              for j, (_, b) in enumerate(boxes) if i < j and a.overlaps(b)]
    for k, ax in enumerate(fig.axes):
        lines = [(ln, np.asarray(ln.get_xydata(), float)) for ln in ax.get_lines() if ln.get_label()[:1] != "_"]
        found += [f"panel {k + 1}: '{b.get_label()}' hides '{a.get_label()}'" for i, (a, xa) in enumerate(lines)
                  for b, xb in lines[i + 1:] if len(xa) > 1 and xa.shape == xb.shape and np.allclose(xa[:, 0], xb[:, 0])
                  and np.abs(xa[:, 1] - xb[:, 1]).max() <= 0.005 * abs(np.subtract(*ax.get_ylim()))
                  and (a.get_linestyle(), a.get_marker()) == (b.get_linestyle(), b.get_marker())]
        marks = [(ln.get_transform().transform(np.asarray(ln.get_xydata(), float)), [ln.get_markersize()], ln)
                 for ln in ax.get_lines() if str(ln.get_marker()).strip() not in ("", "None")]
        found += [f"panel {k + 1}: '{t.get_text()}' covers a marker" for t in ax.texts if t.get_text().strip()
                  and any(t.get_window_extent().contains(*p) for d, _, _ in marks for p in d)]
        marks += [(c.get_offset_transform().transform(np.asarray(c.get_offsets(), float)), np.sqrt(c.get_sizes()), c)
                  for c in ax.collections if len(getattr(c, "get_sizes", list)())]
        (x0, y0), (x1, y1) = ax.bbox.get_points()  # centres px, widths pt: a frame cuts a clipped one within its radius
        found += [f"panel {k + 1}: the frame cuts a marker"] * any(np.any((g < r - 0.5) & (g > -r)) for g, r in [(
            np.minimum.reduce([d[:, 0] - x0, x1 - d[:, 0], d[:, 1] - y0, y1 - d[:, 1]]), np.asarray(w) * fig.dpi / 144)
            for d, w, a in marks if a.get_clip_on()])
    return found + [f"legend {i + 1} covers panel {k + 1}" for i, (own, box) in enumerate(boxes)
                    for k, ax in enumerate(fig.axes) if ax is not own and box.overlaps(ax.get_window_extent())
                    and (own is None or ax.get_position().bounds != own.get_position().bounds)]  # a twin: its own
