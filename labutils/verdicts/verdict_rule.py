"""The one rule that turns a run's numbers into a verdict: ``holds | partly | does not hold | not measured | not judged
| not decided``, with a ``why`` computed from the same numbers (the claims C1-C7 are in
:mod:`labutils.verdicts.claims`). A claim is one or more :class:`Quantity`, judged by sign-aware thresholds
(:meth:`Quantity.judge`) once its :class:`Evidence` meets its :data:`NEEDS` (else ``not judged``, the value shown beside
the reason) and its noise cannot change the verdict (else ``not decided``); :func:`summarise` combines them."""
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
# below this share of the step filled by GPU kernels the host sets the pace: no number format can speed it up
MIN_GPU_BUSY = 0.8

@dataclass(frozen=True)
class Evidence:
    """What stands behind one measured value: checked against its quantity's ``needs`` before it is judged."""
    pair: tuple[str, str] | None = None         # the two runs compared, e.g. ("fp32, micro-batch 8", "fp16, ...")
    hardware: str | None = None                 # "cpu" or the GPU's name; None: from the entry's conditions
    timed_steps: int | None = None              # timed steps after warm-up behind each time of the pair (the fewer)
    spread: float | None = None                 # noise, +- in the value's units (a fraction for "%", a ratio for "x")
    layers: int | None = None                   # the layer count of the model measured
    sweep: dict | None = None                   # {batch size: value} when measured over a batch sweep
    micro_batches: tuple[int, int] | None = None  # the micro-batch of each run of the pair
    note: str | None = None                     # anything more about how it was measured
    mode: str | None = None                     # the run's recorded mode ("full" or "smoke"); None: from conditions
    model: str | None = None                    # the run's model name; None: from the entry's conditions
    state_share: float | None = None            # FP32 weights, grads and AdamW state over the peak compared
    gpu_busy: float | None = None               # GPU kernel time over the faster run's median step time (speed)

    def record(self) -> dict:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items() if v is not None}
        if "sweep" in d:
            d["sweep"] = {str(k): v for k, v in d["sweep"].items()}
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
        return (f"only {n} timed step{'s' if n != 1 else ''} per run (a timed comparison needs >= {MIN_TIMED_STEPS} "
                "after warm-up)")
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


def _need_full_model(q, ev: Evidence) -> str | None:
    smoke = ev.mode != "full" or str(ev.model or "").startswith("tiny")  # from the run's recorded mode and model
    if (ev.mode is None and ev.model is None) or not smoke:  # unknown: the bare rule
        return None
    if q.kind == "speed":
        return ("it is a smoke run of the tiny model, whose step is far too small to show GPT-2's speed on a GPU")
    share = (f" ({100 * ev.state_share:.0f} % of the peak here)" if ev.state_share is not None else "")
    return ("it is a smoke run of the tiny model: its FP32 weights, gradients and AdamW state (16 bytes a parameter) "
            f"are a large part of its peak{share}, so a memory ratio does not carry over to GPT-2 on a GPU")


NEEDS = {"gpu": _need_gpu, "full_model": _need_full_model, "timed_steps": _need_timed_steps,
         "batch_sweep": _need_batch_sweep, "layers": _need_layers, "same_micro_batch": _need_same_micro_batch}
SPEED_NEEDS = ("gpu", "timed_steps")


def median_spread(times) -> tuple[float | None, float | None]:
    """The one definition of a timed quantity: (median of ``times``, +- half their inter-quartile range relative to that
    median); (None, None) without times, a spread of None with one."""
    xs = [float(t) for t in times]
    if not xs:
        return None, None
    m = statistics.median(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else None
    return m, ((q[2] - q[0]) / 2 / m if q and m else None)


def timed_ratio(times_a, times_b) -> dict:
    """Median and spread of a timed comparison of two runs' step times: {"ratio": median(b) / median(a), "spread" (the
    runs' relative half inter-quartile ranges, added), "timed_steps" (the fewer), "median_a", "median_b"}."""
    a, b = list(times_a), list(times_b)
    if not a or not b:
        return {"ratio": None, "spread": None, "timed_steps": min(len(a), len(b)), "median_a": None, "median_b": None}
    (ma, ra), (mb, rb) = median_spread(a), median_spread(b)
    ratio = mb / ma
    spread = None if ra is None or rb is None else ratio * (ra + rb)
    return {"ratio": ratio, "spread": spread, "timed_steps": min(len(a), len(b)), "median_a": ma, "median_b": mb}


def timed_step_times(result) -> list[float]:
    """The step times a RunResult averages into ``step_time_seconds``: its last ``timed_steps`` (empty when none was
    timed); without ``timed_steps``, all but the warm-up."""
    times = list(result.step_times or [])
    n = getattr(result, "timed_steps", None)
    if n is not None and (n or not times or result.step_time_seconds is None):
        return times[len(times) - n:] if n else []
    warm = (result.config or {}).get("train", {}).get("timing_warmup_steps", 0)
    return times[warm:] if warm < len(times) else []


def hardware(env: dict | None) -> str:
    """A run's hardware (its env or ``lu.setup()``'s info) for a claim's conditions: the GPU's name, else the device."""
    env = env or {}
    return env.get("gpu_name") or str(env.get("device") or "cpu")


def run_pair_evidence(base, other, names: tuple[str, str], *, hw: str | None = None) -> tuple[float | None, Evidence]:
    """``other``'s step time over ``base``'s (:func:`timed_ratio` of their timed steps) and the Evidence of that
    timed comparison: pair, hardware (``hw`` or the runs' env), timed steps, noise (+- of the ratio)."""
    t = timed_ratio(timed_step_times(base), timed_step_times(other))
    return t["ratio"], Evidence(pair=names, hardware=hw or hardware(base.env), timed_steps=t["timed_steps"],
                                spread=t["spread"], note="medians of the timed steps after warm-up")


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
        words = {"gpu": "a GPU", "full_model": "a full-mode run (not the tiny smoke model)",
                 "timed_steps": f">= {MIN_TIMED_STEPS} timed steps", "batch_sweep": "a batch sweep",
                 "layers": f">= {MIN_LAYERS} layers", "same_micro_batch": "equal micro-batches"}
        return ", ".join(words[n] for n in self.all_needs())

    def unmet(self, ev: Evidence) -> str | None:
        """The first need ``ev`` does not meet, as a clause (None: judge it). A memory saving is also judged only where
        the FP32 weights, gradients and AdamW state (``ev.state_share`` of the peak) leave room for its "partly"."""
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

    def fmt(self, v: float | None) -> str:
        if v is None:
            return "-"
        if self.unit == "%":
            return f"{100 * v:+.0f} %" if self.better != "higher" else f"{100 * v:.0f} %"
        if self.unit == "x":
            return f"{v:.2f}x"
        return f"{v:.3g}"

    def shown(self, v: float, ev: Evidence) -> str:
        """The value, a speed with where it was timed: "-45 % on CPU"."""
        return self.fmt(v) + ("" if self.kind != "speed" else f" on {'CPU' if on_cpu(ev.hardware) else ev.hardware}")

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
                return (f"{self.label} {got}: a gain, not a cost (claimed {claimed})" if v < 0 else
                        f"{self.label} {got}, within the claimed {claimed}")
            return f"{self.label} {got}, more than the claimed {claimed}"
        return (f"{self.label} {got}, " + ("within" if verdict == HOLDS else "outside") + f" the claimed {claimed}")


def judge_quantity(q: Quantity, v, ev: Evidence | None) -> tuple[str, str]:
    """(verdict, clause) of one quantity: ``not measured`` without a finite value; with ``ev`` (None: the bare rule),
    ``not judged`` when a need is unmet, ``not decided`` when the noise could change the verdict; else the rule."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return NOT_MEASURED, f"{q.label} not measured"
    if ev is not None:
        why = q.unmet(ev)
        if why:
            return NOT_JUDGED, f"{q.label} not judged: {why}; this run measured {q.shown(v, ev)} (shown, not judged)"
        effect = abs(v - 1) if q.unit == "x" else abs(v)  # how far from "no change" (0 % or 1x)
        if ev.spread is not None and ev.spread >= effect:
            noise = f"+-{100 * ev.spread:.0f} %" if q.unit in ("%", "x") else f"+-{ev.spread:.3g}"
            return NOT_DECIDED, f"{q.label} {q.fmt(v)}: not decided (noise {noise} is as large as the effect)"
        if ev.spread and q.judge(v - ev.spread) != q.judge(v + ev.spread):  # the noise range crosses a bound
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
    if judged:  # holds only when every quantity was judged and holds
        kinds = set(judged)
        v = (HOLDS if kinds == {HOLDS} and len(judged) == len(vs) else
             DOES_NOT_HOLD if kinds == {DOES_NOT_HOLD} else PARTLY)
    else:
        v = NOT_DECIDED if all(x == NOT_DECIDED for x in measured) else NOT_JUDGED
    order = sorted(quantities, key=lambda q: (parts[q.name]["verdict"] not in JUDGED,
                                              parts[q.name]["verdict"] == NOT_MEASURED))
    why = "; ".join(parts[q.name]["why"] for q in order)
    return v, why[0].upper() + why[1:]
