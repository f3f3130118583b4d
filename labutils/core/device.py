"""Every difference between a CUDA GPU and the CPU that labutils needs, in one place.

No other labutils module calls ``torch.cuda`` but its lowest layer, :mod:`labutils.core.device_facts`; a notebook may,
where that API is its lesson (each such call is a ``doctor`` check). Each function takes a device (or None: the
default) and does the CPU equivalent, or returns None; CUDA functions always get an explicit device *index*.

Memory budget (:func:`card_budget`, "behave like a G-GB card"): the allocator is capped at what torch reports on such
a card (:mod:`labutils.core.cards`) minus what lives outside the allocator on *this* GPU (context, handles, kernels),
measured with ``cudaMemGetInfo``; cuBLAS workspaces count like tensors; other processes' memory is named, not taken.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess

import torch

from . import cards
from .cards import budget_from_env  # noqa: F401 (dev.budget_from_env: LAB_GPU_MEMORY_GB, one rule)
from .device_facts import (bf16_support, capability, compile_support, cuda_available, default_device,  # noqa: F401
                           fp16_support, is_cuda, name, pin_memory_default, resolve, tf32_support)

GiB = 2**30
# Memory outside the caching allocator (CUDA context, cuBLAS/cuDNN handles and kernels) when it cannot be
# measured: within the 0.3-0.8 GiB range seen on consumer and datacentre cards with recent drivers.
DEFAULT_OUTSIDE_ALLOCATOR_BYTES = GiB // 2
# One process's share outside the allocator stays well under this (context + library handles + kernels, about
# 0.3-1 GiB): more, measured with cudaMemGetInfo, means other processes hold memory on the GPU.
ONE_PROCESS_OUTSIDE_MAX_BYTES = int(1.5 * GiB)
_state: dict = {}  # outside-allocator measurement, cap we set (torch < 2.8 cannot read it back)


# ------------------------------------------------------------------------------------------------- which device
def detect_mode() -> tuple[str, str]:
    """("smoke" | "full", reason). The mode follows the device: smoke when LAB_SMOKE=1 (or true/yes/on) or when
    there is no CUDA GPU, full on a CUDA GPU. The labs' setup cell decides it once; configs take their sizes from it."""
    if os.environ.get("LAB_SMOKE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "smoke", "LAB_SMOKE=1"
    if not cuda_available():
        unusable = unusable_gpu()
        if unusable:  # the driver sees a GPU that this torch cannot use: never a quiet CPU run
            return "smoke", unusable["message"] + "; running the tiny smoke configuration on the CPU"
        return "smoke", "no CUDA GPU found: running the tiny smoke configuration on the CPU"
    return "full", "CUDA GPU found"


# How long nvidia-smi may take to answer (it can take a second or two on a large machine without persistence mode)
NVIDIA_SMI_TIMEOUT_S = 5.0
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]


def driver_gpus() -> list[dict] | None:
    """The GPUs the NVIDIA driver sees (:data:`NVIDIA_SMI_QUERY`), independent of torch: ``[{"name", "driver"}]``,
    or None when nvidia-smi is absent, fails, lists nothing or times out. Asked once per process."""
    if "driver_gpus" not in _state:
        try:
            out = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
            lines = out.stdout.splitlines() if out.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):  # not installed, not executable, or too slow
            lines = []
        gpus = [{"name": name.strip(), "driver": driver.strip()}
                for name, sep, driver in (line.rpartition(",") for line in lines) if sep and name.strip()]
        _state["driver_gpus"] = gpus or None
    return _state["driver_gpus"]


def unusable_gpu() -> dict | None:
    """None unless the NVIDIA driver sees a GPU (:func:`driver_gpus`) that torch cannot use (e.g. a driver too old for
    pip's CUDA 13 torch): then ``{"gpus", "driver", "torch_cuda", "fix", "message"}``."""
    if cuda_available():
        return None
    gpus = driver_gpus()
    if not gpus:
        return None
    driver, built = gpus[0]["driver"], torch.version.cuda
    if built is None:
        fix = ("this torch is a CPU-only build: install a CUDA build of torch (the selector on "
               "https://pytorch.org/get-started/locally/ gives the command)")
    else:
        fix = (f"a torch built for CUDA {built} needs a driver that supports CUDA {built}: update the NVIDIA driver "
               f"(nvidia-smi's header shows the newest CUDA version driver {driver} supports), or install a torch "
               f"built for that CUDA version or older (https://pytorch.org/get-started/locally/)")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        fix = f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU from torch: unset it; otherwise {fix}"
    names = ", ".join(g["name"] for g in gpus)
    message = (f"WARNING: the NVIDIA driver {driver} sees {names}, but this torch {torch.__version__} "
               f"(CUDA {built or 'none: a CPU-only build'}) cannot use it (torch.cuda.is_available() is False). "
               f"Fix: {fix}")
    return {"gpus": gpus, "driver": driver, "torch_cuda": built, "fix": fix, "message": message}


def _index(device) -> int:
    return resolve(device).index


# ------------------------------------------------------------------------------------------------------- memory
def synchronize(device=None) -> None:
    """Wait for the GPU's queued work (timings and memory readings are only real after it); no-op on CPU."""
    if is_cuda(device):
        torch.cuda.synchronize(_index(device))


def allocated(device=None) -> int | None:
    """Bytes of live tensors the caching allocator holds now (None on CPU: see ``MemoryTracker``)."""
    return torch.cuda.memory_allocated(_index(device)) if is_cuda(device) else None


def peak_allocated(device=None) -> int | None:
    """Peak of :func:`allocated` since the last :func:`reset_peak` (None on CPU)."""
    return torch.cuda.max_memory_allocated(_index(device)) if is_cuda(device) else None


def peak_reserved(device=None) -> int | None:
    """Peak of :func:`reserved` since the last :func:`reset_peak`: what the cap limits (None on CPU)."""
    return torch.cuda.max_memory_reserved(_index(device)) if is_cuda(device) else None


def reset_peak(device=None) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(_index(device))


def reserved(device=None) -> int | None:
    """Bytes the caching allocator has taken from the driver (live tensors + cached free blocks)."""
    return torch.cuda.memory_reserved(_index(device)) if is_cuda(device) else None


def memory_stats(device=None) -> dict:
    """The allocator's counters (``torch.cuda.memory_stats``); {} on CPU."""
    return torch.cuda.memory_stats(_index(device)) if is_cuda(device) else {}


def mem_info(device=None) -> tuple[int, int] | None:
    """(free, total) bytes of the whole GPU as the driver sees it (other processes included); None on CPU."""
    return torch.cuda.mem_get_info(_index(device)) if is_cuda(device) else None


def total_memory(device=None) -> int | None:
    return torch.cuda.get_device_properties(_index(device)).total_memory if is_cuda(device) else None


def empty_caches(device=None) -> None:
    """Return cached blocks to the driver: the device allocator's, pinned host memory (``save_on_cpu``'s, which
    ``empty_cache`` never frees) and the cuBLAS workspaces (they come back at the next matmul, inside whatever region
    measures it, instead of passing for memory an earlier section left)."""
    if not cuda_available():
        return
    synchronize(device)
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # CUDA builds (torch >= 1.13)
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # torch >= 2.5
        torch._C._host_emptyCache()


def pinned_host_bytes() -> int | None:
    """Bytes of pinned host memory the caching host allocator holds (None without CUDA)."""
    if not cuda_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)))


# ------------------------------------------------------------------------------------------------ memory budget
def get_cap_fraction(device=None) -> float | None:
    """The allocator's cap as a fraction of the card (1.0 = none); None on CPU."""
    if not is_cuda(device):
        return None
    i = _index(device)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):  # torch >= 2.8
        return float(torch.cuda.get_per_process_memory_fraction(i))
    return _state.get(("fraction", i), 1.0)


def set_cap_fraction(fraction: float, device=None) -> float | None:
    """Cap the allocator at ``fraction`` of the card (clamped to [0, 1]); returns what was set (None on CPU)."""
    if not is_cuda(device):
        return None
    i = _index(device)
    fraction = float(min(1.0, max(0.0, fraction)))
    torch.cuda.set_per_process_memory_fraction(fraction, i)
    _state[("fraction", i)] = fraction
    return fraction


def cap_bytes(device=None) -> int | None:
    """What the allocator may hold under the current cap (the card's total without one); None on CPU."""
    if not is_cuda(device):
        return None
    return int(get_cap_fraction(device) * total_memory(device))


def gpu_processes(device=None) -> tuple[list[tuple[int, int]] | None, str]:
    """([(pid, bytes)], how) of the processes using this GPU, as NVML lists them; (None, why) when it cannot tell
    (nvidia-ml-py missing, NVML refusing, or a list without this process although it holds a CUDA context).
    ([], ...) on the CPU, or before this process made a context."""
    held = torch.cuda.is_initialized()  # this process held a CUDA context before this call (resolving makes one)
    if not is_cuda(device):
        return [], "no GPU"
    try:
        text = torch.cuda.list_gpu_processes(_index(device))
    except Exception as exc:  # NVMLError_NotSupported / NoPermission, or a None memory that the printout divides
        first = (str(exc).splitlines() or [""])[0][:80]
        return None, f"NVML cannot list processes ({type(exc).__name__}: {first})"
    procs = [(int(m[1]), int(float(m[2]) * 2**20))
             for m in re.finditer(r"process\s+(\d+) uses\s+([0-9.]+) MB GPU memory", text)]
    if not procs and "no processes are running" not in text:
        return None, (text.strip().splitlines() or ["NVML gave no answer"])[-1][:100]
    if not procs and held:  # this process holds a context, so an empty list is not this GPU's
        return None, ("NVML lists no process although this one holds a CUDA context (a container or WSL hides "
                      "them): unknown")
    return procs, "NVML (torch.cuda.list_gpu_processes)"


def other_processes(device=None) -> dict:
    """Memory that *other* processes hold on this GPU: ``{"bytes", "processes": [(pid, bytes)], "how"}``; ``bytes`` None
    when NVML cannot list processes (:func:`gpu_processes`) or its list lacks this process's pid (a container without
    ``--pid=host`` lists the host's pids: this process would pass for another one)."""
    procs, how = gpu_processes(device)
    if procs is None:
        return {"bytes": None, "processes": [], "how": how}
    if procs and os.getpid() not in (pid for pid, _ in procs):
        return {"bytes": None, "processes": [],
                "how": f"NVML's pids ({', '.join(str(pid) for pid, _ in procs)}) are not this process's namespace "
                       f"(container?): its pid {os.getpid()} is not among them"}
    others = [(pid, n) for pid, n in procs if pid != os.getpid()]
    return {"bytes": sum(n for _, n in others), "processes": others, "how": how}


def outside_allocator_bytes(device=None, refresh: bool = False) -> tuple[int, str]:
    """(bytes, how measured) of GPU memory this process uses outside the caching allocator, once per process after
    CUDA and cuBLAS init: (total - free) - reserved - what other processes hold (when NVML can tell). Lazily loaded
    kernels add more in the first training step: ``refresh=True`` (:func:`follow_outside`)."""
    if not is_cuda(device):
        return 0, "no CUDA context on the CPU"
    i = _index(device)
    if refresh or ("outside", i) not in _state:
        how = "measured with cudaMemGetInfo after CUDA and cuBLAS init"
        try:
            # Real kernels: the pretend GPU of the tests stops at the line above; `doctor` runs these on a GPU.
            a = torch.ones(64, 64, device=f"cuda:{i}")
            (a @ a).sum().item()  # pragma: no cover  (loads cuBLAS: its handle and kernels live outside the allocator)
            del a  # pragma: no cover
        except RuntimeError:  # measure all the same, without the libraries' share
            how = "measured with cudaMemGetInfo after CUDA init (cuBLAS not loaded)"
        others = other_processes(device)
        _state[("others", i)] = others
        try:
            free, total = torch.cuda.mem_get_info(i)
            used = int(total - free - torch.cuda.memory_reserved(i))
            if others["bytes"] is not None and others["bytes"] > used:  # more than the driver says is used
                others = _state[("others", i)] = {"bytes": None, "processes": [],
                    "how": f"NVML's other processes ({others['bytes'] / GiB:.2f} GiB) exceed what the driver "
                           f"reports used outside this allocator ({used / GiB:.2f} GiB): not comparable"}
            if others["bytes"] is None:
                how += f"; other processes' memory counted in ({others['how']})"
            elif others["bytes"]:
                how += f"; {others['bytes'] / GiB:.2f} GiB of other processes left out"
            _state[("outside", i)] = (max(0, used - (others["bytes"] or 0)), how)
        except RuntimeError as exc:  # a driver that cannot answer: the documented default
            _state[("outside", i)] = (DEFAULT_OUTSIDE_ALLOCATOR_BYTES,
                                      f"default {DEFAULT_OUTSIDE_ALLOCATOR_BYTES / GiB:.1f} GiB "
                                      f"(could not measure: {str(exc).splitlines()[0][:80]})")
    return _state[("outside", i)]


def other_processes_notice(device=None) -> str | None:
    """One line naming memory that other processes hold on this GPU (None when there is none to name): it is not
    part of the student's card, and it can make the budget unreachable here."""
    if not is_cuda(device):
        return None
    i = _index(device)
    outside, how = outside_allocator_bytes(device)
    others = _state.get(("others", i)) or other_processes(device)
    if others["bytes"]:
        names = ", ".join(f"pid {pid}: {n / GiB:.2f} GiB" for pid, n in others["processes"])
        return (f"NOTICE: other processes hold {others['bytes'] / GiB:.2f} GiB on this GPU ({names}), e.g. a second "
                f"notebook kernel left open: the budget leaves them out, but this GPU may run out before the cap; "
                f"close them (nvidia-smi lists them)")
    if others["bytes"] is None and outside > ONE_PROCESS_OUTSIDE_MAX_BYTES and "default" not in how:
        return (f"NOTICE: {outside / GiB:.2f} GiB on this GPU is outside this process's allocator, more than one "
                f"process's CUDA context (< {ONE_PROCESS_OUTSIDE_MAX_BYTES / GiB:.1f} GiB): another process (a second "
                f"notebook kernel?) probably holds memory, and it shrinks this budget; {others['how']}; "
                f"nvidia-smi lists them")
    return None


def card_allocator_bytes(gb: float, device=None) -> int:
    """What PyTorch's allocator can hold on a card sold as ``gb`` GB: its total (:mod:`labutils.core.cards`) minus
    what lives outside the allocator here (on the CPU, nothing)."""
    return max(0, cards.card_total_bytes(gb)[0] - outside_allocator_bytes(device)[0])


def card_budget(gb: float | None, device=None) -> dict | None:
    """Make this GPU behave like a card sold as ``gb`` GB (> 0): cap the allocator at :func:`card_allocator_bytes`,
    never above a lower cap already set. Returns what was done (recorded with results; None on CPU or when ``gb``
    is None): card_gib, card_total_bytes, rule, outside_allocator_bytes, how, allocator_cap_bytes, fraction,
    other_processes_bytes, notice."""
    if gb is None or not is_cuda(device):
        return None
    if not gb > 0:
        raise ValueError(f"a card budget must be > 0 GiB, got {gb!r}")
    card_total, rule = cards.card_total_bytes(gb)
    outside, how = outside_allocator_bytes(device)
    total = total_memory(device)
    fraction = min(get_cap_fraction(device), max(0, card_total - outside) / total)
    set_cap_fraction(fraction, device)
    others = _state.get(("others", _index(device)), {})
    info = {"card_gib": float(gb), "card_total_bytes": card_total, "rule": rule,
            "outside_allocator_bytes": outside, "how": how,
            "allocator_cap_bytes": int(fraction * total), "fraction": fraction,
            "other_processes_bytes": others.get("bytes"), "notice": other_processes_notice(device)}
    _state["budget"] = info
    return info


def follow_outside(device=None) -> dict | None:
    """After the first training step: if what lives outside the allocator grew (lazily loaded kernels), lower the
    budget's cap by as much; never raise it. Returns the budget (None without one, or on CPU)."""
    budget = _state.get("budget")
    if budget is None or not is_cuda(device):
        return None
    outside, how = outside_allocator_bytes(device, refresh=True)
    budget["outside_after_first_step_bytes"] = outside
    if outside > budget["outside_allocator_bytes"]:
        total = total_memory(device)
        fraction = min(budget["fraction"], max(0, budget["card_total_bytes"] - outside) / total)
        set_cap_fraction(min(get_cap_fraction(device), fraction), device)
        budget.update(outside_allocator_bytes=outside, how=f"{how}, again after the first training step",
                      allocator_cap_bytes=int(fraction * total), fraction=fraction)
    return budget


def budget_line(info: dict) -> str:
    """The budget in one line for a student (setup, CLI, doctor), with the notice about other processes."""
    line = (f"memory budget: behaving like a {info['card_gib']:g} GB card, which gives torch "
            f"{info['card_total_bytes'] / GiB:.2f} GiB ({info['rule']}); allocator capped at "
            f"{info['allocator_cap_bytes'] / GiB:.2f} GiB, because {info['outside_allocator_bytes'] / GiB:.2f} GiB "
            f"live outside it on this GPU (its CUDA context and kernels; {info['how']}): this GPU's share, not the "
            f"emulated card's, whose context is its own size (a datacentre GPU's is larger than a GeForce's, so the "
            f"cap is a little lower than on the real card); measured again after the first training step")
    return line + ("\n" + info["notice"] if info.get("notice") else "")


def current_budget() -> dict | None:
    """What the last :func:`card_budget` did in this process (None if nothing was capped)."""
    return _state.get("budget")


@contextlib.contextmanager
def memory_cap(budget_bytes: int | None, device=None):
    """Inside the block the allocator holds at most ``budget_bytes`` (never above a cap already set; restored after),
    caches emptied on both sides. Yields None on CUDA, ``budget_bytes`` on CPU (for ``MemoryTracker``)."""
    if budget_bytes is None or not is_cuda(device):
        yield budget_bytes
        return
    previous = get_cap_fraction(device)
    empty_caches(device)
    set_cap_fraction(min(previous, budget_bytes / total_memory(device)), device)
    try:
        yield None
    finally:
        empty_caches(device)
        budget = current_budget()  # follow_outside may have lowered the budget inside the block
        set_cap_fraction(min(previous, budget["fraction"]) if budget else previous, device)


# What a plain RuntimeError says when memory runs out outside the caching allocator (a CUDA call, pinned host
# memory, cuBLAS / cuDNN handles or workspaces) or in the CPU's allocator ("DefaultCPUAllocator: can't allocate").
OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cudahostalloc",
                "defaultcpuallocator: can't allocate memory")


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error: the device allocator's (``torch.OutOfMemoryError``), or one raised outside it as a
    plain RuntimeError (:data:`OOM_MESSAGES`). Any other error is not (callers re-raise it)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in OOM_MESSAGES)


# ------------------------------------------------------------------------------------------- allocator snapshots
def record_history(enabled: bool = True, max_entries: int = 100_000, stacks: str = "python") -> bool:
    """Start (or stop) recording allocator events for :func:`snapshot`. Backward's allocations on autograd's thread
    have no Python frames; ``stacks="all"`` adds C++ frames that name the backward node (slow to symbolise on some
    systems). Returns False on CPU (nothing recorded)."""
    if not cuda_available():
        return False
    if enabled:
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries, stacks=stacks)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)
    return True


def snapshot() -> dict | None:
    """The allocator's snapshot (segments and the recorded trace); None on CPU."""
    return torch.cuda.memory._snapshot() if cuda_available() else None


def dump_snapshot(path: str | os.PathLike) -> bool:
    """Write the snapshot as a pickle for pytorch.org/memory_viz; False on CPU."""
    if not cuda_available():
        return False
    torch.cuda.memory._dump_snapshot(str(path))
    return True


# ------------------------------------------------------------------------------------------ formats and facts
def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (:func:`driver_gpus`), or None."""
    gpus = driver_gpus()
    return gpus[0]["driver"] if gpus else None


def facts(device=None) -> dict | None:
    """The GPU's facts for provenance (None on CPU): name, memory, compute capability, CUDA, driver, budget."""
    device = resolve(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device.index)
    budget = current_budget()
    return {"name": props.name, "total_memory_bytes": props.total_memory,
            "compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
            "driver": driver_version(), "budget_bytes": cap_bytes(device),
            "card_gib": budget["card_gib"] if budget else None,
            "outside_allocator_bytes": budget["outside_allocator_bytes"] if budget else None}
