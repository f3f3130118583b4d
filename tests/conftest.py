"""Shared fixtures, and the whole-session pretend GPU.

``LAB_PRETEND_GPU=<profile>`` (a key of tests/fake_cuda.py's PROFILES: rtx3070-8gb, t4, h100) installs the pretend
GPU for the whole test session, before collection, so every test (not only the device tests) runs where
``torch.cuda.is_available()`` is True: the closest stand-in for the GPU workflow on a machine without one. It is
in-process only: subprocesses the tests start (``python -m labutils ...``, notebook kernels) see the real machine.
Refused on a machine with a real GPU. How it was run (CPU build, from the repo root):

    LAB_PRETEND_GPU=rtx3070-8gb LAB_SMOKE=1 python -m pytest -x -q -p no:cacheprovider tests

Tests that need real CUDA kernels (training, a real CUDA tensor) skip under it with a reason; none may fail for
assuming there is no GPU: expectations about the hardware come from ``torch.cuda.is_available()``.
"""
import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # unit tests never wait on the network (test_offline unsets it)

import labutils as lu  # noqa: E402


_SESSION_GPU: dict = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "real_kernels: computes on the default device; skipped under LAB_PRETEND_GPU")
    profile = os.environ.get("LAB_PRETEND_GPU", "").strip()
    if profile:
        from tests import fake_cuda
        _SESSION_GPU["gpu"], _SESSION_GPU["undo"] = fake_cuda.install_session(profile)


KERNELS = ("runs work on the default device, which is the session's pretend GPU (LAB_PRETEND_GPU): that needs "
           "real CUDA kernels, which a pretend driver has not; on a real GPU this test runs there")


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.real_kernels``: the test computes on the default device (trains, or makes tensors there)."""
    if "gpu" in _SESSION_GPU:
        for item in items:
            marker = item.get_closest_marker("real_kernels")
            if marker:
                item.add_marker(pytest.mark.skip(reason=marker.kwargs.get("reason", KERNELS)))


def pytest_unconfigure(config):
    if "undo" in _SESSION_GPU:
        _SESSION_GPU.pop("undo")()


def pytest_report_header(config):
    if "gpu" in _SESSION_GPU:
        return f"LAB_PRETEND_GPU: the pretend GPU {_SESSION_GPU['gpu'].profile.name} is installed for the whole session"


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


# The tests that compile with inductor (gcc on the CPU: 10-30 s a cold graph on the 2-core CI box) run on one
# pytest-xdist worker, one after another, so that a graph another of them compiled is read from inductor's on-disk
# caches (FX graph and AOT autograd caches, keyed by the graph, its shapes and the settings; the C++ kernels by their
# source) instead of compiled again beside it (issue 29, §5). Tests that train the tiny model compiled use
# COMPILED_TINY's overrides: the fast config's compiled step in smoke mode (its model keys, bf16, the chunked loss,
# 4 x 64), the graph `run configs/fast_config.yaml` compiles in tests/test_compile.py. (test_reference turns those
# caches off on purpose: it counts what inductor generates; the C++ kernels it shares.)
INDUCTOR = pytest.mark.xdist_group("inductor")
_FAST = lu.load_config(str(ROOT / "configs" / "fast_config.yaml"), mode="smoke")
COMPILED_TINY = {**{f"model__{k}": getattr(_FAST.model, k) for k in ("activation", "pad_vocab_to", "attn_implementation",
                                                                      "dropout", "loss", "loss_chunk_size")},
                 "train__precision": _FAST.train.precision, "data__seq_length": _FAST.data.seq_length,
                 "train__micro_batch_size": _FAST.train.micro_batch_size, "data__pack": True, "train__steps": 3,
                 "train__compile": True}


def tiny_config(corpus=None, **overrides):
    """A smoke-mode config for unit tests: tiny model, fp32, no dropout."""
    base = {"model.dropout": 0.0, "data.seq_length": 48, "data.num_samples": 64, "train.steps": 3,
            "train.warmup_steps": 0, "train.timing_warmup_steps": 0}
    if corpus is not None:
        base["data.corpus"] = str(corpus)
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return lu.load_config(None, overrides=base, mode="smoke")
