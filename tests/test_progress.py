"""Progress bars as a student sees them (issue 44 §7). In JupyterLab a run that ran out of memory left its bar frozen
where it stopped, often red (tqdm's widget turns red on an error): "three red bars at 33 % right above the table that
says oom" read as a crash; and every widget bar of a saved notebook reopened as "Error displaying widget: model not
found". Now the bar is text (no widget), cleared when the run ends, and a run that stops says so in one line.
The oracle is what a terminal or an output area shows of the stream: each line's text after its last carriage
return (how tqdm redraws and clears a bar)."""
import pytest

import labutils as lu

from tests.conftest import tiny_config


def visible(text: str) -> list[str]:
    return [shown for line in text.split("\n") if (shown := line.rsplit("\r", 1)[-1]).strip()]


def shown_after(capsys, **run_kw) -> tuple[list[str], object]:
    capsys.readouterr()
    try:
        result = lu.run(tiny_config(train__steps=3), "cpu", progress=True, verbose=False, desc="bar", **run_kw)
    except KeyboardInterrupt as exc:
        result = exc
    got = capsys.readouterr()
    return visible(got.out + got.err), result


@pytest.fixture(autouse=True)
def bars_on(monkeypatch):
    monkeypatch.setenv("LAB_PROGRESS", "1")


def test_a_finished_run_leaves_no_bar(capsys):
    """Breaks if the bar were left drawn (leave=True) or a stop line were printed for a run that finished."""
    lines, result = shown_after(capsys)
    assert result.status == "ok" and lines == [], lines


def test_a_run_out_of_memory_clears_its_bar_and_says_so_in_one_line(capsys):
    """A CPU budget below the first step's peak: the run becomes an "oom" row. Before, the bar was closed only after
    a finished loop (here its garbage collection cleared it; in a notebook tqdm's widget stayed, red) and no line
    said why it stopped. Breaks if the line went away, or the bar stayed on screen."""
    lines, result = shown_after(capsys, cpu_budget_bytes=1)
    assert result.status == "oom"
    assert lines == ["bar: stopped in step 1 of 3: out of memory"], lines


def test_ctrl_c_clears_the_bar_and_says_where_it_stopped(capsys):
    def interrupt(step, *_):
        if step == 1:
            raise KeyboardInterrupt

    lines, result = shown_after(capsys, on_step=interrupt)
    assert isinstance(result, KeyboardInterrupt)
    assert lines == ["bar: stopped in step 2 of 3: interrupted"], lines


def test_no_bar_and_no_line_when_bars_are_off(capsys, monkeypatch):
    monkeypatch.setenv("LAB_PROGRESS", "0")  # regenerate's kernels: an executed copy keeps no bar
    lines, result = shown_after(capsys, cpu_budget_bytes=1)
    assert result.status == "oom" and lines == [], lines
