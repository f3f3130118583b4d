"""The LM head and cross-entropy in chunks of positions: the logits never exist whole (``model.loss: chunked``).

GPT-2's largest tensor in a training step is the logits, ``[B, T, V]`` (1.6 GB in fp32 at B8 x T1024), and the full
loss holds two or three of them. Per position the loss needs a log-sum-exp and one target logit, its gradient
``softmax - onehot``; so :class:`ChunkedLinearCrossEntropy` walks ``chunk_size`` positions at a time and, as
Liger-Kernel's fused linear cross-entropy does, computes the gradients in the forward: ``logits = h @ W^T (+ bias)``
in the matmul's dtype, their log-sum-exp and target logit in fp32, ``g = softmax - onehot`` in the matmul dtype, then
``g @ W`` and ``g^T @ h`` into one fp32 accumulator (fp16: ``g`` scaled down by the power of two the chunk needs, so
only backward's loss scale can overflow). Backward only scales the stored gradients: no recompute, no host sync, and
compiled, no head matmul AOT autograd could merge with the forward's. FLOPs are the full head's; each extra chunk
re-reads the head (eager about ``16 * V * d`` bytes, compiled ``8 * V * d``: its fp32 gradient read and written once
more), so an unset ``model.loss_chunk_size`` is one chunk where the logits fit (``estimator.advise.fit_loss_chunk``).
:func:`install` replaces a GPT2LMHeadModel's ``forward`` for training calls with labels (no logits in the output).
"""
from __future__ import annotations

import types

import torch

IGNORE_INDEX = -100
DEFAULT_CHUNK = 1024  # positions per chunk where a size is wanted (lab 04's lesson): a [1024, 50304] fp32 chunk, 0.2 GB


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight^T (+ bias)`` against ``targets``, ``chunk`` positions at a time, with
    its gradients computed in the forward (when ``grads``). ``hidden`` [N, d], ``weight`` [V, d], ``bias`` [V] or None,
    ``targets`` [N] (``IGNORE_INDEX`` = no loss), ``dtype`` the matmul dtype. Returns the fp32 sum over the positions
    that count; saves the gradients of ``hidden`` (matmul dtype), ``weight`` and ``bias`` (fp32): never [*, V]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, dtype: torch.dtype, grads: bool):
        with torch.autocast(hidden.device.type, enabled=False):  # casts are explicit below
            h, w = hidden.to(dtype), weight.to(dtype)              # as lm_head's autocast casts them
            n, vocab = h.shape[0], w.shape[0]
            need_h, need_w = grads and hidden.requires_grad, grads and weight.requires_grad
            need_b = grads and bias is not None and bias.requires_grad
            grad_h = []
            grad_w = grad_b = None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            iota = torch.arange(vocab, device=h.device)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                t = targets[s:e]
                valid = t != IGNORE_INDEX
                x = (h[s:e] @ w.t()).float()                                   # fp32, as transformers' loss
                if bias is not None:
                    x += bias.float()
                target_logit = x.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
                lse = torch.logsumexp(x, dim=-1)
                total += torch.where(valid, lse - target_logit, 0.0).sum()
                if not grads:
                    continue
                # softmax - onehot (no scatter), ignored rows 0: in x's buffer in eager; compiled, one elementwise
                # kernel from the matmul's output (the fp32 logits are never written out)
                g = x.sub_(lse.unsqueeze(1)).exp_().add_(iota == t.unsqueeze(1), alpha=-1).mul_(valid.unsqueeze(1))
                if need_b:
                    grad_b = g.sum(0) if grad_b is None else grad_b.add_(g.sum(0))
                g = g.to(dtype)                                                 # as the head's matmul sees it
                if need_h:
                    grad_h.append(g @ w)
                if need_w and dtype == torch.float16:  # fp16 tops at 65504: g scaled down by the power of two the
                    # chunk's largest column sum of |h| needs, undone in fp32 (only the loss scale can overflow)
                    k = torch.ceil(torch.log2(h[s:e].float().abs().sum(0).amax() / 2**15)).clamp_min(0)
                    grad_w = w.new_zeros(w.shape, dtype=torch.float32) if grad_w is None else grad_w
                    grad_w.addcmul_(g.mul_(torch.exp2(-k).to(dtype)).t() @ h[s:e], torch.exp2(k))
                elif need_w and grad_w is None:                                 # an fp32 accumulator
                    grad_w = (g.t() @ h[s:e]).float()
                elif need_w and g.dtype == grad_w.dtype:  # fp32: in place, no [V, d] temporary (out=, which
                    torch.addmm(grad_w, g.t(), h[s:e], out=grad_w)            # torch's FLOP counter sees)
                elif need_w:
                    grad_w.add_(g.t() @ h[s:e])                                 # a bf16 product, added in
                del x, g
        ctx.save_for_backward(torch.cat(grad_h) if need_h else None, grad_w, grad_b)
        ctx.dtypes = hidden.dtype, weight.dtype, None if bias is None else bias.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        scale = grad_total.float()  # fp32 gradients scaled in place (no second [V, d]); the others cast on the way
        out = [None if g is None else g.mul_(scale) if g.dtype == dt else (g.float() * scale).to(dt)
               for g, dt in zip(ctx.saved_tensors, ctx.dtypes)]
        return out[0], out[1], out[2], None, None, None, None


# ---- The causal-LM loss, as transformers' ForCausalLMLoss computes it, chunked ---------------------------------------
def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
                    num_items_in_batch=None, chunk_size: int | None = DEFAULT_CHUNK) -> torch.Tensor:
    """transformers' causal-LM loss of ``hidden`` [B, T, d] through a head ``weight`` [V, d] (+ ``bias`` [V]): labels
    shifted by one, -100 ignored; the sum over target tokens divided by ``num_items_in_batch`` when given, else the
    mean. Gradients are computed only when autograd will want them (grad mode on, an input that requires grad)."""
    d = hidden.shape[-1]
    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, d)
    dev = flat.device.type  # the matmul's dtype: autocast's when it is on here (as lm_head's), else the weight's
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, weight, bias))
    chunk = int(chunk_size or max(1, len(flat)))  # None: every position in one chunk
    total = ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets, chunk, dtype, grads)
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def head_bias(head: torch.nn.Module) -> torch.Tensor | None:
    """The LM head's bias for the chunked loss: a tensor ``head.bias`` as it is; for a head padded the hook way
    (``labutils_real_vocab`` real rows), the dtype's lowest value on the padded rows; None when it has neither."""
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
    """A training call with labels: the transformer, then :func:`chunked_lm_loss` (no logits); else the class's."""
    if labels is None or not self.training or kwargs.get("inputs_embeds") is not None:
        return type(self).forward(self, input_ids, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    out = self.transformer(input_ids, **kwargs)
    head = self.lm_head
    loss = chunked_lm_loss(out.last_hidden_state, head.weight, labels, head_bias(head), num_items_in_batch,
                           self.labutils_loss_chunk)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=None, hidden_states=out.hidden_states,
                                             attentions=out.attentions)


def install(model, chunk_size: int | None = None):
    """Make ``model`` (a GPT2LMHeadModel) compute its training loss with :func:`chunked_lm_loss`: its instance
    ``forward`` is replaced (the class is untouched). Returns the model."""
    model.labutils_loss_chunk = int(chunk_size) if chunk_size else None  # None: the whole micro-batch, one chunk
    model.forward = types.MethodType(_training_forward, model)
    return model


def installed(model) -> bool:
    """Does ``model`` compute its training loss in chunks?"""
    fwd = model.__dict__.get("forward")
    return getattr(fwd, "__func__", None) is _training_forward
