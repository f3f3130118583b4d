"""``python -m labutils bench CONFIG``: the course's path against a reference, a nanoGPT-style GPT-2.

The course's path is the one loop (:func:`labutils.core.train.train`); the reference (:mod:`labutils.models.reference`)
holds the *same weights*, driven by a bare loop (micro-batches on the device before the clock starts, nanoGPT's AdamW,
no scheduler, no checkpointing). Both run the config's precision, compile setting, batch and steps, fitted to this card
as ``run`` fits them (:func:`labutils.core.train.for_this_card`): the ratio prices what the course adds. A run's step
time is the median of its timed steps; each side gets ``repeats`` fresh runs in ABBA order, each neighbouring pair one
ratio, judged against :data:`GOAL` by :func:`judge` on a GPU only. An out-of-memory run is a row and ends its section.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..core import device as dev
from ..core import env as _env
from ..models import reference as ref_model
from ..estimator.advise import default_budget_bytes
from ..core.compiling import compile_for_training, compiled_graphs
from ..core.config import Config, ConfigError, source_of
from ..core.flops import model_flops_per_token
from ..core.memory import oom_caught, release
from ..models.gpt2 import padded_vocab_size, vocab_size
from ..core.peaks import peak_info
from ..core.precisions import get
from ..core.run_result import first_timed_step
from ..core.train import autocast_for, for_this_card, prepare, scaler_for, train

GOAL = 0.95  # course / reference throughput on a GPU
MFU_GOAL_A100 = 0.45  # the fast path's MFU goal on an A100 (on an H100 / H200 the goal is the ratio)
SIDES = ("reference", "labutils")


def reference_loop(cfg: Config, model, dataset, device, warmup: int) -> dict:
    """The reference GPT trained by a bare loop, timed as the course's loop is (step times, retries, compile status)."""
    t = cfg.train
    model.train()  # compiled in place, exactly as labutils' loop compiles (dynamo reset, backend check, settings)
    compiling = compile_for_training(model, device) if t.compile else None
    opt = ref_model.make_optimizer(model, t.lr, t.weight_decay, device)
    autocast, scaler = autocast_for(t.precision, device), scaler_for(t.precision, device)
    # the data path: all micro-batches of the run on the device before the first step, targets shifted once
    n, accum = t.steps * t.accumulation_steps, t.accumulation_steps
    idx = torch.randint(len(dataset), (n, t.micro_batch_size), generator=torch.Generator().manual_seed(t.seed))
    ids = dataset.input_ids[idx].to(device)
    targets = ref_model.shift_labels(dataset.labels[idx]).to(device)
    retries = lambda: dev.memory_stats(device).get("num_alloc_retries")  # noqa: E731  (None on the CPU)
    times, compile_steps, graphs, start_retries = [], [], compiled_graphs(), retries()
    with _env.matmul_precision(tf32=get(t.precision).tf32):
        mark = time.perf_counter()
        for s in range(t.steps):
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
            loss.item()  # the step's one host read: it waits for the device, so the step time is real
            if compiling is not None and compiled_graphs() != graphs:
                graphs = compiled_graphs()
                compile_steps.append(s)
            now = time.perf_counter()
            times.append(now - mark)
            mark = now
    timed = times[first_timed_step(t.steps, warmup, compile_steps):]
    return {"step_times": times, "step_time_seconds": statistics.median(timed) if timed else None, "timed_steps":
            len(timed), "num_alloc_retries": None if start_retries is None else retries() - start_retries,
            "compiled_graphs": None if compiling is None else (compiling.graphs() if compiling.active else 0),
            "compile_fallback": None if compiling is None else compiling.fallback}


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


RUN_KEYS = ("step_time_seconds", "timed_steps", "num_alloc_retries", "compiled_graphs", "compile_fallback")


def compare(cfg: Config, repeats: int, device, warmup: int) -> dict:
    """Each side's runs in ABBA order: ``{side: {key: [per run]} | {"status", "error"}}`` (keys: :data:`RUN_KEYS`),
    each loading the model afresh (same seed; the reference copies its weights). An OOM run ends the comparison."""
    runs = {name: {"status": "ok", "error": None, **{k: [] for k in RUN_KEYS}} for name in SIDES}
    for i, name in enumerate(abba(repeats)):
        _env.seed_everything(cfg.train.seed)
        got = None
        with oom_caught() as oom:
            loaded, dataset = prepare(cfg, device, verbose=i == 0)
            if name == "reference":
                model = ref_model.from_hf(loaded.model, dropout=cfg.model.dropout)
                del loaded
                release()
                got = reference_loop(cfg, model, dataset, device, warmup)
            else:
                r = train(cfg, loaded.model, dataset, device, progress=False)
                got = {k: getattr(r, k) for k in RUN_KEYS}
        loaded = model = r = None
        release()
        if oom:
            runs[name].update(status="oom", error=oom.error)
            break
        for key in RUN_KEYS:
            runs[name][key].append(got[key])
    return runs


def summary(values: list[float]) -> dict:
    """median, mean, standard deviation (0 for one value), min, max, and the values."""
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values),
            "runs": list(values)}


def judge(values: list[float], goal: float) -> tuple[str, str]:
    """The one rule for a goal measured over repeats: ("met" | "missed" | "not decided", why). Met when every
    repeat's value reaches ``goal``, missed when none does; otherwise, or with one repeat (no spread), not decided."""
    lo, hi = min(values), max(values)
    spread = f"{len(values)} repeats, {lo:.3g}..{hi:.3g}"
    if len(values) < 2:
        return "not decided", f"one repeat: no spread to judge by (needs >= 2; {spread})"
    if lo >= goal:
        return "met", f"every repeat >= {goal:g} ({spread})"
    if hi < goal:
        return "missed", f"every repeat < {goal:g} ({spread})"
    return "not decided", f"the repeats straddle {goal:g} ({spread}): more repeats, or a quieter machine"


def _judged(values: list[float], goal: float, why: str = "") -> dict:
    """:func:`judge`'s verdict as a dict: goal, judged, verdict, met (True / False / None: not decided), why."""
    word, rule = judge(values, goal)
    return {"goal": goal, "judged": True, "verdict": word, "met": {"met": True, "missed": False}.get(word),
            "why": why + rule}


def verdict(ratios: list[float] | None, device, oom: str | None = None) -> dict:
    """The ratio's goal and verdict (:func:`judge` over each repeat's ratio); only a GPU run is judged."""
    if torch.device(device).type != "cuda":
        return {"goal": GOAL, "judged": False, "verdict": "not judged", "met": None,
                "why": "CPU run: the ratio is shown, not judged (the goal is for a GPU)"}
    if not ratios:
        return {"goal": GOAL, "judged": True, "verdict": "not decided", "met": None,
                "why": f"no ratio: a run ran out of memory ({oom})"}
    return _judged(ratios, GOAL)


def mfu_goal(cfg: Config, device, labutils_steps: list[float], reference_steps: list[float]) -> dict:
    """Both sides' MFU (:func:`labutils.core.flops.model_flops_per_token` at the padded vocabulary, over the
    card's dense peak) from their median step times, and its goal: >= 45 % on an A100, judged by :func:`judge`;
    on an H100 / H200 the goal is the ratio (MFU shown); other cards and the CPU: shown, not judged."""
    name = dev.name(device) if torch.device(device).type == "cuda" else None
    peak, why = peak_info(name, cfg.train.precision)
    if peak is None:
        return {"labutils": None, "reference": None, "goal": None, "judged": False, "verdict": "not judged",
                "met": None, "why": why}
    vocab = padded_vocab_size(vocab_size(cfg.model.name), cfg.model.pad_vocab_to)
    flops = model_flops_per_token(cfg.model.name, cfg.data.seq_length, vocab) * cfg.effective_batch_size \
        * cfg.data.seq_length / (peak * 1e12)
    ours, theirs = flops / statistics.median(labutils_steps), flops / statistics.median(reference_steps)
    out = {"labutils": ours, "reference": theirs, "goal": None, "judged": False, "verdict": "not judged", "met": None}
    gpu = name.lower()
    if "a100" in gpu:
        return {**out, **_judged([flops / s for s in labutils_steps], MFU_GOAL_A100,
                                 f">= {MFU_GOAL_A100:.0%} on an A100: ")}
    if "h100" in gpu or "h200" in gpu:
        return {**out, "why": "shown: on an H100 / H200 the goal is the ratio to the reference"}
    return {**out, "why": f"no MFU goal for {name} (goals: the ratio on every GPU, MFU on an A100): shown"}


def section(cfg: Config, runs: dict, device, positions_per_step: int) -> dict:
    """One comparison from :func:`compare`'s runs: each side's status, step time (median and spread over its runs),
    positions/s, timed steps, retries and compile status; the ratio, each repeat's ratio, the verdict and MFU."""
    out = {"train": {k: getattr(cfg.train, k) for k in ("precision", "compile", "micro_batch_size",
                                                        "accumulation_steps")}, "loss": cfg.model.loss}
    for name in SIDES:
        r = runs[name]
        times = r["step_time_seconds"]
        ok = r["status"] == "ok" and times and all(x is not None for x in times)
        out[name] = {**r, "step_time_seconds": summary(times) if ok else None,
                     "positions_per_second": summary([positions_per_step / x for x in times]) if ok else None}
    oom = next((runs[n]["error"] for n in SIDES if runs[n]["status"] != "ok"), None)
    ok = oom is None and all(out[n]["step_time_seconds"] for n in SIDES)
    ours, theirs = out["labutils"]["step_time_seconds"], out["reference"]["step_time_seconds"]
    ratios = [r / o for o, r in zip(ours["runs"], theirs["runs"])] if ok else None
    out["ratio"] = theirs["median"] / ours["median"] if ok else None
    out["ratio_runs"] = summary(ratios) if ok else None  # each repeat's pair, neighbours in time
    out["verdict"] = verdict(ratios, device, oom)
    out["mfu"] = mfu_goal(cfg, device, ours["runs"], theirs["runs"]) if ok else None
    return out


def _compile_text(side: dict) -> str:
    fell = [f for f in side["compile_fallback"] if f]
    if fell:
        return f"fell back to eager ({fell[0][:120]})"
    graphs = [g for g in side["compiled_graphs"] if g is not None]
    return f"compiled, {'/'.join(map(str, graphs))} graphs per run" if graphs else "eager"


def _print_section(key: str, sec: dict) -> None:
    for name in SIDES:
        side, st = sec[name], sec[name]["step_time_seconds"]
        if st is None:
            print(f"[{key}] {name:<9} : {side['status']} ({side['error']})")
            continue
        print(f"[{key}] {name:<9} : step {st['median'] * 1e3:,.2f} ms median (mean {st['mean'] * 1e3:,.2f} +- "
              f"{st['std'] * 1e3:,.2f}, min {st['min'] * 1e3:,.2f}, max {st['max'] * 1e3:,.2f}; runs: "
              f"{', '.join(f'{x * 1e3:,.2f}' for x in st['runs'])}) = "
              f"{side['positions_per_second']['median']:,.0f} positions/s; {_compile_text(side)}")
    v, rr = sec["verdict"], sec["ratio_runs"]
    ratio = (f"{sec['ratio']:.3f} (labutils / reference throughput, from the medians; per repeat "
             f"{rr['min']:.3f}..{rr['max']:.3f})" if rr else "none")
    print(f"[{key}] ratio     : {ratio}; goal >= {v['goal']}: {v['verdict'].upper() if v['judged'] else v['verdict']}"
          f" ({v['why']})")
    m = sec["mfu"]
    if m and m["labutils"] is not None:
        print(f"[{key}] MFU       : labutils {m['labutils']:.1%}, reference {m['reference']:.1%} (from the median step "
              f"times); " + (f"{m['verdict']}: {m['why']}" if m["judged"] else m["why"]))
    elif m:
        print(f"[{key}] MFU       : none ({m['why']})")
    tried = sec["labutils"]["num_alloc_retries"] + sec["reference"]["num_alloc_retries"]
    if any(v is not None for v in tried):
        print(f"[{key}] allocator retries per run: reference {sec['reference']['num_alloc_retries']}, labutils "
              f"{sec['labutils']['num_alloc_retries']}" + (" (nonzero: the run hit the memory cap; its speed is "
                                                            "memory-bound)" if any(tried) else ""))


def _measure(cfg: Config, key: str, repeats: int, device, warmup: int, notes: set, verbose: bool) -> dict:
    fitted, lines = for_this_card(cfg, device)
    for line in lines:
        if verbose and line not in notes:
            print(line)
        notes.add(line)
    runs = compare(fitted, repeats, device, warmup)
    sec = section(fitted, runs, device, fitted.effective_batch_size * fitted.data.seq_length)
    if verbose:
        _print_section(key, sec)
    return sec


def reference_ratio(cfg: Config, repeats: int = 2, device=None, verbose: bool = False) -> dict:
    """The course's path / the reference at ``cfg``'s own settings only: what ``doctor`` reports. :func:`section`'s dict
    plus ``device``, ``warmup_steps``, ``repeats``, ``mode``; :class:`ConfigError` when ``train.steps`` leaves no step
    to time."""
    warmup = check_steps(cfg)
    device = torch.device(device or _env.default_device())
    key = "compiled" if cfg.train.compile else "eager"
    sec = _measure(cfg.override({"train.timing_warmup_steps": warmup}), key, repeats, device, warmup, set(), verbose)
    return {**sec, "device": dev.name(device), "warmup_steps": warmup, "repeats": repeats, "mode": key}


def bench(cfg: Config, repeats: int = 5, device=None, verbose: bool = True) -> dict:
    """The course's path against the reference at the config's settings (the headline), with ``train.compile: true``
    eager too (``compile_speedup``) and the other ``model.loss``; each section both sides in ABBA."""
    warmup = check_steps(cfg)  # before any work
    device = torch.device(device or _env.default_device())
    cfg = cfg.override({"train.timing_warmup_steps": warmup})
    where = dev.name(device)
    headline = "compiled" if cfg.train.compile else "eager"
    other = "full" if cfg.model.loss == "chunked" else "chunked"
    sections = {headline: cfg, f"loss {other}": cfg.override({"model.loss": other})}
    if cfg.train.compile:
        sections["eager"] = cfg.override({"train.compile": False})
    if verbose:
        print(f"{cfg.model.name}, {cfg.train.precision}, {cfg.train.micro_batch_size} x "
              f"{cfg.train.accumulation_steps} x {cfg.data.seq_length} tokens, loss {cfg.model.loss}, "
              f"{cfg.train.steps} steps ({warmup} warm-up), on {where}; {repeats} runs of each side, order ABBA; "
              f"each run's step time the median of its timed steps; reference: a nanoGPT-style GPT-2 with the same "
              f"weights, trained by a bare loop")
        if cfg.train.gradient_checkpointing:
            print("train.gradient_checkpointing: the reference does not recompute; the ratio includes it")
    budget = dict(zip(("bytes", "where"), default_budget_bytes())) if device.type == "cuda" else None  # fitted to
    out = {"device": where, "warmup_steps": warmup, "repeats": repeats, "order": "ABBA", "headline": headline,
           "statistic": "median of each run's per-step times (one host read per step); median over runs",
           "goal": GOAL, "budget": budget}
    if verbose and out["budget"]:  # what for_this_card fits the micro-batch to, as the doctor's fast path states it
        print(f"micro-batch fitted to {out['budget']['where']} ({out['budget']['bytes'] / 2**30:.2f} GiB)")
    notes: set = set()
    for key, c in sections.items():
        out[key] = _measure(c, key, repeats, device, warmup, notes, verbose)
    out["notices"] = sorted(notes)
    out.update({k: out[headline][k] for k in ("labutils", "reference", "ratio", "ratio_runs", "verdict", "mfu")})
    step = [out[k]["labutils"]["step_time_seconds"] for k in (headline, f"loss {other}")]
    if all(step):  # the two losses side by side: labutils' median step times, each section's own reference beside
        out["loss_step_ratio"] = {f"{other} / {cfg.model.loss}": step[1]["median"] / step[0]["median"]}
        if verbose:
            print(f"model.loss: {other}'s median step is {step[1]['median'] / step[0]['median']:.3f}x "
                  f"{cfg.model.loss}'s")
    if cfg.train.compile and all(out[k][n]["step_time_seconds"] for k in (headline, "eager") for n in SIDES):
        out["compile_speedup"] = {name: out["eager"][name]["step_time_seconds"]["median"]
                                  / out["compiled"][name]["step_time_seconds"]["median"] for name in SIDES}
        if verbose:
            print("torch.compile: " + ", ".join(f"{n} {x:.2f}x its eager step" for n, x in
                                                 out["compile_speedup"].items()))
    if verbose and device.type != "cuda":
        print("CPU run: these numbers check that bench works; they are not a GPU measurement")
    return out
