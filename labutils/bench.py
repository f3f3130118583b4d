"""``python -m labutils bench CONFIG``: the course's path against a reference, a nanoGPT-style GPT-2.

The course's path is the one loop (:func:`labutils.train.train`) on the config's model. The reference is what a
performance engineer writes for GPT-2 (:mod:`labutils.reference`: its own ``nn.Linear`` blocks, causal SDPA, tanh
GELU, tied head) holding the *same weights*, driven by a bare loop: its own data path (every micro-batch of the run
indexed and moved to the device before the clock starts), nanoGPT's AdamW (fused on CUDA), no scheduler, no
per-step read; the clock runs over the whole timed window, started and stopped on an idle device. Both run the
config's precision, compile setting, TF32 flag, batch and steps. So the ratio, course throughput over reference
throughput, prices everything the course adds: transformers' model code, the loop's bookkeeping (window sampling,
records, one host read per step). Goal on a GPU: >= :data:`GOAL`; on the CPU the ratio is shown, not judged.

One quantity, one number: a run's step time is its timed window over its timed steps (after the warm-up, and
for labutils' loop after any step that compiled, as :func:`labutils.train.train` times it); each side gets
``repeats`` fresh runs in ABBA order (reference, labutils, labutils, reference, ...), so drift hits both alike; the
ratio is the reference's median step time over labutils' median step time, spread (std, min, max, every run)
beside both. With ``train.compile: true`` eager runs come too, labelled: what compiling gains either side; the
headline is always the config's own setting. The allocator's free-and-retry count of every run is recorded:
under a memory cap (``LAB_GPU_MEMORY_GB``) a run near the cap frees cached blocks and retries, which slows it.

The reference has no activation checkpointing and no mask for a padded vocabulary (nanoGPT has neither); with
``train.gradient_checkpointing`` the ratio includes the recompute (the report says so).

Steps at or below the timing warm-up (at least 2: the first steps allocate, autotune and, compiled, compile)
are refused: the ratio would compare warm-up, not the loop.
"""
from __future__ import annotations

import statistics
import time

import torch

from . import device as dev
from . import env as _env
from . import reference as ref_model
from .compiling import compile_for_training
from .config import Config, ConfigError, source_of
from .train import autocast_for, prepare, scaler_for, train

GOAL = 0.95  # course / reference throughput on a GPU (issue 28)
SIDES = ("reference", "labutils")


def _retries(device) -> int | None:
    return dev.memory_stats(device).get("num_alloc_retries")


def reference_loop(cfg: Config, model, dataset, device, warmup: int) -> tuple[float, int, int | None]:
    """The reference model trained by a bare loop; returns (seconds per timed step, timed steps, allocator
    retries). ``model`` is a :class:`labutils.reference.GPT`."""
    t = cfg.train
    model.train()
    if t.compile:  # in place, exactly as labutils' loop compiles (dynamo reset, backend check, same settings)
        compile_for_training(model, device)
    opt = ref_model.make_optimizer(model, t.lr, t.weight_decay, device)
    autocast, scaler = autocast_for(t.precision, device), scaler_for(t.precision, device)
    # the data path: all micro-batches of the run on the device before the first step, targets shifted once
    n, accum = t.steps * t.accumulation_steps, t.accumulation_steps
    idx = torch.randint(len(dataset), (n, t.micro_batch_size), generator=torch.Generator().manual_seed(t.seed))
    ids = dataset.input_ids[idx].to(device)
    targets = ref_model.shift_labels(dataset.labels[idx]).to(device)

    def step(s):
        for i in range(s * accum, (s + 1) * accum):
            with autocast:
                _, loss = model(ids[i], targets[i])
                loss = loss / accum
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
    return elapsed / (t.steps - warmup), t.steps - warmup, retries


def check_steps(cfg: Config) -> int:
    """The timing warm-up bench uses; a :class:`ConfigError` if ``train.steps`` leaves no step to time."""
    warmup = max(cfg.train.timing_warmup_steps, 2)
    if cfg.train.steps <= warmup:
        raise ConfigError(source_of(cfg, "train.steps"), "train.steps", cfg.train.steps,
                          f"bench times the steps after its warm-up of {warmup}; must be >= {warmup + 1}")
    return warmup


def abba(repeats: int) -> list[str]:
    """The run order: reference, labutils, labutils, reference, reference, labutils, ... (``repeats`` of each)."""
    pairs = [SIDES if i % 2 == 0 else SIDES[::-1] for i in range(repeats)]
    return [name for pair in pairs for name in pair]


def compare(cfg: Config, repeats: int, device, warmup: int) -> dict:
    """Step time (s), timed steps and allocator retries of each run of both sides, in ABBA order. Every run
    loads the config's model afresh (same seed: same weights); the reference copies them (:func:`from_hf`)."""
    from .memory import release

    runs = {name: {"step_time_seconds": [], "timed_steps": [], "num_alloc_retries": []} for name in SIDES}
    for k, name in enumerate(abba(repeats)):
        _env.seed_everything(cfg.train.seed)
        loaded, dataset = prepare(cfg, device, verbose=k == 0)
        if name == "reference":
            model = ref_model.from_hf(loaded.model, dropout=cfg.model.dropout)
            del loaded
            release()
            got = reference_loop(cfg, model, dataset, device, warmup)
            del model
        else:
            r = train(cfg, loaded.model, dataset, device, progress=False)
            got = (r.step_time_seconds, r.timed_steps, r.num_alloc_retries)
            del loaded
        for key, value in zip(("step_time_seconds", "timed_steps", "num_alloc_retries"), got):
            runs[name][key].append(value)
        release()
    return runs


def summary(values: list[float]) -> dict:
    """median, mean, standard deviation (0 for one value), min, max, and the values."""
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values),
            "runs": list(values)}


def measure(cfg: Config, repeats: int, device, warmup: int, positions_per_step: int) -> dict:
    """Both sides at ``cfg``'s settings: each side's step time and positions/s (median and spread over the
    runs), the headline ratio (labutils / reference throughput, from the medians) and its per-repeat spread."""
    got = compare(cfg, repeats, device, warmup)
    out = {}
    for name in SIDES:
        times = got[name]["step_time_seconds"]
        if any(x is None for x in times):  # pragma: no cover - check_steps leaves a step to time
            raise RuntimeError(f"bench: a {name} run timed no step")
        out[name] = {"step_time_seconds": summary(times),
                     "positions_per_second": summary([positions_per_step / x for x in times]),
                     "timed_steps": got[name]["timed_steps"], "num_alloc_retries": got[name]["num_alloc_retries"]}
    ours, theirs = out["labutils"]["step_time_seconds"], out["reference"]["step_time_seconds"]
    out["ratio"] = theirs["median"] / ours["median"]
    # each repeat's labutils run against that repeat's reference run (neighbours in time): the ratio's spread
    out["ratio_runs"] = summary([r / o for o, r in zip(ours["runs"], theirs["runs"])])
    return out


def verdict(ratio: float, device) -> dict:
    """The goal and whether this run could judge it: only a GPU run is held to it."""
    if torch.device(device).type != "cuda":
        return {"goal": GOAL, "judged": False, "met": None,
                "why": "CPU run: the ratio is shown, not judged (the goal is for a GPU)"}
    return {"goal": GOAL, "judged": True, "met": ratio >= GOAL, "why": None}


MFU_GOAL_A100 = 0.45  # issue 28: the fast path's MFU goal on an A100; on H100 / H200 the goal is the reference's MFU


def mfu_goal(cfg: Config, device, labutils_step_seconds: float, reference_step_seconds: float) -> dict:
    """Both sides' MFU (PaLM's model FLOPs, :func:`labutils.flops.model_flops_per_token` at the padded vocabulary the
    GPU runs, over the card's dense peak, :mod:`labutils.peaks`) from their median step times, and the benchmark's
    MFU goal: >= 45 % on an A100; on an H100 / H200 >= the reference's MFU measured beside it (a fixed 45 %
    there would be a guess: no H100 run of the reference has been measured); other cards and the CPU: shown, not judged."""
    from .flops import model_flops_per_token
    from .models import padded_vocab_size, vocab_size
    from .peaks import peak_info

    name = dev.name(device) if torch.device(device).type == "cuda" else None
    peak, why = peak_info(name, cfg.train.precision)
    vocab = padded_vocab_size(vocab_size(cfg.model.name), cfg.model.pad_vocab_to)
    flops = model_flops_per_token(cfg.model.name, cfg.data.seq_length, vocab) * cfg.effective_batch_size \
        * cfg.data.seq_length
    if peak is None:
        return {"labutils": None, "reference": None, "goal": None, "judged": False, "met": None, "why": why}
    ours, theirs = flops / labutils_step_seconds / (peak * 1e12), flops / reference_step_seconds / (peak * 1e12)
    gpu = name.lower()
    if "a100" in gpu:
        goal, what = MFU_GOAL_A100, f">= {MFU_GOAL_A100:.0%} on an A100"
    elif "h100" in gpu or "h200" in gpu:
        goal, what = theirs, "on an H100 / H200 >= the reference's MFU"
    else:
        return {"labutils": ours, "reference": theirs, "goal": None, "judged": False, "met": None,
                "why": f"no MFU goal for {name} (goals: A100, H100, H200): shown, not judged"}
    return {"labutils": ours, "reference": theirs, "goal": goal, "judged": True, "met": ours >= goal, "why": what}


def _print_section(key: str, sec: dict, device) -> None:
    for name in SIDES:
        st, pos = sec[name]["step_time_seconds"], sec[name]["positions_per_second"]
        print(f"[{key}] {name:<9} : step {st['median'] * 1e3:,.2f} ms median (mean {st['mean'] * 1e3:,.2f} +- "
              f"{st['std'] * 1e3:,.2f}, min {st['min'] * 1e3:,.2f}, max {st['max'] * 1e3:,.2f}; runs: "
              f"{', '.join(f'{x * 1e3:,.2f}' for x in st['runs'])}) = {pos['median']:,.0f} positions/s")
    v, rr = sec["verdict"], sec["ratio_runs"]
    judged = (f"goal >= {v['goal']}: {'met' if v['met'] else 'MISSED'}" if v["judged"] else
              f"goal >= {v['goal']} on a GPU: not judged ({v['why'].split(': ', 1)[0]})")
    print(f"[{key}] ratio     : {sec['ratio']:.3f} (labutils / reference throughput, from the medians; per "
          f"repeat {rr['median']:.3f}, {rr['min']:.3f}..{rr['max']:.3f}); {judged}")
    m = sec.get("mfu")
    if m and m["labutils"] is not None:
        verdict_text = (f"goal {m['why']} ({m['goal']:.1%}): {'met' if m['met'] else 'MISSED'}" if m["judged"]
                        else m["why"])
        print(f"[{key}] MFU       : labutils {m['labutils']:.1%}, reference {m['reference']:.1%} (from the median step "
              f"times); {verdict_text}")
    elif m:
        print(f"[{key}] MFU       : none ({m['why']})")
    tried = sec["labutils"]["num_alloc_retries"] + sec["reference"]["num_alloc_retries"]
    if any(v is not None for v in tried):
        print(f"[{key}] allocator retries per run: reference {sec['reference']['num_alloc_retries']}, labutils "
              f"{sec['labutils']['num_alloc_retries']}" + (" (nonzero: the run hit the memory cap; its speed is "
                                                            "memory-bound)" if any(tried) else ""))


def reference_ratio(cfg: Config, repeats: int = 3, device=None, verbose: bool = False) -> dict:
    """The course's path / the reference, at ``cfg``'s own settings only (no eager companion runs): what
    ``doctor`` reports. Returns :func:`measure`'s dict plus ``verdict`` (goal, judged, met, why), ``device``,
    ``warmup_steps``, ``repeats``, ``mode`` ("compiled" or "eager"). Raises :class:`ConfigError` when
    ``train.steps`` leaves no step to time."""
    warmup = check_steps(cfg)
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.timing_warmup_steps": warmup})
    sec = measure(cfg, repeats, device, warmup, cfg.effective_batch_size * cfg.data.seq_length)
    sec["verdict"] = verdict(sec["ratio"], device)
    sec["mfu"] = mfu_goal(cfg, device, sec["labutils"]["step_time_seconds"]["median"],
                          sec["reference"]["step_time_seconds"]["median"])
    key = "compiled" if cfg.train.compile else "eager"
    if verbose:
        _print_section(key, sec, device)
    return {**sec, "device": dev.name(device), "warmup_steps": warmup, "repeats": repeats, "mode": key}


def bench(cfg: Config, repeats: int = 5, device=None, verbose: bool = True) -> dict:
    """The course's path against the reference at the config's settings (the headline, also at the top level),
    and with ``train.compile: true`` eager runs of both too (labelled ``eager``; ``compile_speedup`` each side)."""
    warmup = check_steps(cfg)  # before any work
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.timing_warmup_steps": warmup})
    modes = (True, False) if cfg.train.compile else (False,)
    where = dev.name(device)
    positions = cfg.effective_batch_size * cfg.data.seq_length
    if verbose:
        print(f"{cfg.model.name}, {cfg.train.precision}, {cfg.train.micro_batch_size} x "
              f"{cfg.train.accumulation_steps} x {cfg.data.seq_length} tokens, {cfg.train.steps} steps "
              f"({warmup} warm-up), on {where}; {repeats} runs of each side, order ABBA; reference: a "
              f"nanoGPT-style GPT-2 with the same weights, trained by a bare loop")
        if cfg.train.gradient_checkpointing:
            print("train.gradient_checkpointing: the reference does not recompute; the ratio includes it")
    headline = "compiled" if cfg.train.compile else "eager"
    out = {"device": where, "warmup_steps": warmup, "repeats": repeats, "order": "ABBA", "headline": headline,
           "positions_per_step": positions, "goal": GOAL}
    for compiled in modes:
        key = "compiled" if compiled else "eager"
        sec = measure(cfg.override({"train.compile": compiled}), repeats, device, warmup, positions)
        sec["verdict"] = verdict(sec["ratio"], device)
        sec["mfu"] = mfu_goal(cfg, device, sec["labutils"]["step_time_seconds"]["median"],
                              sec["reference"]["step_time_seconds"]["median"])
        out[key] = sec
        if verbose:
            _print_section(key, sec, device)
    out.update({k: out[headline][k] for k in ("labutils", "reference", "ratio", "ratio_runs", "verdict", "mfu")})
    if cfg.train.compile:
        out["compile_speedup"] = {name: out["eager"][name]["step_time_seconds"]["median"]
                                  / out["compiled"][name]["step_time_seconds"]["median"] for name in SIDES}
        if verbose:
            print("torch.compile: " + ", ".join(f"{n} {x:.2f}x its eager step" for n, x in
                                                 out["compile_speedup"].items())
                  + (" (CPU smoke run: says nothing about a GPU)" if device.type != "cuda" else ""))
    if verbose and device.type != "cuda":
        print("CPU run: these numbers check that bench works; they are not a GPU measurement")
    return out
