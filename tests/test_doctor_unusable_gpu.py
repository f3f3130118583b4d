"""Issue 29 §4: a GPU torch cannot use. The NVIDIA driver sees a GPU (a pretend ``nvidia-smi``: an executable
script first on PATH, printing what the real one prints for the device module's query) while torch sees none
(pip's CUDA 13 torch on an older driver; here the driver entry points answer "no device"). ``doctor`` fails,
naming the driver's version, torch's CUDA version and the fix; ``run`` says so loudly before it trains on the CPU.
Before, the doctor said "no CUDA GPU found" and exited 0, and the labs ran the CPU smoke configuration quietly."""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from labutils.core import device as dev
from labutils.tools import doctor
from labutils.core.train import RunResult
from tests import fake_cuda
from test_device import pretend_nvidia_smi

tr = importlib.import_module("labutils.core.train")
DRIVER = "470.256.02"  # a driver too old for CUDA 13 (its nvidia-smi header says CUDA Version: 11.4)


@pytest.fixture
def old_driver(monkeypatch, tmp_path):
    fake_cuda.no_gpu(monkeypatch)
    monkeypatch.delenv("LAB_SMOKE", raising=False)
    monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # pip's default torch
    pretend_nvidia_smi(tmp_path / "bin", monkeypatch, lines=(f"NVIDIA GeForce RTX 3070, {DRIVER}",))
    return monkeypatch


def test_doctor_fails_naming_the_driver_torchs_cuda_and_the_fix(old_driver, capsys):
    """The other checks are stubbed (each has its own tests; on the CPU they pass, tests/test_doctor.py): the one
    failure is the driver row, and `python -m labutils doctor` exits 1."""
    import labutils.labs.lab03.checkpoint_measure as cm
    from labutils.tools import cli

    for name in [n for n in vars(doctor) if n.startswith("check_") and n != "check_driver"]:
        old_driver.setattr(doctor, name, lambda *a, **k: None)
    old_driver.setattr(cm, "loaded", lambda cfg, device: contextlib.nullcontext(
        type("S", (), {"model": None, "dataset": None})))
    old_driver.setattr(cm, "one_batch", lambda *a: None)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "driver: torch can use its GPU" in line)
    assert row.lstrip().startswith("fail") and DRIVER in row and "CUDA 13.0" in row and "Fix:" in row
    assert "no CUDA GPU found" not in out and "1 failed" in out


def test_doctor_row_passes_without_a_driver_and_with_a_usable_gpu(monkeypatch, tmp_path):
    fake_cuda.no_gpu(monkeypatch)
    monkeypatch.setattr(dev, "_state", {})
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    c = doctor.Checks(verbose=False)
    doctor.check_driver(c)
    assert c.rows[0]["status"] == "pass" and "CPU machine" in c.rows[0]["detail"]


def test_run_warns_loudly(old_driver, root, capsys):
    """`python -m labutils run` prints the warning (the mode's reason) before training; the training itself is
    stubbed (the CPU smoke run is tested elsewhere)."""
    from labutils.tools import cli

    def run(cfg, device=None, **kw):
        return RunResult(config=cfg.to_dict(), env={}, losses=[3.0], status="ok")
    old_driver.setattr(tr, "run", run)
    cli.main(["run", str(root / "configs" / "fp32_config.yaml"), "--quiet"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("mode:"))
    assert "WARNING" in line and DRIVER in line and "CUDA 13.0" in line and "cannot use it" in line
