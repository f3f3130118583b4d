"""A pretend GPU for a CPU-only torch: only the driver entry points are replaced, torch's Python layer stays real.

What is replaced: the ``torch._C._cuda_*`` functions a CPU build lacks (device count, init, current device,
synchronize, allocator statistics, memory fraction, snapshots, host allocator), ``torch.cuda._cudart``
(``cudaMemGetInfo``), the device-properties getter that ``_cuda_init`` would install, ``torch.version.cuda``,
and the per-device default generators. What stays real: ``torch.cuda.is_available``, ``_lazy_init``,
``_get_device_index`` (so ``torch.device("cuda")`` without an index is refused where torch refuses it), the
fraction range and type checks of ``set_per_process_memory_fraction``, ``memory_stats`` flattening,
``mem_get_info``, ``_record_memory_history`` / ``_snapshot`` / ``_dump_snapshot``.

Tensors cannot live on the pretend GPU (a CPU build has no CUDA kernels). The pretend allocator follows torch's
caching allocator instead: ``gpu.alloc(n, frames)`` / ``gpu.free(addr)`` / ``empty_cache`` move its counters by
the rules of c10/cuda/CUDACachingAllocator.cpp (``DeviceCachingAllocator``), each cited where it is written
(:class:`CachingAllocator`): requests rounded to 512 B blocks, a small pool of 2 MiB segments, 20 MiB segments
for 1-10 MiB requests, larger ones rounded to 2 MiB; freed blocks stay reserved (cached) until ``empty_cache``
or an allocation that would not fit otherwise; the memory fraction caps *reserved* memory, and a fraction of 1.0
is no cap. cuBLAS workspaces come from the same allocator (``gpu.cublas_workspace()``,
aten/src/ATen/cuda/CublasHandlePool.cpp ``getNewWorkspace``), not from outside it. Trace events are recorded
for snapshots.

Both torch builds: on the CPU build the ``_cuda_*`` entry points are missing (added here); on pip's default CUDA
build without a driver they exist and raise ("Found no NVIDIA driver"), and are replaced the same way. What a real
CUDA tensor does here differs by build (CPU build: ``NotImplementedError``, no CUDA kernels; CUDA build without a
driver: ``RuntimeError``): :meth:`FakeGPU.kernel_failure` tries it, so tests take the expectation from this torch.

Only where no real GPU is: :func:`install` skips the test on a machine with a real CUDA GPU (the pretend driver
is never laid over a real one); there ``python -m labutils doctor`` and the notebooks on CUDA
(.github/workflows/gpu-smoke.yml) run the same paths on the card. :func:`install_session` installs it for a whole
test session (``LAB_PRETEND_GPU=<profile>``, see tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

GiB = 2**30
ON_REAL_GPU = ("a real CUDA GPU is present, so the pretend driver is not installed over it; "
               "`python -m labutils doctor` and the notebooks on CUDA (.github/workflows/gpu-smoke.yml) run these "
               "paths on the card")


@dataclass
class Profile:
    name: str
    total: int
    major: int
    minor: int
    outside: int = 400 * 2**20      # what the CUDA context holds outside the allocator
    mem_info_fails: bool = False     # a driver that cannot answer cudaMemGetInfo


# Totals as torch reports them on real cards ("X GiB total capacity" in public out-of-memory messages; the card
# table labutils/core/cards.py cites each): RTX 3070 7.78 GiB (akshitac8/OW-DETR#46, meta-llama/codellama#82), Colab's
# T4 14.56 GiB (facebookresearch/tribev2#28), H100 80GB HBM3 79.11 GiB (vllm-project/vllm#27508). Written out
# here, not imported, so a test can hold the card table against them. ``outside``: context + libraries, within
# the 0.3-0.6 GiB seen on such cards; a test that models the first step's growth raises it on the profile.
PROFILES = {
    "rtx3070-8gb": Profile("NVIDIA GeForce RTX 3070", int(7.78 * GiB), 8, 6, outside=350 * 2**20),
    "t4": Profile("Tesla T4", int(14.56 * GiB), 7, 5, outside=300 * 2**20),
    "h100": Profile("NVIDIA H100 80GB HBM3", int(79.11 * GiB), 9, 0, outside=520 * 2**20),
}


# The caching allocator's constants, c10/cuda/CUDACachingAllocator.cpp (and c10/core/AllocatorConfig.h in recent
# torch, where they moved), written out here rather than computed from labutils:
K_MIN_BLOCK_SIZE = 512           # kMinBlockSize: "all sizes are rounded to at least 512 bytes" (round_size)
K_SMALL_SIZE = 2**20             # kSmallSize: "largest 'small' allocation is 1 MiB" (get_pool: <= goes small)
K_SMALL_BUFFER = 2 * 2**20       # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
K_LARGE_BUFFER = 20 * 2**20      # kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks"
K_MIN_LARGE_ALLOC = 10 * 2**20   # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2 * 2**20        # kRoundLarge: "round up large allocations to 2 MiB"


def round_size(nbytes: int) -> int:
    """``DeviceCachingAllocator::round_size`` (roundup_power2_divisions unset, the default): at least
    kMinBlockSize, else the next multiple of it."""
    return K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE else -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a rounded request that no cached block holds."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def cublas_workspace_bytes(major: int) -> int:
    """aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize`` without CUBLAS_WORKSPACE_CONFIG:
    ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB), 32 MiB on Hopper (9.x) and Blackwell (10.x and on)."""
    return 32 * 2**20 if major >= 9 else 2 * 4096 * 1024 + 8 * 16 * 1024


@dataclass
class Block:
    segment: int     # the segment's address
    offset: int
    size: int
    allocated: bool = False


@dataclass
class FakeGPU:
    profile: Profile
    allocated: int = 0
    peak: int = 0
    reserved: int = 0
    peak_reserved: int = 0
    fraction: float = 1.0
    fraction_calls: list = field(default_factory=list)
    host_pinned: int = 0
    host_empty_calls: int = 0
    empty_cache_calls: int = 0
    sync_calls: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    recording: dict | None = None
    trace: list = field(default_factory=list)
    live: dict = field(default_factory=dict)       # address -> Block handed out
    segments: dict = field(default_factory=dict)   # address -> [Block, ...] in address order
    small_segments: set = field(default_factory=set)  # addresses of the small pool's segments
    cached: dict = field(default_factory=dict)     # id(block) -> Block: the free blocks of every segment (the pools)
    workspaces: dict = field(default_factory=dict)  # (thread, stream) -> address of its cuBLAS workspace
    next_address: int = 0x7F0000000000  # segments are laid out one after another, never overlapping

    # ------------------------------------------------------------------ what a program does on the GPU
    def limit(self) -> int | None:
        """``setMemoryFraction``: ``allowed_memory_maximum = static_cast<size_t>(fraction * totalGlobalMem)``, and
        none at all for a fraction of 1.0 (recent torch: ``std::nullopt`` unless ``fraction < 1.0``)."""
        return int(self.fraction * self.profile.total) if self.fraction < 1.0 else None

    def _segment_fits(self, nbytes: int) -> bool:
        """``alloc_block``: refused when ``total_allocated_memory + size > allowed_memory_maximum`` (reserved memory,
        cached blocks included, against the cap); otherwise cudaMalloc, which fails when the card itself is full
        (what the driver holds outside the allocator counts there)."""
        limit = self.limit()
        if limit is not None and self.reserved + nbytes > limit:
            return False
        return self.reserved + nbytes + self.profile.outside <= self.profile.total

    def _free_block(self, size: int, small: bool) -> Block | None:
        """``get_free_block``: the smallest cached free block of the request's pool that holds it (best fit)."""
        fits = [b for b in self.cached.values() if b.size >= size and (b.segment in self.small_segments) == small]
        return min(fits, key=lambda b: (b.size, b.segment, b.offset), default=None)

    def release_cached(self) -> int:
        """``release_cached_blocks``: every segment with no block in use goes back to the driver (``emptyCache``,
        and ``malloc``'s last retry before an out-of-memory error). Returns the bytes released."""
        freed = [a for a, blocks in self.segments.items() if not any(b.allocated for b in blocks)]
        popped = [b for a in freed for b in self.segments.pop(a)]
        for b in popped:
            del self.cached[id(b)]
        released = sum(b.size for b in popped)
        self.small_segments.difference_update(freed)
        self.reserved -= released
        return released

    def alloc(self, nbytes: int, frames=None) -> int:
        """``DeviceCachingAllocator::malloc``: round the request, reuse a cached block of its pool, else take a new
        segment (retrying once after releasing every unused cached segment), split off what is left
        (``should_split``), count the *block's* size as allocated (``alloc_found_block``)."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE  # get_pool
        block = self._free_block(size, small)
        if block is None:
            seg_size = allocation_size(size)
            if not self._segment_fits(seg_size):
                self.alloc_retries += 1
                if not (self.release_cached() and self._segment_fits(seg_size)):
                    self.ooms += 1
                    limit = self.limit()
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {seg_size} bytes. GPU 0 has a total capacity of "
                        f"{self.profile.total} bytes. " + (f"{limit} bytes allowed; " if limit is not None else "")
                        + f"Of the allocated memory {self.allocated} bytes is allocated by PyTorch, and "
                        f"{self.reserved - self.allocated} bytes is reserved by PyTorch but unallocated.")
            seg, self.next_address = self.next_address, self.next_address + seg_size
            block = Block(seg, 0, seg_size)
            self.segments[seg] = [block]
            if small:
                self.small_segments.add(seg)
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        # should_split: small pool when >= kMinBlockSize is left, large pool when more than kSmallSize is left
        if (small and remaining >= K_MIN_BLOCK_SIZE) or (not small and remaining > K_SMALL_SIZE):
            blocks = self.segments[block.segment]
            rest = Block(block.segment, block.offset + size, remaining)
            blocks.insert(blocks.index(block) + 1, rest)
            self.cached[id(rest)] = rest
            block.size = size
        block.allocated = True
        self.cached.pop(id(block), None)  # (a new segment's block was never cached)
        addr = block.segment + block.offset
        self.live[addr] = block
        self.allocated += block.size
        self.peak = max(self.peak, self.allocated)
        if self.recording is not None:
            self.trace.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": 0,
                               "frames": list(frames or []), "time_us": len(self.trace)})
        return addr

    def free(self, addr: int) -> None:
        """``free`` / ``free_block``: the block goes back to its pool, merged with free neighbours
        (``try_merge_blocks``); the segment stays reserved."""
        block = self.live.pop(addr)
        block.allocated = False
        self.cached[id(block)] = block
        self.allocated -= block.size
        blocks = self.segments[block.segment]
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # the next block first, so i stays valid for the previous one
            if 0 <= j < len(blocks) and not blocks[j].allocated:
                a, b = sorted((blocks[i], blocks[j]), key=lambda x: x.offset)
                a.size += b.size
                blocks.remove(b)
                del self.cached[id(b)]
                i = blocks.index(a)
        if self.recording is not None:
            self.trace.append({"action": "free_completed", "addr": addr, "size": block.size, "stream": 0,
                               "frames": [], "time_us": len(self.trace)})

    def cublas_workspace(self, thread: str = "main", stream: int = 0) -> int:
        """The cuBLAS workspace a thread's handle gets on first use on a stream (CublasHandlePool.cpp
        ``getNewWorkspace``: ``CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``), held for the
        process's life: inside the allocator, so it counts against the cap like any tensor."""
        key = (thread, stream)
        if key not in self.workspaces:
            self.workspaces[key] = self.alloc(cublas_workspace_bytes(self.profile.major))
        return self.workspaces[key]

    # ------------------------------------------------------------------------------ driver entry points
    def _stats(self, device):
        assert isinstance(device, int), f"the C layer gets an index, got {device!r}"
        def stat(cur, peak):
            return {"all": {"current": cur, "peak": peak, "allocated": peak, "freed": peak - cur}}
        return {"allocated_bytes": stat(self.allocated, self.peak),
                "reserved_bytes": stat(self.reserved, self.peak_reserved),
                "active_bytes": stat(self.allocated, self.peak), "num_alloc_retries": self.alloc_retries,
                "num_ooms": self.ooms}

    def _reset_peak(self, device):
        assert isinstance(device, int)
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def _set_fraction(self, fraction, device):
        assert isinstance(fraction, float) and isinstance(device, int)
        self.fraction = fraction
        self.fraction_calls.append(fraction)

    def _get_fraction(self, device):
        assert isinstance(device, int)
        return self.fraction

    def _empty_cache(self):
        self.empty_cache_calls += 1
        self.release_cached()

    def _clear_workspaces(self):
        """CublasHandlePool.cpp ``clearCublasWorkspaces``: the map of (handle, stream) -> workspace is cleared, each
        workspace's DataPtr freed back to the caching allocator (a cached block until ``empty_cache``)."""
        for addr in self.workspaces.values():
            self.free(addr)
        self.workspaces.clear()

    def _host_empty(self):
        self.host_empty_calls += 1
        self.host_pinned = 0

    def _host_stats(self):
        return {"allocated_bytes": {"current": self.host_pinned, "peak": self.host_pinned},
                "reserved_bytes": {"current": self.host_pinned}}

    def _mem_get_info(self, device):
        if self.profile.mem_info_fails:
            raise RuntimeError("CUDA error: the driver could not be queried (pretend)")
        used = self.profile.outside + self.reserved
        return self.profile.total - used, self.profile.total

    def _record_history(self, enabled, context=None, stacks=None, *rest):
        self.recording = None if enabled is None else {"enabled": enabled, "context": context, "stacks": stacks}
        if enabled is None:
            pass
        else:
            self.trace = []

    def _snapshot(self, *args):
        segments = [{"address": a, "total_size": sum(b.size for b in blocks), "is_large": a not in self.small_segments,
                     "allocated_size": sum(b.size for b in blocks if b.allocated),
                     "blocks": [{"address": a + b.offset, "size": b.size,
                                 "state": "active_allocated" if b.allocated else "inactive"} for b in blocks]}
                    for a, blocks in self.segments.items()]
        return {"segments": segments, "device_traces": [list(self.trace)]}

    def _properties(self, index):
        p = self.profile
        return SimpleNamespace(name=p.name, total_memory=p.total, major=p.major, minor=p.minor,
                               multi_processor_count=80, is_integrated=False)

    def kernel_failure(self) -> type[BaseException] | None:
        """What creating a real CUDA tensor raises under this pretend GPU on this torch build (the pretend driver
        has no kernels): ``NotImplementedError`` on the CPU build, ``RuntimeError`` ("Found no NVIDIA driver")
        on the CUDA build without a driver. None if it succeeded (never, without a driver)."""
        try:
            torch.empty(1, device="cuda:0")
        except Exception as exc:  # noqa: BLE001 - whatever this build raises is the answer
            return type(exc)
        return None  # pragma: no cover

    def install(self, monkeypatch) -> "FakeGPU":
        if real_gpu_present():
            import pytest
            pytest.skip(ON_REAL_GPU)
        C = torch._C
        entry = {
            "_cuda_getDeviceCount": lambda: 1,
            "_cuda_init": lambda: None,
            "_cuda_getDevice": lambda: 0,
            "_cuda_setDevice": lambda i: None,
            "_cuda_exchangeDevice": lambda i: 0,
            "_cuda_maybeExchangeDevice": lambda i: 0,
            "_cuda_synchronize": lambda: setattr(self, "sync_calls", self.sync_calls + 1),
            "_cuda_emptyCache": self._empty_cache,
            "_cuda_clearCublasWorkspaces": self._clear_workspaces,
            "_cuda_memoryStats": self._stats,
            "_cuda_resetPeakMemoryStats": self._reset_peak,
            "_cuda_resetAccumulatedMemoryStats": lambda d: None,
            "_cuda_setMemoryFraction": self._set_fraction,
            "_cuda_getMemoryFraction": self._get_fraction,
            "_cuda_hostMemoryStats": self._host_stats,
            "_host_emptyCache": self._host_empty,
            "_cuda_record_memory_history": self._record_history,
            "_cuda_memorySnapshot": self._snapshot,
            "_cuda_getArchFlags": lambda: "sm_75 sm_80 sm_86 sm_90",
            # torch >= 2.14 (CUDA build): every optimizer.step() asks the accelerator's current stream whether it is
            # being captured into a CUDA graph; the driver would answer (no graph is ever captured here)
            "_accelerator_getDeviceIndex": lambda: 0,
            "_accelerator_getStream": lambda i: SimpleNamespace(is_capturing=lambda: False, device_index=0),
            "_accelerator_synchronizeDevice": lambda i: setattr(self, "sync_calls", self.sync_calls + 1),
            "_cuda_getCurrentRawStream": lambda i: 0,  # the default stream; torch._dynamo imports it on a CUDA torch
        }
        for k, v in entry.items():
            monkeypatch.setattr(C, k, v, raising=False)
        cudart = SimpleNamespace(cudaMemGetInfo=self._mem_get_info,
                                 cudaError=SimpleNamespace(success=0), cudaGetErrorString=str)
        monkeypatch.setattr(torch.cuda, "_cudart", cudart)
        monkeypatch.setattr(torch.cuda, "_get_device_properties", self._properties, raising=False)
        monkeypatch.setattr(torch.cuda, "_exchange_device", lambda i: 0)
        monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", lambda i: 0)
        monkeypatch.setattr(torch.cuda, "_initialized", False)
        monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
        monkeypatch.setattr(torch.cuda, "default_generators", (torch.Generator(),))
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.cuda, MARK, self, raising=False)  # how pretend_gpu() tells it from a real one
        torch.cuda._check_bf16_tensor_supported.cache_clear()
        return self


MARK = "_lab_pretend_gpu"


def pretend_gpu() -> FakeGPU | None:
    """The pretend GPU installed now (by a test or for the session), or None."""
    return getattr(torch.cuda, MARK, None)


def real_gpu_present() -> bool:
    """A real CUDA GPU on this machine (torch sees one and it is not the pretend one)."""
    return pretend_gpu() is None and torch.cuda.is_available()


def install(monkeypatch, profile: str = "rtx3070-8gb", **overrides) -> FakeGPU:
    """Install the pretend GPU of ``profile`` for one test (undone with ``monkeypatch``); the test is skipped,
    with a reason naming what covers it, where a real CUDA GPU is present."""
    base = PROFILES[profile]
    prof = Profile(**{**base.__dict__, **overrides})
    return FakeGPU(prof).install(monkeypatch)


def no_gpu(monkeypatch) -> None:
    """A driver that finds no GPU (device count 0), over whatever is installed (a pretend GPU of the session, or
    a real one): the CPU branches of labutils run as on a machine without a GPU. Driver entry points only."""
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    monkeypatch.setattr(torch.cuda, MARK, None, raising=False)


def install_session(profile: str):
    """Install the pretend GPU of ``profile`` for the rest of the process (``LAB_PRETEND_GPU``, tests/conftest.py).
    Returns (gpu, undo). Refuses with one line on a machine with a real GPU or for an unknown profile."""
    import pytest
    if profile not in PROFILES:
        raise pytest.UsageError(f"LAB_PRETEND_GPU={profile!r}: allowed values are {', '.join(PROFILES)}")
    if real_gpu_present():
        raise pytest.UsageError(f"LAB_PRETEND_GPU={profile!r}: {ON_REAL_GPU}; unset LAB_PRETEND_GPU")
    patcher = pytest.MonkeyPatch()
    return install(patcher, profile), patcher.undo
