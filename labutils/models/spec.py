"""A model's shape as data (:class:`ModelSpec`), read from any transformers causal LM's own config by
:func:`spec_of`; :data:`PRESETS`: GPT-2's sizes plus ``tiny``. What stays GPT-2 only refuses: :func:`gpt2_only`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .hub import vocab_size


@dataclass(frozen=True)
class ModelSpec:
    """transformers' standard names; GPT2Config maps them onto its own (n_embd, n_head, ...) by its attribute_map."""
    family: str          # config.model_type: "gpt2", "llama", "gpt_neox", ...
    n_layer: int         # num_hidden_layers
    d_model: int         # hidden_size
    n_head: int          # num_attention_heads
    n_kv_head: int       # num_key_value_heads (grouped-query attention), else n_head
    head_dim: int        # head_dim, else d_model // n_head
    d_ff: int            # intermediate_size (GPT-2: n_inner, None meaning 4 * d_model)
    gated_mlp: bool      # three MLP matrices (Llama's gate, up, down), not two
    vocab: int           # the tokenizer's vocabulary (a padded LM head's extra rows left out)
    tied_head: bool      # the LM head is the token embedding
    n_positions: int     # max_position_embeddings
    blocks: str          # the blocks' ModuleList: "transformer.h" (GPT-2), "model.layers" (Llama)
    block_class: str     # the block's class: FSDP's wrap unit ("GPT2Block", "LlamaDecoderLayer")

    @property
    def attn_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def block_matmul_weights(self) -> int:
        """One block's matmul weights: Q, K and V (K, V for the kv heads), the output projection, the MLP."""
        d, kv = self.d_model, self.n_kv_head * self.head_dim
        return d * (2 * self.attn_width + 2 * kv) + (3 if self.gated_mlp else 2) * d * self.d_ff

    def blocks_of(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.get_submodule(self.blocks)


PRESETS = {name: ModelSpec("gpt2", n, d, a, a, d // a, 4 * d, False, vocab_size(name), True, 1024, "transformer.h",
                           "GPT2Block") for name, (n, d, a) in {
    "gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25),
    "tiny": (2, 128, 4), "tiny-deep": (4, 96, 4)}.items()}  # tiny*: smoke only, no hub checkpoint; a config's smoke:


def real_vocab_size(model) -> int:
    """The vocabulary the tokenizer uses (rows :func:`labutils.models.gpt2.pad_vocabulary` added left out)."""
    head = model.get_output_embeddings()
    return getattr(head, "labutils_real_vocab", model.config.vocab_size)  # the config: a sharded head has no shape


def spec_of(model) -> ModelSpec:
    """The spec of a preset's name, a transformers config (its model built on the meta device: no memory) or a
    causal LM: the blocks are the ModuleList of the model's ``_no_split_modules`` class."""
    if isinstance(model, str) and model not in PRESETS:
        raise ValueError(f"unknown model {model!r}: the presets are {', '.join(PRESETS)}")
    if isinstance(model, (ModelSpec, str)):
        return PRESETS.get(model, model)
    if not isinstance(model, torch.nn.Module):  # a config
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model)
    c, names = model.config, set(getattr(model, "_no_split_modules", None) or ())
    path, blocks = next(((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
                         and type(m[0]).__name__ in names and hasattr(m[0], "mlp")), ("", None))
    if blocks is None:
        raise ValueError(f"{type(model).__name__}: no list of transformer blocks (with an .mlp) found")
    d, heads = c.hidden_size, c.num_attention_heads
    return ModelSpec(c.model_type, c.num_hidden_layers, d, heads, getattr(c, "num_key_value_heads", None) or heads,
                     getattr(c, "head_dim", None) or d // heads,
                     getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d,
                     sum(getattr(m, "weight", None) is not None for m in blocks[0].mlp.children()) == 3,
                     real_vocab_size(model), bool(getattr(c, "tie_word_embeddings", False)),
                     c.max_position_embeddings, path, type(blocks[0]).__name__)


def gpt2_only(what: str, model) -> ModelSpec:
    """The spec of ``model`` if it is a GPT-2, else ValueError in one line naming what ``what`` supports."""
    spec = spec_of(model)
    if spec.family != "gpt2":
        got = type(model).__name__ if isinstance(model, torch.nn.Module) else spec.family
        raise ValueError(f"{what} models GPT-2 only ({', '.join(PRESETS)}); got {got}")
    return spec
