"""FLOPs of a training step of any transformers causal LM (its :class:`labutils.models.spec.ModelSpec`), the attention
kernel that runs it, and the MFU / HFU of a run: :func:`model_flops_per_token` (PaLM's 6N + 12LTd, MFU's numerator);
:func:`flops_per_token`, what the GPU executes (checkpointing's and fused attention's recompute: HFU);
:func:`attention_kernel`, the SDPA kernel torch would choose, :class:`AttentionProbe` the one that ran (profiler ops,
right under torch.compile too); :func:`account_flops` fills a finished run's TFLOP/s, MFU and HFU (``lu.train``). Counts
are checked against ``torch.utils.flop_counter.FlopCounterMode`` (tests/test_flops.py, test_other_models.py)."""
from __future__ import annotations

import os

import torch

from . import device as dev
from ..models.spec import spec_of
from ..models.gpt2 import CAUSAL_SDPA, padded_vocab_size
from .peaks import peak_tflops
from .precisions import get


def model_flops_per_token(model, seq_length: int, vocab: int | None = None) -> float:
    """Model FLOPs per token of one training step (forward + backward), no recompute: the numerator of MFU, for
    ``model`` (a preset's name, a config or a model: :func:`labutils.models.spec.spec_of`). PaLM's definition (Chowdhery
    et al. 2022, appendix B): 6N + 12 * L * T * d, N the matmul weights (blocks, LM head), 12 * L * T * d the two T x T
    attention matmuls; biases, norms, activations, softmax, embeddings left out, as torch's FLOP counter does.
    ``vocab``: the LM head's rows (default: the real vocabulary)."""
    s = spec_of(model)
    blocks = s.n_layer * (s.block_matmul_weights + 2 * seq_length * s.attn_width)  # one forward's multiply-adds
    head = s.d_model * (vocab or s.vocab)
    return 6 * (blocks + head)


def recomputed_flops_per_token(model, seq_length: int, every_n_layers: int = 1, dropout: bool = True) -> float:
    """FLOPs per token that non-reentrant activation checkpointing re-runs in backward (0 with none).

    Each checkpointed block (0, k, 2k, ... for ``every_n_layers=k``) re-runs its forward up to the last tensor backward
    needs: with ``dropout`` (GPT-2's 0.1, drawn after the MLP's c_proj) the whole forward, else all but c_proj."""
    s = spec_of(model)
    checkpointed = len(range(0, s.n_layer, every_n_layers))
    forward = 2 * (s.block_matmul_weights + 2 * seq_length * s.attn_width)  # one block's forward matmuls
    skipped = 0 if dropout else 2 * s.d_ff * s.d_model    # MLP output projection: not re-run (early stop)
    return checkpointed * (forward - skipped)


def causal_score_fraction(seq_length: int) -> float:
    """The share of the T x T attention scores a causal kernel computes, (T + 1) / 2T: fused kernels with
    ``is_causal=True`` skip the tiles above the diagonal."""
    return (seq_length + 1) / (2 * seq_length)


def flops_per_token(model, seq_length: int, recompute: bool = False, *, every_n_layers: int = 1,
                    dropout: bool = True, fused_attention: bool = False, causal_skip: bool = False,
                    vocab: int | None = None) -> float:
    """Executed training FLOPs per position (forward + backward + recompute): what the GPU really computes.
    ``recompute``: checkpointing every ``every_n_layers``-th block (:func:`recomputed_flops_per_token`);
    ``fused_attention``: SDPA's fused kernels recompute the T x T scores in backward (2 * T * d per layer and token);
    ``causal_skip``: a fused kernel with ``is_causal=True`` computes only :func:`causal_score_fraction` of the scores
    (HFU; torch's counter counts them all); ``vocab``: the LM head's rows. Neither: :func:`model_flops_per_token`."""
    s = spec_of(model)
    n_layer, d = s.n_layer, s.attn_width
    flops = model_flops_per_token(s, seq_length, vocab)
    attention = n_layer * 12 * seq_length * d  # the attention matmuls inside model_flops_per_token
    if fused_attention:
        attention += n_layer * 2 * seq_length * d
        flops += n_layer * 2 * seq_length * d
    if recompute:
        flops += recomputed_flops_per_token(s, seq_length, every_n_layers, dropout)
        attention += len(range(0, n_layer, every_n_layers)) * 4 * seq_length * d
    if causal_skip:
        flops -= attention * (1 - causal_score_fraction(seq_length))
    return flops


# torch's SDPBackend enum (torch/nn/attention/__init__.py): what _fused_sdp_choice returns. On Hopper with the
# cuDNN that torch 2.14 ships, SDPA prefers cuDNN attention over flash: it is named as such, never "flash".
_SDPA_KERNELS = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN", 4: "overrideable"}


def attention_kernel(model, seq_length: int, padded: bool, precision: str = "fp32",
                     device: torch.device | str = "cpu") -> str:
    """Which kernel ``scaled_dot_product_attention`` picks for this model's attention in a training step.

    Asks torch's own dispatcher (``torch._fused_sdp_choice``) with tensors shaped as transformers hands them over, in
    the autocast dtype; with padding, a boolean mask and ``is_causal=False``; the attention dropout while training.
    On CUDA the flash kernel takes no mask; on the CPU its flash kernel takes no dropout."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", "sdpa")
    if impl == CAUSAL_SDPA:
        padded = False  # labutils' causal SDPA never passes a mask
    elif impl != "sdpa":
        return f"{cfg._attn_implementation} (not SDPA)"
    device = torch.device(device)
    dtype = get(precision).dtype
    s = spec_of(model)
    q = torch.empty(1, s.n_head, seq_length, s.head_dim, dtype=dtype, device=device)
    mask = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device) if padded else None
    dropout = getattr(cfg, "attn_pdrop", getattr(cfg, "attention_dropout", 0.0))  # GPT-2's name; Llama's
    dropout = float(dropout or 0.0) if model.training else 0.0
    kernel = _SDPA_KERNELS.get(int(torch._fused_sdp_choice(q, q, q, mask, dropout, not padded)), "unknown")
    return f"{kernel} (CPU kernel)" if device.type == "cpu" and kernel == "flash" else kernel


FUSED_KERNELS = ("flash", "memory-efficient", "cuDNN")  # SDPA kernels that recompute the scores in backward

# The aten op each SDPA kernel dispatches to, as the profiler names it (eager and compiled code call the same ops).
# Each op's argument holding the mask (flash takes none): an input shape there means a mask was passed.
_KERNEL_OPS = {"aten::_scaled_dot_product_flash_attention": ("flash", None),
               "aten::_scaled_dot_product_flash_attention_for_cpu": ("flash (CPU kernel)", 5),
               "aten::_scaled_dot_product_efficient_attention": ("memory-efficient", 3),
               "aten::_scaled_dot_product_cudnn_attention": ("cuDNN", 3),
               "aten::_scaled_dot_product_attention_math": ("math", 3),
               "aten::_scaled_dot_product_fused_attention_overrideable": ("overrideable", 3)}


class AttentionProbe:
    """Which SDPA kernel really ran inside the ``with`` block, read from ``torch.profiler``'s CPU-side aten ops (the
    same names eager or compiled). ``.kernel``: "flash", "memory-efficient", "cuDNN", "math", "flash (CPU kernel)"; "...
    (masked)" when it got a mask; "eager (not SDPA)" when no SDPA op ran; None before the block ends, or when another
    profiler already runs (kineto holds one session at a time). Wrap one warm-up micro-batch."""

    def __init__(self):
        self.kernel, self.ops, self._prof = None, [], None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        # kineto prints C++ progress lines (USDT profiler_start / profiler_stop) into every notebook cell that trains
        # unless its log level is set before the process's first profiler: this probe is usually that first one
        os.environ.setdefault("KINETO_LOG_LEVEL", "10")
        if not torch.autograd._profiler_enabled():
            self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self._prof is None:
            return False
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.ops = [(e.name, e.input_shapes) for e in self._prof.events() if e.name in _KERNEL_OPS]
            self.kernel = kernel_from_ops(self.ops)
        self._prof = None
        return False


def kernel_from_ops(ops) -> str:
    """The kernel named by profiled SDPA ops [(aten op name, input shapes)]: see :class:`AttentionProbe`."""
    if not ops:
        return "eager (not SDPA)"
    names = []
    for name, shapes in ops:
        kernel, mask_arg = _KERNEL_OPS[name]
        masked = mask_arg is not None and len(shapes) > mask_arg and bool(shapes[mask_arg])
        names.append(kernel + (" (masked)" if masked else ""))
    return max(set(names), key=names.count)  # every layer runs the same kernel; the most common if not


def account_flops(result, cfg, seq_length: int, device: torch.device, n_timed: int, model=None) -> None:
    """Achieved TFLOP/s, MFU and HFU of a finished run (a :class:`labutils.core.train.RunResult`, filled in place), over
    its last ``n_timed`` (timed) steps at ``seq_length`` of ``model`` (the one trained: its spec, its LM head's rows;
    None: ``cfg``'s preset, its vocabulary padded as the config says)."""
    t, m = cfg.train, cfg.model
    spec = spec_of(model if model is not None else m.name)
    rows = model.config.vocab_size if model is not None else padded_vocab_size(spec.vocab, m.pad_vocab_to)
    kernel = result.attention_kernel or "flash"
    fused = device.type == "cuda" and m.attn_implementation in ("sdpa", CAUSAL_SDPA) and \
        kernel.split()[0] in FUSED_KERNELS
    # HFU: a fused kernel with is_causal=True and no mask skips the scores above the diagonal (flash never takes a
    # mask; the others say "(masked)" when they got one, see AttentionProbe)
    executed = flops_per_token(spec, seq_length, recompute=t.gradient_checkpointing,
                               every_n_layers=t.checkpoint_every_n_layers, dropout=m.dropout is None or m.dropout > 0,
                               fused_attention=fused, causal_skip=fused and "masked" not in kernel, vocab=rows)
    targets = result.target_tokens[-n_timed:]
    step = result.step_time_seconds  # the median timed step: the one step time every speed reads
    result.model_flops_per_step = model_flops_per_token(spec, seq_length) * sum(targets) / len(targets)
    result.executed_flops_per_step = executed * result.tokens_per_step
    result.achieved_tflops = executed * result.tokens_per_second / 1e12
    peak = peak_tflops(dev.name(device), t.precision) if dev.is_cuda(device) else None
    if peak is not None:
        result.peak_tflops = peak
        total = peak * 1e12 * result.env.get("world_size", 1)  # every process's GPU
        result.mfu = result.model_flops_per_step / step / total
        result.hfu = result.executed_flops_per_step / step / total
