"""Which doctor failures stop a full ``regenerate`` (issue 29 §4, issue 45 §4): only what the labs need gates them.
A failed fast-path row (``configs/fast_config.yaml`` compiled, which only the bench uses) is reported and never stops
the labs, whatever failed: out of memory under the cap or on the whole card, or an inductor error on another torch.
Any row of the labs' own path (CUDA, the cap, each precision's training step) still stops them, alone or beside a
fast-path failure.

The doctor's rows are made by the doctor's own code (``mfu_verdict``, ``Checks``), so a change in how it words
a failure breaks these tests rather than silently re-opening the gate; its process is stood in for as in
tests/test_doctor.py (the code under test is regenerate's gate).
"""
from __future__ import annotations

import pytest
import torch

from labutils.tools import cli
from labutils.tools.doctor_checks import Checks
from labutils.tools.doctor_speed import mfu_verdict
from tests.test_doctor import OTHER_FAIL, PASSED, _doctor_process

FAST = "fast path MFU (fast_config.yaml)"
CAPPED = ["a memory budget is active (behaving like a 8 GB card)"]


def verdict_row(status: str, error: str | None, name: str = FAST) -> dict:
    ok, detail = mfu_verdict(None, "NVIDIA H100 80GB HBM3", "bf16", status, error, CAPPED)
    assert not ok
    return {"name": name, "status": "fail", "value": None, "detail": f"{detail}; 16 x 1 x T1024; value = MFU %"}


def raised_row(exc: BaseException, name: str = FAST) -> dict:
    """The row the doctor's Checks writes when the check raises (run() let the error out)."""
    c = Checks(verbose=False)
    with c.check(name):
        raise exc
    return c.rows[0]


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def regenerate(tmp_path, gb: str) -> int:
    return cli.main(["regenerate", "--out", str(tmp_path / "r"), "--only", "01", "--gpu-memory-gb", gb])


@pytest.mark.parametrize("row, gb", [
    (verdict_row("oom", OOM), "8"), (raised_row(torch.OutOfMemoryError(OOM)), "8"),   # under the cap
    (verdict_row("oom", OOM), "0"),                                                    # the whole card
    (verdict_row("error", "BackendCompilerFailed: inductor failed on this torch"), "8"),  # not for memory
    (raised_row(RuntimeError("InductorError: LoweringException")), "0"),
], ids=["status-oom", "raised-OutOfMemoryError", "no-cap", "compile-error", "raised-compile-error"])
def test_a_failed_fast_path_never_stops_the_labs(monkeypatch, tmp_path, capsys, row, gb):
    """Breaks if the fast path's row gated the labs again (before issue 45: any failure but an OOM under the cap)."""
    ran = _doctor_process(monkeypatch, [PASSED, row])
    assert regenerate(tmp_path, gb) == 0 and ran
    out = capsys.readouterr().out
    assert "does not stop the notebooks" in out and FAST in out and "not a gate" in out
    assert ("8 GiB" in out) == (gb == "8")


CUDA_FAIL = {"name": "driver: torch can use its GPU", "status": "fail", "detail": "CUDA error: no kernel image"}


@pytest.mark.parametrize("rows", [
    [CUDA_FAIL],                                                                 # the labs need CUDA
    [verdict_row("oom", OOM), OTHER_FAIL],                                       # the cap failed beside it
    [raised_row(torch.OutOfMemoryError(OOM), name="train step bf16")],           # the labs' own path ran out
], ids=["cuda", "fast-path-and-cap", "oom-in-a-lab-path"])
def test_what_the_labs_need_still_stops_regenerate(monkeypatch, tmp_path, capsys, rows):
    ran = _doctor_process(monkeypatch, rows)
    assert regenerate(tmp_path, "8") == 1 and not ran
    assert "doctor" in capsys.readouterr().err
