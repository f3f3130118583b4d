"""Lab 03's tools: activation-checkpointing variants for GPT-2, measured with the course's one training loop.

The notebook writes each technique out on a toy stack first; the functions here apply the same ideas to the
GPT-2 models of labutils, so that every variant runs through :func:`labutils.train` and is measured the same way.

Variants: ``variant.apply(model)`` switches it on and returns a function that switches it off again.

    baseline()            keep every activation autograd wants (the default)
    every_n(k)            the model's own API, non-reentrant: blocks 0, k, 2k, ... recompute in backward (k=1: full)
    segments(k)           Chen et al. 2016: k consecutive blocks inside one checkpoint; only segment inputs are kept
    selective(policy)     every block checkpointed, but ops the policy marks (matmuls) are saved, the rest recomputed
    offload()             no recompute: every saved activation goes to host memory (torch.autograd.graph.save_on_cpu)
    checkpoint_offload()  full checkpointing, and what it still saves (block inputs, LM head) goes to host memory

Measuring: ``measure(cfg, variants)`` (one model, one training run per variant, OOM -> a row, memory released),
``largest_batch(cfg, variant)``, ``memory_budget(bytes)``, ``loaded(cfg)``, ``peak_during(fn)``.
Checking: ``step_grads`` / ``max_rel_diff``, ``step_flops``, ``forward_calls``, ``captured_logs``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import env as _env
from .config import Config
from . import device as dev
from .memory import LiveStorages, release
from .models import disable_checkpointing, enable_checkpointing
from .train import RunResult, prepare, train

try:  # torch >= 2.4
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:  # pragma: no cover - older torch: the selective variant is reported as unavailable
    CheckpointPolicy = create_selective_checkpoint_contexts = None

MiB = 2**20


# ----------------------------------------------------------------------------------------------- what torch offers
def available(feature: str) -> tuple[bool, str]:
    """Is a checkpointing feature in this torch/transformers? ("selective", "offload", "every_n_layers")."""
    if feature == "selective":
        ok = create_selective_checkpoint_contexts is not None
        return ok, ("torch.utils.checkpoint.create_selective_checkpoint_contexts" if ok else
                    f"torch {torch.__version__} has no create_selective_checkpoint_contexts (needs torch >= 2.4)")
    if feature == "offload":
        ok = hasattr(torch.autograd.graph, "save_on_cpu")
        return ok, ("torch.autograd.graph.save_on_cpu" if ok else
                    f"torch {torch.__version__} has no torch.autograd.graph.save_on_cpu")
    if feature == "every_n_layers":
        import inspect

        from transformers import PreTrainedModel
        fn = getattr(PreTrainedModel, "activation_checkpointing_enable", None) or \
            PreTrainedModel.gradient_checkpointing_enable
        ok = "every_n_layers" in inspect.signature(fn).parameters
        return ok, (f"{fn.__name__}(every_n_layers=k)" if ok else "this transformers has no every_n_layers")
    raise ValueError(f"unknown feature {feature!r}; one of selective, offload, every_n_layers")


# ------------------------------------------------------------------------------------------------------ variants
@dataclass(eq=False)
class Variant:
    """A way to train: ``undo = variant.apply(model)``; ``variant.info`` collects what it measured (offloaded bytes)."""
    name: str
    kind: str
    apply: Callable[[nn.Module], Callable[[], None]]
    k: int | None = None
    info: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Variant({self.name!r})"


def _hf_enable(model, every_n_layers: int = 1, **checkpoint_kwargs) -> None:
    """The model's own switch, with extra ``torch.utils.checkpoint`` arguments (``context_fn``, ...)."""
    enable_checkpointing(model, every_n_layers, **checkpoint_kwargs)


def _hf_disable(model) -> None:
    disable_checkpointing(model)


def baseline() -> Variant:
    return Variant("baseline", "baseline", lambda model: (lambda: None))


def every_n(k: int = 1, **checkpoint_kwargs) -> Variant:
    """The model's API: ``lu.enable_checkpointing(model, every_n_layers=k)`` (blocks 0, k, 2k, ... recompute)."""
    def apply(model):
        if checkpoint_kwargs:
            _hf_enable(model, k, **checkpoint_kwargs)
        else:
            if hasattr(model, "disable_input_require_grads"):
                model.disable_input_require_grads()
            enable_checkpointing(model, every_n_layers=k)
        return lambda: _hf_disable(model)
    return Variant("full" if k == 1 else f"every {k}", "every_n", apply, k)


def full(**checkpoint_kwargs) -> Variant:
    return every_n(1, **checkpoint_kwargs)


class Segment(nn.Module):
    """``len(blocks)`` consecutive GPT-2 blocks run inside one non-reentrant checkpoint (Chen et al. 2016).

    Forward keeps only the segment's input; backward re-runs the whole segment to get what it needs.
    """

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden_states, *args, **kwargs):
        def run(h):
            for block in self.blocks:
                h = block(h, *args, **kwargs)
            return h
        if self.training and torch.is_grad_enabled():
            return checkpoint(run, hidden_states, use_reentrant=False)
        return run(hidden_states)


def segments(k: int) -> Variant:
    """Group the model's blocks into segments of ``k`` (the last may be shorter), each one checkpoint."""
    def apply(model):
        blocks = model.transformer.h
        model.transformer.h = nn.ModuleList(Segment(blocks[i:i + k]) for i in range(0, len(blocks), k))

        def undo():
            model.transformer.h = blocks
        return undo
    return Variant(f"segments of {k}", "segments", apply, k)


def _sdpa_ops() -> set:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


# Matrix multiplications (and fused attention, a pair of them) cost FLOPs; everything else in a GPT-2 block
# (layer norm, GELU's tanh/pow/mul, residual adds, dropout, views) is pointwise and cheap to recompute.
SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default} | _sdpa_ops()


def draws_random_numbers(op, args, kwargs) -> bool:
    """Does this call consume the random number generator? Ops tagged ``nondeterministic_seeded`` do (dropout,
    rand, bernoulli), except attention kernels called with ``dropout_p == 0``."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[i] if i < len(args) else op._schema.arguments[i].default_value)
        return bool(p)
    return True


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpointing policy: keep matmul outputs, recompute pointwise ops.

    Never keeps an op that draws random numbers: the recompute replays the forward's random stream from the
    checkpoint's saved RNG state, so an op skipped in the recompute (saved) would shift every later draw, and
    the dropouts after it would get other masks than in the forward: silently wrong gradients. On CUDA that
    op is the fused attention kernel with dropout (its mask is drawn inside the kernel); with dropout 0 it is
    deterministic and kept."""
    if op in SAVE_OPS and not draws_random_numbers(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective(policy=None) -> Variant:
    """Every block checkpointed through the model's API, with ``context_fn`` = selective checkpointing contexts."""
    ok, why = available("selective")
    if not ok:
        raise RuntimeError(why)

    def apply(model):
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy or save_matmuls)
        _hf_enable(model, 1, context_fn=context_fn)
        return lambda: _hf_disable(model)
    return Variant("selective", "selective", apply, 1)


class CountingSaveOnCPU(torch.autograd.graph.save_on_cpu):
    """``torch.autograd.graph.save_on_cpu`` that leaves ``keep`` tensors (the weights) in place and counts bytes.

    Plain ``save_on_cpu`` packs *every* saved tensor, and a matmul saves its weight for backward: it would copy
    all weights to the host and back each step while saving no device memory (the parameters stay on the
    device anyway). Here tensors whose storage is in ``keep`` are not moved; ``bytes`` counts what was moved,
    ``kept_bytes`` what plain ``save_on_cpu`` would have copied in addition. Pinned host memory (asynchronous
    copies) where there is a GPU; on a CPU-only machine the tensors already live in host memory and packing is
    free (pinning would need an accelerator).
    """

    def __init__(self, device_type: str = "cuda", keep: frozenset = frozenset()):
        self.pinned = dev.pin_memory_default(device_type)
        super().__init__(pin_memory=self.pinned, device_type=device_type)
        self.bytes = self.kept_bytes = 0
        pack = self.pack_hook

        def counting_pack(t):
            if t.untyped_storage().data_ptr() in keep:
                self.kept_bytes += t.numel() * t.element_size()
                return t.device, t  # unpack's .to(device) is then a no-op
            self.bytes += t.numel() * t.element_size()
            try:
                device, packed = pack(t)
            except RuntimeError as exc:  # pinned host memory exhausted: torch raises a plain RuntimeError
                if isinstance(exc, torch.OutOfMemoryError) or not self.pinned:
                    raise
                raise torch.OutOfMemoryError(f"CPU offload: could not allocate {t.numel() * t.element_size()} "
                                             f"bytes of pinned host memory ({_first_line(exc)})") from exc
            # Already on the CPU, .cpu() returns the tensor itself; a saved *output* held that way would form a
            # reference cycle through its own grad_fn that outlives the graph if backward never runs (OOM).
            return device, (packed.detach() if packed is t else packed)
        self.pack_hook = counting_pack


def _wrap_forward(model, variant: Variant):
    """Run the model's whole forward under :class:`CountingSaveOnCPU`; returns the undo function."""
    original = model.forward
    device_type = next(model.parameters()).device.type
    weights = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())

    @functools.wraps(original)
    def forward(*args, **kwargs):
        hooks = CountingSaveOnCPU(device_type, keep=weights)
        with hooks:
            out = original(*args, **kwargs)
        variant.info["host_bytes"] = max(variant.info.get("host_bytes", 0), hooks.bytes)
        variant.info["weights_not_moved_bytes"] = max(variant.info.get("weights_not_moved_bytes", 0),
                                                      hooks.kept_bytes)
        return out

    model.forward = forward  # instance attribute: nn.Module.__call__ finds it before the class's forward

    def undo():
        if model.__dict__.get("forward") is forward:
            del model.forward
    return undo


def offload() -> Variant:
    """No recompute: every activation autograd saves in the forward is parked in host memory until backward
    (the weights it saves stay where they are, see :class:`CountingSaveOnCPU`)."""
    ok, why = available("offload")
    if not ok:
        raise RuntimeError(why)
    v = Variant("offload", "offload", None)
    v.apply = lambda model: _wrap_forward(model, v)
    return v


def checkpoint_offload() -> Variant:
    """Full checkpointing, plus offload of what it still saves (block inputs, embeddings, LM head)."""
    ok, why = available("offload")
    if not ok:
        raise RuntimeError(why)
    v = Variant("checkpoint + offload", "checkpoint_offload", None, 1)

    def apply(model):
        undo_ckpt = full().apply(model)
        undo_off = _wrap_forward(model, v)

        def undo():
            undo_off()
            undo_ckpt()
        return undo
    v.apply = apply
    return v


# ----------------------------------------------------------------------------------------------------- measuring
@dataclass
class Measured:
    """One training run of one variant."""
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
        return self.result.step_time_seconds if self.ok else None

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
                "target_tokens_per_s": r.target_tokens_per_second if self.ok else None,
                "memory_saving_pct": 100 * (1 - self.peak / baseline.peak) if both else None,
                "time_overhead_pct": 100 * (self.step_time / baseline.step_time - 1) if both else None,
                "host_mib": self.host_bytes / MiB if self.host_bytes is not None else None,
                "error": r.error}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


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
        undo = variant.apply(model)
        result = train(cfg, model, dataset, device, env=dict(env), progress=progress,
                       desc=desc or variant.name, cpu_budget_bytes=cpu_budget)
    except torch.OutOfMemoryError as exc:
        oom = _first_line(exc)
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
