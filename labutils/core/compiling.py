"""``train.compile: true`` that really compiles, says how much it compiled, and falls back to eager out loud.

* dynamo does not compile a frame met under a non-infra ``TorchDispatchMode`` (the CPU tracker, ``FlopCounterMode``)
  and marks its code skipped for the process: :func:`compile_for_training` calls ``torch._dynamo.reset()`` first, so
  each run compiles its own graphs, its graph count and compile time its own.
* A backend that cannot work (no Triton on CUDA, no C++ compiler on CPU): :func:`backend_problem` compiles a two-op
  function first; if that fails the run trains eagerly with one warning (``RunResult.compile_fallback``).
* dynamo's own counters count the graphs; a run that compiled none warns and says so in ``compile_fallback``.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

DEFAULT_BACKEND = "inductor"


class CompileWarning(RuntimeWarning):
    """``train.compile: true`` did not compile (backend unavailable, or no graph compiled)."""


def _counters():
    from torch._dynamo.utils import counters

    return counters


def compiled_graphs() -> int:
    """How many graphs torch.compile (dynamo) has compiled in this process so far: dynamo's own counter."""
    return _counters()["stats"]["unique_graphs"]


def graph_breaks() -> Counter:
    """Graph-break reasons dynamo has recorded in this process so far (reason -> count): a copy."""
    return Counter(_counters()["graph_break"])


def backend_problem(device, backend: str = DEFAULT_BACKEND) -> str | None:
    """Why torch.compile's ``backend`` cannot work on ``device`` (one line), or None when it can.

    Compiles and runs ``gelu(x * 2) + 1`` on the device, reaching inductor's device scheduling (Triton on CUDA, the C++
    compiler on the CPU) as the model would. Only ``BackendCompilerFailed`` counts; anything else propagates."""
    from torch._dynamo.exc import BackendCompilerFailed

    def probe(x):
        return torch.nn.functional.gelu(x * 2.0) + 1.0

    try:
        torch.compile(probe, backend=backend, dynamic=False)(torch.ones(8, device=device))
    except BackendCompilerFailed as exc:  # one line: the backend's own error, not dynamo's wrapper
        inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
        text = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {text[0] if text else ''}"[:300]
    return None


@dataclass
class CompileRun:
    """One run's torch.compile: what it asked, whether it fell back, and what dynamo compiled during the run."""
    backend: str
    fallback: str | None = None            # why the run trained eagerly although compile was asked
    graphs_at_start: int = 0
    breaks_at_start: Counter = field(default_factory=Counter)

    @property
    def active(self) -> bool:
        return self.fallback is None

    def graphs(self) -> int:
        """Graphs compiled since the run started (dynamo's counter)."""
        return compiled_graphs() - self.graphs_at_start

    def breaks(self) -> list[str]:
        """Graph breaks since the run started: "reason (xN)"."""
        now = graph_breaks()
        now.subtract(self.breaks_at_start)
        return [f"{reason} (x{n})" for reason, n in now.items() if n > 0]

    def finish(self, result) -> None:
        """Record the graph count and graph breaks in ``result`` (a RunResult); warn if nothing compiled."""
        if not self.active:
            result.compiled_graphs, result.compile_fallback = 0, self.fallback
            return
        result.compiled_graphs, result.graph_breaks = self.graphs(), self.breaks()
        if result.compiled_graphs == 0 and result.losses:
            result.compile_fallback = (f"train.compile is true but torch.compile ({self.backend}) compiled no graph "
                                       "in this run: every step ran eagerly")
            warnings.warn(f"[labutils] {result.compile_fallback}", CompileWarning, stacklevel=3)


def compile_for_training(model: torch.nn.Module, device, backend: str = DEFAULT_BACKEND) -> CompileRun:
    """``model.compile()`` in place (same parameters and state_dict keys) after clearing dynamo's state; or, when the
    backend cannot work on ``device``, no compile and one :class:`CompileWarning`. Returns what to count."""
    torch._dynamo.reset()  # skip marks left by earlier dispatch modes (see the module docstring)
    problem = backend_problem(device, backend)
    if problem is not None:
        why = (f"train.compile: the torch.compile backend '{backend}' cannot work on {torch.device(device).type} "
               f"({problem}); trained eagerly instead (on a CUDA machine without Triton, e.g. native Windows, "
               "install triton or set train.compile: false)")
        warnings.warn(f"[labutils] {why}", CompileWarning, stacklevel=3)
        return CompileRun(backend, fallback=why)
    model.compile(backend=backend)
    return CompileRun(backend, graphs_at_start=compiled_graphs(), breaks_at_start=graph_breaks())


def cpu_compile_untracked(device, compiled: bool, track_memory: bool, cpu_budget_bytes) -> str | None:
    """Why a run's memory goes untracked (compiled steps on the CPU), or None. A CPU budget cannot be enforced on
    compiled steps: refused (ValueError) rather than ignored."""
    if not compiled or torch.device(device).type == "cuda":
        return None
    if cpu_budget_bytes is not None:
        raise ValueError("cpu_budget_bytes (a simulated CPU memory budget) cannot be enforced on compiled steps: the "
                         "CPU tracker does not see inside compiled kernels; set train.compile: false for this run")
    return ("not tracked: on the CPU the memory tracker counts tensor storages through torch's dispatcher, which "
            "compiled (inductor) kernels bypass, and dynamo does not compile under it; compiled steps are not tracked "
            "on the CPU (train.compile: false measures the eager step)") if track_memory else None
