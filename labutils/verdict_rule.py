"""The one rule that turns a run's numbers into a verdict: ``holds | partly | does not hold | not measured | not
judged | not decided``, with a ``why`` computed from the same numbers as the verdict. The claims it judges (C1-C7,
the original course's words) are in :mod:`labutils.claims`.

A claim is one or more :class:`Quantity` (what to measure, its unit, which direction is good, the range the
course claims, the thresholds of the verdict, and what a run needs before the quantity can be judged). The
threshold rule is sign-aware:

* a *benefit* (``better="higher"``: a saving, a speed-up) holds at or above ``holds_at``; a larger benefit than
  claimed still holds; between ``partly_at`` and ``holds_at`` it holds partly; below ``partly_at`` (a negative
  saving included) it does not hold;
* a *cost* (``better="lower"``: a time overhead, extra memory) holds at or below ``holds_at``; a smaller cost
  than claimed (or a gain) still holds; up to ``partly_at`` partly; above, it does not hold;
* a *target* (``better="within"``) holds inside ``holds_at=(lo, hi)``, partly inside ``partly_at=(lo, hi)``.

The verdict is decided by the value shown: where a value was also measured over a batch sweep, the sweep is
listed beside it as context (and a sweep of >= 2 batch sizes is needed), but the verdict is that of the value shown.

A verdict is only as strong as its evidence. Before the rule is applied, each quantity's :class:`Evidence` (the
pair of runs it compares, the hardware, the mode and model, timed steps and their noise, the layer count, the
batch sweep) is checked against the quantity's ``needs`` (:data:`NEEDS`):

* a speed quantity (``kind="speed"``) needs a GPU and >= :data:`MIN_TIMED_STEPS` timed steps after warm-up (or
  repeats): CPU timing says nothing about a GPU, so it is never judged from CPU timing;
* ``needs=("full_model",)``: a full-mode run (not smoke, not the tiny model). The tiny smoke model's FP32 weights,
  gradients and AdamW state are a large part of its peak, so its memory ratios do not carry over to GPT-2 on a
  GPU (and its speed ratios no more): judged from the run's recorded mode and model, never from a global;
* ``needs=("batch_sweep",)`` needs >= 2 batch sizes;
* ``needs=("layers",)`` needs a model of >= :data:`MIN_LAYERS` layers (where the claim can fail);
* ``needs=("same_micro_batch",)`` needs both runs of the pair at the same micro-batch.

An unmet need gives ``not judged``: the reason in one sentence, and what the run did measure beside it, labelled
(e.g. "this run measured 0.79x on CPU"). A value whose noise (``Evidence.spread``) is as large as its effect gives
``not decided (noise +-x %)``.

Several quantities combine (:func:`summarise`): all judged ones hold -> holds; none holds, even partly -> does not
hold; otherwise partly. A quantity that was not measured, not judged or not decided caps a ``holds`` at ``partly``
and the ``why`` says which; no quantity judged -> ``not judged`` (or ``not decided`` / ``not measured``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED = "holds", "partly", "does not hold", "not measured"
NOT_JUDGED, NOT_DECIDED = "not judged", "not decided"
VERDICTS = (HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED, NOT_JUDGED, NOT_DECIDED)
JUDGED = (HOLDS, PARTLY, DOES_NOT_HOLD)
MIN_TIMED_STEPS = 10   # timed steps after warm-up (or repeats) behind a timed comparison
MIN_LAYERS = 8         # depth below which O(sqrt L) cannot fail (at L=2 every segment length is within 0.5-2 sqrt L)
# a step whose GPU kernels fill less than this share of its wall time waits on the host (Python, kernel launches):
# a faster number format shortens only the kernels, so such a run could not show a format's speed-up (the first GPU
# run: GPT-2 small at 8 x 256 on an H200, whose bf16 step kept the GPU busy 43 % of the time)
MIN_GPU_BUSY = 0.8

@dataclass(frozen=True)
class Evidence:
    """What stands behind one measured value: checked against its quantity's ``needs`` before it is judged.

    ``pair``: the two runs compared, e.g. ("fp32, micro-batch 8", "fp16, micro-batch 8") (shown in the table).
    ``hardware``: "cpu" or the GPU's name; None: taken from the entry's conditions.
    ``timed_steps``: timed steps after warm-up (or repeats) behind *each* time of the pair (the smaller one).
    ``spread``: the value's noise, +- in the value's own units (a fraction for "%", a ratio for "x"); see
    :func:`timed_ratio`. ``layers``: the layer count of the model measured. ``sweep``: {batch size: value} when
    the value was measured over a batch sweep (each point is judged). ``micro_batches``: the micro-batch of each
    run of the pair. ``note``: anything more about how it was measured (kept in the entry). ``mode`` and ``model``:
    the run's recorded mode ("full" or "smoke") and model name (None: taken from the entry's conditions).
    ``state_share``: the FP32 weights, gradients and AdamW state as a fraction of the peak the value compares (the
    reason a smoke memory ratio is not judged, shown with it). ``gpu_busy``: for a GPU speed-up, the share of the
    faster run's step that its GPU kernels fill (below :data:`MIN_GPU_BUSY` the host sets the pace: not judged)."""
    pair: tuple[str, str] | None = None
    hardware: str | None = None
    timed_steps: int | None = None
    spread: float | None = None
    layers: int | None = None
    sweep: dict | None = None
    micro_batches: tuple[int, int] | None = None
    note: str | None = None
    mode: str | None = None
    model: str | None = None
    state_share: float | None = None
    gpu_busy: float | None = None  # profiled GPU kernel time over the median step time of the faster run (speed)

    def record(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if v is not None}
        if "pair" in d:
            d["pair"] = list(d["pair"])
        if "sweep" in d:
            d["sweep"] = {str(k): v for k, v in d["sweep"].items()}
        if "micro_batches" in d:
            d["micro_batches"] = list(d["micro_batches"])
        return d


def on_cpu(hardware: str | None) -> bool:
    return hardware is None or str(hardware).lower() in ("cpu", "-", "")


def _need_gpu(q, ev: Evidence) -> str | None:
    if ev.hardware is None:
        return "the run does not say which hardware timed it"
    if on_cpu(ev.hardware):
        return "it was timed on a CPU, and CPU timing says nothing about GPU speed"
    if q.kind == "speed" and ev.gpu_busy is not None and ev.gpu_busy < MIN_GPU_BUSY:
        return (f"its GPU kernels filled only {ev.gpu_busy:.0%} of the step (profiled kernel time over the median "
                f"step time; a speed-up needs >= {MIN_GPU_BUSY:.0%}): the host (Python, kernel launches) set the "
                f"pace, which no number format changes; a larger micro-batch or a slower GPU gives the kernels the "
                f"step")
    return None


def _need_timed_steps(q, ev: Evidence) -> str | None:
    n = ev.timed_steps
    if n is None:
        return "the run does not say how many timed steps stand behind it"
    if n < MIN_TIMED_STEPS:
        return f"only {n} timed step{'s' if n != 1 else ''} per run (a timed comparison needs >= {MIN_TIMED_STEPS} after warm-up)"
    return None


def _need_batch_sweep(q, ev: Evidence) -> str | None:
    n = len(ev.sweep or {})
    return None if n >= 2 else (f"it was measured at {'one batch size' if n == 1 else 'no batch size'}, and the claim "
                                "is judged over the lab's batch sweep (>= 2 batch sizes)")


def _need_layers(q, ev: Evidence) -> str | None:
    if ev.layers is None:
        return "the run does not say how many layers the model has"
    if ev.layers < MIN_LAYERS:
        return (f"the model has {ev.layers} layers, too few for the claim to fail (it is judged on >= {MIN_LAYERS} "
                "layers)")
    return None


def _need_same_micro_batch(q, ev: Evidence) -> str | None:
    mb = ev.micro_batches
    if mb is None:
        return "the run does not say the micro-batch of each run it compares"
    if mb[0] != mb[1]:
        return (f"the two runs use micro-batches {mb[0]} and {mb[1]}, so the difference comes from the micro-batch "
                "size, not from the technique")
    return None


def is_smoke(mode: str | None, model: str | None = None) -> bool:
    """Whether a run is a smoke run, from its recorded mode and model: not "full", or the tiny model."""
    return mode != "full" or str(model or "").startswith("tiny")


def _need_full_model(q, ev: Evidence) -> str | None:
    if (ev.mode is None and ev.model is None) or not is_smoke(ev.mode, ev.model):  # unknown: the bare rule
        return None
    if q.kind == "speed":
        return ("it is a smoke run of the tiny model, whose step is far too small to show GPT-2's speed on a GPU")
    share = (f" ({100 * ev.state_share:.0f} % of the peak here)" if ev.state_share is not None else "")
    return ("it is a smoke run of the tiny model: its FP32 weights, gradients and AdamW state (16 bytes a parameter) "
            f"are a large part of its peak{share}, so a memory ratio does not carry over to GPT-2 on a GPU")


NEEDS = {"gpu": _need_gpu, "full_model": _need_full_model, "timed_steps": _need_timed_steps, "batch_sweep": _need_batch_sweep,
         "layers": _need_layers, "same_micro_batch": _need_same_micro_batch}
SPEED_NEEDS = ("gpu", "timed_steps")


def median_spread(times) -> tuple[float | None, float | None]:
    """The one definition of a timed quantity: (median of ``times``, +- half their inter-quartile range relative
    to that median); (None, None) without times, a spread of None with one."""
    xs = [float(t) for t in times]
    if not xs:
        return None, None
    m = statistics.median(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else None
    return m, ((q[2] - q[0]) / 2 / m if q and m else None)


def timed_ratio(times_a, times_b) -> dict:
    """Median and spread of a timed comparison: ``times_a`` / ``times_b`` (seconds per step, warm-up excluded) of
    the two runs. Returns {"ratio": median(b) / median(a), "spread": +- of that ratio from the two runs' half
    inter-quartile ranges (relative, added), "timed_steps": the fewer of the two counts, "median_a", "median_b"}.
    For an overhead use ``ratio - 1`` (same spread); for a speed-up of b over a use 1 / ratio."""
    a, b = list(times_a), list(times_b)
    if not a or not b:
        return {"ratio": None, "spread": None, "timed_steps": min(len(a), len(b)), "median_a": None, "median_b": None}
    (ma, ra), (mb, rb) = median_spread(a), median_spread(b)
    ratio = mb / ma
    spread = None if ra is None or rb is None else ratio * (ra + rb)
    return {"ratio": ratio, "spread": spread, "timed_steps": min(len(a), len(b)), "median_a": ma, "median_b": mb}


def timed_step_times(result) -> list[float]:
    """The step times a :class:`labutils.train.RunResult` averages into ``step_time_seconds``: its last
    ``timed_steps`` (the training loop leaves out warm-up, compiling and, on CPU, memory-tracked steps, and times
    none when nothing is left: then this is empty, never warm-up). A result without ``timed_steps`` (made by hand,
    older JSON) falls back to leaving out ``timing_warmup_steps``."""
    times = list(result.step_times or [])
    n = getattr(result, "timed_steps", None)
    if n is not None and (n or not times or result.step_time_seconds is None):
        return times[len(times) - n:] if n else []
    warm = (result.config or {}).get("train", {}).get("timing_warmup_steps", 0)
    return times[warm:] if warm < len(times) else []


def hardware(env: dict | None) -> str:
    """The hardware of a run for a claim's conditions: the GPU's name, else "cpu"."""
    env = env or {}
    return env.get("gpu_name") or ("cpu" if env.get("device", "cpu") == "cpu" else str(env.get("device")))


hardware_of = hardware


def run_pair_evidence(base, other, names: tuple[str, str], *, hardware: str | None = None) -> tuple[float | None, Evidence]:
    """``other``'s step time over ``base``'s (medians of their timed steps; an overhead is this minus 1, a
    speed-up its inverse) and the Evidence of that timed comparison: pair, hardware (``hardware`` or the
    runs' env), timed steps, noise (+- of the ratio)."""
    t = timed_ratio(timed_step_times(base), timed_step_times(other))
    hw = hardware or hardware_of(base.env)
    return t["ratio"], Evidence(pair=names, hardware=hw, timed_steps=t["timed_steps"], spread=t["spread"],
                                note="medians of the timed steps after warm-up")


@dataclass(frozen=True)
class Quantity:
    name: str                      # key of the value in ``values``
    label: str                     # "peak-memory saving"
    unit: str                      # "%" (values are fractions: 0.3 = 30 %) or "x" (ratios) or "" (plain numbers)
    better: str                    # "higher" (a benefit), "lower" (a cost) or "within" (a target range)
    claimed: str                   # the design's number, as the design puts it: "~50 %", "2-3x"
    holds_at: float | tuple        # threshold (higher/lower) or (lo, hi) range (within)
    partly_at: float | tuple       # the same for "partly"
    kind: str = "memory"           # "memory", "speed" (timed: needs a GPU and timed steps) or "shape"
    needs: tuple = ()              # more needs from NEEDS (a speed quantity always needs SPEED_NEEDS)

    def all_needs(self) -> tuple:
        return (SPEED_NEEDS if self.kind == "speed" else ()) + tuple(n for n in self.needs if n not in SPEED_NEEDS)

    def requirement(self) -> str:
        """What a run needs before this quantity is judged, in words (shown with the claim's expectations)."""
        words = {"gpu": "a GPU", "full_model": "a full-mode run (not the tiny smoke model)", "timed_steps": f">= {MIN_TIMED_STEPS} timed steps", "batch_sweep":
                 "a batch sweep", "layers": f">= {MIN_LAYERS} layers", "same_micro_batch": "equal micro-batches"}
        return ", ".join(words[n] for n in self.all_needs())

    def unmet(self, ev: Evidence) -> str | None:
        """The first need ``ev`` does not meet, as a clause (None: judge it). Beyond the named needs, a memory saving
        is judged only where it could reach the "partly" bound: when the FP32 weights, gradients and AdamW state
        (``ev.state_share`` of the baseline peak) leave less room than that, no technique that shrinks the rest
        could show the claim (the first GPU run: GPT-2 medium at micro-batch 1, state 92 % of the peak, so
        checkpointing "saved 0 %" by construction)."""
        for n in self.all_needs():
            why = NEEDS[n](self, ev)
            if why:
                return why
        if (self.kind == "memory" and self.better == "higher" and ev.state_share is not None
                and 1 - ev.state_share < self.partly_at):
            return (f"the FP32 weights, gradients and AdamW state are {ev.state_share:.0%} of the baseline peak, so "
                    f"even a technique that removed everything else could save at most {1 - ev.state_share:.0%}, "
                    f"below the {self.fmt(self.partly_at)} that 'partly' needs: this run could not show the claim")
        return None

    def effect(self, v: float) -> float:
        """How far ``v`` is from "no change" in its own units (0 % or 1x): compared with the noise."""
        return abs(v - 1) if self.unit == "x" else abs(v)

    def fmt_spread(self, s: float) -> str:
        return f"+-{100 * s:.0f} %" if self.unit in ("%", "x") else f"+-{s:.3g}"

    def fmt(self, v: float | None) -> str:
        if v is None:
            return "-"
        if self.unit == "%":
            return f"{100 * v:+.0f} %" if self.better != "higher" else f"{100 * v:.0f} %"
        if self.unit == "x":
            return f"{v:.2f}x"
        return f"{v:.3g}"

    def _bound(self, b) -> str:
        return self.fmt(b) if not isinstance(b, tuple) else f"{self.fmt(b[0])} to {self.fmt(b[1])}"

    def rule(self) -> str:
        """"holds at >= 40 %, partly at >= 20 %" and the like."""
        if self.better == "higher":
            return f"holds at >= {self.fmt(self.holds_at)}, partly at >= {self.fmt(self.partly_at)}"
        if self.better == "lower":
            return f"holds at <= {self.fmt(self.holds_at)}, partly at <= {self.fmt(self.partly_at)}"
        return f"holds within {self._bound(self.holds_at)}, partly within {self._bound(self.partly_at)}"

    def judge(self, v: float | None) -> str:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return NOT_MEASURED
        if self.better == "higher":
            return HOLDS if v >= self.holds_at else PARTLY if v >= self.partly_at else DOES_NOT_HOLD
        if self.better == "lower":
            return HOLDS if v <= self.holds_at else PARTLY if v <= self.partly_at else DOES_NOT_HOLD
        (lo, hi), (plo, phi) = self.holds_at, self.partly_at
        return HOLDS if lo <= v <= hi else PARTLY if plo <= v <= phi else DOES_NOT_HOLD

    def explain(self, v: float) -> str:
        """One clause: what was measured against what was claimed, in words that follow the sign."""
        got, claimed = self.fmt(v), self.claimed
        verdict = self.judge(v)
        if self.better == "higher":
            if verdict == HOLDS:
                return f"{self.label} {got}, meets the claimed {claimed}"
            if v <= 0 and self.unit == "%":
                return f"{self.label} {got}: no saving at all (claimed {claimed})"
            if v <= 1 and self.unit == "x":
                return f"{self.label} {got}: no speed-up at all (claimed {claimed})"
            return f"{self.label} {got}, below the claimed {claimed}"
        if self.better == "lower":
            if verdict == HOLDS:
                gain = v < 0
                return (f"{self.label} {got}: a gain, not a cost (claimed {claimed})" if gain else
                        f"{self.label} {got}, within the claimed {claimed}")
            return f"{self.label} {got}, more than the claimed {claimed}"
        return (f"{self.label} {got}, " + ("within" if verdict == HOLDS else "outside") + f" the claimed {claimed}")


def _combine(verdicts: list[str]) -> str:
    kinds = set(verdicts)
    return HOLDS if kinds == {HOLDS} else DOES_NOT_HOLD if kinds == {DOES_NOT_HOLD} else PARTLY


def judge_quantity(q: Quantity, v, ev: Evidence | None) -> tuple[str, str]:
    """(verdict, clause) of one quantity: ``not measured`` without a finite value; with ``ev`` (None: the bare
    threshold rule, no evidence checked), ``not judged`` when a need is unmet, ``not decided`` when the noise is
    as large as the effect; else the threshold rule (at every point of ``ev.sweep`` when there is one)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return NOT_MEASURED, f"{q.label} not measured"
    if ev is not None:
        why = q.unmet(ev)
        if why:
            where = "on CPU" if q.kind == "speed" and on_cpu(ev.hardware) else (
                f"on {ev.hardware}" if ev.hardware and q.kind == "speed" else "")
            return NOT_JUDGED, (f"{q.label} not judged: {why}; this run measured {q.fmt(v)}"
                                + (f" {where}" if where else "") + " (shown, not judged)")
        if ev.spread is not None and ev.spread >= q.effect(v):
            return NOT_DECIDED, (f"{q.label} {q.fmt(v)}: not decided (noise {q.fmt_spread(ev.spread)} is as large "
                                 f"as the effect)")
        if ev.spread and q.judge(v - ev.spread) != q.judge(v + ev.spread):
            # the noise range crosses a verdict's bound: the H200 run's C4 time, +70 % +-30 %, reached from the
            # 'partly' band (<= +60 %) into 'does not hold' and was called 'does not hold'
            return NOT_DECIDED, (f"{q.label} {q.fmt(v)}: not decided (its noise range, {q.fmt(v - ev.spread)} to "
                                 f"{q.fmt(v + ev.spread)}, crosses a bound of the claim: {q.rule()})")
        if ev.sweep:
            # the verdict is that of the value shown; the sweep is listed beside it, as context
            listed = ", ".join(f"{q.fmt(x)} at {b}" for b, x in sorted(ev.sweep.items()))
            return q.judge(v), f"{q.explain(v)} (the value shown; over the batch sweep: {listed})"
    return q.judge(v), q.explain(v)




def evidence_for(quantities, evidence, hw: str | None, mode: str | None = None, model: str | None = None) -> dict:
    """{quantity name: Evidence} from ``evidence`` (None, one Evidence for all, or a dict), the hardware, mode and
    model filled in from the entry's conditions where the evidence does not name them."""
    out = {}
    for q in quantities:
        ev = evidence.get(q.name) if isinstance(evidence, dict) else evidence
        ev = ev or Evidence()
        fill = {k: v for k, v in (("hardware", hw), ("mode", mode), ("model", model)) if getattr(ev, k) is None}
        out[q.name] = replace(ev, **fill) if fill else ev
    return out


def summarise(quantities, parts: dict) -> tuple[str, str]:
    """(verdict, why) of several quantities' ``parts`` ({name: {"verdict", "why"}}): the combining rule of the
    module docstring; the why lists the judged parts first, then the ones that were not (their clause says why)."""
    vs = [p["verdict"] for p in parts.values()]
    judged = [v for v in vs if v in JUDGED]
    measured = [v for v in vs if v != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED, "nothing was measured"
    if judged:
        v = _combine(judged)
        if v == HOLDS and len(judged) < len(vs):
            v = PARTLY
    else:
        v = NOT_DECIDED if all(x == NOT_DECIDED for x in measured) else NOT_JUDGED
    order = sorted(quantities, key=lambda q: (parts[q.name]["verdict"] not in JUDGED,
                                              parts[q.name]["verdict"] == NOT_MEASURED))
    why = "; ".join(parts[q.name]["why"] for q in order)
    return v, why[0].upper() + why[1:]
