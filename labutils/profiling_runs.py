"""Lab 04's experiments as rows: every run measured under a memory budget and set next to the estimator's
prediction for it (``labutils.estimate``).

* budgets: :func:`budget_like` (an 8 GB card on a GPU; on CPU a simulated card scaled to the smoke model),
  :func:`cpu_budget_kwargs` (what ``lu.run`` needs to raise the simulated OOM);
* :class:`MeasuredRuns`: the notebook's record of every run, estimate against measurement (section 10's table);
* section 4: :func:`setup_training` (model, optimizer and data as ``lu.train`` has them), and
  :func:`add_stage_estimates` / :func:`stage_table` for the stage-by-stage rows;
* section 5: :func:`batch_sweep` and :func:`largest_batch_rows`;
* section 8: :func:`technique_rows`;
* section 9: :func:`leak_curves` (the notebook writes the leaking step; this runs it) and :func:`leak_table`.

The written-out training step, the memory marks and the raw ``torch.cuda`` / ``torch.profiler`` calls stay in
the notebook: they are what the lab teaches.
"""
from __future__ import annotations

import torch

from . import cards
from . import device as dev
from . import estimate as est
from .config import load_config
from .memory import MemoryTracker, gib, oom_caught, release
from .train import autocast_for, make_optimizer, prepare, run

GiB, MiB = 2**30, 2**20


# ----------------------------------------------------------------------------------------------------------
# Budgets and the record of every run
# ----------------------------------------------------------------------------------------------------------
def budget_like(gb: float, config_path: str, device: torch.device) -> int:
    """The budget of a card sold as ``gb`` GB, in bytes. CUDA: what torch reports on such a card
    (:func:`labutils.cards.card_total_bytes`: 7.78 GiB for 8). CPU: a simulated card that gives the smoke model
    as many bytes per parameter as ``gb`` GiB give the full-size model of the config (the CPU tracker raises
    OutOfMemoryError past it)."""
    if device.type == "cuda":
        return cards.card_total_bytes(gb)[0]
    full = load_config(config_path, mode="full").model.name
    small = load_config(config_path).model.name
    return int(gb * GiB * est.parameter_count(small) / est.parameter_count(full))


def cpu_budget_kwargs(budget: int, device: torch.device) -> dict:
    """``lu.run`` keyword arguments for a budget: none on CUDA; on CPU ``cpu_budget_bytes``, the budget plus
    every CPU tensor alive now (``lu.run``'s simulated OOM counts every CPU tensor of the process)."""
    if device.type == "cuda":
        return {}
    with MemoryTracker(device) as t:
        pass
    return {"cpu_budget_bytes": t.start_bytes + budget}


def context_bytes(device: torch.device) -> int:
    """Memory the estimator keeps for the CUDA context, outside PyTorch's allocator (0 on CPU)."""
    return est.CUDA_CONTEXT_BYTES if device.type == "cuda" else 0


class MeasuredRuns:
    """Every measured run of the notebook, one row each: the estimate for this device's kernels against what
    was measured, and the CUDA prediction next to it (``runs.rows`` is section 10's table). ``start_bytes``: memory
    in use when the run started, so the notebook shows each run starts from the lab's baseline (no leftovers)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.records: dict[str, dict] = {}

    def record(self, name: str, c, measured_peak: int, measured_start: int) -> dict:
        """Keep one row for run ``name`` of config ``c``; returns the estimate for this device."""
        e = est.estimate_memory(c, device=self.device.type)
        self.records[name] = {"run": name, **est.compare(e, measured_peak, measured_start, self.device.type),
                              "cuda_prediction_bytes": est.estimate_memory(c)["peak_bytes"],
                              "start_bytes": measured_start}
        return e

    @property
    def rows(self) -> list[dict]:
        return list(self.records.values())

    def estimate_for(self, res, e: dict) -> int:
        """The estimate on the measurement's basis: absolute on CUDA; on CPU shifted to the run's measured
        start."""
        if self.device.type == "cpu" and res.ok:
            return e["peak_bytes"] + res.memory["start_bytes"] - e["resident_bytes"]
        return e["peak_bytes"]


# ----------------------------------------------------------------------------------------------------------
# Section 4: one training step, stage by stage
# ----------------------------------------------------------------------------------------------------------
def setup_training(c, device: torch.device):
    """Model (in train mode), optimizer, the dataset on the device and its window iterator, as ``lu.train``
    has them: ``model, optimizer, data, windows = setup_training(cfg, device)``."""
    loaded, dataset = prepare(c, device, verbose=False)
    model = loaded.model
    model.train()
    optimizer, _ = make_optimizer(model, c, device)
    data = dataset.to(device)                            # the dataset lives on the device, as in lu.train
    return model, optimizer, data, data.windows(c.train.micro_batch_size, c.train.accumulation_steps, c.train.seed)


def add_stage_estimates(rows: list[dict], e_stage: dict, start_bytes: int, device: torch.device,
                        n_params: int) -> None:
    """Add to each stage row ``other`` (allocated minus weights, gradients and AdamW state) and ``estimate``
    (the estimator's timeline at the same point; on CPU shifted to the measured start)."""
    shift = start_bytes - e_stage["resident_bytes"] if device.type == "cpu" else 0   # CPU: align the starts
    est_at = {p["label"]: p["bytes"] + shift for p in e_stage["timeline"]}
    for r in rows:
        r["other"] = r["allocated"] - r["params"] - r["grads"] - r["optimizer"]
        s = r["step"]
        key = {"before forward": "start" if s == 0 else f"step {s - 1} after optimizer step",
               "after forward": f"step {s} after forward", "after backward": f"step {s} after backward",
               "after zero_grad": f"step {s} after optimizer step"}.get(r["stage"])
        r["estimate"] = est_at.get(key) if key else est_at[f"step {s} after optimizer step"] + 4 * n_params


def stage_table(rows: list[dict]) -> list[dict]:
    """The stage rows for display, in MiB, steps numbered from 1."""
    return [{"step": r["step"] + 1, "stage": r["stage"], "allocated (MiB)": r["allocated"] / MiB,
             "estimate (MiB)": r["estimate"] / MiB, "weights": r["params"] / MiB, "grads": r["grads"] / MiB,
             "AdamW state": r["optimizer"] / MiB, "other (activations, data, temporaries)": r["other"] / MiB}
            for r in rows]


# ----------------------------------------------------------------------------------------------------------
# Section 5: batch sweep
# ----------------------------------------------------------------------------------------------------------
def batch_sweep(cfg, batch_sizes, runs: MeasuredRuns, **run_kw) -> list[dict]:
    """Two steps of ``cfg`` at each micro-batch size (``lu.run``: an OOM is a row, not a crash); one row each
    with the measured peak and the estimate. Every run that fits goes into ``runs``."""
    sweep = []
    for b in batch_sizes:
        c = cfg.override({"train.micro_batch_size": b, "train.steps": 2, "train.timing_warmup_steps": 1})
        res = run(c, desc=f"micro-batch {b}", verbose=False, **run_kw)
        e = est.estimate_memory(c, device=runs.device.type)
        row = {"micro_batch": b, "status": res.status, "peak (GiB)": gib(res.peak_memory_bytes) if res.ok else None,
               "estimate (GiB)": gib(runs.estimate_for(res, e)), "target tokens/s": res.target_tokens_per_second,
               "device": res.env.get("gpu_name") or res.env.get("device"), "weights": res.env.get("weights"),
               "error": (res.error or "")[:80]}
        if res.ok:
            runs.record(f"sweep micro-batch {b}", c, res.peak_memory_bytes, res.memory["start_bytes"])
        sweep.append(row)
    return sweep


def largest_batch_rows(cfg, cards, fixed: float, per_sample: float, device: torch.device) -> list[dict]:
    """For each ``(label, budget_bytes)`` card: the largest micro-batch by the fitted line ``fixed + per_sample
    x batch``, by the estimator's raw peak, and the estimator's recommendation (10 % headroom, CUDA context)."""
    context = context_bytes(device)
    rows = []
    for label, budget in cards:
        # the fit is of the allocator's peak: on a GPU the CUDA context takes its share of the card first
        fit_max = int((budget - dev.outside_allocator_bytes()[0] - fixed) // per_sample)
        rows.append({"budget": label, "GiB": budget / GiB, "largest batch (fit)": fit_max,
                     "largest batch (estimator, raw peak)": est.largest_batch(cfg, budget, device=device.type,
                                                                              safe=False),
                     "recommended (estimator, 10% headroom" + (", CUDA context)" if context else ")"):
                         est.largest_batch(cfg, budget, device=device.type, context_bytes=context)})
    return rows


# ----------------------------------------------------------------------------------------------------------
# Section 8: techniques under the budget
# ----------------------------------------------------------------------------------------------------------
def technique_rows(tech_cfg, techniques, runs: MeasuredRuns, budget: int, **run_kw) -> list[dict]:
    """Train ``tech_cfg`` with each ``(name, overrides)`` technique (``lu.run``: an OOM is a row); one row each
    with the measured peak, the estimate, whether the estimate fits ``budget``, throughput, and the saving
    against the first row (its estimate when it did not fit). Every run that fits goes into ``runs``."""
    context = context_bytes(runs.device)
    rows = []
    for name, over in techniques:
        c = tech_cfg.override(over)
        res = run(c, desc=name, verbose=False, **run_kw)
        e = est.estimate_memory(c, device=runs.device.type)
        if res.ok:
            runs.record(f"technique: {name}", c, res.peak_memory_bytes, res.memory["start_bytes"])
        rows.append({"technique": name, "micro x accum": f"{c.train.micro_batch_size} x {c.train.accumulation_steps}",
                     "status": res.status, "peak (GiB)": gib(res.peak_memory_bytes) if res.ok else None,
                     "estimate (GiB)": gib(runs.estimate_for(res, e)),
                     "fits the budget (estimate)": est.fits(e, budget, context),
                     "target tokens/s": res.target_tokens_per_second, "timed steps": res.timed_steps, "mfu": res.mfu,
                     "peak phase (estimate)": e["peak_phase"],
                     "device": res.env.get("gpu_name") or res.env.get("device"), "weights": res.env.get("weights"),
                     "error": (res.error or "")[:60]})
    base = rows[0]
    base_peak = (base["peak (GiB)"] or base["estimate (GiB)"]) * GiB
    for r in rows:
        got = r["peak (GiB)"]
        r["saving vs baseline (%)"] = None if got is None else 100 * (1 - got * GiB / base_peak)
    return rows


# ----------------------------------------------------------------------------------------------------------
# Section 9: leaks
# ----------------------------------------------------------------------------------------------------------
def leak_curves(c, device: torch.device, one_step, warmup_step, variants, steps: int) -> dict:
    """Memory above the start after each of ``steps`` training steps, per variant of keeping the losses.

    ``warmup_step(model, optimizer, window, autocast)`` runs once first (the AdamW state exists from then on);
    then for each variant, ``one_step(model, optimizer, window, val, autocast, variant, train_log, val_log)``
    ``steps`` times (``val``: one validation sequence). An OOM ends a variant early. Returns ``{variant: [bytes
    after step 1, 2, ...], variant + " (after del)": bytes once the logs are dropped}``."""
    model, optimizer, data, windows = setup_training(c, device)
    autocast = autocast_for(c.train.precision, device)
    val = next(data.windows(1, 1, c.train.seed + 7)).micro_batches[0]   # one validation sequence
    curves = {}
    try:
        warmup_step(model, optimizer, next(windows), autocast)   # AdamW state exists from here on
        with MemoryTracker(device) as mt:
            for variant in variants:
                train_log, val_log, ys = [], [], []
                start = mt.current_bytes()
                for _ in range(steps):
                    with oom_caught() as oom:
                        one_step(model, optimizer, next(windows), val, autocast, variant, train_log, val_log)
                    if oom:                                        # the leak filled the card
                        print(f"{variant}: out of memory after {len(ys)} steps")
                        break
                    ys.append(mt.current_bytes() - start)
                curves[variant] = ys
                del train_log, val_log                             # dropping the lists frees the graphs
                curves[variant + " (after del)"] = mt.current_bytes() - start
        return curves
    finally:
        model = optimizer = data = windows = val = None   # drop every reference, even after an error
        release()


def leak_table(curves: dict, variants) -> list[dict]:
    """One row per variant of :func:`leak_curves`: growth per step (first to last step) and what stayed after
    dropping the logs, in MiB."""
    rows = []
    for name in variants:
        ys = curves[name]
        growth = (ys[-1] - ys[0]) / max(1, len(ys) - 1)
        rows.append({"variant": name, "growth per step (MiB)": growth / MiB,
                     "after del (MiB)": curves[name + " (after del)"] / MiB})
    return rows
