"""The LM head and the loss in :class:`labutils.estimator.replay.Replay`: transformers' full loss (the logits whole, an fp32
copy and ``log_softmax``'s output saved; three [N, V] fp32 tensors at the worst moment of backward) and
``model.loss: chunked`` (:mod:`labutils.models.loss_chunks`: one chunk's logits at a time)."""
from __future__ import annotations


class LossReplay:
    """The LM head and loss, forward and backward; mixed into :class:`labutils.estimator.replay.Replay`, whose ``self.led``,
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

    # ---- model.loss: chunked (labutils.models.loss_chunks) ------------------------------------------------------------
    def chunked_loss_forward(self) -> None:
        """``model.loss: chunked`` forward (:class:`labutils.models.loss_chunks.ChunkedLinearCrossEntropy`). Two chunks
        are booked: the second holds the fp32 weight-gradient accumulator that the first created."""
        p, led, N, B, T, h, V, c = self.p, self.led, self.N, self.B, self.T, self.h, self.V, self.c
        C, wte = min(p.loss_chunk or N, N), "temporaries" if self.grads_exist else "grads"
        led.alloc("labels.pad", 8 * B * (T + 1))
        led.alloc("labels.shift", 8 * N)                                 # the targets
        led.free("labels.pad")
        if p.amp:
            led.alloc("tmp.h16", 2 * N * h)
            led.alloc("tmp.w16", 2 * V * h, "half_weights")
        led.alloc("loss.iota", 8 * V)
        chunks = 2 if N > C else 1
        for k in range(chunks):
            if p.amp:
                led.alloc("chunk.x16", c * C * V, "logits")
            led.alloc("chunk.x", 4 * C * V, "logits")
            led.free("chunk.x16")
            led.alloc("chunk.lse", 4 * C * V, "logits")                  # logsumexp's x - max
            led.free("chunk.lse")
            led.alloc("chunk.onehot", C * V, "logits")
            led.free("chunk.onehot")
            if p.amp:
                led.alloc("chunk.g16", c * C * V, "logits")
            led.alloc(f"loss.gh{k}", c * min(C, N - k * C) * h)          # its share of the hidden states' gradient
            if k == 0:
                led.alloc("tmp.gw16" if p.amp else "wte.buffer", c * V * h, "temporaries" if p.amp else wte)
                if p.amp:
                    led.alloc("wte.buffer", 4 * V * h, wte)
            elif p.amp:
                led.alloc("tmp.gw16", c * V * h)
            led.free("tmp.gw16", "chunk.x", "chunk.g16")
        led.alloc("loss.gh_rest", c * max(0, N - chunks * C) * h)         # the chunks not replayed
        led.alloc("loss.grad_h", c * N * h, "activations", True)          # their concatenation, saved
        led.free("loss.gh0", "loss.gh1", "loss.gh_rest", "tmp.h16", "tmp.w16", "loss.iota", "labels.shift")
        led.release("lnf.out")
        led.free_prefix("cache.")                                        # autocast exits: its cache is dropped

    def chunked_loss_backward(self) -> None:
        """``model.loss: chunked`` backward: the saved gradients scaled by the incoming one (the hidden states' upcast
        to fp32); the weight gradient waits in autograd's input buffer for the embedding's, as with the full head."""
        if self.p.amp:
            self.led.alloc("g.lnf", 4 * self.N * self.h)
            self.led.free("loss.grad_h")
        else:
            self.led.rename("loss.grad_h", "g.lnf", "temporaries", saved=False)
