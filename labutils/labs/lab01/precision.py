"""Lab 01, the numerics: number formats read from ``torch.finfo``, what FP16 storage does to real gradients (underflow)
and activations (overflow), and the loss-scale figure. ``import labutils.labs.lab01.precision as lp``. """
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.env import seed_everything
from ...core.figures import legend_outside, step_axis, step_numbers
from ...core.precisions import PRECISIONS, get


def _bits_from_finfo(fi: torch.finfo) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of a floating dtype, derived from finfo alone."""
    mantissa = round(-math.log2(fi.eps))
    return fi.bits - 1 - mantissa, mantissa


def format_rows() -> list[dict]:
    """One row per format: bit layout, range and precision, all read from ``torch.finfo``. TF32 is a tensor-core
    math mode, not a storage dtype: its row is FP32's exponent with FP16's mantissa, from those two finfo's."""
    rows = []
    for name, dtype in ((p.name.upper(), None if p.tf32 else p.dtype) for p in PRECISIONS.values()):
        if dtype is None:
            f32, f16 = torch.finfo(torch.float32), torch.finfo(torch.float16)
            exp, man = _bits_from_finfo(f32)[0], _bits_from_finfo(f16)[1]
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
    exp, _ = _bits_from_finfo(fi)
    int_dtype = {16: torch.int16, 32: torch.int32}[fi.bits]
    s = format(int(torch.tensor(x, dtype=dtype).view(int_dtype).item()) & ((1 << fi.bits) - 1), f"0{fi.bits}b")
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
            ax.barh(i, r[part], left=left, color=colors[part], edgecolor="white", label=part if i == 0 else None)
            ax.text(left + r[part] / 2, i, str(r[part]), ha="center", va="center", fontsize=9, color="white")
            left += r[part]
    ax.set_yticks(range(len(rows)), [f"{r['format']} ({r['bits']} bits)" for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="bits", title="Bit layout: sign | exponent (range) | mantissa (precision)")
    ax.legend(loc="lower right", ncols=3, fontsize=8)
    fig.tight_layout()
    return fig


@dataclass
class HalfGradientCensus:
    """What storing FP32 gradients in FP16 would do to them, with and without a loss scale."""
    scale: float
    nonzero: int = 0
    underflow: int = 0          # nonzero in FP32, exactly zero in FP16
    subnormal: int = 0          # below FP16's smallest normal: stored with fewer mantissa bits
    underflow_scaled: int = 0   # same, after multiplying by ``scale``
    overflow_scaled: int = 0    # inf in FP16 after multiplying by ``scale``
    log2_hist: list | None = None  # counts, not a tensor: a result kept by a name is not in a later peak
    bins: tuple = (-40, 20)

    def fractions(self) -> dict:
        n = max(self.nonzero, 1)
        return {"underflow_fp16": self.underflow / n, "subnormal_fp16": self.subnormal / n,
                "underflow_scaled": self.underflow_scaled / n, "overflow_scaled": self.overflow_scaled / n}


@torch.no_grad()
def half_gradient_census(grads, scale: float) -> HalfGradientCensus:
    """Count, over the nonzero entries of ``grads``, those FP16 would flush to zero, keep as subnormals, and (after
    multiplying by ``scale``) flush or overflow; plus a histogram of log2|g|, one bin per power of 2."""
    c = HalfGradientCensus(scale=scale)
    lo, hi = c.bins
    hist = torch.zeros(hi - lo, dtype=torch.float64)
    tiny = torch.finfo(torch.float16).smallest_normal
    for g in (g.detach().float().flatten() for g in grads if g is not None):
        if not (g := g[g != 0]).numel():
            continue
        h, hs = g.to(torch.float16), (g * scale).to(torch.float16)
        c.nonzero += g.numel()
        c.underflow += int((h == 0).sum())
        c.subnormal += int(((h != 0) & (h.abs() < tiny)).sum())
        c.underflow_scaled += int((hs == 0).sum())
        c.overflow_scaled += int(hs.isinf().sum())
        e = torch.log2(g.abs()).floor().clamp(lo, hi - 1) - lo
        hist += torch.bincount(e.long(), minlength=hi - lo).cpu().double()
    c.log2_hist = hist.tolist()
    return c


def fp32_gradient_census(cfg, device) -> tuple[HalfGradientCensus, str]:
    """One FP32 forward/backward of the lab's model on the lab's first batch; what FP16 storage does to the
    gradients, unscaled and times GradScaler's default initial loss scale. Returns (census, which weights)."""
    from ...core.train import prepare

    seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device)
    model = loaded.model.train()
    window = next(dataset.to(device).windows(cfg.train.micro_batch_size, 1, cfg.train.seed))
    for mb in window.micro_batches:
        model(**mb, num_items_in_batch=window.num_targets).loss.backward()
    scale = torch.amp.GradScaler(device.type).get_scale()  # GradScaler's default initial loss scale
    return half_gradient_census([p.grad for p in model.parameters()], scale), loaded.weights


def plot_gradient_census(census: HalfGradientCensus, title: str):
    """Histogram of log2|gradient| before and after the loss scale, against FP16's zero, normal and max lines."""
    import matplotlib.pyplot as plt

    f16 = torch.finfo(torch.float16)
    lo, hi = census.bins
    edges = torch.arange(lo, hi).float()
    fig, ax = plt.subplots(figsize=(10, 3.8))
    ax.bar(edges, census.log2_hist, width=1, align="edge", alpha=0.6, color="#3498db", label="|gradient| (FP32)")
    ax.bar(edges + math.log2(census.scale), census.log2_hist, width=1, align="edge", alpha=0.4, color="#e74c3c",
           label=f"|gradient| x {census.scale:g} (loss scale)")
    ax.axvspan(lo, math.log2(f16.smallest_normal * f16.eps) - 1, color="gray", alpha=0.2, label="FP16 rounds to 0")
    ax.axvline(math.log2(f16.smallest_normal), color="orange", ls="--", label="FP16 smallest normal")
    ax.axvline(math.log2(f16.max), color="red", ls="--", label="FP16 max")
    ax.set(yscale="log", xlim=(lo, math.log2(f16.max) + 4), xlabel="log2 |gradient value|",
           ylabel="count (log scale)", title=title)
    legend_outside(ax, fontsize=8)  # the panel has no free corner
    fig.tight_layout()
    return fig


def activation_overflow_demo(cfg, device, first_nonfinite, precisions=("fp32", "fp16")):
    """Make the first MLP layer overflow FP16 on purpose (its largest FP32 output scaled to about 4 x FP16's max), then
    run the notebook's ``first_nonfinite(model, batch, amp_dtype)`` per precision. Returns (factor, largest, rows)."""
    from ...core.train import prepare

    seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model.eval()
    batch = next(dataset.to(device).windows(cfg.train.micro_batch_size, 1, cfg.train.seed)).micro_batches[0]
    layer = model.transformer.h[0].mlp.c_fc
    peak = []
    hook = layer.register_forward_hook(lambda m, i, o: peak.append(o.abs().max().item()))
    with torch.no_grad():
        model(**batch)
        hook.remove()
        factor = 4 * torch.finfo(torch.float16).max / peak[0]
        layer.weight.mul_(factor)
        layer.bias.mul_(factor)
    rows = [{"precision": p, "loss": loss, "first non-finite output": where}
            for p in precisions for where, loss in [first_nonfinite(model, batch, get(p).autocast)]]
    return factor, peak[0], rows


def plot_loss_scale(steps: list, scales: list, skipped: list, title: str, injected=(), losses=None, reference=None):
    """The loss scale per step (steps numbered from 1), the skipped steps marked (injected overflows apart from
    real ones); with ``losses`` a second panel with the loss, and ``reference``'s loss (a run) dashed beside it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if losses else 1, figsize=(10, 4), squeeze=False)
    ax = axes[0][0]
    ax.step(steps, scales, where="post", color=get("fp16").color, label="loss scale")
    at = dict(zip(steps, scales))
    for label, marks, style in (("skipped: injected overflow", [s for s in skipped if s in injected],
                                 {"marker": "x", "color": "black"}),
                                ("skipped: overflow in the gradients", [s for s in skipped if s not in injected],
                                 {"marker": "o", "facecolors": "none", "edgecolors": "red"})):
        if marks:
            ax.scatter(marks, [at[s] for s in marks], s=70, zorder=3, label=label, **style)
    ax.set_yscale("log", base=2)
    ax.set(ylabel="loss scale (log2 axis)", title=title)
    if losses:
        axes[0][1].plot(steps, losses, color=get("fp16").color, label="this run")
        if reference is not None and reference.ok:
            axes[0][1].plot(step_numbers(reference.losses), reference.losses, color="gray", ls="--",
                            label="section 4 fp16 run")
        axes[0][1].set(ylabel="loss [nats / token]", title="Loss")
    for ax in axes[0]:
        step_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def loss_scale_rows(run, inject: set) -> list[dict]:
    """One row per step of an fp16 run, numbered from 1 (``inject`` from 0): loss scale, skipped, injected, loss."""
    return [{"step": i + 1, "loss_scale": s, "skipped": i in run.skipped, "injected": i in inject, "loss": l}
            for i, (s, l) in enumerate(zip(run.loss_scales, run.losses))]


def guarded(fn, *args, **kw):
    """Run a hand-written experiment: an OOM becomes ``None`` (its reason printed); memory is released either way."""
    from ...core.memory import oom_caught, release

    try:
        with oom_caught() as oom:
            return fn(*args, **kw)
        print(f"OOM: {fn.__name__} did not fit ({oom.error[:200]}); this part is skipped")
        return None
    finally:
        release()
