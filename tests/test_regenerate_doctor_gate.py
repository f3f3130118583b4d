"""Which doctor failures stop a full ``regenerate`` (issue 29, §4): the fast path running out of memory under the
memory cap regenerate itself gives the doctor (``--gpu-memory-gb``, default 8) is not judged and never a gate:
``configs/fast_config.yaml`` is sized for the whole card, and the labs never use it. Without a cap it is a real
finding and still stops the notebooks, as does any other failure next to it, a fast config that fails otherwise,
or an out-of-memory in any other check.

The doctor's rows are made by the doctor's own code (``mfu_verdict``, ``Checks``), so a change in how it words
an out-of-memory run breaks these tests rather than silently re-opening the gate; its process is stood in for as
in tests/test_doctor.py (the code under test is regenerate's gate).
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


@pytest.mark.parametrize("row", [verdict_row("oom", OOM), raised_row(torch.OutOfMemoryError(OOM))],
                         ids=["status-oom", "raised-OutOfMemoryError"])
def test_fast_path_oom_under_the_cap_is_not_a_gate(monkeypatch, tmp_path, capsys, row):
    ran = _doctor_process(monkeypatch, [PASSED, row])
    assert regenerate(tmp_path, "8") == 0 and ran
    out = capsys.readouterr().out
    assert "does not stop the notebooks" in out and FAST in out
    assert "not judged" in out and "8 GiB" in out and "out of memory" in out.lower()


@pytest.mark.parametrize("rows, gb", [
    ([verdict_row("oom", OOM)], "0"),                                   # the whole card: a real finding
    ([verdict_row("error", "RuntimeError: compile failed")], "8"),      # did not train, not for memory
    ([verdict_row("oom", OOM), OTHER_FAIL], "8"),                       # something else failed too
    ([raised_row(torch.OutOfMemoryError(OOM), name="train step bf16")], "8"),  # the labs' own path ran out
], ids=["no-cap", "other-status", "oom-and-other", "oom-elsewhere"])
def test_everything_else_still_stops_regenerate(monkeypatch, tmp_path, capsys, rows, gb):
    ran = _doctor_process(monkeypatch, rows)
    assert regenerate(tmp_path, gb) == 1 and not ran
    assert "doctor" in capsys.readouterr().err
