""""An 8 GB card", the same in every lab: torch's total on one (:mod:`labutils.core.cards`) minus what lives outside its
allocator (on a GPU measured there, as the labs' caps take it; for a prediction the estimator's CUDA context, as
:func:`labutils.estimator.estimate.fits` takes it), and in smoke ONE scale model of it for the whole course
(:func:`course`): every run any lab measures under the budget (its registry entry's ``budget``) is predicted in full
mode to fit the card or not, and the smoke budget lies halfway (log scale) between the largest smoke peak of a run that
fits and the smallest of one that does not; where no size can, :func:`course` raises naming the two (change a config's
``smoke:`` section, not the rule). Every lab takes its budget, and the line it prints, from :func:`lab_budget`."""
from __future__ import annotations

import functools
import math

import torch

from ..core import cards
from ..core import device as dev
from ..core.config import load_config
from ..estimator.estimate import estimate_memory, fits
from ..core.precisions import amp_precision
from .registry import LABS, lab as registry_lab

CARD_GB, MiB, GiB = 8.0, 2**20, 2**30


def _groups(amp: str, amp_fast: str):
    """(row name prefix, config, rows, smoke overrides) of every lab's runs under the budget (its registry entry)."""
    for entry in LABS:
        for group, (config, rows, smoke) in (entry.budget(amp, amp_fast) if entry.budget else {}).items():
            yield " ".join(filter(None, (entry.id, group))), config, rows, smoke


@functools.lru_cache(maxsize=4)
def course(amp: str, amp_fast: str) -> dict:
    """The card's one scale model for ``amp`` and ``amp_fast`` (:func:`labutils.core.precisions.amp_precision`'s):
    budget_bytes, why, rows (each: lab, row, overrides, full_peak_bytes, full_fits, smoke_peak_bytes, ...)."""
    total, out = cards.card_total_bytes(CARD_GB)[0], []
    for lab, name, rows, smoke_ov in _groups(amp, amp_fast):
        full, smoke = load_config(name, mode="full"), load_config(name, mode="smoke").override(smoke_ov)
        for label, ov in rows.items():
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
    return {"budget_bytes": budget, "rows": out, "why": f"for every lab, between the smoke peaks of {name(hi)} (fits "
            f"the card) and {name(lo)} (does not)"}


def lab_budget(lab: str, device) -> dict:
    """Lab ``lab``'s ``bytes`` (GPU: what the allocator may hold on the card, less the CUDA context measured here; CPU:
    its scale model), ``card_bytes`` (torch's total on one), ``line`` (what every lab prints and records), ``rows``
    (its budgeted runs: labutils.labs.registry) and ``scale_rows`` (:func:`course`'s rows of this lab), its table ``scale_model``."""
    (total, rule), cuda = cards.card_total_bytes(CARD_GB), torch.device(device).type == "cuda"
    amp, amp_fast = amp_precision(device)[0], amp_precision(device, emulated_ok=False)[0]
    tensors, sm = dev.card_allocator_bytes(CARD_GB, device) if cuda else total - cards.CUDA_CONTEXT_BYTES, \
        course(amp, amp_fast)
    line = (f"an {CARD_GB:g} GB card: {tensors / GiB:.2f} GiB for tensors ({total / GiB:.2f} GiB to torch, "
            f"{rule.split(' reports')[0]}, less {(total - tensors) / GiB:.2f} GiB CUDA context, "
            + ("measured on this GPU)" if cuda else
               f"assumed); in smoke its scale model: {sm['budget_bytes'] / MiB:.2f} MiB, {sm['why']}"))
    rows = [{k: v for k, v in r.items() if not (cuda and k.startswith("smoke"))} for r in sm["rows"] if r["lab"] == lab]
    return {"bytes": tensors if cuda else sm["budget_bytes"], "card_bytes": total, "line": line,
            "rows": registry_lab(lab).budget(amp, amp_fast)[""][1], "scale_rows": rows}
