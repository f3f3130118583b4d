import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # unit tests never wait on the network (test_offline unsets it)

import labutils as lu  # noqa: E402


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def ragged_corpus(tmp_path_factory) -> Path:
    """Documents of very different lengths (3 to 90 bytes), so padded batches hold very different token counts."""
    rng = random.Random(0)
    words = "memory gradient token batch scale loss weight layer step model".split()
    docs = []
    for _ in range(60):
        n = rng.choice([1, 2, 3, 8, 12, 16])
        docs.append(" ".join(rng.choice(words) for _ in range(n)))
    path = tmp_path_factory.mktemp("corpus") / "ragged.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def tiny_config(corpus=None, **overrides):
    """A smoke-mode config for unit tests: tiny model, fp32, no dropout."""
    base = {"model.dropout": 0.0, "data.seq_length": 48, "data.num_samples": 64, "train.steps": 3,
            "train.warmup_steps": 0, "train.timing_warmup_steps": 0}
    if corpus is not None:
        base["data.corpus"] = str(corpus)
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return lu.load_config(None, overrides=base, mode="smoke")
