"""One bf16 answer per machine: labutils.env.bf16_supported, used by lab 01 directly and lab 02 via amp_precision."""
from __future__ import annotations

import torch

from labutils.accumulation import amp_precision
from labutils.env import bf16_supported


def test_cpu_answer_is_onednn_native_check_and_labs_agree():
    ok, why = bf16_supported("cpu")
    assert ok == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (amp_precision("cpu")[0] == "bf16") == ok  # lab 02's training precision follows the same answer
    assert ("native BF16 instructions" in why) if ok else ("emulate" in why)


def test_cpu_without_native_bf16_says_emulated(monkeypatch):
    # the hardware is the stand-in here (oneDNN's CPU check), not the code under test
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    ok, why = bf16_supported("cpu")
    assert ok is False and "emulate bfloat16" in why  # was (True, "CPU autocast supports bfloat16") on every CPU
    precision, why2 = amp_precision("cpu")
    assert precision == "fp32" and "no native BF16" in why2
