"""A nanoGPT-style GPT-2 written out in torch: the reference ``bench`` measures the course's fast path against.

Its own ``nn.Linear`` blocks, ``F.scaled_dot_product_attention(is_causal=True)`` with no mask, the tanh GELU, a tied
LM head without a bias, cross-entropy on the logits, AdamW fused on CUDA, weight decay on matrices only. :func:`from_hf`
loads the course's model's weights (padded vocabulary included; the four ``Conv1D`` matrices per block transposed).
No mask for padded vocabulary rows, no activation checkpointing (nanoGPT has neither); unpadded, its loss equals ours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .spec import gpt2_only

IGNORE = -100  # the course's label for a position without a target (labutils.core.data.IGNORE_INDEX)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int = 1024
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head, self.dropout = c.n_head, c.dropout
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd), CausalSelfAttention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.n_embd), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 as nanoGPT writes it; ``forward(idx, targets)`` returns ``(logits, loss)``, the loss a mean over the
    targets that are not ``-100`` (targets are the next tokens: :func:`shift_labels` makes them from labels)."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout), h=nn.ModuleList(Block(c) for _ in range(c.n_layer)),
            ln_f=nn.LayerNorm(c.n_embd)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied (the weights come from from_hf)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE)
        return logits, loss


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The next-token targets of ``labels`` (position t's target is label t+1; the last has none): what
    transformers' causal-LM loss does inside the model, done once outside it."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE)


def config_of(hf_model, dropout: float | None = None) -> GPTConfig:
    """The reference's shape for a transformers GPT-2 (padded vocabulary included); another model: refused."""
    gpt2_only("labutils.models.reference (bench's nanoGPT)", hf_model)
    c = hf_model.config
    vocab = hf_model.get_input_embeddings().weight.shape[0]
    if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"reference: activation {c.activation_function!r} is not GPT-2's tanh GELU")
    return GPTConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=vocab,
                     block_size=c.n_positions, dropout=c.resid_pdrop if dropout is None else dropout)


def convert_state_dict(hf_state: dict) -> dict:
    """transformers' GPT-2 state_dict in the reference's layout: the same names, ``Conv1D`` weights transposed,
    the LM head left out (tied to ``wte``) and transformers' non-weight buffers (``attn.bias`` masks) dropped."""
    out = {}
    for k, v in hf_state.items():
        if k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        out[k] = v.t() if k.endswith(CONV1D) else v
    return out


def from_hf(hf_model, dropout: float | None = None) -> GPT:
    """A reference model holding ``hf_model``'s weights (copies, on the same device, fp32 as they are)."""
    weight = hf_model.get_input_embeddings().weight
    with torch.device("meta"):
        ref = GPT(config_of(hf_model, dropout))
    ref = ref.to_empty(device=weight.device)
    state = convert_state_dict(hf_model.state_dict())
    missing, unexpected = ref.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # pragma: no cover - a transformers change
        raise RuntimeError(f"reference: weights do not map (missing {missing}, unexpected {unexpected})")
    ref.lm_head.weight = ref.transformer.wte.weight  # to_empty / load keep the tie; say it
    return ref.train()


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device):
    """nanoGPT's ``configure_optimizers``: decay on tensors of 2+ dims, none on biases and norms; fused on CUDA.
    AdamW's default betas, as the course's loop uses (nanoGPT's 0.95 would change the maths, not the speed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=torch.device(device).type == "cuda")
