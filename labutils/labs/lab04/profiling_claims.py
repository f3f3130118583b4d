"""C6 and C7, the course-design claims lab 04 measures: :func:`c6_claim` runs all three techniques together against the
FP32 baseline with the notebook's one loop; :func:`c7_claim` DeepSpeed ZeRO-2 + CPU offload against plain fp16 where
DeepSpeed and CUDA are here, else not measured with the estimator's prediction. """
from __future__ import annotations

from ...verdicts import claims as cl
from ...estimator import estimate as est
from ...core.config import load_config
from ...core.memory import fmt_bytes, memory_in_use

ZERO2_OFFLOAD_ACCELERATE = "configs/accelerate/deepspeed_zero2_offload.yaml"


def c6_sides(tech_cfg, pair: dict, budget: int, device: str) -> dict:
    """C6's sides (``pair``: {name: overrides}, FP32 first) sized by the estimator to fit ``budget`` bytes (the lab's
    8 GB card; smoke: its scale model): FP32 as one micro-batch of E, the largest even E up to the config's effective
    batch that fits, the techniques as E/2 x 2; at the config's sequence, else 3/4 or 1/2 of it: the first with E>=2."""
    for c in (tech_cfg.override({"data.seq_length": tech_cfg.data.seq_length * n // 4}) for n in (4, 3, 2)):
        if (E := est.largest_batch(c, budget, device=device, context_bytes=0, limit=c.effective_batch_size)//2*2) > 1:
            break
    sides = {name: {**o, "train.micro_batch_size": max(E, 2) // (1 + i), "train.accumulation_steps": 1 + i}
             for i, (name, o) in enumerate(pair.items())}  # none fits: the smallest plan runs, its OOM is recorded
    return {f"{n}, {o['train.micro_batch_size']} x {o['train.accumulation_steps']}": c.override(o)
            for n, o in sides.items()}


def _c6_run(c, loop, device, budget_bytes: int | None = None) -> dict:
    """One run of the notebook's ``loop(cfg, model, dataset, device)`` under the memory tracker (model loading
    included, so the peak holds the weights; a CPU refuses past ``budget_bytes``): status, peak bytes, step times."""
    from ...core.env import seed_everything
    from ...core.memory import MemoryTracker, oom_caught, release
    from ...core.train import prepare

    out = {"status": "ok", "peak_bytes": None, "step_times": [], "error": None}
    seed_everything(c.train.seed)
    loaded = dataset = None
    try:
        with oom_caught() as oom:
            with MemoryTracker(device, cpu_budget_bytes=budget_bytes if device.type == "cpu" else None) as mt:
                loaded, dataset = prepare(c, device, verbose=False)
                r = loop(c, loaded.model, dataset, device)
            out.update(peak_bytes=mt.peak_bytes, step_times=list(r["step_times"]))
        if oom:
            out.update(status="oom", error=oom.error[:200])
    finally:
        loaded = dataset = None
        release()
    return out


def c6_claim(tech_cfg, loop, info: dict, pair: dict, *, amp: str = "fp16", budget_bytes: int) -> tuple:
    """(C6 entry, its conditions): FP32 against all three techniques (``pair``: {name: overrides}) at one effective
    batch with the notebook's ``loop``, both sized by :func:`c6_sides` to fit what ``budget_bytes`` leaves above the
    memory in use (the tracker counts it in every peak; a GPU: capped)."""
    device = info["device"]
    warm = tech_cfg.train.timing_warmup_steps
    # a GPU gets enough timed steps for a speed verdict; a CPU's time is never judged, so a few steps do
    steps = warm + cl.MIN_TIMED_STEPS if device.type == "cuda" else tech_cfg.train.steps
    plan = {name: c.override({"train.steps": steps, "train.warmup_steps": 0})
            for name, c in c6_sides(tech_cfg, pair, budget_bytes - memory_in_use(device), device.type).items()}
    runs = {name: _c6_run(c, loop, device, budget_bytes) for name, c in plan.items()}
    c = next(iter(plan.values()))
    names = tuple(runs)
    cond = cl.conditions(model=tech_cfg.model.name, batch=f"effective batch {c.effective_batch_size}",
                         sequence=c.data.seq_length, precision=f"{amp} + checkpointing + accumulation vs fp32",
                         hardware=cl.hardware(info), mode=info["mode"], budget=fmt_bytes(budget_bytes))
    state_bytes = 16 * est.parameter_count(tech_cfg.model.name, tech_cfg.model.pad_vocab_to)
    base, both = runs[names[0]], runs[names[1]]
    if base["status"] != "ok" or both["status"] != "ok":
        failed = names[0] if base["status"] != "ok" else names[1]
        e_peak = est.estimate_memory(plan[failed], device=device.type)["peak_bytes"]
        entry = cl.not_measured("C6", f"'{failed}' did not fit the {fmt_bytes(budget_bytes)} budget "
                                      f"({runs[failed]['status']}); the estimator puts its peak at {fmt_bytes(e_peak)} "
                                      f"(a prediction, not a measurement)", cond)
        entry["extra"] = {"runs": {n: {"status": r["status"], "peak_bytes": r["peak_bytes"]} for n, r in runs.items()},
                          "estimate_bytes": {failed: e_peak}}
        return entry, cond
    values = {"memory_saving": 1 - both["peak_bytes"] / base["peak_bytes"]}
    evidence = {"memory_saving": cl.Evidence(pair=names, note="peak allocated, model loading included",
                                             state_share=state_bytes / base["peak_bytes"])}
    t = cl.timed_ratio(base["step_times"][warm:], both["step_times"][warm:])   # all together / baseline
    if t["ratio"]:
        values["slowdown"] = 1 - 1 / t["ratio"]
        evidence["slowdown"] = cl.Evidence(pair=names, timed_steps=t["timed_steps"],
                                           spread=t["spread"] / t["ratio"] ** 2 if t["spread"] is not None else None,
                                           note="medians of the timed steps after warm-up, the notebook's loop")
    entry = cl.claim_entry("C6", values, cond, evidence=evidence,
                           reason=(f"{fmt_bytes(state_bytes)} of FP32 weights, gradients and AdamW state "
                                   f"({state_bytes / base['peak_bytes']:.0%} of the baseline peak) stay whatever the "
                                   f"technique"),
                           extra={"peaks_bytes": {names[0]: base["peak_bytes"], names[1]: both["peak_bytes"]}})
    return entry, cond


def zero2_offload_prediction(cfg, precision: str = "fp16") -> dict:
    """C7's prediction for ``cfg`` on one GPU: model state under plain mixed precision (16P, ZeRO stage 0) vs ZeRO-2
    with the optimizer on the CPU (4P on the GPU), each plus one micro-batch's activations."""
    from ...core.distributed import zero_bytes_per_gpu

    e = est.estimate_memory(cfg, precision=precision)
    plain = zero_bytes_per_gpu(e["parameters"], 0, 1, False, True)["total"] + e["activations_bytes"]
    offload = zero_bytes_per_gpu(e["parameters"], 2, 1, True, True)["total"] + e["activations_bytes"]
    return {"memory_saving": 1 - offload / plain, "plain_bytes": plain, "zero2_offload_bytes": offload}


def zero2_offload_unavailable() -> str | None:
    """Why C7 cannot be measured here (DeepSpeed on a CUDA GPU is needed), or None when it can."""
    import importlib.util

    from ...core import device as dev

    missing = [p for p in ("deepspeed", "accelerate") if importlib.util.find_spec(p) is None]
    if not dev.cuda_available():
        return "it needs DeepSpeed on a CUDA GPU, and this machine has no CUDA GPU"
    if missing:
        return (f"it needs DeepSpeed on a CUDA GPU, and {' and '.join(missing)} is not installed "
                "(pip install -e '.[deepspeed]', which needs a CUDA toolkit)")
    return None


def measure_zero2_offload(config: str, overrides: list[str], workdir, *, timeout: int = 1800) -> dict:
    """The same config and batch trained in subprocesses plainly and under DeepSpeed ZeRO-2 with the optimizer on the
    CPU (:data:`ZERO2_OFFLOAD_ACCELERATE`): {"plain": run record, "zero2_offload": run record} or {"error": why}."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    launchers = {"plain": [sys.executable, "-m", "labutils"],
                 "zero2_offload": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                   ZERO2_OFFLOAD_ACCELERATE, "--num_processes", "1", "-m", "labutils"]}
    out = {}
    for name, launcher in launchers.items():
        path = Path(workdir) / f"c7-{name}.json"
        path.unlink(missing_ok=True)
        cmd = [*launcher, "run", config, "--quiet", "--json", str(path)] + (["--set", *overrides] if overrides else [])
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the {name} run took longer than {timeout} s"}
        if r.returncode != 0 or not path.is_file():
            tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
            return {"error": f"the {name} run failed (exit {r.returncode}): {tail[:200]}"}
        out[name] = json.loads(path.read_text(encoding="utf-8"))
    return out


def c7_claim(config_path: str, tech_cfg, info: dict, workdir) -> dict:
    """C7 at micro-batch 1 in fp16: measured (:func:`measure_zero2_offload`, writing to ``workdir``) where it can
    run here, else not measured with the estimator's prediction for the full-size config."""
    cond = cl.conditions(model=tech_cfg.model.name, batch="1 x 1", sequence=tech_cfg.data.seq_length,
                         precision="fp16, ZeRO-2 + CPU offload vs plain", hardware=cl.hardware(info), mode=info["mode"])
    full = load_config(config_path, mode="full").override({"train.micro_batch_size": 1, "train.accumulation_steps": 1})
    prediction = {"memory_saving": zero2_offload_prediction(full)["memory_saving"]}
    # not measured: the row shows the prediction, so its conditions are the prediction's, not this run's
    why_not = dict(prediction=prediction,
                   prediction_for=f"{full.model.name}, 1 x {full.data.seq_length}, fp16, one CUDA GPU")
    pred_cond = dict(cond, model=full.model.name, sequence=full.data.seq_length, hardware="one CUDA GPU (predicted)")
    missing = zero2_offload_unavailable()
    if missing:
        return cl.not_measured("C7", missing, pred_cond, **why_not)
    c7 = measure_zero2_offload(config_path, ["train.precision=fp16", "train.micro_batch_size=1",
                                             "train.accumulation_steps=1"], workdir)
    if "error" in c7:
        return cl.not_measured("C7", c7["error"], pred_cond, **why_not)
    p_peak, z_peak = c7["plain"]["peak_memory_bytes"], c7["zero2_offload"]["peak_memory_bytes"]
    return cl.claim_entry("C7", {"memory_saving": 1 - z_peak / p_peak}, cond,
                          reason=f"GPU peak {fmt_bytes(p_peak)} plain vs {fmt_bytes(z_peak)} with the AdamW state "
                                 f"on the CPU")
