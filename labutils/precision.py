"""Lab 01 helpers: number formats read from ``torch.finfo``, what autograd saves under autocast, matmul
throughput per dtype, and the lab's comparison table and figures.

The technique itself (autocast, GradScaler, unscale -> clip -> step -> update) is written out in the
notebook; this module holds the measuring and plotting around it. ``import labutils.precision as lp``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from .figures import step_axis, step_numbers
from .memory import fmt_bytes

HALF_DTYPES = (torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------- formats
def _bits_from_finfo(fi: torch.finfo) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of a floating dtype, derived from finfo alone."""
    mantissa = round(-math.log2(fi.eps))
    return fi.bits - 1 - mantissa, mantissa


def format_rows() -> list[dict]:
    """One row per format: bit layout, range and precision, all read from ``torch.finfo``.

    TF32 is not a storage dtype (torch has no finfo for it): it is a tensor-core math mode that keeps
    FP32's 8 exponent bits and FP16's 10 mantissa bits, so its row is assembled from those two finfo's.
    """
    rows = []
    for name, dtype in (("FP32", torch.float32), ("TF32", None), ("FP16", torch.float16), ("BF16", torch.bfloat16)):
        if dtype is None:
            f32, f16 = torch.finfo(torch.float32), torch.finfo(torch.float16)
            exp, _ = _bits_from_finfo(f32)
            _, man = _bits_from_finfo(f16)
            eps, res, normal = f16.eps, f16.resolution, f32.smallest_normal
            max_ = (2 - eps) * (f32.max / (2 - f32.eps))  # largest significand x FP32's largest power of 2
            storage = "none (math mode inside matmuls; tensors stay float32)"
        else:
            fi = torch.finfo(dtype)
            exp, man = _bits_from_finfo(fi)
            max_, normal, eps, res = fi.max, fi.smallest_normal, fi.eps, fi.resolution
            storage = f"torch.{str(dtype).split('.')[-1]}, {fi.bits // 8} bytes"
        rows.append({"format": name, "bits": 1 + exp + man, "sign": 1, "exponent": exp, "mantissa": man,
                     "max": max_, "smallest_normal": normal, "smallest_subnormal": normal * eps,
                     "eps": eps, "decimal_digits": round(-math.log10(res)), "storage": storage})
    return rows


def bit_fields(x: float, dtype: torch.dtype) -> str:
    """The stored bits of ``x`` in ``dtype`` as 'sign exponent mantissa'."""
    fi = torch.finfo(dtype)
    exp, man = _bits_from_finfo(fi)
    int_dtype = {16: torch.int16, 32: torch.int32}[fi.bits]
    raw = int(torch.tensor(x, dtype=dtype).view(int_dtype).item()) & ((1 << fi.bits) - 1)
    s = format(raw, f"0{fi.bits}b")
    return f"{s[0]} {s[1:1 + exp]} {s[1 + exp:]}"


def stored(x: float, dtype: torch.dtype) -> float:
    """The value ``x`` becomes when stored in ``dtype`` (round to nearest even)."""
    return torch.tensor(x, dtype=torch.float64).to(dtype).item()


def plot_bit_layouts(rows: list[dict]):
    """Horizontal bars: sign / exponent / mantissa bits of each format."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.6))
    colors = {"sign": "#e74c3c", "exponent": "#3498db", "mantissa": "#2ecc71"}
    for i, r in enumerate(rows):
        left = 0
        for part in ("sign", "exponent", "mantissa"):
            n = r[part]
            ax.barh(i, n, left=left, color=colors[part], edgecolor="white",
                    label=part if i == 0 else None)
            ax.text(left + n / 2, i, str(n), ha="center", va="center", fontsize=9, color="white",
                    fontweight="bold")
            left += n
    ax.set_yticks(range(len(rows)), [f"{r['format']} ({r['bits']} bits)" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("bits")
    ax.set_title("Bit layout: sign | exponent (range) | mantissa (precision)")
    ax.legend(loc="lower right", ncols=3, fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------- gradients
@dataclass
class HalfGradientCensus:
    """What storing FP32 gradients in FP16 would do to them, with and without a loss scale."""
    scale: float
    nonzero: int = 0
    underflow: int = 0          # nonzero in FP32, exactly zero in FP16
    subnormal: int = 0          # below FP16's smallest normal: stored with fewer mantissa bits
    underflow_scaled: int = 0   # same, after multiplying by ``scale``
    overflow_scaled: int = 0    # inf in FP16 after multiplying by ``scale``
    log2_hist: torch.Tensor | None = None
    bins: tuple = (-40, 20)

    def fractions(self) -> dict:
        n = max(self.nonzero, 1)
        return {"underflow_fp16": self.underflow / n, "subnormal_fp16": self.subnormal / n,
                "underflow_scaled": self.underflow_scaled / n, "overflow_scaled": self.overflow_scaled / n}


@torch.no_grad()
def half_gradient_census(grads, scale: float, bins: tuple = (-40, 20)) -> HalfGradientCensus:
    """Count, over the nonzero entries of ``grads``, those FP16 would flush to zero, keep as subnormals,
    and (after multiplying by ``scale``) flush or overflow; plus a histogram of log2|g|, one bin per power of 2.
    Processes one tensor at a time, so it needs little extra memory."""
    c = HalfGradientCensus(scale=scale, bins=bins)
    lo, hi = bins
    hist = torch.zeros(hi - lo, dtype=torch.float64)
    tiny = torch.finfo(torch.float16).smallest_normal
    for g in grads:
        if g is None:
            continue
        g = g.detach().float().flatten()
        g = g[g != 0]
        if g.numel() == 0:
            continue
        h = g.to(torch.float16)
        hs = (g * scale).to(torch.float16)
        c.nonzero += g.numel()
        c.underflow += int((h == 0).sum())
        c.subnormal += int(((h != 0) & (h.abs() < tiny)).sum())
        c.underflow_scaled += int((hs == 0).sum())
        c.overflow_scaled += int(hs.isinf().sum())
        e = torch.log2(g.abs()).floor().clamp(lo, hi - 1) - lo
        hist += torch.bincount(e.long(), minlength=hi - lo).cpu().double()
    c.log2_hist = hist
    return c


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


# --------------------------------------------------------------------------------------------- matmul speed
def matmul_tflops(m: int, k: int, n: int, precision: str, device: torch.device, min_run_time: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul in ``precision`` (tf32: FP32 tensors, TF32 math).

    Timed with ``torch.utils.benchmark`` (which synchronises CUDA); inputs are freed on return."""
    from torch.utils import benchmark

    from .env import matmul_precision

    dtype = PRECISION_DTYPES[precision]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    with matmul_precision(tf32=precision == "tf32"):
        t = benchmark.Timer("a @ b", globals={"a": a, "b": b}).blocked_autorange(min_run_time=min_run_time)
    del a, b
    return 2 * m * k * n / t.median / 1e12


# --------------------------------------------------------------------------------------------- tables/figures
def guarded(fn, *args, **kw):
    """Run one of the notebook's hand-written experiments: an out-of-memory error becomes ``None`` (the reason
    is printed and the notebook carries on), and memory is released either way."""
    from .memory import release

    try:
        return fn(*args, **kw)
    except torch.OutOfMemoryError as exc:
        print(f"OOM: {fn.__name__} did not fit ({str(exc).strip().splitlines()[0][:200]}); this part is skipped")
        return None
    finally:
        release()


def readable(rows: list[dict], digits: int = 4) -> list[dict]:
    """Rows with floats as short strings (3.403e+38 rather than 39 digits), for display only."""
    return [{k: (f"{v:.{digits}g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]


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


COLORS = {"fp32": "#3498db", "tf32": "#9b59b6", "fp16": "#e74c3c", "bf16": "#2ecc71"}


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


def gib(n: float | None) -> float | None:
    return None if n is None else n / 2**30


__all__ = ["format_rows", "bit_fields", "stored", "plot_bit_layouts", "half_gradient_census",
           "HalfGradientCensus", "saved_tensor_census", "SavedTensorCensus", "dtype_report", "matmul_tflops",
           "guarded", "readable", "skipped_result", "comparison_rows", "plot_comparison", "COLORS", "gib", "fmt_bytes"]
