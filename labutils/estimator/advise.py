"""What to run when a config does not fit, or could run faster: the advisor over the estimator (lab 04).

:func:`recommend` tries every precision, checkpointing and micro-batch x accumulation with the config's effective
batch, keeps what :func:`labutils.estimator.estimate.fits` and ranks it by :func:`relative_step_time` (precisions by
lab 01's measurements on this GPU, else the card's peak table, else equal); :func:`cli_estimate`: ``labutils estimate``.
"""
from __future__ import annotations

import time
from dataclasses import replace

from ..core import cards
from ..core import device as dev
from ..core.config import MAX_COMPILED_CHUNKS, ConfigError
from ..core.distributed import zero_table
from .estimate import CUDA_CONTEXT_BYTES, HEADROOM, GiB, Plan, estimate_memory, estimate_plan, fits, plan_from_config
from ..core.flops import flops_per_token
from ..core.peaks import peak_tflops
from ..core.precisions import NAMES, amp_precision, get
from ..core.results import read_results, write_json

UNKNOWN_SPEEDS = ("unknown: no measured or peak speeds for this GPU; precisions counted equal (ranked by memory, "
                  "recompute and micro-batch size only)")
SATURATION_TOKENS = 1024              # micro-batch tokens at which a GPU reaches half of its throughput (assumed)


def measured_speeds(gpu_name: str | None, mode: str = "full") -> tuple[dict, str] | None:
    """Lab 01's measured speed-ups vs fp32 (its precision_comparison table) when its results were recorded on
    ``gpu_name``; None otherwise. For :func:`recommend`'s ``speeds``."""
    data = read_results("01-Mixed_Precision", mode) if gpu_name else None
    if not data or (data.get("env") or {}).get("gpu_name") != gpu_name:
        return None
    rows = (data.get("tables") or {}).get("precision_comparison") or []
    speeds = {r.get("run"): r.get("speedup_vs_fp32") for r in rows if r.get("status") == "ok"
              and isinstance(r.get("speedup_vs_fp32"), (int, float))}
    speeds.setdefault("fp32", 1.0)
    return speeds, f"measured by lab 01 on {gpu_name} ({data.get('env', {}).get('date') or 'date not recorded'})"


def peak_speeds(gpu_name: str | None) -> tuple[dict, str] | None:
    """Each precision's dense peak relative to fp32 on ``gpu_name`` (labutils.core.peaks): what the advisor ranks by
    when lab 01 has not measured this GPU. None when the card or its fp32 peak is unknown."""
    base = peak_tflops(gpu_name, "fp32") if gpu_name else None
    if not base:
        return None
    peaks = {p: peak_tflops(gpu_name, p) for p in NAMES}
    return ({p: v / base for p, v in peaks.items() if v}, f"the dense peak TFLOP/s of {gpu_name} (labutils' peak "
            f"table, not a measurement: real speed-ups are smaller)")


def speed_source(gpu_name: str | None, mode: str = "full") -> tuple[dict, str] | None:
    """What the advisor ranks precisions by: lab 01's measurements on this GPU, else the card's peak table,
    else None (precisions counted equal)."""
    return measured_speeds(gpu_name, mode) or peak_speeds(gpu_name)


def relative_step_time(plan: Plan, speeds: dict | None = None) -> float:
    """A rough model for ranking: FLOPs per optimizer step / (precision speed x utilisation of the micro-batch).
    ``speeds``: {precision: throughput relative to fp32}; a precision it does not list counts as 1.0."""
    tokens = plan.micro * plan.seq
    util = tokens / (tokens + SATURATION_TOKENS)
    flops = flops_per_token(plan.model, plan.seq, recompute=plan.checkpointing, every_n_layers=plan.every_n)
    return plan.effective_batch * plan.seq * flops / ((speeds or {}).get(plan.precision) or 1.0) / util / 1e12


def candidate_plans(base: Plan, amp_dtype: str | None = None) -> list[Plan]:
    """Every (precision, checkpointing, micro x accum) with the same effective batch as ``base``."""
    eff = base.effective_batch
    if amp_dtype is None:
        amp_dtype = base.precision if base.amp else "bf16"
    full = "fp32" if base.amp else base.precision  # fp32, or tf32 where the config has it
    micros = [m for m in range(eff, 0, -1) if eff % m == 0]
    return [replace(base, precision=precision, checkpointing=ckpt, every_n=1, micro=m, accum=eff // m)
            for precision in dict.fromkeys([full, amp_dtype]) for ckpt in (False, True) for m in micros]


def recommend(cfg, budget_bytes: int, *, device: str = "cuda", amp_dtype: str | None = None,
              speeds: tuple[dict, str] | None = None) -> dict:
    """The fastest configuration predicted to fit ``budget_bytes``, at the config's effective batch. Returns the chosen
    candidate and all candidates. ``speeds``: ({precision: speed relative to fp32}, source), e.g.
    :func:`measured_speeds`; without one precisions count equal and ``speed_source`` says so."""
    speed_map, speed_source = speeds if speeds else ({}, UNKNOWN_SPEEDS)
    base = plan_from_config(cfg, device=device)
    rows = []
    for plan in candidate_plans(base, amp_dtype):
        est = estimate_plan(plan)
        rows.append({"precision": plan.precision, "checkpointing": plan.checkpointing, "micro_batch": plan.micro,
                     "accum": plan.accum, "peak_bytes": est["peak_bytes"], "peak_phase": est["peak_phase"],
                     "fits": fits(est, budget_bytes), "relative_time": relative_step_time(plan, speed_map)})
    fastest = min((r for r in rows if r["fits"]), key=lambda r: r["relative_time"], default=None)
    own_time = relative_step_time(base, speed_map)
    for r in rows:
        r["speedup_vs_config"] = own_time / r["relative_time"]
    return {"budget_bytes": int(budget_bytes), "context_bytes": CUDA_CONTEXT_BYTES, "headroom": HEADROOM,
            "effective_batch": base.effective_batch, "recommendation": fastest, "candidates": rows,
            "speed_source": speed_source, "config_fits": fits(estimate_plan(base), budget_bytes)}


def _amp_dtype(cfg) -> tuple[str, str | None]:
    """The mixed-precision dtype to advise: the config's own, else this GPU's (labutils.core.precisions.amp_precision)."""
    if get(cfg.train.precision).amp:
        return cfg.train.precision, None
    if dev.cuda_available():
        return amp_precision()
    return "bf16", "no GPU here; use fp16 on GPUs before Ampere: same memory"


def default_budget_bytes(whole_card: bool = False) -> tuple[int, str]:
    """The card to fit on: this GPU's memory, or the card ``LAB_GPU_MEMORY_GB`` makes it behave like (not with
    ``whole_card``); an 8 GB card without a GPU. ``fits`` then leaves room for the CUDA context itself."""
    if dev.cuda_available():
        budget = None if whole_card else dev.current_budget() or dev.card_budget(dev.budget_from_env())
        if budget:
            return budget["card_total_bytes"], (f"this GPU ({dev.name()}) behaving like a {budget['card_gib']:g} GB "
                                                 "card")
        return dev.total_memory(), f"this GPU ({dev.name()})"
    total, rule = cards.card_total_bytes(8)
    return total, f"no GPU here: an 8 GB card ({rule})"


# ---- CLI: python -m labutils estimate CONFIG [--set ...] [--gpu-memory-gb G] [--json PATH] ---------------------------
def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def cli_estimate(cfg, args) -> int:
    """``python -m labutils estimate``: the estimate of ``cfg`` part by part, whether it fits the budget, the
    recommendation, and per GPU under data parallelism / ZeRO; ``args.json``: all of it as JSON too."""
    start = time.perf_counter()
    if args.gpu_memory_gb is not None:
        source = getattr(args, "gpu_memory_source", "--gpu-memory-gb ")
        try:
            budget, rule = cards.card_total_bytes(args.gpu_memory_gb)
        except ValueError as exc:  # a card too small for the CUDA context itself
            raise ConfigError(source.strip(" ="), None, args.gpu_memory_gb, str(exc)) from None
        where = f"{source}{args.gpu_memory_gb:g}: {rule}"
    else:
        budget, where = default_budget_bytes(getattr(args, "whole_card", False))
    cfg, chunk_line = fit_loss_chunk(cfg, budget, where)  # an unset loss chunk, sized for this budget as run sizes it
    est = estimate_memory(cfg)
    amp, amp_note = _amp_dtype(cfg)
    advice = recommend(cfg, budget, amp_dtype=amp, speeds=speed_source(dev.name() if dev.cuda_available() else None))
    t = cfg.train
    print(f"{cfg.model.name} ({est['parameters'] / 1e6:.1f}M parameters), {t.precision}, micro-batch "
          f"{t.micro_batch_size} x accumulation {t.accumulation_steps} x {cfg.data.seq_length} tokens, "
          f"checkpointing {'every ' + str(t.checkpoint_every_n_layers) if t.gradient_checkpointing else 'off'}, "
          f"{cfg.model.attn_implementation} attention, {cfg.model.activation}, vocabulary {est['vocab_rows']} rows "
          f"-- predicted for CUDA ({est['basis']})" + (f"\n{chunk_line}" if chunk_line else ""))
    rows = [("params (fp32 master weights)", est["params_bytes"]), ("grads (fp32)", est["grads_bytes"]),
            ("optimizer (AdamW exp_avg + exp_avg_sq)", est["optimizer_bytes"]),
            ("activations (saved by one micro-batch)", est["activations_bytes"]),
            ("  of which log_softmax(logits) fp32" if est.get("loss", "full") == "full" else
             "  of which logits (chunked loss: none)", est.get("saved_logits_bytes", est["logits_bytes"])),
            ("half weight copies (autocast, saved)", est["half_weights_bytes"]),
            ("peak (torch.cuda.max_memory_allocated)", est["peak_bytes"])]
    w = max(len(r[0]) for r in rows)
    for name, n in rows:
        print(f"  {name:<{w}}  {_gib(n):>10}")
    print(f"  peak happens during: {est['peak_phase']}; at the peak: " +
          ", ".join(f"{k} {_gib(v)}" for k, v in est["peak_breakdown"].items() if v > 0))
    usable = budget - CUDA_CONTEXT_BYTES
    print(f"budget: {_gib(budget)} ({where}); fits if peak x {1 + HEADROOM:.2f} <= {_gib(usable)} "
          f"(budget minus {_gib(CUDA_CONTEXT_BYTES)} CUDA context)")
    print(f"this config: {'fits' if advice['config_fits'] else 'does NOT fit'}")
    rec = advice["recommendation"]
    if rec:
        print(f"recommendation (fastest predicted to fit, effective batch {advice['effective_batch']}): "
              f"{rec['precision']}, checkpointing {'on' if rec['checkpointing'] else 'off'}, micro-batch "
              f"{rec['micro_batch']} x accumulation {rec['accum']}: peak {_gib(rec['peak_bytes'])}"
              + (f", ~{rec['speedup_vs_config']:.2f}x the config's speed (rough model)"
                 if rec.get("speedup_vs_config") else "")
              + f"; precision speeds: {advice['speed_source']}"
              + (f" [{amp_note}]" if amp_note and rec["precision"] == amp else ""))
    else:
        smallest = min(advice["candidates"], key=lambda r: r["peak_bytes"])
        print(f"recommendation: nothing fits with this effective batch; the smallest peak is "
              f"{_gib(smallest['peak_bytes'])} ({smallest['precision']}, checkpointing "
              f"{'on' if smallest['checkpointing'] else 'off'}, micro-batch {smallest['micro_batch']}). "
              f"Shorter sequences, a smaller model, LoRA, an 8-bit optimizer or ZeRO offload are the next steps.")
    # beyond one GPU: what ZeRO sharding leaves on each GPU
    mixed = get(t.precision).amp
    zero = zero_table(est["parameters"], est["activations_bytes"], getattr(args, "gpus", 8), mixed_precision=mixed)
    print(f"per GPU with data parallelism / ZeRO (model state {'2P+2P+12P' if mixed else '4P+4P+8P'} sharded + all "
          "of one micro-batch's activations: a sum, not the replayed peak):")
    cols = list(zero[0])
    w = 2 + max(len(str(x)) for x in cols[1:] + [_gib(r[c]) for r in zero for c in cols[1:]])  # a space between
    print("  " + f"{cols[0]:>22}" + "".join(f"{c:>{w}}" for c in cols[1:]))
    for r in zero:
        print("  " + f"{r[cols[0]]:>22}" + "".join(f"{_gib(r[c]):>{w}}" for c in cols[1:]))
    if args.json:
        out = {k: est[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes")}
        out["zero_per_gpu"] = zero
        out.update(estimate=est, recommendation=rec, budget_bytes=budget, config_fits=advice["config_fits"],
                   candidates=advice["candidates"], config=cfg.to_dict())
        write_json(args.json, out)
        print(f"wrote {args.json}")
    print(f"({time.perf_counter() - start:.2f} s)")
    return 0


def fit_micro_batch(cfg, budget_bytes: int, where: str = "the budget") -> tuple[object, str | None]:
    """The config with the largest micro-batch predicted to fit ``budget_bytes``, a divisor of the effective batch and
    at most the config's own. Returns (config, one line saying what changed), or (cfg, None) when it fits as it is
    or nothing smaller fits either (then the run reports its own OOM)."""
    t = cfg.train
    eff = t.micro_batch_size * t.accumulation_steps
    unset = cfg.model.loss == "chunked" and cfg.model.loss_chunk_size is None  # fit_loss_chunk sizes it after

    def ok(micro, accum):  # the config's own keys go to the estimate as they are; an unset chunk at its leanest
        lean = {"loss_chunk": -(-micro * cfg.data.seq_length // MAX_COMPILED_CHUNKS)} if unset else {}
        return fits(estimate_memory(cfg, micro=micro, accum=accum, **lean), budget_bytes)

    if ok(t.micro_batch_size, t.accumulation_steps):
        return cfg, None
    for micro in sorted((m for m in range(1, t.micro_batch_size) if eff % m == 0), reverse=True):
        if ok(micro, eff // micro):
            new = cfg.override({"train.micro_batch_size": micro, "train.accumulation_steps": eff // micro})
            return new, (f"micro-batch {t.micro_batch_size} x {t.accumulation_steps} does not fit "
                         f"{budget_bytes / GiB:.1f} GiB ({where}; estimate); running {micro} x {eff // micro}: the "
                         f"same effective batch of {eff}")
    return cfg, None


def fit_loss_chunk(cfg, budget_bytes: int, where: str = "the budget") -> tuple[object, str | None]:
    """``model.loss: chunked`` with no ``loss_chunk_size``: one chunk (the whole micro-batch) when the estimator fits
    its logits in ``budget_bytes``, else the fewest chunks that fit, at most MAX_COMPILED_CHUNKS (each further chunk
    re-reads the LM head: compiled about 8 x V x d bytes). Returns (config, a line when it takes more than one)."""
    if cfg.model.loss != "chunked" or cfg.model.loss_chunk_size is not None:
        return cfg, None
    positions = cfg.train.micro_batch_size * cfg.data.seq_length
    for n in range(1, MAX_COMPILED_CHUNKS + 1):
        size = -(-positions // n)
        if fits(estimate_memory(cfg, loss_chunk=size), budget_bytes):
            break
    line = (f"model.loss_chunk_size: {size}, {-(-positions // size)} chunks of the micro-batch's {positions} "
            f"positions: one chunk's logits do not fit {budget_bytes / GiB:.1f} GiB ({where}; estimate)")
    return cfg.override({"model.loss_chunk_size": size}), (line if size < positions else None)
