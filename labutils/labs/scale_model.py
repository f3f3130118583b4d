""""An 8 GB card", the same in every lab: torch's total on one (:mod:`labutils.core.cards`) minus what lives outside its
allocator (on a GPU measured there, as the labs' caps take it; for a prediction the estimator's CUDA context, as
:func:`labutils.estimator.estimate.fits` takes it), and in smoke ONE scale model of it for the whole course (:func:`course`):
every run any lab measures under the budget (:func:`lab_rows`) is predicted in full mode to fit the card or not, and
the smoke budget lies halfway (log scale) between the largest smoke peak of a run that fits and the smallest of one
that does not. Where no size can do that, :func:`course` raises naming the two: change the smoke sizes (a config's
``smoke:`` section), not the rule. Every lab takes its budget, and the line it prints, from :func:`lab_budget`.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from ..core import cards
from ..core import device as dev
from ..core.config import load_config
from ..estimator.estimate import estimate_memory, fits
from ..core.precisions import amp_precision
from .lab04.profiling_runs import SWEEP_BATCHES

CARD_GB, MiB, GiB = 8.0, 2**20, 2**30
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# lab 02's sweeps: section 2's direct E x 1 and accumulated 2 x E/2; section 4's MICRO x k; section 6's m x TARGET/m
LAB02 = {"micro": 2, "accum_steps": (1, 4, 8, 16), "proof_batches": (32, 16, 8, 4)}
LABS = {"01": "fp32_config.yaml", "02": "lab02_accumulation.yaml", "03": "lab03_checkpointing.yaml",
        "04": "lab04_techniques.yaml", "04 section 5": "lab04_profile.yaml"}


def lab_rows(lab: str, amp: str) -> dict:
    """``{label: overrides}``: the runs lab ``lab`` measures under the card's budget (the same overrides in full mode
    and in smoke); ``amp``: the mixed precision the lab compares (:func:`labutils.core.precisions.amp_precision`)."""
    b = load_config(CONFIGS / LABS[lab], mode="full").train.micro_batch_size
    if lab == "01":  # the batch sweep: FP32 and AMP at 1, B and 2B
        return {f"{p} x {m}": {"train.precision": p, "train.micro_batch_size": m} for p in ("fp32", amp)
                for m in (1, b, 2 * b)}
    if lab == "02":
        micro, exact, proof = LAB02["micro"], {"train.precision": "fp32", "model.dropout": 0.0}, LAB02["proof_batches"]
        target = micro * max(LAB02["accum_steps"])
        splits = [(f"direct {e} x 1", e, 1, exact) for e in proof] + [(f"accumulated 2 x {e // 2}", 2, e // 2, exact)
                                                                      for e in proof]
        splits += [(f"{micro} x {k}", micro, k, {}) for k in LAB02["accum_steps"]]
        splits += [(f"{2 ** i} x {target // 2 ** i}", 2 ** i, target // 2 ** i, {})
                   for i in range(1, int(math.log2(target)) + 1)]
        return {label: {"train.micro_batch_size": m, "train.accumulation_steps": k, **extra}
                for label, m, k, extra in splits}
    if lab == "03":  # at the config's micro-batch it fits the card only with checkpointing
        return {"no checkpointing, micro-batch 1": {"train.micro_batch_size": 1},
                f"no checkpointing, micro-batch {b}": {"train.micro_batch_size": b},
                f"checkpointing, micro-batch {b}": {"train.micro_batch_size": b, "train.gradient_checkpointing": True}}
    if lab == "04":  # section 8, all at the config's effective batch; accumulation 2 x 2 (the yaml says why)
        acc, mp = {"train.micro_batch_size": b // 2, "train.accumulation_steps": 2}, {"train.precision": amp}
        ck = {"train.gradient_checkpointing": True}
        return {"baseline (fp32)": {}, amp: mp, "checkpointing": ck, "accumulation x2": acc,
                f"{amp} + checkpointing": {**mp, **ck}, "all together": {**mp, **ck, **acc}}
    return {f"micro-batch {m}": {"train.micro_batch_size": m} for m in SWEEP_BATCHES}  # lab 04's batch sweep


@functools.lru_cache(maxsize=4)
def course(amp: str, amp02: str) -> dict:
    """The card's one scale model (``amp``: labs 01 and 04's mixed precision, ``amp02``: lab 02's): budget_bytes,
    why, rows (each: lab, row, overrides, full_peak_bytes, full_fits, smoke_peak_bytes, smoke_fits, full_config)."""
    total, out = cards.card_total_bytes(CARD_GB)[0], []
    for lab, name in LABS.items():
        full, smoke = load_config(CONFIGS / name, mode="full"), load_config(CONFIGS / name, mode="smoke")
        smoke = smoke.override({"train.precision": amp02}) if lab == "02" else smoke
        for label, ov in lab_rows(lab, amp).items():
            row_full = full.override(dict(ov))
            f, s = estimate_memory(row_full), estimate_memory(smoke.override(dict(ov)), device="cpu")
            out.append({"lab": lab, "row": label, "overrides": dict(ov), "full_peak_bytes": f["peak_bytes"],
                        "full_fits": fits(f, total), "smoke_peak_bytes": s["peak_bytes"], "full_config":
                            {f"{k}.{n}": v for k, d in row_full.to_dict().items() for n, v in d.items()}})
    hi = max((r for r in out if r["full_fits"]), key=lambda r: r["smoke_peak_bytes"])
    lo = min((r for r in out if not r["full_fits"]), key=lambda r: r["smoke_peak_bytes"])
    name = lambda r: f"lab {r['lab']} '{r['row']}'"  # noqa: E731
    if hi["smoke_peak_bytes"] >= lo["smoke_peak_bytes"]:
        raise ValueError(f"no smoke budget reproduces the {CARD_GB:g} GB card: {name(hi)} fits the card and {name(lo)} "
                         f"does not, but in smoke they need {hi['smoke_peak_bytes']:,} and {lo['smoke_peak_bytes']:,} "
                         f"bytes: change the smoke sizes")
    budget = int(math.sqrt(hi["smoke_peak_bytes"] * lo["smoke_peak_bytes"]))
    for r in out:
        r["smoke_fits"] = r["smoke_peak_bytes"] <= budget
    return {"budget_bytes": budget, "rows": out, "why": f"one size for labs 01-04, halfway (log scale) between the "
            f"smoke peaks of {name(hi)} and {name(lo)}, the closest pair of their {len(out)} budgeted runs"}


def lab_budget(lab: str, device) -> dict:
    """Lab ``lab``'s ``bytes`` (GPU: what the allocator may hold on the card, less the CUDA context measured here; CPU:
    its scale model), ``card_bytes`` (torch's total on one), ``line`` (what every lab prints and records), ``rows``
    (:func:`lab_rows`) and ``scale_rows`` (:func:`course`'s rows of this lab), its table ``scale_model``."""
    (total, rule), cuda = cards.card_total_bytes(CARD_GB), torch.device(device).type == "cuda"
    amp = amp_precision(device)[0]
    tensors, sm = dev.card_allocator_bytes(CARD_GB, device) if cuda else total - cards.CUDA_CONTEXT_BYTES, \
        course(amp, amp_precision(device, emulated_ok=False)[0])
    line = (f"an {CARD_GB:g} GB card: {tensors / GiB:.2f} GiB for tensors = {total / GiB:.2f} GiB to torch "
            f"({rule.split(' reports')[0]}) - {(total - tensors) / GiB:.2f} GiB CUDA context ("
            + ("measured on this GPU)" if cuda else
               f"assumed); in smoke its scale model: {sm['budget_bytes'] / MiB:.2f} MiB, {sm['why']}"))
    rows = [{k: v for k, v in r.items() if not (cuda and k.startswith("smoke"))} for r in sm["rows"] if r["lab"] == lab]
    return {"bytes": tensors if cuda else sm["budget_bytes"], "card_bytes": total, "line": line,
            "rows": lab_rows(lab, amp), "scale_rows": rows}
