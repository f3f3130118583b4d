"""Lab 02 (gradient accumulation): the bookkeeping of the notebook's gradient experiments (a model held for them, a
cell's memory, rows) and the lab's AMP precision, all releasing their memory when they end. The training runs:
:mod:`labutils.labs.lab02.accumulation_sweeps`. """
from __future__ import annotations

import contextlib
import math

import torch

from ...core import device as dev
from ...core import env as _env
from ...core.config import Config
from ...core.data import IGNORE_INDEX, LMDataset
from ...core.memory import MemoryTracker, oom_caught, release
from ...core.precisions import get
from ...core.train import autocast_for, make_optimizer, prepare, scaler_for, step_scheduler, train


def count_targets(micro_batches) -> int:
    """Target tokens of a window: label positions 1.. that are not padding (the model shifts labels by one)."""
    return int(sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches))


def grads_to_cpu(model) -> list[torch.Tensor]:
    """A float32 CPU copy of every parameter's gradient (zeros where none), a real copy also on the CPU (where
    ``.float().cpu()`` would be ``p.grad`` itself): it lives exactly as long as the caller keeps it."""
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
            "rel_l2": math.sqrt(d2 / b2) if b2 else math.inf,
            "cosine": dot / math.sqrt(a2 * b2) if a2 and b2 else math.nan}


@contextlib.contextmanager
def held_model(cfg: Config, device=None, adamw_state: bool = False):
    """``with held_model(cfg) as (model, dataset, device):`` on the device, released after (use it inside a function);
    ``adamw_state``: AdamW's m and v held beside it, as in training, so a peak is a training step's."""
    device = torch.device(device or _env.default_device())
    _env.seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model.train()
    state = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters() for _ in "mv"] if adamw_state else []
    try:
        yield model, dataset.to(device), device
    finally:
        model.zero_grad(set_to_none=True)
        loaded = state = model = None
        release()


def max_relative_gap(xs, ys) -> float:
    """Largest ``|x - y| / |y|`` over per-step numbers of two loops. An fp16 step that overflows gives both loops the
    same inf (or nan) grad norm: a match (gap 0); a non-finite value on one side only is a gap of inf."""
    def gap(x, y):
        if math.isfinite(x) and math.isfinite(y):
            return abs(x - y) / max(abs(y), 1e-30)
        return 0.0 if x == y or (math.isnan(x) and math.isnan(y)) else math.inf
    return max((gap(float(x), float(y)) for x, y in zip(xs, ys, strict=True)), default=0.0)


def first_window(dataset: LMDataset, micro: int, accum: int, seed: int):
    return next(dataset.windows(micro, accum, seed))


def measure_gradient(model, compute, device, cpu_budget_bytes=None, track: bool = True) -> dict:
    """Run ``compute(model)`` (the cell's code: fills ``p.grad``, returns the loss), TF32 off. ``track``: under a memory
    tracker (an OOM, simulated on CPU past ``cpu_budget_bytes``, is status "oom"); else the gradient, copied to CPU."""
    out = {"status": "ok", "error": None, "peak_bytes": None, "loss": None, "grads": None}
    tracker = (MemoryTracker(device, cpu_budget_bytes=cpu_budget_bytes if device.type == "cpu" else None)
               if track else contextlib.nullcontext())
    try:
        with oom_caught() as oom:
            with _env.matmul_precision(tf32=False), tracker:
                out["loss"] = float(compute(model))
            out.update({"peak_bytes": tracker.peak_bytes} if track else {"grads": grads_to_cpu(model)})
        if oom:
            out.update(status="oom", error=oom.error[:200], peak_bytes=dev.peak_allocated(device))
    finally:
        model.zero_grad(set_to_none=True)
    release()
    return out


def split_of(window) -> str:
    return f"{window.micro_batches[0]['input_ids'].shape[0]} x {len(window.micro_batches)}"


def equivalence_rows(effective: int, windows: dict, measured: dict, grads: dict | None = None) -> list[dict]:
    """Section 2's rows of one effective batch (``windows``, ``measured``: {"accumulated" / "direct": window, tracked
    measurement}); with ``grads`` (the two untracked gradients) each row gets their element-wise comparison."""
    diff = grad_diff(grads["accumulated"]["grads"], grads["direct"]["grads"]) if grads else {}
    return [{"effective_batch": effective, "split": split_of(w), "kind": kind, "status": measured[kind]["status"],
             "peak_memory_bytes": measured[kind]["peak_bytes"], "loss": measured[kind]["loss"],
             "target_tokens": w.num_targets, "error": measured[kind]["error"], **diff} for kind, w in windows.items()]


def short_documents(dataset: LMDataset, seed: int = 0, min_tokens: int = 4) -> LMDataset:
    """The same samples cut at random lengths (``min_tokens`` up to their own) and right-padded (mask 0, label -100
    past the cut: never attended to, never predicted), like chat or instruction data."""
    g = torch.Generator().manual_seed(seed)
    mask, labels = dataset.attention_mask.clone().cpu(), dataset.labels.clone().cpu()
    for i in range(len(dataset)):
        hi = int(mask[i].sum())
        cut = int(torch.randint(min(min_tokens, hi), hi + 1, (1,), generator=g))
        mask[i, cut:] = 0
        labels[i, cut:] = IGNORE_INDEX
    targets = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    where = dataset.input_ids.device
    return LMDataset(dataset.input_ids, mask.to(where), labels.to(where), targets, packed=False)


def padding_rows(data_name: str, data: LMDataset, window, g_full: dict, measured: dict) -> list[dict]:
    """The padding pitfall's rows for one data set: the full batch, and each accumulated gradient of ``measured``
    ({method: untracked measurement}) with its error against it; the data's padding, targets per micro-batch."""
    per_mb = [count_targets([mb]) for mb in window.micro_batches]
    info = {"data": data_name, "padding": 1 - float(data.attention_mask.float().mean()),
            "tokens_per_micro_batch": "/".join(map(str, per_mb))}
    samples = sum(mb["input_ids"].shape[0] for mb in window.micro_batches)
    rows = [{**info, "method": f"full batch {samples} x 1", "status": g_full["status"], "loss": g_full["loss"],
             "rel_l2": 0.0, "max_rel_diff": 0.0}]
    for label, g in measured.items():
        rows.append({**info, "method": f"{split_of(window)} {label}", "status": g["status"], "loss": g["loss"],
                     **(grad_diff(g["grads"], g_full["grads"]) if g["status"] == g_full["status"] == "ok" else {})})
    return rows


def replay(cfg: Config, step_fn, device=None) -> dict:
    """The same steps, weights and data with ``train`` and with the notebook's ``step_fn``: both losses and norms."""
    out = {}
    with held_model(cfg, device) as (model, dataset, device):
        r = train(cfg, model, dataset, device, progress=False, track_memory=False)
        out["labutils_losses"], out["labutils_grad_norms"] = r.losses, r.grad_norms
    model = dataset = r = None  # a with-block's names outlive it: unbound before the notebook's side loads its model
    with held_model(cfg, device) as (model, dataset, device), _env.matmul_precision(tf32=get(cfg.train.precision).tf32):
        optimizer, scheduler = make_optimizer(model, cfg, device)
        autocast, scaler = autocast_for(cfg.train.precision, device), scaler_for(cfg.train.precision, device)
        windows = dataset.windows(cfg.train.micro_batch_size, cfg.train.accumulation_steps, cfg.train.seed)
        steps = []
        for _ in range(cfg.train.steps):
            steps.append(step_fn(model, optimizer, next(windows), autocast=autocast, scaler=scaler,
                                 max_grad_norm=cfg.train.max_grad_norm))
            step_scheduler(scheduler)
        optimizer = scheduler = scaler = None      # AdamW's state freed before held_model releases the memory
        out["notebook_losses"], out["notebook_grad_norms"] = [float(x) for x, _ in steps], [float(n) for _, n in steps]
    return out


