"""Issue 20, item 7: inside a training step, every TF32 flag torch offers reads back, and they agree.

Students and libraries read the legacy flags (``torch.backends.cuda.matmul.allow_tf32``,
``torch.get_float32_matmul_precision()``, ``torch.backends.cudnn.allow_tf32``); torch >= 2.9 also has the new
``fp32_precision`` switches. ``env.matmul_precision`` used to set only the new ones, and torch's own legacy
getters then raised "mix of the legacy and new APIs" (ATen's Context checks both sides agree). The oracle is
torch's readers themselves, read from inside a forward pass of ``lu.train``.
"""
from __future__ import annotations

import pytest
import torch

import labutils as lu
from labutils.core import env as lenv

from conftest import tiny_config

NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(torch.backends.cudnn, "conv")


def read_all_flags() -> dict:
    """Every TF32 reader, legacy and new; a reader that raises is recorded as its error."""
    b = torch.backends
    readers = {
        "cuda.matmul.allow_tf32": lambda: b.cuda.matmul.allow_tf32,
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cudnn.allow_tf32": lambda: b.cudnn.allow_tf32,
    }
    if NEW_API:
        readers.update({"cuda.matmul.fp32_precision": lambda: b.cuda.matmul.fp32_precision,
                        "cudnn.conv.fp32_precision": lambda: b.cudnn.conv.fp32_precision,
                        "cudnn.rnn.fp32_precision": lambda: b.cudnn.rnn.fp32_precision})
    out = {}
    for k, read in readers.items():
        try:
            out[k] = read()
        except RuntimeError as exc:
            out[k] = f"RuntimeError: {str(exc)[:120]}"
    return out


def expected_flags(tf32: bool) -> dict:
    """What torch documents each reader means: TF32 allowed <=> allow_tf32, precision "high" (vs "highest"),
    fp32_precision "tf32" (vs "ieee")."""
    exp = {"cuda.matmul.allow_tf32": tf32, "get_float32_matmul_precision": "high" if tf32 else "highest",
           "cudnn.allow_tf32": tf32}
    if NEW_API:
        v = "tf32" if tf32 else "ieee"
        exp.update({"cuda.matmul.fp32_precision": v, "cudnn.conv.fp32_precision": v, "cudnn.rnn.fp32_precision": v})
    return exp


@pytest.mark.parametrize("precision,tf32", [("fp32", False), ("tf32", True)])
def test_tf32_flags_read_consistently_inside_a_training_step(ragged_corpus, precision, tf32):
    """Fails on the new-API-only switch: reading allow_tf32 raised inside a tf32 step (legacy precision still
    "highest"), and cudnn.allow_tf32 raised inside an fp32 step (conv "ieee", rnn "tf32", legacy flag True)."""
    before = read_all_flags()
    cfg = tiny_config(ragged_corpus, train__precision=precision, train__steps=2)
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    seen = []
    hook = loaded.model.register_forward_hook(lambda *a: seen.append(read_all_flags()))
    try:
        res = lu.train(cfg, loaded.model, ds, "cpu", progress=False)
    finally:
        hook.remove()
    assert res.ok and len(seen) == 2
    assert all(s == expected_flags(tf32) for s in seen), seen[0]
    assert read_all_flags() == before  # restored after the run


def test_switch_restores_a_state_the_caller_set_with_the_new_api():
    """A caller that set only the new API (legacy getters refusing) gets exactly that state back."""
    if not NEW_API:
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    m = torch.backends.cuda.matmul
    saved = m.fp32_precision
    try:
        m.fp32_precision = "tf32"
        with lenv.matmul_precision(False):
            assert read_all_flags() == expected_flags(False)
        assert m.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        m.fp32_precision = saved


def test_legacy_only_torch_path(monkeypatch):
    """torch 2.6-2.8: no fp32_precision, no cudnn.conv/rnn; the legacy setters alone must do it."""
    monkeypatch.setattr(lenv, "_fp32_precision_switches", lambda: {})
    for tf32 in (True, False):
        with lenv.matmul_precision(tf32):
            assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
            assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
