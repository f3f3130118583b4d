"""``python -m labutils bench CONFIG``: labutils' loop against a bare loop on the same model, data and settings.

The bare loop below is what the training step costs without the course's bookkeeping (progress bar, memory
tracking, grad-norm/scale records, per-step timing). The ratio of tokens/s says what that bookkeeping costs;
the goal is >= 0.98.
"""
from __future__ import annotations

import statistics
import time

import torch

from . import device as dev
from . import env as _env
from .config import Config
from .train import autocast_for, make_optimizer, prepare, scaler_for, train


def bare_loop(cfg: Config, model, dataset, device) -> float:
    """The whole training step in 15 lines; returns tokens/s over the steps after the timing warm-up."""
    t = cfg.train
    opt, sched = make_optimizer(model, cfg, device)
    autocast, scaler = autocast_for(t.precision, device), scaler_for(t.precision, device)
    windows, times = dataset.to(device).windows(t.micro_batch_size, t.accumulation_steps, t.seed), []
    with _env.matmul_precision(tf32=t.precision == "tf32"):
        for _ in range(t.steps):
            start, w = time.perf_counter(), next(windows)
            for mb in w.micro_batches:
                with autocast:
                    loss = model(**mb, num_items_in_batch=w.num_targets, use_cache=False).loss
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(opt)
            if t.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
            (scaler.step(opt), scaler.update()) if scaler else opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            times.append(time.perf_counter() - start)
    timed = times[min(max(t.timing_warmup_steps, 2), len(times) - 1):]
    return cfg.effective_batch_size * dataset.seq_length * len(timed) / sum(timed)


def bench(cfg: Config, repeats: int = 3, device=None, verbose: bool = True) -> dict:
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.timing_warmup_steps": max(cfg.train.timing_warmup_steps, 2)})
    bare, ours = [], []
    for i in range(repeats):  # alternate, so drift (thermal, other load) hits both alike
        for name, out in (("bare", bare), ("labutils", ours)):
            _env.seed_everything(cfg.train.seed)
            loaded, dataset = prepare(cfg, device, verbose=i == 0 and name == "bare")
            if name == "bare":
                out.append(bare_loop(cfg, loaded.model, dataset, device))
            else:
                out.append(train(cfg, loaded.model, dataset, device, progress=False).tokens_per_second)
            del loaded
            from .memory import release
            release()
    b, o = statistics.median(bare), statistics.median(ours)
    where = dev.name(device)
    if verbose:
        print(f"{cfg.model.name}, {cfg.train.precision}, {cfg.train.micro_batch_size} x "
              f"{cfg.train.accumulation_steps} x {cfg.data.seq_length} tokens, {cfg.train.steps} steps, on {where}")
        print(f"bare loop : {b:,.0f} tokens/s  (runs: {', '.join(f'{x:,.0f}' for x in bare)})")
        print(f"labutils  : {o:,.0f} tokens/s  (runs: {', '.join(f'{x:,.0f}' for x in ours)})")
        print(f"ratio     : {o / b:.3f} (goal >= 0.98)")
    return {"bare_tokens_per_second": b, "labutils_tokens_per_second": o, "ratio": o / b, "device": where}
