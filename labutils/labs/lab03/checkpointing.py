"""Lab 03's checkpointing variants on labutils' GPT-2 models (the notebook writes each out on a toy stack first), run
through :func:`labutils.core.train` and measured the same way (:mod:`.checkpoint_measure`). ``undo = v.apply(model)``
switches one on: baseline(), every_n(k) (the model's API; k=1: full), segments(k) (Chen et al. 2016), selective(policy)
(saves what the policy marks), offload() (saved activations to host memory), checkpoint_offload() (both)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ...core import device as dev
from ...core.memory import oom_text
from ...models.spec import spec_of
from ...models.gpt2 import disable_checkpointing, enable_checkpointing


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


def baseline() -> Variant:
    return Variant("baseline", "baseline", lambda model: (lambda: None))


def every_n(k: int = 1, **checkpoint_kwargs) -> Variant:
    """The model's API: ``lu.enable_checkpointing(model, every_n_layers=k)`` (blocks 0, k, 2k, ... recompute)."""
    def apply(model):
        enable_checkpointing(model, k, **checkpoint_kwargs)
        return lambda: disable_checkpointing(model)
    return Variant("full" if k == 1 else f"every {k}", "every_n", apply, k)


def full(**checkpoint_kwargs) -> Variant:
    return every_n(1, **checkpoint_kwargs)


class Segment(nn.Module):
    """``len(blocks)`` consecutive blocks in one non-reentrant checkpoint (Chen et al. 2016): only its input is kept."""

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
        path = spec_of(model).blocks  # where the model keeps its blocks ("transformer.h", "model.layers")
        blocks = model.get_submodule(path)
        model.set_submodule(path, nn.ModuleList(Segment(blocks[i:i + k]) for i in range(0, len(blocks), k)))

        def undo():
            model.set_submodule(path, blocks)
        return undo
    return Variant(f"segments of {k}", "segments", apply, k)


# Matrix multiplications (and fused attention, a pair of them) cost FLOPs; everything else in a GPT-2 block
# (layer norm, GELU's tanh/pow/mul, residual adds, dropout, views) is pointwise and cheap to recompute.
_aten = torch.ops.aten
SAVE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
            _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
            _aten._scaled_dot_product_cudnn_attention.default,
            _aten._scaled_dot_product_flash_attention_for_cpu.default}


def draws_random_numbers(op, args, kwargs) -> bool:
    """Does this call draw random numbers? Ops tagged ``nondeterministic_seeded`` do, unless ``dropout_p == 0``."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[i] if i < len(args) else op._schema.arguments[i].default_value)
        return bool(p)
    return True


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpointing policy: keep matmul outputs, recompute pointwise ops; never keep an op that draws random
    numbers (CUDA fused attention with dropout): its skipped draw would shift every later dropout mask (wrong grads)."""
    if op in SAVE_OPS and not draws_random_numbers(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective(policy=None) -> Variant:
    """Every block checkpointed through the model's API, with ``context_fn`` = selective checkpointing contexts."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy or save_matmuls)
    return Variant("selective", "selective", every_n(1, context_fn=context_fn).apply, 1)


class CountingSaveOnCPU(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` (pinned where there is a GPU) that leaves ``keep`` tensors (the weights) in place and counts:
    ``bytes`` moved, ``kept_bytes`` what plain ``save_on_cpu`` would have copied in addition."""

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
                if isinstance(exc, torch.OutOfMemoryError) or not self.pinned or not dev.is_oom(exc):
                    raise  # any other error (a bad tensor, a driver fault) is what it is, not an OOM
                raise torch.OutOfMemoryError(f"CPU offload: could not allocate {t.numel() * t.element_size()} "
                                             f"bytes of pinned host memory ({oom_text(exc)})") from exc
            # Already on the CPU, .cpu() returns the tensor itself; a saved *output* held that way would form a
            # reference cycle through its own grad_fn that outlives the graph if backward never runs (OOM).
            return device, (packed.detach() if packed is t else packed)
        self.pack_hook = counting_pack


def _wrap_forward(model, variant: Variant):
    """Run the model's whole forward under :class:`CountingSaveOnCPU`; returns the undo function, which puts back
    what was there (an instance forward of its own, e.g. the chunked loss's :func:`labutils.models.loss_chunks.install`)."""
    original, before = model.forward, model.__dict__.get("forward")
    device_type = next(model.parameters()).device.type
    weights = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())

    @functools.wraps(original)
    def forward(*args, **kwargs):
        hooks = CountingSaveOnCPU(device_type, keep=weights)
        with hooks:
            out = original(*args, **kwargs)
        variant.info["host_bytes"] = max(variant.info.get("host_bytes", 0), hooks.bytes)
        variant.info["weights_not_moved_bytes"] = max(variant.info.get("weights_not_moved_bytes", 0), hooks.kept_bytes)
        return out

    model.forward = forward  # instance attribute: nn.Module.__call__ finds it before the class's forward

    def undo():
        if model.__dict__.get("forward") is forward:
            del model.forward
            if before is not None:
                model.forward = before
    return undo


def offload() -> Variant:
    """No recompute: saved activations wait in host memory for backward (weights stay: :class:`CountingSaveOnCPU`)."""
    v = Variant("offload", "offload", None)
    v.apply = lambda model: _wrap_forward(model, v)
    return v


def checkpoint_offload() -> Variant:
    """Full checkpointing, plus offload of what it still saves (block inputs, embeddings, LM head)."""
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
