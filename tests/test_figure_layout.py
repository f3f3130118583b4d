"""Legends that hide something (the H200 run's every_k figure: two legends side by side below its panels, the right
one over the other and off the figure). :func:`labutils.core.figures.unseen` measures the drawn figure
(matplotlib's own window extents); ``record_results`` prints a warning for each problem, and no lab's figure may
have one in the session's run."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import labutils as lu  # noqa: E402
from labutils.core.figures import legend_outside, unseen  # noqa: E402
from labutils.labs.registry import IDS as LABS  # noqa: E402


def two_panels(labels=3):
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax in axes:
        for i in range(labels):
            ax.plot([0, 1], [i, i + 1], label=f"a long series name {i}")
    return fig, axes


def test_a_legend_set_outside_onto_the_next_panel_is_found():
    fig, (left, right) = two_panels()
    legend_outside(left)
    assert unseen(fig) == ["legend 1 covers panel 2"]
    plt.close(fig)


def test_two_figure_legends_over_each_other_are_found():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="x" * 40)
    fig.legend(loc="lower left", bbox_to_anchor=(0, -0.2))
    fig.legend(loc="lower left", bbox_to_anchor=(0.3, -0.2))
    assert unseen(fig) == ["legends 1 and 2 overlap"]
    plt.close(fig)


def test_legends_in_their_own_panel_or_beside_the_last_one_pass():
    fig, (left, right) = two_panels()
    left.legend()
    legend_outside(right)
    twin = left.twinx()  # a twin axis shares its panel: a legend there is inside its own panel
    twin.plot([0, 1], [1, 0], label="other scale")
    twin.legend(loc="lower right")
    assert unseen(fig) == []
    plt.close(fig)


def test_a_curve_drawn_over_another_in_the_same_style_is_found():
    """Issue 44 §7: lab 01's fp32, fp16 and bf16 losses agree within 3e-4, so one line hid the other two while the
    legend listed three. Breaks if such a curve is not found, or if one told apart by its style (a dashed line with
    markers over a solid one) or by its values is."""
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([1, 2, 3], [5.0, 4.0, 3.0], label="fp32")
    ax.plot([1, 2, 3], [5.0, 4.0003, 3.0], label="fp16")
    ax.plot([1, 2, 3], [5.2, 4.5, 3.5], label="another run")
    assert unseen(fig) == ["panel 1: 'fp16' hides 'fp32'"]
    ax.lines[1].set(linestyle="--", marker="o")
    assert unseen(fig) == []
    plt.close(fig)


def test_a_figure_wider_than_the_output_area_is_found():
    """Issue 44 §7: figures 12-15 in wide were shrunk to 67-85 % in JupyterLab's ~1,000-pixel output area (at
    matplotlib's 100 dpi), their labels 6-7 px. Breaks if such a figure passes, or a 10-in one is flagged."""
    for width, found in ((14, ["14 in wide: shrunk to 71% in a 1,000-px output area"]), (10, [])):
        fig, ax = plt.subplots(figsize=(width, 3))
        assert unseen(fig) == found
        plt.close(fig)


def test_a_text_over_a_marker_is_found():
    """Issue 44 §7: lab 04 §8's value labels sat on the estimator's crosses. Breaks if a text drawn over a marker
    passes, or one set above it is flagged."""
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [1.0, 2.0], "x", ms=9, label="estimator")
    ax.text(1, 2.0, "2.0", ha="center", va="bottom")
    assert unseen(fig) == ["panel 1: '2.0' covers a marker"]
    ax.texts[0].remove()
    ax.annotate("2.0", (1, 2.0), xytext=(0, 7), textcoords="offset points", ha="center", va="bottom")
    assert unseen(fig) == []
    plt.close(fig)


def test_a_marker_cut_by_the_frame_is_found():
    """Issue 44 §7: lab 01's loss-scale plot showed markers cut off by the frame. Breaks if a marker (a line's or a
    scatter's) centred on the axes' limit passes, or if one with room around it, or one drawn unclipped, is flagged."""
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], "o-", ms=8)
    ax.set_xlim(0, 1)
    assert unseen(fig) == ["panel 1: the frame cuts a marker"]
    ax.set(xlim=(-0.1, 1.1), ylim=(-0.1, 1.1))
    ax.scatter([1.1], [0.5], s=70)  # a scatter's marker on the right edge
    assert unseen(fig) == ["panel 1: the frame cuts a marker"]
    ax.collections[0].set_clip_on(False)  # drawn whole, over the frame
    assert unseen(fig) == []
    plt.close(fig)


@pytest.mark.parametrize("after_ms, after_noise", [(0.0, 0.0), (0.5, 0.5)])
def test_lab04_slow_ops_error_bars_that_reach_zero_are_not_cut(after_ms, after_noise):
    """Lab 04's slowest-ops figure (CI's smoke run, 2026-11-29): an op the fix removed (0 ms) or whose noise reaches 0
    put an error bar's cap on the frame at 0, half cut off. A time's bar now stops at 0, without caps. Breaks if a cap
    sits on the frame again."""
    from labutils.labs.lab04.profiling_figures import plot_op_changes

    rows = [{"op": "aten::mm", "before (ms)": 1.0, "before noise (ms)": 0.1, "after (ms)": after_ms,
             "after noise (ms)": after_noise, "reading": "fix"},
            {"op": "aten::add", "before (ms)": 0.2, "before noise (ms)": None, "after (ms)": 0.1,
             "after noise (ms)": 0.01, "reading": ""}]
    fig = plot_op_changes(rows, "slowest ops")
    assert unseen(fig) == []
    plt.close(fig)


def test_record_results_warns_of_a_hidden_legend(tmp_path, capsys):
    fig, (left, right) = two_panels()
    legend_outside(left)
    lu.record_results("99-Layout", {"t": [{"a": 1}]}, {"bad": fig}, out_dir=tmp_path, mode="smoke")
    assert "warning: figure 'bad': legend 1 covers panel 2" in capsys.readouterr().err
    plt.close(fig)


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.regen_labs(lab)) for lab in LABS])
def test_no_lab_figure_hides_a_legend(lab):
    """Every figure every lab records, drawn as saved: no warning from unseen in the executed copy."""
    from tests import regen_once

    run = regen_once.run_for([lab])
    [executed] = (run.out / "executed").glob(f"{lab}-*.ipynb")
    text = "".join(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                   for c in json.loads(executed.read_text())["cells"] for o in c.get("outputs", []))
    assert "warning: figure" not in text, [line for line in text.splitlines() if "warning: figure" in line]
