"""Issue 20 item 4: an out-of-memory raised outside the caching allocator is an OOM row in every sweep, as
``torch.OutOfMemoryError`` is; any other RuntimeError is raised.

A real card raises it as a plain RuntimeError, not ``torch.OutOfMemoryError``: cuBLAS handle creation on the first
matmul fails with the message below (PyTorch's ``TORCH_CUDABLAS_CHECK`` in aten/src/ATen/cuda/CublasHandlePool.cpp
formats "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), and a lazily loaded kernel
module fails with "CUDA error: out of memory". Here the GPT-2 model's forward (transformers' code, the collaborator)
or the notebook's step raises it; the sweep code under test runs unchanged. A sweep that still caught only
``torch.OutOfMemoryError`` crashes with that error (fails the OOM-row tests); one that caught every RuntimeError
would turn a shape bug into an "oom" row (fails the ``shape mismatch`` tests).
"""
import pytest
import torch
from transformers import GPT2LMHeadModel

import labutils as lu
import labutils.labs.lab02.accumulation as acc
import labutils.labs.lab03.checkpoint_measure as cm
import labutils.labs.lab03.checkpointing as ck
import labutils.labs.lab01.precision as lp
from conftest import tiny_config
from labutils.core.memory import oom_caught
from labutils.labs.lab04.profiling_claims import c6_claim
from labutils.labs.lab04.profiling_runs import leak_curves

CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
NOT_OOM = "shape mismatch: mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"
CPU = torch.device("cpu")


def raising(message):
    def forward(*args, **kwargs):
        raise RuntimeError(message)
    return forward


@pytest.mark.parametrize("exc", [RuntimeError(CUBLAS), RuntimeError("CUDA error: out of memory"),
                                 torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_oom_caught_keeps_every_out_of_memory(exc):
    with oom_caught() as oom:
        raise exc
    assert oom and oom.error == str(exc)


# torch 2.11's message on the first GPU run (H200, capped to an 8 GB card's share), as lab 03 printed it
H200_OOM = ("CUDA out of memory. Tried to allocate 394.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "132.14 GiB is free. Including non-PyTorch memory, this process has 7.66 GiB memory in use. 7.04 GiB "
            "allowed; Of the allocated memory 6.75 GiB is allocated by PyTorch, and 167.66 MiB is reserved by PyTorch "
            "but unallocated.")


def test_an_oom_row_names_the_cap_not_the_whole_cards_free_memory():
    """Lab 03 on the H200 printed "did not fit on this device: ... a total capacity of 139.80 GiB of which 132.14
    GiB is free" under a 7 GiB cap: it read as if the 140 GiB card were full. Breaks if the row keeps the card's
    free memory, or loses the request or the cap."""
    with oom_caught() as oom:
        raise torch.OutOfMemoryError(H200_OOM)
    assert oom.error == "CUDA out of memory. Tried to allocate 394.00 MiB (7.04 GiB allowed by the memory cap)"
    assert "132.14" not in lu.core.memory.oom_text(torch.OutOfMemoryError(H200_OOM))


def test_budget_words_name_the_emulated_card_when_capped(monkeypatch):
    """Breaks if a capped run says "this device" (the H200 run) instead of the card it behaves as."""
    monkeypatch.setattr(lu.device, "current_budget", lambda: {"card_gib": 8.0})
    assert lu.core.memory.budget_words() == "the 8 GB card's memory budget"
    monkeypatch.setattr(lu.device, "current_budget", lambda: None)
    assert lu.core.memory.budget_words() == "the memory this run could use"


def test_oom_caught_raises_any_other_error():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with oom_caught():
            raise RuntimeError(NOT_OOM)
    with oom_caught() as oom:
        pass
    assert not oom and oom.error is None


@pytest.mark.parametrize("message, oom", [(CUBLAS, True), (NOT_OOM, False)])
def test_lab02_measure_gradient(monkeypatch, message, oom):
    model = torch.nn.Linear(8, 8)
    monkeypatch.setattr(model, "forward", raising(message))

    def compute(m):  # the notebook's gradient cell
        loss = m(torch.ones(4, 8)).sum()
        loss.backward()
        return loss

    if not oom:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            acc.measure_gradient(model, compute, CPU)
        return
    out = acc.measure_gradient(model, compute, CPU)
    assert out["status"] == "oom" and "CUBLAS_STATUS_ALLOC_FAILED" in out["error"] and out["grads"] is None


@pytest.mark.parametrize("message, oom", [(CUBLAS, True), (NOT_OOM, False)])
def test_lab03_checkpoint_measure(monkeypatch, message, oom):
    monkeypatch.setattr(GPT2LMHeadModel, "forward", raising(message))
    cfg = tiny_config(train__steps=1, train__micro_batch_size=2, data__seq_length=16)
    if not oom:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            cm.measure(cfg, [ck.baseline()], CPU, progress=False)
        return
    (m,) = cm.measure(cfg, [ck.baseline()], CPU, progress=False)
    assert m.result.status == "oom" and "CUBLAS_STATUS_ALLOC_FAILED" in m.result.error


@pytest.mark.parametrize("message, oom", [(CUBLAS, True), (NOT_OOM, False)])
def test_lab01_guarded(capsys, message, oom):
    def experiment():
        raise RuntimeError(message)
    if not oom:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            lp.guarded(experiment)
        return
    assert lp.guarded(experiment) is None
    assert "OOM: experiment did not fit" in capsys.readouterr().out


@pytest.mark.parametrize("message, oom", [(CUBLAS, True), (NOT_OOM, False)])
def test_lab04_leak_curves(monkeypatch, capsys, message, oom):
    cfg = tiny_config(train__steps=1, train__micro_batch_size=2, data__seq_length=16)

    def one_step(model, optimizer, window, val, autocast, variant, train_log, val_log):  # the notebook's step
        model(**window.micro_batches[0])

    monkeypatch.setattr(GPT2LMHeadModel, "forward", raising(message))
    args = (cfg, CPU, one_step, lambda *a: None, ["keep the tensor"], 2)
    if not oom:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            leak_curves(*args)
        return
    curves = leak_curves(*args)
    assert curves["keep the tensor"] == []
    assert "keep the tensor: out of memory after 0 steps" in capsys.readouterr().out


@pytest.mark.parametrize("message, oom", [(CUBLAS, True), (NOT_OOM, False)])
def test_lab04_c6_claim(message, oom):
    """Every run of C6's pair runs out of memory: C6 is "not measured", the baseline's estimate beside it (issue 27:
    no smaller batch is substituted after the failure)."""
    cfg = tiny_config(train__steps=1, train__micro_batch_size=2, train__accumulation_steps=1,
                      data__seq_length=16)
    pair = {"baseline (fp32)": {}, "all together": {"train.precision": "fp16"}}

    def loop(c, model, dataset, device):  # the notebook's training loop
        raise RuntimeError(message)

    info = {"device": CPU, "gpu_name": None, "mode": "smoke"}
    if not oom:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            c6_claim(cfg, loop, info, pair, budget_bytes=2**30)
        return
    c6, _ = c6_claim(cfg, loop, info, pair, budget_bytes=2**30)
    assert c6["id"] == "C6" and c6["verdict"] == "not measured" and "did not fit the 1.00 GiB budget" in c6["why"], c6
    assert "a prediction, not a measurement" in c6["why"] and c6["extra"]["estimate_bytes"], c6


# Issue 29: the CPU allocator's own failure. torch.empty of an impossible size makes c10's DefaultCPUAllocator
# fail for real (posix_memalign returns ENOMEM): a plain RuntimeError, "DefaultCPUAllocator: can't allocate
# memory: you tried to allocate ... bytes". Nothing here writes the message: torch does.
IMPOSSIBLE = 2**50  # bytes: 1 PiB, more than any machine's address space will back


def cpu_allocation_failure():
    torch.empty(IMPOSSIBLE, dtype=torch.uint8)


def test_oom_caught_keeps_the_cpu_allocators_failure():
    with oom_caught() as oom:
        cpu_allocation_failure()
    assert oom and "DefaultCPUAllocator: can't allocate memory" in oom.error


def test_run_turns_a_cpu_allocation_failure_into_an_oom_result(monkeypatch):
    """``run`` (the CLI's ``run`` and every notebook's) on a model whose forward asks the CPU for too much: a result
    with status "oom", not a traceback. A cap that caught every RuntimeError would also pass this; the test above
    and ``test_oom_caught_raises_any_other_error`` keep the classification honest."""
    import labutils as lu

    def forward(*args, **kwargs):
        cpu_allocation_failure()
    monkeypatch.setattr(GPT2LMHeadModel, "forward", forward)
    cfg = tiny_config(train__steps=1, train__micro_batch_size=2, data__seq_length=16)
    result = lu.run(cfg, "cpu", progress=False, verbose=False)
    assert result.status == "oom" and "DefaultCPUAllocator: can't allocate memory" in result.error, result.error
