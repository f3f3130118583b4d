"""Where we run: mode (full/smoke), device, GPU facts, versions, seeds, TF32 switches, memory budget."""
from __future__ import annotations

import contextlib
import os
import datetime as _dt
import platform
import random
import sys
import time
import warnings

import numpy as np

import torch

from . import device
from .device import detect_mode


# torch 2.10 and 2.11 warn "Profiler clears events at the end of each cycle" on every profile, even one with no
# cycles to clear (pytorch/pytorch#180348, fixed in 2.12): filtered on those two versions only.
FALSE_PROFILER_WARNING = "Warning: Profiler clears events at the end of each cycle"


def quiet_false_profiler_warning(version: str = torch.__version__) -> bool:
    """Filter torch 2.10/2.11's false profiler warning (above); True when ``version`` is one of those."""
    try:
        major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    if (2, 10) <= major_minor < (2, 12):
        warnings.filterwarnings("ignore", message=FALSE_PROFILER_WARNING, category=UserWarning)
        return True
    return False


quiet_false_profiler_warning()


# the device module's answers under the names the labs use; every CUDA/CPU difference stays in labutils.core.device
default_device = device.default_device
set_memory_budget = device.card_budget       # make this GPU behave like a ``gb`` GB card; None on CPU or gb None


def _fp32_precision_switches() -> dict:
    """The new API's per-backend ``fp32_precision`` switches this torch has (torch >= 2.9: cuBLAS matmul, cuDNN conv
    and RNN, oneDNN matmul); {} on torch 2.6-2.8, where reading ``torch.backends.cudnn.conv`` raises."""
    b = torch.backends
    found = {"cuda.matmul": b.cuda.matmul, "cudnn.conv": getattr(b.cudnn, "conv", None),
             "cudnn.rnn": getattr(b.cudnn, "rnn", None), "mkldnn.matmul": getattr(b.mkldnn, "matmul", None)}
    return {k: o for k, o in found.items() if o is not None and hasattr(o, "fp32_precision")}


def _read_or_none(read):
    try:  # torch refuses to read a legacy flag while the legacy and new settings disagree
        return read()
    except RuntimeError:
        return None


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """Switch TF32 for float32 matmuls/convolutions on (tf32=True) or explicitly off, restoring afterwards.

    Inside, every reader agrees, legacy (``allow_tf32``, ``get_float32_matmul_precision``) and new (torch >= 2.9's
    ``fp32_precision``): ATen's legacy getters raise "mix of the legacy and new APIs" when the two disagree. The
    legacy setters update both sides, so they go first; then cuDNN conv and rnn get an explicit "ieee" when off."""
    b = torch.backends
    matmul, cudnn = b.cuda.matmul, b.cudnn
    switches = _fp32_precision_switches()
    saved_new = {k: o.fp32_precision for k, o in switches.items()}
    saved_matmul = _read_or_none(torch.get_float32_matmul_precision)
    saved_cudnn = _read_or_none(lambda: cudnn.allow_tf32)
    matmul.allow_tf32 = tf32
    cudnn.allow_tf32 = tf32
    for k in ("cudnn.conv", "cudnn.rnn"):
        if k in switches:
            switches[k].fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        # legacy values first (their setters also write the new per-backend values), then the new values as
        # they were; a legacy value that could not be read (the caller had mixed the APIs) stays as set above
        if saved_matmul is not None:
            torch.set_float32_matmul_precision(saved_matmul)
        if saved_cudnn is not None:
            cudnn.allow_tf32 = saved_cudnn
        for k, value in saved_new.items():
            switches[k].fp32_precision = value


@contextlib.contextmanager
def progress_bar(steps: int, desc: str, shown: bool = True):
    """``with progress_bar(n, desc) as bar: for step in bar``: a text bar (a widget reopens from a saved notebook as
    "model not found"), on stdout in a kernel (its stderr is red), cleared at the end; a run that stops (out of
    memory, Ctrl-C, an error) says so in one line. No bar where ``$LAB_PROGRESS`` is 0 or off (regenerate)."""
    from tqdm.std import tqdm

    shown = shown and os.environ.get("LAB_PROGRESS", "1").strip().lower() not in ("0", "false", "no", "off")
    out = sys.stdout if type(sys.stdout).__module__.startswith("ipykernel") else sys.stderr
    bar = tqdm(range(steps), desc=desc, disable=not shown, leave=False, file=out)
    try:
        yield bar
    except BaseException as exc:
        bar.close()
        if shown:
            why = "out of memory" if device.is_oom(exc) else "interrupted" * isinstance(exc, KeyboardInterrupt)
            print(f"{desc}: stopped in step {bar.n + 1} of {steps}: {why or type(exc).__name__}", file=out)
        raise
    finally:
        bar.close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def apply_budget_from_env(dev: torch.device | str | None = None) -> dict | None:
    """Apply ``LAB_GPU_MEMORY_GB`` (if set) to this process's GPU: what notebooks and the CLI call first."""
    return device.card_budget(device.budget_from_env(), dev)


def environment(dev: torch.device | str | None = None, mode: str | None = None, weights: str | None = None) -> dict:
    """Facts that make a measurement reproducible: recorded with every result."""
    import transformers

    from ..models.gpt2 import last_tokenizer

    dev = device.resolve(dev)
    gpu = device.facts(dev)
    budget = device.current_budget()
    try:  # the card asked for: applied on a GPU (then in "gpu" too), only recorded on the CPU
        requested = device.budget_from_env()
    except ValueError:
        requested = None
    return {"device": dev.type, "gpu_name": gpu["name"] if gpu else None, "gpu": gpu,
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "mode": mode or detect_mode()[0], "weights": weights,
        "gpu_memory_budget_gb": budget["card_gib"] if budget else requested,
        "tokenizer": last_tokenizer(),  # of the most recent model loaded (run() sets the run's own)
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


SETUP_AT: float | None = None  # time.perf_counter() at the last setup()


def setup(seed: int = 42, verbose: bool = True) -> dict:
    """The notebooks' setup cell: decide the mode once, apply the memory budget, seed, and print the facts."""
    from .run_result import RUN_LOG

    global SETUP_AT
    SETUP_AT = time.perf_counter()  # the lab's elapsed time counts from here (record_results)
    RUN_LOG.clear()  # the lab's training runs since its setup cell
    mode, reason = detect_mode()
    dev = device.resolve(None)
    budget = apply_budget_from_env(dev)
    seed_everything(seed)
    from ..models.gpt2 import hub_reachable
    hub = hub_reachable()  # before anything imports transformers: sets HF_HUB_OFFLINE when unreachable
    info = environment(dev, mode)
    if verbose:
        if reason.startswith("WARNING"):  # a GPU the driver sees and torch cannot use (device.unusable_gpu): loudly
            print(reason, file=sys.stderr, flush=True)
            reason = "see the WARNING above: this is not your GPU"
        print(f"mode: {mode} ({reason})")
        if dev.type == "cuda":
            g = info["gpu"]
            print(f"device: cuda, {g['name']} ({g['total_memory_bytes'] / 2**30:.1f} GiB), "
                  f"compute capability {g['compute_capability']}, CUDA {g['cuda']}")
            if budget:
                print(device.budget_line(budget))
        else:
            print("device: cpu (no CUDA GPU): numbers below are smoke-test numbers, not GPU results")
        print(f"torch {info['torch']}, transformers {info['transformers']}, python {info['python']}, seed {seed}")
        print("new machine? run `python -m labutils doctor` once first: it checks every GPU path the labs use")
        print("model hub: " + ("reachable (pretrained GPT-2 weights)" if hub else
                               "unreachable, offline mode: GPT-2 weights from the local Hugging Face cache if "
                               "they are there, else random weights of the same architecture; the tokenizer "
                               "(GPT-2's BPE), data, shapes, memory and speed are those of an online run, only "
                               "loss values differ"))
    if "ipykernel" in sys.modules:  # a notebook's kernel: what the labs import is no garbage (memory.py says why)
        from .memory import freeze_import_state, set_baseline

        freeze_import_state()
        set_baseline(dev)  # what every measurement of the lab starts from (memory.start_check)
    return {"mode": mode, "device": dev, **{k: v for k, v in info.items() if k not in ("mode", "device")}}
