"""How long the instructors' full run takes on a card: predicted before it starts (``regenerate --plan``).

A lab's cost is its training runs (:data:`LAB_RUNS`: the configs and overrides its cells train with ``lu.run`` /
``lu.train``, in full mode) plus a fresh kernel's fixed cost. One run costs ``steps x max(compute, host)``:

* compute: the step's executed FLOPs (:func:`labutils.flops.flops_per_token`, checkpointing's recompute and the
  fused attention's included) over the card's dense peak in that precision (:mod:`labutils.peaks`) times
  :data:`ACHIEVED`, the share of the peak such a step reaches;
* host: eager PyTorch's Python and kernel-launch time, which sets the pace of a model this small on a fast card:
  :data:`HOST_BLOCK_S` per transformer block and micro-batch (forward + backward), more under autocast (casts) and
  with checkpointing (the recompute launches again), plus :data:`HOST_STEP_S` per optimizer step.

The constants are assumptions from the one full GPU run so far (an H200, torch 2.11, 2026-11-26, GPT-2 small at
8 x 256 tokens: its step times are quoted beside them). Every full ``regenerate`` prints the prediction first and
each part's real time beside it at the end (and in run.json): that is how they are checked, and corrected.
"""
from __future__ import annotations

from .config import load_config
from .flops import flops_per_token
from .models import PRESETS, padded_vocab_size, vocab_size
from .peaks import peak_tflops
from .precisions import NAMES, PRECISIONS, choose, get

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
    """FLOPs and predicted seconds of ``lu.run(cfg)`` on ``gpu_name`` (``device="cpu"``: the FLOPs a CPU run counts,
    no fused attention, for checking against a smoke run's own counts; its seconds mean nothing). ``loads``: the run
    builds its model (``lu.run``); False for a run on a model already loaded (lab 03's scans, sweeps). ``card_bytes``:
    the memory cap the run is under; one the estimator says does not fit stops in its first step (an "oom" row)."""
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
    host = (t.accumulation_steps * PRESETS[m.name][0] * HOST_BLOCK_S
            * (AUTOCAST_HOST if precision.amp else 1)
            * (CHECKPOINT_HOST if t.gradient_checkpointing else 1) + HOST_STEP_S)
    step = max(compute or 0.0, host)
    steps = t.steps
    if card_bytes is not None:
        from .estimate import estimate_memory, fits
        steps = t.steps if fits(estimate_memory(cfg), card_bytes) else 1
    return {"steps": steps, "flops": step_flops * steps, "compute_s": compute, "host_s": host,
            "bound": "host" if host >= (compute or 0.0) else "compute", "seconds": steps * step + LOAD_S * loads}


# ------------------------------------------------------------------------------------- what each lab trains
def _native(device: str, gpu_name: str | None):
    """``native(precision) -> (bool, why)`` where the plan runs: this CPU (labutils.device_facts, as the labs ask
    it), or a card by name (a format it has a peak for in labutils.peaks: a T4 has no BF16)."""
    if device == "cuda":
        return lambda p: (peak_tflops(gpu_name, p) is not None, f"{gpu_name}'s datasheet (labutils.peaks)")
    return lambda p: get(p).native(device)


def lab_precision(device: str, gpu_name: str | None = None, emulated_ok: bool = True) -> str:
    """The mixed precision a lab's cells choose where the plan runs: ``lu.amp_precision(device, emulated_ok)``'s
    rule (labutils.precisions.choose) with that device's answers."""
    return choose(_native(device, gpu_name), device == "cuda", emulated_ok)[0]


LAB01_ALWAYS = ("fp32", "fp16")  # lab 01 runs these even where emulated: the baseline, the GradScaler's format


def _lab01(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 01: the two-step check of amp_step against lu.train, the precisions (the others where native), the
    batch sweep's points other than the config's own micro-batch, and fp16 again with the injected overflow."""
    cfgs = {p: load_config(f"configs/{p}_config.yaml", mode=mode) for p in ("fp32", "fp16", "bf16")}
    if mode == "smoke":
        cfgs = {p: c.override({"train.steps": 24, "train.timing_warmup_steps": 4}) for p, c in cfgs.items()}
    amp, native_here = lab_precision(device, gpu_name), _native(device, gpu_name)  # lab 01's AMP and NATIVE
    cfgs.update({p: cfgs["fp32"].override({"train.precision": p}) for p in NAMES if p not in cfgs})
    runs = [("amp_step check", cfgs["fp16"].override({"train.steps": min(2, cfgs["fp16"].train.steps)}))]
    runs += [(p, cfgs[p]) for p in NAMES if p in LAB01_ALWAYS or native_here(p)[0]]
    b = load_config("configs/fp32_config.yaml", mode="full").train.micro_batch_size
    runs += [(f"{p} x {m}", cfgs[p].override({"train.micro_batch_size": m, "train.steps": 12,
                                              "train.timing_warmup_steps": min(cfgs[p].train.timing_warmup_steps, 11)}))
             for p in ("fp32", amp) for m in (1, b, 2 * b) if m != cfgs[p].train.micro_batch_size]
    return runs + [("fp16 + injected overflow", cfgs["fp16"])]


def _largest_split(target: int = 32) -> int:
    """Lab 02's largest micro-batch of the B = 32 split (BF16) that fits an 8 GB card (the estimator's answer;
    smoke's budget is a scale model of that card, so it finds the same one)."""
    from .cards import card_total_bytes
    from .estimate import estimate_memory, fits

    full_cfg, card = load_config("configs/lab02_accumulation.yaml", mode="full"), card_total_bytes(8)[0]
    return max(m for m in (2, 4, 8, 16, 32) if m == 2 or fits(estimate_memory(full_cfg.override(
        {"train.micro_batch_size": m, "train.accumulation_steps": target // m, "train.precision": "bf16"})), card))


def _lab02(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 02: the two train_step checks, the micro-batch 2 sweep, the split of B = 32, the learning-rate runs."""
    cfg = load_config("configs/lab02_accumulation.yaml", mode=mode)
    amp = lab_precision(device, gpu_name, emulated_ok=False)  # a CPU without BF16 trains in fp32 (emulation is slow)
    cfg = cfg.override({"train.precision": amp})
    check = {"train.micro_batch_size": 2, "train.accumulation_steps": 4, "model.dropout": 0.0,
             "train.steps": min(cfg.train.steps, 2)}
    runs = [(f"train_step check {p}", cfg.override({**check, "train.precision": p}))
            for p in dict.fromkeys([amp, "fp16"])]
    runs += [(f"2 x {k}", cfg.override({"train.micro_batch_size": 2, "train.accumulation_steps": k}))
             for k in (1, 4, 8, 16)]
    runs += [(f"{m} x {32 // m}", cfg.override({"train.micro_batch_size": m, "train.accumulation_steps": 32 // m}))
             for m in (4, 8, 16, 32)]
    ratio, w0, s0 = 4, cfg.train.warmup_steps, cfg.train.steps
    w1 = max(2, round(w0 / ratio))
    s1 = max(w1, s0 // ratio)
    m_big = _largest_split()
    def lr(B, steps, warmup):
        m = min(m_big, B)
        return cfg.override({"train.micro_batch_size": m, "train.accumulation_steps": B // m, "train.steps": steps,
                             "train.warmup_steps": warmup})
    runs += [("lr baseline", lr(8, s1 * ratio, w1 * ratio))] + [(f"lr B=32 #{i}", lr(32, s1, w1 if i < 3 else 0))
                                                               for i in range(4)]
    return runs


def _lab03(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 03: the on/off pairs, the scale model's rows, the largest-batch scans (as far as the estimator says they
    go on an 8 GB card), every k, the variants beyond, the combinations."""
    from .cards import card_total_bytes
    from .estimate import largest_batch

    cfg = load_config("configs/lab03_checkpointing.yaml", mode=mode)
    B, L = cfg.train.micro_batch_size, PRESETS[cfg.model.name][0]
    pair_steps = max(cfg.train.steps, cfg.train.timing_warmup_steps + 10) if device == "cuda" else cfg.train.steps
    ck = {"train.gradient_checkpointing": True}
    runs = [(f"pair {b} {on}", cfg.override({"train.micro_batch_size": b, "train.steps": pair_steps,
                                              **(ck if on else {})}))
            for b in sorted({1, B}) for on in (False, True)]
    runs += [(f"scale model {i}", cfg.override(o)) for i, o in enumerate(
        [{"train.micro_batch_size": 1}, {"train.micro_batch_size": B}, {"train.micro_batch_size": B, **ck}])]
    card = card_total_bytes(8)[0]
    probe = cfg.override({"train.steps": 2, "train.timing_warmup_steps": min(cfg.train.timing_warmup_steps, 1)})
    for on in (False, True):
        last = min(4 * B, largest_batch(load_config("configs/lab03_checkpointing.yaml", mode="full"), card,
                                        checkpointing=on) + 1)
        runs += [(f"largest {on} {b}", probe.override({"train.micro_batch_size": b, **(ck if on else {})}), b == 1)
                 for b in range(1, last + 1)]  # one model per scan
    ks = [k for k in range(2, L + 1) if L % k == 0]
    runs += [(f"every/segments {k}", cfg.override(ck), i == 0) for i, k in enumerate(ks + ks)]  # one model (cm.measure)
    runs += [(f"beyond {i}", cfg.override(ck), i == 0) for i in range(3)]
    half = max(1, B // 2)
    mixed = lab_precision(device, gpu_name)  # lab 03's MIXED
    runs += [(name, cfg.override(o)) for name, o in (
        ("mixed", {"train.precision": mixed}), ("mixed + ckpt", {"train.precision": mixed, **ck}),
        ("accumulation", {"train.micro_batch_size": 1, "train.accumulation_steps": B}),
        ("all", {"train.precision": mixed, **ck, "train.micro_batch_size": half,
                 "train.accumulation_steps": B // half}))]
    return runs


def _lab04(mode: str, device: str, gpu_name: str | None = None) -> list:
    """Lab 04: the batch sweep, the techniques of section 8, the full and chunked loss, one_loop against lu.train."""
    cfg = load_config("configs/lab04_profile.yaml", mode=mode)
    tech = load_config("configs/lab04_techniques.yaml", mode=mode)
    amp = lab_precision(device, gpu_name)  # lab 04's AMP
    mp, ck = {"train.precision": amp}, {"train.gradient_checkpointing": True}
    acc = {"train.micro_batch_size": tech.train.micro_batch_size // 2, "train.accumulation_steps": 2}
    sweep = {"train.steps": 2, "train.timing_warmup_steps": 1}
    runs = [(f"sweep {b}", cfg.override({"train.micro_batch_size": b, **sweep}))
            for b in (1, 2, 4, 8, 16)]
    runs += [(name, tech.override(o)) for name, o in (("baseline", {}), ("mp", mp), ("ckpt", ck), ("acc", acc),
                                                      ("mp+ckpt", {**mp, **ck}), ("all", {**mp, **ck, **acc}))]
    runs += [(f"loss {loss}", tech.override({**mp, **ck, "model.loss": loss})) for loss in ("full", "chunked")]
    return runs + [("lu.train vs one_loop", tech.override({**mp, **ck, **acc, "train.steps": 3}))]


LAB_RUNS = {"01": _lab01, "02": _lab02, "03": _lab03, "04": _lab04}


def lab_plan(lab: str, gpu_name: str | None, mode: str = "full", device: str = "cuda",
             card_bytes: int | None = None) -> dict:
    """A lab's predicted cost: its runs (:data:`LAB_RUNS`: ``(label, config[, loads a model])``), each
    :func:`run_cost`, and the fresh kernel's fixed cost."""
    runs = [{"run": r[0], **run_cost(r[1], gpu_name, device, *r[2:], card_bytes=card_bytes)}
            for r in LAB_RUNS[lab](mode, device, gpu_name)]
    return {"lab": lab, "runs": runs, "steps": sum(r["steps"] for r in runs), "flops": sum(r["flops"] for r in runs),
            "seconds": KERNEL_S + sum(r["seconds"] for r in runs)}


def bench_plan(gpu_name: str, repeats: int) -> dict:
    """``bench configs/fast_config.yaml --repeats N`` on the whole card: each section (the config's own; the other
    loss; eager when the config compiles) runs each side ``repeats`` times, each run loading its model and, when
    compiled, compiling it again (:data:`RECOMPILE_S`)."""
    cfg = load_config("configs/fast_config.yaml", mode="full")
    other = "full" if cfg.model.loss == "chunked" else "chunked"
    sections = [cfg, cfg.override({"model.loss": other})] + ([cfg.override({"train.compile": False})]
                                                              if cfg.train.compile else [])
    seconds = sum(2 * repeats * (run_cost(c, gpu_name)["seconds"] + RECOMPILE_S * c.train.compile) for c in sections)
    return {"repeats": repeats, "runs": 2 * repeats * len(sections), "seconds": seconds}


def course_plan(gpu_name: str, labs=("01", "02", "03", "04"), doctor: bool = True, card_gb: float | None = 8,
                bench_repeats: int | None = None) -> dict:
    """The whole regeneration on ``gpu_name``: the doctor (checks, then compiling the fast path) and each lab, under
    regenerate's memory cap (``card_gb``: a card of that size, as ``--gpu-memory-gb``; None: no cap); with
    ``bench_repeats``, the bench that follows them (``--bench N``)."""
    from .cards import card_total_bytes

    card = card_total_bytes(card_gb)[0] if card_gb else None
    plans = [lab_plan(lab, gpu_name, card_bytes=card) for lab in labs]
    doc = DOCTOR_S + COMPILE_S if doctor else 0.0
    return {"gpu": gpu_name, "doctor_seconds": doc, "labs": plans,
            "seconds": doc + sum(p["seconds"] for p in plans), "goal_seconds": GOAL_S,
            "bench": bench_plan(gpu_name, bench_repeats) if bench_repeats else None}


def plan_lines(plan: dict) -> list[str]:
    """The plan as a few printed lines: one per lab, the total against the goal."""
    head = f"time plan for {plan['gpu']} (labutils.timeplan: executed FLOPs / the card's peak, or the host's pace)"
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
    lines = ["time: predicted -> actual (labutils.timeplan)"]
    for name, key, predicted in rows:
        got = actual.get(key)
        lines.append(f"  {name:<8} {predicted:6.0f} s -> " + (f"{got:6.0f} s ({got / predicted:.2f}x)" if got else
                                                             "  not run"))
    done = sum(v for k, v in actual.items() if v and k != "bench")
    lines.append(f"  total    {plan['seconds']:6.0f} s -> {done:6.0f} s = {done / 60:.1f} min "
                 f"({'within' if done <= GOAL_S else 'OVER'} the {GOAL_S / 60:.0f}-minute goal; bench apart)")
    return lines
