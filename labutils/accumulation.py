"""Lab 02 (gradient accumulation): the bookkeeping of the lab's gradient experiments, and its setup (AMP
precision, memory budget). The experiments themselves (direct vs accumulated gradient, the padding pitfall, the
training step) are written out in the notebook's cells; this module holds a model for them
(:func:`held_model`), measures what a cell's gradient function does (:func:`measure_gradient`: memory, OOM, a
copy of the gradient) and turns the results into rows (:func:`equivalence_rows`, :func:`padding_rows`).

The one rule the lab is about: a window of k micro-batches holds N target tokens in all; each micro-batch's
loss is (sum of its token losses) / N, so the accumulated gradient is that of the whole window's mean loss::

    loss_i = model(**mb_i, num_items_in_batch=N).loss      # exact, padded or not
    loss_i = model(**mb_i).loss / k                        # naive: exact only if every mb_i holds N/k tokens

Everything here releases its model and memory when it ends, also on error; an out-of-memory error becomes a
row with status "oom". The training runs' tables, fits and figures are in :mod:`labutils.accumulation_sweeps`.
``import labutils.accumulation as acc``.
"""
from __future__ import annotations

import contextlib
import math
import numpy as np
import torch

from . import device as dev
from . import env as _env
from .config import Config
from .data import IGNORE_INDEX, LMDataset
from .memory import LiveStorages, MemoryTracker, fmt_bytes, oom_caught, release
from .train import make_optimizer, prepare, step_scheduler, train

NORMALISATIONS = ("window", "naive")


# --------------------------------------------------------------------------- gradients of one window
def count_targets(micro_batches) -> int:
    """Target tokens of a window: label positions 1.. that are not padding (the model shifts labels by one)."""
    return int(sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches))


def window_gradient(model, micro_batches, normalise: str = "window", autocast=None) -> float:
    """Zero the gradients, then accumulate one window's gradient into ``p.grad``; return the window's loss.

    ``normalise="window"``: every micro-batch divides its summed token loss by the window's target count N
    (what labutils.train does). ``"naive"``: every micro-batch takes its own mean and divides by k.
    """
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise must be one of {NORMALISATIONS}, not {normalise!r}")
    model.zero_grad(set_to_none=True)
    n, k = count_targets(micro_batches), len(micro_batches)
    total = 0.0
    for mb in micro_batches:
        with autocast or contextlib.nullcontext():
            if normalise == "window":
                loss = model(**mb, num_items_in_batch=n, use_cache=False).loss
            else:
                loss = model(**mb, use_cache=False).loss / k
        loss.backward()
        total += loss.item()
        del loss
    return total


def grads_to_cpu(model) -> list[torch.Tensor]:
    """A float32 CPU copy of every parameter's gradient (zeros where a parameter got none). A real copy, also on
    the CPU (``.float().cpu()`` of an FP32 CPU gradient is the gradient itself): ``zero_grad`` then frees ``p.grad``,
    and the copies live exactly as long as the caller keeps them."""
    return [(p.grad.detach().to("cpu", torch.float32, copy=True) if p.grad is not None else torch.zeros(p.shape))
            for p in model.parameters()]


def grad_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """How far gradient ``a`` is from reference ``b``, element-wise and as vectors.

    max_rel_diff = max_i |a_i - b_i| / max_i |b_i|  (the largest element-wise error, relative to the gradient's
    scale); rel_l2 = ||a - b|| / ||b||; cosine = <a, b> / (||a|| ||b||).
    """
    max_diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    max_ref = max(float(y.abs().max()) for y in b)
    d2 = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b))
    a2 = sum(float((x.double() ** 2).sum()) for x in a)
    b2 = sum(float((y.double() ** 2).sum()) for y in b)
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    return {"elements": sum(y.numel() for y in b), "max_abs_diff": max_diff, "max_rel_diff": max_diff / max_ref if max_ref else math.inf,
            "rel_l2": math.sqrt(d2 / b2) if b2 else math.inf,
            "cosine": dot / math.sqrt(a2 * b2) if a2 and b2 else math.nan}


@contextlib.contextmanager
def held_model(cfg: Config, device=None):
    """``with held_model(cfg) as (model, dataset, device):`` model and dataset on the device, released after.

    Released only if nothing else holds them: names bound by the ``with`` in a notebook cell outlive the block.
    Use it inside a function (the names die when it returns); :func:`memory_in_use` checks that they did."""
    device = torch.device(device or _env.default_device())
    _env.seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model
    model.train()
    try:
        yield model, dataset.to(device), device
    finally:
        model.zero_grad(set_to_none=True)
        loaded = None
        del model
        release()


def memory_in_use(device=None) -> int:
    """Bytes of tensors alive now on ``device``: on CUDA the allocator's allocated bytes; on the CPU every live CPU
    tensor storage (and ``.grad``), found by a garbage-collector scan -- what labutils' CPU tracker counts at the
    start of a measured region, so whatever is alive here is in every peak measured next."""
    device = torch.device(device or _env.default_device())
    release()
    if device.type == "cuda":
        return int(dev.allocated(device) or 0)
    live = LiveStorages()
    live.add_existing()
    return live.current


def baseline_line(device, baseline: int, where: str) -> tuple[int, str]:
    """(bytes in use now, a line saying so next to the lab's ``baseline``): every measured run of a section starts
    from the baseline it reports, so a leftover of an earlier section shows here, with its size."""
    now = memory_in_use(device)
    extra = now - baseline
    return now, (f"memory in use at the start of {where}: {fmt_bytes(now)} (the lab's baseline: {fmt_bytes(baseline)}"
                 + ("; nothing left over from earlier sections)" if extra == 0 else
                    f"; {fmt_bytes(abs(extra))} {'more' if extra > 0 else 'less'}: "
                    + ("left over from an earlier section, counted in every peak below)" if extra > 0 else ")")))


def max_relative_gap(xs, ys) -> float:
    """Largest ``|x - y| / |y|`` over pairs of per-step numbers from two loops (losses, grad norms).

    fp16 steps can overflow: then both loops see an inf (or nan) gradient norm and skip the step. The same
    non-finite value on both sides is a match (gap 0); a non-finite value on one side only is a gap of inf."""
    worst = 0.0
    for x, y in zip(xs, ys, strict=True):
        x, y = float(x), float(y)
        if not (math.isfinite(x) and math.isfinite(y)):
            same = (math.isnan(x) and math.isnan(y)) or x == y
            worst = max(worst, 0.0 if same else math.inf)
        else:
            worst = max(worst, abs(x - y) / max(abs(y), 1e-30))
    return worst


def first_window(dataset: LMDataset, micro: int, accum: int, seed: int):
    return next(dataset.windows(micro, accum, seed))


def measure_gradient(model, compute, device, cpu_budget_bytes=None, track: bool = True) -> dict:
    """Run ``compute(model)`` (the notebook's code: it fills ``p.grad`` and returns the loss) with FP32 matmuls
    (TF32 off), optionally under a memory tracker: status, peak bytes, loss, and the gradient (CPU copy). An
    out-of-memory error (real on CUDA, simulated on CPU past ``cpu_budget_bytes``) gives status "oom"."""
    out = {"status": "ok", "error": None, "peak_bytes": None, "loss": None, "grads": None}
    tracker = (MemoryTracker(device, cpu_budget_bytes=cpu_budget_bytes if device.type == "cpu" else None)
               if track else contextlib.nullcontext())
    try:
        with oom_caught() as oom:
            with _env.matmul_precision(tf32=False), tracker:
                out["loss"] = float(compute(model))
            out["peak_bytes"] = tracker.peak_bytes if track else None
            out["grads"] = grads_to_cpu(model)
        if oom:
            out.update(status="oom", error=oom.error[:200], peak_bytes=dev.peak_allocated(device))
    finally:
        model.zero_grad(set_to_none=True)
    release()
    return out


# --------------------------------------------------------------------------- bookkeeping: equivalence
def equivalence_rows(effective: int, accumulated, g_acc: dict, direct, g_dir: dict) -> tuple[list[dict], dict | None]:
    """The table rows of one effective batch (the accumulated window and the direct batch, each measured with
    :func:`measure_gradient`) and, when both fitted, the element-wise comparison of the two gradients."""
    rows = []
    for kind, w, g in (("accumulated", accumulated, g_acc), ("direct", direct, g_dir)):
        mbs = w.micro_batches
        rows.append({"effective_batch": effective, "split": f"{mbs[0]['input_ids'].shape[0]} x {len(mbs)}",
                     "kind": kind, "status": g["status"], "peak_memory_bytes": g["peak_bytes"], "loss": g["loss"],
                     "target_tokens": w.num_targets, "error": g["error"]})
    if g_acc["status"] != "ok" or g_dir["status"] != "ok":
        return rows, None
    proof = {"effective_batch": effective, "micro": accumulated.micro_batches[0]["input_ids"].shape[0],
             "accum": len(accumulated.micro_batches), **grad_diff(g_acc["grads"], g_dir["grads"]),
             "loss_direct": g_dir["loss"], "loss_accumulated": g_acc["loss"],
             "peak_direct_bytes": g_dir["peak_bytes"], "peak_accumulated_bytes": g_acc["peak_bytes"]}
    for r in rows:
        r.update(max_rel_diff=proof["max_rel_diff"], rel_l2=proof["rel_l2"])
    return rows, proof


# --------------------------------------------------------------------------- experiment: padding pitfall
def short_documents(dataset: LMDataset, seed: int = 0, min_tokens: int = 4) -> LMDataset:
    """The same samples cut at random lengths (uniform between ``min_tokens`` and their own length) and
    right-padded: what chat or instruction data looks like. Past the cut, mask 0 and label -100: to the model
    that is padding (the token ids left there are never attended to and never predicted)."""
    g = torch.Generator().manual_seed(seed)
    mask, labels = dataset.attention_mask.clone().cpu(), dataset.labels.clone().cpu()
    lengths = mask.sum(dim=1)
    for i in range(len(dataset)):
        hi = int(lengths[i])
        lo = min(min_tokens, hi)
        cut = int(torch.randint(lo, hi + 1, (1,), generator=g))
        mask[i, cut:] = 0
        labels[i, cut:] = IGNORE_INDEX
    targets = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    dev = dataset.input_ids.device
    return LMDataset(dataset.input_ids, mask.to(dev), labels.to(dev), targets, packed=False)


def padding_rows(data_name: str, data: LMDataset, window, g_full: dict, measured: dict) -> list[dict]:
    """The padding pitfall's table for one data set: the full batch (reference) and each accumulated gradient in
    ``measured`` ({method label: measure_gradient output}) with its error against the full batch; how much of the
    data is padding and how many target tokens each micro-batch of ``window`` holds."""
    per_mb = [count_targets([mb]) for mb in window.micro_batches]
    k, micro = len(per_mb), window.micro_batches[0]["input_ids"].shape[0]
    info = {"data": data_name, "padding": 1 - float(data.attention_mask.float().mean()),
            "tokens_per_micro_batch": "/".join(map(str, per_mb)),
            "token_spread": (max(per_mb) - min(per_mb)) / (sum(per_mb) / len(per_mb))}
    rows = [{**info, "method": f"full batch {micro * k} x 1", "status": g_full["status"], "loss": g_full["loss"],
             "rel_l2": 0.0, "max_rel_diff": 0.0, "cosine": 1.0}]
    for label, g in measured.items():
        rows.append({**info, "method": f"{micro} x {k} {label}", "status": g["status"], "loss": g["loss"],
                     **(grad_diff(g["grads"], g_full["grads"]) if g["status"] == g_full["status"] == "ok" else {})})
    return rows


# --------------------------------------------------------------------------- experiment: clipping order
def clipping_order(cfg: Config, micro: int = 2, accum: int = 8, fraction: float = 0.5, device=None) -> dict:
    """Clip once per optimizer step (right) against clip after every micro-batch's backward (wrong), in FP32.

    The threshold is ``fraction`` x the window's own gradient norm, so that clipping is active (as it is in the
    first steps of most runs). Also: the norm a clip would see before ``scaler.unscale_`` (scaled by S), and the
    error a second ``unscale_`` in the same step raises."""
    out = {}
    with held_model(cfg, device) as (model, dataset, device), _env.matmul_precision(tf32=False):
        params = [p for p in model.parameters()]
        w = first_window(dataset, micro, accum, cfg.train.seed)
        n = count_targets(w.micro_batches)
        window_gradient(model, w.micro_batches)
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        max_norm = fraction * norm
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        right = grads_to_cpu(model)
        model.zero_grad(set_to_none=True)
        coefs = []  # clip coefficient applied after each micro-batch (1 = not clipped)
        for mb in w.micro_batches:
            model(**mb, num_items_in_batch=n, use_cache=False).loss.backward()
            before = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            coefs.append(min(1.0, max_norm / (before + 1e-6)))
        wrong = grads_to_cpu(model)
        # weight of micro-batch i in the final gradient: the product of the clip factors applied after it,
        # relative to the single factor the right order applies to every micro-batch
        right_coef = min(1.0, max_norm / (norm + 1e-6))
        weights = [float(np.prod(coefs[i:])) / right_coef for i in range(len(coefs))]
        out.update(window_norm=norm, max_norm=max_norm, clip_coefs=coefs, relative_weights=weights,
                   right_norm=math.sqrt(sum(float((g ** 2).sum()) for g in right)),
                   wrong_norm=math.sqrt(sum(float((g ** 2).sum()) for g in wrong)), **grad_diff(wrong, right))
        del right, wrong
        # GradScaler: the gradients are S times too large until unscale_, which may run once per step
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(params, lr=0.0)
        scaler = torch.amp.GradScaler(device.type)
        for mb in w.micro_batches:
            scaler.scale(model(**mb, num_items_in_batch=n, use_cache=False).loss).backward()
        out["scale"] = scaler.get_scale()
        out["norm_before_unscale"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        scaler.unscale_(opt)
        out["norm_after_unscale"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        try:
            scaler.unscale_(opt)
            out["second_unscale_error"] = None
        except RuntimeError as exc:
            out["second_unscale_error"] = str(exc)
        del opt, scaler, w, params
    return out


# --------------------------------------------------------------------------- the written-out loop vs labutils
def replay(cfg: Config, step_fn, device=None) -> dict:
    """Train ``cfg.train.steps`` steps twice from the same weights and data: once with ``step_fn`` (the
    notebook's own loop body), once with :func:`labutils.train`. Returns both loss and grad-norm lists.

    ``step_fn(model, optimizer, window, autocast, scaler, max_grad_norm) -> (loss, grad_norm)``."""
    from .train import autocast_for, scaler_for

    out = {}
    with held_model(cfg, device) as (model, dataset, device):
        r = train(cfg, model, dataset, device, progress=False, track_memory=False)
        out["labutils_losses"], out["labutils_grad_norms"] = r.losses, r.grad_norms
    with held_model(cfg, device) as (model, dataset, device), _env.matmul_precision(tf32=cfg.train.precision == "tf32"):
        optimizer, scheduler = make_optimizer(model, cfg, device)
        autocast, scaler = autocast_for(cfg.train.precision, device), scaler_for(cfg.train.precision, device)
        windows = dataset.windows(cfg.train.micro_batch_size, cfg.train.accumulation_steps, cfg.train.seed)
        losses, norms = [], []
        try:
            for _ in range(cfg.train.steps):
                loss, norm = step_fn(model, optimizer, next(windows), autocast=autocast, scaler=scaler,
                                     max_grad_norm=cfg.train.max_grad_norm)
                step_scheduler(scheduler)
                losses.append(float(loss))
                norms.append(float(norm))
        finally:
            del optimizer, scheduler, scaler
        out["notebook_losses"], out["notebook_grad_norms"] = losses, norms
    return out


# --------------------------------------------------------------------------- the lab's setup
def amp_precision(device=None) -> tuple[str, str]:
    """The mixed precision to train with, and why: BF16 where the hardware has it natively; on a CUDA GPU without
    it, FP16 (with a GradScaler); on a CPU without native BF16 (no AVX512-BF16/AMX), FP32, because autocast
    would emulate the 16-bit formats there at many times FP32's cost. Same loop either way."""
    device = torch.device(device or _env.default_device())
    ok, why = _env.bf16_supported(device)
    if device.type == "cuda":
        return ("bf16" if ok else "fp16"), why
    if ok:  # the library's one answer (labutils.env.bf16_supported), as lab 01 uses it
        return "bf16", why
    return "fp32", (f"{why}; FP16 is emulated too: CPU runs stay in FP32 (same loop, autocast is a no-op; the "
                    f"GradScaler path is still checked in section 1.1)")


def parameters_of(name: str) -> int:
    """Parameter count of a model size, built on the meta device (no memory, no download)."""
    from transformers import GPT2LMHeadModel

    from .models import gpt2_config
    with torch.device("meta"):
        m = GPT2LMHeadModel(gpt2_config(name))
    return sum(p.numel() for p in m.parameters())


def memory_budget(cfg: Config, device=None, reference_gib: float = 8.0) -> tuple[int | None, str]:
    """The memory the experiments must fit in, and what it is.

    CUDA: the card's memory, or ``LAB_GPU_MEMORY_GB`` when set (the allocator enforces it). CPU: no card, so a
    simulated one (an "oom" past it is labutils' CPU tracker refusing, not a real out-of-memory error): ``reference_gib`` scaled by (this model's parameters / GPT-2 small's), i.e. the same
    memory-to-model ratio as GPT-2 small on an 8 GB card. labutils' CPU tracker raises OOM past it."""
    device = torch.device(device or _env.default_device())
    if device.type == "cuda":
        b = _env.memory_budget_bytes(device)
        return b, f"{b / 2**30:.1f} GiB of CUDA memory (the allocator enforces it)"
    ratio = parameters_of(cfg.model.name) / parameters_of("gpt2")
    b = int(reference_gib * 2**30 * ratio)
    return b, (f"simulated on CPU: {reference_gib:g} GiB x ({cfg.model.name} params / gpt2 params) = "
               f"{b / 2**20:.1f} MiB, the memory-to-model ratio of GPT-2 small on an {reference_gib:g} GB GPU")
