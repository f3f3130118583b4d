"""Lab 02 (gradient accumulation): the bookkeeping of the lab's gradient experiments, and its setup (AMP
precision, memory budget). The experiments (the training step, direct vs accumulated gradient, the padding pitfall,
the clipping order) are written out in the notebook's cells; this module holds a model for them
(:func:`held_model`), measures what a cell's gradient function does (:func:`measure_gradient`) and turns the
results into rows. Everything here releases its model and memory when it ends, also on error; an out-of-memory
error becomes a row with status "oom". The training runs' tables and figures: :mod:`labutils.accumulation_sweeps`.
"""
from __future__ import annotations

import contextlib
import math

import torch

from . import device as dev
from . import env as _env
from .config import Config, load_config
from .data import IGNORE_INDEX, LMDataset
from .estimate import scale_model_budget
from .memory import LiveStorages, MemoryTracker, fmt_bytes, oom_caught, release
from .train import autocast_for, make_optimizer, prepare, scaler_for, step_scheduler, train


# --------------------------------------------------------------------------- gradients of one window
def count_targets(micro_batches) -> int:
    """Target tokens of a window: label positions 1.. that are not padding (the model shifts labels by one)."""
    return int(sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches))


def grads_to_cpu(model) -> list[torch.Tensor]:
    """A float32 CPU copy of every parameter's gradient (zeros where a parameter got none). A real copy, also on
    the CPU (``.float().cpu()`` of an FP32 CPU gradient is the gradient itself): ``zero_grad`` then frees ``p.grad``,
    and the copies live exactly as long as the caller keeps them."""
    return [(p.grad.detach().to("cpu", torch.float32, copy=True) if p.grad is not None else torch.zeros(p.shape))
            for p in model.parameters()]


def grad_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """How far gradient ``a`` is from reference ``b``: max_rel_diff = max_i |a_i - b_i| / max_i |b_i| (the largest
    element-wise error, relative to the gradient's scale); rel_l2 = ||a - b|| / ||b||; cosine."""
    max_diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    max_ref = max(float(y.abs().max()) for y in b)
    d2 = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b))
    a2 = sum(float((x.double() ** 2).sum()) for x in a)
    b2 = sum(float((y.double() ** 2).sum()) for y in b)
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    return {"elements": sum(y.numel() for y in b), "max_rel_diff": max_diff / max_ref if max_ref else math.inf,
            "rel_l2": math.sqrt(d2 / b2) if b2 else math.inf, "cosine": dot / math.sqrt(a2 * b2) if a2 and b2 else math.nan}


@contextlib.contextmanager
def held_model(cfg: Config, device=None, adamw_state: bool = False):
    """``with held_model(cfg) as (model, dataset, device):`` model and dataset on the device, released after.

    ``adamw_state``: AdamW's two moments (m and v, one FP32 tensor each per parameter) are held beside the model,
    as training holds them between steps, so that a measured peak is a training step's forward and backward.
    Released only if nothing else holds them: names bound by the ``with`` in a notebook cell outlive the block.
    Use it inside a function (the names die when it returns); :func:`memory_in_use` checks that they did."""
    device = torch.device(device or _env.default_device())
    _env.seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model
    model.train()
    state = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters() for _ in "mv"] if adamw_state else []
    try:
        yield model, dataset.to(device), device
    finally:
        model.zero_grad(set_to_none=True)
        loaded = state = None
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
    (TF32 off). ``track``: under a memory tracker (status, peak bytes, loss; an out-of-memory error, real on CUDA or
    simulated on CPU past ``cpu_budget_bytes``, gives status "oom"), and no copy of the gradient: a copy kept from
    one run would sit in the next run's peak. Untracked: the gradient, as a CPU copy (``grads``)."""
    out = {"status": "ok", "error": None, "peak_bytes": None, "loss": None, "grads": None}
    tracker = (MemoryTracker(device, cpu_budget_bytes=cpu_budget_bytes if device.type == "cpu" else None)
               if track else contextlib.nullcontext())
    try:
        with oom_caught() as oom:
            with _env.matmul_precision(tf32=False), tracker:
                out["loss"] = float(compute(model))
            if track:
                out["peak_bytes"] = tracker.peak_bytes
            else:
                out["grads"] = grads_to_cpu(model)
        if oom:
            out.update(status="oom", error=oom.error[:200], peak_bytes=dev.peak_allocated(device))
    finally:
        model.zero_grad(set_to_none=True)
    release()
    return out


# --------------------------------------------------------------------------- bookkeeping: equivalence, padding
def split_of(window) -> str:
    return f"{window.micro_batches[0]['input_ids'].shape[0]} x {len(window.micro_batches)}"


def equivalence_rows(effective: int, windows: dict, measured: dict, grads: dict | None = None) -> list[dict]:
    """Section 2's rows of one effective batch: ``windows`` and ``measured`` ({"accumulated" / "direct": window,
    :func:`measure_gradient` with tracking}); with ``grads`` (the two untracked gradients) each row also gets the
    element-wise comparison (accumulated against direct)."""
    diff = grad_diff(grads["accumulated"]["grads"], grads["direct"]["grads"]) if grads else {}
    return [{"effective_batch": effective, "split": split_of(w), "kind": kind, "status": measured[kind]["status"],
             "peak_memory_bytes": measured[kind]["peak_bytes"], "loss": measured[kind]["loss"],
             "target_tokens": w.num_targets, "error": measured[kind]["error"], **diff} for kind, w in windows.items()]


def short_documents(dataset: LMDataset, seed: int = 0, min_tokens: int = 4) -> LMDataset:
    """The same samples cut at random lengths (uniform between ``min_tokens`` and their own length) and
    right-padded: what chat or instruction data looks like. Past the cut, mask 0 and label -100: to the model
    that is padding (the token ids left there are never attended to and never predicted)."""
    g = torch.Generator().manual_seed(seed)
    mask, labels = dataset.attention_mask.clone().cpu(), dataset.labels.clone().cpu()
    lengths = mask.sum(dim=1)
    for i in range(len(dataset)):
        hi = int(lengths[i])
        cut = int(torch.randint(min(min_tokens, hi), hi + 1, (1,), generator=g))
        mask[i, cut:] = 0
        labels[i, cut:] = IGNORE_INDEX
    targets = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    where = dataset.input_ids.device
    return LMDataset(dataset.input_ids, mask.to(where), labels.to(where), targets, packed=False)


def padding_rows(data_name: str, data: LMDataset, window, g_full: dict, measured: dict) -> list[dict]:
    """The padding pitfall's rows for one data set: the full batch (reference) and each accumulated gradient in
    ``measured`` ({method label: untracked measure_gradient output}) with its error against the full batch; how much
    of the data is padding and how many target tokens each micro-batch of ``window`` holds."""
    per_mb = [count_targets([mb]) for mb in window.micro_batches]
    info = {"data": data_name, "padding": 1 - float(data.attention_mask.float().mean()),
            "tokens_per_micro_batch": "/".join(map(str, per_mb))}
    samples = sum(mb["input_ids"].shape[0] for mb in window.micro_batches)
    rows = [{**info, "method": f"full batch {samples} x 1", "status": g_full["status"], "loss": g_full["loss"], "rel_l2": 0.0, "max_rel_diff": 0.0}]
    for label, g in measured.items():
        rows.append({**info, "method": f"{split_of(window)} {label}", "status": g["status"], "loss": g["loss"],
                     **(grad_diff(g["grads"], g_full["grads"]) if g["status"] == g_full["status"] == "ok" else {})})
    return rows


# --------------------------------------------------------------------------- the written-out loop vs labutils
def replay(cfg: Config, step_fn, device=None) -> dict:
    """Train ``cfg.train.steps`` steps twice from the same weights and data: once with ``step_fn`` (the
    notebook's own loop body), once with :func:`labutils.train`. Returns both loss and grad-norm lists.

    ``step_fn(model, optimizer, window, autocast, scaler, max_grad_norm) -> (loss, grad_norm)``."""
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
    return "fp32", f"{why}; FP16 is emulated too: CPU runs stay in FP32 (same loop; section 1.1 checks the fp16 path)"


def budget_rows(micro: int, accum_steps, target: int, proof_batches) -> dict:
    """``{label: config overrides}`` of every run the lab measures under its memory budget: section 2's direct
    (E x 1) and accumulated (2 x E/2) gradients, in FP32 without dropout; section 4's sweep (``micro`` x k); section
    6's splits of the effective batch ``target`` (m x target/m, m = 2, 4, ... up to ``target``)."""
    def split(m, k, **extra):
        return {"train.micro_batch_size": m, "train.accumulation_steps": k, **extra}

    exact = {"train.precision": "fp32", "model.dropout": 0.0}
    rows = {}
    for E in proof_batches:
        rows[f"direct {E} x 1"] = split(E, 1, **exact)
        rows[f"accumulated 2 x {E // 2}"] = split(2, E // 2, **exact)
    rows.update({f"{micro} x {k}": split(micro, k) for k in accum_steps})
    rows.update({f"{2 ** i} x {target // 2 ** i}": split(2 ** i, target // 2 ** i)
                 for i in range(1, int(math.log2(target)) + 1)})
    return rows


def memory_budget(cfg: Config, device, rows: dict) -> tuple[int | None, str, list[dict]]:
    """(bytes the experiments must fit in, what they are, the scale model's rows).

    CUDA: the allocator's budget (the card's memory, or the 8 GB card ``LAB_GPU_MEMORY_GB`` makes of it; the
    allocator enforces it), and no rows. CPU: no card, so a simulated one, past which labutils' CPU tracker refuses
    (an "oom" row there is no real out-of-memory error): the 8 GB card's budget scaled by the course's one rule
    (:func:`labutils.estimate.scale_model_budget`) over ``rows`` (:func:`budget_rows`), so that the rows that run
    out of memory on an 8 GB card in full mode run out here too, and the rows that fit there fit here."""
    device = torch.device(device or _env.default_device())
    if device.type == "cuda":
        b = _env.memory_budget_bytes(device)
        return b, f"{b / 2**30:.1f} GiB of CUDA memory (the allocator enforces it)", []
    sm = scale_model_budget(load_config(cfg.source, mode="full"), cfg, rows)
    return sm["budget_bytes"], f"simulated on the CPU: {sm['why']}", sm["rows"]


def budget_now(device, budget: int | None) -> int | None:
    """The budget in force: on a GPU the allocator's cap now (measured again after the first training step, and only
    ever lowered); on the CPU ``budget``, the simulated card."""
    return _env.memory_budget_bytes(device) if torch.device(device).type == "cuda" else budget
