"""Lab 03's checkpointing variants through the model's own API, and the :class:`Variant` every variant is: ``undo =
v.apply(model)`` switches one on. Here: baseline(), every_n(k) (``lu.enable_checkpointing``; k=1: full). The notebook
writes out the others in its cells (Chen's segments, selective, offload): what a student copies; the tests and the
doctor run those cells' code (:func:`labutils.labs.registry.cell_definitions`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

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

    @property
    def defined_in(self) -> str | None:
        """Where ``apply`` was written: "notebook" (a cell: the kernel runs it as ``__main__``), else its module."""
        module = getattr(self.apply, "__module__", None)
        return "notebook" if module == "__main__" else module


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


def notebook_variants() -> dict:
    """The notebook's own code for the variants it writes out (``segments``, ``selective``, ``offload`` and what they
    use), run from its cells: the tests and the doctor check what a student reads and copies."""
    from ..registry import cell_definitions
    return cell_definitions("03", ("MATMULS", "save_matmuls", "Segment", "segments", "selective", "offload"))
