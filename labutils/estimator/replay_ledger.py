"""The ledger of :class:`labutils.estimator.replay.Replay`: live tensors by name, their bytes and kind, the current and peak
bytes, and the parts of the peak by kind."""
from __future__ import annotations

import math
from collections import Counter

KINDS = ("weights", "grads", "optimizer", "activations", "logits", "half_weights", "temporaries", "data",
         "workspace")   # what each tensor is booked as: the parts of the peak


class Ledger:
    """The live tensors of a replay by name, with their bytes, kind (one of :data:`KINDS`) and whether autograd
    saved them; the current and peak bytes, the phase and the parts at the peak, and a timeline of marks.
    CUDA's caching allocator rounds each block up to 512 bytes: ``round_to=512``."""

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
