"""The LM head and cross-entropy in chunks of positions: the logits never exist whole (``model.loss: chunked``).

GPT-2's largest tensor in a training step is not an activation of a block but the logits, ``[B, T, V]`` with
V = 50257: at B8 x T1024 they are 1.6 GB in fp32, and the loss holds two or three tensors of that size at once
(the fp32 copy, ``log_softmax``'s output saved for backward, and in backward the gradients of both). Nobody needs
them whole: the loss needs, per position, a log-sum-exp and one target logit; the backward needs, per position,
``softmax - onehot``. So :class:`ChunkedLinearCrossEntropy` walks the positions in chunks of ``chunk_size``:

* forward, per chunk: ``logits = h @ W^T (+ bias)`` in the matmul's dtype (autocast's, as ``lm_head`` would), upcast
  to fp32 as transformers' loss does, log-sum-exp and the target logit, summed; only the log-sum-exp (4 bytes a
  position) is kept;
* backward, per chunk: the same logits are recomputed, turned into ``softmax - onehot`` in place, and give their
  share of the hidden states' gradient and the head weight's (accumulated in fp32). One chunk's logits live at a
  time.

Why a ``torch.autograd.Function`` rather than ``torch.utils.checkpoint`` per chunk: checkpointing would give the
same recompute, but each chunk's backward would hand autograd its own ``[V, d]`` weight gradient to add up (one
more head-sized tensor per chunk in flight) and keep ``log_softmax``'s output while it runs; written out, the weight
gradient is one fp32 buffer added into in place and the softmax is computed in the logits' own buffer. The cost is
the recompute: one more ``h @ W^T`` per step, 2 * V * d FLOPs per position (:func:`labutils.flops.flops_per_token`
counts it; MFU's model FLOPs do not change).

Liger-Kernel's fused linear cross-entropy (``pip install labutils[liger]``, Triton, CUDA only) does the same in
fused kernels and computes the gradients during the forward (no recompute); :func:`chunked_lm_loss` uses it on a
CUDA device when it is installed and ``use_liger`` allows. Both are held to the same tests (tests/test_chunked_loss.py).

:func:`install` replaces a GPT2LMHeadModel instance's ``forward`` for training calls with labels: the transformer
runs as before (gradient checkpointing and ``nn.Module.compile`` included: the compiled call traces the instance's
``forward``), then the chunked loss; the output carries the loss and no logits. Other calls (no labels, eval mode)
go to the model's own forward unchanged.
"""
from __future__ import annotations

import importlib.util
import types

import torch

IGNORE_INDEX = -100
DEFAULT_CHUNK = 1024  # positions per chunk (model.loss_chunk_size): a [1024, 50304] fp32 chunk is 0.2 GB


def compute_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``lm_head``'s matmul runs in: autocast's when it is on for this device, else the weight's."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight^T (+ bias)`` against ``targets``, ``chunk`` positions at a time.

    ``hidden`` [N, d], ``weight`` [V, d], ``bias`` [V] or None, ``targets`` [N] (``IGNORE_INDEX`` = no loss),
    ``dtype`` the matmul dtype. Returns the fp32 sum over the positions that count. Nothing of size N x V is saved
    for backward: only the log-sum-exp of each position (and ``hidden`` in the matmul dtype, as ``lm_head`` saves it).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, dtype: torch.dtype):
        with torch.autocast(hidden.device.type, enabled=False):  # casts are explicit below
            h = hidden.to(dtype)                                   # as lm_head's autocast cast (saved, as there)
            w = weight.to(dtype)
            n = h.shape[0]
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            lse = torch.empty(n, dtype=torch.float32, device=h.device)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                t = targets[s:e]
                x = _chunk_logits(h[s:e], w, bias)
                target_logit = x.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
                top = x.amax(dim=-1, keepdim=True)
                lse[s:e] = x.sub_(top).exp_().sum(-1).log_() + top.squeeze(1)   # log-sum-exp, in x's buffer
                del x
                total += torch.where(t != IGNORE_INDEX, lse[s:e] - target_logit, 0.0).sum()
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.chunk, ctx.dtype, ctx.hidden_dtype = chunk, dtype, hidden.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, weight, bias, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            n = h.shape[0]
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if need_b else None
            scale = grad_total.float()
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                t = targets[s:e]
                valid = (t != IGNORE_INDEX).float()
                g = _chunk_logits(h[s:e], w, bias)
                g.sub_(lse[s:e].unsqueeze(1)).exp_()                           # softmax, in the logits' buffer
                g.scatter_add_(1, t.clamp_min(0).unsqueeze(1), -valid.unsqueeze(1))   # - onehot(target)
                g.mul_((valid * scale).unsqueeze(1))                            # ignored positions: 0
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(dtype)                                                 # as the head's matmul sees it
                if need_h:
                    torch.mm(g, w, out=grad_h[s:e])
                if need_w and g.dtype == grad_w.dtype:   # in place, no [V, d] temporary; out= rather than addmm_,
                    torch.addmm(grad_w, g.t(), h[s:e], out=grad_w)     # which torch's FLOP counter does not see
                elif need_w:
                    grad_w.add_(g.t() @ h[s:e])                                 # half product, fp32 accumulator
                del g
        grad_hidden = grad_h.to(ctx.hidden_dtype) if need_h else None
        grad_weight = grad_w.to(weight.dtype) if need_w else None
        grad_bias = grad_b.to(bias.dtype) if need_b else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _chunk_logits(h, w, bias):
    """One chunk's logits in fp32: the matmul in ``h``'s dtype (lm_head's), then upcast as transformers' loss does."""
    x = (h @ w.t()).float()
    if bias is not None:
        x += bias.float()
    return x


# ---------------------------------------------------------------------------------------------------------------
# Liger-Kernel (optional, CUDA only)
# ---------------------------------------------------------------------------------------------------------------
LIGER_PACKAGE = "liger-kernel"


def liger_available() -> bool:
    """Is Liger-Kernel installed? (``find_spec``: nothing is imported; Triton is imported only when it is used.)"""
    return importlib.util.find_spec("liger_kernel") is not None


def uses_liger(device: torch.device | str, use_liger: bool = True) -> bool:
    """Whether :func:`chunked_lm_loss` takes Liger's fused kernel on ``device``: CUDA, installed, and allowed."""
    return use_liger and torch.device(device).type == "cuda" and liger_available()


def _liger_sum(hidden, weight, bias, targets):
    """Liger's fused linear cross-entropy, summed; the weight gradient accumulated in fp32 where the installed
    version takes ``accum_dtype`` (as the torch path does)."""
    import inspect

    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    kw = {"accum_dtype": torch.float32} if "accum_dtype" in inspect.signature(
        liger_fused_linear_cross_entropy).parameters else {}
    return liger_fused_linear_cross_entropy(hidden, weight, targets, bias, ignore_index=IGNORE_INDEX,
                                            reduction="sum", **kw)


# ---------------------------------------------------------------------------------------------------------------
# The causal-LM loss, as transformers' ForCausalLMLoss computes it, chunked
# ---------------------------------------------------------------------------------------------------------------
def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
                    num_items_in_batch=None, chunk_size: int = DEFAULT_CHUNK, use_liger: bool = True) -> torch.Tensor:
    """transformers' causal-LM loss of ``hidden`` [B, T, d] through a head ``weight`` [V, d] (+ ``bias`` [V]):
    labels shifted by one (the last position has no target), -100 ignored; the sum over target tokens divided
    by ``num_items_in_batch`` when given (token-exact accumulation: the window's target count), else the mean.

    ``bias``: e.g. a constant large negative on padded vocabulary rows, so they never win and add 0 to the softmax.
    On CUDA with Liger-Kernel installed (and ``use_liger``), Liger's fused kernel computes the sum instead."""
    d = hidden.shape[-1]
    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, d)
    if uses_liger(flat.device, use_liger):
        total = _liger_sum(flat, weight, bias, targets)
    else:
        dtype = compute_dtype(flat.device.type, weight.dtype)
        total = ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets, int(chunk_size), dtype)
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def head_bias(head: torch.nn.Module) -> torch.Tensor | None:
    """The LM head's bias for the chunked loss. A tensor ``head.bias`` (a Linear's bias or a registered buffer, e.g.
    a constant large negative on the padded vocabulary rows) is used as it is. A head padded the hook way
    (``labutils_real_vocab`` rows are real, the hook overwrites the rest of its output) gets the same effect as a
    bias: the dtype's lowest value on the padded rows. None when the head has neither."""
    bias = getattr(head, "bias", None)
    if isinstance(bias, torch.Tensor):
        return bias
    real = getattr(head, "labutils_real_vocab", None)
    rows = head.weight.shape[0]
    if real is None or real >= rows:
        return None
    out = torch.zeros(rows, dtype=torch.float32, device=head.weight.device)
    out[real:] = torch.finfo(torch.float32).min
    return out


def _training_forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
    """GPT2LMHeadModel.forward for training calls with labels: the transformer, then :func:`chunked_lm_loss`;
    ``logits`` is None. Any other call goes to the class's own forward."""
    if labels is None or not self.training or kwargs.get("inputs_embeds") is not None:
        return type(self).forward(self, input_ids, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    out = self.transformer(input_ids, **kwargs)
    head = self.lm_head
    loss = chunked_lm_loss(out.last_hidden_state, head.weight, labels, head_bias(head), num_items_in_batch,
                           self.labutils_loss_chunk, self.labutils_use_liger)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=None, hidden_states=out.hidden_states,
                                             attentions=out.attentions)


def install(model, chunk_size: int | None = None, use_liger: bool = True):
    """Make ``model`` (a GPT2LMHeadModel) compute its training loss with :func:`chunked_lm_loss`: its instance
    ``forward`` is replaced (the class is untouched; ``uninstall`` restores it). Returns the model."""
    model.labutils_loss_chunk = int(chunk_size or DEFAULT_CHUNK)
    model.labutils_use_liger = bool(use_liger)
    model.forward = types.MethodType(_training_forward, model)
    return model


def uninstall(model):
    """Back to the model's own forward (the full logits and loss)."""
    model.__dict__.pop("forward", None)
    return model


def installed(model) -> bool:
    """Does ``model`` compute its training loss in chunks?"""
    fwd = model.__dict__.get("forward")
    return getattr(fwd, "__func__", None) is _training_forward
