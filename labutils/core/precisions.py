"""The precisions the course trains in, as data (one row each), and the one answer to "which mixed precision on
this device, and why". Nothing else compares precision names: it asks a row (``get(p).autocast``, ``.scaler``) or
:func:`amp_precision`. A name not in :data:`PRECISIONS` is refused when a config is read (labutils.core.config)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from . import device_facts as facts


@dataclass(frozen=True)
class Precision:
    name: str                      # the config's train.precision and every table's key (peaks, results)
    label: str                     # how tables and figures name it
    autocast: torch.dtype | None   # autocast's dtype; None: no autocast (FP32 weights and math)
    tf32: bool                     # float32 matmuls on TF32 tensor cores
    scaler: bool                   # needs a GradScaler: FP16's 5 exponent bits underflow small gradients
    bytes: int                     # bytes per element of the matmuls' inputs (the copies autocast makes)
    color: str                     # its colour in every figure
    native: Callable               # device -> (runs natively?, why), from labutils.core.device_facts
    peak: str                      # the datasheet column it computes at (labutils.core.peaks)
    rtol: float                    # a matmul's relative error vs float64 its mantissa allows (doctor's check)

    @property
    def amp(self) -> bool:
        return self.autocast is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the matmuls compute in (FP32 for fp32 and tf32)."""
        return self.autocast or torch.float32


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "FP32 (TF32 off)", None, False, False, 4, "#3498db", lambda device=None: (True, "everywhere"),
              "fp32", 1e-5),
    Precision("tf32", "TF32", None, True, False, 4, "#9b59b6", facts.tf32_support, "tf32", 5e-3),
    Precision("fp16", "FP16 + GradScaler", torch.float16, False, True, 2, "#e74c3c", facts.fp16_support, "fp16", 5e-3),
    Precision("bf16", "BF16", torch.bfloat16, False, False, 2, "#2ecc71", facts.bf16_support, "bf16", 3e-2),
)}
NAMES = tuple(PRECISIONS)
BASELINE = "fp32"  # what every speed-up and memory saving of the course is measured against


def get(name: str) -> Precision:
    """The row of ``name``; a ValueError naming the allowed ones otherwise."""
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"precision {name!r}: must be one of {', '.join(NAMES)}") from None


def dtype_name(dtype) -> str:
    """The table's name of a tensor's dtype (torch.float32: "fp32"), or torch's name for one not in it."""
    return next((p.name for p in PRECISIONS.values() if p.dtype == dtype and not p.tf32), str(dtype))


def choose(native: Callable[[str], tuple[bool, str]], gpu: bool, emulated_ok: bool = True) -> tuple[str, str]:
    """The rule, given ``native(name) -> (bool, why)`` for the device (or a card by name): BF16 where native; else
    FP16 + GradScaler on a GPU; else (a CPU without BF16) FP16 when ``emulated_ok`` (a lab showing what autocast
    does), FP32 when not (emulated 16-bit matmuls cost many times FP32's)."""
    ok, why = native("bf16")
    if ok:
        return "bf16", why
    if gpu:
        return "fp16", f"{why}: FP16 with its GradScaler instead"
    fp16, why16 = native("fp16")
    if fp16 or emulated_ok:
        return "fp16", f"{why}; {why16}"
    return "fp32", f"{why}; {why16}: this run stays in FP32"


def amp_precision(device=None, emulated_ok: bool = True) -> tuple[str, str]:
    """Which mixed precision on ``device``, and why (:func:`choose` with this device's answers)."""
    device = facts.resolve(device)
    return choose(lambda name: get(name).native(device), device.type == "cuda", emulated_ok)


def autocast(name: str, device) -> contextlib.AbstractContextManager:
    """The autocast context of a precision (reusable across micro-batches); a no-op where it has none."""
    p = get(name)
    return torch.amp.autocast(torch.device(device).type, dtype=p.autocast) if p.amp else contextlib.nullcontext()


def scaler(name: str, device, **kwargs):
    """A ``torch.amp.GradScaler`` where the precision needs one (kwargs: init_scale, growth_interval...), else None."""
    return torch.amp.GradScaler(torch.device(device).type, **kwargs) if get(name).scaler else None
