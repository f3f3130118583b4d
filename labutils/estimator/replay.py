"""One training step of HF GPT-2, replayed as tensor allocations and frees: the engine of :mod:`labutils.estimator.estimate`.

:class:`Replay` walks a step as PyTorch runs it (forward, loss, backward node by node, AdamW), with the sizes and
dtypes CUDA produces, booking every tensor in a :class:`Ledger` (live bytes and peak, by kind). Arithmetic only.
It follows Korthikanti et al. 2022 (§4.1: ``s*b*h*(34 + 5*a*s/h)`` bytes saved per block with 16-bit activations);
HF GPT-2 under ``torch.autocast`` saves more: the residual stream and LayerNorm stay FP32; ``gelu_new``'s ``pow`` is
on autocast's float32 list (67 bytes per token and hidden unit in the MLP, not 19); SDPA's fused kernels save no
``a*s*s`` scores (q, k, v, the output, a log-sum-exp); the loss's FP32 logits ``[B, T, V]``
(:mod:`labutils.estimator.replay_loss`), often the largest term; autocast's cached half weight copies until backward.
Master weights, gradients and AdamW's moments are FP32 in every precision: 16 bytes per parameter. ``device="cpu"``
switches to the CPU kernels' behaviour (float dropout masks, math attention under dropout, CPU autocast's lists, the
unfused AdamW), so the replay can be checked against the CPU tracker without a GPU.
"""
from __future__ import annotations

from ..models.spec import gpt2_only
from ..models.gpt2 import CAUSAL_SDPA, FAST_GELU, padded_vocab_size
from .replay_attention import AttentionReplay
from .replay_ledger import Ledger
from .replay_loss import LossReplay

CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8   # cuBLAS default workspace per (handle, stream)


def cublas_workspace_bytes(major: int | None = None) -> int:
    """torch's default cuBLAS workspace per (handle, stream) on a GPU of compute capability ``major``
    (``CublasHandlePool.cpp``): 8.125 MiB before Hopper, 32 MiB from 9.x on. None: taken as pre-Hopper."""
    return 32 * 2**20 if major is not None and major >= 9 else CUBLAS_WORKSPACE_BYTES


class Replay(AttentionReplay, LossReplay):
    """HF GPT-2 training steps for one ``plan`` (a :class:`labutils.estimator.estimate.Plan`), booked tensor by tensor
    in ``self.led`` (a :class:`Ledger`). :meth:`run` replays two optimizer steps of up to two micro-batches each (the
    later ones with AdamW's state and ``.grad`` allocated) and returns the ledger; :meth:`forward` and
    :meth:`block_forward` alone give what a forward leaves saved for backward."""

    def __init__(self, plan):
        self.p = plan
        spec = gpt2_only("labutils.estimator.estimate", plan.model)  # its op-by-op replay is GPT-2's
        self.L, self.h, self.a, self.V_real, self.n_pos = spec.n_layer, spec.d_model, spec.n_head, spec.vocab, \
            spec.n_positions
        self.V = padded_vocab_size(self.V_real, plan.pad_vocab_to)   # the LM head's (and wte's) rows
        self.fast_gelu = plan.activation == FAST_GELU
        # a 4-D mask reaches SDPA only through transformers' sdpa path with padded batches; sdpa_causal takes none
        self.masked = plan.padded and plan.attn not in ("eager", CAUSAL_SDPA)
        self.B, self.T = plan.micro, plan.seq
        self.N = self.B * self.T
        self.cuda = plan.device == "cuda"
        self.chunked = plan.loss == "chunked"            # model.loss: the logits a chunk of positions at a time
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
        self.ckpt = set(range(0, self.L, plan.every_n)) if plan.checkpointing else set()   # checkpointed blocks
        self.led = Ledger(round_to=512 if self.cuda else 1)
        # Autograd adds a second gradient into its input buffer in place when it holds the only reference; on CPU
        # the tracker's dispatch mode keeps extra references, so there every such addition is out of place.
        self.inplace_accumulate = self.cuda
        self._recomputing = False                         # backward re-runs a checkpointed block's forward
        self.grads_exist = False                          # a later micro-batch: .grad is allocated already

    def mask_bytes(self, input_bytes: int) -> int:
        """Dropout mask: CUDA native_dropout keeps a bool one; the CPU kernel a float one of the input dtype."""
        return 1 if self.cuda else input_bytes

    # ---- parameters, gradients ---------------------------------------------------------------------------
    def half_copy(self, name: str, numel: int, block: int | None, bias: int = 0) -> None:
        """Autocast casts a weight (and its ``bias`` elements) once per forward and caches it; a matmul saves it for
        backward, except in a checkpointed block, whose copy only lives in the cache (until autocast exits)."""
        if not self.p.amp:
            return
        saved = block is None or block not in self.ckpt or self._recomputing
        prefix = "" if saved else "cache."
        self.led.alloc(f"{prefix}w16.{name}", 2 * numel, "half_weights", saved=saved)
        if bias:
            self.led.alloc(f"cache.b16.{name}", 2 * bias, "half_weights")

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(self, label: str) -> None:
        p, led, N, T, B, h = self.p, self.led, self.N, self.T, self.B, self.h
        led.phase = f"{label} forward"
        led.alloc("emb.inputs_embeds", 4 * N * h)              # alive until GPT2Model.forward returns
        led.alloc("emb.pos_ids", 8 * T, "activations", True)
        led.alloc("emb.pos_embeds", 4 * T * h)
        led.alloc("emb.sum", 4 * N * h)
        mask_saved = bool(self.ckpt)                            # checkpoint keeps its inputs, the mask too
        if p.attn == "eager" or self.masked:                    # eager: a float mask; SDPA: a bool one
            led.alloc("mask4d", (4 if p.attn == "eager" else 1) * B * T * T,
                      "activations" if mask_saved else "temporaries", mask_saved)
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
        self.head_and_loss_forward()

    def block_forward(self, i: int) -> None:
        """GPT2Block.forward: ln_1 -> attn (c_attn, SDPA, c_proj, dropout) -> add -> ln_2 -> mlp -> add. In a
        checkpointed block nothing is saved, so tensors die as soon as the code drops them (``led.release``)."""
        p, led, N, h, c, e = self.p, self.led, self.N, self.h, self.c, self.e
        x = f"h{i}."
        Nh, n = N * h, 4 * N * h
        recomputing = self._recomputing
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
        self.half_copy(x + "c_attn", 3 * h * h, i, bias=3 * h)
        if p.amp:
            save("ln1.in16", 2 * Nh)
        else:
            keep("ln1.out")
        led.alloc(x + "qkv", 3 * c * Nh)
        release("ln1.in16")
        self.attention_forward(i, save, keep, release)  # --- attention
        self.half_copy(x + "attn.c_proj", h * h, i, bias=h)  # --- output projection, dropout, residual
        led.alloc(x + "attn.proj", c * Nh)
        release("attn.out")
        if p.dropout:
            save("resid1.mask", self.mask_bytes(c) * Nh)
            release("resid1.mask")
            led.alloc(x + "resid1.out", c * Nh)
            led.free(x + "attn.proj")
        release("qkv")                                          # GPT2Attention.forward returns
        led.alloc(x + "mid", 4 * Nh, A, S)                      # attn_output + residual: fp32
        led.release(x + "ln1.out")         # attn_output (resid1.out / attn.proj) stays bound until the block returns
        save("ln2.stats", 8 * N)  # --- MLP
        release("ln2.stats")
        led.alloc(x + "ln2.out", 4 * Nh)
        self.half_copy(x + "mlp.c_fc", 4 * h * h, i, bias=4 * h)
        if p.amp:
            save("ln2.in16", 2 * Nh)
        else:
            keep("ln2.out")
        led.alloc(x + "fc", c * n)                              # c_fc output, gelu input
        release("ln2.in16")
        if self.fast_gelu:                                      # gelu(x, approximate="tanh"): one kernel
            keep("fc")                                          # saves only its input (derivatives.yaml)
            led.alloc(x + "gelu.out", c * n)                    # input dtype: on no autocast list
            keep("gelu.out")                                    # saved by c_proj's matmul
            release("fc")
        else:
            # gelu_new = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))
            save("gelu.half_x", c * n)
            if e != c:
                save("gelu.x32", e * n)                             # pow's autocast cast to fp32, saved by pow
            else:
                keep("fc")                                          # pow saves its input
            # pow, * 0.044715, x + ..., * sqrt(2/pi): each temporary frees the one before
            for k, before in enumerate(("gelu.x32", "gelu.t1", "gelu.t2", "gelu.t3"), 1):
                led.alloc(f"{x}gelu.t{k}", e * n)
                release(before)
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
        self.half_copy(x + "mlp.c_proj", 4 * h * h, i, bias=h)
        led.alloc(x + "mlp.proj", c * Nh)
        release("gelu.out", "mlp.proj_in16")
        if p.dropout:
            save("resid2.mask", self.mask_bytes(c) * Nh)
            release("resid2.mask")
            led.alloc(x + "resid2.out", c * Nh)
            led.free(x + "mlp.proj")
        if not recomputing:                                     # recompute stops before the block output
            led.alloc(f"res.{i + 1}", 4 * Nh, "activations", True)
        led.release(x + "resid2.out", x + "mlp.proj", x + "ln2.out", x + "mid", x + "resid1.out", x + "attn.proj")

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
        """One backward node: allocates its outputs (input and parameter gradients), releases what it saved and the
        gradient it consumed; a half copy's gradient is cast to fp32; AccumulateGrad keeps it or adds it in place."""
        led, half, exist = self.led, cast and self.p.amp, self.grads_exist

        def fp32_grad(name, numel):  # .grad exists: a temporary, added into it in place; else it becomes .grad
            led.alloc(("tmp.g32." if exist else "grad.") + name, 4 * numel, "temporaries" if exist else "grads")
        for name, nbytes, *kind in out:
            led.alloc(name, nbytes, *kind)
        for name, numel in params:
            if half:
                led.alloc("tmp.g16." + name, self.c * numel)
            else:
                fp32_grad(name, numel)
        led.free(*free)
        for name, numel in params:
            if half:
                fp32_grad(name, numel)
                led.free("tmp.g16." + name)
            led.free("tmp.g32." + name)

    def backward(self, label: str, grads_exist: bool) -> None:
        p, led, h, V = self.p, self.led, self.h, self.V
        self.grads_exist = grads_exist
        led.phase = f"{label} backward: loss and LM head"
        Nh = self.N * h
        if self.chunked:
            self.chunked_loss_backward()
        else:
            self.full_loss_backward()
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
        ws = [("g.emb_ws", 4 * Nh + 16 * self.N)] if self.cuda else []     # CUDA: sorted ids, partial sums
        self.node(out=[("g.wte", 4 * V * h)] + ws, free=["res.0", "g.emb_ws"])  # embedding_dense_backward
        # the buffer holds lm_head's contribution: a fresh fp32 copy under autocast (added into in place),
        # a transposed view of the matmul's output in fp32 (so the sum is a new tensor); the chunked loss's is
        # its own fp32 accumulator (added into in place)
        self.accumulate("wte.buffer", "g.wte", self.inplace_accumulate and (p.amp or self.chunked))
        self.node(params=[("wpe", self.n_pos * h)], free=["g.wpe_in", "g.res", "emb.pos_ids", "mask4d"], cast=False)
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

    def _layernorm_grad(self, name: str, ln: str, out: str, saved: list[str]) -> None:
        """A branch's gradient leaves through its LayerNorm: the gradient of the LayerNorm's output, ``name``
        (``name + "_16"`` under autocast, then cast back to fp32), goes through the fp32 LayerNorm (its weight
        and bias gradients; ``saved`` freed) and is added into the residual gradient as ``out``."""
        g = name + "_16"
        if self.c != 4:
            self.node(out=[(name, 4 * self.N * self.h)], free=[g])
            g = name
        self.node(out=[(out, 4 * self.N * self.h)], params=[(ln + ".weight", self.h), (ln + ".bias", self.h)],
                  free=[g] + saved, cast=False)
        self.accumulate("g.res", out)                                       # into the residual gradient

    def block_backward(self, i: int) -> None:
        """GPT2Block backward, node by node, from the block output back to its input."""
        led, N, h, c, e = self.led, self.N, self.h, self.c, self.e
        x = f"h{i}."
        Nh, n = N * h, 4 * N * h
        node = self.node
        # residual add: the gradient goes on to the MLP branch, cast to its dtype (fp32: the same tensor)
        g = self._branch_grad("g.b", x + "resid2.mask")
        # mlp.c_proj (its input: the gelu output, cast to half under autocast)
        node(out=[("g.gelu_out", c * n)], params=[(x + "mlp.c_proj.weight", 4 * h * h), (x + "mlp.c_proj.bias", h)],
             free=[g if g != "g.res" else "", x + "mlp.proj_in16", x + "gelu.out", "w16." + x + "mlp.c_proj"])
        if self.fast_gelu:                                      # gelu_backward(grad, x): one tensor
            node(out=[("g.xbuf", c * n)], free=["g.gelu_out", x + "fc"])
        else:
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
        self._layernorm_grad("g.ln2", x + "ln_2", "g.mid_ln", [x + "mid", x + "ln2.stats"])
        g = self._branch_grad("g.a", x + "resid1.mask")  # attention branch
        node(out=[("g.attn_out", c * Nh)], params=[(x + "attn.c_proj.weight", h * h), (x + "attn.c_proj.bias", h)],
             free=[g if g != "g.res" else "", "w16." + x + "attn.c_proj"])
        self.attention_backward(i)
        # attn.c_attn
        node(out=[("g.ln1_16", c * Nh)],
             params=[(x + "attn.c_attn.weight", 3 * h * h), (x + "attn.c_attn.bias", 3 * h)],
             free=["g.qkv", x + "ln1.in16", x + "ln1.out", "w16." + x + "c_attn"])
        self._layernorm_grad("g.ln1", x + "ln_1", "g.in_ln", [f"res.{i}", x + "ln1.stats"])
        led.free_prefix(x)                                                  # nothing of the block is left
        led.free_prefix("cache.b16." + x)

    # ---- optimizer -------------------------------------------------------------------------------------------
    def param_groups(self) -> tuple[list[int], list[int]]:
        """Parameter sizes in labutils' two AdamW groups, in model.parameters() order: matrices (decayed), then
        biases and LayerNorm weights."""
        h = self.h
        decay, no_decay = [self.V * h, self.n_pos * h], []
        for _ in range(self.L):
            decay += [3 * h * h, h * h, 4 * h * h, 4 * h * h]    # c_attn, attn.c_proj, c_fc, mlp.c_proj weights
            no_decay += [h, h, 3 * h, h, h, h, 4 * h, h]        # ln_1, their biases, ln_2, theirs
        return decay, no_decay + [h, h]

    def optimizer_step(self, label: str, first: bool) -> None:
        """Fused AdamW on CUDA updates in place. On CPU the single-tensor AdamW makes two temporaries of each
        parameter's size (``denom``) while the previous one's is still bound. State is created per group, before
        its update."""
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
    def run(self) -> Ledger:
        """Load (weights, dataset, cuBLAS workspace), then two optimizer steps of ``plan.accum`` micro-batches
        (at most two replayed: the later ones repeat the second); the ledger holds the peak and the timeline."""
        p, led = self.p, self.led
        led.phase = "load"
        led.alloc("weights", 4 * sum(map(sum, self.param_groups())), "weights")   # fp32: every parameter
        if p.num_samples:
            led.alloc("dataset", 3 * 8 * p.num_samples * p.seq, "data")
        if self.cuda:
            led.alloc("cublas.workspace", p.workspace_bytes, "workspace")
        led.mark("start")
        for step in range(2):
            label = f"step {step}"
            led.alloc("window", p.accum * (3 * 8 * self.N + 8 * self.B), "data")
            for mb in range(min(p.accum, 2)):
                which = f" (micro-batch {mb})" if p.accum > 1 else ""
                self.forward(label)
                led.mark(f"{label} after forward{which}")
                self.backward(label, grads_exist=mb > 0)
                led.mark(f"{label} after backward{which}")
            self.optimizer_step(label, first=step == 0)
            led.free("window")
            led.mark(f"{label} after optimizer step")
        return led

