"""Lab 03's measurements: each checkpointing variant trained, under a memory budget, and checked step by step.

The variants themselves are in :mod:`labutils.checkpointing`; everything here runs them through the course's one
training loop (:func:`labutils.train`), so memory and time are measured as in every other lab.

Runs: ``measure(cfg, variants)`` (one model, one training run per variant, OOM -> a row, memory released),
``largest_batch(cfg, variant)``, ``variant_peaks`` / ``segment_peaks(cfg, ks, n_layer=)`` (a deep model), ``memory_budget(bytes)``, ``loaded(cfg)``, ``peak_during(fn)``; each run is a
:class:`Measured` (``.row(baseline)`` is its table row).
Checks of one forward + backward: ``step_grads`` / ``max_rel_diff``, ``step_flops``, ``forward_calls``;
``compare`` gathers one row per forward of the notebook's toy models; ``one_batch`` and ``captured_logs`` feed
and quiet them.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from . import device as dev
from . import env as _env
from .checkpointing import Variant
from .config import Config
from .memory import LiveStorages, oom_caught, release
from .train import RunResult, prepare, train
from .verdict_rule import timed_ratio, timed_step_times

MiB = 2**20


# -------------------------------------------------------------------------------------------------------- runs
@dataclass
class Measured:
    """One training run of one variant. Its step time is the median of its timed steps (warm-up left out), with
    the spread (half the inter-quartile range, relative) beside it: the one definition every table, figure and
    claim of lab 03 reads (:func:`overhead` is the ratio of two such medians)."""
    variant: str
    kind: str
    k: int | None
    result: RunResult
    host_bytes: int | None = None
    info: dict = field(default_factory=dict)  # what the variant counted (offload: bytes moved, weights kept)

    @classmethod
    def from_run(cls, name: str, result: RunResult, kind: str | None = None) -> "Measured":
        """Wrap a :func:`labutils.run` result (the model's API switched by the config)."""
        t = result.config.get("train", {})
        kind = kind or ("every_n" if t.get("gradient_checkpointing") else "baseline")
        return cls(name, kind, t.get("checkpoint_every_n_layers") if kind == "every_n" else None, result)

    @property
    def ok(self) -> bool:
        return self.result.status == "ok"

    @property
    def peak(self) -> int | None:
        return self.result.peak_memory_bytes if self.ok else None

    @property
    def step_time(self) -> float | None:
        if not self.ok:
            return None
        times = sorted(timed_step_times(self.result))
        if not times:
            return self.result.step_time_seconds
        n = len(times)
        return times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2

    @property
    def step_spread(self) -> float | None:
        """+- of the step time, relative (half the inter-quartile range of the timed steps over their median)."""
        times = timed_step_times(self.result) if self.ok else []
        spread = timed_ratio(times, times)["spread"] if len(times) >= 2 else None
        return None if spread is None else spread / 2    # timed_ratio adds both runs' half-IQRs: one run's is half

    @property
    def micro_batch(self) -> int:
        return self.result.config["train"]["micro_batch_size"]

    def row(self, baseline: "Measured | None" = None, **extra) -> dict:
        """A flat table row; savings and overheads relative to ``baseline`` when both ran."""
        r = self.result
        both = baseline is not None and baseline.result is not r and baseline.ok and self.ok
        return {**extra, "variant": self.variant, "k": self.k, "micro_batch": self.micro_batch,
                "seq": r.config["data"]["seq_length"], "precision": r.config["train"]["precision"],
                "status": r.status.upper() if r.status != "ok" else "ok",
                "peak_mib": self.peak / MiB if self.peak is not None else None,
                "step_s": self.step_time,
                "step_spread_pct": 100 * self.step_spread if self.step_spread is not None else None,
                "target_tokens_per_s": r.target_tokens_per_second if self.ok else None,
                "memory_saving_pct": 100 * (1 - self.peak / baseline.peak) if both else None,
                "time_overhead_pct": 100 * overhead(baseline, self) if both else None,
                "host_mib": self.host_bytes / MiB if self.host_bytes is not None else None,
                "error": r.error}


def saving(base: Measured, other: Measured) -> float | None:
    """``other``'s peak-memory saving against ``base`` (a fraction), or None unless both ran."""
    return 1 - other.peak / base.peak if base.ok and other.ok else None


def overhead(base: Measured, other: Measured) -> float | None:
    """``other``'s step-time overhead against ``base``: the ratio of their median timed steps minus 1 (the same
    number :func:`labutils.claims.run_pair_evidence` gives a claim), or None unless both ran."""
    return other.step_time / base.step_time - 1 if base.ok and other.ok else None


@contextlib.contextmanager
def memory_budget(budget_bytes: int | None, device: torch.device | str | None = None):
    """Inside the block PyTorch's allocator may hold at most ``budget_bytes`` (``lu.card_allocator_bytes(8)``
    gives the number for an 8-GiB card: 8 GiB minus the CUDA context's share).

    CUDA: :func:`labutils.device.memory_cap` (never above a cap already set, e.g. by ``LAB_GPU_MEMORY_GB``),
    restored afterwards; yields None. CPU: there is nothing to cap, so it yields the
    budget to pass on as ``cpu_budget_bytes`` (the memory tracker then raises ``torch.OutOfMemoryError``).
    """
    release()
    try:
        with dev.memory_cap(budget_bytes, device) as cpu_budget:
            yield cpu_budget
    finally:
        release()


def _train_variant(cfg: Config, model, dataset, device, variant: Variant, env: dict, *, cpu_budget, progress,
                   desc=None) -> Measured:
    """One run of one variant on an already loaded model; the variant is switched off and memory released after,
    even on error. An out-of-memory error becomes a Measured with status "oom"."""
    variant.info.clear()
    undo, oom, result = None, None, None
    dev.reset_peak(device)
    try:
        with oom_caught() as caught:
            undo = variant.apply(model)
            result = train(cfg, model, dataset, device, env=dict(env), progress=progress,
                           desc=desc or variant.name, cpu_budget_bytes=cpu_budget)
        oom = caught.error
    finally:
        if undo is not None:
            undo()
        model.zero_grad(set_to_none=True)
        release()
    if oom is not None:
        result = RunResult(config=cfg.to_dict(), env=dict(env), status="oom", error=oom,
                           effective_batch_size=cfg.effective_batch_size,
                           peak_memory_bytes=dev.peak_allocated(device))
    return Measured(variant.name, variant.kind, variant.k, result, variant.info.get("host_bytes"), dict(variant.info))


@dataclass
class Session:
    """A loaded model and its dataset; emptied when :func:`loaded`'s block ends."""
    model: nn.Module | None
    dataset: object
    weights: str


@contextlib.contextmanager
def loaded(cfg: Config, device: torch.device | str | None = None):
    """``with loaded(cfg) as s:`` ``s.model``, ``s.dataset``: the config's model and data, released when the block
    ends, even on error (keep no other reference to ``s.model`` after the block)."""
    device = torch.device(device or _env.default_device())
    _env.seed_everything(cfg.train.seed)
    session = None
    try:
        bundle, dataset = prepare(cfg, device, verbose=False)
        session = Session(bundle.model, dataset, bundle.weights)
        del bundle
        yield session
    finally:
        if session is not None:
            session.model = session.dataset = None
        release()


def measure(cfg: Config, variants, device: torch.device | str | None = None, *, budget_bytes: int | None = None,
            progress: bool = True) -> list[Measured]:
    """Train ``cfg`` once per variant on one loaded model; returns one :class:`Measured` per variant.

    ``budget_bytes``: run as if the accelerator had only this much memory (see :func:`memory_budget`).
    Memory is the tracker's peak of live tensors (CUDA allocator / CPU storages), the same as ``labutils.run``.
    """
    device = torch.device(device or _env.default_device())
    if cfg.train.gradient_checkpointing:
        cfg = cfg.override({"train.gradient_checkpointing": False})  # the variants decide
    out = []
    with memory_budget(budget_bytes, device) as cpu_budget, loaded(cfg, device) as s:
        env = _env.environment(device, cfg.mode, s.weights)
        for v in variants:
            out.append(_train_variant(cfg, s.model, s.dataset, device, v, env, cpu_budget=cpu_budget,
                                      progress=progress))
    return out


def largest_batch(cfg: Config, variant: Variant, device: torch.device | str | None = None, *,
                  budget_bytes: int | None = None, start: int = 1, max_batch: int = 64, steps: int = 2,
                  progress: bool = False) -> tuple[int, list[Measured]]:
    """The largest micro-batch (<= ``max_batch``) that trains without running out of memory.

    Tries ``start``; doubles while runs fit (halves while they fail), then bisects between the last batch that fit
    and the first that did not. ``steps=2``: the second step already holds the optimizer state, so its peak is
    the steady-state peak. Returns (largest batch that fits, or 0 if not even 1 does; every probe, by batch).
    """
    device = torch.device(device or _env.default_device())
    base = cfg.override({"train.steps": steps, "train.gradient_checkpointing": False,
                         "train.timing_warmup_steps": min(cfg.train.timing_warmup_steps, steps - 1)})
    probes: dict[int, Measured] = {}
    with memory_budget(budget_bytes, device) as cpu_budget, loaded(base, device) as s:
        env = _env.environment(device, cfg.mode, s.weights)

        def fits(b: int) -> bool:
            if b not in probes:
                c = base.override({"train.micro_batch_size": b})
                probes[b] = _train_variant(c, s.model, s.dataset, device, variant, env, cpu_budget=cpu_budget,
                                           progress=progress, desc=f"{variant.name}, batch {b}")
            return probes[b].ok

        b = max(1, min(start, max_batch))
        if fits(b):
            good, bad = b, None
            while bad is None and good < max_batch:
                b = min(2 * good, max_batch)
                good, bad = (b, None) if fits(b) else (good, b)
        else:
            good, bad = 0, b
            while good == 0 and bad > 1:
                b = bad // 2
                good, bad = (b, bad) if fits(b) else (0, b)
        while bad is not None and bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, [probes[b] for b in sorted(probes)]


def variant_peaks(cfg: Config, variants: dict, device: torch.device | str | None = None, *, n_layer: int,
                  n_embd: int | None = None) -> dict:
    """Peak memory of one forward + backward of a GPT-2 like ``cfg``'s, but ``n_layer`` blocks deep (and
    ``n_embd`` wide, default the config's), under each variant of ``variants`` ({key: Variant}): {key: peak bytes
    above the start}. For what needs depth (the k-sweep of section 4, claim C5, which cannot fail on a shallow
    model): smoke mode's ``tiny`` has 2 blocks, so the sweep is repeated on a deep, narrow model of the same
    architecture (random weights, the config's dropout, one micro-batch of the config's data)."""
    from transformers import GPT2LMHeadModel

    from .models import gpt2_config

    device = torch.device(device or _env.default_device())
    gcfg = gpt2_config(cfg.model.name, cfg.model.dropout, cfg.model.attn_implementation)
    gcfg.n_layer = n_layer
    if n_embd is not None:
        gcfg.n_embd = n_embd
    with loaded(cfg, device) as s:
        batch = one_batch(s.dataset, cfg.train.micro_batch_size, cfg.train.seed, device)
    _env.seed_everything(cfg.train.seed)
    model = GPT2LMHeadModel(gcfg).to(device).train()
    model.loss_type = "ForCausalLM"  # as labutils.models does: the class name maps to no loss type (a warning)
    peaks = {}
    try:
        for key, variant in variants.items():
            undo = variant.apply(model)
            try:
                peaks[key] = peak_during(lambda: _forward_backward(model, batch), device)
            finally:
                undo()
                model.zero_grad(set_to_none=True)
    finally:
        del model
        release()
    return peaks


def segment_peaks(cfg: Config, ks, device: torch.device | str | None = None, *, n_layer: int,
                  n_embd: int | None = None) -> dict[int, int]:
    """:func:`variant_peaks` with segments of k blocks (:func:`labutils.checkpointing.segments`) for each k in
    ``ks``: {k: peak bytes above the start}."""
    from .checkpointing import segments

    return variant_peaks(cfg, {k: segments(k) for k in ks}, device, n_layer=n_layer, n_embd=n_embd)


def peak_during(fn: Callable[[], object], device: torch.device | str | None = None) -> int:
    """Peak bytes of the tensors ``fn()`` allocates, above what was live when it started.

    CUDA: the allocator's peak. CPU: the storages created inside, counted like :class:`labutils.MemoryTracker`
    does, but without its walk over every live object (which costs ~0.5 s in a notebook kernel), so it suits
    many small measurements.
    """
    device = dev.resolve(device)
    if device.type == "cuda":
        dev.synchronize(device)
        start = dev.allocated(device)
        dev.reset_peak(device)
        fn()
        dev.synchronize(device)
        return dev.peak_allocated(device) - start
    with LiveStorages() as live:  # the CPU counter of MemoryTracker, minus the count of existing tensors
        fn()
    return live.peak


# ------------------------------------------------------------------------------------------------------ checking
def compare(step: Callable, forwards) -> tuple[list[dict], dict]:
    """Measure each forward once: ``step(forward)`` runs one forward + backward and returns (row, gradients).

    ``forwards``: ``(name, forward)`` or ``(name, forward, ok, why)``; one whose ``ok`` is false is skipped, with
    ``why`` printed. Returns the table rows (``{"forward": name, **row}``) and the gradients by name."""
    rows, grads = [], {}
    for name, forward, *available in forwards:
        ok, why = available or (True, "")
        if not ok:
            print(f"skipped '{name}': {why}")
            continue
        row, grads[name] = step(forward)
        rows.append({"forward": name, **row})
    return rows, grads


def one_batch(dataset, micro_batch_size: int, seed: int, device) -> dict:
    """The first micro-batch the training loop would see, on ``device``."""
    window = next(dataset.windows(micro_batch_size, 1, seed))
    return {k: v.to(device) for k, v in window.micro_batches[0].items()}


def _forward_backward(model, batch) -> None:
    model(**batch, use_cache=False).loss.backward()


def step_grads(model, batch: dict, variant: Variant | None = None) -> list[torch.Tensor]:
    """Gradients of one forward + backward with ``variant`` on (copies in host memory, one per parameter)."""
    params = list(model.parameters())  # before apply: segments() re-parents blocks, not parameters
    model.train()
    model.zero_grad(set_to_none=True)
    undo = variant.apply(model) if variant else None
    try:
        _forward_backward(model, batch)
        grads = [p.grad.detach().to("cpu", copy=True) if p.grad is not None else None for p in params]
    finally:
        if undo:
            undo()
        model.zero_grad(set_to_none=True)
    return grads


def max_rel_diff(grads, reference) -> float:
    """Largest ||g - g_ref|| / ||g_ref|| over parameters (inf if one side has no gradient where the other has)."""
    worst = 0.0
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None:
            if (g is None) != (r is None):
                return math.inf
            continue
        worst = max(worst, float((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)))
    return worst


def step_flops(model, batch: dict, variant: Variant | None = None) -> int:
    """FLOPs of matmuls and attention in one forward + backward (``torch.utils.flop_counter``): recompute shows up."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    model.zero_grad(set_to_none=True)
    undo = variant.apply(model) if variant else None
    try:
        with FlopCounterMode(display=False) as counter:
            _forward_backward(model, batch)
    finally:
        if undo:
            undo()
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def forward_calls(model, batch: dict, variant: Variant | None = None) -> int:
    """How many times the blocks' MLPs run in one forward + backward: L without recompute, more with it.

    The hook sits on ``block.mlp``, a module *inside* the checkpointed region: transformers checkpoints a block's
    ``forward`` (not ``__call__``), so hooks on the block itself would not see the recompute.
    """
    calls = [0]
    mlps = [block.mlp for block in model.transformer.h]
    handles = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in mlps]
    model.train()
    model.zero_grad(set_to_none=True)
    undo = variant.apply(model) if variant else None
    try:
        _forward_backward(model, batch)
    finally:
        if undo:
            undo()
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return calls[0]


class _ListHandler(logging.Handler):
    def __init__(self, records: list):
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record):
        self.records.append(record.getMessage())


@contextlib.contextmanager
def captured_logs(name: str = "transformers"):
    """Collect a library's log messages in a list instead of printing them (restored afterwards)."""
    logger = logging.getLogger(name)
    records: list[str] = []
    saved = logger.handlers[:]
    logger.handlers = [_ListHandler(records)]
    try:
        yield records
    finally:
        logger.handlers = saved
