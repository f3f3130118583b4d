"""What one training run measured (:class:`RunResult`, what ``--json`` writes), when a run counts as diverged
(:func:`divergence`, one rule for every precision), and the step-time rule every speed reads: the median of the timed
steps (:func:`first_timed_step`, :func:`finish_timing`). :mod:`labutils.core.train` fills them in."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from .compiling import CompileRun
from .config import Config
from .flops import account_flops
from .precisions import get


# Every lu.train of this process since the lab's setup cell (env.setup clears it), one row each: recorded with the
# lab's results ("runs"), which regenerate's time plan (labutils.tools.timeplan) is checked against.
RUN_LOG: list[dict] = []


def log_run(result: "RunResult", cfg: Config, desc: str | None) -> None:
    t, steps, per_step = cfg.train, len(result.losses), result.executed_flops_per_step
    RUN_LOG.append({"desc": desc, "model": cfg.model.name, "precision": t.precision, "micro_batch_size":
                    t.micro_batch_size, "accumulation_steps": t.accumulation_steps, "steps": steps,
                    "executed_flops": steps * per_step if per_step else None,
                    "seconds": sum(result.step_times) + result.untimed_seconds,
                    "config": {f"{s}.{k}": v for s, d in cfg.to_dict().items() for k, v in d.items()}})


class NonFiniteLossError(FloatingPointError):
    pass


STATUSES = ("ok", "oom", "diverged", "skipped")  # lower case everywhere (tables, JSON); prose may say "OOM"
NONFINITE_WINDOW = 3   # diverged: the loss was non-finite on each of the run's last min(3, steps) steps
ALL_SKIPPED_MIN = 5    # diverged: fp16 skipped every step of a run of at least this many steps


def divergence(losses: list, skipped: list, precision: str) -> str | None:
    """Why a finished run counts as diverged, or None. The one rule, whatever the precision:

    - the loss is non-finite on each of the last ``min(NONFINITE_WINDOW, steps)`` steps (fp16's GradScaler may skip an
      overflowing step and recover; the other precisions stop at the first non-finite loss);
    - or every step was skipped (fp16, at least ``ALL_SKIPPED_MIN`` steps): no weight was ever updated."""
    n = len(losses)
    if n == 0:
        return None
    last = losses[-min(NONFINITE_WINDOW, n):]
    if all(not math.isfinite(v) for v in last):
        return (f"the loss was non-finite ({last[-1]}) on the last {len(last)} of {n} steps with precision "
                f"{precision}" + ("; the GradScaler skipped them and did not recover" if get(precision).scaler else "")
                + ". Lower train.lr, set train.max_grad_norm, or check the data")
    if n >= ALL_SKIPPED_MIN and len(set(skipped)) >= n:
        return (f"every one of the {n} steps overflowed in {precision} and was skipped by the GradScaler: no weight "
                "was updated. Lower train.lr, or use bf16 where the GPU supports it")
    return None


@dataclass
class RunResult:
    """Everything one training run measured. ``to_dict()`` is what ``--json`` writes."""
    config: dict
    env: dict
    status: str = "ok"                 # ok | oom | diverged | skipped
    error: str | None = None
    losses: list = field(default_factory=list)        # token-weighted mean loss of each optimizer step
    grad_norms: list = field(default_factory=list)    # global L2 norm of the (unscaled) gradients, pre-clip
    loss_scales: list = field(default_factory=list)   # fp16: GradScaler scale used at each step
    skipped: list = field(default_factory=list)       # fp16: steps skipped because gradients overflowed
    step_times: list = field(default_factory=list)    # seconds, device synchronised: each step's whole wall-clock
    timed_steps: int = 0     # the speed numbers average the last this-many steps; 0: no step was timed (speeds None)
    compile_seconds: float | None = None  # train.compile: extra time of the compiling steps over a timed step
    compiled_graphs: int | None = None    # train.compile: graphs torch.compile compiled in this run (dynamo's count)
    graph_breaks: list = field(default_factory=list)  # train.compile: dynamo's graph-break reasons in this run
    compile_fallback: str | None = None   # train.compile asked, yet the run was eager: why (backend unavailable, ...)
    untimed_seconds: float = 0.0  # between steps, left out of step_times: state_bytes, memory tracker, on_step
    num_alloc_retries: int | None = None  # CUDA: allocator frees-and-retries during the run (near a memory cap)
    tokens_per_step: int = 0          # positions processed per optimizer step (padding included: it is computed)
    target_tokens: list = field(default_factory=list)  # positions that count in the loss, per step
    effective_batch_size: int = 0
    parameters: int = 0
    step_time_seconds: float | None = None   # median of the timed steps (warm-up steps left out)
    tokens_per_second: float | None = None   # = positions_per_second (padding counted); kept for compatibility
    positions_per_second: float | None = None       # every position computed, padding included
    target_tokens_per_second: float | None = None   # positions that count in the loss: the speed to compare
    padding_fraction: float | None = None    # share of the run's positions that were padding
    attention_kernel: str | None = None      # the SDPA kernel this run's attention can use (flash / ... / math)
    achieved_tflops: float | None = None
    # FLOP accounting (labutils.models.gpt2, labutils.core.peaks): MFU = model FLOPs (6N + attention, no recompute, per
    # target token: PaLM's definition) / peak; HFU = executed FLOPs (recompute included, per position) / peak.
    model_flops_per_step: float | None = None     # mean over the timed steps
    executed_flops_per_step: float | None = None
    peak_tflops: float | None = None  # dense peak of the GPU in this precision; None on CPU or an unknown GPU
    mfu: float | None = None
    hfu: float | None = None
    peak_memory_bytes: int | None = None
    peak_reserved_bytes: int | None = None   # CUDA: the allocator's peak reserved, what a memory cap limits
    memory: dict = field(default_factory=dict)

    @property
    def skipped_steps(self) -> int:
        return len(self.skipped)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["skipped_steps"] = self.skipped_steps
        d["avg_loss"] = sum(self.losses) / len(self.losses) if self.losses else None
        d["final_loss"] = self.losses[-1] if self.losses else None
        return d

    def row(self, **extra) -> dict:
        """A flat summary for result tables."""
        t = self.config.get("train", {})
        return {**extra, "model": self.config.get("model", {}).get("name"), "precision": t.get("precision"),
                "micro_batch": t.get("micro_batch_size"), "accum": t.get("accumulation_steps"),
                "checkpointing": t.get("gradient_checkpointing"), "status": self.status,
                "avg_loss": self.to_dict()["avg_loss"], "final_loss": self.to_dict()["final_loss"],
                "step_time_s": self.step_time_seconds, "tokens_per_s": self.tokens_per_second,
                "target_tokens_per_s": self.target_tokens_per_second, "padding_fraction": self.padding_fraction,
                "tflops": self.achieved_tflops, "peak_memory_bytes": self.peak_memory_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "mfu": self.mfu,
                "skipped_steps": self.skipped_steps, "error": self.error,
                **({"compiled_graphs": self.compiled_graphs, "compile_fallback": self.compile_fallback}
                   if t.get("compile") else {})}  # a compiled row says how much compiled, or why it did not


def first_timed_step(steps: int, warmup: int, compile_steps=(), slow_steps: int = 0) -> int:
    """The first step whose time counts: after the ``warmup`` steps and after the last step that compiled (compiling
    is never timed), and after the first ``slow_steps`` (CPU memory tracking) if that leaves a step to time.
    ``steps`` (no step timed) when ``steps <= warmup`` or the last step compiled: never warm-up timed silently."""
    first = max(warmup, max(compile_steps, default=-1) + 1)
    return max(first, slow_steps) if max(first, slow_steps) < steps else first


def finish_timing(result: RunResult, cfg: Config, seq_length: int, device, first: int, compile_steps,
                   real_positions: int, compiling: CompileRun | None = None, model=None) -> None:
    """Step time and speeds over the timed steps ``first..`` (none: they stay None), compile seconds apart;
    ``compiling``: the run's torch.compile; ``model``: the one trained, whose FLOPs are counted (None: the preset)."""
    timed = result.step_times[first:]
    result.timed_steps = len(timed)
    # the course's one step time: the median of the timed steps (an outlier moves a mean, not the median);
    # throughput, TFLOP/s and MFU are all read from it, so a table's speed-up and its tokens/s never disagree
    median = statistics.median(timed) if timed else None
    if compile_steps:  # what the compiling steps took beyond a timed step (all of it when none was timed)
        result.compile_seconds = max(0.0, sum(result.step_times[s] - (median or 0.0) for s in compile_steps))
    elif compiling is not None and compiling.active:
        result.compile_seconds = 0.0
    if compiling is not None:
        compiling.finish(result)
    steps = len(result.target_tokens)
    result.padding_fraction = 1.0 - real_positions / (result.tokens_per_step * steps) if steps else None
    if not timed:
        return
    result.step_time_seconds = median
    result.tokens_per_second = result.positions_per_second = result.tokens_per_step / median
    # target tokens/s: the timed steps' mean target count per median step time
    result.target_tokens_per_second = sum(result.target_tokens[steps - len(timed):]) / len(timed) / median
    account_flops(result, cfg, seq_length, device, len(timed), model)
