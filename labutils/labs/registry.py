"""The one list of labs, :data:`LABS`: the tests, ``regenerate`` (the repository's notebooks are exactly these), the
results page and the time plan iterate over it. A fifth lab: its notebook, its entry here, its config, its claims.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.config import load_config
from ..models.gpt2 import PRESETS
from ..core.peaks import peak_tflops
from ..core.precisions import NAMES, choose, get
from .scale_model import course, lab_rows

LAB01_ALWAYS = ("fp32", "fp16")  # lab 01 runs these even where emulated: the baseline, the GradScaler's format


def native_where(device: str, gpu_name: str | None):
    """``native(precision) -> (bool, why)`` where a plan runs: this CPU (labutils.core.device_facts, as the labs ask it),
    or a card by name (a format it has a peak for in labutils.core.peaks: a T4 has no BF16)."""
    if device == "cuda":
        return lambda p: (peak_tflops(gpu_name, p) is not None, f"{gpu_name}'s datasheet (labutils.core.peaks)")
    return lambda p: get(p).native(device)


def lab_precision(device: str, gpu_name: str | None = None, emulated_ok: bool = True) -> str:
    """The mixed precision a lab's cells choose where the plan runs: ``lu.amp_precision(device, emulated_ok)``'s
    rule (labutils.core.precisions.choose) with that device's answers."""
    return choose(native_where(device, gpu_name), device == "cuda", emulated_ok)[0]


def _lab01(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 01: the two-step check of amp_step against lu.train, the precisions (the others where native), the
    batch sweep's points other than the config's own micro-batch, and fp16 again with the injected overflow."""
    cfgs = {p: load_config(f"configs/{p}_config.yaml", mode=mode) for p in ("fp32", "fp16", "bf16")}
    if mode == "smoke":
        cfgs = {p: c.override({"train.steps": 24, "train.timing_warmup_steps": 4}) for p, c in cfgs.items()}
    amp, native_here = lab_precision(device, gpu_name), native_where(device, gpu_name)  # lab 01's AMP and NATIVE
    cfgs.update({p: cfgs["fp32"].override({"train.precision": p}) for p in NAMES if p not in cfgs})
    runs = [("amp_step check", cfgs["fp16"].override({"train.steps": min(2, cfgs["fp16"].train.steps)}))]
    runs += [(p, cfgs[p]) for p in NAMES if p in LAB01_ALWAYS or native_here(p)[0]]
    runs += [(label, c.override({**o, "train.steps": 12, "train.timing_warmup_steps": min(c.train.timing_warmup_steps,
                                                                                          11)}))  # the batch sweep
             for label, o in lab_rows("01", amp).items()
             if o["train.micro_batch_size"] != (c := cfgs[o["train.precision"]]).train.micro_batch_size]
    return runs + [("fp16 + injected overflow", cfgs["fp16"])]


def _lab02(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 02: the two train_step checks, the micro-batch 2 sweep, the split of B = 32, the learning-rate runs."""
    cfg = load_config("configs/lab02_accumulation.yaml", mode=mode)
    amp = lab_precision(device, gpu_name, emulated_ok=False)  # a CPU without BF16 trains in fp32 (emulation is slow)
    cfg = cfg.override({"train.precision": amp})
    check = {"train.micro_batch_size": 2, "train.accumulation_steps": 4, "model.dropout": 0.0,
             "train.steps": min(cfg.train.steps, 2)}
    runs = [(f"train_step check {p}", cfg.override({**check, "train.precision": p}))
            for p in dict.fromkeys([amp, "fp16"])]
    runs += [(label, cfg.override(o)) for label, o in lab_rows("02", amp).items() if label[0].isdigit()]  # 4 and 6
    ratio, w0, s0 = 4, cfg.train.warmup_steps, cfg.train.steps
    w1 = max(2, round(w0 / ratio))
    s1 = max(w1, s0 // ratio)
    m_big = max(r["overrides"]["train.micro_batch_size"] for r in course("bf16", "bf16")["rows"]  # on an 8 GB card
                if r["lab"] == "02" and r["full_fits"] and r["row"] in {f"{m} x {32 // m}" for m in (2, 4, 8, 16, 32)})
    def lr(B, steps, warmup):
        m = min(m_big, B)
        return cfg.override({"train.micro_batch_size": m, "train.accumulation_steps": B // m, "train.steps": steps,
                             "train.warmup_steps": warmup})
    runs += [("lr baseline", lr(8, s1 * ratio, w1 * ratio))] + [(f"lr B=32 #{i}", lr(32, s1, w1 if i < 3 else 0))
                                                               for i in range(4)]
    return runs


def _lab03(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 03: the on/off pairs, the scale model's rows, the largest-batch scans (as far as the estimator says they
    go on an 8 GB card), every k, the variants beyond, the combinations."""
    from ..core.cards import card_total_bytes
    from ..estimator.estimate import largest_batch

    cfg = load_config("configs/lab03_checkpointing.yaml", mode=mode)
    B, L = cfg.train.micro_batch_size, PRESETS[cfg.model.name].n_layer
    pair_steps = max(cfg.train.steps, cfg.train.timing_warmup_steps + 10) if device == "cuda" else cfg.train.steps
    ck = {"train.gradient_checkpointing": True}
    runs = [(f"pair {b} {on}", cfg.override({"train.micro_batch_size": b, "train.steps": pair_steps,
                                              **(ck if on else {})}))
            for b in sorted({1, B}) for on in (False, True)]
    runs += [(f"scale model {i}", cfg.override(o)) for i, o in enumerate(lab_rows("03", "bf16").values())]
    card = card_total_bytes(8)[0]
    probe = cfg.override({"train.steps": 2, "train.timing_warmup_steps": min(cfg.train.timing_warmup_steps, 1)})
    for on in (False, True):
        last = min(4 * B, largest_batch(load_config("configs/lab03_checkpointing.yaml", mode="full"), card,
                                        checkpointing=on) + 1)
        runs += [(f"largest {on} {b}", probe.override({"train.micro_batch_size": b, **(ck if on else {})}), b == 1)
                 for b in range(1, last + 1)]  # one model per scan
    ks = [k for k in range(2, L + 1) if L % k == 0]
    runs += [(f"every/segments {k}", cfg.override(ck), i == 0) for i, k in enumerate(ks + ks)]  # one model (cm.measure)
    runs += [(f"beyond {i}", cfg.override(ck), i == 0) for i in range(3)]
    half = max(1, B // 2)
    mixed = lab_precision(device, gpu_name)  # lab 03's MIXED
    runs += [(name, cfg.override(o)) for name, o in (
        ("mixed", {"train.precision": mixed}), ("mixed + ckpt", {"train.precision": mixed, **ck}),
        ("accumulation", {"train.micro_batch_size": 1, "train.accumulation_steps": B}),
        ("all", {"train.precision": mixed, **ck, "train.micro_batch_size": half,
                 "train.accumulation_steps": B // half}))]
    return runs


def _lab04(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 04: the batch sweep, the techniques of section 8, the full and chunked loss, one_loop against lu.train."""
    cfg = load_config("configs/lab04_profile.yaml", mode=mode)
    tech = load_config("configs/lab04_techniques.yaml", mode=mode)
    amp = lab_precision(device, gpu_name)  # lab 04's AMP
    rows = lab_rows("04", amp)
    mp, ck, acc = rows[amp], rows["checkpointing"], rows["accumulation x2"]
    runs = [(f"sweep {label}", cfg.override({**o, "train.steps": 2, "train.timing_warmup_steps": 1}))
            for label, o in lab_rows("04 section 5", amp).items()]
    runs += [(name, tech.override(o)) for name, o in rows.items()]
    runs += [(f"loss {loss}", tech.override({**mp, **ck, "model.loss": loss})) for loss in ("full", "chunked")]
    return runs + [("lu.train vs one_loop", tech.override({**mp, **ck, **acc, "train.steps": 3}))]


@dataclass(frozen=True)
class Lab:
    id: str                           # "01"
    stem: str                         # its notebook's name: "01-Mixed_Precision"
    title: str
    configs: tuple[str, ...]          # the configs it reads
    runs: Callable[..., list]         # (mode, device, gpu_name=None) -> [(label, config[, loads a model])]: what
                                      # its cells train, where they run (a card by name: the time plan)
    claims: tuple[str, ...] = ()      # the claims it owns (labutils.verdicts.claims): it measures and records them


LABS = (
    Lab("01", "01-Mixed_Precision", "Mixed precision",
        tuple(f"configs/{p}_config.yaml" for p in ("fp32", "fp16", "bf16")), _lab01, ("C1", "C2")),
    Lab("02", "02-Gradient_Accumulation", "Gradient accumulation", ("configs/lab02_accumulation.yaml",), _lab02,
        ("C3",)),
    Lab("03", "03-Gradient_Checkpointing", "Gradient checkpointing", ("configs/lab03_checkpointing.yaml",), _lab03,
        ("C4", "C5")),
    Lab("04", "04-Memory_Profiling", "Memory profiling",
        ("configs/lab04_profile.yaml", "configs/lab04_techniques.yaml"), _lab04, ("C6", "C7")),
)
IDS = tuple(lab.id for lab in LABS)


def lab(key: str) -> Lab:
    """The lab of an id ("03") or a notebook stem ("03-Gradient_Checkpointing"); KeyError for another."""
    return {k: entry for entry in LABS for k in (entry.id, entry.stem)}[key]


def mismatch(stems) -> str | None:
    """Why the notebooks found (their stems) are not the registry's labs, naming both sides; None when they are."""
    found, known = set(stems), {entry.stem for entry in LABS}
    return "; ".join([f"notebook {s}.ipynb is not in the registry (labutils/labs/registry.py)" for s in sorted(found - known)]
                     + [f"lab {s} of the registry (labutils/labs/registry.py) has no notebook {s}.ipynb"
                        for s in sorted(known - found)]) or None
