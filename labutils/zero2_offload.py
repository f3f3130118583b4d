"""C7, "DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU saves 20-30 % of GPU memory on one GPU": its
estimator prediction (no DeepSpeed needed), whether it can be measured here, and the measurement itself (two
subprocess runs). The verdict is :mod:`labutils.claims`'s (lab 04 builds the entry, :mod:`labutils.profiling_claims`).
"""
from __future__ import annotations

def zero2_offload_prediction(cfg, precision: str = "fp16") -> dict:
    """C7's estimator prediction for ``cfg`` on one GPU: model state per GPU under plain mixed-precision training
    (2P fp16 weights + 2P grads + 12P AdamW/master, ZeRO stage 0) vs ZeRO-2 with the optimizer offloaded to the
    CPU (2P + 2P on the GPU), plus one micro-batch's activations (which neither touches), from
    :func:`labutils.distributed.zero_bytes_per_gpu` and :func:`labutils.estimate.estimate_memory`.

    Returns {"memory_saving": fraction, "plain_bytes": ..., "zero2_offload_bytes": ...}: a prediction.
    """
    from .distributed import zero_bytes_per_gpu
    from .estimate import estimate_memory

    est = estimate_memory(cfg, precision=precision)
    acts = est["activations_bytes"]
    plain = zero_bytes_per_gpu(est["parameters"], 0, 1, False, True)["total"] + acts
    offload = zero_bytes_per_gpu(est["parameters"], 2, 1, True, True)["total"] + acts
    return {"memory_saving": 1 - offload / plain, "plain_bytes": plain, "zero2_offload_bytes": offload}


ZERO2_OFFLOAD_ACCELERATE = "configs/accelerate/deepspeed_zero2_offload.yaml"


def zero2_offload_unavailable() -> str | None:
    """Why C7 cannot be measured here (DeepSpeed on a CUDA GPU is needed), or None when it can."""
    import importlib.util

    from . import device as dev

    missing = [p for p in ("deepspeed", "accelerate") if importlib.util.find_spec(p) is None]
    if not dev.cuda_available():
        return "it needs DeepSpeed on a CUDA GPU, and this machine has no CUDA GPU"
    if missing:
        return (f"it needs DeepSpeed on a CUDA GPU, and {' and '.join(missing)} is not installed "
                "(pip install -e '.[deepspeed]', which needs a CUDA toolkit)")
    return None


def measure_zero2_offload(config: str, overrides: list[str], workdir, *, timeout: int = 1800) -> dict:
    """C7 on one GPU: the same config and batch trained twice in subprocesses, plainly (``python -m labutils
    run``) and under DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (``accelerate launch`` with
    :data:`ZERO2_OFFLOAD_ACCELERATE`). Returns {"plain": run record, "zero2_offload": run record} (the
    ``--json`` records, with ``peak_memory_bytes``) or {"error": why}. Call only when
    :func:`zero2_offload_unavailable` is None."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    launchers = {"plain": [sys.executable, "-m", "labutils"],
                 "zero2_offload": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                   ZERO2_OFFLOAD_ACCELERATE, "--num_processes", "1", "-m", "labutils"]}
    out = {}
    for name, launcher in launchers.items():
        path = Path(workdir) / f"c7-{name}.json"
        path.unlink(missing_ok=True)
        cmd = [*launcher, "run", config, "--quiet", "--json", str(path)] + (["--set", *overrides] if overrides else [])
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the {name} run took longer than {timeout} s"}
        if r.returncode != 0 or not path.is_file():
            tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
            return {"error": f"the {name} run failed (exit {r.returncode}): {tail[:200]}"}
        out[name] = json.loads(path.read_text(encoding="utf-8"))
    return out
