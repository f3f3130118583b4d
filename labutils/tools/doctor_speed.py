"""The doctor's speed checks (``python -m labutils doctor``): matmul TFLOP/s per format against the datasheets'
ratios, and configs/fast_config.yaml trained for a few steps: it must train; its MFU is printed, never judged
(a health check fails no card for speed: the MFU goal is the benchmark's, ``python -m labutils bench``)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..core import device as dev
from ..verdicts.claims import MIN_TIMED_STEPS
from .doctor_checks import Checks, expect
from ..core.precisions import BASELINE, PRECISIONS, get


def _matmul_speed_floor(label: str, gpu_name: str, capability: tuple[int, int]) -> tuple[float | None, str]:
    """How much faster than strict FP32 ``label`` must be on this card (None: not judged), and why: where the
    datasheets' dense peaks differ 2x or more (datacentre TF32, tensor-core FP16/BF16), at least 1.5x; GeForce
    Ampere/Ada/Blackwell run TF32 at the FP32 rate, so there only "not slower" (0.9x)."""
    from ..core.peaks import peak_tflops

    fp32, other = peak_tflops(gpu_name, "fp32"), peak_tflops(gpu_name, label)
    if fp32 and other:
        ratio = other / fp32
        return (1.5 if ratio >= 1.9 else 0.9), f"datasheet {label}/fp32 = {ratio:.1f}x"
    if get(label).amp and capability[0] >= 7:  # tensor cores from Volta on (BF16 runs only where native: Ampere)
        return 1.5, f"{label} tensor cores (compute capability {capability[0]}.{capability[1]})"
    return None, "card not in the peaks table: speed not judged"


def matmul_verdict(label: str, tflops: float, rel_error: float, fp32_tflops: float | None,
                   floor: float | None, why: str, cuda: bool) -> tuple[bool, str]:
    """The product is right (vs float64) to what the format allows; TF32 really engaged (its 10-bit mantissa
    shows) and FP32 strict; on CUDA, faster than strict FP32 by ``floor``. CPU timing judges no speed."""
    limit = get(label).rtol
    ok = tflops > 0 and rel_error <= limit
    detail = f"relative error vs float64 {rel_error:.1e} (limit {limit:g})"
    if get(label).tf32 and rel_error <= 1e-5:
        ok, detail = False, detail + "; an FP32-sized error: TF32 not engaged"
    if not cuda:
        return ok, detail + "; CPU timing: speed not judged"
    if label != BASELINE and floor is not None and fp32_tflops:
        fast = tflops >= floor * fp32_tflops
        ok = ok and fast
        detail += f"; {tflops / fp32_tflops:.2f}x fp32 (needs >= {floor:g}x: {why})"
    elif label != BASELINE:
        detail += f"; {why}"
    return ok, detail


def check_matmul(c: Checks, device: torch.device) -> None:
    cuda = device.type == "cuda"
    n = 4096 if cuda else 512
    # a GPU: each format it has; a CPU: FP32 and BF16 (no TF32 tensor cores; FP16 without a scaler's use here)
    formats = [(p.name, p.dtype, p.tf32) for p in PRECISIONS.values()
               if (p.native(device)[0] if cuda else not (p.tf32 or p.scaler))]
    fp32_tflops = None
    for label, dtype, tf32 in formats:
        with c.check(f"matmul TFLOP/s {label} ({n}x{n})") as row:
            tflops, err = _matmul_measure(n, dtype, tf32, device)
            row["value"] = tflops
            floor, why = _matmul_speed_floor(label, dev.name(device), dev.capability(device)) if cuda else (None, "")
            expect(row, *matmul_verdict(label, tflops, err, fp32_tflops, floor, why, cuda))
            if label == BASELINE:
                fp32_tflops = tflops


def _matmul_measure(n: int, dtype: torch.dtype, tf32: bool, device: torch.device) -> tuple[float, float]:
    """(TFLOP/s of an n x n matmul, relative error of a 256 x 256 block of the product vs float64)."""
    from ..core.env import matmul_precision

    with matmul_precision(tf32):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            a @ b
        dev.synchronize(device)
        reps, start = 5, time.perf_counter()
        for _ in range(reps):
            a @ b
        dev.synchronize(device)
        tflops = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
        m = 256
        x, y = a[:m], b[:, :m]
        ref = x.double() @ y.double()
        err = float((x @ y).double().sub(ref).norm() / ref.norm())
    return tflops, err


# ------------------------------------------------------------------------------------------ the fast path's MFU
FAST_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "fast_config.yaml"


def mfu_verdict(mfu: float | None, gpu_name: str | None, precision: str = "bf16", status: str = "ok",
                error: str | None = None, context: list[str] | tuple[str, ...] = ()) -> tuple[bool, str]:
    """The fast config trained (status ok): all the doctor judges; its MFU is shown, never judged. ``context`` says how
    it was measured (a memory budget, a lowered micro-batch), or why there is none (the card's peak is unknown)."""
    from ..core.peaks import peak_info

    if status != "ok":
        return False, f"the fast config did not train: status {status}" + (f" ({error})" if error else "")
    how = f" ({'; '.join(context)})" if context else ""
    if mfu is None:
        return True, f"no MFU: {peak_info(gpu_name, precision)[1]}{how}"
    return True, (f"MFU {100 * mfu:.1f} % ({precision}){how}; shown, not judged: the MFU goal is the "
                  f"benchmark's (python -m labutils bench), a health check fails no card for speed")


def reference_ratio(cfg, device: torch.device, repeats: int = 2) -> tuple[float | None, str]:
    """The fast path's speed as a ratio to the nanoGPT-style reference (:func:`labutils.tools.bench.reference_ratio`,
    two ABBA pairs by default), shown next to the MFU, never judged. Returns (ratio or None, what to print): a run
    that cannot fit here gives (None, why), not a failure."""
    from .bench import reference_ratio as bench_ratio

    got = bench_ratio(cfg, repeats=repeats, device=device)
    if got["ratio"] is None:
        return None, f"ratio to the reference: not measured ({got['verdict']['why']})"
    ours, theirs, rr = got["labutils"]["step_time_seconds"], got["reference"]["step_time_seconds"], got["ratio_runs"]
    spread = f"per pair {rr['min']:.3f}..{rr['max']:.3f}" if len(rr["runs"]) > 1 else "one pair: no spread"
    return got["ratio"], (f"ratio to the nanoGPT-style reference {got['ratio']:.3f}x ({spread}; median step "
                          f"{ours['median'] * 1e3:.1f} vs {theirs['median'] * 1e3:.1f} ms, {got['repeats']} ABBA "
                          f"repeats, {got['mode']}; goal >= {got['verdict']['goal']:g}, judged by `python -m "
                          f"labutils bench`, not here)")


def fast_path_config(device: torch.device):
    """configs/fast_config.yaml fitted to this card as ``bench`` and ``run`` fit it
    (:func:`labutils.core.train.for_this_card`), then shortened: its warm-up + MIN_TIMED_STEPS timed steps, random
    weights, only the samples those steps read. Returns (config, one line per change)."""
    from ..core.config import load_config
    from ..core.train import for_this_card

    cfg, changes = for_this_card(load_config(FAST_CONFIG, mode="full"), device)
    t = cfg.train
    steps = t.timing_warmup_steps + MIN_TIMED_STEPS
    return cfg.override({"train.steps": steps, "model.pretrained": "false", "data.num_samples": min(
        cfg.data.num_samples, steps * t.micro_batch_size * t.accumulation_steps)}), changes


def check_fast_path(c: Checks, device: torch.device) -> None:
    """configs/fast_config.yaml trained for a few steps: it must train; its MFU over the timed steps and the
    ratio to the reference are shown, never judged. The compiling steps are its timing warm-up, their time
    recorded apart (``compile_seconds``). Skipped with the reason where torch.compile cannot compile for this GPU."""
    name = "fast path MFU (fast_config.yaml)"
    if device.type != "cuda":
        c.skip(name, "no CUDA GPU: MFU is measured against a GPU's peak (CPU timing judges no speed)")
        return
    if not FAST_CONFIG.is_file():
        c.skip(name, f"{FAST_CONFIG} not found (an installed labutils without the repository's configs/)")
        return
    from ..estimator.advise import default_budget_bytes
    from ..core.train import run

    with c.check(name) as row:
        cfg, changes = fast_path_config(device)
        compiles, why = dev.compile_support(device)
        if cfg.train.compile and not compiles:  # its compile would raise, and a row that is never "ok" would block
            row["status"] = "skip"              # `regenerate`: not judged, with the reason
            row["detail"] = f"the fast config compiles (train.compile: true) and {why}"
            return
        t = cfg.train
        b, where = default_budget_bytes()  # what for_this_card fitted the micro-batch to, as bench says too
        context = [f"{'under a memory budget: ' if dev.current_budget() else ''}micro-batch fitted to {where} "
                   f"({b / 2**30:.2f} GiB)"] + (["lowered to fit"] if "train.micro_batch_size" in cfg.origins else [])
        res = run(cfg, device, progress=False, verbose=False)
        ok, detail = mfu_verdict(res.mfu, dev.name(device), t.precision, res.status, res.error, context)
        row["value"] = None if res.mfu is None else 100 * res.mfu
        ratio, ratio_text = (reference_ratio(cfg, device) if res.status == "ok" else
                             (None, "ratio to the reference: not measured (the fast config did not train)"))
        row["reference_ratio"] = ratio
        parts = [detail, ratio_text, f"{t.micro_batch_size} x {t.accumulation_steps} x T{cfg.data.seq_length}"]
        warm = res.step_times[:t.timing_warmup_steps]
        if res.step_time_seconds:
            parts.append(f"{len(res.step_times) - len(warm)} timed steps, {res.step_time_seconds * 1e3:.0f} ms/step")
        row["compile_seconds"] = res.compile_seconds
        if res.compile_seconds is not None:
            parts.append(f"compile {res.compile_seconds:.1f} s, not timed")
        elif warm:
            parts.append(f"{len(warm)} warm-up steps (compile included) {sum(warm):.1f} s, not timed")
        expect(row, ok, "; ".join(parts + changes) + "; value = MFU %")
