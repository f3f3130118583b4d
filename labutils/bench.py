"""``python -m labutils bench CONFIG``: labutils' loop against a bare loop on the same model and settings.

The bare loop below is what a performance engineer would write to time a training step: its own data path
(every micro-batch of the run indexed and moved to the device before the clock starts, target counts read once
up front), its own fused AdamW, no scheduler, no per-step read: the clock runs over the whole timed window,
started and stopped on an idle device. labutils' loop pays for its bookkeeping (window sampling, records, one
host read per step, the progress machinery); the ratio of positions/s says what that costs (goal >= 0.98).

Runs alternate ABBA (bare, labutils, labutils, bare, ...), so drift (clocks, heat, other load) hits both alike;
each loop gets ``repeats`` fresh runs (default 5) and the report gives mean +- standard deviation and the median.
With ``train.compile: true`` both loops run eager and compiled: a ratio for each, and what compiling gains.
The allocator's free-and-retry count of every run is recorded: under a memory cap (``LAB_GPU_MEMORY_GB``) a run
near the cap frees cached blocks and retries (``cudaFree`` synchronises), which slows it; read speed rows with
retries as memory-bound, or run them without the cap.

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
from .data import IGNORE_INDEX
from .train import autocast_for, prepare, scaler_for, train


def _retries(device) -> int | None:
    return dev.memory_stats(device).get("num_alloc_retries")


def bare_loop(cfg: Config, model, dataset, device, warmup: int) -> tuple[float, int | None]:
    """The training step written plainly; returns (positions/s over the timed window, allocator retries)."""
    t = cfg.train
    model.train()
    if t.compile:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, fused=device.type == "cuda")
    autocast, scaler = autocast_for(t.precision, device), scaler_for(t.precision, device)
    # the data path: all micro-batches of the run on the device before the first step
    n, accum = t.steps * t.accumulation_steps, t.accumulation_steps
    idx = torch.randint(len(dataset), (n, t.micro_batch_size), generator=torch.Generator().manual_seed(t.seed))
    ids, labels = dataset.input_ids[idx].to(device), dataset.labels[idx].to(device)
    masks = None if dataset.packed else dataset.attention_mask[idx].to(device)
    counts = (dataset.labels[idx][..., 1:] != IGNORE_INDEX).view(t.steps, -1).sum(1).tolist()  # host, up front

    def step(s):
        for i in range(s * accum, (s + 1) * accum):
            with autocast:
                loss = model(input_ids=ids[i], labels=labels[i], attention_mask=None if masks is None else masks[i],
                             num_items_in_batch=counts[s], use_cache=False).loss
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if t.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    retries = _retries(device)
    with _env.matmul_precision(tf32=t.precision == "tf32"):
        for s in range(warmup):
            loss = step(s)
        loss.item()  # the window starts on an idle device ...
        start = time.perf_counter()
        for s in range(warmup, t.steps):
            loss = step(s)
        loss.item()  # ... and ends when the device is done
        elapsed = time.perf_counter() - start
    retries = None if retries is None else _retries(device) - retries
    return cfg.effective_batch_size * dataset.seq_length * (t.steps - warmup) / elapsed, retries


def check_steps(cfg: Config) -> int:
    """The timing warm-up bench uses; a :class:`ConfigError` if ``train.steps`` leaves no step to time."""
    warmup = max(cfg.train.timing_warmup_steps, 2)
    if cfg.train.steps <= warmup:
        raise ConfigError(cfg.source, "train.steps", cfg.train.steps,
                          f"bench times the steps after its warm-up of {warmup}; must be >= {warmup + 1}")
    return warmup


def abba(repeats: int) -> list[str]:
    """The run order: bare, labutils, labutils, bare, bare, labutils, ... (``repeats`` runs of each)."""
    pairs = [("bare", "labutils") if i % 2 == 0 else ("labutils", "bare") for i in range(repeats)]
    return [name for pair in pairs for name in pair]


def compare(cfg: Config, repeats: int, device, warmup: int) -> dict:
    """positions/s and allocator retries of each run of both loops, in ABBA order."""
    from .memory import release

    runs = {"bare": [], "labutils": []}
    retries = {"bare": [], "labutils": []}
    for k, name in enumerate(abba(repeats)):
        _env.seed_everything(cfg.train.seed)
        loaded, dataset = prepare(cfg, device, verbose=k == 0)
        if name == "bare":
            speed, retry = bare_loop(cfg, loaded.model, dataset, device, warmup)
        else:
            r = train(cfg, loaded.model, dataset, device, progress=False)
            speed, retry = r.tokens_per_second, r.num_alloc_retries
        runs[name].append(speed)
        retries[name].append(retry)
        del loaded
        release()
    return {"runs": runs, "num_alloc_retries": retries}


def summary(values: list[float]) -> dict:
    """mean, standard deviation (0 for one value), median, and the values."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "median": statistics.median(values), "runs": list(values)}


def bench(cfg: Config, repeats: int = 5, device=None, verbose: bool = True) -> dict:
    """labutils' loop against the bare loop; with ``train.compile: true``, eager and compiled both."""
    warmup = check_steps(cfg)  # before any work
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.timing_warmup_steps": warmup})
    modes = (False, True) if cfg.train.compile else (False,)
    where = dev.name(device)
    if verbose:
        print(f"{cfg.model.name}, {cfg.train.precision}, {cfg.train.micro_batch_size} x "
              f"{cfg.train.accumulation_steps} x {cfg.data.seq_length} tokens, {cfg.train.steps} steps "
              f"({warmup} warm-up), on {where}; {repeats} runs of each loop, order ABBA")
    out = {"device": where, "warmup_steps": warmup, "repeats": repeats, "order": "ABBA"}
    for compiled in modes:
        got = compare(cfg.override({"train.compile": compiled}), repeats, device, warmup)
        bare, ours = summary(got["runs"]["bare"]), summary(got["runs"]["labutils"])
        # each repeat's labutils run over that repeat's bare run (neighbours in time): the ratio's own spread
        ratios = summary([o / b for o, b in zip(ours["runs"], bare["runs"])])
        key = "compiled" if compiled else "eager"
        out[key] = {"bare": bare, "labutils": ours, "ratio_runs": ratios, "num_alloc_retries": got["num_alloc_retries"],
                    "bare_tokens_per_second": bare["mean"], "labutils_tokens_per_second": ours["mean"],
                    "ratio": ours["mean"] / bare["mean"]}
        if verbose:
            for name, s in (("bare loop", bare), ("labutils", ours)):
                print(f"[{key}] {name:<9} : {s['mean']:,.0f} +- {s['std']:,.0f} positions/s (median "
                      f"{s['median']:,.0f}; runs: {', '.join(f'{x:,.0f}' for x in s['runs'])})")
            print(f"[{key}] ratio     : {out[key]['ratio']:.3f} (per repeat {ratios['mean']:.3f} +- "
                  f"{ratios['std']:.3f}; goal >= 0.98)")
            tried = got["num_alloc_retries"]
            if any(v is not None for v in tried["bare"] + tried["labutils"]):
                print(f"[{key}] allocator retries per run: bare {tried['bare']}, labutils {tried['labutils']}"
                      + (" (nonzero: the run hit the memory cap; its speed is memory-bound)"
                         if any(tried["bare"] + tried["labutils"]) else ""))
    out.update(out["eager"])  # the eager numbers stay at the top level, as before
    if cfg.train.compile:
        out["compile_speedup"] = out["compiled"]["labutils_tokens_per_second"] / out["eager"]["labutils_tokens_per_second"]
        if verbose:
            print(f"torch.compile: labutils' loop {out['compile_speedup']:.2f}x the eager one"
                  + (" (CPU smoke run: says nothing about a GPU)" if device.type != "cuda" else ""))
    if verbose and device.type != "cuda":
        print("CPU run: these numbers check that bench works; they are not a GPU measurement")
    return out
