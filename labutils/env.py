"""Where we run: mode (full/smoke), device, GPU facts, versions, seeds, TF32 switches, memory budget."""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import random

import numpy as np
import torch

from .config import smoke_requested


def detect_mode() -> tuple[str, str]:
    """("smoke" | "full", reason). Smoke when LAB_SMOKE=1 or when there is no CUDA GPU."""
    if smoke_requested():
        return "smoke", "LAB_SMOKE=1"
    if not torch.cuda.is_available():
        return "smoke", "no CUDA GPU found: running the tiny smoke configuration on the CPU"
    return "full", "CUDA GPU found"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Native BF16 support (no emulation) and a reason a student can read: one answer per machine, used by
    every lab. A CPU counts as native only with BF16 instructions (AVX512-BF16 / AMX, oneDNN's own check);
    elsewhere CPU autocast still runs bfloat16, emulated: correct, many times slower than FP32."""
    device = torch.device(device or default_device())
    if device.type == "cpu":
        native = False
        with contextlib.suppress(Exception):  # oneDNN's check; absent from builds without oneDNN
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        cap = torch.backends.cpu.get_cpu_capability()
        return native, (f"this CPU ({cap}) has native BF16 instructions (oneDNN)" if native else
                        f"this CPU ({cap}) has no native BF16: autocast would emulate bfloat16 (correct, but many "
                        f"times slower than FP32)")
    try:
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch without the keyword
        ok = torch.cuda.is_bf16_supported()
    name = torch.cuda.get_device_name(device)
    cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return ok, (f"{name} (compute capability {cc}) has native BF16" if ok else
                f"{name} (compute capability {cc}) has no native BF16 (needs Ampere, 8.0, or newer)")


def tf32_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    device = torch.device(device or default_device())
    if device.type != "cuda":
        return False, "TF32 is a tensor-core format of NVIDIA Ampere and newer GPUs; this run has no GPU"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major >= 8:
        return True, f"{name} (compute capability {major}.{minor}) has TF32 tensor cores"
    return False, f"{name} (compute capability {major}.{minor}) predates Ampere: no TF32"


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """Switch TF32 for float32 matmuls/convolutions on (tf32=True) or explicitly off, restoring afterwards."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9 API; the allow_tf32 flags are its legacy view
        saved = (matmul.fp32_precision, conv.fp32_precision)
        matmul.fp32_precision = conv.fp32_precision = "tf32" if tf32 else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = saved
    else:  # pragma: no cover - older torch
        saved = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        try:
            yield
        finally:
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def set_memory_budget(gb: float | None, device: torch.device | str | None = None) -> float | None:
    """Cap this process's CUDA allocations at ``gb`` GiB, so a big card behaves like a small one.

    Returns the fraction set, or None on CPU or when gb is None/0. ``LAB_GPU_MEMORY_GB`` sets it from outside.
    """
    if not gb or not torch.cuda.is_available():
        return None
    device = torch.device(device or "cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gb * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def memory_budget_bytes(device: torch.device | str | None = None) -> int | None:
    """The usable CUDA memory for this process: the budget if one is set, else the card's total."""
    device = torch.device(device or default_device())
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    gb = os.environ.get("LAB_GPU_MEMORY_GB")
    return int(min(total, float(gb) * 2**30)) if gb else total


def _driver_version() -> str | None:
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device | str | None = None, mode: str | None = None, weights: str | None = None) -> dict:
    """Facts that make a measurement reproducible: recorded with every result."""
    import transformers

    device = torch.device(device or default_device())
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "total_memory_bytes": props.total_memory,
               "compute_capability": f"{props.major}.{props.minor}",
               "budget_bytes": memory_budget_bytes(device), "cuda": torch.version.cuda,
               "driver": _driver_version()}
    return {
        "device": device.type,
        "gpu_name": gpu["name"] if gpu else None,
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "mode": mode or detect_mode()[0],
        "weights": weights,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def setup(seed: int = 42, verbose: bool = True) -> dict:
    """The notebooks' setup cell: decide the mode once, apply the memory budget, seed, and print the facts."""
    mode, reason = detect_mode()
    device = default_device()
    budget = os.environ.get("LAB_GPU_MEMORY_GB")
    if budget and device.type == "cuda":
        set_memory_budget(float(budget), device)
    seed_everything(seed)
    from .models import hub_reachable
    hub = hub_reachable()  # before anything imports transformers: sets HF_HUB_OFFLINE when unreachable
    info = environment(device, mode)
    if verbose:
        print(f"mode: {mode} ({reason})")
        if device.type == "cuda":
            g = info["gpu"]
            cap = f", budget {g['budget_bytes'] / 2**30:.1f} GiB" if budget else ""
            print(f"device: cuda, {g['name']} ({g['total_memory_bytes'] / 2**30:.1f} GiB{cap}), "
                  f"compute capability {g['compute_capability']}, CUDA {g['cuda']}")
        else:
            print("device: cpu (no CUDA GPU): numbers below are smoke-test numbers, not GPU results")
        print(f"torch {info['torch']}, transformers {info['transformers']}, python {info['python']}, seed {seed}")
        print("model hub: " + ("reachable (pretrained GPT-2 weights)" if hub else
                               "unreachable, offline mode: random weights of the same architecture "
                               "(memory and speed identical, loss values not comparable to pretrained)"))
    return {"mode": mode, "device": device, **{k: v for k, v in info.items() if k not in ("mode", "device")}}
