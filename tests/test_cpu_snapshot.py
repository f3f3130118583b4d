"""Lab 04's CPU memory snapshot (labutils.labs.lab04.profiling.CPUTraceRecorder) logs every allocation of the steps it
records: its peak is the CPU tracker's peak for the same steps (issue 44 §3). Oracle: lu.MemoryTracker, the tracker
every lab's peaks come from, over the same two training steps of the same model and optimizer state. Before: the
recorder compared the number of live storages before and after each add, and LiveStorages.add first forgets the
storages that died meanwhile, so an allocation that coincided with a free was never logged (lab 04's snapshot read
13.28 MiB for steps the tracker measured at 17.03 MiB)."""
import torch

import labutils as lu
from labutils.labs.lab04.profiling import CPUTraceRecorder, trace_summary

from conftest import tiny_config


def test_the_cpu_snapshot_peak_is_the_trackers_peak_for_the_same_two_steps():
    cfg = tiny_config(data__pack=True)
    loaded, data = lu.prepare(cfg, "cpu", verbose=False)
    model = loaded.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    windows = data.windows(4, 1, 0)

    def step():
        (batch,) = next(windows).micro_batches
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # AdamW's state exists before either measurement
    with lu.MemoryTracker("cpu") as mt:
        step()
        step()
    with CPUTraceRecorder(model) as rec:
        step()
        step()
    summary = trace_summary(rec.snapshot(), start_bytes=rec.start_bytes)
    assert rec.start_bytes == mt.start_bytes
    assert summary["peak_bytes"] == mt.peak_bytes, (summary["peak_bytes"], mt.peak_bytes)
