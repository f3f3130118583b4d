"""The doctor's number-format checks (``python -m labutils doctor``): labutils' BF16 / TF32 answers against real
ops on the device (a bfloat16 matmul, an fp32 matmul inside the course's TF32 switch, each against float64), and
the TF32 switch's legacy and new flags agreeing. Verdicts are functions of the measured numbers
(tests/test_doctor_checks.py hands them broken ones)."""
from __future__ import annotations

import torch

from ..core import device as dev
from .doctor_checks import Checks, expect


BF16_ERROR = (1e-5, 3e-2)  # a bf16 product's relative error vs float64: above an fp32-sized error, within bf16's
TF32_MIN_ERROR = 1e-5      # a TF32 product's error is ~1e-4..1e-3 (10-bit mantissa); strict fp32's ~1e-7


def support_probe(device: torch.device) -> dict:
    """Real ops on ``device``: a bfloat16 matmul, and an fp32 matmul with the course's TF32 switch on and off, each as
    its relative error against float64. ``bf16_error`` is None (``bf16_why`` says why) where bfloat16 cannot run."""
    from ..core.env import matmul_precision

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    ref = a.double() @ b.double()

    def err(x) -> float:
        return float((x.double().cpu() - ref).norm() / ref.norm())
    out = {"bf16_error": None, "bf16_why": ""}
    try:
        out["bf16_error"] = err(a.to(device, torch.bfloat16) @ b.to(device, torch.bfloat16))
    except RuntimeError as exc:  # no bfloat16 matmul kernel for this device
        out["bf16_why"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    for key, on in (("tf32_error", True), ("fp32_error", False)):
        with matmul_precision(on):
            out[key] = err(a.to(device) @ b.to(device))
    return out


def support_verdict(bf16: bool, tf32: bool, probe: dict) -> tuple[bool, str]:
    """labutils' answers against what the device did: BF16 claimed <=> a bfloat16 matmul ran with a bfloat16-sized
    error; TF32 claimed <=> the switch gave the fp32 product a TF32-sized error (off: strict fp32)."""
    lo, hi = BF16_ERROR
    e16, e_tf, e32 = probe["bf16_error"], probe["tf32_error"], probe["fp32_error"]
    problems = []
    if bf16 and (e16 is None or not lo < e16 <= hi):
        problems.append("bf16 claimed but " + (f"no bfloat16 matmul ran ({probe['bf16_why']})" if e16 is None else
                                               f"its error {e16:.1e} is not bfloat16's ({lo:g}..{hi:g})"))
    engaged = e_tf > TF32_MIN_ERROR
    if tf32 != engaged:
        problems.append(f"tf32 {'claimed' if tf32 else 'denied'} but the switch {'did' if engaged else 'did not'} "
                        f"change the fp32 product (error {e_tf:.1e})")
    if e32 > TF32_MIN_ERROR:
        problems.append(f"fp32 with TF32 off is not strict (error {e32:.1e})")
    shown = f"{e16:.1e}" if e16 is not None else f"none ({probe['bf16_why']})"
    detail = (f"bf16: {bf16}, a bf16 matmul's error {shown}; tf32: {tf32}, an fp32 matmul's error with TF32 on "
              f"{e_tf:.1e}, off {e32:.1e}")
    return not problems, "; ".join(problems + [detail])


def check_support_facts(c: Checks, device: torch.device) -> None:
    """labutils' BF16/TF32 answers (what every lab's precision choice rests on) against real ops on the device."""
    with c.check("device: bf16 / tf32 support, facts") as row:
        bf, _ = dev.bf16_support(device)
        tf, _ = dev.tf32_support(device)
        facts = dev.facts(device)
        ok, detail = support_verdict(bf, tf, support_probe(device))
        cuda = device.type == "cuda"
        expect(row, ok and (facts is not None) == cuda, f"{dev.name(device)}; {detail}")
        row["value"] = facts["compute_capability"] if facts else None


def tf32_flags(tf32: bool) -> dict:
    """Every TF32 reader of torch, legacy and new (where this torch has it), inside ``matmul_precision(tf32)``."""
    from ..core.env import matmul_precision

    b = torch.backends
    readers = {"cuda.matmul.allow_tf32": lambda: b.cuda.matmul.allow_tf32,
               "get_float32_matmul_precision": torch.get_float32_matmul_precision,
               "cudnn.allow_tf32": lambda: b.cudnn.allow_tf32}
    if hasattr(b.cuda.matmul, "fp32_precision"):
        readers["cuda.matmul.fp32_precision"] = lambda: b.cuda.matmul.fp32_precision
    with matmul_precision(tf32):
        out = {}
        for k, read in readers.items():
            try:
                out[k] = read()
            except RuntimeError as exc:
                out[k] = f"RuntimeError: {str(exc)[:100]}"
    return out


def tf32_flags_verdict(flags: dict, tf32: bool) -> tuple[bool, str]:
    want = {"cuda.matmul.allow_tf32": tf32, "get_float32_matmul_precision": "high" if tf32 else "highest",
            "cudnn.allow_tf32": tf32, "cuda.matmul.fp32_precision": "tf32" if tf32 else "ieee"}
    wrong = {k: v for k, v in flags.items() if v != want[k]}
    return not wrong, ("all agree" if not wrong else "; ".join(f"{k} = {v!r}" for k, v in wrong.items()))


def check_tf32_flags(c: Checks, device: torch.device) -> None:
    """Inside the course's TF32 switch, students and libraries read the legacy flags: they must agree."""
    with c.check("tf32 switch: legacy + new flags agree") as row:
        results = [tf32_flags_verdict(tf32_flags(on), on) for on in (True, False)]
        expect(row, all(ok for ok, _ in results), f"on: {results[0][1]}; off: {results[1][1]}")
