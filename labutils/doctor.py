"""``python -m labutils doctor [--json PATH]``: the first thing to run on a new machine.

It runs every CUDA path the labs rely on, briefly, and prints a pass/fail table with numbers: the device
module's functions and the raw ``torch.cuda`` calls lab 04 shows; one short training step per precision the
card supports (GPT-2 small); the memory cap and recovery from an out-of-memory error; an allocator snapshot
recorded, dumped and read back by the course's own parser; a profiler run with CUDA activity; every
checkpointing variant's gradients against no checkpointing *with dropout on*; the memory estimator against
measured peaks; matmul TFLOP/s per precision. Exit code 1 if anything failed.

Without a GPU it says so, runs the CPU equivalents that exist (tiny model), and exits 0: the GPU checks are
listed as skipped, never as passed.
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch

from . import device as dev

MiB, GiB = 2**20, 2**30
ESTIMATOR_TOLERANCE_PCT = 10.0   # the estimator's goal: within 10 % of the measured CUDA peak
GRAD_TOLERANCE = 1e-5            # checkpointing variants: largest relative gradient difference (fp32, TF32 off)


class Checks:
    """Collects one row per check: name, status (pass | fail | skip), value, detail, seconds."""

    def __init__(self, verbose: bool = True):
        self.rows: list[dict] = []
        self.verbose = verbose

    @contextlib.contextmanager
    def check(self, name: str):
        """``with checks.check("name") as row: ... row["value"] = ...``; an exception fails the check (the run
        goes on); ``row["status"] = "fail"`` or ``"skip"`` set inside also counts."""
        row = {"name": name, "status": "pass", "value": None, "detail": ""}
        start = time.perf_counter()
        try:
            yield row
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # a check that raises has failed; the doctor goes on to the next one
            text = str(exc).strip().splitlines()
            row.update(status="fail", detail=f"{type(exc).__name__}: {text[0][:200] if text else ''}")
        row["seconds"] = round(time.perf_counter() - start, 3)
        self.rows.append(row)
        if self.verbose:
            print(f"  {row['status']:<4}  {name:<44} {_fmt(row['value']):>14}  {row['detail']}", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"name": name, "status": "skip", "value": None, "detail": why, "seconds": 0.0})
        if self.verbose:
            print(f"  skip  {name:<44} {'':>14}  {why}", flush=True)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "fail"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _expect(row: dict, ok: bool, detail: str) -> None:
    row["detail"] = detail
    if not ok:
        row["status"] = "fail"


def _cfg(name: str, **over):
    from .config import load_config

    base = {"model.name": name, "model.pretrained": "false", "data.num_samples": 32, "data.seq_length": 128,
            "data.pack": True, "train.steps": 3, "train.micro_batch_size": 2, "train.warmup_steps": 0,
            "train.timing_warmup_steps": 1}
    return load_config(None, overrides={**base, **over}, mode="full")


# ----------------------------------------------------------------------------------------------------- the checks
def check_device_functions(c: Checks, device: torch.device) -> None:
    """Every function of labutils.device, and the raw torch.cuda calls lab 04 teaches, answer sensibly."""
    cuda = device.type == "cuda"
    with c.check("device: memory counters") as row:
        dev.synchronize(device)
        dev.reset_peak(device)
        a, p, r = dev.allocated(device), dev.peak_allocated(device), dev.reserved(device)
        if cuda:
            x = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
            a2, p2 = dev.allocated(device), dev.peak_allocated(device)
            del x
            _expect(row, a2 - a >= 64 * MiB and p2 >= a2 and dev.reserved(device) >= a2 and p >= a and r >= a,
                    f"64 MiB tensor seen: allocated +{(a2 - a) / MiB:.0f} MiB, peak {p2 / MiB:.0f} MiB")
            row["value"] = (a2 - a) / MiB
        else:
            _expect(row, a is None and p is None and r is None, "CPU: no allocator counters (the CPU tracker counts)")
    with c.check("device: mem_info / total / stats") as row:
        info, total, stats = dev.mem_info(device), dev.total_memory(device), dev.memory_stats(device)
        if cuda:
            free, tot = info
            _expect(row, 0 < free <= tot == total and "allocated_bytes.all.current" in stats,
                    f"free {free / GiB:.2f} of {tot / GiB:.2f} GiB")
            row["value"] = tot / GiB
        else:
            _expect(row, info is None and total is None and stats == {}, "CPU: none of these exist")
    with c.check("device: cap set / restore / never raised") as row:
        if cuda:
            before = dev.get_cap_fraction(device)
            total = dev.total_memory(device)
            with dev.memory_cap(total // 2, device):
                inside = dev.get_cap_fraction(device)
                with dev.memory_cap(total, device):  # a larger cap inside must not raise the smaller one
                    nested = dev.get_cap_fraction(device)
            after = dev.get_cap_fraction(device)
            same = lambda x, y: abs(x - y) * total <= 2  # noqa: E731  (the allocator stores whole bytes)
            _expect(row, same(inside, min(before, total // 2 / total)) and same(nested, inside) and same(after, before),
                    f"fraction {before:.3f} -> {inside:.3f} (nested {nested:.3f}) -> {after:.3f}")
        else:
            with dev.memory_cap(123, device) as cpu_budget:
                _expect(row, cpu_budget == 123, "CPU: the budget is handed to the CPU tracker")
    with c.check("device: outside-allocator memory") as row:
        outside, how = dev.outside_allocator_bytes(device)
        row["value"] = outside / GiB
        _expect(row, (0 < outside < 4 * GiB) if cuda else outside == 0, how)
    with c.check("device: empty caches (device + pinned host)") as row:
        dev.empty_caches(device)
        pinned = dev.pinned_host_bytes()
        _expect(row, (pinned is not None) == cuda, f"pinned host bytes after: {pinned}")
    with c.check("device: bf16 / tf32 support, facts") as row:
        bf, why_bf = dev.bf16_support(device)
        tf, why_tf = dev.tf32_support(device)
        facts = dev.facts(device)
        _expect(row, (facts is not None) == cuda and isinstance(bf, bool) and isinstance(tf, bool),
                f"{dev.name(device)}; bf16: {bf}; tf32: {tf}")
        row["value"] = facts["compute_capability"] if facts else None
    if not cuda:
        c.skip("torch.cuda calls of lab 04", "no CUDA GPU")
        return
    with c.check("torch.cuda calls of lab 04") as row:
        free, total = torch.cuda.mem_get_info()
        vals = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated(),
                torch.cuda.memory_stats().get("num_alloc_retries", 0), torch.cuda.current_device()]
        procs = torch.cuda.list_gpu_processes()
        _expect(row, free <= total and all(v >= 0 for v in vals) and isinstance(procs, str),
                "mem_get_info, memory_allocated/reserved, max_memory_allocated, memory_stats, list_gpu_processes")


def check_training(c: Checks, device: torch.device) -> None:
    """One short run per precision this device supports: finite losses, the fp16 scaler working."""
    from .train import run

    name = "gpt2" if device.type == "cuda" else "tiny"
    precisions = ["fp32", "fp16", "bf16"] + (["tf32"] if dev.tf32_support(device)[0] else [])
    if device.type == "cuda" and not dev.bf16_support(device)[0]:
        precisions.remove("bf16")
        c.skip("train step bf16", dev.bf16_support(device)[1])
    if device.type != "cuda":
        c.skip("train step tf32", dev.tf32_support(device)[1])
    for precision in precisions:
        with c.check(f"train step {precision}") as row:
            res = run(_cfg(name, **{"train.precision": precision}), device, progress=False, verbose=False)
            ok = res.ok and all(math.isfinite(x) for x in res.losses) and len(res.losses) == 3
            row["value"] = res.peak_memory_bytes / MiB if res.peak_memory_bytes else None
            _expect(row, ok, f"{name}: status {res.status}, losses "
                             + ", ".join(f"{x:.3f}" for x in res.losses) + (f", skipped {res.skipped}" if res.skipped else "")
                             + (f"; {res.error}" if res.error else "") + "; value = peak MiB")


def check_cap_and_oom(c: Checks, device: torch.device) -> None:
    """Exceed a cap on purpose, catch the error, and get the memory back to where it was."""
    from .memory import release

    with c.check("cap + OOM recovery") as row:
        release()
        if device.type == "cuda":
            base = dev.allocated(device)
            caught = False
            with dev.memory_cap(base + 256 * MiB, device):
                try:
                    x = torch.empty(512 * MiB, dtype=torch.uint8, device=device)
                    del x
                except torch.OutOfMemoryError:
                    caught = True
            release()
            after = dev.allocated(device)
            row["value"] = (after - base) / MiB
            _expect(row, caught and after == base, f"512 MiB under a {base / MiB + 256:.0f} MiB cap: "
                                                   f"{'OOM caught' if caught else 'NOT refused'}; back to baseline: {after == base}")
        else:
            from .memory import MemoryTracker
            caught = False
            try:
                with MemoryTracker(device, cpu_budget_bytes=0):
                    torch.ones(1 * MiB)
            except torch.OutOfMemoryError:
                caught = True
            _expect(row, caught, "CPU: the tracker's simulated budget raises torch.OutOfMemoryError")


def _tiny_step(model, batch):
    model(**batch, use_cache=False).loss.backward()


def check_snapshot(c: Checks, device: torch.device, session) -> None:
    """Record allocator events over a step, dump them, read the dump back with the course's parser."""
    from .profiling import CPUTraceRecorder, trace_summary

    with c.check("snapshot record -> dump -> parse") as row:
        model, batch = session
        if device.type == "cuda":
            dev.record_history(True)
            try:
                start = dev.allocated(device)
                _tiny_step(model, batch)
                model.zero_grad(set_to_none=True)
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "snapshot.pickle"
                    dev.dump_snapshot(path)
                    with open(path, "rb") as f:
                        snap = pickle.load(f)
            finally:
                dev.record_history(False)
        else:
            with CPUTraceRecorder(model) as rec:
                _tiny_step(model, batch)
            model.zero_grad(set_to_none=True)
            snap, start = rec.snapshot(), rec.start_bytes
        s = trace_summary(snap, start_bytes=start, top=3)
        top = s["top_at_peak"][0]["site"] if s["top_at_peak"] else "(none)"
        row["value"] = s["events"]
        _expect(row, s["events"] > 0 and top != "(no stack)", f"peak {s['peak_bytes'] / MiB:.1f} MiB; top holder: {top}")


def check_profiler(c: Checks, device: torch.device, session) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from .profiling import range_times

    with c.check("profiler ranges") as row:
        model, batch = session
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        os.environ.setdefault("KINETO_LOG_LEVEL", "10")
        with profile(activities=activities) as prof:
            with record_function("forward"):
                loss = model(**batch, use_cache=False).loss
            with record_function("backward"):
                loss.backward()
        model.zero_grad(set_to_none=True)
        rows = range_times(prof.events(), ("forward", "backward"))
        names = [r["range"] for r in rows]
        if device.type == "cuda":  # backward does about twice forward's matmuls: its GPU time must show it
            fwd, bwd = (r["device time (ms)"] or 0 for r in rows)
            ok = names == ["forward", "backward"] and fwd > 0 and bwd >= fwd
        else:
            ok = names == ["forward", "backward"] and all(r["device time (ms)"] is None for r in rows)
        _expect(row, ok, "; ".join(f"{r['range']}: cpu {r['cpu time (ms)']:.1f} ms, device "
                                   f"{_fmt(r['device time (ms)']) or '-'} ms" for r in rows))


def check_checkpointing(c: Checks, device: torch.device) -> None:
    """Every checkpointing variant gives the gradients of no checkpointing, with dropout on."""
    from . import checkpoint_measure as cm
    from . import checkpointing as ck
    from .env import matmul_precision
    from .memory import release

    cfg = _cfg("gpt2" if device.type == "cuda" else "tiny", **{"model.dropout": 0.1, "data.seq_length": 64})
    variants = [ck.full(), ck.every_n(2), ck.segments(2)]
    for feature, make in (("selective", ck.selective), ("offload", ck.offload),
                          ("offload", ck.checkpoint_offload)):
        if ck.available(feature)[0]:
            variants.append(make())
    with cm.loaded(cfg, device) as s, matmul_precision(False):
        batch = cm.one_batch(s.dataset, 2, cfg.train.seed, device)

        def grads(v):
            torch.manual_seed(1234)  # the same dropout masks for every variant
            return cm.step_grads(s.model, batch, v)

        ref = grads(None)
        for v in variants:
            with c.check(f"checkpointing grads: {v.name} (dropout 0.1)") as row:
                d = cm.max_rel_diff(grads(v), ref)
                row["value"] = d
                _expect(row, d <= GRAD_TOLERANCE, f"max relative difference vs no checkpointing (limit {GRAD_TOLERANCE:g})")
    release()


def check_estimator(c: Checks, device: torch.device) -> None:
    from . import estimate as est
    from .train import run

    name = "gpt2" if device.type == "cuda" else "tiny"
    cases = [("fp32", False, 2), ("fp16", True, 4)] if device.type == "cuda" else [("fp32", False, 2)]
    for precision, ckpt, micro in cases:
        with c.check(f"estimator vs measured: {name} {precision}{' ckpt' if ckpt else ''} b{micro}") as row:
            cfg = _cfg(name, **{"train.precision": precision, "train.gradient_checkpointing": ckpt,
                                "train.micro_batch_size": micro, "train.steps": 2})
            res = run(cfg, device, progress=False, verbose=False)
            e = est.estimate_memory(cfg, device=device.type)
            cmp = est.compare(e, res.peak_memory_bytes, res.memory.get("start_bytes"), device.type)
            row["value"] = cmp["error_pct"]
            _expect(row, res.ok and cmp["error_pct"] is not None and abs(cmp["error_pct"]) <= ESTIMATOR_TOLERANCE_PCT,
                    f"{cmp['basis']}: estimated {cmp['estimated_bytes'] / MiB:.1f} MiB, measured "
                    f"{(cmp['measured_bytes'] or 0) / MiB:.1f} MiB; value = error %")


def check_matmul(c: Checks, device: torch.device) -> None:
    from .env import matmul_precision

    n = 4096 if device.type == "cuda" else 512
    formats = [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False)]
    if device.type == "cuda":
        formats = [("fp32", torch.float32, False), ("fp16", torch.float16, False)]
        if dev.tf32_support(device)[0]:
            formats.insert(1, ("tf32", torch.float32, True))
        if dev.bf16_support(device)[0]:
            formats.append(("bf16", torch.bfloat16, False))
    for label, dtype, tf32 in formats:
        with c.check(f"matmul TFLOP/s {label} ({n}x{n})") as row, matmul_precision(tf32):
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            for _ in range(2):
                a @ b
            dev.synchronize(device)
            reps, start = 5, time.perf_counter()
            for _ in range(reps):
                a @ b
            dev.synchronize(device)
            row["value"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
            _expect(row, row["value"] > 0, "measured (dense, no sparsity)")


def run_doctor(device=None, verbose: bool = True) -> dict:
    """All checks on ``device`` (default: the GPU if there is one). Returns ``{"checks": [...], "env": {...}}``."""
    from .env import environment, seed_everything
    from .memory import release

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
        print(f"  memory budget: like a {budget['card_gib']:g} GiB card (allocator cap "
              f"{budget['allocator_cap_bytes'] / GiB:.2f} GiB; {budget['outside_allocator_bytes'] / GiB:.2f} GiB "
              f"outside the allocator, {budget['how']})")
    outside_at_start = dev.outside_allocator_bytes(device)[0]
    check_device_functions(c, device)
    check_training(c, device)
    if device.type == "cuda":  # lazily loaded kernels (attention, fused AdamW) add memory outside the allocator
        with c.check("device: outside-allocator memory after training") as row:
            outside, how = dev.outside_allocator_bytes(device, refresh=True)
            row["value"] = outside / GiB
            _expect(row, 0 < outside < 4 * GiB, f"{how}; {outside_at_start / GiB:.2f} GiB at the start (what the "
                                                f"budget subtracts); value = GiB now")
    check_cap_and_oom(c, device)
    from . import checkpoint_measure as cm
    cfg = _cfg("gpt2" if device.type == "cuda" else "tiny", **{"data.seq_length": 64})
    with cm.loaded(cfg, device) as s:
        session = (s.model, cm.one_batch(s.dataset, 2, 0, device))
        check_snapshot(c, device, session)
        check_profiler(c, device, session)
        session = None
    check_checkpointing(c, device)
    check_estimator(c, device)
    check_matmul(c, device)
    release()
    counts = {k: sum(r["status"] == k for r in c.rows) for k in ("pass", "fail", "skip")}
    if verbose:
        print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
              + ("" if device.type == "cuda" else " (no GPU: CPU checks only)"))
    return {"checks": c.rows, "summary": counts, "env": environment(device)}


def cli_doctor(args) -> int:
    from .results import write_json

    report = run_doctor()
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 1 if report["summary"]["fail"] else 0
