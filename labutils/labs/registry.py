"""The one list of labs, :data:`LABS`: the tests, ``regenerate`` (the repository's notebooks are exactly these), the
results page and the time plan iterate over it. A fifth lab: its notebook, its entry here, its config, its claims. """
from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.cards import card_total_bytes
from ..core.config import load_config
from ..estimator.estimate import estimate_memory, fits
from ..models.gpt2 import PRESETS
from ..core.peaks import peak_tflops
from ..core.precisions import NAMES, choose, get

LAB01_ALWAYS = ("fp32", "fp16")  # lab 01 runs these even where emulated: the baseline, the GradScaler's format
# lab 02's sweeps: section 2's direct E x 1 and accumulated 2 x E/2; section 4's MICRO x k; section 6's m x TARGET/m
LAB02 = {"micro": 2, "accum_steps": (1, 4, 8, 16), "proof_batches": (32, 16, 8, 4)}
LAB04_SWEEP = (1, 2, 4, 8, 16)  # lab 04 section 5's batch-size sweep


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


def _budget01(amp: str, amp_fast: str) -> dict:
    """The batch sweep: FP32 and AMP at 1, B and 2B (the rows each lab runs under the card's budget: {group:
    (config, {label: overrides}, smoke overrides)}; the same overrides in full mode and in smoke)."""
    b = load_config("configs/fp32_config.yaml", mode="full").train.micro_batch_size
    return {"": ("configs/fp32_config.yaml", {f"{p} x {m}": {"train.precision": p, "train.micro_batch_size": m}
                                              for p in ("fp32", amp) for m in (1, b, 2 * b)}, {})}


def _budget02(amp: str, amp_fast: str) -> dict:
    micro, exact, proof = LAB02["micro"], {"train.precision": "fp32", "model.dropout": 0.0}, LAB02["proof_batches"]
    target = micro * max(LAB02["accum_steps"])
    splits = [(f"direct {e} x 1", e, 1, exact) for e in proof] + [(f"accumulated 2 x {e // 2}", 2, e // 2, exact)
                                                                  for e in proof]
    splits += [(f"{micro} x {k}", micro, k, {}) for k in LAB02["accum_steps"]]
    splits += [(f"{2 ** i} x {target // 2 ** i}", 2 ** i, target // 2 ** i, {})
               for i in range(1, int(math.log2(target)) + 1)]
    return {"": ("configs/lab02_accumulation.yaml", {label: {"train.micro_batch_size": m, "train.accumulation_steps": k,
                                                             **extra} for label, m, k, extra in splits},
                 {"train.precision": amp_fast})}


def _budget03(amp: str, amp_fast: str) -> dict:
    """At the config's micro-batch it fits the card only with checkpointing."""
    b = load_config("configs/lab03_checkpointing.yaml", mode="full").train.micro_batch_size
    return {"": ("configs/lab03_checkpointing.yaml", {
        "no checkpointing, micro-batch 1": {"train.micro_batch_size": 1},
        f"no checkpointing, micro-batch {b}": {"train.micro_batch_size": b},
        f"checkpointing, micro-batch {b}": {"train.micro_batch_size": b, "train.gradient_checkpointing": True}}, {})}


def _budget04(amp: str, amp_fast: str) -> dict:
    """Section 8, all at the config's effective batch (accumulation 2 x 2: the yaml says why); section 5's sweep."""
    b = load_config("configs/lab04_techniques.yaml", mode="full").train.micro_batch_size
    acc, mp = {"train.micro_batch_size": b // 2, "train.accumulation_steps": 2}, {"train.precision": amp}
    ck = {"train.gradient_checkpointing": True}
    return {"": ("configs/lab04_techniques.yaml", {
        "baseline (fp32)": {}, amp: mp, "checkpointing": ck, "accumulation x2": acc,
        f"{amp} + checkpointing": {**mp, **ck}, "all together": {**mp, **ck, **acc}}, {}),
        "section 5": ("configs/lab04_profile.yaml",
                      {f"micro-batch {m}": {"train.micro_batch_size": m} for m in LAB04_SWEEP}, {})}


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
             for label, o in _budget01(amp, amp)[""][1].items()
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
    rows = _budget02(amp, amp)[""][1]
    runs += [(label, cfg.override(o)) for label, o in rows.items() if label[0].isdigit()]  # sections 4 and 6
    ratio, w0, s0 = 4, cfg.train.warmup_steps, cfg.train.steps
    w1 = max(2, round(w0 / ratio))
    s1 = max(w1 + 2, s0 // ratio)  # the notebook's rule: B=32's warm-up, then at least 2 steps at the full rate
    full, card = load_config("configs/lab02_accumulation.yaml", mode="full"), card_total_bytes(8)[0]
    m_big = max(o["train.micro_batch_size"] for label, o in rows.items() if label[0].isdigit() and  # fits 8 GB
                o["train.accumulation_steps"] * o["train.micro_batch_size"] == 32 and
                fits(estimate_memory(full.override({**o, "train.precision": "bf16"})), card))
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
    runs += [(f"scale model {i}", cfg.override(o)) for i, o in enumerate(_budget03(None, None)[""][1].values())]
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
    budget = _budget04(amp, amp)
    rows = budget[""][1]
    mp, ck, acc = rows[amp], rows["checkpointing"], rows["accumulation x2"]
    runs = [(f"sweep {label}", cfg.override({**o, "train.steps": 2, "train.timing_warmup_steps": 1}))
            for label, o in budget["section 5"][1].items()]
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
    budget: Callable[..., dict] | None = None  # (amp, amp_fast) -> its runs under the card's budget (labs.scale_model)
    extras: tuple = ()  # besides its runs, for the time plan: models built and not trained by lu.train, profiler runs,
    #                     child processes that import torch (labutils.tools.timeplan.EXTRA_S)


LABS = (
    Lab("01", "01-Mixed_Precision", "Mixed precision",
        tuple(f"configs/{p}_config.yaml" for p in ("fp32", "fp16", "bf16")), _lab01, ("C1", "C2"), _budget01,
        (("models", 4), ("profiles", 2))),
    Lab("02", "02-Gradient_Accumulation", "Gradient accumulation", ("configs/lab02_accumulation.yaml",), _lab02,
        ("C3",), _budget02, (("models", 4),)),
    Lab("03", "03-Gradient_Checkpointing", "Gradient checkpointing", ("configs/lab03_checkpointing.yaml",), _lab03,
        ("C4", "C5"), _budget03, (("models", 4),)),
    Lab("04", "04-Memory_Profiling", "Memory profiling",
        ("configs/lab04_profile.yaml", "configs/lab04_techniques.yaml"), _lab04, ("C6", "C7"), _budget04,
        (("models", 8), ("profiles", 7), ("processes", 3))),
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


def cell_definitions(key: str, names) -> dict:
    """The top-level ``def``, ``class`` and ``NAME = ...`` statements named ``names`` in lab ``key``'s code cells, run
    (after the notebook's imports) in one namespace, returned: the tests and the doctor run the code a student reads."""
    path = Path(__file__).resolve().parents[2] / f"{lab(key).stem}.ipynb"
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    body = []
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        try:
            body += ast.parse("".join(cell["source"])).body
        except SyntaxError as exc:  # a cell magic (%%time) or a half-edited cell: not Python this can run
            raise SyntaxError(f"{path.name}, code cell {i + 1}: {exc.msg} (line {exc.lineno})") from None
    named = [n for n in body if getattr(n, "name", None) in names
             or isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets)]
    found = [getattr(n, "name", None) or n.targets[0].id for n in named]
    if bad := sorted(n for n in set(names) if found.count(n) != 1):
        raise LookupError(f"{path.name}: {bad} not defined exactly once in its code cells")
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    namespace = {"__name__": f"{path.stem}.ipynb"}
    exec(compile(ast.Module(imports + named, []), str(path), "exec"), namespace)  # noqa: S102 - the repository's code
    return namespace
