"""A model's shape as data, read from its own transformers config: :class:`ModelSpec`, :data:`PRESETS` (GPT-2's
sizes plus ``tiny``) and :func:`spec_of`, which answers for a preset's name, a config or a live causal LM of any
family (GPT-2, Llama, Qwen2, GPT-NeoX, ...). FLOP counts, checkpointing, the labs' hooks and FSDP's wrap class ask
it, so the course's loop works on a model a student brings; what stays GPT-2-only refuses in one line
(:func:`gpt2_only`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .hub import vocab_size

N_POSITIONS = 1024  # positions of every GPT-2 size


@dataclass(frozen=True)
class ModelSpec:
    """transformers' standard names (GPT2Config maps hidden_size, num_attention_heads, num_hidden_layers onto its
    own through its attribute_map)."""
    family: str          # config.model_type: "gpt2", "llama", "qwen2", "gpt_neox", ...
    n_layer: int         # num_hidden_layers
    d_model: int         # hidden_size
    n_head: int          # num_attention_heads
    n_kv_head: int       # num_key_value_heads (grouped-query attention); n_head without it
    head_dim: int        # head_dim; d_model // n_head without it
    d_ff: int            # intermediate_size (GPT-2: n_inner, None meaning 4 * d_model)
    gated_mlp: bool      # three MLP matrices (gate, up, down: Llama's SwiGLU), not two
    vocab: int           # the tokenizer's vocabulary (a padded LM head's extra rows left out)
    tied_head: bool      # the LM head is the token embedding
    n_positions: int     # max_position_embeddings
    blocks: str          # where the blocks' ModuleList is: "transformer.h" (GPT-2), "model.layers" (Llama)
    block_class: str     # the block's class name: FSDP's wrap unit ("GPT2Block", "LlamaDecoderLayer")

    @property
    def attn_width(self) -> int:
        """Query (and attention output) width: heads x head size."""
        return self.n_head * self.head_dim

    @property
    def block_matmul_weights(self) -> int:
        """One block's matmul weights: Q, K, V (K and V of the kv heads only), the output projection, the MLP."""
        d, kv = self.d_model, self.n_kv_head * self.head_dim
        return d * (2 * self.attn_width + 2 * kv) + (3 if self.gated_mlp else 2) * d * self.d_ff

    def blocks_of(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The model's blocks (its ModuleList at :attr:`blocks`)."""
        return operator.attrgetter(self.blocks)(model)


def _gpt2(name: str, n_layer: int, d_model: int, n_head: int) -> ModelSpec:
    return ModelSpec("gpt2", n_layer, d_model, n_head, n_head, d_model // n_head, 4 * d_model, False,
                     vocab_size(name), True, N_POSITIONS, "transformer.h", "GPT2Block")


PRESETS = {name: _gpt2(name, *shape) for name, shape in {
    "gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25),
    "tiny": (2, 128, 4),  # GPT-2 architecture, for smoke runs only; no hub checkpoint
}.items()}


def real_vocab_size(model) -> int:
    """The vocabulary the tokenizer uses (rows :func:`labutils.models.pad_vocabulary` added left out)."""
    head = model.get_output_embeddings()
    return getattr(head, "labutils_real_vocab", model.config.vocab_size)  # the config: a sharded head has no shape


def spec_of(model) -> ModelSpec:
    """The :class:`ModelSpec` of a preset's name, a transformers config (its model built on the meta device, no
    memory, to see where the blocks are) or a live causal LM; a spec is returned as it is."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model {model!r}: the presets are {', '.join(PRESETS)}")
        return PRESETS[model]
    if not isinstance(model, torch.nn.Module):  # a config
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model)
    c = model.config
    names = set(getattr(model, "_no_split_modules", None) or ())
    path, blocks = next(((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
                         and (type(m[0]).__name__ in names or not names)), (None, None))
    if blocks is None or not hasattr(blocks[0], "mlp"):
        raise ValueError(f"{type(model).__name__}: no list of transformer blocks with an .mlp found")
    d, heads = c.hidden_size, c.num_attention_heads
    d_ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
    return ModelSpec(c.model_type, c.num_hidden_layers, d, heads, getattr(c, "num_key_value_heads", None) or heads,
                     getattr(c, "head_dim", None) or d // heads, d_ff,
                     sum(getattr(m, "weight", None) is not None for m in blocks[0].mlp.children()) == 3,
                     real_vocab_size(model),
                     bool(getattr(c, "tie_word_embeddings", False)), c.max_position_embeddings, path,
                     type(blocks[0]).__name__)


def gpt2_only(what: str, model) -> ModelSpec:
    """The spec of ``model`` if it is a GPT-2, else ValueError in one line naming what ``what`` supports."""
    spec = spec_of(model)
    if spec.family != "gpt2":
        got = type(model).__name__ if isinstance(model, torch.nn.Module) else spec.family
        raise ValueError(f"{what} models GPT-2 only ({', '.join(PRESETS)}); got {got}")
    return spec
