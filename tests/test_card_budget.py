"""``--gpu-memory-gb G`` models a real G GB card, checked against facts from outside the code.

Oracles: the totals torch printed on real cards in public out-of-memory messages (written out here and in
tests/fake_cuda.py's profiles, each with its issue), torch's own fraction-to-bytes rule (c10/cuda/
CUDACachingAllocator.cpp, ``allowed_memory_maximum = static_cast<size_t>(fraction * device_total)``: the
pretend GPU enforces ``int(fraction * total)`` on *reserved* memory, with the allocator's rounding, pools,
caching and cuBLAS workspaces as that file and aten/src/ATen/cuda/CublasHandlePool.cpp have them; see the section
"torch's allocator rules" below), and the pretend GPU's own ground truth (``profile.outside``: what
its driver reports as used outside the allocator, which the implementation has to measure through
``cudaMemGetInfo``).
"""
from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

import fake_cuda
from labutils.core import cards
from labutils.core import device as dev

GiB, MiB = 2**30, 2**20
# "X GiB total capacity" as torch printed it on real cards (the issues are cited in labutils/core/cards.py)
PUBLISHED = {"RTX 3070 (8 GB)": 7.78, "Colab T4 (16 GB)": 14.56, "H100 80GB HBM3": 79.11, "A100 80GB": 79.25}
EIGHT_GB_CARD = int(round(7.78 * GiB))  # akshitac8/OW-DETR#46, meta-llama/codellama#82 (RTX 3070, Linux)


def torch_limit(gpu) -> int:
    """What the caching allocator may hold under the fraction torch was given (torch's rule, see above)."""
    return int(gpu.fraction * gpu.profile.total)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(dev, "_state", {})
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    return monkeypatch


def fake_nvml(procs=None, refuses: bool = False):
    """A stand-in for nvidia-ml-py (the NVML driver library that ``torch.cuda.list_gpu_processes`` imports):
    ``procs`` = [(pid, bytes)]; ``refuses`` = NVML in WSL / some containers (not supported)."""
    class NVMLError(Exception):
        pass

    def running(handle):
        if refuses:
            raise NVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=n) for pid, n in procs or []]
    return SimpleNamespace(NVMLError_DriverNotLoaded=NVMLError, nvmlInit=lambda: None,
                           nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetComputeRunningProcesses=running)


# --------------------------------------------------------------------------------------------- the card table
def test_card_table_holds_the_published_totals():
    """Breaks if a total in the table is mistyped (it must appear, as torch printed it, in a cited issue), is
    not a real card's (at or above the size sold, in GiB), or disagrees with the figures above."""
    for c in cards.CARDS:
        assert c.sources and all(re.match(r"[\w.-]+/[\w.-]+#\d+: ", s) for s in c.sources), c.key
        if c.torch_total_gib is not None:
            assert any(f"{c.torch_total_gib:.2f} GiB" in s for s in c.sources), c.key
            assert c.total_bytes < c.sold_as_gb * GiB
    assert cards.BY_KEY["geforce-8gb"].torch_total_gib == PUBLISHED["RTX 3070 (8 GB)"]
    assert cards.BY_KEY["t4"].torch_total_gib == PUBLISHED["Colab T4 (16 GB)"]
    assert cards.BY_KEY["h100-80gb"].torch_total_gib == PUBLISHED["H100 80GB HBM3"]
    assert cards.BY_KEY["a100-80gb"].torch_total_gib == PUBLISHED["A100 80GB"]
    # the pretend GPU's profiles were transcribed from the same issues, separately
    for key, prof in (("geforce-8gb", "rtx3070-8gb"), ("t4", "t4"), ("h100-80gb", "h100")):
        assert abs(cards.BY_KEY[key].total_bytes - fake_cuda.PROFILES[prof].total) < 6 * MiB


def test_a_g_gb_card_is_what_users_have():
    """Breaks if 8 became 8 GiB again, if an 80 GB card were the larger A100 figure (a row fitting there would
    not fit on an H100), or if a size outside the table were silently taken as G GiB."""
    assert cards.card_total_bytes(8)[0] == EIGHT_GB_CARD < 8 * GiB
    total, rule = cards.card_total_bytes(80)
    assert total == int(round(79.11 * GiB)) and "h100-80gb" in rule
    total, rule = cards.card_total_bytes(6)  # nearest card (8 GB) scaled: the README states this rule
    assert total == int(7.78 * GiB * 6 / 8) and "scaled" in rule and "no 6 GB card" in rule
    total, rule = cards.card_total_bytes(24)  # the L4 has no torch figure: nearest with one is the 16 GB T4
    assert total == pytest.approx(14.56 * GiB * 24 / 16, abs=2) and "t4" in rule
    with pytest.raises(ValueError, match="> 0"):
        cards.card_total_bytes(0)


# ------------------------------------------------------------------------------------------------ the budget
@pytest.mark.parametrize("profile", list(fake_cuda.PROFILES))
def test_budget_8_follows_the_card_table_on_every_card(fresh, profile, capsys):
    """Under --gpu-memory-gb 8, whatever the card: the allocator limit torch enforces plus what lives outside the
    allocator (the pretend driver's truth) is what a real 8 GB card gives torch. Breaks if the budget is 8 GiB,
    if the outside memory is not measured (or counted twice), or if the fraction is rounded the wrong way."""
    gpu = fake_cuda.install(fresh, profile)
    info = dev.card_budget(8)
    assert torch_limit(gpu) + gpu.profile.outside == pytest.approx(EIGHT_GB_CARD, abs=2)
    assert info["allocator_cap_bytes"] == torch_limit(gpu)
    print(f"{profile}: total {gpu.profile.total / GiB:.2f} GiB, fraction {gpu.fraction:.6f}, allocator limit "
          f"{torch_limit(gpu) / GiB:.3f} GiB, outside {gpu.profile.outside / GiB:.3f} GiB")
    assert "7.78 GiB" in dev.budget_line(info) and "NOTICE" not in dev.budget_line(info)


@pytest.mark.parametrize("profile", list(fake_cuda.PROFILES))
def test_what_a_program_can_allocate_under_budget_8_fits_a_real_8gb_card(fresh, profile):
    """The allocator's own refusal, not the budget's arithmetic: under --gpu-memory-gb 8, allocate 1 MiB blocks until
    the pretend allocator raises torch.OutOfMemoryError (at torch's int(fraction x total)); what was allocated plus
    what the driver holds outside the allocator must fit the published 7.78 GiB of an RTX 3070 and leave at most one
    block unused. Breaks if the cap models 8 GiB (about 225 MiB too much), or wastes the card (a cap far below)."""
    gpu = fake_cuda.install(fresh, profile)
    dev.card_budget(8)
    held = 0
    with pytest.raises(torch.OutOfMemoryError):
        while True:
            gpu.alloc(MiB)
            held += MiB
    published = int(round(PUBLISHED["RTX 3070 (8 GB)"] * GiB))
    assert published - MiB - 6 * MiB < held + gpu.profile.outside <= published  # torch prints 2 decimals: 5.2 MiB


def test_budget_of_the_card_itself_on_a_t4(fresh):
    """--gpu-memory-gb 16 on Colab's T4 is that T4: the limit is its own total minus what lives outside."""
    gpu = fake_cuda.install(fresh, "t4")
    dev.card_budget(16)
    assert torch_limit(gpu) + gpu.profile.outside == pytest.approx(int(round(14.56 * GiB)), abs=2)


def test_cap_follows_what_grows_outside_after_the_first_step(fresh):
    """After the first step, lazily loaded kernels (attention, fused optimizers: CUDA's lazy module loading) live
    outside the allocator too: the cap must shrink by as much, and never grow back. Breaks if the budget
    keeps its first measurement, or if a later, smaller reading (or a user's lower cap) were raised."""
    gpu = fake_cuda.install(fresh, "h100")
    dev.card_budget(8)
    before = torch_limit(gpu)
    gpu.profile.outside += 72 * MiB  # the driver now reports this much more in use (kernel modules)
    info = dev.follow_outside()
    assert torch_limit(gpu) + gpu.profile.outside == pytest.approx(EIGHT_GB_CARD, abs=2)
    assert before - torch_limit(gpu) == pytest.approx(72 * MiB, abs=2)
    assert info["outside_after_first_step_bytes"] == gpu.profile.outside
    lowered = gpu.fraction
    gpu.profile.outside -= 100 * MiB
    dev.follow_outside()
    assert gpu.fraction == lowered  # never raised
    torch.cuda.set_per_process_memory_fraction(0.01, 0)  # the user's own lower cap
    gpu.profile.outside += 200 * MiB
    dev.follow_outside()
    assert gpu.fraction == 0.01
    with dev.memory_cap(GiB):  # a lab's block restores the budget's (lowered) cap at most, not its old one
        pass
    assert gpu.fraction <= lowered


def test_memory_cap_restores_the_lowered_budget(fresh):
    gpu = fake_cuda.install(fresh, "h100")
    dev.card_budget(8)
    with dev.memory_cap(4 * GiB):
        gpu.profile.outside += 64 * MiB
        dev.follow_outside()
    assert torch_limit(gpu) + gpu.profile.outside == pytest.approx(EIGHT_GB_CARD, abs=2)


def test_train_re_measures_after_the_first_step(monkeypatch):
    """The training loop asks for the new measurement once, after step 0 (before it, the kernels are not
    loaded; later steps add nothing new)."""
    import labutils as lu
    from conftest import tiny_config

    calls = []
    monkeypatch.setattr(dev, "follow_outside", lambda device=None: calls.append(device))
    cfg = tiny_config(train__steps=2)
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    seen = []
    res = lu.train(cfg, loaded.model, ds, "cpu", progress=False, on_step=lambda s, *a: seen.append((s, len(calls))))
    assert seen == [(0, 1), (1, 1)] and res.ok
    assert "peak_reserved_bytes" in res.to_dict() and res.row()["peak_reserved_bytes"] is None  # CPU: none


def test_accelerate_path_re_measures_after_the_first_step(monkeypatch):
    """The same under ``accelerate launch`` (one process on the CPU here: the accelerate engine's own loop in
    labutils.core.train): once, after step 0. Fails if that loop keeps the budget's first measurement."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    import labutils as lu
    from conftest import tiny_config

    calls = []
    monkeypatch.setattr(dev, "follow_outside", lambda device=None: calls.append(device))
    cfg = tiny_config(train__steps=2)
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    seen = []
    res = lu.train(cfg, loaded.model, ds, "cpu", progress=False, accelerator=Accelerator(cpu=True),
                   on_step=lambda s, *a: seen.append((s, len(calls))))
    assert seen == [(0, 1), (1, 1)] and res.ok and res.env["world_size"] == 1


# ------------------------------------------------------------------------------------- other processes
def test_other_processes_are_named_not_charged_to_the_budget(fresh):
    """A second notebook kernel holding 1.2 GiB: NVML lists it; the budget leaves it out (it is not part of a
    student's card) and the printed line names it. Breaks if its memory silently shrinks the cap or goes
    unmentioned."""
    gpu = fake_cuda.install(fresh, "rtx3070-8gb")
    own = gpu.profile.outside
    gpu.profile.outside = own + int(1.2 * GiB)  # the driver's "used" now holds the other kernel too
    fresh.setitem(sys.modules, "pynvml", fake_nvml([(os.getpid(), own), (4242, int(1.2 * GiB))]))
    info = dev.card_budget(8)
    assert info["outside_allocator_bytes"] == pytest.approx(own, abs=MiB)
    assert torch_limit(gpu) + own == pytest.approx(EIGHT_GB_CARD, abs=MiB)
    line = dev.budget_line(info)
    assert "NOTICE" in line and "pid 4242: 1.20 GiB" in line and info["other_processes_bytes"] > GiB


def test_other_processes_are_suspected_where_nvml_refuses(fresh):
    """WSL / containers: NVML refuses to list processes. 2 GiB outside one process's allocator is more than a
    CUDA context: the notice says another process probably holds memory."""
    gpu = fake_cuda.install(fresh, "rtx3070-8gb")
    gpu.profile.outside = 2 * GiB
    fresh.setitem(sys.modules, "pynvml", fake_nvml(refuses=True))
    info = dev.card_budget(8)
    assert dev.gpu_processes()[0] is None and "NVML cannot list" in dev.gpu_processes()[1]
    assert info["notice"] and "probably holds memory" in info["notice"] and "NVML cannot list" in info["notice"]


HOST_PID = 2_000_000_000  # a host pid no process in this namespace has (Linux pids stay below 2**22)


@pytest.mark.parametrize("neighbour", [0, int(1.2 * GiB)], ids=["alone", "with-a-second-kernel"])
def test_a_container_lists_this_process_under_a_host_pid(fresh, neighbour):
    """A container without --pid=host: NVML (real torch.cuda.list_gpu_processes over a stand-in nvidia-ml-py)
    lists this very process under its host pid, which is not os.getpid(). Its memory must not pass for
    another process's. Before the fix it was subtracted as "other": outside became 0, the cap the whole card
    total (too large by this process's context), and the NOTICE named the process itself. The driver's used
    memory (the pretend GPU's truth) equals the NVML list's sum, so only the pid check can catch it."""
    gpu = fake_cuda.install(fresh, "rtx3070-8gb")
    own = gpu.profile.outside
    gpu.profile.outside = own + neighbour
    listed = [(HOST_PID, own)] + ([(HOST_PID + 1, neighbour)] if neighbour else [])
    fresh.setitem(sys.modules, "pynvml", fake_nvml(listed))
    assert dev.gpu_processes()[0] == listed  # torch's printout, parsed back
    info = dev.card_budget(8)
    assert torch_limit(gpu) + own <= EIGHT_GB_CARD + 2  # never more than this process's share of the card
    assert info["outside_allocator_bytes"] == own + neighbour  # the old conservative way: others counted in
    assert info["other_processes_bytes"] is None and "not this process's namespace" in info["how"]
    assert f"pid {HOST_PID}:" not in dev.budget_line(info)
    if neighbour:  # 1.54 GiB outside: the heuristic still suspects a second process, without naming pids
        assert "probably holds memory" in info["notice"] and "container?" in info["notice"]
    else:
        assert info["notice"] is None


def test_others_beyond_what_the_driver_uses_are_unknown(fresh):
    """NVML lists this pid and a neighbour holding 3 GiB, but the driver reports only this process's 350 MiB in
    use outside the allocator (a list that does not describe this card's memory). Subtracting it gave
    max(0, negative) = 0 outside and the whole card total as cap; it must count as unknown instead."""
    gpu = fake_cuda.install(fresh, "rtx3070-8gb")
    own = gpu.profile.outside
    fresh.setitem(sys.modules, "pynvml", fake_nvml([(os.getpid(), own), (4242, 3 * GiB)]))
    info = dev.card_budget(8)
    assert torch_limit(gpu) + own == pytest.approx(EIGHT_GB_CARD, abs=2)
    assert info["other_processes_bytes"] is None and "exceed what the driver reports used" in info["how"]
    assert info["notice"] is None  # 350 MiB outside is one process's context: nothing to suspect


def test_no_notice_when_alone_or_unknown(fresh):
    fake_cuda.install(fresh, "t4")
    fresh.setitem(sys.modules, "pynvml", fake_nvml([]))
    assert not torch.cuda.is_initialized()
    assert dev.gpu_processes()[0] == []  # asked before this process had a context: truly none
    assert dev.other_processes()["bytes"] is None  # asked again, now holding one (the first call made it): unknown
    fresh.delitem(sys.modules, "pynvml")
    assert dev.gpu_processes()[0] is None  # nvidia-ml-py not installed here
    assert dev.card_budget(8)["notice"] is None
    assert dev.other_processes_notice() is None


def test_an_empty_nvml_list_while_this_process_holds_a_context_is_unknown(fresh):
    """NVML lists no process on the GPU although this process holds a CUDA context (the budget made one): the list
    cannot describe this GPU (a container, WSL), so other processes' memory is unknown, not 0. Breaks if an empty
    list is read as "no others" (as before)."""
    fake_cuda.install(fresh, "t4")
    dev.card_budget(8)
    assert torch.cuda.is_initialized()
    fresh.setitem(sys.modules, "pynvml", fake_nvml([]))
    procs, how = dev.gpu_processes()
    assert procs is None and "unknown" in how and "holds a CUDA context" in how
    assert dev.other_processes()["bytes"] is None and dev.other_processes_notice() is None


def test_cpu_has_no_processes_budget_or_reserved():
    assert dev.gpu_processes("cpu") == ([], "no GPU") and dev.other_processes_notice("cpu") is None
    assert dev.follow_outside("cpu") is None and dev.peak_reserved("cpu") is None


def test_peak_reserved_is_the_allocators(monkeypatch):
    """Peak reserved comes from torch's counter (``reserved_bytes.all.peak``), not peak allocated: a 3 MiB request
    takes a 20 MiB segment (kLargeBuffer, for 1-10 MiB requests), which stays reserved after the free."""
    gpu = fake_cuda.install(monkeypatch, "t4")
    addr = gpu.alloc(3 * MiB)
    gpu.free(addr)
    assert dev.peak_reserved() == 20 * MiB and dev.reserved() == 20 * MiB and dev.allocated() == 0


def exercise_card_budget(monkeypatch) -> None:
    """The device module's card-budget lines, run by tests/test_device.py's in-process coverage check too."""
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        m.delitem(sys.modules, "pynvml", raising=False)
        test_other_processes_are_named_not_charged_to_the_budget(m)
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        test_other_processes_are_suspected_where_nvml_refuses(m)
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        m.delitem(sys.modules, "pynvml", raising=False)
        test_no_notice_when_alone_or_unknown(m)
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        test_an_empty_nvml_list_while_this_process_holds_a_context_is_unknown(m)
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        test_cap_follows_what_grows_outside_after_the_first_step(m)
    for neighbour in (0, int(1.2 * GiB)):
        with monkeypatch.context() as m:
            m.setattr(dev, "_state", {})
            test_a_container_lists_this_process_under_a_host_pid(m, neighbour)
    with monkeypatch.context() as m:
        m.setattr(dev, "_state", {})
        test_others_beyond_what_the_driver_uses_are_unknown(m)
    with monkeypatch.context() as m:
        test_peak_reserved_is_the_allocators(m)
    test_cpu_has_no_processes_budget_or_reserved()


# ------------------------------------------------------------------- torch's allocator rules (the pretend GPU)
# Oracle: c10/cuda/CUDACachingAllocator.cpp, not labutils. Each number below is one of its constants or rules:
# kMinBlockSize 512 B (round_size), kSmallSize 1 MiB (get_pool), kSmallBuffer 2 MiB and kLargeBuffer 20 MiB,
# kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB (get_allocation_size), should_split, alloc_block's
# ``total_allocated_memory + size > allowed_memory_maximum`` (reserved memory against the cap),
# release_cached_blocks before an out-of-memory error, setMemoryFraction (1.0: no cap), and
# aten/src/ATen/cuda/CublasHandlePool.cpp's getNewWorkspace (the workspace comes from the caching allocator).
def _counters():
    torch.cuda.init()  # memory_stats answers {} before CUDA is initialised
    s = torch.cuda.memory_stats(0)
    return s["allocated_bytes.all.current"], s["reserved_bytes.all.current"]


@pytest.mark.parametrize("request_bytes,block,segment", [
    (1, 512, 2 * MiB),                                  # below kMinBlockSize: one 512 B block, a small 2 MiB segment
    (1000, 1024, 2 * MiB),                              # rounded up to a multiple of 512 B
    (MiB, MiB, 2 * MiB),                                # kSmallSize itself is small
    (MiB + 1, MiB + 512, 20 * MiB),                     # 1-10 MiB: a 20 MiB segment, split
    (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB, 10 * MiB),                     # kMinLargeAlloc and up: its own segment, rounded to 2 MiB
    (64 * MiB + 1, 64 * MiB + 512, 66 * MiB),           # remainder 2 MiB - 512 B > kSmallSize: split off
])
def test_requests_are_rounded_and_pooled_as_torch_does(monkeypatch, request_bytes, block, segment):
    """What one request adds to allocated (its block) and reserved (its segment). Breaks if the pretend GPU counts
    the bytes asked for (as before: allocated == reserved == request) or segments by another rule."""
    fake_cuda.install(monkeypatch, "t4")
    gpu = fake_cuda.pretend_gpu()
    gpu.alloc(request_bytes)
    assert _counters() == (block, segment)


def test_small_blocks_share_a_segment_and_freed_blocks_stay_reserved(monkeypatch):
    """Two 1 MiB tensors share one 2 MiB segment; freed, they stay reserved (cached) until empty_cache, and a later
    request of the same pool reuses them without a new segment."""
    gpu = fake_cuda.install(monkeypatch, "t4")
    a, b = gpu.alloc(MiB), gpu.alloc(MiB)
    assert _counters() == (2 * MiB, 2 * MiB)
    gpu.free(a)
    gpu.free(b)
    assert _counters() == (0, 2 * MiB)
    free_before = torch.cuda.mem_get_info(0)[0]
    gpu.alloc(1000)
    assert _counters() == (1024, 2 * MiB) and torch.cuda.mem_get_info(0)[0] == free_before
    gpu.free(next(iter(gpu.live)))
    big = gpu.alloc(100 * MiB)
    gpu.free(big)
    assert _counters() == (0, 102 * MiB)
    half = gpu.alloc(50 * MiB)  # best fit in the cached 100 MiB block, split: no new segment
    assert _counters() == (50 * MiB, 102 * MiB)
    torch.cuda.empty_cache()  # only wholly free segments go back: the 2 MiB one
    assert _counters() == (50 * MiB, 100 * MiB)
    gpu.free(half)  # merged with its free neighbour again (try_merge_blocks): 80 MiB fits without a new segment
    gpu.alloc(80 * MiB)
    assert _counters() == (80 * MiB, 100 * MiB)


def test_the_cap_limits_reserved_memory_and_cached_blocks_are_released_first(monkeypatch):
    """Under a cap of 100 MiB: a cached 60 MiB block does not fit a 70 MiB request; 60 + 70 cached + new would pass
    the cap, so the allocator releases the cached segment and retries (num_alloc_retries); then 70 in use + 40 new
    passes the cap with nothing to release: out of memory although 70 + 40 < the card. Breaks if the cap counts
    allocated instead of reserved memory, or if cached memory is never given back before failing."""
    gpu = fake_cuda.install(monkeypatch, "t4")
    torch.cuda.set_per_process_memory_fraction(100 * MiB / gpu.profile.total, 0)
    gpu.free(gpu.alloc(60 * MiB))
    gpu.alloc(70 * MiB)
    stats = torch.cuda.memory_stats(0)
    assert _counters() == (70 * MiB, 70 * MiB) and stats["num_alloc_retries"] == 1
    with pytest.raises(torch.OutOfMemoryError, match="allowed"):
        gpu.alloc(40 * MiB)
    assert torch.cuda.memory_stats(0)["num_ooms"] == 1


def test_a_fraction_of_one_is_no_cap(monkeypatch):
    """setMemoryFraction(1.0) sets no limit (recent torch: std::nullopt): only the card itself, what the driver
    holds outside the allocator included, refuses. Breaks if 1.0 were a cap at the total (the pretend driver would
    then refuse at the total, not at total - outside)."""
    gpu = fake_cuda.install(monkeypatch, "t4")
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert gpu.limit() is None
    room = gpu.profile.total - gpu.profile.outside
    gpu.alloc(room // (2 * MiB) * 2 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as err:
        gpu.alloc(2 * MiB + 1)
    assert "allowed" not in str(err.value)


@pytest.mark.parametrize("profile,workspace", [("rtx3070-8gb", 2 * 4096 * 1024 + 8 * 16 * 1024), ("h100", 32 * MiB)])
def test_cublas_workspaces_come_from_the_caching_allocator(monkeypatch, profile, workspace):
    """One workspace per thread and stream (the main thread's and autograd's backward thread's), each
    ``getChosenWorkspaceSize()`` (":4096:2:16:8" by default, 32 MiB on Hopper) taken through the caching allocator:
    allocated and reserved, never in what cudaMemGetInfo shows outside it. Breaks if the pretend GPU kept them
    outside (as its profiles' comments and the device module's docstring said)."""
    gpu = fake_cuda.install(monkeypatch, profile)
    outside_before = gpu.profile.total - torch.cuda.mem_get_info(0)[0] - _counters()[1]
    gpu.cublas_workspace("main")
    gpu.cublas_workspace("autograd")
    gpu.cublas_workspace("main")  # the same handle and stream: no second workspace
    allocated, reserved = _counters()
    assert allocated == 2 * fake_cuda.round_size(workspace) and reserved >= allocated
    assert gpu.profile.total - torch.cuda.mem_get_info(0)[0] - reserved == outside_before


@pytest.mark.parametrize("request_mib", [1, 4, 64])
@pytest.mark.parametrize("profile", list(fake_cuda.PROFILES))
def test_what_a_program_holds_under_budget_8_by_torchs_rules(fresh, profile, request_mib):
    """Under --gpu-memory-gb 8 a program (two cuBLAS workspaces, then tensors of one size until the allocator
    refuses) holds, by torch's rules: reserved memory at most the cap; reserved + what lives outside the allocator
    at most the published 7.78 GiB of an RTX 3070; and all of the cap but less than one segment of that size
    (2 MiB for 1 MiB tensors, 20 MiB for 4 MiB ones, 64 MiB for 64 MiB ones). Breaks if the cap models 8 GiB,
    lets cached memory pass it, or wastes more than one segment."""
    gpu = fake_cuda.install(fresh, profile)
    dev.card_budget(8)
    cap = torch_limit(gpu)
    gpu.cublas_workspace("main")
    gpu.cublas_workspace("autograd")
    with pytest.raises(torch.OutOfMemoryError):
        while True:
            gpu.alloc(request_mib * MiB)
    allocated, reserved = _counters()
    segment = fake_cuda.allocation_size(fake_cuda.round_size(request_mib * MiB))
    assert allocated <= reserved <= cap
    assert reserved + gpu.profile.outside <= int(round(PUBLISHED["RTX 3070 (8 GB)"] * GiB))
    assert cap - reserved < segment
    assert reserved - allocated < fake_cuda.allocation_size(fake_cuda.round_size(8 * MiB))  # workspace slack only


def test_the_budget_line_says_the_context_subtracted_is_this_gpus(fresh):
    """The emulated card's cap subtracts what lives outside the allocator on *this* GPU (an H100's context is
    larger than a GeForce's): the line says so, with the number."""
    gpu = fake_cuda.install(fresh, "h100")
    line = dev.budget_line(dev.card_budget(8))
    assert f"{gpu.profile.outside / GiB:.2f} GiB" in line and "this GPU" in line and "not the emulated card" in line


# ------------------------------------------------------------------------------ failures a real card produces
@pytest.mark.parametrize("message", [
    "CUDA error: out of memory",                                                     # a lazily loaded kernel module
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",    # cuBLAS handle creation
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
])
def test_ooms_raised_outside_the_allocator_are_ooms(message):
    """The messages torch raises (as plain RuntimeError) when memory runs out outside the caching allocator."""
    assert dev.is_oom(RuntimeError(message))


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",
    "pin_memory=True requires a CUDA or other accelerator backend; no pinned memory allocator is available",
    "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`",
])
def test_other_runtime_errors_are_not_ooms(message):
    assert not dev.is_oom(RuntimeError(message)) and not dev.is_oom(ValueError("out of memory"))


def test_offload_relabels_only_an_out_of_memory_pinned_allocation(monkeypatch):
    """Lab 03's offload (its cells' code) pins host memory where there is a GPU. When cudaHostAlloc fails for want of
    memory (torch.empty is the pinned allocation's entry point) the run is an OOM row, caught as labutils' training
    loop catches it (test_device.py shows the other half: an error that is not OOM is raised)."""
    import labutils.labs.lab03.checkpointing as ck
    from labutils.core.memory import oom_caught

    fake_cuda.install(monkeypatch, "t4")
    real_empty = torch.empty

    def empty(*a, pin_memory=False, **k):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")  # what C10_CUDA_CHECK(cudaHostAlloc(...)) raises
        return real_empty(*a, **k)
    monkeypatch.setattr(torch, "empty", empty)
    model = torch.nn.Linear(4, 4)
    undo = ck.notebook_variants()["offload"]().apply(model)
    with oom_caught() as caught:
        model(torch.randn(2, 4, requires_grad=True))
    undo()
    assert caught.error and "out of memory" in caught.error


def test_run_records_an_oom_outside_the_allocator_as_an_oom_row(monkeypatch):
    """lu.run: cuBLAS failing to allocate its handle is an "oom" row like torch.OutOfMemoryError; any other
    RuntimeError still propagates (a bug must not hide as an OOM). Breaks if run() catches only
    torch.OutOfMemoryError (the cuBLAS case crashed the sweep) or catches every RuntimeError."""
    import labutils as lu
    from conftest import tiny_config

    train_module = sys.modules["labutils.core.train"]
    cfg = tiny_config(train__steps=1)

    def failing(message):
        def train(*a, **k):
            raise RuntimeError(message)
        return train
    monkeypatch.setattr(train_module, "train", failing("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                                       "`cublasCreate(handle)`"))
    res = lu.run(cfg, "cpu", progress=False, verbose=False)
    assert res.status == "oom" and "CUBLAS_STATUS_ALLOC_FAILED" in res.error
    monkeypatch.setattr(train_module, "train", failing("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(RuntimeError, match="shapes"):
        lu.run(cfg, "cpu", progress=False, verbose=False)
