"""Predict the memory of a training run before running it, and advise what fits (lab 04).

``estimate_memory(cfg)`` replays one training step of HF GPT-2 as a list of tensor allocations and frees, with
the sizes and dtypes that CUDA produces, and returns the peak and its parts. Nothing runs on a GPU: it is
arithmetic, a few milliseconds per configuration, for any GPT-2 size, on a laptop.

The accounting follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4.1): per block, the tensors autograd saves for backward. Their total for a GPT block is
``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations; HF GPT-2 under ``torch.autocast`` saves more, because:

* the residual stream stays FP32 (embeddings are FP32 and ``fp16 + fp32`` promotes), so LayerNorm inputs
  are 4 bytes per element, and LayerNorm itself runs in FP32 (CUDA autocast's float32 list);
* GPT-2's activation ``gelu_new`` is a Python expression, ``0.5*x*(1+tanh(c*(x+0.044715*x**3)))``: every
  intermediate that a multiplication needs is saved, and ``pow`` is on CUDA autocast's float32 list, so the
  whole chain after it is FP32: the MLP saves 67 bytes per token and hidden unit, Korthikanti counts 19;
* SDPA (flash / memory-efficient kernels) saves no ``a*s*s`` scores: q, k, v, the output and a log-sum-exp;
* the loss upcasts the logits ``[B, T, V]`` to FP32 and ``log_softmax`` saves an FP32 copy: with V = 50257
  this is often the largest single term, and its backward holds three such tensors at once;
* autocast caches a half-precision copy of each weight for the forward pass; the copies that matmuls save
  live until their backward (all blocks' copies while the loss is computed, even with checkpointing).

Master weights, gradients and AdamW's two moments are FP32 in every precision: 4 + 4 + 8 = 16 bytes per
parameter. ``device="cpu"`` switches to the CPU kernels' behaviour (float dropout masks, math attention when
dropout is on, CPU autocast's op lists, the unfused AdamW) so the same replay can be checked against the CPU
tracker on a machine without a GPU; the CUDA prediction itself can only be checked on a GPU.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, replace

from .models import N_POSITIONS, PRESETS, vocab_size

GiB, MiB = 2**30, 2**20
CUDA_CONTEXT_BYTES = int(0.5 * GiB)   # CUDA context + kernels outside PyTorch's allocator (typical 0.3-0.6 GiB)
HEADROOM = 0.10                       # allocator rounding / fragmentation: reserved is usually 5-15 % above peak
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8   # cuBLAS default workspace per (handle, stream)
# How the advisor ranks precisions: no built-in numbers (the design's "2.2x" is claim C2, tested in lab 01). A speed
# source gives {precision: throughput relative to fp32} and says where it came from: lab 01's measurements on this
# GPU (measured_speeds), a peak table of the card, or nothing ("unknown": all precisions counted equal).
UNKNOWN_SPEEDS = "unknown: no measured or peak speeds for this GPU; precisions counted equal (ranked by memory, recompute and micro-batch size only)"
SATURATION_TOKENS = 1024              # micro-batch tokens at which a GPU reaches half of its throughput (assumed)


# ----------------------------------------------------------------------------------------------------------
# What a run looks like, in numbers
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Everything the estimate depends on. Built from a labutils Config by :func:`plan_from_config`."""
    model: str = "gpt2"
    seq: int = 128
    micro: int = 4
    accum: int = 1
    precision: str = "fp32"
    checkpointing: bool = False
    every_n: int = 1
    attn: str = "sdpa"          # sdpa | eager
    dropout: bool = True        # GPT-2's own 0.1 unless the config sets 0
    padded: bool = False        # batches with padding get a 4-D attention mask (no flash kernel)
    num_samples: int = 0        # the dataset lives on the device: 3 int64 tensors of num_samples x seq
    device: str = "cuda"        # cuda: predict CUDA; cpu: the CPU kernels (to check against the CPU tracker)
    workspace_bytes: int = 2 * CUBLAS_WORKSPACE_BYTES  # forward thread + autograd thread each get one

    @property
    def amp(self) -> bool:
        return self.precision in ("fp16", "bf16")

    @property
    def effective_batch(self) -> int:
        return self.micro * self.accum

    def layers_checkpointed(self) -> list[int]:
        n_layer = PRESETS[self.model][0]
        return list(range(0, n_layer, self.every_n)) if self.checkpointing else []


def plan_from_config(cfg, device: str = "cuda", **overrides) -> Plan:
    """A :class:`Plan` from a labutils Config; keyword overrides win (micro=, accum=, precision=, ...)."""
    t, d, m = cfg.train, cfg.data, cfg.model
    plan = Plan(model=m.name, seq=d.seq_length, micro=t.micro_batch_size, accum=t.accumulation_steps,
                precision=t.precision, checkpointing=t.gradient_checkpointing, every_n=t.checkpoint_every_n_layers,
                attn=m.attn_implementation, dropout=(m.dropout is None or m.dropout > 0), padded=not d.pack,
                num_samples=d.num_samples, device=device)
    return replace(plan, **overrides)


def parameter_count(model: str) -> int:
    n_layer, h, _ = PRESETS[model]
    return vocab_size(model) * h + N_POSITIONS * h + n_layer * (12 * h * h + 13 * h) + 2 * h


def _block_params(h: int) -> dict[str, int]:
    """Parameter tensors of one GPT2Block (Conv1D weights are [in, out])."""
    return {"ln_1.weight": h, "ln_1.bias": h, "attn.c_attn.weight": 3 * h * h, "attn.c_attn.bias": 3 * h,
            "attn.c_proj.weight": h * h, "attn.c_proj.bias": h, "ln_2.weight": h, "ln_2.bias": h,
            "mlp.c_fc.weight": 4 * h * h, "mlp.c_fc.bias": 4 * h, "mlp.c_proj.weight": 4 * h * h,
            "mlp.c_proj.bias": h}


# ----------------------------------------------------------------------------------------------------------
# The ledger: live tensors, current and peak bytes, by kind
# ----------------------------------------------------------------------------------------------------------
KINDS = ("weights", "grads", "optimizer", "activations", "logits", "half_weights", "temporaries", "data",
         "workspace")


class _Ledger:
    def __init__(self, round_to: int = 1):
        self.live: dict[str, tuple[int, str, bool]] = {}   # name -> (bytes, kind, saved for backward)
        self.by_kind: Counter = Counter()
        self.cur = self.peak = 0
        self.peak_kinds: dict = {}
        self.peak_phase = ""
        self.phase = ""
        self.timeline: list[tuple[str, int, int]] = []
        self.round_to = round_to

    def alloc(self, name: str, nbytes: float, kind: str = "temporaries", saved: bool = False) -> None:
        nbytes = int(math.ceil(nbytes / self.round_to) * self.round_to)
        if nbytes <= 0:
            return
        if name in self.live:
            raise AssertionError(f"estimator bug: {name} allocated twice")
        self.live[name] = (nbytes, kind, saved)
        self.cur += nbytes
        self.by_kind[kind] += nbytes
        if self.cur > self.peak:
            self.peak, self.peak_phase, self.peak_kinds = self.cur, self.phase, dict(self.by_kind)

    def free(self, *names: str) -> None:
        for name in names:
            if name in self.live:
                nbytes, kind, _ = self.live.pop(name)
                self.cur -= nbytes
                self.by_kind[kind] -= nbytes

    def free_prefix(self, prefix: str, saved_only: bool = False) -> None:
        self.free(*[n for n, (_, _, s) in self.live.items() if n.startswith(prefix) and (s or not saved_only)])

    def release(self, *names: str) -> None:
        """A Python reference goes away: the tensor is freed unless autograd saved it."""
        self.free(*[n for n in names if n in self.live and not self.live[n][2]])

    def rename(self, old: str, new: str, kind: str | None = None, saved: bool | None = None) -> None:
        nbytes, k, s = self.live.pop(old)
        self.by_kind[k] -= nbytes
        k = kind or k
        self.by_kind[k] += nbytes
        self.live[new] = (nbytes, k, s if saved is None else saved)

    def keep(self, name: str, kind: str = "activations") -> None:
        """A temporary turns out to be saved for backward."""
        self.rename(name, name, kind=kind, saved=True)

    def saved_bytes(self, kinds=("activations", "logits")) -> int:
        return sum(b for b, k, s in self.live.values() if s and k in kinds)

    def mark(self, label: str) -> None:
        self.timeline.append((label, self.cur, self.peak))


# ----------------------------------------------------------------------------------------------------------
# One training step of HF GPT-2, tensor by tensor
# ----------------------------------------------------------------------------------------------------------
class _Replay:
    def __init__(self, plan: Plan):
        self.p = plan
        self.L, self.h, self.a = PRESETS[plan.model]
        self.V = vocab_size(plan.model)
        self.B, self.T = plan.micro, plan.seq
        self.N = self.B * self.T
        self.cuda = plan.device == "cuda"
        amp = plan.amp
        self.c = 2 if amp else 4                          # matmul outputs (autocast: half; else fp32)
        # gelu_new's pow: float32 on CUDA autocast's list; CPU autocast leaves it in the input dtype
        self.e = 4 if (amp and self.cuda) else self.c
        if plan.attn == "eager":
            self.attn = "eager"
        elif self.cuda or not plan.dropout:
            self.attn = "flash"                           # flash / memory-efficient / CPU flash: no s*s scores
        else:
            self.attn = "math"                            # CPU SDPA with dropout: the math path, upcast to fp32
        self.ckpt = set(plan.layers_checkpointed())
        self.led = _Ledger(round_to=512 if self.cuda else 1)
        # Autograd adds a second gradient into its input buffer in place when it holds the only reference.
        # On CPU we compare with labutils' tracker, whose dispatch mode keeps extra references: every such
        # addition is then out of place, and the replay does the same so that the two can be compared.
        self.inplace_accumulate = self.cuda

    def _qkv_aliases(self) -> tuple[str, ...]:
        """Which of q', k', v' (the bmm operands of eager / math attention) are views of qkv, not copies."""
        if self.B != 1 or (self.attn == "math" and self.p.amp):
            return ()
        return ("v'",) if self.attn == "math" else ("q'", "k'", "v'")

    # dropout mask: CUDA native_dropout keeps a bool mask; the CPU kernel keeps a float mask of the input dtype
    def mask_bytes(self, input_bytes: int) -> int:
        return 1 if self.cuda else input_bytes

    # ---- parameters, gradients ---------------------------------------------------------------------------
    def half_copy(self, name: str, numel: int, block: int | None) -> None:
        """Autocast casts a weight once per forward and caches it; a matmul saves it for backward, except in a
        checkpointed block, whose copy only lives in the cache (until autocast exits)."""
        if not self.p.amp:
            return
        saved = block is None or block not in self.ckpt or getattr(self, "_recomputing", False)
        prefix = "" if saved else "cache."
        self.led.alloc(f"{prefix}w16.{name}", 2 * numel, "half_weights", saved=saved)

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(self, label: str) -> None:
        p, led, N, T, B, h, V = self.p, self.led, self.N, self.T, self.B, self.h, self.V
        led.phase = f"{label} forward"
        led.alloc("emb.inputs_embeds", 4 * N * h)              # alive until GPT2Model.forward returns
        led.alloc("emb.pos_ids", 8 * T, "activations", True)
        led.alloc("emb.pos_embeds", 4 * T * h)
        led.alloc("emb.sum", 4 * N * h)
        mask_saved = bool(self.ckpt)                            # checkpoint keeps its inputs, the mask too
        if p.attn == "eager":
            led.alloc("mask4d", 4 * B * T * T, "activations" if mask_saved else "temporaries", mask_saved)
        elif p.padded:
            led.alloc("mask4d", B * T * T, "activations" if mask_saved else "temporaries", mask_saved)
        if p.dropout:
            led.alloc("res.0", 4 * N * h, "activations", True)
            led.alloc("emb.drop_mask", self.mask_bytes(4) * N * h, "activations", True)
            led.free("emb.sum")
        else:
            led.rename("emb.sum", "res.0", "activations", True)
        for i in range(self.L):
            self.block_forward(i)
            if i in self.ckpt:                                  # checkpoint: only the block input survives
                led.free_prefix(f"h{i}.", saved_only=True)
        # final LayerNorm; GPT2Model.forward returns (its locals go), then the LM head and the loss
        led.phase = f"{label} forward: LM head and loss"
        led.alloc("lnf.stats", 8 * N, "activations", True)
        led.alloc("lnf.out", 4 * N * h)
        led.free("emb.inputs_embeds", "emb.pos_embeds")
        if not mask_saved:
            led.free("mask4d")
        if p.amp:
            self.half_copy("wte", V * h, None)
            led.alloc("lmh.in16", 2 * N * h, "activations", True)
        else:
            led.keep("lnf.out")
        led.alloc("logits", self.c * N * V, "logits")
        # ForCausalLMLoss: logits.float() (a copy under autocast), shift labels, cross_entropy = log_softmax + nll
        if p.amp:
            led.alloc("logits.fp32", 4 * N * V, "logits")
        led.alloc("labels.pad", 8 * B * (T + 1))
        led.alloc("labels.shift", 8 * N, "activations", True)
        led.alloc("log_softmax", 4 * N * V, "logits", True)
        led.free("logits.fp32", "labels.pad")
        led.free("logits")                                       # the model returns; only .loss is kept
        led.release("lnf.out")                                   # fp32: saved by lm_head instead
        led.free_prefix("cache.")                                # autocast exits: its cache is dropped

    def block_forward(self, i: int) -> None:
        """GPT2Block.forward: ln_1 -> attn (c_attn, SDPA, c_proj, dropout) -> add -> ln_2 -> mlp -> add.

        Tensors autograd saves live until backward; in a checkpointed block's forward nothing is saved, so the
        same tensors die as soon as the Python code drops them (``led.release``, a no-op for saved tensors)."""
        p, led, N, T, B, h, a, c, e = self.p, self.led, self.N, self.T, self.B, self.h, self.a, self.c, self.e
        x = f"h{i}."
        Nh, n, aTT = N * h, 4 * N * h, self.a * B * T * T
        recomputing = getattr(self, "_recomputing", False)
        S = recomputing or i not in self.ckpt                 # does autograd keep what it saves?
        A = "activations" if S else "temporaries"

        def save(name, nbytes):
            led.alloc(x + name, nbytes, A, S)

        def keep(name):
            if S:
                led.keep(x + name)

        def release(*names):
            led.release(*[x + nm for nm in names])

        save("ln1.stats", 8 * N)
        release("ln1.stats")
        led.alloc(x + "ln1.out", 4 * Nh)                        # fp32 (LayerNorm runs in fp32)
        self.half_copy(x + "c_attn", 3 * h * h, i)
        if p.amp:
            led.alloc(f"cache.b16.{x}c_attn", 2 * 3 * h, "half_weights")
            save("ln1.in16", 2 * Nh)
        else:
            keep("ln1.out")
        led.alloc(x + "qkv", 3 * c * Nh)
        release("ln1.in16")
        # --- attention
        if self.attn == "flash":
            keep("qkv")                                         # q, k, v are views of it; the kernel saves them
            lse_T = -(-T // 32) * 32 if (self.cuda and not p.amp) else T   # memory-efficient kernel pads to 32
            save("sdpa.lse", 4 * a * B * lse_T)
            if p.padded:
                save("sdpa.bias", c * B * T * T)                # bool mask converted to the query dtype
            save("attn.out", c * Nh)
            release("sdpa.lse", "sdpa.bias")
        else:
            # math / eager: q, k, v copied for bmm; scores [B, a, T, T] materialised and saved
            f = 4 if self.attn == "math" else c                 # CPU math SDPA upcasts half inputs to fp32
            # bmm needs [B*a, T, d] operands: a copy of the head views, except when B == 1 and no cast is
            # needed, where the reshape is a view of qkv (the math path scales q and k first: copies anyway)
            aliased = self._qkv_aliases()
            for t in ("q'", "k'", "v'"):
                if t not in aliased:
                    save(t, f * Nh)
            if aliased:
                keep("qkv")
            else:
                led.free(x + "qkv")
            led.alloc(x + "scores", f * aTT)
            soft = 4 if self.attn == "eager" else f              # eager: + fp32 mask promotes the scores to fp32
            if soft != f:
                led.alloc(x + "scores32", soft * aTT)
                led.free(x + "scores")
                led.rename(x + "scores32", x + "scores")
            save("probs", soft * aTT)
            led.free(x + "scores")
            if self.attn == "eager" and soft != c:
                led.alloc(x + "probs16", c * aTT)               # .type(value.dtype)
                if not p.dropout:
                    keep("probs16")
            pb = c if self.attn == "eager" else f
            if p.dropout:
                save("attn_drop.mask", self.mask_bytes(pb) * aTT)
                save("attn_drop.out", pb * aTT)
                led.free(x + "probs16")
            release("q'", "k'", "probs", "probs16", "attn_drop.mask")
            led.alloc(x + "attn.bmm", f * Nh)
            release("v'", "attn_drop.out", "qkv")
            if f != c:
                led.alloc(x + "attn.bmm16", c * Nh)
                led.free(x + "attn.bmm")
            save("attn.out", c * Nh)                            # transpose(1, 2).contiguous()
            led.free(x + "attn.bmm", x + "attn.bmm16")
        # --- output projection, dropout, residual
        self.half_copy(x + "attn.c_proj", h * h, i)
        if p.amp:
            led.alloc(f"cache.b16.{x}attn.c_proj", 2 * h, "half_weights")
        led.alloc(x + "attn.proj", c * Nh)
        release("attn.out")
        if p.dropout:
            save("resid1.mask", self.mask_bytes(c) * Nh)
            release("resid1.mask")
            led.alloc(x + "resid1.out", c * Nh)
            led.free(x + "attn.proj")
        release("qkv")                                          # GPT2Attention.forward returns
        led.alloc(x + "mid", 4 * Nh, A, S)                      # attn_output + residual: fp32
        led.release(x + "resid1.out", x + "attn.proj", x + "ln1.out")
        # --- MLP
        save("ln2.stats", 8 * N)
        release("ln2.stats")
        led.alloc(x + "ln2.out", 4 * Nh)
        self.half_copy(x + "mlp.c_fc", 4 * h * h, i)
        if p.amp:
            led.alloc(f"cache.b16.{x}mlp.c_fc", 2 * 4 * h, "half_weights")
            save("ln2.in16", 2 * Nh)
        else:
            keep("ln2.out")
        led.alloc(x + "fc", c * n)                              # c_fc output, gelu input
        release("ln2.in16")
        # gelu_new = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))
        save("gelu.half_x", c * n)
        if e != c:
            save("gelu.x32", e * n)                             # pow's autocast cast to fp32, saved by pow
        else:
            keep("fc")                                          # pow saves its input
        led.alloc(x + "gelu.t1", e * n)                         # pow
        release("gelu.x32")
        led.alloc(x + "gelu.t2", e * n)                         # * 0.044715
        led.free(x + "gelu.t1")
        led.alloc(x + "gelu.t3", e * n)                         # x + ...
        led.free(x + "gelu.t2")
        led.alloc(x + "gelu.t4", e * n)                         # * sqrt(2/pi)
        led.free(x + "gelu.t3")
        save("gelu.tanh", e * n)
        led.free(x + "gelu.t4")
        save("gelu.one_plus", e * n)
        release("gelu.tanh")
        led.alloc(x + "gelu.out", e * n)                        # half_x * one_plus: promotes to e
        release("gelu.half_x", "gelu.one_plus", "fc")           # NewGELUActivation.forward returns
        if e == c:
            keep("gelu.out")                                    # saved by c_proj's matmul
        else:
            save("mlp.proj_in16", c * n)                        # autocast's cast for c_proj
            led.free(x + "gelu.out")
        self.half_copy(x + "mlp.c_proj", 4 * h * h, i)
        if p.amp:
            led.alloc(f"cache.b16.{x}mlp.c_proj", 2 * h, "half_weights")
        led.alloc(x + "mlp.proj", c * Nh)
        release("gelu.out", "mlp.proj_in16")
        if p.dropout:
            save("resid2.mask", self.mask_bytes(c) * Nh)
            release("resid2.mask")
            led.alloc(x + "resid2.out", c * Nh)
            led.free(x + "mlp.proj")
        if not recomputing:                                     # recompute stops before the block output
            led.alloc(f"res.{i + 1}", 4 * Nh, "activations", True)
        led.release(x + "resid2.out", x + "mlp.proj", x + "ln2.out", x + "mid")

    # ---- backward --------------------------------------------------------------------------------------------
    def accumulate(self, buffer: str, incoming: str, inplace: bool | None = None) -> None:
        """A second gradient for the same tensor: added into autograd's input buffer."""
        led = self.led
        if self.inplace_accumulate if inplace is None else inplace:
            led.free(incoming)
            return
        nbytes, kind, _ = led.live[buffer]
        led.alloc(buffer + ".sum", nbytes, kind)
        led.free(buffer, incoming)
        led.rename(buffer + ".sum", buffer)

    def node(self, out=(), params=(), free=(), cast: bool = True) -> None:
        """One backward node: it allocates its outputs (input gradients, parameter gradients), then releases
        what it saved and the gradient it consumed; the parameter gradients then go on: a half copy's gradient
        is cast back to fp32, and AccumulateGrad keeps it (.grad is None) or adds it in place."""
        led, half, exist = self.led, cast and self.p.amp, self._grads_exist
        for name, nbytes, *kind in out:
            led.alloc(name, nbytes, *kind)
        for name, numel in params:
            if half:
                led.alloc("tmp.g16." + name, self.c * numel)
            elif exist:
                led.alloc("tmp.g32." + name, 4 * numel)
            else:
                led.alloc("grad." + name, 4 * numel, "grads")
        led.free(*free)
        for name, numel in params:
            if half:
                if exist:
                    led.alloc("tmp.g32." + name, 4 * numel)
                else:
                    led.alloc("grad." + name, 4 * numel, "grads")
                led.free("tmp.g16." + name)
            led.free("tmp.g32." + name)

    def backward(self, label: str, grads_exist: bool) -> None:
        p, led, N, h, V, c = self.p, self.led, self.N, self.h, self.V, self.c
        self._grads_exist = grads_exist
        led.phase = f"{label} backward: loss and LM head"
        NV, Nh = N * V, N * h
        self.node(out=[("g.nll", 4 * NV, "logits")], free=["labels.shift"])  # nll_loss: dense [N, V] fp32
        self.node(out=[("g.lsm", 4 * NV, "logits")], free=["g.nll", "log_softmax"])  # log_softmax backward
        if p.amp:
            self.node(out=[("g.logits", c * NV, "logits")], free=["g.lsm"])  # .float() backward: cast back
        else:
            led.rename("g.lsm", "g.logits")
        # lm_head: grad wrt its input and wrt the (tied) wte weight; the latter waits in autograd's input
        # buffer for the embedding's contribution at the very end of backward
        self.node(out=[("g.lnf16", c * Nh), ("tmp.gwte16", c * V * h)],
                  free=["g.logits", "lmh.in16", "w16.wte"] + ([] if p.amp else ["lnf.out"]))
        if p.amp:
            led.alloc("wte.buffer", 4 * V * h, "temporaries" if grads_exist else "grads")
            led.free("tmp.gwte16")
            self.node(out=[("g.lnf", 4 * Nh)], free=["g.lnf16"])
        else:
            led.rename("tmp.gwte16", "wte.buffer", "temporaries" if grads_exist else "grads")
            led.rename("g.lnf16", "g.lnf")
        self.node(out=[("g.res", 4 * Nh)], params=[("ln_f.weight", h), ("ln_f.bias", h)],
                  free=["g.lnf", "lnf.stats", f"res.{self.L}"], cast=False)
        for i in reversed(range(self.L)):
            led.phase = f"{label} backward: block {i}" + (" (recomputed)" if i in self.ckpt else "")
            if i in self.ckpt:
                self._recomputing = True
                self.block_forward(i)                           # recompute, under autocast again
                led.free_prefix("cache.")
                self._recomputing = False
            self.block_backward(i)
        led.phase = f"{label} backward: embeddings"
        if p.dropout:
            self.node(out=[("g.emb", 4 * Nh)], free=["g.res", "emb.drop_mask"])
            led.rename("g.emb", "g.res")
        self.node(out=[("g.wpe_in", 4 * self.T * h)])                       # the add's broadcast: sum over B
        ws = [("g.emb_ws", 4 * Nh + 16 * N)] if self.cuda else []          # CUDA: sorted ids, partial sums
        self.node(out=[("g.wte", 4 * V * h)] + ws, free=["res.0", "g.emb_ws"])  # embedding_dense_backward
        # the buffer holds lm_head's contribution: a fresh fp32 copy under autocast (added into in place),
        # a transposed view of the matmul's output in fp32 (so the sum is a new tensor)
        self.accumulate("wte.buffer", "g.wte", self.inplace_accumulate and p.amp)
        self.node(params=[("wpe", N_POSITIONS * h)], free=["g.wpe_in", "g.res", "emb.pos_ids", "mask4d"],
                  cast=False)
        if grads_exist:
            led.free("wte.buffer")                                          # .grad += buffer
        else:
            led.rename("wte.buffer", "grad.wte", "grads")
        led.free_prefix("g.")

    def _branch_grad(self, name: str, dropout_mask: str) -> str:
        """The residual gradient entering a branch: cast to the branch's dtype (fp32: the same tensor), then
        through the branch's output dropout. Returns the name of the gradient that reaches the branch."""
        g = "g.res"
        if self.c != 4:
            self.node(out=[(name, self.c * self.N * self.h)])
            g = name
        if self.p.dropout:
            self.node(out=[(name + "2", self.c * self.N * self.h)], free=[g if g != "g.res" else "", dropout_mask])
            g = name + "2"
        return g

    def block_backward(self, i: int) -> None:
        """GPT2Block backward, node by node, from the block output back to its input."""
        p, led, N, T, B, h, c, e = self.p, self.led, self.N, self.T, self.B, self.h, self.c, self.e
        x = f"h{i}."
        Nh, n, aTT = N * h, 4 * N * h, self.a * B * T * T
        node = self.node
        # residual add: the gradient goes on to the MLP branch, cast to its dtype (fp32: the same tensor)
        g = self._branch_grad("g.b", x + "resid2.mask")
        # mlp.c_proj (its input: the gelu output, cast to half under autocast)
        node(out=[("g.gelu_out", c * n)], params=[(x + "mlp.c_proj.weight", 4 * h * h), (x + "mlp.c_proj.bias", h)],
             free=[g if g != "g.res" else "", x + "mlp.proj_in16", x + "gelu.out", "w16." + x + "mlp.c_proj"])
        if e != c:
            node(out=[("g.prod", e * n)], free=["g.gelu_out"])
        else:
            led.rename("g.gelu_out", "g.prod")
        # gelu_new backward. Autograd runs the highest sequence number first, so the chain through tanh and
        # pow runs before `0.5 * x`, whose gradient waits in its input buffer meanwhile.
        # half_x * one_plus: grad * other (computed in the promoted dtype, cast to half_x's), grad * self
        if e != c:
            node(out=[("g.half_x32", e * n), ("g.half_x", c * n)])
            led.free("g.half_x32")
        else:
            node(out=[("g.half_x", c * n)])
        node(out=[("g.one_plus", e * n)], free=["g.prod", x + "gelu.half_x", x + "gelu.one_plus"])
        node(out=[("g.t", e * n)], free=["g.one_plus", x + "gelu.tanh"])  # tanh backward (1 + . passes on)
        node(out=[("g.s", e * n)], free=["g.t"])                           # * sqrt(2/pi)
        if e != c:                                                          # x + ...: x's share, in x's dtype
            node(out=[("g.xbuf", c * n)])
            node(out=[("g.m", e * n)], free=["g.s"])                       # * 0.044715
        else:                                                               # the same tensor goes to both
            led.rename("g.s", "g.xbuf")
            node(out=[("g.m", e * n)])
        # pow backward: grad * (3 * x.pow(2)): the C++ temporaries live until the end of the expression
        node(out=[("g.pow_t1", e * n), ("g.pow_t2", e * n), ("g.pow", e * n)],
             free=["g.pow_t1", "g.pow_t2", "g.m", x + "gelu.x32", x + "fc"])
        if e != c:
            node(out=[("g.pow16", c * n)], free=["g.pow"])                 # backward of the cast for pow
            self.accumulate("g.xbuf", "g.pow16")
        else:
            self.accumulate("g.xbuf", "g.pow")
        node(out=[("g.hx", c * n)], free=["g.half_x"])                    # 0.5 * x, at last
        self.accumulate("g.xbuf", "g.hx")
        # mlp.c_fc
        node(out=[("g.ln2_16", c * Nh)], params=[(x + "mlp.c_fc.weight", 4 * h * h), (x + "mlp.c_fc.bias", 4 * h)],
             free=["g.xbuf", x + "ln2.in16", x + "ln2.out", "w16." + x + "mlp.c_fc"])
        g = "g.ln2_16"
        if c != 4:
            node(out=[("g.ln2", 4 * Nh)], free=["g.ln2_16"])
            g = "g.ln2"
        node(out=[("g.mid_ln", 4 * Nh)], params=[(x + "ln_2.weight", h), (x + "ln_2.bias", h)],
             free=[g, x + "mid", x + "ln2.stats"], cast=False)
        self.accumulate("g.res", "g.mid_ln")                                # into the residual gradient
        # attention branch
        g = self._branch_grad("g.a", x + "resid1.mask")
        node(out=[("g.attn_out", c * Nh)], params=[(x + "attn.c_proj.weight", h * h), (x + "attn.c_proj.bias", h)],
             free=[g if g != "g.res" else "", "w16." + x + "attn.c_proj"])
        if self.attn == "flash":
            ws = [("g.sdpa_ws", 4 * Nh + 4 * self.a * N)] if self.cuda else []   # fp32 dq accumulator
            node(out=[("g.dq", c * Nh), ("g.dk", c * Nh), ("g.dv", c * Nh)] + ws,
                 free=["g.sdpa_ws", "g.attn_out", x + "attn.out", x + "sdpa.lse", x + "sdpa.bias", x + "qkv"])
            node(out=[("g.qkv", 3 * c * Nh)], free=["g.dq", "g.dk", "g.dv"])   # split backward: one [N, 3h]
        else:
            f = 4 if self.attn == "math" else c
            soft = 4 if self.attn == "eager" else f
            pb = c if self.attn == "eager" else f
            if f != c:
                node(out=[("g.bmm", f * Nh)], free=["g.attn_out"])
            else:
                led.rename("g.attn_out", "g.bmm")
            led.free(x + "attn.out")
            aliased = self._qkv_aliases()
            v_last = "v'" in aliased and "q'" not in aliased          # qkv was saved for v only
            node(out=[("g.probs", pb * aTT), ("g.v", f * Nh)],
                 free=["g.bmm", x + "v'", x + "attn_drop.out"] + ([x + "qkv"] if v_last else []))
            if p.dropout:
                node(out=[("g.probs2", pb * aTT)], free=["g.probs", x + "attn_drop.mask"])
            if soft != pb:
                node(out=[("g.probs32", soft * aTT)], free=["g.probs", "g.probs2"])
            node(out=[("g.scores", soft * aTT)],
                 free=["g.probs", "g.probs2", "g.probs32", x + "probs", x + "probs16"])
            node(out=[("g.q", f * Nh), ("g.k", f * Nh)], free=["g.scores", x + "q'", x + "k'", x + "qkv"])
            node(out=[("g.qkv", 3 * c * Nh)], free=["g.q", "g.k", "g.v"])
        # attn.c_attn
        node(out=[("g.ln1_16", c * Nh)],
             params=[(x + "attn.c_attn.weight", 3 * h * h), (x + "attn.c_attn.bias", 3 * h)],
             free=["g.qkv", x + "ln1.in16", x + "ln1.out", "w16." + x + "c_attn"])
        g = "g.ln1_16"
        if c != 4:
            node(out=[("g.ln1", 4 * Nh)], free=["g.ln1_16"])
            g = "g.ln1"
        node(out=[("g.in_ln", 4 * Nh)], params=[(x + "ln_1.weight", h), (x + "ln_1.bias", h)],
             free=[g, f"res.{i}", x + "ln1.stats"], cast=False)
        self.accumulate("g.res", "g.in_ln")                                 # into the residual gradient
        led.free_prefix(x)                                                  # nothing of the block is left
        led.free_prefix("cache.b16." + x)

    # ---- optimizer -------------------------------------------------------------------------------------------
    def param_groups(self) -> tuple[list[int], list[int]]:
        """Parameter sizes in labutils' two AdamW groups, in model.parameters() order: matrices (decayed), then
        biases and LayerNorm weights."""
        h = self.h
        decay, no_decay = [self.V * h, N_POSITIONS * h], []
        for _ in range(self.L):
            for name, numel in _block_params(h).items():
                (decay if name.endswith("weight") and not name.startswith("ln_") else no_decay).append(numel)
        return decay, no_decay + [h, h]

    def optimizer_step(self, label: str, first: bool) -> None:
        """Fused AdamW on CUDA updates in place. On CPU the single-tensor AdamW computes, per parameter,
        ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: two temporaries of the parameter's
        size, while the previous parameter's ``denom`` is still bound to the variable. State is created per
        group, just before that group's update."""
        led = self.led
        led.phase = f"{label} optimizer"
        for g, sizes in enumerate(self.param_groups()):
            if first:
                led.alloc(f"adamw.state{g}", 8 * sum(sizes), "optimizer")
                led.alloc(f"adamw.steps{g}", (512 if self.cuda else 4) * len(sizes), "optimizer")
            if not self.cuda:
                worst = max(2 * s + (sizes[i - 1] if i else 0) for i, s in enumerate(sizes))
                led.alloc("tmp.adam", 4 * worst)
                led.free("tmp.adam")
        led.free_prefix("grad.")                                # zero_grad(set_to_none=True)

    # ---- a whole run ---------------------------------------------------------------------------------------
    def run(self) -> _Ledger:
        p, led = self.p, self.led
        P = parameter_count(p.model)
        led.phase = "load"
        led.alloc("weights", 4 * P, "weights")
        if p.num_samples:
            led.alloc("dataset", 3 * 8 * p.num_samples * p.seq, "data")
        if self.cuda:
            led.alloc("cublas.workspace", p.workspace_bytes, "workspace")
        led.mark("start")
        for step in range(2):
            label = f"step {step}"
            led.alloc("window", p.accum * (3 * 8 * self.N + 8 * self.B), "data")
            for mb in range(min(p.accum, 2)):
                self.forward(label)
                led.mark(f"{label} after forward" + (f" (micro-batch {mb})" if p.accum > 1 else ""))
                self.backward(label, grads_exist=mb > 0)
                led.mark(f"{label} after backward" + (f" (micro-batch {mb})" if p.accum > 1 else ""))
            self.optimizer_step(label, first=step == 0)
            led.free("window")
            led.mark(f"{label} after optimizer step")
        return led


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------
def estimate_plan(plan: Plan) -> dict:
    """The estimate for a :class:`Plan` (see :func:`estimate_memory`)."""
    replay = _Replay(plan)
    led = replay.run()
    P = parameter_count(plan.model)
    # activations: what one micro-batch's forward leaves saved for backward (replayed once more to read it)
    probe = _Replay(plan)
    probe.forward("probe")
    acts = probe.led.saved_bytes()
    half = probe.led.saved_bytes(("half_weights",))
    kinds = {k: int(led.peak_kinds.get(k, 0)) for k in KINDS}
    return {
        "model": plan.model, "parameters": P, "device": plan.device,
        "precision": plan.precision, "micro_batch_size": plan.micro, "accumulation_steps": plan.accum,
        "seq_length": plan.seq, "gradient_checkpointing": plan.checkpointing,
        "checkpoint_every_n_layers": plan.every_n, "attn_implementation": plan.attn,
        "params_bytes": 4 * P, "grads_bytes": 4 * P,
        "optimizer_bytes": 8 * P,
        "activations_bytes": acts,                      # saved for backward by one micro-batch's forward
        "half_weights_bytes": half,                     # autocast's weight copies saved for backward
        "logits_bytes": 4 * replay.N * replay.V,        # one FP32 [B, T, V] tensor (the loss holds 2-3)
        "peak_bytes": led.peak,                         # compare with torch.cuda.max_memory_allocated()
        "peak_phase": led.peak_phase,
        "peak_breakdown": kinds,
        "resident_bytes": led.timeline[0][1],           # weights + dataset (+ workspace) before training
        "timeline": [{"label": lb, "bytes": cur, "peak": pk} for lb, cur, pk in led.timeline],
    }


def estimate_memory(cfg, device: str = "cuda", **overrides) -> dict:
    """Predicted memory of ``lu.run(cfg)`` in bytes: params/grads/optimizer/activations/peak and more.

    ``device="cuda"`` (default) predicts CUDA whatever machine this runs on; ``device="cpu"`` replays the CPU
    kernels instead, to compare with the CPU tracker. Overrides: micro=, accum=, precision=, checkpointing=,
    every_n=, seq=, padded=, dropout=, attn=, num_samples=.
    """
    return estimate_plan(plan_from_config(cfg, device=device, **overrides))


def activation_table(cfg=None, device: str = "cuda", **overrides) -> list[dict]:
    """What one transformer block saves for backward, tensor by tensor, in bytes per token (and per layer)."""
    plan = plan_from_config(cfg, device=device, **overrides) if cfg is not None else Plan(device=device, **overrides)
    plan = replace(plan, checkpointing=False)
    r = _Replay(plan)
    r.led.alloc("res.0", 4 * r.N * r.h, "activations", True)
    r.block_forward(0)
    rows = []
    for name, (nbytes, kind, saved) in r.led.live.items():
        if not saved or name == "res.1":
            continue
        what = name.split(".", 1)[1] if name.startswith("h0.") else "block input (residual, fp32)"
        rows.append({"tensor": what, "kind": kind, "bytes": nbytes, "bytes_per_token": nbytes / r.N,
                     "per_token_hidden": nbytes / (r.N * r.h)})
    return rows


def korthikanti_bytes_per_layer(model: str, seq: int, micro: int, flash: bool = True) -> int:
    """Korthikanti et al. 2022, eq. (1): s*b*h*(34 + 5*a*s/h) bytes per layer (16-bit activations)."""
    n_layer, h, a = PRESETS[model]
    return int(seq * micro * h * (34 + (0 if flash else 5 * a * seq / h)))


def fits(estimate: dict, budget_bytes: int, context_bytes: int = CUDA_CONTEXT_BYTES,
         headroom: float = HEADROOM) -> bool:
    """Fits if the allocator's peak plus headroom plus the CUDA context stays within the budget."""
    return estimate["peak_bytes"] * (1 + headroom) + context_bytes <= budget_bytes


def measured_speeds(gpu_name: str | None, mode: str = "full") -> tuple[dict, str] | None:
    """Lab 01's measured speed-ups vs fp32 (its precision_comparison table) when its results were recorded on
    ``gpu_name``; None otherwise. For :func:`recommend`'s ``speeds``."""
    from .results import read_results

    data = read_results("01-Mixed_Precision", mode) if gpu_name else None
    if not data or (data.get("env") or {}).get("gpu_name") != gpu_name:
        return None
    rows = (data.get("tables") or {}).get("precision_comparison") or []
    speeds = {r.get("run"): r.get("speedup_vs_fp32") for r in rows if r.get("status") == "ok"
              and isinstance(r.get("speedup_vs_fp32"), (int, float))}
    speeds.setdefault("fp32", 1.0)
    return speeds, f"measured by lab 01 on {gpu_name} ({data.get('env', {}).get('date') or 'date not recorded'})"


def peak_speeds(gpu_name: str | None) -> tuple[dict, str] | None:
    """Each precision's dense peak relative to fp32 on ``gpu_name`` (labutils.peaks): what the advisor ranks by
    when lab 01 has not measured this GPU. None when the card or its fp32 peak is unknown."""
    from .peaks import peak_tflops

    base = peak_tflops(gpu_name, "fp32") if gpu_name else None
    if not base:
        return None
    speeds = {p: (v / base if v else None) for p in ("fp32", "tf32", "fp16", "bf16")
              for v in [peak_tflops(gpu_name, p)]}
    return ({p: v for p, v in speeds.items() if v}, f"the dense peak TFLOP/s of {gpu_name} (labutils' peak table, "
            f"not a measurement: real speed-ups are smaller)")


def speed_source(gpu_name: str | None, mode: str = "full") -> tuple[dict, str] | None:
    """What the advisor ranks precisions by: lab 01's measurements on this GPU, else the card's peak table,
    else None (precisions counted equal)."""
    return measured_speeds(gpu_name, mode) or peak_speeds(gpu_name)


def relative_step_time(plan: Plan, speeds: dict | None = None) -> float:
    """A rough model for ranking: FLOPs per optimizer step / (precision speed x utilisation of the micro-batch).
    ``speeds``: {precision: throughput relative to fp32}; a precision it does not list counts as 1.0."""
    from .flops import flops_per_token

    tokens = plan.micro * plan.seq
    util = tokens / (tokens + SATURATION_TOKENS)
    recompute = plan.checkpointing and plan.every_n == 1
    flops = flops_per_token(plan.model, plan.seq, recompute=recompute)
    if plan.checkpointing and plan.every_n > 1:   # only some blocks recompute
        base = flops_per_token(plan.model, plan.seq)
        flops = base + (flops_per_token(plan.model, plan.seq, recompute=True) - base) / plan.every_n
    return plan.effective_batch * plan.seq * flops / ((speeds or {}).get(plan.precision) or 1.0) / util / 1e12


def candidate_plans(base: Plan, amp_dtype: str | None = None) -> list[Plan]:
    """Every (precision, checkpointing, micro x accum) with the same effective batch as ``base``."""
    eff = base.effective_batch
    if amp_dtype is None:
        amp_dtype = base.precision if base.amp else "bf16"
    full = "tf32" if base.precision == "tf32" else "fp32"
    micros = [m for m in range(eff, 0, -1) if eff % m == 0]
    out = []
    for precision in dict.fromkeys([full, amp_dtype]):
        for ckpt in (False, True):
            for m in micros:
                out.append(replace(base, precision=precision, checkpointing=ckpt, every_n=1, micro=m,
                                   accum=eff // m))
    return out


def recommend(cfg, budget_bytes: int, *, device: str = "cuda", amp_dtype: str | None = None,
              context_bytes: int = CUDA_CONTEXT_BYTES, headroom: float = HEADROOM,
              speeds: tuple[dict, str] | None = None, **overrides) -> dict:
    """The fastest configuration predicted to fit ``budget_bytes`` (a GPU's memory), keeping the config's
    effective batch (micro x accumulation) as the target. Returns the chosen candidate and all candidates.
    ``speeds``: ({precision: speed relative to fp32}, where it came from), e.g. :func:`measured_speeds` or a peak
    table of the card; without one precisions count equal and ``speed_source`` says so."""
    speed_map, speed_source = speeds if speeds else ({}, UNKNOWN_SPEEDS)
    base = plan_from_config(cfg, device=device, **overrides)
    rows = []
    for plan in candidate_plans(base, amp_dtype):
        est = estimate_plan(plan)
        ok = fits(est, budget_bytes, context_bytes, headroom)
        rows.append({"precision": plan.precision, "checkpointing": plan.checkpointing, "micro_batch": plan.micro,
                     "accum": plan.accum, "peak_bytes": est["peak_bytes"], "peak_phase": est["peak_phase"],
                     "fits": ok, "relative_time": relative_step_time(plan, speed_map)})
    fastest = min((r for r in rows if r["fits"]), key=lambda r: r["relative_time"], default=None)
    own_time = relative_step_time(base, speed_map)
    for r in rows:
        r["speedup_vs_config"] = own_time / r["relative_time"]
    return {"budget_bytes": int(budget_bytes), "context_bytes": int(context_bytes), "headroom": headroom,
            "effective_batch": base.effective_batch, "recommendation": fastest, "candidates": rows,
            "speed_source": speed_source,
            "config_fits": fits(estimate_plan(base), budget_bytes, context_bytes, headroom)}


def _amp_dtype(cfg) -> tuple[str, str | None]:
    """The mixed-precision dtype to advise: the config's own, else bf16 where this GPU has it, else fp16."""
    if cfg.train.precision in ("fp16", "bf16"):
        return cfg.train.precision, None
    from . import device as dev

    if dev.cuda_available():
        return ("bf16", None) if dev.bf16_support()[0] else ("fp16", "this GPU has no native bf16")
    return "bf16", "no GPU here; use fp16 on GPUs before Ampere: same memory"


def _gpu_name() -> str | None:
    from . import device as dev

    return dev.name() if dev.cuda_available() else None


def default_budget_bytes() -> tuple[int, str]:
    """The card to fit on: this GPU's memory, or the card it was told to behave like (``LAB_GPU_MEMORY_GB``);
    8 GiB without a GPU. ``fits`` then leaves room for the CUDA context itself."""
    from . import device as dev

    if dev.cuda_available():
        budget = dev.current_budget() or dev.card_budget(dev.budget_from_env())
        if budget:
            return int(budget["card_gib"] * GiB), f"this GPU ({dev.name()}) behaving like a {budget['card_gib']:g} GiB card"
        return dev.total_memory(), f"this GPU ({dev.name()})"
    return 8 * GiB, "no GPU here: an 8 GiB card"


def compare(estimate: dict, measured_peak: int | None, measured_start: int | None = None,
            device: str = "cuda") -> dict:
    """Estimate vs measurement. CUDA: absolute peaks (``torch.cuda.max_memory_allocated``, what decides an
    OOM). CPU: peaks above the start of the run, because the CPU tracker also counts every other CPU tensor
    that happens to be alive in the process (the estimate's start is weights + dataset)."""
    if device == "cuda" or measured_start is None:
        e, m, basis = estimate["peak_bytes"], measured_peak, "absolute peak"
    else:
        e, m, basis = estimate["peak_bytes"] - estimate["resident_bytes"], measured_peak - measured_start, \
            "peak above start"
    err = 100.0 * (e - m) / m if m else None
    return {"basis": basis, "estimated_bytes": e, "measured_bytes": m, "error_pct": err}


def largest_batch(cfg, budget_bytes: int, *, device: str = "cuda", safe: bool = True, limit: int = 4096,
                  context_bytes: int = CUDA_CONTEXT_BYTES, headroom: float = HEADROOM, **overrides) -> int:
    """The largest micro-batch predicted to fit: ``safe`` applies the CUDA context and the headroom
    (:func:`fits`); otherwise the raw allocator peak is compared with the budget."""
    def ok(b):
        e = estimate_memory(cfg, device=device, micro=b, **overrides)
        return fits(e, budget_bytes, context_bytes, headroom) if safe else e["peak_bytes"] <= budget_bytes

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# ----------------------------------------------------------------------------------------------------------
# CLI: python -m labutils estimate CONFIG [--set ...] [--gpu-memory-gb G] [--json PATH]
# ----------------------------------------------------------------------------------------------------------
def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def cli_estimate(cfg, args) -> int:
    from .cli import write_json

    start = time.perf_counter()
    if args.gpu_memory_gb is not None:
        budget, where = int(args.gpu_memory_gb * GiB), f"--gpu-memory-gb {args.gpu_memory_gb:g}"
    else:
        budget, where = default_budget_bytes()
    est = estimate_memory(cfg)
    amp, amp_note = _amp_dtype(cfg)
    advice = recommend(cfg, budget, amp_dtype=amp, speeds=speed_source(_gpu_name()))
    t = cfg.train
    print(f"{cfg.model.name} ({est['parameters'] / 1e6:.1f}M parameters), {t.precision}, micro-batch "
          f"{t.micro_batch_size} x accumulation {t.accumulation_steps} x {cfg.data.seq_length} tokens, "
          f"checkpointing {'every ' + str(t.checkpoint_every_n_layers) if t.gradient_checkpointing else 'off'}, "
          f"{cfg.model.attn_implementation} attention -- predicted for CUDA")
    rows = [("params (fp32 master weights)", est["params_bytes"]),
            ("grads (fp32)", est["grads_bytes"]),
            ("optimizer (AdamW exp_avg + exp_avg_sq)", est["optimizer_bytes"]),
            ("activations (saved by one micro-batch)", est["activations_bytes"]),
            ("  of which log_softmax(logits) fp32", est["logits_bytes"]),
            ("half weight copies (autocast, saved)", est["half_weights_bytes"]),
            ("peak (torch.cuda.max_memory_allocated)", est["peak_bytes"])]
    w = max(len(r[0]) for r in rows)
    for name, n in rows:
        print(f"  {name:<{w}}  {_gib(n):>10}")
    print(f"  peak happens during: {est['peak_phase']}; at the peak: " +
          ", ".join(f"{k} {_gib(v)}" for k, v in est["peak_breakdown"].items() if v > 0))
    usable = budget - CUDA_CONTEXT_BYTES
    print(f"budget: {_gib(budget)} ({where}); fits if peak x {1 + HEADROOM:.2f} <= {_gib(usable)} "
          f"(budget minus {_gib(CUDA_CONTEXT_BYTES)} CUDA context)")
    print(f"this config: {'fits' if advice['config_fits'] else 'does NOT fit'}")
    rec = advice["recommendation"]
    if rec:
        print(f"recommendation (fastest predicted to fit, effective batch {advice['effective_batch']}): "
              f"{rec['precision']}, checkpointing {'on' if rec['checkpointing'] else 'off'}, micro-batch "
              f"{rec['micro_batch']} x accumulation {rec['accum']}: peak {_gib(rec['peak_bytes'])}"
              + (f", ~{rec['speedup_vs_config']:.2f}x the config's speed (rough model)"
                 if rec.get("speedup_vs_config") else "")
              + f"; precision speeds: {advice['speed_source']}"
              + (f" [{amp_note}]" if amp_note and rec["precision"] == amp else ""))
    else:
        smallest = min(advice["candidates"], key=lambda r: r["peak_bytes"])
        print(f"recommendation: nothing fits with this effective batch; the smallest peak is "
              f"{_gib(smallest['peak_bytes'])} ({smallest['precision']}, checkpointing "
              f"{'on' if smallest['checkpointing'] else 'off'}, micro-batch {smallest['micro_batch']}). "
              f"Shorter sequences, a smaller model, LoRA, an 8-bit optimizer or ZeRO offload are the next steps.")
    from .distributed import zero_table  # beyond one GPU: what ZeRO sharding leaves on each GPU

    zero = zero_table(est["parameters"], est["activations_bytes"], getattr(args, "gpus", 8),
                      mixed_precision=t.precision in ("fp16", "bf16"))
    print(f"per GPU with data parallelism / ZeRO (model state {'2P+2P+12P' if t.precision in ('fp16', 'bf16') else '4P+4P+8P'}"
          f" sharded, plus this micro-batch's activations):")
    cols = list(zero[0])
    print("  " + "".join(f"{c:>22}" if i == 0 else f"{c:>10}" for i, c in enumerate(cols)))
    for r in zero:
        print("  " + "".join(f"{r[c]:>22}" if i == 0 else f"{_gib(r[c]):>10}" for i, c in enumerate(cols)))
    if args.json:
        out = {k: est[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                   "peak_bytes")}
        out["zero_per_gpu"] = zero
        out.update(estimate=est, recommendation=rec, budget_bytes=budget, config_fits=advice["config_fits"],
                   candidates=advice["candidates"], config=cfg.to_dict())
        write_json(args.json, out)
        print(f"wrote {args.json}")
    print(f"({time.perf_counter() - start:.2f} s)")
    return 0

