"""C6 and C7, the two claims of the course design that lab 04 measures under the 8 GB budget (the verdict rules
are in :mod:`labutils.claims`; this module runs what they need and builds their entries).

* :func:`c6_claim`: the FP32 baseline against all three techniques together (mixed precision, checkpointing,
  accumulation) at the same effective batch: the technique table's rows when the baseline fit, else the
  largest effective batch where it does (halving until the baseline runs), so an 8 GB card gives C6 a number;
* :func:`technique_claims`: C1, C2 and C4 from the same table, when its FP32 baseline fit;
* :func:`c7_claim`: ZeRO-2 with the optimizer offloaded to the CPU against plain fp16 training, where DeepSpeed
  and CUDA are here; otherwise not measured, with the estimator's prediction.
"""
from __future__ import annotations

from . import cards
from . import claims as cl
from . import estimate as est
from .config import load_config
from .memory import fmt_bytes
from .profiling import cuda_memory_cap
from .train import run

GiB = 2**30
LAB = "04-Memory_Profiling"
SPEED = "target tokens/s"  # the technique table's throughput column (profiling_runs.technique_rows)


def _hardware(info: dict) -> str:
    return cl.hardware({"gpu_name": info["gpu_name"], "device": info["device"].type})


def _c6_runs(tech_cfg, e: int, run_kw: dict) -> dict:
    """The FP32 baseline and "all together" at effective batch ``e``, under the 8 GB card's cap."""
    m = max(1, e // 4)                                   # all together: micro-batch e/4 x accumulation 4 (or less)
    plan = {"baseline (fp32)": {"train.micro_batch_size": e, "train.accumulation_steps": 1},
            "all together": {"train.precision": "fp16", "train.gradient_checkpointing": True,
                             "train.micro_batch_size": m, "train.accumulation_steps": e // m}}
    with cuda_memory_cap(8):
        return {name: run(tech_cfg.override(over), desc=f"C6 {name}, batch {e}", verbose=False, **run_kw)
                for name, over in plan.items()}


def c6_claim(tech_cfg, by: dict, config_path: str, budget: int, info: dict, **run_kw) -> tuple[dict, dict, dict]:
    """C6 from the technique table (``by``: its rows by technique), running the pair again at smaller effective
    batches when the baseline did not fit. ``info``: ``lu.setup()``'s dict; ``run_kw``: ``lu.run``'s budget
    arguments. Returns ``(entry, conditions, predicted largest micro-batch on an 8 GB card (7.78 GiB to torch) per setting)``."""
    device = info["device"]
    E = tech_cfg.effective_batch_size
    c6_batch, c6 = E, None
    if by["baseline (fp32)"]["status"] != "ok":
        e = E // 2
        while e >= 1 and c6 is None:
            runs_e = _c6_runs(tech_cfg, e, run_kw)
            if runs_e["baseline (fp32)"].ok:
                c6_batch, c6 = e, runs_e
            e //= 2
    cond = cl.conditions(model=tech_cfg.model.name, batch=f"effective batch {c6_batch}",
                         sequence=tech_cfg.data.seq_length, precision="fp16 + checkpointing + accumulation vs fp32",
                         hardware=_hardware(info), mode=info["mode"],
                         budget=f"{budget / GiB:.3g} GiB" + ("" if device.type == "cuda" else " (simulated)"))
    if c6 is None:   # the table's own rows
        b_row, a_row = by["baseline (fp32)"], by["all together"]
        pair = ((b_row["peak (GiB)"] or 0) * GiB, b_row[SPEED], (a_row["peak (GiB)"] or 0) * GiB, a_row[SPEED]) \
            if b_row["status"] == a_row["status"] == "ok" else None
    else:
        b_run, a_run = c6["baseline (fp32)"], c6["all together"]
        pair = (b_run.peak_memory_bytes, b_run.target_tokens_per_second, a_run.peak_memory_bytes,
                a_run.target_tokens_per_second) \
            if a_run.ok else None
    state_bytes = 16 * est.parameter_count(tech_cfg.model.name)
    fits_pred = {name: est.largest_batch(plan_over, cards.card_total_bytes(8)[0], limit=64, **over) for name, plan_over, over in
                 (("fp32 baseline", load_config(config_path, mode="full"), {}),
                  ("fp16 + checkpointing", load_config(config_path, mode="full"),
                   {"precision": "fp16", "checkpointing": True}))}
    if pair:
        b_peak, b_tps, a_peak, a_tps = pair
        entry = cl.claim_entry("C6", {"memory_saving": 1 - a_peak / b_peak, "slowdown": 1 - a_tps / b_tps}, cond,
                               reason=(f"{fmt_bytes(state_bytes)} of FP32 weights, gradients and AdamW state "
                                       f"({state_bytes / b_peak:.0%} of the baseline peak) stay whatever the technique"
                                       + ("; at effective batch 1 there is nothing to accumulate" if c6_batch == 1
                                          else "")),
                               extra={"largest_micro_batch_8GiB_predicted": fits_pred})
    else:
        entry = cl.not_measured("C6", f"the FP32 baseline did not fit the budget at any effective batch from {E} "
                                      f"down to 1", cond)
    return entry, cond, fits_pred


def technique_claims(by: dict, cond: dict) -> list[dict]:
    """C1, C2 and C4 from the technique table (``by``: its rows by technique) against its FP32 baseline, when that
    baseline ran; [] when it did not (then the labs that own those claims answer them, or "not measured")."""
    base = by["baseline (fp32)"]
    if base["status"] != "ok":
        return []
    measures = {"C1": ("fp16", lambda r: {"memory_saving": 1 - r["peak (GiB)"] / base["peak (GiB)"]}),
                "C2": ("fp16", lambda r: {"speedup": r[SPEED] / base[SPEED]}),
                "C4": ("checkpointing", lambda r: {"memory_saving": 1 - r["peak (GiB)"] / base["peak (GiB)"],
                                                   "time_overhead": base[SPEED] / r[SPEED] - 1})}
    return [cl.claim_entry(cid, measure(by[name]), cond, lab=LAB) if by[name]["status"] == "ok" else
            cl.not_measured(cid, f"the '{name}' row of section 8 ended with {by[name]['status']}", cond, lab=LAB)
            for cid, (name, measure) in measures.items()]


def c7_claim(config_path: str, tech_cfg, info: dict, workdir) -> dict:
    """C7 at micro-batch 1 in fp16: measured with DeepSpeed ZeRO-2 + CPU offload against plain training (in
    subprocesses writing to ``workdir``) where that can run here, else not measured with the estimator's
    prediction for the full-size config."""
    over = ["train.precision=fp16", "train.micro_batch_size=1", "train.accumulation_steps=1"]
    cond = cl.conditions(model=tech_cfg.model.name, batch="1 x 1", sequence=tech_cfg.data.seq_length,
                         precision="fp16, ZeRO-2 + CPU offload vs plain", hardware=_hardware(info), mode=info["mode"])
    full = load_config(config_path, mode="full").override({"train.micro_batch_size": 1, "train.accumulation_steps": 1})
    prediction = {"memory_saving": cl.zero2_offload_prediction(full)["memory_saving"]}
    prediction_for = f"{full.model.name}, 1 x {full.data.seq_length}, fp16, one CUDA GPU"
    missing = cl.zero2_offload_unavailable()
    if missing:
        return cl.not_measured("C7", missing, cond, prediction=prediction, prediction_for=prediction_for)
    c7 = cl.measure_zero2_offload(config_path, over, workdir)
    if "error" in c7:
        return cl.not_measured("C7", c7["error"], cond, prediction=prediction, prediction_for=prediction_for)
    p_peak, z_peak = c7["plain"]["peak_memory_bytes"], c7["zero2_offload"]["peak_memory_bytes"]
    return cl.claim_entry("C7", {"memory_saving": 1 - z_peak / p_peak}, cond,
                          reason=f"GPU peak {fmt_bytes(p_peak)} plain vs {fmt_bytes(z_peak)} with the AdamW state "
                                 f"on the CPU")
