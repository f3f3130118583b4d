"""How long the instructors' full run takes on a card: predicted before it starts (``regenerate --plan``).

A lab's cost is its training runs (its entry in :mod:`labutils.labs.registry`, full mode) plus a fresh kernel's fixed
cost. One run costs ``steps x max(compute, host)``: compute is the step's executed FLOPs over the card's dense peak
(:mod:`labutils.core.peaks`) times :data:`ACHIEVED`; host is eager PyTorch's launch time, :data:`HOST_BLOCK_S` per
block and micro-batch (more under autocast and checkpointing) plus :data:`HOST_STEP_S` per optimizer step.
The constants are assumptions from one full GPU run (H200, torch 2.11, GPT-2 small at 8 x 256); every full
``regenerate`` prints the prediction and each part's real time, which is how they are checked.
"""
from __future__ import annotations

from ..core.config import load_config
from ..core.flops import flops_per_token
from ..labs.registry import IDS, lab as registry_lab
from ..models.gpt2 import PRESETS, padded_vocab_size, vocab_size
from ..core.peaks import peak_tflops
from ..core.precisions import PRECISIONS, get

ACHIEVED = {p.name: 0.25 if p.amp else 0.3 if p.tf32 else 0.5 for p in PRECISIONS.values()}  # of the dense peak
HOST_BLOCK_S = 1.6e-3      # host s per block and micro-batch, fwd + bwd (FP32 step 48.0 ms, TF32 27.2 ms)
AUTOCAST_HOST = 1.5        # autocast's casts: more launches per block (BF16 run: 38.1 ms, host-bound)
CHECKPOINT_HOST = 1.4      # a checkpointed block launches its forward twice
HOST_STEP_S = 8e-3         # clipping + AdamW + zero_grad per optimizer step
LOAD_S = 2.0               # building the model on the GPU, the dataset there, the first step's kernel choices
KERNEL_S = 20.0            # a fresh kernel: imports, setup, the lab's figures and tables, record_results
DOCTOR_S = 64.0            # doctor's checks (H200 run)
COMPILE_S = 64.0           # doctor compiling the fast path (H200 run)
RECOMPILE_S = 10.0         # bench: each compiled run compiles again from inductor's warm cache (dynamo traces anew)
GOAL_S = 8 * 60            # the whole course (doctor + four labs) within one device command (issue 39)
COMMAND_S = 10 * 60        # one command on a lent GPU (regenerate, then bench) stops here


def run_cost(cfg, gpu_name: str | None, device: str = "cuda", loads: bool = True, card_bytes: int | None = None):
    """FLOPs and predicted seconds of ``lu.run(cfg)`` on ``gpu_name`` (``device="cpu"``: a CPU run's FLOPs). ``loads``:
    False on a model already loaded; ``card_bytes``: the cap (a run that does not fit stops in its first step)."""
    t, m, d = cfg.train, cfg.model, cfg.data
    fused = device == "cuda" and m.attn_implementation in ("sdpa", "sdpa_causal")
    per_token = flops_per_token(m.name, d.seq_length, recompute=t.gradient_checkpointing,
                                every_n_layers=t.checkpoint_every_n_layers, dropout=m.dropout is None or m.dropout > 0,
                                fused_attention=fused,
                                causal_skip=fused and (d.pack or m.attn_implementation == "sdpa_causal"),
                                vocab=padded_vocab_size(vocab_size(m.name), m.pad_vocab_to))
    step_flops = per_token * t.micro_batch_size * t.accumulation_steps * d.seq_length
    precision = get(t.precision)
    peak = peak_tflops(gpu_name, precision.name) or peak_tflops(gpu_name, "fp32")
    compute = step_flops / (peak * 1e12 * ACHIEVED[precision.name]) if peak else None
    host = (t.accumulation_steps * PRESETS[m.name].n_layer * HOST_BLOCK_S
            * (AUTOCAST_HOST if precision.amp else 1)
            * (CHECKPOINT_HOST if t.gradient_checkpointing else 1) + HOST_STEP_S)
    step = max(compute or 0.0, host)
    steps = t.steps
    if card_bytes is not None:
        from ..estimator.estimate import estimate_memory, fits
        steps = t.steps if fits(estimate_memory(cfg), card_bytes) else 1
    return {"steps": steps, "flops": step_flops * steps, "compute_s": compute, "host_s": host,
            "bound": "host" if host >= (compute or 0.0) else "compute", "seconds": steps * step + LOAD_S * loads}


def bench_plan(gpu_name: str, repeats: int, card_bytes: int | None = None) -> dict:
    """``bench configs/fast_config.yaml --repeats N``, fitted to the doctor's cap (``card_bytes``) as bench fits it:
    each section (the config's own; the other loss; eager when the config compiles) runs each side ``repeats`` times,
    each run loading its model and, when compiled, compiling it again (:data:`RECOMPILE_S`)."""
    from ..estimator.advise import fit_micro_batch

    cfg = load_config("configs/fast_config.yaml", mode="full")
    cfg = fit_micro_batch(cfg, card_bytes)[0] if card_bytes else cfg
    other = "full" if cfg.model.loss == "chunked" else "chunked"
    sections = [cfg, cfg.override({"model.loss": other})] + ([cfg.override({"train.compile": False})]
                                                              if cfg.train.compile else [])
    seconds = sum(2 * repeats * (run_cost(c, gpu_name)["seconds"] + RECOMPILE_S * c.train.compile) for c in sections)
    return {"repeats": repeats, "runs": 2 * repeats * len(sections), "seconds": seconds}


def course_plan(gpu_name: str, labs=IDS, doctor: bool = True, card_gb: float | None = 8,
                bench_repeats: int | None = None) -> dict:
    """The whole regeneration on ``gpu_name``: the doctor and each lab under regenerate's memory cap (``card_gb``, as
    ``--gpu-memory-gb``; None: no cap); with ``bench_repeats``, the bench that follows them (``--bench N``)."""
    from ..core.cards import card_total_bytes

    card = card_total_bytes(card_gb)[0] if card_gb else None
    plans = []
    for lab in labs:  # its runs (its entry in labutils.labs.registry), each priced, and a fresh kernel's fixed cost
        runs = [{"run": r[0], **run_cost(r[1], gpu_name, "cuda", *r[2:], card_bytes=card)}
                for r in registry_lab(lab).runs("full", "cuda", gpu_name)]
        plans.append({"lab": lab, "runs": runs, "steps": sum(r["steps"] for r in runs),
                      "flops": sum(r["flops"] for r in runs), "seconds": KERNEL_S + sum(r["seconds"] for r in runs)})
    doc = DOCTOR_S + COMPILE_S if doctor else 0.0
    return {"gpu": gpu_name, "doctor_seconds": doc, "labs": plans,
            "seconds": doc + sum(p["seconds"] for p in plans), "goal_seconds": GOAL_S,
            "bench": bench_plan(gpu_name, bench_repeats, card) if bench_repeats else None}


def plan_lines(plan: dict) -> list[str]:
    """The plan as a few printed lines: one per lab, the total against the goal."""
    head = f"time plan for {plan['gpu']} (labutils.tools.timeplan: executed FLOPs / the card's peak, or the host's pace)"
    lines = [head] + ([f"  doctor              {plan['doctor_seconds']:6.0f} s  (checks + compiling the fast path: the "
                       f"H200 run's times, assumed)"]
                      if plan["doctor_seconds"] else [])
    for p in plan["labs"]:
        host = sum(1 for r in p["runs"] if r["bound"] == "host")
        lines.append(f"  lab {p['lab']}              {p['seconds']:6.0f} s  ({len(p['runs'])} training runs, "
                     f"{p['steps']} steps, {p['flops'] / 1e15:.2f} PFLOP; {host} of the runs host-bound)")
    total, goal = plan["seconds"], plan["goal_seconds"]
    lines.append(f"  total               {total:6.0f} s = {total / 60:.1f} min "
                 f"({'within' if total <= goal else 'OVER'} the {goal / 60:.0f}-minute goal)")
    if plan.get("bench"):
        b = plan["bench"]
        both = total + b["seconds"]
        lines.append(f"  then bench          {b['seconds']:6.0f} s  ({b['runs']} runs, a compiled one "
                     f"{RECOMPILE_S:.0f} s more): "
                     f"{both / 60:.1f} min in all, {'within' if both <= COMMAND_S else 'OVER'} one "
                     f"{COMMAND_S / 60:.0f}-minute command")
    return lines


def against_actual(plan: dict, actual: dict) -> list[str]:
    """Predicted against actual seconds (``actual``: {"doctor" or a lab: seconds}), one line each, and the total."""
    rows = ([("doctor", "doctor", plan["doctor_seconds"])] if plan["doctor_seconds"] else []) + \
        [(f"lab {p['lab']}", p["lab"], p["seconds"]) for p in plan["labs"]] + \
        ([("bench", "bench", plan["bench"]["seconds"])] if plan.get("bench") else [])
    lines = ["time: predicted -> actual (labutils.tools.timeplan)"]
    for name, key, predicted in rows:
        got = actual.get(key)
        lines.append(f"  {name:<8} {predicted:6.0f} s -> " + (f"{got:6.0f} s ({got / predicted:.2f}x)" if got else
                                                             "  not run"))
    done = sum(v for k, v in actual.items() if v and k != "bench")
    lines.append(f"  total    {plan['seconds']:6.0f} s -> {done:6.0f} s = {done / 60:.1f} min "
                 f"({'within' if done <= GOAL_S else 'OVER'} the {GOAL_S / 60:.0f}-minute goal; bench apart)")
    return lines
