"""Lab 03's measurements: the checkpointing variants trained through the course's one loop (:func:`labutils.core.train`)
under a memory budget, each run a :class:`Measured`; and checks of one forward + backward (grads, FLOPs, calls)."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable

import torch

from ...core import device as dev
from ...core import env as _env
from .checkpointing import Variant
from ...core.config import Config
from ...core.memory import LiveStorages, oom_caught, release
from ...models.spec import spec_of
from ...core.train import RunResult, prepare, train
from ...verdicts.verdict_rule import median_spread, timed_step_times

MiB = 2**20
RECOMPUTE = ("extra_flops_pct", "recomputed_blocks")  # what a variant recomputes, counted (:func:`measure`)


# -------------------------------------------------------------------------------------------------------- runs
@dataclass
class Measured:
    """One training run of one variant. Its step time is the median of its timed steps, the spread beside it: the
    one definition every table, figure and claim of lab 03 reads (:func:`overhead`: the ratio of two medians)."""
    variant: str
    kind: str
    k: int | None
    result: RunResult
    host_bytes: int | None = None
    info: dict = field(default_factory=dict)  # what the variant counted (offload: bytes moved, weights kept)
    defined_in: str | None = None  # where the variant's code is: "notebook" (a cell), or labutils' module

    @property
    def ok(self) -> bool:
        return self.result.status == "ok"

    @property
    def peak(self) -> int | None:
        return self.result.peak_memory_bytes if self.ok else None

    @property
    def step_time(self) -> float | None:
        times = timed_step_times(self.result) if self.ok else []
        return median_spread(times)[0] if times else self.result.step_time_seconds if self.ok else None

    @property
    def step_spread(self) -> float | None:
        """+- of the step time, relative (half the inter-quartile range of the timed steps over their median)."""
        return median_spread(timed_step_times(self.result) if self.ok else [])[1]

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
                "peak_mib": self.peak / MiB if self.peak is not None else None, "step_s": self.step_time,
                "step_spread_pct": 100 * self.step_spread if self.step_spread is not None else None,
                "target_tokens_per_s": r.target_tokens_per_second if self.ok else None,
                "memory_saving_pct": 100 * (1 - self.peak / baseline.peak) if both else None,
                "time_overhead_pct": 100 * overhead(baseline, self) if both else None,
                "host_mib": self.host_bytes / MiB if self.host_bytes is not None else None, "error": r.error,
                "defined_in": self.defined_in,
                **{k: self.info.get(k) for k in RECOMPUTE}}


def saving(base: Measured, other: Measured) -> float | None:
    """``other``'s peak-memory saving against ``base`` (a fraction), or None unless both ran."""
    return 1 - other.peak / base.peak if base.ok and other.ok else None


def overhead(base: Measured, other: Measured) -> float | None:
    """``other``'s step-time overhead over ``base`` (ratio of medians - 1, as claims take it), None unless both ran."""
    return other.step_time / base.step_time - 1 if base.ok and other.ok else None


@contextlib.contextmanager
def memory_budget(budget_bytes: int | None, device: torch.device | str | None = None):
    """At most ``budget_bytes`` inside (:func:`labutils.core.device.memory_cap`); yields a CPU's budget, or None."""
    release()
    try:
        with dev.memory_cap(budget_bytes, device) as cpu_budget:
            yield cpu_budget
    finally:
        release()


def _train_variant(cfg: Config, model, dataset, device, variant: Variant, env: dict, *, cpu_budget, progress,
                   desc=None) -> Measured:
    """One run of one variant on a loaded model, switched off and memory released after; OOM -> status "oom"."""
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
    return Measured(variant.name, variant.kind, variant.k, result, variant.info.get("host_bytes"), dict(variant.info),
                    variant.defined_in)


@contextlib.contextmanager
def loaded(cfg: Config, device: torch.device | str | None = None):
    """``with loaded(cfg) as s:`` ``s.model``, ``s.dataset``: the config's model and data, released when the block
    ends, even on error (keep no other reference to ``s.model`` after the block)."""
    device = torch.device(device or _env.default_device())
    _env.seed_everything(cfg.train.seed)
    session = None
    try:
        bundle, dataset = prepare(cfg, device, verbose=False)
        session = SimpleNamespace(model=bundle.model, dataset=dataset, weights=bundle.weights)
        del bundle
        yield session
    finally:
        if session is not None:
            session.model = session.dataset = None
        release()


def measure(cfg: Config, variants, device: torch.device | str | None = None, *, budget_bytes: int | None = None,
            progress: bool = True) -> list[Measured]:
    """Train ``cfg`` once per variant on one loaded model (within ``budget_bytes``: :func:`memory_budget`), peaks as in
    ``labutils.run``; first, apart, what each recomputes on one sequence as trained: ``info["extra_flops_pct"]`` (over
    a plain step's :func:`step_flops`), ``info["recomputed_blocks"]`` (:func:`forward_calls` beyond a plain step's)."""
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.gradient_checkpointing": False})  # the variants decide
    with memory_budget(budget_bytes, device) as cpu_budget, loaded(cfg, device) as s:
        batch, extra = one_batch(s.dataset, 1, cfg.train.seed, device), [{}] * len(variants)  # {}: counting OOMed
        with oom_caught():
            plain, calls = step_flops(s.model, batch), forward_calls(s.model, batch)
            extra = [{"extra_flops_pct": 100 * step_flops(s.model, batch, v) / plain - 100,
                      "recomputed_blocks": forward_calls(s.model, batch, v) - calls} for v in variants]
        del batch
        release()  # what the counter kept alive is gone before any peak is measured
        env = _env.environment(device, cfg.mode, s.weights)
        out = [_train_variant(cfg, s.model, s.dataset, device, v, env, cpu_budget=cpu_budget, progress=progress)
               for v in variants]
    return [replace(m, info={**m.info, **x}) for m, x in zip(out, extra)]


def largest_batch(cfg: Config, variant: Variant, device: torch.device | str | None = None, *,
                  budget_bytes: int | None = None, max_batch: int = 64, steps: int = 2,
                  progress: bool = False) -> tuple[int, list[Measured]]:
    """(the largest micro-batch <= ``max_batch`` that trains without running out of memory, 0 if not even 1 does;
    every probe): tries 1, 2, 3, ... for ``steps`` steps (the second holds the optimizer state)."""
    device = torch.device(device or _env.default_device())
    base = cfg.override({"train.steps": steps, "train.gradient_checkpointing": False,
                         "train.timing_warmup_steps": min(cfg.train.timing_warmup_steps, steps - 1)})
    probes: list[Measured] = []
    with memory_budget(budget_bytes, device) as cpu_budget, loaded(base, device) as s:
        env = _env.environment(device, cfg.mode, s.weights)
        for b in range(1, max_batch + 1):
            probes.append(_train_variant(base.override({"train.micro_batch_size": b}), s.model, s.dataset, device,
                                         variant, env, cpu_budget=cpu_budget, progress=progress,
                                         desc=f"{variant.name}, batch {b}"))
            if not probes[-1].ok:
                break
    return sum(m.ok for m in probes), probes


def peak_during(fn: Callable[[], object], device: torch.device | str | None = None) -> int:
    """Peak bytes of the tensors ``fn()`` allocates, above what was live when it started. CUDA: the allocator's
    peak. CPU: the storages created inside (:class:`labutils.core.memory.LiveStorages`, no walk over live objects)."""
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
def one_batch(dataset, micro_batch_size: int, seed: int, device) -> dict:
    """The first micro-batch the training loop would see, on ``device``."""
    window = next(dataset.windows(micro_batch_size, 1, seed))
    return {k: v.to(device) for k, v in window.micro_batches[0].items()}


@contextlib.contextmanager
def _one_step(model, batch: dict, variant: Variant | None):
    """One forward + backward with ``variant`` on, on entering the block (read grads inside); grads cleared around."""
    model.train()
    model.zero_grad(set_to_none=True)
    undo = variant.apply(model) if variant else None
    try:
        model(**batch, use_cache=False).loss.backward()
        yield
    finally:
        if undo:
            undo()
        model.zero_grad(set_to_none=True)


def step_grads(model, batch: dict, variant: Variant | None = None) -> list[torch.Tensor]:
    """Gradients of one forward + backward with ``variant`` on (copies in host memory, one per parameter)."""
    params = list(model.parameters())  # before apply: lab 03's segments re-parent blocks, not parameters
    with _one_step(model, batch, variant):
        return [p.grad.detach().to("cpu", copy=True) if p.grad is not None else None for p in params]


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

    with FlopCounterMode(display=False) as counter, _one_step(model, batch, variant):
        return counter.get_total_flops()


def forward_calls(model, batch: dict, variant: Variant | None = None) -> int:
    """How many times the blocks' MLPs run in one forward + backward: L without recompute, more with it (on
    ``block.mlp``: transformers checkpoints a block's ``forward``, so a hook on the block misses the recompute)."""
    calls = [0]
    handles = [block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
               for block in spec_of(model).blocks_of(model)]
    try:
        with _one_step(model, batch, variant):
            return calls[0]
    finally:
        for h in handles:
            h.remove()
