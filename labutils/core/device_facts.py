"""Which device this is and what it can do: the default device, its index, name and compute capability, native
BF16 / TF32, whether torch.compile can compile for it, whether host copies are pinned. The lowest layer of
:mod:`labutils.core.device`, which imports these names (callers use them from there: ``dev.bf16_support(...)``)."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

CPU_NATIVE = "oneDNN's {} matmuls use them, not autocast's casts or FP32 ops: a step can still be slower than FP32"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda" if cuda_available() else "cpu")


def resolve(device=None) -> torch.device:
    """A ``torch.device`` with an explicit index on CUDA: ``cuda`` -> this process's GPU (``LOCAL_RANK`` under a
    multi-GPU launch, else the current one)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        local = os.environ.get("LOCAL_RANK", "")
        index = int(local) if local.isdigit() and int(local) < torch.cuda.device_count() else None
        device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return device


def is_cuda(device=None) -> bool:
    return resolve(device).type == "cuda"


def _card(device: torch.device) -> tuple[str, int]:
    """("NAME (compute capability M.m)", M) of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device.index)
    return f"{torch.cuda.get_device_name(device.index)} (compute capability {major}.{minor})", major


def bf16_support(device=None) -> tuple[bool, str]:
    """Native BF16 (no emulation) on this device, and a reason a student can read. CUDA: from Ampere (8.0) on. CPU:
    only with BF16 instructions (elsewhere CPU autocast emulates bfloat16, many times slower than FP32)."""
    device = resolve(device)
    if device.type != "cuda":  # native only with BF16 instructions (AVX512-BF16 / AMX): oneDNN's own check
        native = False
        with contextlib.suppress(Exception):  # absent from builds without oneDNN
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        cap = torch.backends.cpu.get_cpu_capability()
        return native, (f"this CPU ({cap}) has native BF16 instructions: {CPU_NATIVE.format('BF16')}" if native else
                        f"this CPU ({cap}) has no native BF16: autocast would emulate bfloat16 (correct, but many "
                        f"times slower than FP32)")
    card, major = _card(device)
    return major >= 8, (f"{card} has native BF16" if major >= 8 else
                        f"{card} has no native BF16 (needs Ampere, 8.0, or newer)")


def fp16_support(device=None) -> tuple[bool, str]:
    """Whether ``device`` computes FP16 in hardware, and why. Every CUDA GPU does; a CPU only with AVX512-FP16 or
    AMX-FP16 (oneDNN's own check). Elsewhere autocast's FP16 matmuls are emulated."""
    if (torch.device(device) if device is not None else default_device()).type == "cuda":
        return True, "CUDA GPUs compute FP16 in hardware (tensor cores from Volta, sm_70)"
    native = False
    with contextlib.suppress(Exception):  # absent from builds without oneDNN
        native = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if native:
        return True, f"this CPU has native FP16 instructions (AVX512-FP16 / AMX-FP16): {CPU_NATIVE.format('FP16')}"
    return False, ("this CPU has no FP16 arithmetic (no AVX512-FP16 / AMX-FP16): autocast's FP16 is emulated, each "
                   "matmul converting to FP32 inside, far slower than FP32 itself")


def tf32_support(device=None) -> tuple[bool, str]:
    device = resolve(device)
    if device.type != "cuda":
        return False, "TF32 is a tensor-core format of NVIDIA Ampere and newer GPUs; this run has no GPU"
    card, major = _card(device)
    return major >= 8, f"{card} has TF32 tensor cores" if major >= 8 else f"{card} predates Ampere: no TF32"


def name(device=None) -> str:
    """The GPU's name as the driver reports it (what ``peak_tflops`` matches), or "CPU"."""
    device = resolve(device)
    return torch.cuda.get_device_name(device.index) if device.type == "cuda" else "CPU"


def compile_support(device=None) -> tuple[bool, str]:
    """Whether ``torch.compile`` (inductor) can compile for this device, and why not: on a CUDA GPU inductor writes
    Triton kernels, and native Windows has no Triton (the fast path's compile raises there). The CPU needs none."""
    if not is_cuda(device):
        return True, "CPU: inductor generates C++, no Triton needed"
    if importlib.util.find_spec("triton") is None:
        return False, ("torch.compile on a CUDA GPU generates Triton kernels and Triton is not installed here "
                       "(native Windows has no Triton build): use Linux or WSL2, where pip's torch brings Triton")
    return True, "Triton is installed"


def pin_memory_default(device_type: str) -> bool:
    """Whether host copies for ``device_type`` should be pinned (only with a GPU: pinning needs its driver)."""
    return device_type == "cuda" and cuda_available()


def capability(device=None) -> tuple[int, int] | None:
    """The GPU's compute capability (major, minor) as torch reports it; None on the CPU."""
    device = resolve(device)
    return tuple(torch.cuda.get_device_capability(device.index)) if device.type == "cuda" else None
