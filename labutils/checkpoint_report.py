"""Lab 03's report: the tables, figures, written conclusions and claims that the notebook builds from its runs.

Nothing here measures: every function takes what :mod:`labutils.checkpoint_measure` measured in this run (its
:class:`~labutils.checkpoint_measure.Measured` runs, or plain numbers) and lays it out. In the order of the lab:

    plot_chain                      section 3: Chen et al.'s chain, peak vs segment length
    every_k_table, sqrt_note,       section 4: every_n_layers = k and segments of k blocks on GPT-2
      plot_every_k
    every_k_fit_note                section 4: which k fits the budget (and, on a GPU only, which is fastest)
    pareto_front, plot_pareto,      section 5: the memory / time trade-off of every variant
      ranking_label, front_line
    recommendation,                 section 6: which variant for which memory gap
      recommendation_note
    spec_check, spec_conclusions,   section 7: the course README's expectations against this run; claims C4 and C5
      claim_c4, claim_c5
"""
from __future__ import annotations

import math

from . import claims as cl
from .figures import legend_outside
from .memory import budget_words, fmt_bytes as fmt
from .models import vocab_size

MiB = 2**20


# ------------------------------------------------------------------------------------ section 3: Chen's chain
def plot_chain(ks: list[int], peaks: list[float], n_layers: int):
    """Peak memory (in layer tensors) of a chain of ``n_layers`` equal layers against segment length k, with
    Chen et al.'s model L/k + k and k = sqrt(L). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(ks, peaks, "o-", label="measured")
    ax.plot(ks, [n_layers / k + k for k in ks], "--", label="L/k + k")
    ax.axvline(math.sqrt(n_layers), color="gray", linestyle=":", label="k = sqrt(L)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("segment length k (layers)")
    ax.set_ylabel("peak memory (layer tensors)")
    ax.set_title(f"Chen et al. 2016 on a {n_layers}-layer chain of equal-sized layers")
    ax.legend()
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------- section 4: k on GPT-2
def every_k_table(ks: list[int], every: dict, segs: dict) -> list[dict]:
    """One row per k: status, peak (MiB) and step time of ``every_n_layers = k`` and of segments of k blocks
    (``every`` and ``segs``: the Measured runs by k)."""
    return [{"k": k, **{f"{name}_{col}": m.row()[col]
                        for name, m in (("every_n", every[k]), ("segments", segs[k]))
                        for col in ("status", "peak_mib", "step_s")}} for k in ks]


def every_k_accounting(L: int, k: int, x: float, a: float) -> float:
    """Saved activations at the peak of backward under ``every_n_layers = k`` (blocks 0, k, 2k, ... checkpointed),
    from section 1's accounting: ``x`` one block's input, ``a`` one block's saved activations. The peak is the
    largest of the moments that matter, not their sum: at the start of backward every un-checkpointed block's
    ``a`` and every checkpointed block's ``x`` are live; when a checkpointed block j is recomputed, the blocks
    above it have been back-propagated and freed, so only the un-checkpointed blocks below j, the inputs of the
    checkpointed blocks up to j, and j's own recomputed ``a`` are live. (Adding the recompute's ``a`` to the
    start, as the first version of this formula did, counted an ``a`` twice and over-predicted every k > 1.)"""
    ck = list(range(0, L, k))
    moments = [(L - len(ck)) * a + len(ck) * x]
    for i, j in enumerate(ck):
        below = j - i                        # un-checkpointed blocks below block j
        moments.append(below * a + (i + 1) * x + a)
    return max(moments)


def segments_accounting(L: int, k: int, x: float, a: float) -> float:
    """The same for segments of k blocks (every block recomputed): all ceil(L/k) segment inputs are live when the
    top segment's k blocks are recomputed (Chen et al.'s L/k + k)."""
    return math.ceil(L / k) * x + min(k, L) * a


def sqrt_note(seg_blocks: float) -> str:
    """What Chen's optimal segment, counted in tensors and converted back to blocks (``seg_blocks``), means for
    checkpointing block by block."""
    if seg_blocks < 0.5:
        return ("even one block is longer than that segment: per-block checkpointing is the finest this API gets "
                "(finer means choosing tensors inside a block: selective checkpointing, section 5)")
    if seg_blocks <= 2:
        return "so checkpointing every block is (close to) the sqrt schedule already"
    return f"so segments of ~{seg_blocks:.0f} blocks should beat per-block checkpointing on memory"


def plot_every_k(ks: list[int], every: dict, segs: dict, pred_every: dict, pred_seg: dict, base, budget: int,
                 title: str, n_blocks: int):
    """Two panels against k: peak memory (measured, and the accounting's prediction dashed; OOM runs as x at the
    budget) and step time, for every_n_layers = k and segments of k, beside the run without checkpointing
    (``base``) and k = sqrt(L), L = ``n_blocks``. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for series, pred, mark, label in [(every, pred_every, "o", "every_n_layers = k (model API)"),
                                      (segs, pred_seg, "s", "segments of k blocks (Chen)")]:
        kk = [k for k in ks if series[k].ok]
        line, = ax_m.plot(kk, [series[k].peak / MiB for k in kk], mark + "-", label=label)
        ax_m.plot(ks, [pred[k] / MiB for k in ks], "--", color=line.get_color(), alpha=0.6)
        ax_t.plot(kk, [series[k].step_time for k in kk], mark + "-", label=label)
        oom = [k for k in ks if not series[k].ok]
        if oom:
            ax_m.plot(oom, [budget / MiB] * len(oom), "x", color=line.get_color(),
                      label=f"{label}: OOM (drawn at the budget, not a measured peak)")
    for ax, value in [(ax_m, base.peak / MiB if base.ok else None), (ax_t, base.step_time)]:
        if value is not None:
            ax.axhline(value, color="black", linestyle=":", label="no checkpointing")
        ax.axvline(math.sqrt(n_blocks), color="gray", linestyle="-.", label="k = sqrt(L)")
        ax.set_xlabel("k (blocks)")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax_m.axhline(budget / MiB, color="red", linestyle=":", label="budget")
    ax_m.set_ylabel("peak memory (MiB)")
    ax_t.set_ylabel("step time (s)")
    ax_m.set_title(title)
    ax_t.set_title("Step time vs k")
    ax_t.set_ylim(bottom=0)  # from zero: a few timed steps' noise is not drawn as a trend (the H200 run's 0.158-0.163 s)
    # one legend for both panels, below them: two legends side by side overlapped and ran off the figure (H200 run)
    handles = {}
    for ax in (ax_m, ax_t):
        for h, lb in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lb, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncols=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05 * math.ceil(len(handles) / 2), 1, 1))
    return fig


# -------------------------------------------------------------------- orders by step time: what they may say
CPU_ORDER = "ordered by CPU step time: not a GPU ranking, not judged"


def unsettled_order(a, b) -> str | None:
    """Why the step-time order of two runs (``a`` measured faster than ``b``) is not settled, or None when it is:
    fewer than :data:`labutils.claims.MIN_TIMED_STEPS` timed steps, or a noise (:func:`labutils.claims.timed_ratio`:
    +- from the two runs' half inter-quartile ranges) as large as the difference."""
    t = cl.timed_ratio(cl.timed_step_times(a.result), cl.timed_step_times(b.result))
    if t["timed_steps"] < cl.MIN_TIMED_STEPS:
        return f"{t['timed_steps']} timed step(s), fewer than {cl.MIN_TIMED_STEPS}"
    if t["spread"] is not None and t["spread"] >= abs(t["ratio"] - 1):
        return f"noise +-{t['spread']:.0%} vs a {t['ratio'] - 1:+.0%} difference"
    return None


def ranking_label(runs: list, device_type: str) -> str:
    """How an order of ``runs`` by step time (fastest first) may be read on ``device_type``: on a CPU it is CPU
    timing (:data:`CPU_ORDER`: says nothing about a GPU); on a GPU a measured ranking, with each neighbouring pair
    whose order is not settled (:func:`unsettled_order`) named."""
    if device_type != "cuda":
        return CPU_ORDER
    open_pairs = [f"{a.variant} vs {b.variant} ({why})" for a, b in zip(runs, runs[1:])
                  if (why := unsettled_order(a, b))]
    return ("fastest first, by measured GPU step time"
            + ("; order not decided for " + "; ".join(open_pairs) if open_pairs else ""))


def every_k_fit_note(ks: list[int], every: dict, budget: int, device_type: str) -> str:
    """Section 4's pick among every_n_layers = k (``every``: the Measured runs by k) within ``budget``. Memory is
    measured on any device: the largest k whose peak fits. Which k is fastest is said only on a GPU, by measured
    step time (with :func:`unsettled_order` against the runner-up); on a CPU the step time is shown, labelled as CPU
    timing that ranks nothing. Every word follows the numbers printed beside it."""
    fits = [k for k in ks if every[k].ok and every[k].peak <= budget]
    if not fits:
        return f"every_n_layers: no k fits the budget of {fmt(budget)}"
    big = max(fits)
    vs1 = (lambda k: f"{every[k].step_time / every[1].step_time - 1:+.0%} step time vs k = 1") if every[1].ok else \
        (lambda k: f"{every[k].step_time:.3g} s per step")
    out = (f"every_n_layers: the largest k whose peak fits the budget of {fmt(budget)} is k = {big} "
           f"(peak {fmt(every[big].peak)}: memory, measured)")
    if device_type != "cuda":
        return out + f"; {vs1(big)} ({CPU_ORDER})"
    by_time = sorted(fits, key=lambda k: every[k].step_time)
    fastest = by_time[0]
    out += (f"; the fastest k that fits, by measured GPU step time, is k = {fastest} ({vs1(fastest)})"
            + (f"; k = {big}: {vs1(big)}" if fastest != big else ""))
    if len(by_time) > 1 and (why := unsettled_order(every[fastest], every[by_time[1]])):
        out += f"; not decided against k = {by_time[1]}: {why}"
    return out


# ---------------------------------------------------------------------------- section 5: memory vs time
OFFLOAD_KINDS = ("offload", "checkpoint_offload")


def does_nothing_here(m, device_type: str) -> bool:
    """True for a variant that does nothing on this hardware: CPU offload on a CPU moves activations from host
    memory to host memory. Such a run is shown, never ranked or recommended."""
    return device_type != "cuda" and m.kind in OFFLOAD_KINDS


def pareto_front(runs, device_type: str = "cuda") -> list:
    """The runs that ran and that no other run beats on both peak memory and step time, by step time (what that
    order may say: :func:`ranking_label`); a variant that does nothing on ``device_type``
    (:func:`does_nothing_here`) is left out."""
    front, best = [], math.inf
    for m in sorted((m for m in runs if m.ok and not does_nothing_here(m, device_type)),
                    key=lambda m: (m.step_time, m.peak)):
        if m.peak < best:
            front.append(m)
            best = m.peak
    return front


def plot_pareto(ks: list[int], every: dict, segs: dict, points: list, front: list, budget: int, title: str):
    """Peak memory against step time: the every_n / segments sweeps as grey lines, ``points`` (baseline, full,
    the variants beyond) as labelled dots, the Pareto front and the budget. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for series, mark, label in [(every, "o", "every_n_layers = 1..L"), (segs, "s", "segments of 1..L blocks")]:
        kk = [k for k in ks if series[k].ok]
        ax.plot([series[k].step_time for k in kk], [series[k].peak / MiB for k in kk], mark + "-", ms=3, lw=0.8,
                color="silver", label=label)
        if kk:
            ax.annotate(f"k={kk[-1]}", (series[kk[-1]].step_time, series[kk[-1]].peak / MiB), fontsize=7,
                        color="gray")
    for m, color in zip(points, ["black", "C0", "C1", "C2", "C3"]):
        if m.ok:
            ax.scatter(m.step_time, m.peak / MiB, s=60, color=color, label=m.variant, zorder=3)
            ax.annotate(m.variant, (m.step_time, m.peak / MiB), xytext=(5, 5), textcoords="offset points",
                        fontsize=8)
    ax.plot([m.step_time for m in front], [m.peak / MiB for m in front], "-", color="C4", alpha=0.5,
            label="Pareto front")
    ax.axhline(budget / MiB, color="red", linestyle=":", label="budget")
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(title)
    legend_outside(ax, fontsize=7)  # points fill the corners: the legend goes to the right
    fig.tight_layout()
    return fig


def front_line(front: list, device_type: str) -> str:
    """The Pareto front in one line, its order labelled by :func:`ranking_label`."""
    unit = " CPU" if device_type != "cuda" else ""
    return (f"Pareto front ({ranking_label(front, device_type)}): "
            + " -> ".join(f"{m.variant} ({fmt(m.peak)}, {m.step_time:.3g} s{unit})" for m in front))


# ---------------------------------------------------------------------------- section 6: which one when
def recommendation(front: list, base) -> list[dict]:
    """One row per Pareto-front run, in the front's order (by step time): the budget it needs, the gap to the
    baseline it closes, its step time and overhead; a last row says what to do below the front's smallest peak."""
    rec = []
    for m in front:  # in the front's order: by step time (on a CPU, CPU time: see recommendation_note)
        rec.append({"budget_at_least_mib": m.peak / MiB, "use": m.variant,
                    "gap_it_closes_mib": (base.peak - m.peak) / MiB if base.ok else None,
                    "step_s": m.step_time,
                    "time_overhead_pct": 100 * (m.step_time / base.step_time - 1) if base.ok else None})
    if front:
        rec.append({"budget_at_least_mib": None,
                    "use": f"below {fmt(front[-1].peak)}: checkpointing alone is not enough: "
                           "smaller micro-batch + accumulation, mixed precision (below), or a bigger GPU"})
    return rec


def recommendation_note(front: list, budget: int, device_type: str) -> str:
    """How to read :func:`recommendation`'s table and what it gives within this lab's ``budget``. On a GPU the rows
    are a measured ranking: the first row that fits is the fastest option that does (with the noise caveats of
    :func:`ranking_label`). On a CPU the order is CPU timing, so no option is called fastest: only which ones fit
    (memory, measured) is said."""
    fit = [m.variant for m in front if m.peak <= budget]
    if device_type != "cuda":
        return (f"rows {CPU_ORDER}; what this run shows is memory: within this lab's budget of {fmt(budget)} "
                + (f"the peak of {', '.join(repr(v) for v in fit)} fits" if fit else "none of them fits"))
    return (f"read it top down ({ranking_label(front, device_type)}): the first row whose peak fits your budget is "
            f"the fastest option that does. With this lab's budget of {fmt(budget)}: "
            + (f"'{fit[0]}'" if fit else "none of them") + ".")


# ------------------------------------------------------------------------- section 7: against the spec
def spec_check(cfg, info: dict, *, off, on, saving, overhead, hw: str, flops_ratio: float, block_ratio: float,
               k_seg) -> list[dict]:
    """The course README's expectations (Lab-1.4, its lab 3 table) beside this run's measurements (``off`` / ``on``: the config's batch without and
    with checkpointing; ``saving`` / ``overhead``: their fractions, None if one did not run). The README's
    absolute sizes are GPT-2 on a GPU, so outside full mode they are not put next to a smoke run's MiB."""
    B, T = cfg.train.micro_batch_size, cfg.data.seq_length
    gb = (lambda s: s) if info["mode"] == "full" else (lambda s: "(a GPU size: full mode only)")
    return [
        {"quantity": f"peak, no checkpointing ({B} x {T})", "course README": gb("~12 GB"),
         "this run": fmt(off.peak) if off.ok else f"OOM within {budget_words()}"},
        {"quantity": "peak, checkpointing", "course README": gb("~7 GB"), "this run": fmt(on.peak) if on.ok else "OOM"},
        {"quantity": f"memory saving ({B} x {T})", "course README": "42%", "this run": f"{saving:.0%}" if saving is not None else "-"},
        {"quantity": f"step time ({B} x {T}, median of timed steps" + (", CPU timing)" if info["device"].type != "cuda" else ")"),
         "course README": "125%", "this run": f"{1 + overhead:.0%}" if overhead is not None else "-"},
        {"quantity": "extra FLOPs", "course README": "20-30% (time)", "this run": f"{flops_ratio - 1:+.0%}"},
        {"quantity": "activations vs depth", "course README": "O(L) -> O(sqrt L)",
         "this run": f"L*A -> L*x + A, A = {block_ratio:.0f}x; best segment k = {k_seg}"}]


def spec_conclusions(cfg, info: dict, *, off, on, saving, overhead, state_bytes: int, flops_ratio: float,
                     block_ratio: float, k_star: float, k_seg, sqrt_note: str, k_chain: int,
                     chain_layers: int = 64) -> list[str]:
    """Why this run's memory, time and best segment length differ from the course README's: one paragraph each.

    ``state_bytes``: FP32 weights, gradients and AdamW state (16N); ``block_ratio``: a block's saved activations
    over its input (A/x); ``k_star``: sqrt(L*x/A); ``k_chain``: the measured optimum of section 3's chain."""
    B, T = cfg.train.micro_batch_size, cfg.data.seq_length
    out = []
    if saving is not None:
        V = vocab_size(cfg.model.name)
        out.append(f"- memory at micro-batch {B}: {fmt(off.peak)} -> {fmt(on.peak)} ({saving:.0%} saved) vs the course README's "
                   f"{'~12 GB -> ~7 GB (42%)' if info['mode'] == 'full' else '42% (its GPU sizes are not comparable here)'}. "
                   f"Checkpointing only touches activations inside the blocks: the {fmt(state_bytes)} of FP32 weights, "
                   f"gradients and AdamW state stay ({state_bytes / on.peak:.0%} of the checkpointed peak), and so does "
                   f"the LM head: its logits alone are {fmt(B * T * V * 4)} at {B} x {T} x {V} (vocabulary), and "
                   f"log_softmax and the gradient add copies of that size. The course README gives no batch, sequence length or "
                   f"precision; the saving grows with the share of block activations in the peak (here "
                   f"{(off.peak - state_bytes) / off.peak:.0%} is not state).")
    else:
        out.append(f"- memory: the baseline did not fit within {budget_words()} at batch {B} x {T}, which is the course "
                   f"README's point; "
                   f"with checkpointing the peak was {fmt(on.peak) if on.ok else 'OOM too'}.")
    if overhead is not None:
        reason = ("negative: with these few short steps the timing noise is larger than the recompute itself"
                  if overhead < 0 else
                  "the optimizer step, the LM head and the data movement are not recomputed, so the wall-clock "
                  "overhead stays below the FLOP overhead" if overhead < flops_ratio - 1 else
                  "small kernels, launch overhead and (on CPU) the Python work of the checkpoint machinery cost more "
                  "than their FLOPs")
        cpu = info["device"].type != "cuda"
        if cpu:   # CPU timing is shown once, labelled; nothing interprets it
            out.append(f"- time: {overhead:+.0%} per step at micro-batch {B} (CPU timing, not interpreted: it says "
                       f"nothing about a GPU); the FLOP counter says {flops_ratio - 1:+.0%} on any device.")
        else:
            out.append(f"- time: {overhead:+.0%} per step at micro-batch {B} (median of the timed steps) vs the course "
                       f"README's +25%; the FLOP counter says {flops_ratio - 1:+.0%} (one more forward of the blocks, "
                       f"bounded by +33%): {reason}.")
    chain_verdict = cl.CLAIMS["C5"].quantities[0].judge(k_chain / math.sqrt(chain_layers))  # C5's own rule
    out.append(f"- O(sqrt L): per-block checkpointing keeps L block inputs plus one block (L*x + A). Chen's sqrt(L) "
               f"assumes equal-sized layers; a GPT-2 block holds {block_ratio:.0f} block-input-sized tensors, so the "
               f"best segment length is sqrt(L*x/A) = {k_star:.2f} blocks (measured k = {k_seg}): {sqrt_note}. "
               f"Counted in equal-sized tensors, the sqrt rule {chain_verdict} (measured optimum {k_chain} on the "
               f"{chain_layers}-layer chain of section 3, sqrt(L) = {math.sqrt(chain_layers):.0f}).")
    return out


def _conditions(cfg, info: dict, batch: int, budget_text: str) -> dict:
    return cl.conditions(model=cfg.model.name, batch=f"{batch} x 1", sequence=cfg.data.seq_length,
                         precision=cfg.train.precision,
                         hardware=cl.hardware({"gpu_name": info["gpu_name"], "device": info["device"].type}),
                         mode=info["mode"], budget=budget_text)


def claim_c4(cfg, info: dict, *, pair, b0: int, b1: int, budget: int, state_bytes: int, flops_ratio: float,
             hw: str, dropout: float | None = None, **_unused) -> dict:
    """Claim C4 ("checkpointing saves 30-50 % of the memory (~12 GB -> ~7 GB) for +20-30 % time"), judged by
    :mod:`labutils.claims` on the one pair of runs the lab measured at that micro-batch (section 2's switch):
    ``pair`` = (no checkpointing, checkpointing), both at the same micro-batch, or None when no micro-batch ran
    both. The lab passes the config's micro-batch (the course README's ~12 GB batch) when both ran there, else the largest
    micro-batch where the baseline fits the budget (``b0``). The saving and overhead are the same numbers the
    lab's tables print (peaks; medians of the timed steps, :func:`labutils.checkpoint_measure.overhead`).

    The headline is what checkpointing buys: the largest micro-batch within ``budget`` (``b0`` without, ``b1``
    with), first in the why and in ``extra``. ``flops_ratio``: full checkpointing's FLOPs over the baseline's on
    the model as measured (``dropout``: its dropout). ``state_bytes``: FP32 weights + gradients + AdamW, whose
    share of the baseline peak is recorded with the evidence (why a smoke memory ratio is not judged)."""
    hwname = cl.hardware({"gpu_name": info["gpu_name"], "device": info["device"].type})
    headline = (f"within {fmt(budget)} the largest micro-batch is {b0} without checkpointing and {b1} with it"
                + (f" ({b1 / b0:.1f}x the sequences per step)" if b0 else ""))
    extra = {"headline": headline,
             "largest_micro_batch_within_budget": {"no checkpointing": b0, "checkpointing": b1},
             "recompute_flops_overhead": flops_ratio - 1}
    if pair and all(m.ok for m in pair):
        o, n = pair
        mb = o.micro_batch
        ratio, ev = cl.run_pair_evidence(o.result, n.result, (f"no checkpointing, micro-batch {mb}",
                                                              f"checkpointing every block, micro-batch {mb}"),
                                         hardware=hwname)
        c4_time = n.step_time / o.step_time - 1   # the tables' number: the ratio of the medians
        mem_ev = cl.Evidence(pair=ev.pair, hardware=ev.hardware, state_share=state_bytes / o.peak)
        time_judged = cl.judge_quantity(cl.CLAIMS["C4"].quantities[1], c4_time, ev)[0] in cl.JUDGED
        drop = f" (dropout {dropout:g})" if dropout is not None else ""
        reason = (f"at micro-batch {mb} {fmt(state_bytes)} of FP32 weights, gradients and "
                  f"AdamW state ({state_bytes / o.peak:.0%} of the baseline peak) and the LM head are not "
                  f"checkpointed; the recompute costs {flops_ratio - 1:+.0%} FLOPs on the model measured{drop}"
                  + (f", the step {c4_time:+.0%} time (median of {ev.timed_steps} timed steps)" if time_judged else ""))
        entry = cl.claim_entry("C4", {"memory_saving": 1 - n.peak / o.peak, "time_overhead": c4_time},
                               _conditions(cfg, info, mb, fmt(budget)), reason=reason,
                               evidence={"memory_saving": mem_ev, "time_overhead": ev}, extra=extra)
        entry["why"] = f"What it buys: {headline}. {entry['why']}"   # the headline first, then the verdict's parts
        return entry
    return cl.not_measured("C4", f"no micro-batch ran both with and without checkpointing on {hw} ({headline})",
                           _conditions(cfg, info, b0 or 1, fmt(budget)))


def claim_c5(cfg, info: dict, *, k_chain: int, chain_layers: int, k_seg, n_blocks: int, block_ratio: float | None = None,
             gpt2_model: str | None = None) -> dict:
    """Claim C5 (the best segment length is about sqrt(L)), each half judged only on a model of at least
    :data:`labutils.claims.MIN_LAYERS` layers: the chain of equal layers (section 3, ``chain_layers`` deep, best
    at ``k_chain``) and the GPT-2 segment sweep (``n_blocks`` deep, best at ``k_seg``; ``gpt2_model`` names it
    when it is not the config's model, e.g. smoke mode's deep, narrow stand-in). ``block_ratio``: a block's
    saved activations over its input, for the reason when the best segment is shorter than sqrt(L).

    The layer count of each model is recorded in the conditions (``layers``); the reason is phrased from each
    half's own verdict, so it cannot contradict it."""
    values = {"chain_optimum_over_sqrt_L": k_chain / math.sqrt(chain_layers),
              "gpt2_optimum_over_sqrt_L": k_seg / math.sqrt(n_blocks) if k_seg else None}
    gname = gpt2_model or cfg.model.name
    evidence = {"chain_optimum_over_sqrt_L": cl.Evidence(layers=chain_layers, pair=(
                    f"{chain_layers}-layer chain, segments of k", "its best k against sqrt(L)")),
                "gpt2_optimum_over_sqrt_L": cl.Evidence(layers=n_blocks, pair=(
                    f"{gname} ({n_blocks} blocks), segments of k blocks", "its best k against sqrt(L)"))}
    hw = cl.hardware({"gpu_name": info["gpu_name"], "device": info["device"].type})
    parts = cl.judge("C5", values, evidence, hardware=hw)[2]

    def said(name, k, L, what):
        v = parts[name]["verdict"]
        if v not in cl.JUDGED:
            return None
        root = math.sqrt(L)
        where = {cl.HOLDS: "within 2x of", cl.PARTLY: "within 4x, not 2x, of", cl.DOES_NOT_HOLD: "more than 4x away from"}[v]
        out = f"{what} is best at k = {k}, {where} sqrt(L) = {root:.1f}"
        if v != cl.HOLDS and block_ratio and k < root and name.startswith("gpt2"):
            out += (f": a GPT-2 block keeps ~{block_ratio:.0f} block-input-sized tensors, not one, so shorter "
                    "segments win")
        return out

    clauses = [c for c in (said("chain_optimum_over_sqrt_L", k_chain, chain_layers,
                                f"the {chain_layers}-layer chain of equal layers"),
                           said("gpt2_optimum_over_sqrt_L", k_seg, n_blocks, f"{gname} ({n_blocks} blocks)") if k_seg
                           else None) if c]
    cond = _conditions(cfg, info, cfg.train.micro_batch_size, "-")
    cond["layers"] = {"chain of equal layers": chain_layers, gname: n_blocks}
    return cl.claim_entry("C5", values, cond, reason="; ".join(clauses) or None, evidence=evidence)
