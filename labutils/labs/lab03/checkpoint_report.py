"""Lab 03's report: the sentences, tables, figures and claims C4 / C5 that the notebook builds, in the lab's order,
from what :mod:`labutils.labs.lab03.checkpoint_measure` measured. Nothing here measures."""
from __future__ import annotations

import math

from ...verdicts import claims as cl
from . import checkpoint_measure as cm
from ...core.figures import legend_outside
from ...core.memory import budget_words, fmt_bytes as fmt

MiB = 2**20


def switch_lines(switch: dict, estimates: dict, device_type: str, peak_info: tuple, flops_ratio: float) -> list[str]:
    """Section 2: per micro-batch b of ``switch`` ({(b, on): Measured}) the saving and cost (CPU: ``flops_ratio``), or
    the run that did not fit; a saving under 1 % says why when the estimate at b holds no activation at its peak. Last,
    MFU -> HFU at the largest b where both have one, else why not (``peak_info``: :func:`labutils.peak_info`)."""
    out, mfu_at = [], None
    for b in sorted({b for b, _ in switch}):
        off, on = switch[b, False], switch[b, True]
        if not (off.ok and on.ok):
            failed = off if not off.ok else on
            out.append(f"batch {b}: '{failed.variant}' did not fit within {budget_words()}")
            continue
        saving = 1 - on.peak / off.peak
        cost = (f"{on.step_time / off.step_time - 1:+.0%} step time" if device_type == "cuda" else
                f"{flops_ratio - 1:+.0%} FLOPs (section 1), step time {CPU_TIME}")
        line = f"batch {b}: checkpointing saves {saving:.0%} of the peak ({fmt(off.peak)} -> {fmt(on.peak)}) for {cost}"
        est = estimates.get(b)
        if abs(saving) < 0.01 and est and not est["peak_breakdown"].get("activations"):
            kept = sum(est["peak_breakdown"].get(k, 0) for k in ("weights", "grads", "optimizer"))
            line += (f". Why 0 %: the peak comes at '{est['peak_phase']}' (estimator), when no activation is live "
                     f"any more: {fmt(kept)} of weights, gradients and AdamW state, which checkpointing does not touch")
        out.append(line)
        if off.result.mfu is not None and on.result.mfu is not None:
            mfu_at = b
    if mfu_at is not None:
        off, on = switch[mfu_at, False].result, switch[mfu_at, True].result
        out.append(f"batch {mfu_at}: MFU {off.mfu:.1%} -> {on.mfu:.1%} with checkpointing (same model FLOPs, longer "
                   f"step); HFU {off.hfu:.1%} -> {on.hfu:.1%} counts the recompute as work the GPU did")
    else:
        why = peak_info[1] if peak_info[0] is None else "no micro-batch ran both with and without checkpointing"
        out.append(f"MFU / HFU: - ({why})")
    return out


def plot_chain(ks: list[int], peaks: list[float], n_layers: int):
    """Peak (layer tensors) of an ``n_layers`` chain against segment length k, with L/k + k and k = sqrt(L)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(ks, peaks, "o-", label="measured")
    ax.plot(ks, [n_layers / k + k for k in ks], "--", label="L/k + k")
    ax.axvline(math.sqrt(n_layers), color="gray", linestyle=":", label="k = sqrt(L)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set(xlabel="segment length k (layers)", ylabel="peak memory (layer tensors)",
           title=f"Chen et al. 2016 on a {n_layers}-layer chain of equal-sized layers")
    ax.legend()
    fig.tight_layout()
    return fig


def every_k_table(ks: list[int], every: dict, segs: dict, pred_every: dict, pred_seg: dict) -> list[dict]:
    """One row per k: status, peak (MiB), the accounting's prediction (MiB) and step time of ``every_n_layers = k``
    and of segments of k blocks (``every`` and ``segs``: the Measured runs by k; ``pred_*``: bytes by k)."""
    return [{"k": k, **{f"{name}_{col}": m.row()[col] for name, m in (("every_n", every[k]), ("segments", segs[k]))
                        for col in ("status", "peak_mib", "step_s")},
             "every_n_predicted_mib": pred_every[k] / MiB, "segments_predicted_mib": pred_seg[k] / MiB} for k in ks]


def every_k_accounting(L: int, k: int, x: float, a: float) -> float:
    """Saved activations at the peak of backward under ``every_n_layers = k`` (``x``: a block's input, ``a``: its saved
    activations): the largest of the start of backward and each checkpointed block's recompute, not their sum."""
    ck = list(range(0, L, k))   # below checkpointed block j (the i-th): j - i un-checkpointed blocks
    return max([(L - len(ck)) * a + len(ck) * x] + [(j - i) * a + (i + 1) * x + a for i, j in enumerate(ck)])


def segments_accounting(L: int, k: int, x: float, a: float) -> float:
    """The same for segments of k blocks: ceil(L/k) segment inputs + the top segment's k blocks (Chen's L/k + k)."""
    return math.ceil(L / k) * x + min(k, L) * a


def plot_every_k(ks: list[int], every: dict, segs: dict, pred_every: dict, pred_seg: dict, base, budget: int,
                 title: str, n_blocks: int):
    """Peak memory against k, every_n_layers = k and segments of k (the accounting dashed, OOM as x at the budget),
    beside the run without checkpointing (``base``), the budget and k = sqrt(``n_blocks``). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for series, pred, mark, label in [(every, pred_every, "o", "every_n_layers = k (model API)"),
                                      (segs, pred_seg, "s", "segments of k blocks (Chen)")]:
        kk = [k for k in ks if series[k].ok]
        line, = ax.plot(kk, [series[k].peak / MiB for k in kk], mark + "-", label=label)
        ax.plot(ks, [pred[k] / MiB for k in ks], "--", color=line.get_color(), alpha=0.6, label=f"{label}: accounting")
        if oom := [k for k in ks if not series[k].ok]:
            ax.plot(oom, [budget / MiB] * len(oom), "x", color=line.get_color(), label=f"{label}: OOM (at the budget)")
    if base.ok:
        ax.axhline(base.peak / MiB, color="black", linestyle=":", label="no checkpointing")
    ax.axhline(budget / MiB, color="red", linestyle=":", label="budget")
    ax.axvline(math.sqrt(n_blocks), color="gray", linestyle="-.", label="k = sqrt(L)")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set(xlabel="k (blocks)", ylabel="peak memory (MiB)", title=title)
    legend_outside(ax, fontsize=7)
    fig.tight_layout()
    return fig


CPU_TIME = "not judged (CPU timing)"
CPU_ORDER = f"ordered by recomputed FLOPs, then blocks re-run (counted): not a GPU ranking; step_s {CPU_TIME}"


def cost(m, device_type: str):
    """A run's cost: GPU, its median step time; CPU (timing not judged), what it recomputes (``cm.measure`` counts)."""
    return m.step_time if device_type == "cuda" else tuple(m.info[k] for k in cm.RECOMPUTE)


def ranking_label(runs: list, device_type: str) -> str:
    """How an order of ``runs`` by :func:`cost` may be read: on a CPU, :data:`CPU_ORDER`; on a GPU a measured
    ranking (fastest first), naming each neighbouring pair whose order is not settled (few timed steps, or noise)."""
    if device_type != "cuda":
        return CPU_ORDER

    def unsettled(a, b) -> str | None:
        t = cl.timed_ratio(cl.timed_step_times(a.result), cl.timed_step_times(b.result))
        if t["timed_steps"] < cl.MIN_TIMED_STEPS:
            return f"{t['timed_steps']} timed step(s), fewer than {cl.MIN_TIMED_STEPS}"
        if t["spread"] is not None and t["spread"] >= abs(t["ratio"] - 1):
            return f"noise +-{t['spread']:.0%} vs a {t['ratio'] - 1:+.0%} difference"
        return None
    open_pairs = [f"{a.variant} vs {b.variant} ({why})" for a, b in zip(runs, runs[1:]) if (why := unsettled(a, b))]
    return ("fastest first, by measured GPU step time"
            + ("; order not decided for " + "; ".join(open_pairs) if open_pairs else ""))


def pareto_front(runs, device_type: str = "cuda") -> list:
    """The runs that ran and that no other run beats on both peak memory and :func:`cost`, by cost (what that order
    may say: :func:`ranking_label`). CPU offload on a CPU (host memory to host memory) is never ranked."""
    front, best = [], math.inf
    useless = ("offload", "checkpoint_offload") if device_type != "cuda" else ()
    for m in sorted((m for m in runs if m.ok and m.kind not in useless), key=lambda m: (cost(m, device_type), m.peak)):
        if m.peak < best:
            front.append(m)
            best = m.peak
    return front


def plot_pareto(ks: list[int], every: dict, segs: dict, points: list, front: list, budget: int, title: str,
                device_type: str = "cuda"):
    """Peak memory against :func:`cost` (GPU: step time; CPU: recomputed FLOPs): the every_n / segments sweeps (grey),
    ``points`` (dots), the Pareto front (each member named) and the budget. Returns the figure."""
    import matplotlib.pyplot as plt

    gpu = device_type == "cuda"
    x = (lambda m: m.step_time) if gpu else (lambda m: m.info["extra_flops_pct"])  # CPU: timing not judged
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for series, mark, label in [(every, "o", "every_n_layers = k"), (segs, "s", "segments of k blocks")]:
        kk = [k for k in ks if series[k].ok]
        ax.plot([x(series[k]) for k in kk], [series[k].peak / MiB for k in kk], mark + "-", ms=3, lw=0.8,
                color="silver", label=label)
    for m, color in zip(points, ["black", "C0", "C1", "C2", "C3"]):
        if m.ok:
            ax.scatter(x(m), m.peak / MiB, s=60, color=color, label=m.variant, zorder=3)
    ax.plot([x(m) for m in front], [m.peak / MiB for m in front], "-", color="C4", alpha=0.5, label="Pareto front")
    for m in front:
        ax.annotate(m.variant, (x(m), m.peak / MiB), xytext=(5, 5), textcoords="offset points", fontsize=8)
    ax.axhline(budget / MiB, color="red", linestyle=":", label="budget")
    ax.set(xlabel="step time (s)" if gpu else "recomputed FLOPs (%)", ylabel="peak memory (MiB)", title=title)
    legend_outside(ax, fontsize=7)  # points fill the corners: the legend goes to the right
    fig.tight_layout()
    return fig


def recommendation(front: list, base, budget: int) -> list[dict]:
    """One row per Pareto-front run, in the front's order: the budget it needs, whether this lab's ``budget`` is
    enough, the gap to the baseline it closes, its step time and overhead; then what to do below the front."""
    rec = [{"budget_at_least_mib": m.peak / MiB, "use": m.variant, "fits_this_budget": m.peak <= budget,
            "gap_it_closes_mib": (base.peak - m.peak) / MiB if base.ok else None,
            **{k: m.info.get(k) for k in cm.RECOMPUTE}, "step_s": m.step_time,
            "time_overhead_pct": 100 * (m.step_time / base.step_time - 1) if base.ok else None} for m in front]
    if front:
        rec.append({"budget_at_least_mib": None, "use": f"below {fmt(front[-1].peak)}: smaller micro-batch + "
                                                        "accumulation, mixed precision (below), or a bigger GPU"})
    return rec


def spec_check(cfg, info: dict, *, off, on, saving, overhead, flops_ratio: float, block_ratio: float, k_seg,
               k_star: float, state_bytes: int) -> list[dict]:
    """The course README's lab 3 table beside section 2's pair at the config's batch, each row with why they differ.
    Its GB are GPT-2 on a GPU: never set beside a smoke run's MiB; the FLOP count is set against no claim."""
    B, T = cfg.train.micro_batch_size, cfg.data.seq_length
    gb = (lambda s: s) if info["mode"] == "full" else (lambda s: "(a GPU size: full mode only)")
    cpu = info["device"].type != "cuda"
    state = (f"{fmt(state_bytes)} of FP32 state ({state_bytes / on.peak:.0%} of the checkpointed peak) is not "
             "checkpointed") if on.ok else "-"
    f = f"the +{flops_ratio - 1:.0%} FLOPs"
    time_why = ("-" if overhead is None else CPU_TIME if cpu else
                "negative: timing noise larger than the recompute" if overhead < 0 else
                f"below {f}: the optimizer step and LM head are not recomputed" if overhead < flops_ratio - 1 else
                f"above {f}: small kernels and launches cost more than their FLOPs")
    return [{"quantity": f"peak, no checkpointing ({B} x {T})", "course README": gb("~12 GB"),
         "this run": fmt(off.peak) if off.ok else f"OOM within {budget_words()}",
         "why": "the README gives no batch, length or precision"},
        {"quantity": "peak, checkpointing", "course README": gb("~7 GB"),
         "this run": fmt(on.peak) if on.ok else "OOM", "why": "-"},
        {"quantity": f"memory saving ({B} x {T})", "course README": "42% (30-50%)",
         "this run": f"{saving:.0%}" if saving is not None else "-", "why": state if saving is not None else "-"},
        {"quantity": f"step time ({B} x {T}, median" + (", CPU timing)" if cpu else ")"),
         "course README": "125% (+20-30% time)", "this run": f"{1 + overhead:.0%}" if overhead is not None else "-",
         "why": time_why},
        {"quantity": "extra FLOPs, full checkpointing (section 1)", "course README": "- (it states time only)",
         "this run": f"{flops_ratio - 1:+.0%}", "why": "one more forward of the blocks: at most +33%"},
        {"quantity": "activations vs depth", "course README": "O(L) -> O(sqrt L)",
         "this run": f"L*x + A, A = {block_ratio:.0f}x", "why": f"best segment k = {k_seg} block(s); blocks are not "
                                                                f"equal layers: sqrt(L*x/A) = {k_star:.2f}"}]


def _conditions(cfg, info: dict, batch: int, budget_text: str) -> dict:
    return cl.conditions(model=cfg.model.name, batch=f"{batch} x 1", sequence=cfg.data.seq_length,
                         precision=cfg.train.precision, hardware=cl.hardware(info), mode=info["mode"],
                         budget=budget_text)


def claim_c4(cfg, info: dict, *, pair, b0: int, b1: int, budget: int, state_bytes: int, flops_ratio: float,
             hw: str, dropout: float | None = None) -> dict:
    """Claim C4 (30-50 % less memory for +20-30 % time) on section 2's ``pair`` (without, with checkpointing), headed by
    what it buys (the largest micro-batch within ``budget``); ``state_bytes`` (16N) goes with the evidence."""
    headline = (f"within {fmt(budget)} the largest micro-batch is {b0} without checkpointing and {b1} with it"
                + (f" ({b1 / b0:.1f}x the sequences per step)" if b0 else ""))
    extra = {"headline": headline, "recompute_flops_overhead": flops_ratio - 1,
             "largest_micro_batch_within_budget": {"no checkpointing": b0, "checkpointing": b1}}
    if not (pair and all(m.ok for m in pair)):
        entry = cl.not_measured("C4", f"no micro-batch ran both with and without checkpointing on {hw} "
                                      f"({headline})", _conditions(cfg, info, b0 or 1, fmt(budget)))
        return {**entry, "extra": extra}
    o, n = pair
    mb = o.micro_batch
    ratio, ev = cl.run_pair_evidence(o.result, n.result, (f"no checkpointing, micro-batch {mb}",
                                                          f"checkpointing every block, micro-batch {mb}"),
                                     hw=cl.hardware(info))
    c4_time = n.step_time / o.step_time - 1   # the tables' number: the ratio of the medians
    mem_ev = cl.Evidence(pair=ev.pair, hardware=ev.hardware, state_share=state_bytes / o.peak)
    time_judged = cl.judge_quantity(cl.CLAIMS["C4"].quantities[1], c4_time, ev)[0] in cl.JUDGED
    drop = f" (dropout {dropout:g})" if dropout is not None else ""
    reason = (f"at micro-batch {mb} {fmt(state_bytes)} of FP32 weights, gradients and AdamW state "
              f"({state_bytes / o.peak:.0%} of the baseline peak) and the LM head are not checkpointed; the "
              f"recompute costs {flops_ratio - 1:+.0%} FLOPs on the model measured{drop}"
              + (f", the step {c4_time:+.0%} time (median of {ev.timed_steps} timed steps)" if time_judged else ""))
    entry = cl.claim_entry("C4", {"memory_saving": 1 - n.peak / o.peak, "time_overhead": c4_time},
                           _conditions(cfg, info, mb, fmt(budget)), reason=reason,
                           evidence={"memory_saving": mem_ev, "time_overhead": ev}, extra=extra)
    entry["why"] = f"What it buys: {headline}. {entry['why']}"   # the headline first, then the verdict's parts
    return entry


def claim_c5(cfg, info: dict, *, k_chain: int, chain_layers: int, k_seg, n_blocks: int,
             block_ratio: float | None = None, gpt2_model: str | None = None) -> dict:
    """Claim C5 (the best segment length is about sqrt(L)): the chain of section 3 (best at ``k_chain``) and the GPT-2
    segment sweep (``n_blocks`` deep, best at ``k_seg``); the reason states the measured optima only."""
    gname = gpt2_model or cfg.model.name
    values = {"chain_optimum_over_sqrt_L": k_chain / math.sqrt(chain_layers),
              "gpt2_optimum_over_sqrt_L": k_seg / math.sqrt(n_blocks) if k_seg else None}
    evidence = {"chain_optimum_over_sqrt_L": cl.Evidence(layers=chain_layers, pair=(
                    f"{chain_layers}-layer chain, segments of k", "its best k against sqrt(L)")),
                "gpt2_optimum_over_sqrt_L": cl.Evidence(layers=n_blocks, pair=(
                    f"{gname} ({n_blocks} blocks), segments of k blocks", "its best k against sqrt(L)"))}
    reason = f"the {chain_layers}-layer chain of equal layers is best at k = {k_chain} (sqrt(L) = " \
             f"{math.sqrt(chain_layers):.1f})"
    if k_seg:
        reason += f"; {gname} ({n_blocks} blocks) at k = {k_seg} (sqrt(L) = {math.sqrt(n_blocks):.1f})"
        if block_ratio and k_seg < math.sqrt(n_blocks):
            reason += f": a GPT-2 block keeps ~{block_ratio:.0f} block-input-sized tensors, not one"
    cond = _conditions(cfg, info, cfg.train.micro_batch_size, "-")
    cond["layers"] = {"chain of equal layers": chain_layers, gname: n_blocks}
    return cl.claim_entry("C5", values, cond, reason=reason, evidence=evidence)
