"""The doctor's correctness checks (what fails each: tests/test_doctor_checks.py): device functions and lab 04's raw
``torch.cuda`` calls, training per precision, the cap and OOM recovery, snapshots, profiler ranges, checkpointing
gradients, the estimator, emptying the caches. Each ``check_*`` adds rows to a :class:`Checks`."""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch

from ..core import device as dev
from ..core.precisions import PRECISIONS, get

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
        self._add(row)

    def skip(self, name: str, why: str) -> None:
        self._add({"name": name, "status": "skip", "value": None, "detail": why, "seconds": 0.0})

    def _add(self, row: dict) -> None:
        self.rows.append(row)
        if self.verbose:
            print(f"  {row['status']:<4}  {row['name']:<44} {_fmt(row['value']):>14}  {row['detail']}", flush=True)


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def expect(row: dict, ok: bool, detail: str) -> None:
    """Set the row's detail; fail it unless ``ok``."""
    row["detail"] = detail
    if not ok:
        row["status"] = "fail"


def small_config(name: str, **over):
    from ..core.config import load_config

    base = {"model.name": name, "model.pretrained": "false", "data.num_samples": 32, "data.seq_length": 128,
            "data.pack": True, "train.steps": 3, "train.micro_batch_size": 2, "train.warmup_steps": 0,
            "train.timing_warmup_steps": 1}
    return load_config(None, overrides={**base, **over}, mode="full")


# ----------------------------------------------------------------------------------------------------- the checks
def check_memory_counters(c: Checks, device: torch.device) -> None:
    """A 64 MiB tensor moves memory_allocated, the peak and reserved (a pretend GPU cannot hold one: it fails
    there with NotImplementedError). CPU: there are no allocator counters (the CPU tracker counts)."""
    cuda = device.type == "cuda"
    with c.check("device: memory counters") as row:
        dev.synchronize(device)
        dev.reset_peak(device)
        a, p, r = dev.allocated(device), dev.peak_allocated(device), dev.reserved(device)
        if cuda:
            x = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
            a2, p2 = dev.allocated(device), dev.peak_allocated(device)
            del x
            expect(row, a2 - a >= 64 * MiB and p2 >= a2 and dev.reserved(device) >= a2 and p >= a and r >= a,
                    f"64 MiB tensor seen: allocated +{(a2 - a) / MiB:.0f} MiB, peak {p2 / MiB:.0f} MiB")
            row["value"] = (a2 - a) / MiB
        else:
            expect(row, a is None and p is None and r is None, "CPU: no allocator counters (the CPU tracker counts)")


def mem_info_verdict(free: int, driver_total: int, device_total: int, stats: dict) -> tuple[bool, str]:
    """cudaMemGetInfo's total is the device's totalGlobalMem: the same number, to the byte."""
    ok = 0 < free <= driver_total and driver_total == device_total and "allocated_bytes.all.current" in stats
    detail = f"free {free / GiB:.2f} of {driver_total / GiB:.2f} GiB"
    if driver_total != device_total:
        detail += f"; cudaMemGetInfo total {driver_total} B != device total {device_total} B"
    return ok, detail


def check_mem_info(c: Checks, device: torch.device) -> None:
    with c.check("device: mem_info / total / stats") as row:
        info, total, stats = dev.mem_info(device), dev.total_memory(device), dev.memory_stats(device)
        if device.type == "cuda":
            ok, detail = mem_info_verdict(info[0], info[1], total, stats)
            expect(row, ok, detail)
            row["value"] = info[1] / GiB
        else:
            expect(row, info is None and total is None and stats == {}, "CPU: none of these exist")


def check_cap(c: Checks, device: torch.device) -> None:
    """The cap is set as asked, a larger cap inside never raises it, and the one before comes back."""
    with c.check("device: cap set / restore / never raised") as row:
        if device.type == "cuda":
            before = dev.get_cap_fraction(device)
            total = dev.total_memory(device)
            with dev.memory_cap(total // 2, device):
                inside = dev.get_cap_fraction(device)
                with dev.memory_cap(total, device):  # a larger cap inside must not raise the smaller one
                    nested = dev.get_cap_fraction(device)
            after = dev.get_cap_fraction(device)
            same = lambda x, y: abs(x - y) * total <= 2  # noqa: E731  (the allocator stores whole bytes)
            expect(row, same(inside, min(before, total // 2 / total)) and same(nested, inside) and same(after, before),
                    f"fraction {before:.3f} -> {inside:.3f} (nested {nested:.3f}) -> {after:.3f}")
        else:
            with dev.memory_cap(123, device) as cpu_budget:
                expect(row, cpu_budget == 123, "CPU: the budget is handed to the CPU tracker")


def outside_verdict(outside: int, how: str) -> tuple[bool, str]:
    """Memory outside the allocator is measured (not the documented default), above 0 (the CUDA context alone
    takes hundreds of MiB) and below 4 GiB."""
    measured = not how.startswith("default")
    return measured and 0 < outside < 4 * GiB, how


def check_outside_allocator(c: Checks, device: torch.device, name: str = "device: outside-allocator memory",
                            refresh: bool = False, at_start: int | None = None) -> None:
    with c.check(name) as row:
        # after training, the budget follows what grew outside the allocator, as train() does after step 0
        # (follow_outside measures again and lowers the cap); without a budget, only the measurement again
        followed = refresh and dev.follow_outside(device) is not None
        outside, how = dev.outside_allocator_bytes(device, refresh=refresh and not followed)
        row["value"] = outside / GiB
        if device.type == "cuda":
            ok, detail = outside_verdict(outside, how)
            if at_start is not None:
                detail += f"; {at_start / GiB:.2f} GiB at the start (what the budget subtracts); value = GiB now"
            expect(row, ok, detail)
        else:
            expect(row, outside == 0, how)


def lab04_verdict(free: int, total: int, device_total: int, counters: list) -> bool:
    return 0 < free <= total == device_total and all(v >= 0 for v in counters)


def check_lab04_calls(c: Checks, device: torch.device) -> None:
    if device.type != "cuda":
        c.skip("torch.cuda calls of lab 04", "no CUDA GPU")
        return
    with c.check("torch.cuda calls of lab 04") as row:
        free, total = torch.cuda.mem_get_info()
        vals = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated(),
                torch.cuda.memory_stats().get("num_alloc_retries", 0), torch.cuda.current_device()]
        # lab 04's torch.cuda.list_gpu_processes(), through the device module's guard: NVML refuses in WSL and
        # some containers, which is no fault of this machine's CUDA
        procs, how = dev.gpu_processes(device)
        listed = (f"list_gpu_processes: {len(procs)} process(es)" if procs is not None
                  else f"list_gpu_processes unavailable ({how})")
        expect(row, lab04_verdict(free, total, torch.cuda.get_device_properties(device.index).total_memory, vals),
                f"mem_get_info, memory_allocated/reserved, max_memory_allocated, memory_stats; {listed}")


FP16_STEPS = 6  # enough steps that a scaler skipping most of them is not just calibrating its initial scale


def train_verdict(precision: str, res, steps: int) -> tuple[bool, str]:
    """A run trains: status ok, every step's loss finite. fp16: the GradScaler is there (a scale per step) and
    skipped at most half of the steps (its first steps may overflow at the initial scale of 65536)."""
    ok = res.ok and len(res.losses) == steps and all(math.isfinite(x) for x in res.losses)
    detail = "status " + res.status + ", losses " + ", ".join(f"{x:.3f}" for x in res.losses)
    if get(precision).scaler:
        scaled = len(res.loss_scales) == steps
        few_skips = 2 * len(res.skipped) <= steps
        ok = ok and scaled and few_skips
        detail += (f", skipped {len(res.skipped)} of {steps}" + ("" if few_skips else " (more than half)")
                   + ("" if scaled else "; no GradScaler"))
    return ok, detail + (f"; {res.error}" if res.error else "")


def check_training(c: Checks, device: torch.device, only: tuple[str, ...] | None = None) -> None:
    """One short run per precision this device supports (``only``: those of them): finite losses, the fp16
    scaler working."""
    from ..core.train import run

    name = "gpt2" if device.type == "cuda" else "tiny"
    precisions = []
    for p in PRECISIONS.values():  # each this device has; a CPU trains FP16 / BF16 emulated, TF32 needs the GPU
        ok, why = p.native(device)
        if ok or (p.amp and device.type != "cuda"):
            precisions.append(p.name)
        else:
            c.skip(f"train step {p.name}", why)
    for precision in [p for p in precisions if only is None or p in only]:
        with c.check(f"train step {precision}") as row:
            steps = FP16_STEPS if get(precision).scaler else 3
            res = run(small_config(name, **{"train.precision": precision, "train.steps": steps}), device,
                      progress=False, verbose=False)
            ok, detail = train_verdict(precision, res, steps)
            row["value"] = res.peak_memory_bytes / MiB if res.peak_memory_bytes else None
            expect(row, ok, f"{name}: {detail}; value = peak MiB")


def oom_recovery_verdict(capped_status: str, capped_peak: int | None, step_start: int, base: int | None,
                         after_oom: int | None, rerun_status: str, after_rerun: int | None) -> tuple[bool, str]:
    """A run under a cap too small for it is refused by an out-of-memory error raised *during training*, the memory
    comes back to where it was, and the same run then trains. ``base``/``after_*``: allocated bytes (None on CPU)."""
    problems = []
    if capped_status != "oom":
        problems.append(f"the capped run was not refused (status {capped_status})")
    elif capped_peak is None or capped_peak <= step_start:
        problems.append("the out-of-memory error came before training started")
    if base is not None and after_oom != base:
        problems.append(f"after the OOM {((after_oom or 0) - base) / MiB:+.1f} MiB stayed allocated")
    if rerun_status != "ok":
        problems.append(f"the run after the OOM did not train (status {rerun_status})")
    if base is not None and after_rerun != base:
        problems.append(f"after the rerun {((after_rerun or 0) - base) / MiB:+.1f} MiB stayed allocated")
    return not problems, "; ".join(problems) or (
        "OOM raised inside a training step, caught; memory back to baseline; the next run trained"
        + ("" if base is not None else " (CPU: simulated budget, no allocator to read)"))


def check_cap_and_oom(c: Checks, device: torch.device) -> None:
    """Run a real training step under a cap too small for it, catch the error, get the memory back, train again."""
    from ..core.memory import release
    from ..core.train import run

    cuda = device.type == "cuda"
    cfg = small_config("gpt2" if cuda else "tiny", **{"train.steps": 2})
    with c.check("cap + OOM recovery") as row:
        release()
        base = dev.allocated(device)
        fits = run(cfg, device, progress=False, verbose=False)
        start, peak = fits.memory["start_bytes"], fits.peak_memory_bytes
        cap = start + (peak - start) // 2  # the model and data fit, half of what the step adds does not
        if cuda:
            with dev.memory_cap(cap, device):
                capped = run(cfg, device, progress=False, verbose=False)
        else:
            capped = run(cfg, device, progress=False, verbose=False, cpu_budget_bytes=cap)
        release()
        after_oom = dev.allocated(device)
        rerun = run(cfg, device, progress=False, verbose=False)
        release()
        after_rerun = dev.allocated(device)
        ok, detail = oom_recovery_verdict(capped.status, capped.peak_memory_bytes, start, base, after_oom,
                                          rerun.status, after_rerun)
        row["value"] = cap / MiB
        expect(row, ok and fits.ok, f"cap {cap / MiB:.0f} MiB (peak {peak / MiB:.0f}): {detail}; value = cap MiB")


def _tiny_step(model, batch):
    model(**batch, use_cache=False).loss.backward()


NO_FRAMES = "no Python frames"  # how labutils.labs.lab04.profiling labels an allocation that was recorded without a stack


def snapshot_verdict(summary: dict) -> tuple[bool, str]:
    """Events were recorded, and some allocation has a stack (the forward's always do; backward's, on autograd's
    thread, legitimately have none): a snapshot where no site has a stack recorded none at all."""
    sites = [r["site"] for r in summary["top_allocated"]]
    top = summary["top_at_peak"][0]["site"] if summary["top_at_peak"] else "(none)"
    with_stack = [s for s in sites if NO_FRAMES not in s]
    ok = summary["events"] > 0 and bool(with_stack)
    return ok, (f"peak {summary['peak_bytes'] / MiB:.1f} MiB; top holder: {top}"
                + ("" if with_stack else "; no allocation has a stack (recorded without frames)"))


def check_snapshot(c: Checks, device: torch.device, session) -> None:
    """Record allocator events over a step, dump them, read the dump back with the course's parser."""
    from ..labs.lab04.profiling import CPUTraceRecorder, trace_summary

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
        s = trace_summary(snap, start_bytes=start, top=10)
        row["value"] = s["events"]
        expect(row, *snapshot_verdict(s))


def profiler_verdict(rows: list[dict], cuda: bool) -> bool:
    """The two ranges, in order; on CUDA with device time, backward (about twice forward's matmuls) >= forward;
    on CPU no device time at all."""
    if [r["range"] for r in rows] != ["forward", "backward"]:
        return False
    if cuda:
        fwd, bwd = (r["device time (ms)"] for r in rows)
        return fwd is not None and bwd is not None and 0 < fwd <= bwd
    return all(r["device time (ms)"] is None for r in rows)


def check_profiler(c: Checks, device: torch.device, session) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..labs.lab04.profiling import range_times

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
        expect(row, profiler_verdict(rows, device.type == "cuda"),
                "; ".join(f"{r['range']}: cpu {r['cpu time (ms)']:.1f} ms, device "
                          f"{_fmt(r['device time (ms)']) or '-'} ms" for r in rows) or "no forward/backward range")


def check_checkpointing(c: Checks, device: torch.device) -> None:
    """Every checkpointing variant gives the gradients of no checkpointing, with dropout on: the model's API, and the
    variants lab 03 writes out in its cells (their code, run from the notebook)."""
    from ..labs.lab03 import checkpoint_measure as cm
    from ..labs.lab03 import checkpointing as ck
    from ..core.env import matmul_precision
    from ..core.memory import release

    cfg = small_config("gpt2" if device.type == "cuda" else "tiny", **{"model.dropout": 0.1, "data.seq_length": 64})
    variants = [ck.full(), ck.every_n(2)]
    try:  # lab 03's own cells: in a checkout (pip install -e .), not in an installed package without the notebooks
        nb = ck.notebook_variants()
        variants += [nb["segments"](2), nb["selective"](), nb["offload"](), nb["offload"](True)]
    except (OSError, SyntaxError, LookupError) as exc:  # no notebook (an installed package), or a student's edit
        c.skip("checkpointing grads: lab 03's cell variants", f"not read from lab 03's notebook: {type(exc).__name__}: "
                                                               f"{exc}")
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
                expect(row, d <= GRAD_TOLERANCE,
                       f"max relative difference vs no checkpointing (limit {GRAD_TOLERANCE:g})")
    release()


def check_estimator(c: Checks, device: torch.device) -> None:
    from ..estimator import estimate as est
    from ..core.train import run

    name = "gpt2" if device.type == "cuda" else "tiny"
    cases = [("fp32", False, 2), ("fp16", True, 4)] if device.type == "cuda" else [("fp32", False, 2)]
    for precision, ckpt, micro in cases:
        with c.check(f"estimator vs measured: {name} {precision}{' ckpt' if ckpt else ''} b{micro}") as row:
            cfg = small_config(name, **{"train.precision": precision, "train.gradient_checkpointing": ckpt,
                                "train.micro_batch_size": micro, "train.steps": 2})
            res = run(cfg, device, progress=False, verbose=False)
            e = est.estimate_memory(cfg, device=device.type)
            cmp = est.compare(e, res.peak_memory_bytes, res.memory.get("start_bytes"), device.type)
            row["value"] = cmp["error_pct"]
            expect(row, res.ok and cmp["error_pct"] is not None and abs(cmp["error_pct"]) <= ESTIMATOR_TOLERANCE_PCT,
                    f"{cmp['basis']}: estimated {cmp['estimated_bytes'] / MiB:.1f} MiB, measured "
                    f"{(cmp['measured_bytes'] or 0) / MiB:.1f} MiB; value = error %")


def empty_caches_verdict(before: int | None, after: int | None) -> tuple[str, str]:
    """("pass" | "fail" | "skip", detail): pinned host memory was held, and empty_caches gave all of it back."""
    if before is None:
        return "skip", (f"torch {torch.__version__} has no torch.cuda.host_memory_stats (torch >= 2.7): pinned "
                        "host memory cannot be read, so freeing it is not judged")
    if before <= 0:
        return "fail", "no pinned host memory was held before emptying: nothing was tested"
    return ("pass" if after == 0 else "fail"), f"pinned host bytes {before} -> {after}"


def check_empty_caches(c: Checks, device: torch.device) -> None:
    """After the offload variants (save_on_cpu pins host memory), empty_caches frees the pinned host cache too."""
    with c.check("device: empty caches (device + pinned host)") as row:
        if device.type != "cuda":
            dev.empty_caches(device)
            # without CUDA there is no pinned host allocator (a CPU run on a GPU machine has one: not judged)
            expect(row, dev.pinned_host_bytes() is None or dev.cuda_available(), "CPU: no pinned host allocator")
            return
        if dev.pinned_host_bytes() == 0:  # hold some: a freed pinned block stays in the caching host allocator
            torch.empty(MiB, dtype=torch.uint8, pin_memory=True)
        before = dev.pinned_host_bytes()
        dev.empty_caches(device)
        status, detail = empty_caches_verdict(before, dev.pinned_host_bytes())
        row["status"], row["detail"] = status, detail

