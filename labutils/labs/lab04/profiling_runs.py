"""Lab 04's experiments as rows: every run measured under the lab's one budget (an 8 GB card) next to the estimator's
prediction for it. The written-out training step and the raw ``torch.cuda`` / ``torch.profiler`` calls stay in the
notebook: they are what the lab teaches. """
from __future__ import annotations

import re

import torch

from ...core import cards
from ...core import device as dev
from ...estimator import estimate as est
from ...models.loss_chunks import DEFAULT_CHUNK
from ...core.memory import MemoryTracker, cpu_budget_kwargs, gib, oom_caught, release  # noqa: F401 (pr.cpu_budget_kwargs)
from ...models.gpt2 import padded_vocab_size, vocab_size
from ...core.train import autocast_for, make_optimizer, prepare, run

GiB, MiB = 2**30, 2**20


def as_counted(phase: str) -> str:
    """An estimator phase with steps counted from 1, as tables and figures count them (the replay counts from 0)."""
    return re.sub(r"\bstep (\d+)", lambda m: f"step {int(m.group(1)) + 1}", phase)


class MeasuredRuns:
    """Every measured run (``runs.rows``, section 10): this device's estimate against the measurement, the CUDA
    prediction beside it, and ``start_bytes`` (memory in use at the start)."""

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
        """The estimate on the measurement's basis: absolute on CUDA; on CPU shifted to the run's measured start."""
        if self.device.type == "cpu" and res.ok:
            return e["peak_bytes"] + res.memory["start_bytes"] - e["resident_bytes"]
        return e["peak_bytes"]


def setup_training(c, device: torch.device):
    """``model, optimizer, data, windows = setup_training(cfg, device)``, as ``lu.train`` has them."""
    loaded, dataset = prepare(c, device, verbose=False)
    model = loaded.model.train()
    optimizer, _ = make_optimizer(model, c, device)
    data = dataset.to(device)
    return model, optimizer, data, data.windows(c.train.micro_batch_size, c.train.accumulation_steps, c.train.seed)


def fresh_training(c, device: torch.device, fn):
    """``fn(model, optimizer, data, windows, autocast)`` on a fresh :func:`setup_training` of ``c``, all released when
    it returns (even after an error), so the next measurement starts from the lab's baseline."""
    model, optimizer, data, windows = setup_training(c, device)
    try:
        return fn(model, optimizer, data, windows, autocast_for(c.train.precision, device))
    finally:
        model = optimizer = data = windows = None
        release()


def add_stage_estimates(rows: list[dict], e_stage: dict, start_bytes: int, device: torch.device, n_params: int) -> None:
    """Add to each stage row ``other`` (allocated minus weights, gradients and AdamW state) and ``estimate`` (the
    estimator's timeline at the same point, steps from 0; on CPU shifted to the measured start)."""
    shift = start_bytes - e_stage["resident_bytes"] if device.type == "cpu" else 0
    est_at = {p["label"]: p["bytes"] + shift for p in e_stage["timeline"]}
    for r in rows:
        r["other"] = r["allocated"] - r["params"] - r["grads"] - r["optimizer"]
        s = r["step"]
        key = {"before forward": "start" if s == 0 else f"step {s - 1} after optimizer step",
               "after forward": f"step {s} after forward", "after backward": f"step {s} after backward",
               "after zero_grad": f"step {s} after optimizer step"}.get(r["stage"])
        r["estimate"] = est_at.get(key) if key else est_at[f"step {s} after optimizer step"] + 4 * n_params


def stage_table(rows: list[dict]) -> list[dict]:
    """The stage rows in MiB, steps counted from 1 (as :func:`as_counted` and the figures count them)."""
    return [{"step": r["step"] + 1, "stage": r["stage"], "allocated (MiB)": r["allocated"] / MiB,
             "estimate (MiB)": r["estimate"] / MiB, "weights (MiB)": r["params"] / MiB, "grads (MiB)": r["grads"] / MiB,
             "AdamW state (MiB)": r["optimizer"] / MiB, "other (MiB)": r["other"] / MiB} for r in rows]


def _measured(c, name: str, runs: MeasuredRuns, **run_kw) -> tuple[dict, dict]:
    """``lu.run`` one config (an OOM is a row): ``(row, estimate)``, the row with status, measured peak, the estimate
    on the same basis, throughput, device, weights and error. A run that fit goes into ``runs``."""
    res = run(c, desc=name, verbose=False, **run_kw)
    e = (runs.record(name, c, res.peak_memory_bytes, res.memory["start_bytes"]) if res.ok else
         est.estimate_memory(c, device=runs.device.type))
    return {"status": res.status, "peak (GiB)": gib(res.peak_memory_bytes) if res.ok else None,
            "estimate (GiB)": gib(runs.estimate_for(res, e)), "target tokens/s": res.target_tokens_per_second,
            "timed steps": res.timed_steps, "mfu": res.mfu, "device": res.env.get("gpu_name") or res.env.get("device"),
            "weights": res.env.get("weights"), "error": (res.error or "")[:80]}, e


def batch_sweep(cfg, batch_sizes, runs: MeasuredRuns, **run_kw) -> list[dict]:
    """Two steps of ``cfg`` at each micro-batch size, one row each (:func:`_measured`)."""
    return [{"micro_batch": b, **_measured(cfg.override({"train.micro_batch_size": b, "train.steps": 2,
                                                          "train.timing_warmup_steps": 1}),
                                           f"sweep micro-batch {b}", runs, **run_kw)[0]} for b in batch_sizes]


def largest_batch_rows(cfg, cards_, fixed: float, per_sample: float, device: torch.device) -> list[dict]:
    """For each ``(label, budget_bytes)``: the largest micro-batch by the fitted line ``fixed + per_sample x batch``,
    by the estimator's raw peak, and recommended (:func:`labutils.estimator.estimate.fits`)."""
    context = est.CUDA_CONTEXT_BYTES if device.type == "cuda" else 0
    return [{"budget": label, "GiB": budget / GiB,
             "largest batch (fit)": int((budget - dev.outside_allocator_bytes()[0] - fixed) // per_sample),
             "largest batch (estimator, raw peak)": est.largest_batch(cfg, budget, device=device.type, safe=False),
             "recommended (estimator, 10% headroom" + (", CUDA context)" if context else ")"):
                 est.largest_batch(cfg, budget, device=device.type, context_bytes=context)}
            for label, budget in cards_]


def technique_rows(tech_cfg, techniques: dict, runs: MeasuredRuns, full_cfg=None, **run_kw) -> list[dict]:
    """Train ``tech_cfg`` with each technique ``{name: overrides}``, with whether the full-size config fits an 8 GB
    card (estimate), the estimate's peak phase, and the saving against the first row (its estimate if OOM)."""
    card = cards.card_total_bytes(8)[0]
    rows = []
    for name, over in techniques.items():
        c = tech_cfg.override(over)
        row, e = _measured(c, f"technique: {name}", runs, **run_kw)
        fits = est.fits(est.estimate_memory((full_cfg or tech_cfg).override(over)), card)
        rows.append({"technique": name, "micro x accum": f"{c.train.micro_batch_size} x {c.train.accumulation_steps}",
                     **row, "8 GB card (estimate)": "fits" if fits else "OOM",
                     "peak phase (estimate)": as_counted(e["peak_phase"])})
    base_peak = (rows[0]["peak (GiB)"] or rows[0]["estimate (GiB)"]) * GiB
    for r in rows:
        r["saving vs baseline (%)"] = None if r["peak (GiB)"] is None else 100 * (1 - r["peak (GiB)"] * GiB / base_peak)
    return rows


def logits_share_rows(cfg, device=None, chunk_size: int | None = None, progress: bool = False) -> list[dict]:
    """``[full_row, chunked_row]``: ``cfg`` trained with the full loss, then the chunked one (``chunk_size`` positions
    a chunk): its peak, the logits' bytes (all, largest live) and their shares, and the saving against the full loss."""
    chunk = int(chunk_size or cfg.model.loss_chunk_size or DEFAULT_CHUNK)
    positions = cfg.train.micro_batch_size * cfg.data.seq_length
    if chunk >= positions:
        raise ValueError(f"logits_share_rows: a chunk of {chunk} positions holds all {positions} positions of a "
                         f"micro-batch ({cfg.train.micro_batch_size} x {cfg.data.seq_length}): the chunked loss "
                         f"would be the full loss; give chunk_size below {positions}")
    logits = 4 * positions * padded_vocab_size(vocab_size(cfg.model.name), cfg.model.pad_vocab_to)
    rows = []
    for loss in ("full", "chunked"):
        res = run(cfg.override({"model.loss": loss, "model.loss_chunk_size": chunk}), device, progress=progress,
                  verbose=False, desc=f"loss {loss}")
        largest = logits if loss == "full" else logits * chunk // positions
        peak = res.peak_memory_bytes if res.ok else None
        rows.append({"loss": loss, "chunk_size": chunk if loss == "chunked" else None, "status": res.status,
                     "peak_bytes": peak, "start_bytes": res.memory.get("start_bytes"), "logits_bytes": logits,
                     "largest_logits_bytes": largest, "logits_share": logits / peak if peak else None,
                     "largest_logits_share": largest / peak if peak else None,
                     "final_loss": res.losses[-1] if res.losses else None, "error": res.error})
    full_peak = rows[0]["peak_bytes"]
    for row in rows:
        ok = full_peak is not None and row["peak_bytes"] is not None
        row["saved_bytes"] = full_peak - row["peak_bytes"] if ok else None
        row["saved_logits"] = row["saved_bytes"] / logits if ok else None
    return rows


def leak_curves(c, device: torch.device, one_step, warmup_step, variants, steps: int) -> dict:
    """``{variant: [bytes above the start after each step], variant + " (after del)": bytes once the logs are
    dropped}`` over ``steps`` steps of ``one_step`` per variant, after one ``warmup_step``; an OOM ends a variant."""
    def curves_of(model, optimizer, data, windows, autocast):
        val = next(data.windows(1, 1, c.train.seed + 7)).micro_batches[0]
        warmup_step(model, optimizer, next(windows), autocast)
        curves = {}
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

    return fresh_training(c, device, curves_of)


def leak_table(curves: dict, variants) -> list[dict]:
    """One row per variant of :func:`leak_curves`: growth per step (first to last step), what stayed after del."""
    return [{"variant": name, "growth per step (MiB)": (ys[-1] - ys[0]) / max(1, len(ys) - 1) / MiB if ys else None,
             "after del (MiB)": curves[name + " (after del)"] / MiB} for name, ys in ((n, curves[n]) for n in variants)]
