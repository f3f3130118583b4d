"""``python -m labutils doctor``: on a machine without a GPU it must say so, run the CPU checks and exit 0;
`regenerate` (full mode) runs it first and stops if it fails. On a machine with a GPU the doctor itself is the
GPU workflow's own step (.github/workflows/gpu-smoke.yml)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labutils.tools import command_parts, regenerate as rg


@pytest.mark.regen_labs("all")
def test_doctor_on_a_cpu_machine():
    """The doctor the session's rehearsal ran first (tests/regen_once.py: regenerate starts ``python -m labutils
    doctor`` in a child process, which the pretend GPU of regenerate's own process does not reach), i.e. on this
    machine's real hardware. Fails if the doctor stops saying there is no GPU, marks a GPU-only check pass on a CPU,
    or fails a CPU check."""
    from tests import fake_cuda, regen_once
    from labutils.labs.registry import IDS

    if fake_cuda.real_gpu_present():
        pytest.skip("a real CUDA GPU is present: the doctor runs its GPU checks, which .github/workflows/gpu-smoke.yml "
                    "runs as its own step (`python -m labutils doctor`)")
    run = regen_once.run_for(IDS)
    report = json.loads((run.out / "doctor.json").read_text())
    seconds = json.loads((run.out / "run.json").read_text())["seconds"]["doctor"]
    assert "no CUDA GPU found" in run.stdout and seconds < 120
    assert set(report) >= {"checks", "env"} and report["env"]["device"] == "cpu"
    # its own total time, in the summary line and the JSON (the README points there instead of a promise), the
    # checks' time apart from compiling (none on the CPU: the fast path is skipped)
    assert 0 < report["seconds"] <= seconds and f", {report['seconds']:.0f} s in all" in run.stdout
    assert report["compile_seconds"] == 0 and report["checks_seconds"] == report["seconds"]
    checks = {c["name"]: c for c in report["checks"]}
    assert all({"name", "status"} <= set(c) for c in report["checks"])
    assert not [c for c in report["checks"] if c["status"] == "fail"]
    assert checks["torch.cuda calls of lab 04"]["status"] == "skip"       # GPU checks are never "pass" on a CPU
    assert checks["driver: torch can use its GPU"]["status"] == "pass"    # this machine's driver sees no GPU
    assert checks["checkpointing grads: selective (dropout 0.1)"]["status"] == "pass"
    assert {"train step fp32", "cap + OOM recovery", "snapshot record -> dump -> parse", "profiler ranges"} <= set(checks)


def test_a_failing_check_fails_the_doctor(monkeypatch):
    from labutils.tools import doctor
    from tests import fake_cuda

    fake_cuda.no_gpu(monkeypatch)  # the CPU checks, on any machine: one broken check must be the one failure

    def broken(c, device):
        with c.check("broken on purpose"):
            raise RuntimeError("boom")
    monkeypatch.setattr(doctor, "check_matmul", broken)
    for name in ("check_training", "check_checkpointing", "check_estimator", "check_snapshot", "check_profiler",
                 "check_cap_and_oom"):
        monkeypatch.setattr(doctor, name, lambda *a: None)
    # no model either: importing transformers' GPT-2 for the first time under no_gpu (which gives this CPU build a
    # CUDA entry point) makes torch._dynamo import CUDA-only names (it failed so when run on its own)
    import contextlib
    import labutils.labs.lab03.checkpoint_measure as cm
    monkeypatch.setattr(cm, "loaded", lambda cfg, device: contextlib.nullcontext(
        type("S", (), {"model": None, "dataset": None})))
    monkeypatch.setattr(cm, "one_batch", lambda *a: None)
    report = doctor.run_doctor("cpu", verbose=False)
    assert report["summary"]["fail"] == 1 and report["checks"][-1]["detail"] == "RuntimeError: boom"


def test_full_regenerate_stops_when_the_doctor_fails(monkeypatch, tmp_path, capsys):
    """The instructors' command checks the machine before it spends hours on the notebooks."""
    from labutils.tools import cli

    monkeypatch.setattr(rg, "_cuda_available", lambda: True)        # past the "full needs a GPU" gate
    monkeypatch.setattr(rg, "run_doctor_first", lambda out, gb, **k: 1)  # a machine whose doctor fails
    ran = []
    monkeypatch.setattr(rg, "regenerate", lambda *a, **k: ran.append(a) or [])
    assert cli.main(["regenerate", "--out", str(tmp_path / "r"), "--only", "01"]) == 1
    assert not ran and "doctor" in capsys.readouterr().err
    monkeypatch.setattr(rg, "run_doctor_first", lambda out, gb, **k: 0)
    cli.main(["regenerate", "--out", str(tmp_path / "r"), "--only", "01"])
    assert ran


MFU_MISSED = {"name": "fast path MFU (fast_config.yaml)", "status": "fail", "gates_regenerate": False,
              "detail": "MFU 30.0 % (bf16), goal >= 45 % on NVIDIA H100 80GB HBM3"}
OTHER_FAIL = {"name": "cap + OOM recovery", "status": "fail", "detail": "memory not back to baseline"}
PASSED = {"name": "train step bf16", "status": "pass", "detail": ""}


def _doctor_process(monkeypatch, rows, code=1):
    """The doctor's process as `regenerate` sees it: it writes its rows to ``--json PATH`` and exits with ``code``
    (rows None: it crashed before writing). A row marked ``"gates_regenerate": False`` stands for any finding the
    doctor lets through (the fast path's MFU no longer fails at all: issue 28, tests/test_doctor_checks.py)."""
    monkeypatch.setattr(rg, "_cuda_available", lambda: True)        # past the "full needs a GPU" gate
    real = command_parts._child  # python -m labutils ARGV as a child process

    def child(argv, env):
        if argv[0] != "doctor":
            return real(argv, env)
        path = Path(argv[argv.index("--json") + 1])
        if rows is not None:
            path.write_text(json.dumps({"checks": rows, "summary": {}}))
        return code
    monkeypatch.setattr(command_parts, "_child", child)
    ran = []
    monkeypatch.setattr(rg, "regenerate", lambda *a, **k: ran.append(a) or [])
    return ran


def _regenerate(tmp_path, stale=None) -> int:
    from labutils.tools import cli

    out = tmp_path / "r"
    if stale is not None:
        out.mkdir()
        (out / "doctor.json").write_text(json.dumps({"checks": stale}))
    return cli.main(["regenerate", "--out", str(out), "--only", "01"])


def test_full_regenerate_goes_on_after_a_missed_mfu_goal_alone(monkeypatch, tmp_path, capsys):
    """A missed fast-path MFU goal is a real finding (doctor exits 1) but the labs do not need that speed: the
    notebooks run, and regenerate prints the finding. Breaks if any doctor failure stops the notebooks (as
    before: regenerate refused every notebook), or if the finding is not printed."""
    ran = _doctor_process(monkeypatch, [PASSED, MFU_MISSED])
    assert _regenerate(tmp_path) == 0 and ran
    out = capsys.readouterr().out
    assert "does not stop the notebooks" in out and "fast path MFU" in out and "goal >= 45 %" in out


@pytest.mark.parametrize("rows,stale", [
    ([MFU_MISSED, OTHER_FAIL], None),                                  # the MFU miss and something else
    ([OTHER_FAIL], None),
    (None, None),                                                      # the doctor crashed: no report
    (None, [PASSED, MFU_MISSED]),                                      # ... and an earlier run's report lies there
], ids=["mfu-and-other", "other", "no-report", "stale-report"])
def test_full_regenerate_stops_on_any_other_doctor_failure(monkeypatch, tmp_path, capsys, rows, stale):
    """Only rows marked ``gates_regenerate: False`` and fast-path rows (issue 45 §4: the labs do not run the fast
    config; tests/test_regenerate_doctor_gate.py) are let through; any other failure, or a doctor that left no
    report of this run, stops the notebooks. Breaks if the gate ignores failures next to the MFU miss, or reads an
    earlier run's doctor.json."""
    ran = _doctor_process(monkeypatch, rows)
    assert _regenerate(tmp_path, stale) == 1 and not ran
    assert "doctor" in capsys.readouterr().err


@pytest.mark.parametrize("budget", [None, "8"])
@pytest.mark.parametrize("profile", ["rtx3070-8gb", "t4", "h100"])
def test_doctor_device_checks_on_a_pretend_gpu(monkeypatch, profile, budget):
    """The CUDA branch of the doctor's device checks (cap set/restore in bytes, outside-allocator memory, caches,
    lab 04's raw torch.cuda calls) runs on the pretend GPU, with and without an 8 GiB budget. Only the checks that
    need a real CUDA tensor (a 64 MiB allocation; the bf16 / tf32 ops) cannot: the pretend driver has no kernels,
    and those rows must fail with what creating a real CUDA tensor raises on this torch build (asked of torch, not
    assumed: the CPU build raises NotImplementedError, pip's default CUDA build without a driver a RuntimeError).
    Skipped on a real GPU, where `python -m labutils doctor` runs these checks on the card."""
    from labutils.core import device as dev
    from labutils.tools import doctor
    from tests import fake_cuda

    monkeypatch.setattr(dev, "_state", {})
    monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    if budget:
        monkeypatch.setenv("LAB_GPU_MEMORY_GB", budget)
    gpu = fake_cuda.install(monkeypatch, profile)
    failure = gpu.kernel_failure()
    assert failure is not None  # the pretend driver has no kernels on either build
    dev.card_budget(dev.budget_from_env())
    c = doctor.Checks(verbose=False)
    doctor.check_device_functions(c, dev.resolve("cuda"))
    status = {r["name"]: (r["status"], r["detail"]) for r in c.rows}
    for name in ("device: memory counters", "device: bf16 / tf32 support, facts"):  # need real kernels
        row = status.pop(name)
        assert row[0] == "fail" and row[1].startswith(f"{failure.__name__}:"), row
    assert all(s == "pass" for s, _ in status.values()), status
    assert "torch.cuda calls of lab 04" in status
