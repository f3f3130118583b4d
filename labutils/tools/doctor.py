"""``python -m labutils doctor [--json PATH]``: the first thing to run on a new machine.

Runs every CUDA path the labs rely on, briefly (GPT-2 small), and prints a pass/fail table; exit code 1 if anything
failed (``regenerate`` runs it first and stops on a failure). Without a GPU it runs the CPU equivalents (tiny model)
and exits 0, the GPU checks listed as skipped; a GPU the driver sees but torch cannot use fails (exit 1).

The checks live in :mod:`labutils.tools.doctor_checks`, :mod:`labutils.tools.doctor_formats` (BF16 / TF32) and
:mod:`labutils.tools.doctor_speed`; one ``check_*`` per row, its GPU verdict a ``*_verdict`` function of the numbers
so that tests/test_doctor_checks.py can break each on purpose; its docstring lists what fails each row.
"""
from __future__ import annotations

import time

import torch

from ..core import device as dev
from .doctor_checks import (Checks, check_cap, check_cap_and_oom, check_checkpointing,  # noqa: F401
                            check_empty_caches, check_estimator, check_lab04_calls, check_mem_info,
                            check_memory_counters, check_outside_allocator, check_profiler, check_snapshot,
                            check_training, expect, small_config)
from .doctor_formats import check_support_facts, check_tf32_flags  # noqa: F401
from .doctor_speed import check_fast_path, check_matmul  # noqa: F401


def check_device_functions(c: Checks, device: torch.device) -> None:
    """Every function of labutils.core.device, and the raw torch.cuda calls lab 04 teaches, answer sensibly."""
    check_memory_counters(c, device)
    check_mem_info(c, device)
    check_cap(c, device)
    check_outside_allocator(c, device)
    check_support_facts(c, device)
    check_lab04_calls(c, device)


def check_driver(c: Checks) -> None:
    """The GPU the NVIDIA driver sees (nvidia-smi) is one torch can use (:func:`labutils.core.device.unusable_gpu`)."""
    with c.check("driver: torch can use its GPU") as row:
        unusable = dev.unusable_gpu()
        if unusable:
            expect(row, False, unusable["message"])
        elif dev.cuda_available():
            expect(row, True, f"torch {torch.__version__} (CUDA {torch.version.cuda}) uses {dev.name()}; "
                              f"driver {dev.driver_version() or 'unknown (nvidia-smi not found)'}")
        else:
            expect(row, True, "no NVIDIA GPU seen by the driver (nvidia-smi absent or listing none): a CPU machine")


def run_doctor(device=None, verbose: bool = True) -> dict:
    """All checks on ``device`` (default: the GPU if there is one). Returns ``{"checks": [...], "summary", "seconds",
    "checks_seconds", "compile_seconds", "env"}`` (``compile_seconds``: the fast path's compiling, apart)."""
    from ..core.env import environment, seed_everything
    from ..core.memory import release

    start = time.perf_counter()
    device = dev.resolve(device)
    c = Checks(verbose)
    if verbose:
        if device.type == "cuda":
            print(f"labutils doctor on {dev.name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})")
        elif dev.unusable_gpu():
            print(f"labutils doctor: {dev.unusable_gpu()['message']}\nThe GPU checks are skipped; the CPU "
                  "equivalents run on the tiny model.", flush=True)
        else:
            print("labutils doctor: no CUDA GPU found. The GPU checks are skipped; the CPU equivalents run on the "
                  "tiny model. Run this again on the GPU machine you will use.")
    seed_everything(0)
    budget = dev.card_budget(dev.budget_from_env(), device)
    if budget and verbose:
        print("  " + dev.budget_line(budget))
    outside_at_start = dev.outside_allocator_bytes(device)[0]
    check_driver(c)
    check_device_functions(c, device)
    check_tf32_flags(c, device)
    check_training(c, device)
    if device.type == "cuda":  # lazily loaded kernels (attention, fused AdamW) add memory outside the allocator
        check_outside_allocator(c, device, "device: outside-allocator memory after training", refresh=True,
                                at_start=outside_at_start)
    check_cap_and_oom(c, device)
    from ..labs.lab03 import checkpoint_measure as cm
    cfg = small_config("gpt2" if device.type == "cuda" else "tiny", **{"data.seq_length": 64})
    with cm.loaded(cfg, device) as s:
        session = (s.model, cm.one_batch(s.dataset, 2, 0, device))
        check_snapshot(c, device, session)
        check_profiler(c, device, session)
        session = None
    check_checkpointing(c, device)
    check_empty_caches(c, device)  # after the offload variants, which pin host memory
    check_estimator(c, device)
    check_fast_path(c, device)  # the whole fast step's MFU, then (last) the raw matmul speed per format
    check_matmul(c, device)
    release()
    counts = {k: sum(r["status"] == k for r in c.rows) for k in ("pass", "fail", "skip")}
    seconds = round(time.perf_counter() - start, 1)
    compile_seconds = round(sum(r.get("compile_seconds") or 0.0 for r in c.rows), 1)
    checks_seconds = round(seconds - compile_seconds, 1)
    if verbose:
        compiled = (f", compiling the fast path {compile_seconds:.0f} s apart" if any(
            r.get("compile_seconds") is not None for r in c.rows) else "")
        print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped: checks "
              f"{checks_seconds:.0f} s{compiled}, {seconds:.0f} s in all"
              + ("" if device.type == "cuda" else " (no GPU: CPU checks only)"))
    return {"checks": c.rows, "summary": counts, "seconds": seconds, "checks_seconds": checks_seconds,
            "compile_seconds": compile_seconds, "env": environment(device)}


def cli_doctor(args) -> int:
    from ..core.results import write_json

    report = run_doctor()
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 1 if report["summary"]["fail"] else 0
