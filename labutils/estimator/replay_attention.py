"""Attention in :class:`labutils.estimator.replay.Replay`: what SDPA (flash / memory-efficient / CPU flash) or the math and
eager paths allocate and save in a block's forward, and free again in its backward (see :mod:`labutils.estimator.replay` for
the accounting and :class:`labutils.estimator.replay.Ledger` for the booking)."""
from __future__ import annotations


class AttentionReplay:
    """The attention part of a block, forward and backward; mixed into :class:`labutils.estimator.replay.Replay`, whose
    ``self.led``, sizes and ``attn`` ("flash", "math" or "eager") it reads."""

    def qkv_aliases(self) -> tuple[str, ...]:
        """Which of q', k', v' (the bmm operands of eager / math attention) are views of qkv, not copies."""
        if self.B != 1 or (self.attn == "math" and self.p.amp):
            return ()
        return ("v'",) if self.attn == "math" else ("q'", "k'", "v'")

    def attention_forward(self, i: int, save, keep, release) -> None:
        """After c_attn: q, k, v from ``h{i}.qkv`` through SDPA (or the eager / math bmm chain) to ``attn.out``;
        ``save``, ``keep`` and ``release`` are the block's (they know whether the block is checkpointed)."""
        p, led, N, T, B, h, a, c = self.p, self.led, self.N, self.T, self.B, self.h, self.a, self.c
        x, Nh, aTT = f"h{i}.", N * h, self.a * B * T * T
        if self.attn == "flash":
            keep("qkv")                                         # q, k, v are views of it; the kernel saves them
            lse_T = -(-T // 32) * 32 if (self.cuda and not p.amp) else T   # memory-efficient kernel pads to 32
            save("sdpa.lse", 4 * a * B * lse_T)
            if self.masked:
                save("sdpa.bias", c * B * T * T)                # bool mask converted to the query dtype
            save("attn.out", c * Nh)
            release("sdpa.lse", "sdpa.bias")
        else:
            # math / eager: q, k, v copied for bmm; scores [B, a, T, T] materialised and saved
            f = 4 if self.attn == "math" else c                 # CPU math SDPA upcasts half inputs to fp32
            # bmm needs [B*a, T, d] operands: a copy of the head views, except when B == 1 and no cast is
            # needed, where the reshape is a view of qkv (the math path scales q and k first: copies anyway)
            aliased = self.qkv_aliases()
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

    def attention_backward(self, i: int) -> None:
        """From ``g.attn_out`` (c_proj's input gradient) to ``g.qkv``, freeing what the forward saved."""
        p, led, N, T, B, h, c, node = self.p, self.led, self.N, self.T, self.B, self.h, self.c, self.node
        x, Nh, aTT = f"h{i}.", N * h, self.a * B * T * T
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
            aliased = self.qkv_aliases()
            v_last = "v'" in aliased and "q'" not in aliased          # qkv was saved for v only
            node(out=[("g.probs", pb * aTT), ("g.v", f * Nh)],
                 free=["g.bmm", x + "v'", x + "attn_drop.out"] + ([x + "qkv"] if v_last else []))
            if p.dropout:
                node(out=[("g.probs2", pb * aTT)], free=["g.probs", x + "attn_drop.mask"])
            if soft != pb:
                node(out=[("g.probs32", soft * aTT)], free=["g.probs", "g.probs2"])
            node(out=[("g.scores", soft * aTT)], free=["g.probs", "g.probs2", "g.probs32", x + "probs", x + "probs16"])
            node(out=[("g.q", f * Nh), ("g.k", f * Nh)], free=["g.scores", x + "q'", x + "k'", x + "qkv"])
            node(out=[("g.qkv", 3 * c * Nh)], free=["g.q", "g.k", "g.v"])
