"""The doctor's speed checks (``python -m labutils doctor``): matmul TFLOP/s per format against the datasheets'
ratios, and configs/fast_config.yaml trained for a few steps, its MFU printed (issue 28: no card fails for its
MFU; the MFU goal is the benchmark's, ``python -m labutils bench``)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from . import device as dev
from .claims import MIN_TIMED_STEPS
from .doctor_checks import Checks, expect


def _matmul_speed_floor(label: str, gpu_name: str, capability: tuple[int, int]) -> tuple[float | None, str]:
    """How much faster than strict FP32 ``label`` must be on this card (None: not judged), and why: the ratio
    of the datasheets' dense peaks (labutils.peaks). Where that ratio is about 2 or more (L4 TF32: 1.98;
    datacentre TF32, every tensor-core FP16/BF16), at least 1.5x; GeForce Ampere/Ada/Blackwell run TF32 at the FP32 rate
    (whitepapers), so there only "not slower" (0.9x) is asked."""
    from .peaks import peak_tflops

    fp32, other = peak_tflops(gpu_name, "fp32"), peak_tflops(gpu_name, label)
    if fp32 and other:
        ratio = other / fp32
        return (1.5 if ratio >= 1.9 else 0.9), f"datasheet {label}/fp32 = {ratio:.1f}x"
    if label in ("fp16", "bf16") and capability[0] >= (8 if label == "bf16" else 7):
        return 1.5, f"{label} tensor cores (compute capability {capability[0]}.{capability[1]})"
    return None, "card not in the peaks table: speed not judged"


def matmul_verdict(label: str, tflops: float, rel_error: float, fp32_tflops: float | None,
                   floor: float | None, why: str, cuda: bool) -> tuple[bool, str]:
    """The product is right (vs float64) to what the format allows; TF32 really engaged (its 10-bit mantissa
    shows) and FP32 strict; on CUDA, faster than strict FP32 by ``floor``. CPU timing judges no speed."""
    limit = {"fp32": 1e-5, "tf32": 5e-3, "fp16": 5e-3, "bf16": 3e-2}[label]
    ok = tflops > 0 and rel_error <= limit
    detail = f"relative error vs float64 {rel_error:.1e} (limit {limit:g})"
    if label == "tf32" and rel_error <= 1e-5:
        ok, detail = False, detail + "; an FP32-sized error: TF32 not engaged"
    if not cuda:
        return ok, detail + "; CPU timing: speed not judged"
    if label != "fp32" and floor is not None and fp32_tflops:
        fast = tflops >= floor * fp32_tflops
        ok = ok and fast
        detail += f"; {tflops / fp32_tflops:.2f}x fp32 (needs >= {floor:g}x: {why})"
    elif label != "fp32":
        detail += f"; {why}"
    return ok, detail


def check_matmul(c: Checks, device: torch.device) -> None:
    cuda = device.type == "cuda"
    n = 4096 if cuda else 512
    formats = [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False)]
    if cuda:
        formats = [("fp32", torch.float32, False), ("fp16", torch.float16, False)]
        if dev.tf32_support(device)[0]:
            formats.insert(1, ("tf32", torch.float32, True))
        if dev.bf16_support(device)[0]:
            formats.append(("bf16", torch.bfloat16, False))
        capability = dev.capability(device)
    fp32_tflops = None
    for label, dtype, tf32 in formats:
        with c.check(f"matmul TFLOP/s {label} ({n}x{n})") as row:
            tflops, err = _matmul_measure(n, dtype, tf32, device)
            row["value"] = tflops
            floor, why = _matmul_speed_floor(label, dev.name(device), capability) if cuda else (None, "")
            expect(row, *matmul_verdict(label, tflops, err, fp32_tflops, floor, why, cuda))
            if label == "fp32":
                fp32_tflops = tflops


def _matmul_measure(n: int, dtype: torch.dtype, tf32: bool, device: torch.device) -> tuple[float, float]:
    """(TFLOP/s of an n x n matmul, relative error of a 256 x 256 block of the product vs float64)."""
    from .env import matmul_precision

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
MFU_GOAL = 0.45  # issue 21: build-nanogpt reaches about 50 % on an A100 for GPT-2 small; the fast path must reach 45 %
# The cards the goal is set for: A100 and H100 (issue 21), and the H200 (the H100's GH100 chip with the same
# datasheet peaks and more memory bandwidth). Others: the MFU is printed, not judged.
MFU_GOAL_CARDS = ("a100", "h100", "h200")
FAST_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "fast_config.yaml"


def mfu_goal(gpu_name: str | None, precision: str) -> float | None:
    """The MFU goal on this card in this precision, or None (no goal): 45 % on a card of MFU_GOAL_CARDS whose
    dense peak labutils.peaks knows."""
    from .peaks import normalise, peak_tflops

    if not gpu_name or peak_tflops(gpu_name, precision) is None:
        return None
    return MFU_GOAL if normalise(gpu_name).split(" ")[0] in MFU_GOAL_CARDS else None


def mfu_verdict(mfu: float | None, gpu_name: str | None, precision: str = "bf16", status: str = "ok",
                error: str | None = None, not_judged: list[str] | tuple[str, ...] = ()) -> tuple[bool, str]:
    """The fast config trained (status ok); on a card with a goal (:func:`mfu_goal`) its MFU reached it. Elsewhere
    the MFU is shown and not judged (no goal for this card), or there is none (the card's peak is unknown).
    ``not_judged``: why this run cannot be held to the goal although the card has one (a memory budget is active,
    the micro-batch was lowered to fit): the goal is for the config as written on the whole card (issue 21: speed
    rows run without the cap), so the MFU is shown with those reasons and not judged."""
    from .peaks import peak_info

    if status != "ok":
        return False, f"the fast config did not train: status {status}" + (f" ({error})" if error else "")
    if mfu is None:
        return True, f"no MFU: {peak_info(gpu_name, precision)[1]}; not judged"
    goal = mfu_goal(gpu_name, precision)
    if goal is None:
        return True, f"MFU {100 * mfu:.1f} % ({precision}); no goal for this card: not judged"
    if not_judged:
        return True, (f"MFU {100 * mfu:.1f} % ({precision}); not judged against the {100 * goal:.0f} % goal: "
                      + "; ".join(not_judged) + " (the goal holds for the config as written, without a cap)")
    return mfu >= goal, f"MFU {100 * mfu:.1f} % ({precision}), goal >= {100 * goal:.0f} % on {gpu_name}"


def fast_path_config(device: torch.device):
    """configs/fast_config.yaml for the doctor: the config's warm-up steps (compile included) + MIN_TIMED_STEPS
    timed ones (the claims' evidence rule, labutils.claims: the MFU verdict rests on as many timed steps as any
    timed claim), random weights (no download: MFU does not depend on them), FP16 where the card has no BF16, and
    the largest micro-batch the estimator fits on this card, as ``python -m labutils run`` picks it. Returns
    (config, the line saying what the fit changed or None)."""
    from .advise import default_budget_bytes, fit_micro_batch
    from .config import load_config

    base = load_config(FAST_CONFIG, mode="full")
    t = base.train
    steps = t.timing_warmup_steps + MIN_TIMED_STEPS
    over = {"train.steps": steps, "model.pretrained": "false",
            "data.num_samples": min(base.data.num_samples, steps * t.micro_batch_size * t.accumulation_steps)}
    if t.precision == "bf16" and not dev.bf16_support(device)[0]:
        over["train.precision"] = "fp16"
    return fit_micro_batch(load_config(FAST_CONFIG, overrides=over, mode="full"), default_budget_bytes()[0])


def check_fast_path(c: Checks, device: torch.device) -> None:
    """configs/fast_config.yaml trained for a few steps; MFU over the timed steps next to the goal. The compiling
    steps are the config's timing warm-up: ``train.run`` leaves them out of the step time the MFU uses."""
    name = "fast path MFU (fast_config.yaml)"
    if device.type != "cuda":
        c.skip(name, "no CUDA GPU: MFU is measured against a GPU's peak (CPU timing judges no speed)")
        return
    if not FAST_CONFIG.is_file():
        c.skip(name, f"{FAST_CONFIG} not found (an installed labutils without the repository's configs/)")
        return
    from .train import run

    with c.check(name) as row:
        cfg, fitted = fast_path_config(device)
        t = cfg.train
        budget = dev.current_budget()  # set by run_doctor from LAB_GPU_MEMORY_GB, or by the fit just above
        why_not = ([f"a memory budget is active (behaving like a {budget['card_gib']:g} GB card)"] if budget else []) \
            + (["the micro-batch was lowered to fit"] if fitted else [])
        res = run(cfg, device, progress=False, verbose=False)
        ok, detail = mfu_verdict(res.mfu, dev.name(device), t.precision, res.status, res.error, why_not)
        row["value"] = None if res.mfu is None else 100 * res.mfu
        # A missed goal is a real finding (doctor fails), but the labs do not need the fast path's speed: it does
        # not stop `regenerate`. A fast config that does not train at all still does.
        if not ok and res.status == "ok":
            row["gates_regenerate"] = False
        parts = [detail, f"{t.micro_batch_size} x {t.accumulation_steps} x T{cfg.data.seq_length}"]
        warm = res.step_times[:t.timing_warmup_steps]
        if res.step_time_seconds:
            parts.append(f"{len(res.step_times) - len(warm)} timed steps, {res.step_time_seconds * 1e3:.0f} ms/step")
        compile_s = getattr(res, "compile_seconds", None)  # RunResult.compile_seconds where train.py reports it
        if compile_s is not None:
            parts.append(f"compile {compile_s:.1f} s, not timed")
        elif warm:
            parts.append(f"{len(warm)} warm-up steps (compile included) {sum(warm):.1f} s, not timed")
        parts += [fitted] if fitted else []
        detail = "; ".join(parts) + "; value = MFU %"
        expect(row, ok, detail)

