"""The LM head and the loss in :class:`labutils.replay.Replay`: transformers' full loss (the logits whole, an fp32
copy and ``log_softmax``'s output saved; three [N, V] fp32 tensors at the worst moment of backward) and
``model.loss: chunked`` (:mod:`labutils.loss_chunks`: one chunk's logits at a time)."""
from __future__ import annotations


class LossReplay:
    """The LM head and loss, forward and backward; mixed into :class:`labutils.replay.Replay`, whose ``self.led``,
    sizes and ``node`` it uses."""

    def head_and_loss_forward(self) -> None:
        """After the final LayerNorm: the LM head and the loss (the full one, or chunked)."""
        p, led, N, T, B, h, V = self.p, self.led, self.N, self.T, self.B, self.h, self.V
        if self.chunked:
            self.chunked_loss_forward()
            return
        if p.amp:
            self.half_copy("wte", V * h, None)
            led.alloc("lmh.in16", 2 * N * h, "activations", True)
        else:
            led.keep("lnf.out")
        led.alloc("logits", self.c * N * V, "logits")
        # padded vocabulary: the LM head's constant bias (models.pad_vocabulary) is added inside addmm: nothing new
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

    def full_loss_backward(self) -> None:
        """transformers' loss and the LM head, backward: three [N, V] fp32 tensors at the worst moment."""
        p, led, N, h, V, c, grads_exist = self.p, self.led, self.N, self.h, self.V, self.c, self.grads_exist
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

    # ---- model.loss: chunked (labutils.loss_chunks) ------------------------------------------------------------
    def _chunk_logits(self, C: int) -> None:
        """One chunk's logits, ``loss_chunks._chunk_logits``: the matmul in the head's dtype, upcast to fp32."""
        led, V = self.led, self.V
        led.alloc("chunk.logits", self.c * C * V, "logits")
        if self.p.amp:
            led.alloc("chunk.logits32", 4 * C * V, "logits")
            led.free("chunk.logits")
            led.rename("chunk.logits32", "chunk.logits")

    def chunked_loss_forward(self) -> None:
        """``model.loss: chunked`` forward (:class:`labutils.loss_chunks.ChunkedLinearCrossEntropy`): the shifted
        targets, the head's input in its matmul dtype (saved, as lm_head saves it), the weight cast (a temporary),
        then one chunk's logits at a time, log-sum-exp computed in their buffer; a log-sum-exp per position is
        kept. Liger's fused kernel (CUDA, where installed) is booked as this path."""
        p, led, N, B, T, h, V = self.p, self.led, self.N, self.B, self.T, self.h, self.V
        led.alloc("labels.pad", 8 * B * (T + 1))
        led.alloc("labels.shift", 8 * N, "activations", True)            # the targets, saved
        led.free("labels.pad")
        if V != self.V_real:                                             # head_bias: the padded rows' constant
            led.alloc("loss.bias", 4 * V, "activations", True)
        if p.amp:
            led.alloc("lmh.in16", 2 * N * h, "activations", True)
            led.alloc("tmp.w16", 2 * V * h, "half_weights")
        else:
            led.keep("lnf.out")
        led.alloc("loss.lse", 4 * N, "activations", True)
        self._chunk_logits(min(self.p.loss_chunk, N))
        led.free("chunk.logits", "tmp.w16")
        led.release("lnf.out")                                           # fp32: saved by the loss instead
        led.free_prefix("cache.")                                        # autocast exits: its cache is dropped

    def chunked_loss_backward(self) -> None:
        """``model.loss: chunked`` backward: the gradients' buffers (the head input's in the matmul dtype, the
        weight's in fp32), then per chunk the logits recomputed and turned into ``softmax - onehot`` in place,
        cast to the matmul dtype under autocast, and their shares added in (under autocast a half [V, d] product
        first); the weight gradient waits in autograd's input buffer for the embedding's, as the full head's."""
        p, led, N, h, V, c = self.p, self.led, self.N, self.h, self.V, self.c
        C = min(p.loss_chunk, N)
        if p.amp:
            led.alloc("tmp.w16", 2 * V * h, "half_weights")
        led.alloc("g.lnf16", c * N * h)
        led.alloc("wte.buffer", 4 * V * h, "temporaries" if self.grads_exist else "grads")
        self._chunk_logits(C)
        if p.amp:
            led.alloc("chunk.g16", c * C * V, "logits")
            led.free("chunk.logits")
            led.alloc("tmp.gwte16", c * V * h)
            led.free("tmp.gwte16", "chunk.g16")
            led.alloc("g.lnf", 4 * N * h)
            led.free("g.lnf16")
        else:
            led.free("chunk.logits")
            led.rename("g.lnf16", "g.lnf")
        led.free("tmp.w16", "lmh.in16", "lnf.out", "labels.shift", "loss.lse", "loss.bias")
