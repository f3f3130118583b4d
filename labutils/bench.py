"""``python -m labutils bench CONFIG``: labutils' loop against a bare loop on the same model, data and settings.

The bare loop below is what the training step costs without the course's bookkeeping (progress bar, memory
tracking, grad-norm/scale records, per-step timing). The ratio of tokens/s says what that bookkeeping costs;
the goal is >= 0.98. With ``train.compile: true`` both loops run twice, eager and under ``torch.compile``:
a ratio for each, and what compiling gains.

Steps at or below the timing warm-up (at least 2: the first steps allocate, autotune and, compiled, compile)
are refused: the ratio would compare warm-up, not the loop.
"""
from __future__ import annotations

import statistics
import time

import torch

from . import device as dev
from . import env as _env
from .config import Config, ConfigError
from .train import autocast_for, make_optimizer, prepare, scaler_for, step_scheduler, train


def bare_loop(cfg: Config, model, dataset, device) -> float:
    """The whole training step in 15 lines; returns tokens/s over the steps after the timing warm-up."""
    t = cfg.train
    if t.compile:
        model.compile()
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
            step_scheduler(sched)
            opt.zero_grad(set_to_none=True)
            loss.item()
            times.append(time.perf_counter() - start)
    timed = times[min(max(t.timing_warmup_steps, 2), len(times) - 1):]
    return cfg.effective_batch_size * dataset.seq_length * len(timed) / sum(timed)


def check_steps(cfg: Config) -> int:
    """The timing warm-up bench uses; a :class:`ConfigError` if ``train.steps`` leaves no step to time."""
    warmup = max(cfg.train.timing_warmup_steps, 2)
    if cfg.train.steps <= warmup:
        raise ConfigError(cfg.source, "train.steps", cfg.train.steps,
                          f"bench times the steps after its warm-up of {warmup}; must be >= {warmup + 1}")
    return warmup


def compare(cfg: Config, repeats: int, device) -> tuple[list, list]:
    """tokens/s of the bare loop and of labutils' loop, ``repeats`` times each, alternating."""
    from .memory import release

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
            release()
    return bare, ours


def bench(cfg: Config, repeats: int = 3, device=None, verbose: bool = True) -> dict:
    """labutils' loop against the bare loop; with ``train.compile: true``, eager and compiled both."""
    warmup = check_steps(cfg)  # before any work
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.timing_warmup_steps": warmup})
    modes = (False, True) if cfg.train.compile else (False,)
    where = dev.name(device)
    if verbose:
        print(f"{cfg.model.name}, {cfg.train.precision}, {cfg.train.micro_batch_size} x "
              f"{cfg.train.accumulation_steps} x {cfg.data.seq_length} tokens, {cfg.train.steps} steps "
              f"({warmup} warm-up), on {where}")
    out = {"device": where, "warmup_steps": warmup}
    for compiled in modes:
        bare, ours = compare(cfg.override({"train.compile": compiled}), repeats, device)
        b, o = statistics.median(bare), statistics.median(ours)
        key = "compiled" if compiled else "eager"
        out[key] = {"bare_tokens_per_second": b, "labutils_tokens_per_second": o, "ratio": o / b}
        if verbose:
            print(f"[{key}] bare loop : {b:,.0f} tokens/s  (runs: {', '.join(f'{x:,.0f}' for x in bare)})")
            print(f"[{key}] labutils  : {o:,.0f} tokens/s  (runs: {', '.join(f'{x:,.0f}' for x in ours)})")
            print(f"[{key}] ratio     : {o / b:.3f} (goal >= 0.98)")
    out.update(out["eager"])  # the eager numbers stay at the top level, as before
    if cfg.train.compile:
        out["compile_speedup"] = out["compiled"]["labutils_tokens_per_second"] / out["eager"]["labutils_tokens_per_second"]
        if verbose:
            print(f"torch.compile: labutils' loop {out['compile_speedup']:.2f}x the eager one"
                  + (" (CPU smoke run: says nothing about a GPU)" if device.type != "cuda" else ""))
    return out
