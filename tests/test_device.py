"""The CUDA paths, rehearsed on a machine without a GPU with a pretend GPU (tests/fake_cuda.py), on either torch
build (the CPU build, or pip's default CUDA build without a driver). Skipped where a real GPU is present: there
``python -m labutils doctor`` and the notebooks on CUDA run these paths on the card.

Only the driver entry points are replaced; torch's own Python layer (device-index checks, fraction checks,
statistics flattening, snapshots) stays real, so a call torch would refuse on a real GPU is refused here too.
Each test names the row of issue 11 it guards; each failed before its fix.
"""
from __future__ import annotations

import functools
import math
import os
import stat
import sys

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import labutils as lu
from labutils.labs.lab02 import accumulation as acc
from labutils.labs.lab03 import checkpoint_measure as cm
from labutils.labs.lab03 import checkpointing as ck
from labutils.core import device as dev
from labutils.core import env as lenv
from labutils.labs.lab04 import profiling
from labutils.labs import scale_model
from tests import fake_cuda


GiB, MiB = 2**30, 2**20
PROFILES = list(fake_cuda.PROFILES)


@pytest.fixture
def gpu(monkeypatch, request):
    """The pretend GPU of the test's profile (parametrise ``gpu`` indirectly; default: an 8 GB RTX 3070)."""
    monkeypatch.setattr(dev, "_state", {})
    monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    monkeypatch.delenv("LAB_SMOKE", raising=False)  # CI sets it; with a GPU and no LAB_SMOKE the mode is full
    return fake_cuda.install(monkeypatch, getattr(request, "param", "rtx3070-8gb"))


# ---------------------------------------------------------------------------------------------------- row 1
@pytest.mark.parametrize("gpu", PROFILES, indirect=True)
def test_setup_with_a_budget_runs_on_every_card(gpu, monkeypatch, capsys):
    """Row 1: lu.setup() with LAB_GPU_MEMORY_GB set passed torch.device("cuda") (no index) to
    set_per_process_memory_fraction, which raises on a GPU: every notebook died in its first cell."""
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", "8")
    info = lu.setup(seed=1)
    assert info["mode"] == "full" and info["device"] == torch.device("cuda", 0)
    p = gpu.profile
    # torch's rule (CUDACachingAllocator: limit = size_t(fraction * total)) plus what lives outside = the total a
    # real 8 GB GeForce reports (7.78 GiB: akshitac8/OW-DETR#46), whatever this card is
    assert int(gpu.fraction * p.total) + p.outside == pytest.approx(int(round(7.78 * GiB)), abs=2)
    assert info["gpu"]["name"] == p.name and info["gpu"]["card_gib"] == 8.0
    assert info["gpu"]["outside_allocator_bytes"] == p.outside
    assert info["gpu_memory_budget_gb"] == 8.0
    out = capsys.readouterr().out
    assert "behaving like a 8 GB card" in out and "7.78 GiB" in out and "doctor" in out


def test_torch_refuses_a_device_without_index(gpu):
    """The stand-in keeps torch's own check: the call labutils used to make fails here as on a real GPU."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))


# ---------------------------------------------------------------------------------------------------- row 2
@pytest.mark.parametrize("gpu", ["h100"], indirect=True)
def test_lab04_cap_never_raises_a_lower_cap_and_restores_it(gpu):
    """Row 2: lab 04's cap (once profiling.cuda_memory_cap, now the lab's one budget, the card's bytes for tensors,
    under dev.memory_cap) raised the same ValueError on entry and restore, and could raise a lower cap."""
    budget = scale_model.lab_budget("04", torch.device("cuda", 0))["bytes"]
    with dev.memory_cap(budget):
        assert dev.cap_bytes() + gpu.profile.outside == pytest.approx(int(round(7.78 * GiB)), abs=2)  # 8 GB card
    assert gpu.fraction == 1.0
    torch.cuda.set_per_process_memory_fraction(0.04, 0)  # the user's own, lower cap (3.2 GB of 80)
    with dev.memory_cap(budget):
        assert gpu.fraction == pytest.approx(0.04)
    assert gpu.fraction == pytest.approx(0.04)


def test_lab04_cap_is_a_no_op_on_cpu(monkeypatch):
    fake_cuda.no_gpu(monkeypatch)  # a machine without a GPU, whatever this one has (or the session pretends)
    with dev.memory_cap(123) as cpu_budget:
        assert cpu_budget == 123 and dev.cap_bytes() is None  # the budget handed on to the CPU tracker


# ---------------------------------------------------------------------------------------------------- row 3
@pytest.mark.parametrize("missing", ["cudnn.conv", "both"])
def test_matmul_precision_on_torch_without_fp32_precision(monkeypatch, missing):
    """Row 3: torch 2.6-2.8 have no torch.backends.cudnn.conv; reading it first raised AttributeError."""
    monkeypatch.delattr(type(torch.backends.cudnn), "conv")
    if missing == "both":
        monkeypatch.delattr(type(torch.backends.cuda.matmul), "fp32_precision", raising=False)
    with lenv.matmul_precision(tf32=True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    with lenv.matmul_precision(tf32=False):
        assert not torch.backends.cuda.matmul.allow_tf32


# ---------------------------------------------------------------------------------------------------- row 4
@pytest.mark.parametrize("xs, ys, gap", [
    ([math.inf, 2.0], [math.inf, 2.0], 0.0),      # step 0 overflowed in both loops: a match
    ([math.nan, 2.0], [math.nan, 2.0], 0.0),
    ([math.inf, 2.0], [1.0, 2.0], math.inf),      # only one loop overflowed: not a match
    ([1.0, 2.0], [1.0, 2.2], pytest.approx(0.2 / 2.2)),
])
def test_written_out_step_comparison_survives_an_overflowing_fp16_step(xs, ys, gap):
    """Row 4: lab 02 compared with abs(a - b) / abs(b): inf - inf is nan, and its assert failed."""
    assert acc.max_relative_gap(xs, ys) == gap
    old = max(abs(a - b) / abs(b) for a, b in zip(xs, ys))  # the notebook's old expression
    if xs[0] == ys[0] and not math.isfinite(xs[0]):
        assert not old < 1e-3                                   # it would have failed the lab's assert


# ---------------------------------------------------------------------------------------------------- row 5
@torch.library.custom_op("labtest::fused_dropout_matmul", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def fused_dropout_matmul(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Like CUDA's fused attention with dropout: one op that multiplies and draws its dropout mask inside."""
    mask = (torch.rand_like(x) >= dropout_p).to(x.dtype) / (1 - dropout_p)
    return (x * mask) @ w, mask


@fused_dropout_matmul.register_fake
def _(x, w, dropout_p):
    return x.new_empty(x.shape[0], w.shape[1]), torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, w, output[1])


def _backward(ctx, grad, _grad_mask):
    x, w, mask = ctx.saved_tensors
    return (grad @ w.T) * mask, (x * mask).T @ grad, None


fused_dropout_matmul.register_autograd(_backward, setup_context=_setup)
FUSED = torch.ops.labtest.fused_dropout_matmul.default


def _block(x, w1, w2, p):
    h = FUSED(x, w1, p)[0]
    h = torch.nn.functional.dropout(h, p, training=True)   # a later dropout: must get the forward's mask again
    return torch.tanh(h @ w2).sum()


def _grads(policy, p):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    w1 = torch.randn(16, 16, generator=g, requires_grad=True)
    w2 = torch.randn(16, 4, generator=g, requires_grad=True)
    torch.manual_seed(7)
    if policy is None:
        loss = _block(x, w1, w2, p)
    else:
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        loss = torch.utils.checkpoint.checkpoint(_block, x, w1, w2, p, use_reentrant=False, context_fn=context_fn)
    loss.backward()
    return [w1.grad, w2.grad]


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_selective_checkpointing_is_exact_with_a_seeded_op_it_would_save(monkeypatch, p):
    """Row 5: save_matmuls marked CUDA's fused attention (which draws its dropout mask inside) MUST_SAVE; the
    recompute then skipped its random draw and every later dropout got another mask: wrong gradients. The policy is
    lab 03's own, written out in its cells (MATMULS = ck.SAVE_OPS as the cell sets it), which trains GPT-2 with it."""
    monkeypatch.setattr(ck, "SAVE_OPS", ck.SAVE_OPS | {FUSED})  # as CUDA's fused attention kernels are
    save_matmuls = ck.notebook_variants()["save_matmuls"]
    ref = _grads(None, p)
    got = _grads(save_matmuls, p)
    assert cm.max_rel_diff(got, ref) < 1e-6
    if p == 0:  # deterministic: kept, as the policy intends (no recompute of the expensive op)
        assert save_matmuls(None, FUSED, torch.ones(1), torch.ones(1), 0.0) == CheckpointPolicy.MUST_SAVE
    else:
        assert ck.draws_random_numbers(FUSED, (None, None, p), {})


def test_sdpa_kernels_with_dropout_are_recomputed():
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.ones(1)
    save_matmuls = ck.notebook_variants()["save_matmuls"]
    assert save_matmuls(None, op, q, q, q, None, True, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert save_matmuls(None, op, q, q, q, None, True, 0.0) == CheckpointPolicy.MUST_SAVE
    assert save_matmuls(None, op, q, q, q, None, True, dropout_p=0.2) == CheckpointPolicy.PREFER_RECOMPUTE
    assert save_matmuls(None, torch.ops.aten.mm.default, q, q) == CheckpointPolicy.MUST_SAVE


# ---------------------------------------------------------------------------------------------------- row 6
@pytest.mark.parametrize("gpu", PROFILES, indirect=True)
def test_budget_models_a_card_not_just_the_allocator(gpu):
    """Row 6: an 8 GiB allocator cap is a bigger card than a student's 8 GB one (the CUDA context and library
    workspaces live outside the allocator). The cap is now 8 GiB minus what lives outside it here."""
    info = lenv.set_memory_budget(8)
    p = gpu.profile
    assert info["outside_allocator_bytes"] == p.outside and "measured" in info["how"]
    assert info["allocator_cap_bytes"] + p.outside == pytest.approx(int(round(7.78 * GiB)), abs=2)  # a real 8 GB card
    assert lu.card_allocator_bytes(8) == info["allocator_cap_bytes"]
    assert lenv.environment()["gpu"]["outside_allocator_bytes"] == p.outside


def test_budget_falls_back_to_a_documented_default(monkeypatch):
    monkeypatch.setattr(dev, "_state", {})
    fake_cuda.install(monkeypatch, "t4", mem_info_fails=True)
    info = lenv.set_memory_budget(8)
    assert info["outside_allocator_bytes"] == dev.DEFAULT_OUTSIDE_ALLOCATOR_BYTES and "default" in info["how"]


@pytest.mark.parametrize("raw", ["-8", "nan", "inf", "eight"])
def test_bad_budget_variable_is_refused_with_its_name(monkeypatch, raw):
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", raw)
    with pytest.raises(ValueError, match="LAB_GPU_MEMORY_GB"):
        dev.budget_from_env()


@pytest.mark.parametrize("raw", ["", "0", " 0.0 "])
def test_zero_or_empty_budget_means_no_cap(monkeypatch, raw):
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", raw)
    assert dev.budget_from_env() is None


# ---------------------------------------------------------------------------------------------------- row 7
def _event(i, name, start, end, device_type="CPU", thread=0, kernel_us=0):
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent
    e = FunctionEvent(i, name, thread=thread, start_us=start, end_us=end, device_type=getattr(DeviceType, device_type),
                      is_user_annotation=device_type == "CUDA", use_device="cuda")
    if kernel_us:
        e.append_kernel(f"{name} kernel", 0, kernel_us)
    return e


def test_profiler_ranges_once_each_with_gpu_time():
    """Row 7: with CUDA activity each range is recorded on the CPU and again as a GPU annotation (two rows in
    key_averages), and both copies see only kernels launched from the range's own thread: backward's are
    launched by autograd's worker thread, so its device time read ~0."""
    events = [_event(1, "forward", 0, 100), _event(2, "forward", 5, 180, "CUDA"),
              _event(3, "aten::mm", 10, 20, kernel_us=50),                        # forward's matmul, main thread
              _event(4, "backward", 100, 200), _event(5, "backward", 180, 182, "CUDA"),  # annotation: ~0
              _event(6, "MmBackward0", 110, 150, thread=7, kernel_us=90),         # autograd's thread
              _event(7, "aten::mm", 115, 140, thread=7, kernel_us=70),            # its child: self time counts once
              _event(8, "optimizer_step", 200, 230), _event(9, "aten::_fused_adamw_", 205, 220, kernel_us=30)]
    for parent, child in ((events[5], events[6]),):
        parent.append_cpu_child(child)
    rows = profiling.range_times(events)
    assert [r["range"] for r in rows] == ["forward", "backward", "optimizer_step"]
    assert [r["calls"] for r in rows] == [1, 1, 1]
    assert rows[0]["device time (ms)"] == pytest.approx(0.05)
    assert rows[1]["device time (ms)"] == pytest.approx(0.16) and rows[1]["cpu time (ms)"] == pytest.approx(0.1)
    assert rows[2]["device time (ms)"] == pytest.approx(0.03)
    cpu_only = [e for e in events if e.device_type.name == "CPU"]
    assert all(r["device time (ms)"] is None for r in profiling.range_times([_event(1, "forward", 0, 9)]))
    assert len(profiling.range_times(cpu_only)) == 3


# ---------------------------------------------------------------------------------------------------- row 8
def test_backward_allocations_are_attributed_to_their_autograd_node(gpu):
    """Row 8: with stacks="python", allocations made during backward have no frames: "(no stack)" topped the
    table. The course records C++ frames too and names the backward node that allocated."""
    assert dev.record_history(True, stacks="all")
    assert gpu.recording["stacks"] == "all"
    gpu.alloc(10 * MiB, [{"filename": "/work/labs/model.py", "line": 3, "name": "forward"}])
    gpu.alloc(30 * MiB, [{"filename": "/pytorch/torch/csrc/autograd/generated/Functions.cpp", "line": 0,
                          "name": "torch::autograd::generated::MmBackward0::apply(...)"},
                         {"filename": "/pytorch/torch/csrc/autograd/engine.cpp", "line": 0,
                          "name": "torch::autograd::Engine::evaluate_function(...)"}])
    gpu.alloc(5 * MiB, [{"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main"}])
    gpu.alloc(2 * MiB, [])  # stacks="python" (the default): backward's allocations have no frame at all
    summary = profiling.trace_summary(dev.snapshot())
    sites = [r["site"] for r in summary["top_at_peak"]]
    assert sites[0] == "backward: MmBackward0" and "backward (autograd engine)" in sites
    assert "backward (autograd thread: no Python frames)" in sites and "(no stack)" not in sites
    assert dev.record_history(False) and gpu.recording is None


# ---------------------------------------------------------------------------------------------------- row 9
def test_release_frees_pinned_host_memory(gpu):
    """Row 9: CPU offload pins host RAM that lu.release() never returned (only the device cache was emptied)."""
    gpu.host_pinned = 6 * GiB
    lu.release()
    assert gpu.host_empty_calls == 1 and dev.pinned_host_bytes() == 0


def test_a_pinned_allocation_error_that_is_not_oom_is_raised(gpu):
    """Row 9, corrected (issue 20): only an out-of-memory failure of a pinned allocation is an OOM row (see
    tests/test_card_budget.py). Under the pretend GPU the pinned allocation fails for another reason, on either
    build (no driver, no host allocator): that error is raised as it is, not relabelled as out of memory. The
    offload is lab 03's own (its cells' code), its runs caught as labutils' training loop catches them."""
    from labutils.core.memory import oom_caught

    model = torch.nn.Linear(4, 4)
    undo = ck.notebook_variants()["offload"]().apply(model)  # a GPU is there: the saved input goes to pinned memory
    with pytest.raises(RuntimeError) as caught:
        with oom_caught():
            model(torch.randn(2, 4, requires_grad=True))
    undo()
    assert not isinstance(caught.value, torch.OutOfMemoryError) and not dev.is_oom(caught.value)
    assert dev.is_oom(torch.OutOfMemoryError("x")) and dev.is_oom(RuntimeError("cudaHostAlloc failed"))
    assert not dev.is_oom(RuntimeError("shape mismatch")) and not dev.is_oom(ValueError("out of memory"))


# --------------------------------------------------------------------------------------------------- row 10
@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_honours_the_budget_variable(gpu, monkeypatch, root, command):
    """Row 10: `python -m labutils run/bench` ignored LAB_GPU_MEMORY_GB while the results reported it."""
    from labutils.tools import bench, cli
    train = sys.modules["labutils.core.train"]  # (lu.train is the function)

    seen = {}

    def fake_run(cfg, *a, **k):  # training itself cannot run on a pretend GPU; the budget is what is tested
        seen["fraction"] = gpu.fraction
        return train.RunResult(config=cfg.to_dict(), env={}, status="oom", error="stand-in")

    monkeypatch.setattr(train, "run", fake_run)
    monkeypatch.setattr(bench, "bench", lambda cfg, **k: fake_run(cfg))
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", "6")
    cli.main([command, str(root / "configs/fp32_config.yaml"), "--set", "train.steps=6"])
    # no 6 GB card in the table: the 8 GB GeForce's 7.78 GiB scaled by 6/8 (README, "模式")
    assert int(seen["fraction"] * gpu.profile.total) + gpu.profile.outside == pytest.approx(int(7.78 * GiB * 6 / 8), abs=8)


def test_cli_refuses_a_bad_budget_variable(monkeypatch, root, capsys):
    from labutils.tools import cli
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", "lots")
    assert cli.main(["run", str(root / "configs/fp32_config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "LAB_GPU_MEMORY_GB" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ the device module, end to end
def pretend_nvidia_smi(directory, monkeypatch, lines=("NVIDIA GeForce RTX 3070, 570.86.15",), code=0,
                       sleep=0.0) -> None:
    """An executable ``nvidia-smi`` first on PATH (in ``directory``), answering the device module's query as the real
    one does: ``--query-gpu=name,driver_version --format=csv,noheader`` prints one "name, driver_version" line per
    GPU (e.g. "NVIDIA GeForce RTX 3070, 570.86.15"); any other arguments exit 2. ``code`` != 0: what it does when
    it cannot reach the driver (exit 9 with NVIDIA's message); ``sleep``: a hung driver."""
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "nvidia-smi"
    body = "\n".join(f"echo '{line}'" for line in lines)
    if code:
        body = ("echo 'NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
                "the latest NVIDIA driver is installed and running.'")
    exe.write_text("#!/bin/sh\n"
                   '[ "$*" = "--query-gpu=name,driver_version --format=csv,noheader" ] || '
                   '{ echo "pretend nvidia-smi: unexpected arguments $*" >&2; exit 2; }\n'
                   f"sleep {sleep}\n{body}\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(dev, "_state", {})  # the probe is asked once per process: ask this one


def _fake_nvidia_smi(tmp_path, monkeypatch):
    pretend_nvidia_smi(tmp_path / "driver", monkeypatch)


def exercise_device_module(monkeypatch, tmp_path, profile: str) -> None:
    """Every function of labutils.core.device under a pretend GPU of ``profile``, then on the CPU; also lu.setup()
    with a cap, environment(), the tracker, lab 04's cap context and the snapshot helpers."""
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        gpu = fake_cuda.install(m, profile)
        _fake_nvidia_smi(tmp_path, m)
        m.setenv("LAB_GPU_MEMORY_GB", "8")
        m.setenv("LAB_SMOKE", "yes")
        assert dev.detect_mode() == ("smoke", "LAB_SMOKE=1")
        m.delenv("LAB_SMOKE")
        assert dev.detect_mode() == ("full", "CUDA GPU found") and dev.unusable_gpu() is None
        info = lu.setup(verbose=False)
        assert info["gpu"]["driver"] == "570.86.15"
        assert dev.default_device().type == "cuda" and dev.is_cuda("cuda") and dev.resolve("cuda:0").index == 0
        with lu.MemoryTracker("cuda") as mt:
            a = gpu.alloc(100 * MiB)
            mt.mark("allocated")
            gpu.free(a)
        assert mt.peak_bytes - mt.start_bytes == 100 * MiB and mt.reserved_bytes >= 100 * MiB
        assert mt.timeline[0][1] == 100 * MiB
        assert dev.allocated() == 0 and dev.peak_allocated() == 100 * MiB
        dev.reset_peak()
        assert dev.peak_allocated() == 0 and dev.reserved() >= 0
        assert dev.memory_stats()["allocated_bytes.all.current"] == 0
        free, total = dev.mem_info()
        assert free < total == dev.total_memory() == gpu.profile.total
        cap_before = dev.get_cap_fraction()
        with dev.memory_cap(dev.card_allocator_bytes(4)):
            assert dev.cap_bytes() <= 4 * GiB
            with pytest.raises(torch.OutOfMemoryError):
                gpu.alloc(5 * GiB)
        assert dev.get_cap_fraction() == cap_before
        with cm.memory_budget(2 * GiB) as cpu_budget:
            assert cpu_budget is None and dev.cap_bytes() <= 2 * GiB
        assert dev.current_budget()["card_gib"] == 8.0
        gpu.host_pinned = 123
        assert dev.pinned_host_bytes() == 123
        lu.release()
        assert dev.pinned_host_bytes() == 0 and gpu.empty_cache_calls > 0 and gpu.sync_calls > 0
        assert dev.record_history(True) and gpu.recording["stacks"] == "python"
        gpu.alloc(MiB, [{"filename": "/x/lab.py", "line": 1, "name": "f"}])
        snap = dev.snapshot()
        assert snap["device_traces"][0][0]["size"] == MiB
        assert dev.dump_snapshot(tmp_path / "s.pickle") and (tmp_path / "s.pickle").stat().st_size > 0
        dev.record_history(False)
        ok_bf16, why = dev.bf16_support()
        ok_tf32, why_tf = dev.tf32_support()
        assert ok_bf16 == ok_tf32 == (gpu.profile.major >= 8) and gpu.profile.name in why + why_tf
        assert dev.name() == gpu.profile.name and dev.pin_memory_default("cuda")
        assert lu.precisions.get("bf16").native()[0] == ok_bf16
        assert lu.amp_precision()[0] == ("bf16" if ok_bf16 else "fp16")  # a GPU without BF16: FP16, never FP32
        assert dev.capability() == (gpu.profile.major, gpu.profile.minor)
        env = lenv.environment()
        assert env["gpu"]["compute_capability"] == f"{gpu.profile.major}.{gpu.profile.minor}"
        assert dev.set_cap_fraction(1.5) == 1.0 and dev.card_budget(None) is None
        with pytest.raises(ValueError):
            dev.card_budget(0)
        # torch < 2.8 has no get_per_process_memory_fraction: the module remembers what it set
        m.delattr(torch.cuda, "get_per_process_memory_fraction")
        dev.set_cap_fraction(0.25)
        assert dev.get_cap_fraction() == 0.25
    # the same functions on a machine without a GPU (whatever this one has, or a session's pretend GPU)
    with monkeypatch.context() as m:
        fake_cuda.no_gpu(m)
        exercise_cpu_branches(monkeypatch, tmp_path)


def exercise_cpu_branches(monkeypatch, tmp_path) -> None:
    assert dev.default_device().type == "cpu" and not dev.is_cuda()
    with monkeypatch.context() as m:
        m.delenv("LAB_SMOKE", raising=False)
        assert dev.detect_mode()[0] == "smoke" and "no CUDA GPU" in dev.detect_mode()[1]
    assert dev.allocated() is None and dev.peak_allocated() is None and dev.reserved() is None
    assert dev.memory_stats() == {} and dev.mem_info() is None and dev.total_memory() is None
    assert dev.get_cap_fraction() is None and dev.set_cap_fraction(0.5) is None and dev.cap_bytes() is None
    assert dev.card_budget(8) is None and dev.outside_allocator_bytes()[0] == 0
    assert dev.card_allocator_bytes(8) == int(round(7.78 * GiB))  # nothing outside an allocator on the CPU
    with dev.memory_cap(5) as b:
        assert b == 5
    dev.synchronize()
    dev.reset_peak()
    dev.empty_caches()
    assert dev.pinned_host_bytes() is None and not dev.record_history(True)
    assert dev.snapshot() is None and not dev.dump_snapshot(tmp_path / "none.pickle")
    assert isinstance(dev.bf16_support("cpu")[0], bool) and "BF16" in dev.bf16_support("cpu")[1]
    assert not dev.tf32_support("cpu")[0] and dev.name("cpu") == "CPU"
    assert dev.facts("cpu") is None and not dev.pin_memory_default("cuda")
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        m.setenv("PATH", str(tmp_path / "empty"))
        assert dev.driver_version() is None and dev.unusable_gpu() is None
    exercise_driver_probe(monkeypatch, tmp_path)


def exercise_driver_probe(monkeypatch, tmp_path) -> None:
    """A GPU torch cannot use (issue 29): the driver (a pretend nvidia-smi) sees one while torch sees none."""
    for build in ("13.0", None):  # pip's default CUDA 13 build on an old driver; a CPU-only build
        with monkeypatch.context() as m:
            fake_cuda.no_gpu(m)
            m.delenv("LAB_SMOKE", raising=False)
            m.delenv("CUDA_VISIBLE_DEVICES", raising=False)
            pretend_nvidia_smi(tmp_path / "old-driver", m, lines=("NVIDIA GeForce RTX 3070, 470.256.02",))
            m.setattr(torch.version, "cuda", build)
            info = dev.unusable_gpu()
            assert info["driver"] == "470.256.02" and info["torch_cuda"] == build
            assert "470.256.02" in info["message"] and "RTX 3070" in info["message"]
            assert (f"CUDA {build}" if build else "CPU-only build") in info["message"]
            mode, reason = dev.detect_mode()
            assert mode == "smoke" and reason.startswith("WARNING") and "470.256.02" in reason
            m.setenv("CUDA_VISIBLE_DEVICES", "")
            assert "CUDA_VISIBLE_DEVICES" in dev.unusable_gpu()["fix"]


@pytest.mark.parametrize("profile", PROFILES)
def test_device_module_end_to_end(monkeypatch, tmp_path, profile):
    exercise_device_module(monkeypatch, tmp_path, profile)


# ------------------------------------------------------------------------- the driver's view (nvidia-smi), issue 29
def test_driver_gpus_are_read_from_nvidia_smi(monkeypatch, tmp_path):
    """Two GPUs, as nvidia-smi prints them; the driver's version from the first. Breaks if the probe asks another
    query (the pretend nvidia-smi refuses it) or splits a name."""
    pretend_nvidia_smi(tmp_path, monkeypatch,
                       lines=("NVIDIA H100 80GB HBM3, 570.86.15", "NVIDIA A100-SXM4-80GB, 570.86.15"))
    assert dev.driver_gpus() == [{"name": "NVIDIA H100 80GB HBM3", "driver": "570.86.15"},
                                 {"name": "NVIDIA A100-SXM4-80GB", "driver": "570.86.15"}]
    assert dev.driver_version() == "570.86.15"


@pytest.mark.parametrize("how", ["absent", "no-driver", "hung", "refuses-the-query"])
def test_driver_probe_never_fails(monkeypatch, tmp_path, how):
    """No nvidia-smi (a CPU machine, macOS), one that cannot reach the driver (exit 9), one that hangs (answered
    within the short timeout, not waited on), one that prints usage: no GPU seen, nothing raised."""
    import time

    if how == "absent":
        monkeypatch.setattr(dev, "_state", {})
        monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    elif how == "no-driver":
        pretend_nvidia_smi(tmp_path, monkeypatch, code=9)
    elif how == "hung":
        pretend_nvidia_smi(tmp_path, monkeypatch, sleep=30)
        monkeypatch.setattr(dev, "NVIDIA_SMI_TIMEOUT_S", 0.5)
    else:
        pretend_nvidia_smi(tmp_path, monkeypatch)
        monkeypatch.setattr(dev, "NVIDIA_SMI_QUERY", ["nvidia-smi", "--query-gpu=name"])
    t0 = time.perf_counter()
    assert dev.driver_gpus() is None and dev.driver_version() is None
    assert time.perf_counter() - t0 < 10


def test_a_gpu_torch_cannot_use_is_named_not_quietly_the_cpu(monkeypatch, tmp_path):
    """The driver sees a GPU, torch does not (pip's CUDA 13 torch on an old driver): the mode's reason is a WARNING
    naming the driver's version, torch's CUDA version and the fix. Before, it was "no CUDA GPU found" and the labs
    ran the CPU smoke configuration without a word."""
    exercise_driver_probe(monkeypatch, tmp_path)


def test_no_warning_where_torch_uses_the_gpu_or_no_driver_sees_one(gpu, monkeypatch, tmp_path):
    pretend_nvidia_smi(tmp_path, monkeypatch)
    assert dev.unusable_gpu() is None and dev.detect_mode() == ("full", "CUDA GPU found")
    fake_cuda.no_gpu(monkeypatch)
    monkeypatch.setattr(dev, "_state", {})
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert dev.unusable_gpu() is None and dev.detect_mode()[1].startswith("no CUDA GPU found")


def exercise_compile_support(monkeypatch) -> None:
    """No Triton (native Windows): torch.compile cannot compile for a CUDA GPU; the CPU needs none."""
    import importlib.util

    assert dev.compile_support("cpu")[0]
    with monkeypatch.context() as m:
        fake_cuda.install(m, "rtx3070-8gb")
        real = importlib.util.find_spec
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
        ok, why = dev.compile_support("cuda")
        assert not ok and "Triton" in why and "Windows" in why
        m.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
        assert dev.compile_support("cuda") == (True, "Triton is installed")


def test_compile_support_names_a_missing_triton(monkeypatch):
    exercise_compile_support(monkeypatch)


def test_setup_says_so_loudly(monkeypatch, tmp_path, capsys):
    """Each notebook's setup cell: the warning on stderr (Jupyter shows it in red), the mode line pointing at it."""
    fake_cuda.no_gpu(monkeypatch)
    monkeypatch.delenv("LAB_SMOKE", raising=False)
    monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    pretend_nvidia_smi(tmp_path, monkeypatch, lines=("NVIDIA GeForce RTX 3070, 470.256.02",))
    info = lu.setup(seed=0)
    out, err = capsys.readouterr()
    assert info["mode"] == "smoke"
    assert err.startswith("WARNING") and "470.256.02" in err and "CUDA 13.0" in err and "Fix:" in err
    assert "mode: smoke (see the WARNING above" in out


@pytest.mark.skipif(sys.gettrace() is not None, reason="another tracer (coverage or a debugger) is running")
def test_device_module_fully_covered(monkeypatch, tmp_path):
    """The pretend GPU runs 100 % of labutils/core/device.py's and device_facts.py's lines (the report is printed)."""
    import importlib

    import labutils.core.device_facts as facts
    coverage = pytest.importorskip("coverage")
    cov = coverage.Coverage(include=[dev.__file__, facts.__file__], data_file=None)
    cov.start()
    try:
        importlib.reload(facts)  # module-level lines count too
        importlib.reload(dev)
        for profile in PROFILES:
            exercise_device_module(monkeypatch, tmp_path, profile)
        with monkeypatch.context() as m:
            m.setattr(dev, "_state", {})
            fake_cuda.install(m, "t4", mem_info_fails=True)
            assert "default" in dev.outside_allocator_bytes()[1]
            assert dev.fp16_support("cuda")[0]  # every CUDA GPU computes FP16 (the T4's tensor cores)
        dev.is_oom(RuntimeError("x")), dev.is_oom(torch.OutOfMemoryError("x"))
        test_driver_gpus_are_read_from_nvidia_smi(monkeypatch, tmp_path / "probe")
        exercise_compile_support(monkeypatch)
        from test_card_budget import exercise_card_budget  # the card budget's lines (h2's tests)
        exercise_card_budget(monkeypatch)
        for native in (True, False):  # the CPU's FP16 answer both ways (only oneDNN's check replaced)
            with monkeypatch.context() as m:
                m.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: native)
                assert facts.fp16_support("cpu")[0] is native
        for raw in ("8", "x", ""):
            with monkeypatch.context() as m:
                m.setenv("LAB_GPU_MEMORY_GB", raw)
                try:
                    dev.budget_from_env()
                except ValueError:
                    pass
    finally:
        cov.stop()
    import io
    report = io.StringIO()
    percent = cov.report(show_missing=True, file=report)
    print(report.getvalue())
    assert percent == 100.0, report.getvalue()


# ------------------------------------------------------------------------------------- the one place, enforced
def _code(text: str) -> str:
    """Source without comments and ``literal`` spans (docstrings name torch.cuda functions to explain them)."""
    import re
    return "\n".join(re.sub(r"``[^`]*``", "", line.split("#", 1)[0]) for line in text.splitlines())


def test_no_torch_cuda_call_outside_the_device_module(root):
    """Every CUDA call of labutils goes through labutils/core/device.py (and device_facts.py, its lowest layer); the
    doctor's checks (doctor_checks.py) are the one exception: they call the raw torch.cuda functions that lab 04
    shows students, to confirm them on a real GPU."""
    import re
    offenders = {p.name: sorted(set(re.findall(r"torch\.cuda\.[\w.]+\(", _code(p.read_text()))))
                 for p in (root / "labutils").rglob("*.py")
                 if p.name not in ("device.py", "device_facts.py", "doctor_checks.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_raw_cuda_calls_in_notebooks_are_lab04_lessons_checked_by_doctor(root):
    import json
    import re
    doctor = "".join(next((root / "labutils").rglob(f)).read_text() for f in ("doctor_checks.py", "device.py", "device_facts.py"))
    for nb in sorted(root.glob("[0-9][0-9]-*.ipynb")):
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        calls = set(re.findall(r"torch\.cuda\.([\w.]+)\(", _code(code)))
        if not nb.name.startswith("04-"):
            assert not calls, f"{nb.name}: raw torch.cuda calls {calls}; use labutils.core.device"
        for call in calls:
            assert f"torch.cuda.{call}(" in doctor, f"{nb.name} calls torch.cuda.{call}, which doctor never checks"
