"""Lab 01 helpers, what mixed precision saves: where one training step's memory goes (what autograd saves under
autocast, the dtypes of the training state), matmul throughput per dtype, the comparison table and figure of
the four precisions, what the speed-ups say (Amdahl, MFU), and the README's expectations and claims C1/C2.

The training step measured here is the notebook's own written-out ``amp_step``, passed in. The numerics
(formats, underflow, overflow, loss scaling) are in :mod:`labutils.precision`.
``import labutils.amp_speed_memory as am``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch

from . import claims as cl
from .env import matmul_precision, seed_everything
from .figures import step_axis, step_numbers
from .memory import MemoryTracker, fmt_bytes, state_bytes
from .peaks import peak_info
from .precision import AMP_DTYPES, COLORS, DTYPE_NAMES

HALF_DTYPES = (torch.float16, torch.bfloat16)
PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------- saved tensors
_VIEW_FNS = {"TBackward0", "TransposeBackward0", "TransposeBackward1", "ViewBackward0", "UnsafeViewBackward0",
             "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "ReshapeAliasBackward0"}


def _skip_views(fn):
    """Follow single-input view/transpose nodes (F.linear saves ``weight.t()``, a view of the cast copy)."""
    for _ in range(8):
        if fn is None or type(fn).__name__ not in _VIEW_FNS:
            return fn
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return fn
        fn = nxt[0]
    return fn


def _is_weight_copy(t: torch.Tensor) -> bool:
    """True for autocast's cast of a parameter (or a view of it): a ``_to_copy`` of a leaf weight."""
    fn = _skip_views(t.grad_fn)
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(getattr(_skip_views(nf), "variable", None) is not None for nf, _ in fn.next_functions if nf is not None)


@dataclass
class SavedTensorCensus:
    """Bytes autograd saves for backward, by kind, each storage counted once.

    kinds: ``parameter`` (a reference to an FP32 weight: no new memory), ``half weight copy`` (autocast's
    FP16/BF16 cast of a weight, kept alive for backward), ``activation fp32`` and ``activation half``.
    """
    param_ptrs: set
    by_kind: dict = field(default_factory=dict)
    _seen: set = field(default_factory=set)

    def pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = st.data_ptr()
        if key in self._seen or st.nbytes() == 0:
            return t
        self._seen.add(key)
        if key in self.param_ptrs:
            kind = "parameter"
        elif _is_weight_copy(t):
            kind = "half weight copy"
        elif t.dtype in HALF_DTYPES:
            kind = "activation half"
        else:
            kind = "activation fp32"
        self.by_kind[kind] = self.by_kind.get(kind, 0) + st.nbytes()
        return t

    def get(self, kind: str) -> int:
        return self.by_kind.get(kind, 0)

    @property
    def new_bytes(self) -> int:
        """Saved bytes that are new memory (everything except references to the weights)."""
        return sum(v for k, v in self.by_kind.items() if k != "parameter")


@contextlib.contextmanager
def saved_tensor_census(model: torch.nn.Module):
    """``with saved_tensor_census(model) as census: loss = model(...)`` then ``census.by_kind``."""
    census = SavedTensorCensus({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda t: t):
        yield census


def dtype_report(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The dtypes the training state is held in: weights, gradients, optimizer state (sets of names)."""
    name = lambda d: DTYPE_NAMES.get(d, str(d))
    out = {"weights": {name(p.dtype) for p in model.parameters()},
           "gradients": {name(p.grad.dtype) for p in model.parameters() if p.grad is not None}}
    if optimizer is not None:
        out["optimizer state"] = {name(v.dtype) for s in optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor) and v.dim() > 0}
    return {k: ", ".join(sorted(v)) or "-" for k, v in out.items()}


# --------------------------------------------------------------------------------------------- one step's memory
def measure_step_memory(cfg, precision: str, step_fn, device) -> dict:
    """Two training steps with ``step_fn`` (the notebook's ``amp_step``); the second one (AdamW state already
    allocated) is measured: weights, gradients, optimizer state, what autograd saves (activations FP32 / half,
    half weight copies), what the forward adds, the peak, and the dtype of each part of the training state.

    ``step_fn(model, window, optimizer, scaler, amp_dtype, max_grad_norm, mark)`` calls ``mark(label)`` after
    the forward, after the backward and after the optimizer step."""
    from .train import make_optimizer, prepare

    amp_dtype = AMP_DTYPES.get(precision)
    seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model.train()
    optimizer, _ = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    windows = dataset.to(device).windows(cfg.train.micro_batch_size, cfg.train.accumulation_steps, cfg.train.seed)
    seen, marks = {}, {}

    def record_dtype(name):
        def hook(module, inputs, output):  # a forward hook must return None, or it replaces the output
            seen[name] = DTYPE_NAMES[output.dtype]
        return hook

    hooks = [model.transformer.h[0].attn.c_attn.register_forward_hook(record_dtype("matmul output")),
             model.lm_head.register_forward_hook(record_dtype("logits"))]

    def mark(label):
        marks[label] = mt.mark(label)
        if label == "after backward":  # gradients exist only between backward and zero_grad
            marks["gradient bytes"] = state_bytes(model)["grads"]
            seen.update(dtype_report(model, optimizer))

    with matmul_precision(tf32=False):
        step_fn(model, next(windows), optimizer, scaler, amp_dtype, cfg.train.max_grad_norm)  # step 1: Adam state
        with MemoryTracker(device) as mt, saved_tensor_census(model) as saved:
            mark("step start")
            loss = step_fn(model, next(windows), optimizer, scaler, amp_dtype, cfg.train.max_grad_norm, mark)
    for h in hooks:
        h.remove()
    seen["loss"] = DTYPE_NAMES[loss.dtype]
    state = state_bytes(model, optimizer)
    return {"precision": precision, "weights": state["params"], "gradients": marks["gradient bytes"],
            "optimizer": state["optimizer"], "half_weight_copies": saved.get("half weight copy"),
            "activations_fp32": saved.get("activation fp32"), "activations_half": saved.get("activation half"),
            "forward_adds": marks["after forward"] - marks["step start"], "peak": mt.peak_bytes,
            "step_start": marks["step start"], "dtypes": seen,
            "n_params": sum(p.numel() for p in model.parameters()),
            "matmul_weight_numel": sum(p.numel() for n, p in model.named_parameters()
                                       if p.dim() == 2 and "wpe" not in n)}


def memory_breakdown_rows(mem: dict) -> list[dict]:
    """One row (GiB) per precision of :func:`measure_step_memory`'s results ``{precision: result}``."""
    G = 2**30
    return [{"precision": p, "weights_gib": m["weights"] / G, "gradients_gib": m["gradients"] / G,
             "optimizer_gib": m["optimizer"] / G,
             "saved_activations_gib": (m["activations_fp32"] + m["activations_half"]) / G,
             "half_weight_copies_gib": m["half_weight_copies"] / G, "forward_adds_gib": m["forward_adds"] / G,
             "model_state_gib": (m["weights"] + m["gradients"] + m["optimizer"]) / G, "peak_gib": m["peak"] / G,
             # model state during the step = weights + gradients + AdamW state: what autocast does not shrink
             "peak_minus_model_state_gib": (m["peak"] - m["weights"] - m["gradients"] - m["optimizer"]) / G}
            for p, m in mem.items()]


def dtype_rows(mem: dict) -> list[dict]:
    """One row per part of the training state (weights ... loss), one column per precision: its dtype."""
    return [{"tensor": k, **{p: m["dtypes"].get(k, "-") for p, m in mem.items()}}
            for k in ("weights", "gradients", "optimizer state", "matmul output", "logits", "loss")]


# --------------------------------------------------------------------------------------------- matmul speed
def matmul_tflops(m: int, k: int, n: int, precision: str, device: torch.device, min_run_time: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul in ``precision`` (tf32: FP32 tensors, TF32 math).

    Timed with ``torch.utils.benchmark`` (which synchronises CUDA); inputs are freed on return."""
    from torch.utils import benchmark

    dtype = PRECISION_DTYPES[precision]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    with matmul_precision(tf32=precision == "tf32"):
        t = benchmark.Timer("a @ b", globals={"a": a, "b": b}).blocked_autorange(min_run_time=min_run_time)
    del a, b
    return 2 * m * k * n / t.median / 1e12


def speedup_readings(runs: dict, big: dict, small: dict, precisions: list, baseline: str = "fp32") -> list[str]:
    """What each precision's matmul speed-up (``big``/``small``: rows of the matmul table) says about the whole
    training step's speed-up: no fast path, Amdahl's share of matmul work, or a step that is not matmul-bound."""
    base = runs[baseline]
    lines = [f"{p} matmul vs fp32: {big[f'{p}_tflops'] / big['fp32_tflops']:.2f}x at '{big['matmul']}', "
             f"{small[f'{p}_tflops'] / small['fp32_tflops']:.2f}x at '{small['matmul']}'" for p in precisions[1:]]
    for p in ("tf32", "fp16", "bf16"):
        r = runs[p]
        if not (r.ok and base.ok and p in precisions):
            continue
        model_x = base.step_time_seconds / r.step_time_seconds
        mm_x = big[f"{p}_tflops"] / big["fp32_tflops"]
        line = f"{p}: whole training step at {model_x:.2f}x FP32 speed, its largest matmul at {mm_x:.2f}x"
        if mm_x <= 1:
            line += " -> this device has no fast path for this precision: nothing to gain (or a loss)"
        elif model_x > 1 and mm_x > model_x:
            share = (1 - 1 / model_x) / (1 - 1 / mm_x)  # Amdahl: S = 1 / ((1 - f) + f / X)  =>  f
            line += f" -> as if about {share:.0%} of the FP32 step time were matmul work that sped up (Amdahl)"
        elif model_x <= 1:
            line += " -> the faster matmuls did not make the step faster: the step is not matmul-bound here"
        lines.append(line)
    return lines


def mfu_readings(points: list, amp: str, hardware: str, gpu_name: str | None) -> list[str]:
    """What the MFU of the ``amp`` runs ``[(micro_batch, result), ...]`` (smallest batch first) says: whether the
    small micro-batch leaves the card idle (launch-bound); or why no MFU was computed."""
    if not points:
        return [(f"MFU not computed: {peak_info(gpu_name, amp)[1]}. On a GPU in labutils' peak table this "
                 f"line prints the MFU of each micro-batch (model FLOPs per second / the card's dense {amp} peak): "
                 f"whether the small micro-batch leaves the card idle (launch-bound) next to a busy one. Smoke mode "
                 f"cannot: a CPU has no tensor-core peak, and the tiny model's FLOP rates say nothing about a GPU.")]
    (b_lo, r_lo), (b_hi, r_hi) = points[0], points[-1]
    lines = [f"{amp} MFU on {hardware} (dense {amp} peak {r_hi.peak_tflops:g} TFLOP/s, "
             f"{peak_info(hardware, amp)[1]}): " + ", ".join(f"micro-batch {b}: {r.mfu:.1%}" for b, r in points)]
    if len(points) > 1 and r_hi.mfu > 1.5 * r_lo.mfu:
        lines.append(f"micro-batch {b_lo} keeps the card {r_lo.mfu:.1%} busy, micro-batch {b_hi} {r_hi.mfu:.1%} "
                     f"({r_hi.mfu / r_lo.mfu:.1f}x): the small batch is launch-bound, the big one feeds the tensor "
                     f"cores.")
    elif len(points) > 1:
        lines.append(f"MFU hardly changes with the batch here ({r_lo.mfu:.1%} -> {r_hi.mfu:.1%}): even micro-batch "
                     f"{b_lo} keeps this card as busy as the larger ones, or none of them is matmul-bound.")
    return lines


# --------------------------------------------------------------------------------------------- the four runs
def skipped_result(cfg, reason: str, device=None):
    """A RunResult row for an experiment this machine cannot run, with the reason."""
    from .env import environment
    from .train import RunResult

    return RunResult(config=cfg.to_dict(), env=environment(device, cfg.mode), status="skipped", error=reason,
                     effective_batch_size=cfg.effective_batch_size)


def comparison_rows(runs: dict, baseline: str = "fp32") -> list[dict]:
    """One row per run: loss, time, throughput, TFLOP/s, peak memory, and speed-up/saving against ``baseline``."""
    base = runs.get(baseline)
    base_ok = base is not None and base.ok
    rows = []
    for label, r in runs.items():
        d = r.to_dict()
        ok = r.ok
        rows.append({
            "run": label, "status": r.status,
            "avg_loss": d["avg_loss"], "final_loss": d["final_loss"],
            # wall time of every step, warm-up included (the spec's "training time"); everything else below is
            # over the timed steps only (train.timing_warmup_steps left out): step_time_s and steps_per_s = 1 / it
            "time_all_steps_s": sum(r.step_times) if ok else None,
            "step_time_s": r.step_time_seconds if ok else None,
            "steps_per_s": 1 / r.step_time_seconds if ok else None,
            "target_tokens_per_s": r.target_tokens_per_second, "tflops": r.achieved_tflops,
            "peak_memory_gib": r.peak_memory_bytes / 2**30 if r.peak_memory_bytes else None,
            "speedup_vs_fp32": base.step_time_seconds / r.step_time_seconds if ok and base_ok else None,
            "memory_saving_vs_fp32": 1 - r.peak_memory_bytes / base.peak_memory_bytes
            if ok and base_ok and r.peak_memory_bytes and base.peak_memory_bytes else None,
            "skipped_steps": r.skipped_steps if ok else None,
            "note": r.error or "",
        })
    return rows


def plot_comparison(runs: dict, title: str):
    """The spec's 2x2 figure: training time, throughput, peak memory, loss curves. Skipped runs are labelled."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    fig.suptitle(title, fontsize=13, fontweight="bold")
    labels = list(runs)
    colors = [COLORS.get(k, "gray") for k in labels]
    panels = [
        (axes[0, 0], "Training time (all steps)", "time [s]", lambda r: sum(r.step_times)),
        (axes[0, 1], "Throughput (timed steps)", "target tokens / s", lambda r: r.target_tokens_per_second),
        (axes[1, 0], "Peak memory", "peak memory [GiB]", lambda r: r.peak_memory_bytes / 2**30),
    ]
    for ax, name, unit, get in panels:
        values = [get(runs[k]) if runs[k].ok else 0.0 for k in labels]
        bars = ax.bar(labels, values, color=colors)
        for bar, k in zip(bars, labels):
            if not runs[k].ok:
                ax.text(bar.get_x() + bar.get_width() / 2, 0, runs[k].status, ha="center", va="bottom",
                        rotation=90, fontsize=9, color="gray")
        ax.set_title(name)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[1, 1]
    for k in labels:
        if runs[k].ok:
            ax.plot(step_numbers(runs[k].losses), runs[k].losses, label=k, color=COLORS.get(k), lw=1.5)
    ax.set_title("Training loss")
    step_axis(ax)
    ax.set_ylabel("loss [nats / token]")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------- claims C1, C2
def speed_evidence(base, r, names: tuple[str, str]) -> tuple[float | None, cl.Evidence]:
    """The speed-up of run ``r`` over ``base`` (median step time over median step time) and its evidence: the
    pair compared, the hardware, the timed steps behind each and the noise (from their inter-quartile ranges)."""
    ratio, ev = cl.run_pair_evidence(base, r, names)
    if ratio is None:
        return None, ev
    return 1 / ratio, replace(ev, spread=None if ev.spread is None else ev.spread / ratio ** 2)


def readme_rows(runs: dict, expected: dict, baseline: str = "fp32") -> list[dict]:
    """The course README's expected (peak GB, speed vs FP32) per precision next to the measured ratios, with what
    the course's one rule (:mod:`labutils.claims`) makes of them at this one batch size: memory (C1) is "not
    judged" here (C1 is judged over the batch sweep), speed (C2) only on a GPU with enough timed steps."""
    base = runs[baseline]
    claimed_base = expected[baseline][0]
    rows = []
    for p, (gb, speed) in expected.items():
        r = runs[p]
        ok = r.ok and base.ok
        saving = 1 - r.peak_memory_bytes / base.peak_memory_bytes if ok else None
        speedup, ev = speed_evidence(base, r, (baseline, p)) if ok else (None, None)
        if not r.ok:
            verdict = f"not measured: {r.status} ({r.error})"
        elif p == baseline:
            verdict = "baseline"
        else:
            hw = cl.hardware(base.env)
            verdict = (f"memory: {cl.verdict('C1', {'memory_saving': saving}, cl.Evidence(sweep={0: saving}), hardware=hw)[0]} "
                       f"(one batch size; C1 is judged over the sweep); "
                       f"speed: {cl.verdict('C2', {'speedup': speedup}, ev)[0]}")
        rows.append({"precision": p, "README_peak_GB": gb,
                     "measured_peak_GB": r.peak_memory_bytes / 1e9 if r.ok else None,
                     "README_saving": 1 - gb / claimed_base, "measured_saving": saving,
                     "README_speedup": speed, "measured_speedup": speedup, "verdict": verdict})
    return rows


def c1_c2_claims(runs: dict, cond: dict, *, amp: str, model_state: int | None = None,
                 fp16_matmul_x: float | None = None, sweep_rows=()) -> list[dict]:
    """C1 (memory) and C2 (speed) as recorded claims.

    C1 is judged over the batch sweep (``sweep_rows``: ``amp`` against fp32 at each micro-batch; the value shown
    is the median saving, every point is judged), with the reason from the memory breakdown (``model_state``:
    weights + gradients + AdamW bytes). C2 is fp16 against fp32 at the config's batch: median step times over
    the timed steps, judged only on a GPU with enough timed steps (CPU fp16 is an emulation: the CPU ratio is
    shown, not judged), with the matmul table's fp16 speed-up (``fp16_matmul_x``) as the reason."""
    base, r16 = runs["fp32"], runs["fp16"]
    hw = cl.hardware(base.env)
    sweep_savings = {r["micro_batch"]: r["memory_saving"] for r in sweep_rows if r["memory_saving"] is not None}
    if sweep_savings:
        vals = sorted(sweep_savings.values())
        median = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
        mem_reason = (f"FP32 weights, gradients and AdamW state ({fmt_bytes(model_state)}) are "
                      f"{model_state / base.peak_memory_bytes:.0%} of the FP32 peak at micro-batch "
                      f"{base.config.get('train', {}).get('micro_batch_size')} and autocast does not shrink them"
                      if model_state is not None and base.ok else None)
        bs = sorted(sweep_savings)
        c1 = cl.claim_entry("C1", {"memory_saving": median}, cond, reason=mem_reason,
                            evidence=cl.Evidence(pair=(f"fp32 at micro-batch {bs}", f"{amp} at micro-batch {bs}"),
                                                 sweep=sweep_savings, note="value shown: the median over the sweep"),
                            extra={f"{amp}_saving_by_micro_batch": sweep_savings})
    else:
        c1 = cl.not_measured("C1", f"no micro-batch of the sweep ran in both fp32 and {amp}", cond)
    if not (r16.ok and base.ok):
        failed = r16 if not r16.ok else base
        why = f"the {'fp16' if failed is r16 else 'fp32'} run ended with status {failed.status} ({failed.error})"
        return [c1, cl.not_measured("C2", why, cond)]
    x16, ev = speed_evidence(base, r16, ("fp32", "fp16"))
    judged_here = cl.judge("C2", {"speedup": x16}, ev)[0] in cl.JUDGED
    speed_reason = (None if fp16_matmul_x is None or not judged_here else
                    f"this device's largest fp16 matmul runs at {fp16_matmul_x:.2f}x FP32"
                    + (" and the rest of the step speeds up less" if fp16_matmul_x > 1
                       else ": no fast half-precision path"))
    others = {p: speed_evidence(base, runs[p], ("fp32", p))[0] for p in ("tf32", "bf16") if p in runs and runs[p].ok}
    c2 = cl.claim_entry("C2", {"speedup": x16}, cond, reason=speed_reason, evidence=ev,
                        extra={f"speedup_on_{'cpu' if cl.on_cpu(hw) else 'gpu'}": {"fp16": x16, **others}})
    return [c1, c2]


__all__ = ["HALF_DTYPES", "PRECISION_DTYPES", "SavedTensorCensus", "saved_tensor_census", "dtype_report",
           "measure_step_memory", "memory_breakdown_rows", "dtype_rows", "matmul_tflops", "speedup_readings",
           "mfu_readings", "skipped_result", "comparison_rows", "plot_comparison", "readme_rows", "c1_c2_claims"]
