"""Data: an offline corpus, tokenised into fixed-length samples, and a sampler that is exact for accumulation.

``builtin`` corpus: the English prose of Python's own documentation (``pydoc_data``), nothing downloaded; a ``.txt``
path: documents separated by blank lines. ``pack=False``: one document per sample, truncated and right-padded (label
-100, attention mask 0); ``pack=True``: documents joined by EOS and cut into full blocks, no padding, no mask (SDPA's
flash kernel eligible). Labs that measure speed or memory pack; lab 02 pads, as padding is its lesson.
:meth:`LMDataset.windows` yields, per optimizer step, its ``micro x accum`` samples split into micro-batches; they
depend only on the seed and the effective batch, so (8 x 1), (2 x 4) and (1 x 8) compare exactly.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .config import DataConfig

IGNORE_INDEX = -100
_TOLD: set[tuple[int, int]] = set()  # (samples, effective batch) already noticed


def _builtin_documents(min_chars: int = 200) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some minimal Pythons strip it: a synthetic fallback, clearly not real prose
        words = ("the model reads a batch of tokens and predicts the next one while memory holds weights "
                 "gradients optimizer state and activations").split()
        g = torch.Generator().manual_seed(0)
        return [" ".join(words[i] for i in torch.randint(len(words), (int(n),), generator=g))
                for n in torch.randint(20, 200, (400,), generator=g)]
    docs = []
    for name in sorted(topics):
        buf = ""
        for para in re.split(r"\n\s*\n", topics[name]):
            para = para.strip()
            if not para:
                continue
            buf = f"{buf}\n\n{para}" if buf else para
            if len(buf) >= min_chars:
                docs.append(buf)
                buf = ""
        if buf:
            docs.append(buf)
    return docs


def load_documents(corpus: str) -> list[str]:
    """The corpus as a list of documents (blank-line separated for text files)."""
    if corpus == "builtin":
        return _builtin_documents()
    text = Path(corpus).read_text(encoding="utf-8", errors="replace")
    docs = [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    if not docs:
        raise ValueError(f"{corpus}: no documents (documents are separated by blank lines)")
    return docs


@dataclass
class LMDataset:
    input_ids: torch.Tensor       # [N, T] int64
    attention_mask: torch.Tensor  # [N, T] int64, 0 on padding
    labels: torch.Tensor          # [N, T] int64, -100 on padding
    targets: list[int]            # per sample: positions that count in the loss (labels[1:] != -100)
    packed: bool
    real: list[int] | None = None  # per sample: positions that are real tokens (attention mask 1); None = count

    def __post_init__(self):
        if self.real is None:
            self.real = self.attention_mask.sum(dim=1).tolist()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def padding_fraction(self) -> float:
        """Fraction of all positions that are padding (attention mask 0)."""
        return 1.0 - sum(self.real) / (len(self) * self.seq_length)

    def to(self, device) -> "LMDataset":
        return LMDataset(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device),
                         self.targets, self.packed, self.real)

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """The samples ``indices`` as model inputs; packed data gets no ``attention_mask``. On a GPU the indices travel
        from pinned memory without syncing the host."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self.input_ids.is_cuda:
            idx = idx.pin_memory().to(self.input_ids.device, non_blocking=True)
        out = {"input_ids": self.input_ids[idx], "labels": self.labels[idx]}
        if not self.packed:
            out["attention_mask"] = self.attention_mask[idx]
        return out

    def step_indices(self, effective_batch: int, seed: int) -> Iterator[list[int]]:
        """Sample indices for each optimizer step: a fresh seeded permutation every epoch, consumed in order."""
        epoch, pending = 0, []
        while True:
            while len(pending) < effective_batch:
                g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
                pending += torch.randperm(len(self), generator=g).tolist()
                epoch += 1
            yield pending[:effective_batch]
            pending = pending[effective_batch:]

    def windows(self, micro_batch_size: int, accumulation_steps: int, seed: int) -> Iterator["Window"]:
        """One :class:`Window` per optimizer step: its micro-batches and its total target-token count. A step that
        needs more samples than the dataset holds repeats them within the step: said once per process."""
        eff = micro_batch_size * accumulation_steps
        if eff > len(self) and (len(self), eff) not in _TOLD:
            _TOLD.add((len(self), eff))
            print(f"notice: each optimizer step takes {eff} samples (micro-batch x accumulation steps) from a dataset "
                  f"of {len(self)} (data.num_samples): every sample repeats about {eff / len(self):.0f} times a step")
        for idx in self.step_indices(eff, seed):
            chunks = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
            yield Window([self.batch(c) for c in chunks], sum(self.targets[i] for i in idx),
                         sum(self.real[i] for i in idx))


@dataclass
class Window:
    micro_batches: list[dict[str, torch.Tensor]]
    num_targets: int  # target tokens in the whole accumulation window: the loss normaliser
    num_real: int = 0  # positions of the window that are real tokens, not padding


def build_dataset(cfg: DataConfig, tokenizer) -> LMDataset:
    """Tokenise the corpus into ``cfg.num_samples`` samples of ``cfg.seq_length`` tokens."""
    docs = load_documents(cfg.corpus)
    T, N, eos = cfg.seq_length, cfg.num_samples, tokenizer.eos_token_id
    if cfg.pack:
        stream: list[int] = []
        for doc in docs:
            stream += tokenizer.encode(doc) + [eos]
            if len(stream) >= N * T:
                break
        reps = -(-N * T // len(stream))
        ids = torch.tensor((stream * reps)[:N * T], dtype=torch.long).view(N, T)
        mask = torch.ones_like(ids)
        labels = ids.clone()
    else:
        encoded = [e[:T] for e in map(tokenizer.encode, docs) if len(e) >= 2]
        if not encoded:
            raise ValueError(f"{cfg.corpus}: no document has two or more tokens")
        ids = torch.full((N, T), eos, dtype=torch.long)
        mask = torch.zeros((N, T), dtype=torch.long)
        for i in range(N):
            e = encoded[i % len(encoded)]
            ids[i, :len(e)] = torch.tensor(e)
            mask[i, :len(e)] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    targets = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    return LMDataset(ids, mask, labels, targets, cfg.pack, mask.sum(dim=1).tolist())
