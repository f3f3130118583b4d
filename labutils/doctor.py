"""``python -m labutils doctor [--json PATH]``: the first thing to run on a new machine.

It runs every CUDA path the labs rely on, briefly, and prints a pass/fail table with numbers: the device
module's functions and the raw ``torch.cuda`` calls lab 04 shows; one short training step per precision the
card supports (GPT-2 small); the memory cap and recovery from an out-of-memory error; an allocator snapshot
recorded, dumped and read back by the course's own parser; a profiler run with CUDA activity; every
checkpointing variant's gradients against no checkpointing *with dropout on*; the memory estimator against
measured peaks; matmul TFLOP/s per precision; configs/fast_config.yaml for a few steps, its MFU next to the goal.
Exit code 1 if anything failed; the summary line gives the total time. ``regenerate`` runs it first and stops on
any failure except a missed MFU goal (the row says ``"gates_regenerate": False``): the labs do not need the
fast path's speed.

Without a GPU it says so, runs the CPU equivalents that exist (tiny model), and exits 0: the GPU checks are
listed as skipped, never as passed.

Every check can fail on a broken machine. One function per check (``check_*``); where the verdict needs a GPU,
it is a small function of the measured numbers (``*_verdict``) so a test can hand it broken numbers. What
fails each (tests/test_doctor_checks.py breaks each on purpose):

  device: memory counters           a 64 MiB tensor not seen by memory_allocated / peak / reserved; on CPU, a
                                    CUDA-only counter answering a number
  device: mem_info / total / stats  cudaMemGetInfo's total != get_device_properties().total_memory (exactly),
                                    free > total, no allocator stats
  device: cap set / restore         the driver ignoring set_per_process_memory_fraction; a nested larger cap
                                    raising the smaller one; the cap not restored
  device: outside-allocator memory  cudaMemGetInfo unanswerable (only the default is known), 0 or >= 4 GiB
  device: bf16 / tf32 support       labutils' answer differs from torch.cuda.is_bf16_supported(including_
                                    emulation=False) or from NVIDIA's Ampere (8.0) line for TF32
  torch.cuda calls of lab 04        a counter < 0, free > total, total != the device's total memory (NVML
                                    refusing list_gpu_processes, as in WSL, is reported "unavailable", no fail)
  tf32 switch: legacy + new flags   a TF32 reader raising ("mix of the legacy and new APIs") or disagreeing
  train step <precision>            a non-finite loss, too few steps; fp16: no GradScaler, or more than half
                                    of the steps skipped by it
  outside-allocator after training  as above, measured again after lazily loaded kernels
  cap + OOM recovery                a training step under a cap too small for it not refused, refused before
                                    training started, memory not back to baseline, no successful run after
  snapshot record -> dump -> parse  no events recorded, or the top holder has no stack
  profiler ranges                   forward/backward ranges missing; on CUDA no device time, backward < forward
  checkpointing grads: <variant>    gradients differ from no checkpointing (e.g. the RNG state not restored
                                    for the recompute: other dropout masks)
  estimator vs measured             the estimate more than 10 % from the measured peak
  device: empty caches              pinned host memory still held after empty_caches (needs
                                    torch.cuda.host_memory_stats, torch >= 2.7: skipped with the reason before)
  matmul TFLOP/s <format>           a wrong product (vs float64); TF32 not engaged (fp32-sized error); on CUDA
                                    TF32 / FP16 / BF16 not faster than FP32 by what the card's datasheet promises
  fast path MFU (fast_config.yaml)  the fast config not training (OOM even at the fitted micro-batch, a
                                    non-finite loss); on an A100/H100/H200, uncapped at the config's own
                                    micro-batch, an MFU below 45 % over >= claims.MIN_TIMED_STEPS timed steps
                                    (not gating regenerate). Not judged, MFU shown: other cards, a memory
                                    budget active (LAB_GPU_MEMORY_GB), a lowered micro-batch; CPU: skipped
"""
from __future__ import annotations

import time

import torch

from . import device as dev
from .doctor_checks import (Checks, check_cap_and_oom, check_checkpointing, check_device_functions,  # noqa: F401
                            check_empty_caches, check_estimator, check_outside_allocator, check_profiler,
                            check_snapshot, check_tf32_flags, check_training, small_config)
from .doctor_speed import check_fast_path, check_matmul  # noqa: F401


def run_doctor(device=None, verbose: bool = True) -> dict:
    """All checks on ``device`` (default: the GPU if there is one). Returns ``{"checks": [...], "env": {...}}``."""
    from .env import environment, seed_everything
    from .memory import release

    start = time.perf_counter()
    device = dev.resolve(device)
    c = Checks(verbose)
    if verbose:
        if device.type == "cuda":
            print(f"labutils doctor on {dev.name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})")
        else:
            print("labutils doctor: no CUDA GPU found. The GPU checks are skipped; the CPU equivalents run on the "
                  "tiny model. Run this again on the GPU machine you will use.")
    seed_everything(0)
    budget = dev.card_budget(dev.budget_from_env(), device)
    if budget and verbose:
        print("  " + dev.budget_line(budget))
    outside_at_start = dev.outside_allocator_bytes(device)[0]
    check_device_functions(c, device)
    check_tf32_flags(c, device)
    check_training(c, device)
    if device.type == "cuda":  # lazily loaded kernels (attention, fused AdamW) add memory outside the allocator
        check_outside_allocator(c, device, "device: outside-allocator memory after training", refresh=True,
                                at_start=outside_at_start)
    check_cap_and_oom(c, device)
    from . import checkpoint_measure as cm
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
    if verbose:
        quiet = [r["name"] for r in c.failed if r.get("gates_regenerate") is False]
        print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in {seconds:.0f} s"
              + ("" if device.type == "cuda" else " (no GPU: CPU checks only)")
              + (f"; {len(quiet)} of the failures ({', '.join(quiet)}) do not stop `regenerate`" if quiet else ""))
    return {"checks": c.rows, "summary": counts, "seconds": seconds, "env": environment(device)}


def cli_doctor(args) -> int:
    from .results import write_json

    report = run_doctor()
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 1 if report["summary"]["fail"] else 0
