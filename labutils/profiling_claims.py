"""C6 and C7, the two claims of the course design that lab 04 measures under the 8 GB budget (the verdict rules
are in :mod:`labutils.claims`; this module runs what they need and builds their entries).

* :func:`c6_claim`: the FP32 baseline against all three techniques together (the lab's mixed precision,
  checkpointing, accumulation) at the technique table's effective batch; a baseline that does not fit is recorded
  as such, with its estimate;
* :func:`technique_claims`: C1, C2 and C4 from the same table, when its FP32 baseline fit;
* :func:`c7_claim`: ZeRO-2 with the optimizer offloaded to the CPU against plain fp16 training, where DeepSpeed
  and CUDA are here; otherwise not measured, with the estimator's prediction.
"""
from __future__ import annotations

from . import cards
from . import claims as cl
from . import zero2_offload as z2
from . import estimate as est
from .config import load_config
from .memory import fmt_bytes
from .profiling import cuda_memory_cap

GiB = 2**30
LAB = "04-Memory_Profiling"
SPEED = "target tokens/s"  # the technique table's throughput column (profiling_runs.technique_rows)


def _hardware(info: dict) -> str:
    return cl.hardware({"gpu_name": info["gpu_name"], "device": info["device"].type})


def _c6_run(c, loop, device, budget_kw: dict) -> dict:
    """One run of the notebook's ``loop(cfg, model, dataset, device) -> {"losses", "step_times", ...}`` under the
    memory tracker (model loading included, so the peak holds the weights): status, peak bytes, step times."""
    from .env import seed_everything
    from .memory import MemoryTracker, oom_caught, release
    from .train import prepare

    out = {"status": "ok", "peak_bytes": None, "step_times": [], "error": None}
    seed_everything(c.train.seed)
    loaded = dataset = None
    try:
        with oom_caught() as oom:
            with MemoryTracker(device, **budget_kw) as mt:
                loaded, dataset = prepare(c, device, verbose=False)
                r = loop(c, loaded.model, dataset, device)
            out.update(peak_bytes=mt.peak_bytes, step_times=list(r["step_times"]))
        if oom:
            out.update(status="oom", error=oom.error[:200])
    finally:
        loaded = dataset = None
        release()
    return out


def c6_plan(tech_cfg, e: int, steps: int, amp: str = "fp16") -> dict:
    """The pair C6 compares at effective batch ``e``: the FP32 baseline (``e`` x 1) and all three techniques
    (``amp`` mixed precision + checkpointing, micro-batch e/4 x accumulation 4, or less), each for ``steps``
    optimizer steps. ``amp``: the lab's mixed precision (bf16 where native, else fp16), as lab 01 decides it."""
    m = max(1, e // 4)
    base = {"train.steps": steps, "train.warmup_steps": 0}
    return {f"fp32 baseline, {e} x 1": tech_cfg.override({**base, "train.micro_batch_size": e,
                                                          "train.accumulation_steps": 1}),
            f"{amp} + checkpointing + accumulation, {m} x {e // m}": tech_cfg.override(
                {**base, "train.precision": amp, "train.gradient_checkpointing": True,
                 "train.micro_batch_size": m, "train.accumulation_steps": e // m})}


def c6_claim(tech_cfg, loop, config_path: str, budget: int, info: dict, *, amp: str = "fp16",
             **run_kw) -> tuple[dict, dict, dict]:
    """C6 measured with the notebook's one loop (``loop``, section 8.1): the FP32 baseline against all three
    techniques (``amp`` mixed precision) at ONE effective batch, the technique table's. A baseline that does not
    fit the budget is recorded as such, with the estimator's peak for it (labelled a prediction): no smaller
    batch is substituted, so there is always something to accumulate. Speed is judged only from a GPU with enough
    timed steps (:mod:`labutils.claims`); in smoke nothing is judged (the tiny model). ``info``: ``lu.setup()``'s
    dict; ``run_kw``: the CPU budget (``cpu_budget_kwargs``). Returns ``(entry, conditions, predicted largest
    micro-batch on an 8 GB card per setting)``."""
    device = info["device"]
    warm = tech_cfg.train.timing_warmup_steps
    # a GPU gets enough timed steps for a speed verdict; a CPU's time is never judged, so a few steps do
    steps = warm + cl.MIN_TIMED_STEPS if device.type == "cuda" else tech_cfg.train.steps
    E = tech_cfg.effective_batch_size
    plan = c6_plan(tech_cfg, E, steps, amp)
    with cuda_memory_cap(8):
        runs = {name: _c6_run(c, loop, device, run_kw) for name, c in plan.items()}
    names = tuple(runs)
    cond = cl.conditions(model=tech_cfg.model.name, batch=f"effective batch {E}",
                         sequence=tech_cfg.data.seq_length, precision=f"{amp} + checkpointing + accumulation vs fp32",
                         hardware=_hardware(info), mode=info["mode"],
                         budget=fmt_bytes(budget) + ("" if device.type == "cuda" else " (simulated)"))
    n_params = est.parameter_count(tech_cfg.model.name, tech_cfg.model.pad_vocab_to)
    state_bytes = 16 * n_params
    full = load_config(config_path, mode="full")
    fits_pred = {name: est.largest_batch(full, cards.card_total_bytes(8)[0], limit=64, **over) for name, over in
                 (("fp32 baseline", {}), (f"{amp} + checkpointing", {"precision": amp, "checkpointing": True}))}
    base, both = runs[names[0]], runs[names[1]]
    if base["status"] != "ok" or both["status"] != "ok":
        failed = names[0] if base["status"] != "ok" else names[1]
        c_failed = plan[failed]
        e_peak = est.estimate_memory(c_failed, device=device.type)["peak_bytes"]
        why = (f"'{failed}' did not fit the budget of {fmt_bytes(budget)} ({runs[failed]['status']}); the estimator "
               f"puts its peak at {fmt_bytes(e_peak)} (a prediction, not a measurement)")
        entry = cl.not_measured("C6", why, cond)
        entry["extra"] = {"runs": {n: {"status": r["status"], "peak_bytes": r["peak_bytes"]} for n, r in runs.items()},
                          "estimate_bytes": {failed: e_peak}, "largest_micro_batch_8GiB_predicted": fits_pred}
        return entry, cond, fits_pred
    memory_saving = 1 - both["peak_bytes"] / base["peak_bytes"]
    t_base, t_both = base["step_times"][warm:], both["step_times"][warm:]
    values = {"memory_saving": memory_saving}
    mem_ev = cl.Evidence(pair=names, note="peak allocated, model loading included",
                         state_share=state_bytes / base["peak_bytes"])
    evidence = {"memory_saving": mem_ev}
    # speed judged only on a GPU, with its noise (labutils.claims)
    t = cl.timed_ratio(t_base, t_both)                  # ratio = median step time, all together / baseline
    if t["ratio"]:
        values["slowdown"] = 1 - 1 / t["ratio"]
        spread = t["spread"] / t["ratio"] ** 2 if t["spread"] is not None else None
        evidence["slowdown"] = cl.Evidence(pair=names, timed_steps=t["timed_steps"], spread=spread,
                                           note="medians of the timed steps after warm-up, the notebook's loop")
    entry = cl.claim_entry("C6", values, cond, evidence=evidence,
                           reason=(f"{fmt_bytes(state_bytes)} of FP32 weights, gradients and AdamW state "
                                   f"({state_bytes / base['peak_bytes']:.0%} of the baseline peak) stay whatever the "
                                   f"technique"),
                           extra={"largest_micro_batch_8GiB_predicted": fits_pred,
                                  "peaks_bytes": {names[0]: base["peak_bytes"], names[1]: both["peak_bytes"]}})
    entry.setdefault("compares", {q: f"{names[0]} vs {names[1]}" for q in values})
    return entry, cond, fits_pred


def technique_claims(by: dict, cond: dict, amp: str = "fp16") -> list[dict]:
    """C1, C2 and C4 from the technique table (``by``: its rows by technique) against its FP32 baseline, when that
    baseline ran; [] when it did not (then the labs that own those claims answer them, or "not measured")."""
    base = by["baseline (fp32)"]
    if base["status"] != "ok":
        return []
    measures = {"C1": (amp, lambda r: {"memory_saving": 1 - r["peak (GiB)"] / base["peak (GiB)"]}),
                "C2": (amp, lambda r: {"speedup": r[SPEED] / base[SPEED]}),
                "C4": ("checkpointing", lambda r: {"memory_saving": 1 - r["peak (GiB)"] / base["peak (GiB)"],
                                                   "time_overhead": base[SPEED] / r[SPEED] - 1})}
    def evidence(cid: str, name: str, values: dict) -> dict:
        # what stands behind the row's numbers: the timed steps of both runs (the H200 run's C2 said only "the run
        # does not say how many timed steps stand behind it") and, for C1, its one batch size (C1 is judged over
        # lab 01's sweep)
        pair, hw = ("baseline (fp32)", name), cond.get("hardware")
        steps = [x.get("timed steps") for x in (base, by[name])]
        timed = cl.Evidence(pair=pair, hardware=hw, timed_steps=min(steps) if None not in steps else None,
                            note="the technique table's runs: target tokens/s over their timed steps")
        micro = int(str(by[name]["micro x accum"]).split(" x ")[0])
        memory = cl.Evidence(pair=pair, hardware=hw, sweep={micro: values["memory_saving"]} if cid == "C1" else None)
        return {q: (memory if q == "memory_saving" else timed) for q in values}

    out = []
    for cid, (name, measure) in measures.items():
        if by[name]["status"] != "ok":
            out.append(cl.not_measured(cid, f"the '{name}' row of section 8 ended with {by[name]['status']}", cond,
                                       lab=LAB))
            continue
        values = measure(by[name])
        out.append(cl.claim_entry(cid, values, cond, lab=LAB, evidence=evidence(cid, name, values)))
    return out


def c7_claim(config_path: str, tech_cfg, info: dict, workdir) -> dict:
    """C7 at micro-batch 1 in fp16: measured with DeepSpeed ZeRO-2 + CPU offload against plain training (in
    subprocesses writing to ``workdir``) where that can run here, else not measured with the estimator's
    prediction for the full-size config."""
    over = ["train.precision=fp16", "train.micro_batch_size=1", "train.accumulation_steps=1"]
    cond = cl.conditions(model=tech_cfg.model.name, batch="1 x 1", sequence=tech_cfg.data.seq_length,
                         precision="fp16, ZeRO-2 + CPU offload vs plain", hardware=_hardware(info), mode=info["mode"])
    full = load_config(config_path, mode="full").override({"train.micro_batch_size": 1, "train.accumulation_steps": 1})
    prediction = {"memory_saving": z2.zero2_offload_prediction(full)["memory_saving"]}
    prediction_for = f"{full.model.name}, 1 x {full.data.seq_length}, fp16, one CUDA GPU"
    # not measured: the row shows the prediction, so its conditions are the prediction's, not this run's
    pred_cond = cl.conditions(model=full.model.name, batch="1 x 1", sequence=full.data.seq_length,
                              precision="fp16, ZeRO-2 + CPU offload vs plain", hardware="one CUDA GPU (predicted)",
                              mode=info["mode"])
    missing = z2.zero2_offload_unavailable()
    if missing:
        return cl.not_measured("C7", missing, pred_cond, prediction=prediction, prediction_for=prediction_for)
    c7 = z2.measure_zero2_offload(config_path, over, workdir)
    if "error" in c7:
        return cl.not_measured("C7", c7["error"], pred_cond, prediction=prediction, prediction_for=prediction_for)
    p_peak, z_peak = c7["plain"]["peak_memory_bytes"], c7["zero2_offload"]["peak_memory_bytes"]
    return cl.claim_entry("C7", {"memory_saving": 1 - z_peak / p_peak}, cond,
                          reason=f"GPU peak {fmt_bytes(p_peak)} plain vs {fmt_bytes(z_peak)} with the AdamW state "
                                 f"on the CPU")
