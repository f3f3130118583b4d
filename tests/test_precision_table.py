"""The precision table (labutils.core.precisions) is the one home of every precision decision (issue 43): the labs,
the time plan and the training loop ask it, so a CPU with native BF16 gets the same answer from each of them.

The oracles: oneDNN's own BF16 check (the one hardware query, replaced to give each answer a CPU can give), the
notebooks' own cells (which call to ``lu.amp_precision`` each lab makes), torch's autocast state, and the peak
table's datasheets (a T4 has no BF16)."""
from __future__ import annotations

import ast
import importlib
import json
import re

import pytest
import torch

import labutils as lu
from labutils.core import precisions as pr
from labutils.tools import regenerate as rg
from labutils.labs import registry as labs
from labutils.tools import timeplan

train = importlib.import_module("labutils.core.train")  # the module: `labutils.core.train` is also the function

LABS = labs.IDS
H100, T4 = "NVIDIA H100 80GB HBM3", "Tesla T4"
AMP_VAR = {"01": "AMP", "02": "AMP", "03": "MIXED", "04": "AMP"}  # the name each lab gives its mixed precision


def _code(lab: str) -> str:
    nb = json.loads(next(iter(rg.find_notebooks(rg.REPO_ROOT, [lab]))).read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def _lab_choice(lab: str) -> str:
    """The mixed precision the lab's own cell chooses on this CPU: its call to lu.amp_precision, as written."""
    found = re.findall(rf"^{AMP_VAR[lab]}(?:, \w+)? = lu\.amp_precision\(device(?:, emulated_ok=(True|False))?\)",
                       _code(lab), re.M)
    assert len(found) == 1, f"lab {lab}: one `{AMP_VAR[lab]} = lu.amp_precision(device...)` cell line, {found}"
    return pr.amp_precision("cpu", emulated_ok=found[0] != "False")[0]


def _lab01_always() -> tuple:
    line = re.search(r"^ALWAYS = (\(.*?\))", _code("01"), re.M)
    return ast.literal_eval(line.group(1))


def _expected(lab: str) -> set:
    """What the lab's cells train on this CPU: its choice, plus the formats it always runs."""
    amp = _lab_choice(lab)
    if lab == "01":  # every native format, the ones it always runs (emulated or not), and its AMP's batch sweep
        return {amp, *_lab01_always(), *(p for p in pr.NAMES if pr.get(p).native("cpu")[0])}
    return {amp, "fp16"} if lab == "02" else {amp, "fp32"}  # lab 02: fp16 for the GradScaler check; 03, 04: FP32


@pytest.mark.parametrize("native_bf16", [True, False], ids=["cpu-with-bf16", "cpu-without-bf16"])
def test_labs_and_plan_choose_the_same_precisions(monkeypatch, native_bf16):
    """Under each answer a CPU gives to "native BF16?", every lab's smoke plan trains exactly the precisions the
    lab's cells choose. Failed before the table: the plan hard-coded fp16 / fp32 for a CPU while the labs trained
    BF16 where native (the README's test_plan_arithmetic_is_the_runs_own failed on an AVX512-BF16 / AMX CPU)."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    assert pr.get("bf16").native("cpu")[0] is native_bf16  # labutils' own check reads the replaced query
    for lab in LABS:
        planned = {r[1].train.precision for r in labs.lab(lab).runs("smoke", "cpu")}
        assert planned == _expected(lab), (lab, native_bf16)
    assert labs.LAB01_ALWAYS == _lab01_always()
    if native_bf16:
        assert {_lab_choice(lab) for lab in LABS} == {"bf16"}


def test_no_notebook_decides_a_precision_itself():
    """The labs ask the table: no `"bf16" if ...` of their own, no dtype map, no bare support check."""
    for lab in LABS:
        code = _code(lab)
        assert not re.search(r'"(bf16|fp16|fp32)" if ', code), lab
        assert "bf16_supported" not in code and "tf32_supported" not in code and "torch.bfloat16}" not in code, lab


def test_a_t4_plan_trains_fp16_where_an_h100_plan_trains_bf16():
    """The plan for a card by name uses the labs' rule with that card's formats (labutils.core.peaks): a T4 has no
    BF16, so its labs train FP16 (and no TF32); an H100's train BF16. Failed before: every GPU planned BF16."""
    assert lu.peak_tflops(T4, "bf16") is None and lu.peak_tflops(H100, "bf16")
    assert labs.lab_precision("cuda", T4) == "fp16" and labs.lab_precision("cuda", H100) == "bf16"
    for lab in LABS:
        t4 = {r[1].train.precision for r in labs.lab(lab).runs("full", "cuda", T4)}
        h100 = {r[1].train.precision for r in labs.lab(lab).runs("full", "cuda", H100)}
        assert "fp16" in t4 and not {"bf16", "tf32"} & t4, (lab, t4)
        assert "bf16" in h100, (lab, h100)
    cfg = lu.load_config("configs/lab03_checkpointing.yaml", mode="full").override({"train.precision": "fp16"})
    cost = timeplan.run_cost(cfg, T4)  # FP16 at the T4's FP16 peak: the plan's compute is the datasheet's
    assert cost["compute_s"] == pytest.approx(cost["flops"] / cost["steps"] / (65e12 * timeplan.ACHIEVED["fp16"]))


@pytest.mark.parametrize("name", pr.NAMES)
def test_each_rows_autocast_dtype_reaches_torch(name):
    """A row without its autocast dtype would train in FP32 silently (autocast falls through): each row's dtype is
    what torch's autocast runs a matmul in, and a scaler exists exactly where the row says."""
    row, cpu = pr.get(name), torch.device("cpu")
    x = torch.randn(8, 8)
    with train.autocast_for(name, cpu):
        assert torch.is_autocast_enabled("cpu") == row.amp
        if row.amp:
            assert torch.get_autocast_dtype("cpu") == row.autocast
        y = x @ x
    assert y.dtype == row.dtype and pr.dtype_name(row.dtype) == ("fp32" if row.tf32 else name)
    assert (train.scaler_for(name, cpu) is not None) == row.scaler


def test_an_unknown_precision_is_refused_naming_the_rows():
    cfg = lu.load_config("configs/fp32_config.yaml")
    with pytest.raises(lu.ConfigError) as err:
        cfg.override({"train.precision": "fp8"})
    assert "train.precision" in str(err.value) and all(n in str(err.value) for n in pr.NAMES)
    with pytest.raises(ValueError, match=", ".join(pr.NAMES)):
        pr.get("fp8")


def test_cpu_answer_is_onednn_and_without_it_lab02_trains_fp32(monkeypatch):
    """One BF16 answer per machine (oneDNN's check); without native BF16 the reason says emulated, the labs that
    show autocast take FP16 and the ones that should be fast (lab 02, lab 04's slow step) FP32."""
    ok, why = pr.get("bf16").native("cpu")
    assert ok == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert ("native BF16 instructions" in why) if ok else ("emulate" in why)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    assert "emulate bfloat16" in pr.get("bf16").native("cpu")[1]
    assert pr.amp_precision("cpu")[0] == "fp16"
    precision, why = pr.amp_precision("cpu", emulated_ok=False)
    assert precision == "fp32" and "no native BF16" in why


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_native_on_a_cpu_says_what_it_speeds_up(monkeypatch, name):
    """Issue 44: the setup printed "FP16: native (this CPU has native FP16 instructions (AVX512-FP16 / AMX-FP16))" and
    section 4 then timed FP16 at 0.86x FP32 with nothing reconciling the two. A CPU's native 16-bit instructions speed
    up oneDNN's matmuls only; the reason says so, and that a step can still be slower (CPU timing is never judged)."""
    monkeypatch.setattr(torch.ops.mkldnn, f"_is_mkldnn_{name}_supported", lambda: True)
    ok, why = pr.get(name).native("cpu")
    assert ok and f"{name.upper()} matmuls" in why and "can still be slower than FP32" in why, why
