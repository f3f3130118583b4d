"""``bench``: a bare loop with its own device-resident data, ABBA order, mean +- spread over the repeats."""
import pytest

import labutils as lu
from labutils import bench as bench_mod

from conftest import tiny_config


def test_abba_order():
    """Breaks if the loops stop alternating (always bare first hides warm-up drift in the first of each pair)."""
    assert bench_mod.abba(3) == ["bare", "labutils", "labutils", "bare", "bare", "labutils"]


def test_bench_reports_mean_and_spread_over_abba_repeats(monkeypatch, capsys):
    """Five runs of each loop, in ABBA order (observed by spies that call through), each reported with
    mean +- std and median; the bare loop never touches labutils' data path (``LMDataset.windows``).
    Breaks if bench reverts to a median of 3 always bare first, or the bare loop samples through labutils."""
    order, windows_calls = [], []
    real_bare, real_train, real_windows = bench_mod.bare_loop, bench_mod.train, lu.LMDataset.windows

    def bare(*a, **k):
        order.append("bare")
        before = len(windows_calls)
        out = real_bare(*a, **k)
        assert len(windows_calls) == before  # its own data path
        return out

    def ours(*a, **k):
        order.append("labutils")
        return real_train(*a, **k)

    def windows(self, *a, **k):
        windows_calls.append(1)
        return real_windows(self, *a, **k)
    monkeypatch.setattr(bench_mod, "bare_loop", bare)
    monkeypatch.setattr(bench_mod, "train", ours)
    monkeypatch.setattr(lu.LMDataset, "windows", windows)
    cfg = tiny_config(data__pack=True, train__steps=3, data__seq_length=32)
    out = bench_mod.bench(cfg, repeats=5, device="cpu")
    assert order == bench_mod.abba(5)
    for name in ("bare", "labutils"):
        s = out["eager"][name]
        assert len(s["runs"]) == 5 and all(x > 0 for x in s["runs"])
        assert s["mean"] == pytest.approx(sum(s["runs"]) / 5) and s["std"] > 0
        assert min(s["runs"]) <= s["median"] <= max(s["runs"])
    assert out["ratio"] == pytest.approx(out["eager"]["labutils"]["mean"] / out["eager"]["bare"]["mean"])
    assert out["order"] == "ABBA" and out["repeats"] == 5
    assert out["eager"]["num_alloc_retries"] == {"bare": [None] * 5, "labutils": [None] * 5}  # CPU: no allocator
    printed = capsys.readouterr().out
    assert "+-" in printed and "median" in printed and "not a GPU measurement" in printed
