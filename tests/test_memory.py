import pytest
import torch

import labutils as lu


def test_cpu_tracker_sees_100mb_and_returns_to_baseline():
    with lu.MemoryTracker("cpu") as mt:
        base = mt.current_bytes()
        x = torch.empty(100 * 10**6, dtype=torch.uint8)
        x.fill_(1)
        assert mt.current_bytes() - base >= 100 * 10**6
        del x
        assert mt.current_bytes() == base
    assert mt.peak_bytes - mt.start_bytes >= 100 * 10**6
    assert mt.end_bytes == mt.start_bytes


def test_cpu_tracker_counts_preexisting_tensors_and_views_once():
    keep = torch.zeros(10**6)  # 4 MB alive before the region
    with lu.MemoryTracker("cpu") as mt:
        view = keep[10:]  # a view: same storage, no new bytes
        assert mt.current_bytes() == mt.start_bytes
        y = keep * 2
        assert mt.current_bytes() - mt.start_bytes == 4 * 10**6
    assert mt.start_bytes >= 4 * 10**6
    del view, y


def test_cpu_tracker_measures_backward_activations_and_marks():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(512, 256)
    with lu.MemoryTracker("cpu") as mt:
        y = model(x)
        after_fwd = mt.mark("after forward")
        y.square().mean().backward()
        mt.mark("after backward")
        del y
    labels = [t[0] for t in mt.timeline]
    assert labels == ["after forward", "after backward"]
    # forward keeps at least the 512x1024 hidden activation (2 MB) alive for backward
    assert after_fwd - mt.start_bytes >= 512 * 1024 * 4
    state = lu.state_bytes(model)
    assert state["grads"] == state["params"] > 0


def test_cpu_budget_raises_out_of_memory():
    with pytest.raises(torch.OutOfMemoryError, match="simulated out of memory"):
        with lu.MemoryTracker("cpu", cpu_budget_bytes=10 * 2**20) as mt:
            keep = [torch.empty(2**20)]
            keep.append(torch.empty(4 * 2**20))  # 4 MB + 16 MB > the 10 MiB budget
    assert mt is not None


def test_tracker_reports_training_peak_above_model_state(ragged_corpus):
    from conftest import tiny_config

    res = lu.run(tiny_config(ragged_corpus), "cpu", progress=False, verbose=False)
    m = res.memory
    # AdamW: exp_avg + exp_avg_sq in fp32, plus a 4-byte `step` scalar per parameter tensor
    assert m["params"] > 0 and 0 < m["optimizer"] - 2 * m["params"] < 1024
    assert res.peak_memory_bytes > m["params"] * 4  # params + grads + 2 states + activations


def test_fmt_bytes():
    assert lu.fmt_bytes(3 * 2**30) == "3.00 GiB" and lu.fmt_bytes(512) == "512 B"
