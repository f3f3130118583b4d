"""How long the instructors' full run takes on a card: predicted before it starts (``regenerate --plan``).

A lab's cost is its training runs (its :mod:`labutils.labs.registry` entry, full mode), each ``steps x max(compute,
host)`` (executed FLOPs over the card's dense peak times :data:`ACHIEVED`; eager PyTorch's launch time), plus a fresh
kernel and its :data:`EXTRA_S`. The constants are assumptions from one full GPU run (H200, torch 2.11) and issue 45's
count of what else runs; every full ``regenerate`` prints each part's prediction and real time, which checks them. The
parts are packed into commands of at most :data:`LIMIT_S` each (``make gpu-results PART=K``, :func:`commands`).
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
EXTRA_S = {"models": LOAD_S, "profiles": 6.0, "processes": 10.0}  # a lab's other work (its registry entry's extras):
#                            a model built, a profiler run (start, trace written), a child process importing torch
DOCTOR_S = 94.0            # doctor's checks: the H200 run's 64 s, +30 s for the two ABBA pairs it times since
COMPILE_S = 64.0           # one cold compile of the fast path (doctor, H200 run); the bench's compiled sections too
RECOMPILE_S = 10.0         # bench: each compiled run compiles again from inductor's warm cache (dynamo traces anew)
START_S = 25.0             # a command's start: .whl/ installed, interpreter, torch + transformers imported, CUDA up
COMMAND_S = 10 * 60        # one command on a lent GPU stops here
LIMIT_S = 0.75 * COMMAND_S  # ... so a command is planned at 7.5 min at most: a quarter to spare (issue 45 §3)


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
    each run loading its model and, when compiled, compiling it again (:data:`RECOMPILE_S`) after a cold compile of
    each compiled section (:data:`COMPILE_S`: another command may run on a fresh machine, its caches empty)."""
    from ..estimator.advise import fit_micro_batch

    cfg = load_config("configs/fast_config.yaml", mode="full")
    cfg = fit_micro_batch(cfg, card_bytes)[0] if card_bytes else cfg
    other = "full" if cfg.model.loss == "chunked" else "chunked"
    sections = [cfg, cfg.override({"model.loss": other})] + ([cfg.override({"train.compile": False})]
                                                              if cfg.train.compile else [])
    seconds = sum(2 * repeats * (run_cost(c, gpu_name)["seconds"] + RECOMPILE_S * c.train.compile) + COMPILE_S *
                  c.train.compile for c in sections)
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
        extras = dict(registry_lab(lab).extras)
        seconds = KERNEL_S + sum(n * EXTRA_S[kind] for kind, n in extras.items()) + sum(r["seconds"] for r in runs)
        plans.append({"lab": lab, "runs": runs, "steps": sum(r["steps"] for r in runs), "extras": extras,
                      "flops": sum(r["flops"] for r in runs), "seconds": seconds})
    doc = DOCTOR_S + COMPILE_S if doctor else 0.0
    return {"gpu": gpu_name, "doctor_seconds": doc, "labs": plans, "seconds": doc + sum(p["seconds"] for p in plans),
            "bench": bench_plan(gpu_name, bench_repeats, card) if bench_repeats else None}


def commands(plan: dict) -> list[dict]:
    """The plan's parts (doctor, each lab, bench), in order, in commands of at most :data:`LIMIT_S` each, start-up
    included: [{"parts": {name: seconds}, "seconds": total}]; ``make gpu-results PART=K`` runs the K-th."""
    parts = {"doctor": plan["doctor_seconds"]} if plan["doctor_seconds"] else {}
    parts.update({p["lab"]: p["seconds"] for p in plan["labs"]})
    parts.update({"bench": plan["bench"]["seconds"]} if plan["bench"] else {})
    out: list[dict] = []
    for name, seconds in parts.items():
        if not out or out[-1]["seconds"] + seconds > LIMIT_S:
            out.append({"parts": {}, "seconds": START_S})
        out[-1]["parts"][name] = seconds
        out[-1]["seconds"] += seconds
    return out


def plan_lines(plan: dict) -> list[str]:
    """The plan as a few printed lines: one per part, then the commands that run them."""
    head = f"time plan for {plan['gpu']} (labutils.tools.timeplan: executed FLOPs / the card's peak, or the host's pace)"
    lines = [head] + ([f"  doctor              {plan['doctor_seconds']:6.0f} s  (checks + compiling the fast path: the "
                       f"H200 run's times, assumed)"]
                      if plan["doctor_seconds"] else [])
    for p in plan["labs"]:
        host = sum(1 for r in p["runs"] if r["bound"] == "host")
        extra = ", ".join(f"{n} {kind}" for kind, n in p["extras"].items() if n)
        lines.append(f"  lab {p['lab']}              {p['seconds']:6.0f} s  ({len(p['runs'])} training runs, "
                     f"{p['steps']} steps, {p['flops'] / 1e15:.2f} PFLOP; {host} of the runs host-bound"
                     + (f"; + {extra})" if extra else ")"))
    if plan.get("bench"):
        b = plan["bench"]
        lines.append(f"  bench               {b['seconds']:6.0f} s  ({b['runs']} runs; each compiled section once "
                     f"cold, {COMPILE_S:.0f} s, then {RECOMPILE_S:.0f} s a compiled run)")
    cmds = commands(plan)
    lines.append(f"  in {len(cmds)} command(s) of at most {LIMIT_S / 60:.1f} min each (a lent GPU's command stops at "
                 f"{COMMAND_S / 60:.0f}; each starts in {START_S:.0f} s), one after the other:")
    lines += [f"    make gpu-results PART={k}   {c['seconds']:5.0f} s = {c['seconds'] / 60:.1f} min  "
              f"{', '.join(n if n in ('doctor', 'bench') else f'lab {n}' for n in c['parts'])}"
              + ("" if c["seconds"] <= LIMIT_S else "  OVER: a part longer than one command")
              for k, c in enumerate(cmds, 1)]
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
    done = sum(v for v in actual.values() if v)
    planned = sum(p for name, key, p in rows if actual.get(key))
    lines.append(f"  this command's parts {planned:6.0f} s -> {done:6.0f} s = {done / 60:.1f} min "
                 f"(planned at most {LIMIT_S / 60:.1f} min a command)")
    return lines
