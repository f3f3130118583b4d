"""The seven folklore claims of the course's design (C1-C7), and the one rule that turns a run's numbers into a
verdict: ``holds | partly | does not hold | not measured | not judged | not decided``, with a ``why`` computed
from the same numbers as the verdict.

Each claim is data: the design's words, and one or more :class:`Quantity` (what to measure, its unit, which
direction is good, the range the design claims, the thresholds of the verdict, and what a run needs before the
quantity can be judged). The threshold rule is sign-aware:

* a *benefit* (``better="higher"``: a saving, a speed-up) holds at or above ``holds_at``; a larger benefit than
  claimed still holds; between ``partly_at`` and ``holds_at`` it holds partly; below ``partly_at`` (a negative
  saving included) it does not hold;
* a *cost* (``better="lower"``: a time overhead, extra memory) holds at or below ``holds_at``; a smaller cost
  than claimed (or a gain) still holds; up to ``partly_at`` partly; above, it does not hold;
* a *target* (``better="within"``) holds inside ``holds_at=(lo, hi)``, partly inside ``partly_at=(lo, hi)``.

A verdict is only as strong as its evidence. Before the rule is applied, each quantity's :class:`Evidence` (the
pair of runs it compares, the hardware, timed steps and their noise, the model's layer count, the batch sweep)
is checked against the quantity's ``needs`` (:data:`NEEDS`):

* a speed quantity (``kind="speed"``) needs a GPU and >= :data:`MIN_TIMED_STEPS` timed steps after warm-up (or
  repeats): CPU timing says nothing about a GPU, so it is never judged from CPU timing;
* a quantity with ``needs=("batch_sweep",)`` needs >= 2 batch sizes (judged at every point of the sweep);
* ``needs=("layers",)`` needs a model of >= :data:`MIN_LAYERS` layers (where the claim can fail);
* ``needs=("same_micro_batch",)`` needs both runs of the pair at the same micro-batch.

An unmet need gives ``not judged``: the reason in one sentence, and what the run did measure beside it, labelled
(e.g. "this run measured 0.79x on CPU"). A value whose noise (``Evidence.spread``) is as large as its effect gives
``not decided (noise +-x %)``.

Several quantities combine: all judged ones hold -> holds; none holds, even partly -> does not hold; otherwise
partly. A quantity that was not measured, not judged or not decided caps a ``holds`` at ``partly`` and the
``why`` says which; no quantity judged -> ``not judged`` (or ``not decided`` / ``not measured``), always with
the reason and, where the estimator can, its prediction labelled as a prediction.

A lab records ``claims=[claim_entry(...), ...]`` with its results (``lu.record_results(..., claims=...)``);
:func:`collect` builds the whole C1-C7 table from every lab's results. CLAIMS_API.md (not in the repository)
describes the API for the labs' claim builders.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED = "holds", "partly", "does not hold", "not measured"
NOT_JUDGED, NOT_DECIDED = "not judged", "not decided"
VERDICTS = (HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED, NOT_JUDGED, NOT_DECIDED)
JUDGED = (HOLDS, PARTLY, DOES_NOT_HOLD)
MIN_TIMED_STEPS = 10   # timed steps after warm-up (or repeats) behind a timed comparison
MIN_LAYERS = 8         # depth below which O(sqrt L) cannot fail (at L=2 every segment length is within 0.5-2 sqrt L)
SMOKE_LABEL = "smoke measurement (tiny model, few steps, CPU): shows the code runs; not a GPU result"
PREDICTION_LABEL = "prediction of labutils.estimate (arithmetic, not a measurement)"
OWNER = {"C1": "01-Mixed_Precision", "C2": "01-Mixed_Precision", "C3": "02-Gradient_Accumulation",
         "C4": "03-Gradient_Checkpointing", "C5": "03-Gradient_Checkpointing", "C6": "04-Memory_Profiling",
         "C7": "04-Memory_Profiling"}


@dataclass(frozen=True)
class Evidence:
    """What stands behind one measured value: checked against its quantity's ``needs`` before it is judged.

    ``pair``: the two runs compared, e.g. ("fp32, micro-batch 8", "fp16, micro-batch 8") (shown in the table).
    ``hardware``: "cpu" or the GPU's name; None: taken from the entry's conditions.
    ``timed_steps``: timed steps after warm-up (or repeats) behind *each* time of the pair (the smaller one).
    ``spread``: the value's noise, +- in the value's own units (a fraction for "%", a ratio for "x"); see
    :func:`timed_ratio`. ``layers``: the layer count of the model measured. ``sweep``: {batch size: value} when
    the value was measured over a batch sweep (each point is judged). ``micro_batches``: the micro-batch of each
    run of the pair. ``note``: anything more about how it was measured (kept in the entry)."""
    pair: tuple[str, str] | None = None
    hardware: str | None = None
    timed_steps: int | None = None
    spread: float | None = None
    layers: int | None = None
    sweep: dict | None = None
    micro_batches: tuple[int, int] | None = None
    note: str | None = None

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


NEEDS = {"gpu": _need_gpu, "timed_steps": _need_timed_steps, "batch_sweep": _need_batch_sweep,
         "layers": _need_layers, "same_micro_batch": _need_same_micro_batch}
SPEED_NEEDS = ("gpu", "timed_steps")


def timed_ratio(times_a, times_b) -> dict:
    """Median and spread of a timed comparison: ``times_a`` / ``times_b`` (seconds per step, warm-up excluded) of
    the two runs. Returns {"ratio": median(b) / median(a), "spread": +- of that ratio from the two runs' half
    inter-quartile ranges (relative, added), "timed_steps": the fewer of the two counts, "median_a", "median_b"}.
    For an overhead use ``ratio - 1`` (same spread); for a speed-up of b over a use 1 / ratio."""
    a, b = [float(t) for t in times_a], [float(t) for t in times_b]
    if not a or not b:
        return {"ratio": None, "spread": None, "timed_steps": min(len(a), len(b)), "median_a": None, "median_b": None}

    def rel_half_iqr(xs):
        if len(xs) < 2:
            return None
        q = statistics.quantiles(xs, n=4, method="inclusive")
        return (q[2] - q[0]) / 2 / statistics.median(xs)

    ma, mb = statistics.median(a), statistics.median(b)
    ra, rb = rel_half_iqr(a), rel_half_iqr(b)
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
        words = {"gpu": "a GPU", "timed_steps": f">= {MIN_TIMED_STEPS} timed steps", "batch_sweep":
                 "a batch sweep", "layers": f">= {MIN_LAYERS} layers", "same_micro_batch": "equal micro-batches"}
        return ", ".join(words[n] for n in self.all_needs())

    def unmet(self, ev: Evidence) -> str | None:
        """The first need ``ev`` does not meet, as a clause (None: judge it)."""
        for n in self.all_needs():
            why = NEEDS[n](self, ev)
            if why:
                return why
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


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str                     # the design's words (Traditional Chinese) and an English gloss
    source: str                    # where in ../shared/seeds the claim is made
    quantities: tuple[Quantity, ...]

    def expected(self) -> str:
        return "; ".join(f"{q.label} {q.claimed} ({q.rule()}" + (f"; judged only with {q.requirement()}"
                                                                  if q.all_needs() else "") + ")"
                         for q in self.quantities)

    def expected_ranges(self) -> dict:
        return {q.name: {"claimed": q.claimed, "unit": q.unit, "better": q.better, "kind": q.kind,
                         "needs": list(q.all_needs()), "holds_at": q.holds_at, "partly_at": q.partly_at}
                for q in self.quantities}


CLAIMS: dict[str, Claim] = {c.id: c for c in (
    Claim("C1", "混合精度：記憶體減少 ~50% (mixed precision / FP16 saves ~50 % of the memory)",
          "000 README, 核心技術概覽 1 and the lab 1 table (FP32 ~8 GB -> FP16 ~4.5 GB)",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "~50 %", 0.40, 0.20,
                    needs=("batch_sweep",)),)),
    Claim("C2", "混合精度：速度提升 2-3x (AMP trains 2-3x faster)",
          "000 README, 核心技術概覽 1 and the lab 1 table (FP16 2.2x, BF16 2.1x)",
          (Quantity("speedup", "speed-up", "x", "higher", "2-3x", 2.0, 1.5, kind="speed"),)),
    Claim("C3", "梯度累積：記憶體 0%，速度 -5% (accumulation costs no memory and ~5 % of the time)",
          "000 README, 單一技術效果 table; 002 notebook: 慢 5-10%",
          (Quantity("memory_increase", "extra peak memory", "%", "lower", "0 %", 0.05, 0.20),
           Quantity("time_cost", "throughput cost", "%", "lower", "~5 % (5-10 %)", 0.10, 0.20, kind="speed",
                    needs=("same_micro_batch",)))),
    Claim("C4", "梯度檢查點：記憶體節省 30-50% (~12 GB -> ~7 GB)，代價 20-30% 時間 "
                "(checkpointing saves 30-50 % of the memory for +20-30 % time)",
          "000 README, lab 3 table and 單一技術效果 table",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "30-50 %", 0.30, 0.15),
           Quantity("time_overhead", "step-time overhead", "%", "lower", "+20-30 %", 0.30, 0.60, kind="speed"))),
    Claim("C5", "梯度檢查點：記憶體從 O(L) 降至 O(√L) (activation memory drops from O(L) to O(sqrt L))",
          "000 README, 核心技術概覽 3",
          (Quantity("chain_optimum_over_sqrt_L", "best segment / sqrt(L), chain of equal layers", "x", "within",
                    "1 (segments of sqrt L)", (0.5, 2.0), (0.25, 4.0), kind="shape", needs=("layers",)),
           Quantity("gpt2_optimum_over_sqrt_L", "best segment / sqrt(L), GPT-2 blocks", "x", "within",
                    "1 (segments of sqrt L)", (0.5, 2.0), (0.25, 4.0), kind="shape", needs=("layers",)))),
    Claim("C6", "三者組合：記憶體節省 ~65-70%，速度持平或略慢 10-15% "
                "(mixed precision + accumulation + checkpointing: -65-70 % memory, 10-15 % slower at most)",
          "000 README, 組合優化效果",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "65-70 %", 0.65, 0.325),
           Quantity("slowdown", "slowdown", "%", "lower", "0-15 %", 0.15, 0.30, kind="speed"))),
    Claim("C7", "單 GPU 上 DeepSpeed ZeRO-2 + CPU offload：節省 20-30% GPU 記憶體 "
                "(ZeRO-2 + CPU offload on one GPU saves 20-30 % of GPU memory)",
          "003 Lab-1.3 README, 實驗 1",
          (Quantity("memory_saving", "GPU peak-memory saving", "%", "higher", "20-30 %", 0.20, 0.10),)),
)}
SPEED_QUANTITIES = {(c.id, q.name) for c in CLAIMS.values() for q in c.quantities if q.kind == "speed"}


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
        if ev.sweep:
            points = sorted(ev.sweep.items())
            verdicts = [q.judge(x) for _, x in points]
            got = _combine(verdicts)
            listed = ", ".join(f"{q.fmt(x)} at {b}" for b, x in points)
            word = {HOLDS: f"meets the claimed {q.claimed} at every batch size",
                    PARTLY: f"meets the claimed {q.claimed} only in part",
                    DOES_NOT_HOLD: f"falls short of the claimed {q.claimed} at every batch size"}[got]
            return got, f"{q.label} over batch sizes {', '.join(str(b) for b, _ in points)}: {listed}; {word}"
    return q.judge(v), q.explain(v)


def _evidence_for(claim: Claim, evidence, hw: str | None) -> dict:
    """{quantity name: Evidence} from ``evidence`` (None, one Evidence for all, or a dict), the hardware filled in
    from the conditions where the evidence does not name it."""
    out = {}
    for q in claim.quantities:
        ev = evidence.get(q.name) if isinstance(evidence, dict) else evidence
        ev = ev or Evidence()
        out[q.name] = ev if ev.hardware is not None else replace(ev, hardware=hw)
    return out


def judge(claim_id: str, values: dict, evidence=None, *, hardware: str | None = None) -> tuple[str, str, dict]:
    """(verdict, why, parts) with the evidence checked: ``evidence`` is one :class:`Evidence` for every quantity
    or {quantity name: Evidence}; the hardware defaults to ``hardware`` (the conditions'). ``parts``: {quantity
    name: {"verdict", "why"}}. The rule of the module docstring."""
    claim = CLAIMS[claim_id]
    evs = _evidence_for(claim, evidence, hardware)
    parts = {}
    for q in claim.quantities:
        j, clause = judge_quantity(q, values.get(q.name), evs[q.name])
        parts[q.name] = {"verdict": j, "why": clause}
    return (*_summarise(claim, parts), parts)


def _summarise(claim: Claim, parts: dict) -> tuple[str, str]:
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
    # judged parts first, then the ones that were not (their clause says why)
    order = sorted(claim.quantities, key=lambda q: (parts[q.name]["verdict"] not in JUDGED,
                                                    parts[q.name]["verdict"] == NOT_MEASURED))
    why = "; ".join(parts[q.name]["why"] for q in order)
    return v, why[0].upper() + why[1:]


def verdict(claim_id: str, values: dict, evidence=None, *, hardware: str | None = None) -> tuple[str, str]:
    """(verdict, why) for ``values`` ({quantity name: number or None}). Without ``evidence`` and ``hardware``
    this is the bare threshold rule (what the numbers would mean *if* the run could support them); a recorded
    entry (:func:`claim_entry`) always checks the evidence."""
    if evidence is None and hardware is None:
        claim = CLAIMS[claim_id]
        parts = {q.name: dict(zip(("verdict", "why"), judge_quantity(q, values.get(q.name), None)))
                 for q in claim.quantities}
        return _summarise(claim, parts)
    return judge(claim_id, values, evidence, hardware=hardware)[:2]


def _measured(claim: Claim, values: dict, parts: dict | None = None) -> dict:
    out = {}
    for q in claim.quantities:
        if values.get(q.name) is None:
            continue
        item = {"value": values.get(q.name), "unit": q.unit, "text": q.fmt(values.get(q.name)), "label": q.label}
        if parts and parts[q.name]["verdict"] in (NOT_JUDGED, NOT_DECIDED):
            item["judged"] = parts[q.name]["verdict"]
        out[q.name] = item
    return out


def conditions(*, model: str | None, batch: str | None, sequence: int | None, precision: str | None,
               hardware: str | None, mode: str, **extra) -> dict:
    """The conditions a claim entry was measured under (anything extra is kept, e.g. budget="8 GiB")."""
    return {"model": model, "batch": batch, "sequence": sequence, "precision": precision,
            "hardware": hardware, "mode": mode, **extra}


def hardware(env: dict | None) -> str:
    """The hardware of a run for a claim's conditions: the GPU's name, else "cpu"."""
    env = env or {}
    return env.get("gpu_name") or ("cpu" if env.get("device", "cpu") == "cpu" else str(env.get("device")))


hardware_of = hardware


def claim_entry(claim_id: str, values: dict | None, cond: dict, *, reason: str | None = None,
                not_measured: str | None = None, prediction: dict | None = None, lab: str | None = None,
                extra: dict | None = None, prediction_for: str | None = None, evidence=None) -> dict:
    """One ``claims`` entry: id, claim, expected, measured (values with units), verdict, why, conditions, parts
    (each quantity's own verdict and clause), compares (each quantity's pair of runs), evidence.

    ``values``: {quantity: number}; None or empty with ``not_measured`` (why not) gives ``not measured``.
    ``evidence``: one :class:`Evidence` for all quantities or {quantity: Evidence}; its hardware defaults to
    ``cond["hardware"]``. Without evidence a speed quantity is ``not judged`` (no timed steps recorded).
    ``reason``: a clause the lab computed from the same numbers (e.g. which memory term did not shrink),
    appended to the why; the lab must not let it contradict the verdict (see :func:`judged_words`).
    ``prediction``: {quantity: number} from the estimator, recorded and labelled as a prediction, never as a
    measurement. ``extra``: more measured context (e.g. the largest batch each setup fits).
    In smoke mode (``cond["mode"] != "full"``) the measurement is labelled a smoke measurement.
    """
    claim = CLAIMS[claim_id]
    values = {k: v for k, v in (values or {}).items() if v is not None}
    evs = _evidence_for(claim, evidence, cond.get("hardware"))
    v, why, parts = judge(claim_id, values, evs)
    if v == NOT_MEASURED:
        why = f"Not measured: {not_measured or 'this run produced none of the numbers it needs'}"
    elif reason:
        why = f"{why}: {reason}"
    if v == NOT_MEASURED and prediction:
        pv, pwhy = verdict(claim_id, prediction)
        why += (f". The estimator predicts{f' (for {prediction_for})' if prediction_for else ''} "
                f"{_plain(claim, prediction)}, which would make it "
                f"'{pv}' (a prediction, not a measurement)")
    smoke = cond.get("mode") != "full"
    if smoke and v != NOT_MEASURED:
        why += " [smoke measurement: tiny model on CPU, not a GPU result]"
    entry = {"id": claim_id, "claim": claim.claim, "source": claim.source, "expected": claim.expected(),
             "expected_ranges": claim.expected_ranges(),
             "measured": _measured(claim, values, parts) or None,
             "measurement": (None if v == NOT_MEASURED else SMOKE_LABEL if smoke else
                             f"measured on {cond.get('hardware')}"),
             "verdict": v, "why": why + ("" if why.endswith(".") else "."), "conditions": dict(cond),
             "parts": parts if values else {},
             "compares": {k: " vs ".join(e.pair) for k, e in evs.items() if e.pair and k in values},
             "evidence": {k: e.record() for k, e in evs.items() if k in values},
             "lab": lab or OWNER[claim_id]}
    if prediction:
        entry["prediction"] = {"label": PREDICTION_LABEL, "for": prediction_for, **_measured(claim, prediction)}
    if extra:
        entry["extra"] = extra
    return entry


def judged_words(entry: dict, name: str) -> str:
    """The verdict of one quantity of a recorded entry ("holds", "not judged", ...): for a lab's reason clause
    that must agree with the verdict (e.g. C5's "the best segment is / is not sqrt(L)")."""
    return (entry.get("parts") or {}).get(name, {}).get("verdict", NOT_MEASURED)


def _plain(claim: Claim, values: dict) -> str:
    return ", ".join(f"{q.label} {q.fmt(values[q.name])}" for q in claim.quantities if values.get(q.name) is not None)


def not_measured(claim_id: str, why: str, cond: dict, *, prediction: dict | None = None, lab: str | None = None,
                 prediction_for: str | None = None) -> dict:
    """A ``not measured`` entry: always says why; ``prediction`` (from the estimator, for the setup named in
    ``prediction_for``) is labelled as one."""
    return claim_entry(claim_id, None, cond, not_measured=why, prediction=prediction, lab=lab,
                       prediction_for=prediction_for)


def not_judged(claim_id: str, why: str, cond: dict, values: dict | None = None, *, lab: str | None = None,
               evidence=None, extra: dict | None = None) -> dict:
    """A ``not judged`` entry whatever the numbers: ``why`` (one sentence: what the run lacks) and what the run
    did measure (``values``, shown labelled, not judged). For a claim the lab knows it cannot judge here."""
    e = claim_entry(claim_id, values, cond, lab=lab, evidence=evidence, extra=extra)
    claim = CLAIMS[claim_id]
    shown = _plain(claim, {k: v for k, v in (values or {}).items() if v is not None})
    e["verdict"] = NOT_JUDGED
    e["parts"] = {q.name: {"verdict": NOT_JUDGED if q.name in (values or {}) else NOT_MEASURED, "why": why}
                  for q in claim.quantities}
    for item in (e["measured"] or {}).values():
        item["judged"] = NOT_JUDGED
    smoke = cond.get("mode") != "full"
    e["why"] = (f"Not judged: {why.rstrip('.')}" + (f"; this run measured {shown} (shown, not judged)" if shown else "")
                + (" [smoke measurement: tiny model on CPU, not a GPU result]" if smoke and shown else "") + ".")
    return e


# ------------------------------------------------------------------------------------------ the whole C1-C7 table
_RANK = {HOLDS: 0, PARTLY: 0, DOES_NOT_HOLD: 0, NOT_DECIDED: 1, NOT_JUDGED: 2, NOT_MEASURED: 3}


def collect(results: dict[str, dict], fallback: list[dict] | None = None) -> list[dict]:
    """C1-C7, one entry each: the first judged entry from the lab that owns the claim, else ``fallback``
    (entries computed elsewhere, e.g. lab 04), else any other lab; failing a judged one, the first ``not
    decided``, then ``not judged``, then ``not measured`` entry in that order; else a ``not measured`` entry
    saying no lab recorded it. ``results``: {anything: results JSON}.
    """
    by_lab: dict[str, dict[str, dict]] = {}
    for data in results.values():
        for e in data.get("claims") or []:
            by_lab.setdefault(data.get("notebook") or e.get("lab"), {})[e["id"]] = e
    fb = {e["id"]: e for e in fallback or []}
    table = []
    for cid in CLAIMS:
        own = by_lab.get(OWNER[cid], {}).get(cid)
        others = [lab_claims[cid] for lab, lab_claims in sorted(by_lab.items())
                  if lab != OWNER[cid] and cid in lab_claims]
        candidates = [e for e in (own, fb.get(cid), *others) if e]
        pick = min(candidates, key=lambda e: _RANK.get(e["verdict"], 3)) if candidates else None
        if pick is None:
            pick = not_measured(cid, f"no lab recorded it (it belongs to {OWNER[cid]}, whose results are not here)",
                                conditions(model=None, batch=None, sequence=None, precision=None, hardware=None,
                                           mode="-"))
        table.append(pick)
    return table


def table_rows(entries: list[dict]) -> list[dict]:
    """Flat rows for a Markdown table: id, verdict, measured (a value not judged is labelled so), compares (the
    pair of runs behind each value), why, conditions, lab."""
    rows = []
    for e in entries:
        m = e.get("measured") or {}
        c = e.get("conditions") or {}
        hw = "CPU" if on_cpu(c.get("hardware")) else c.get("hardware")
        measured = ", ".join(f"{x['label']} {x['text']}" + (f" ({hw} timing, {x['judged']})" if x.get("judged") ==
                                                             NOT_JUDGED and (e["id"], k) in SPEED_QUANTITIES else
                                                             f" ({x['judged']})" if x.get("judged") else "")
                             for k, x in m.items()) or "-"
        if e.get("measurement", "") and e["measurement"].startswith("smoke"):
            measured = f"{measured} (smoke)"
        if not m and e.get("prediction"):
            p = {k: v for k, v in e["prediction"].items() if isinstance(v, dict)}
            measured = "prediction: " + ", ".join(f"{x['label']} {x['text']}" for x in p.values())
        compares = "; ".join(e.get("compares", {}).values()) or "-"
        layers = c.get("layers")
        if isinstance(layers, dict):
            layers = "; ".join(f"{n}: {v} layers" for n, v in layers.items())
        cond = ", ".join(str(x) for x in (c.get("model"), layers, *(c.get(k) for k in ("batch", "sequence",
                                                                                        "precision", "hardware")))
                         if x)
        rows.append({"claim": e["id"], "design says": e["claim"], "verdict": e["verdict"], "measured": measured,
                     "compares": compares, "why": e["why"], "conditions": cond or "-", "lab": e.get("lab")})
    return rows


# ------------------------------------------------------------------------------------------ C7 without DeepSpeed
def zero2_offload_prediction(cfg, precision: str = "fp16") -> dict:
    """C7's estimator prediction for ``cfg`` on one GPU: model state per GPU under plain mixed-precision training
    (2P fp16 weights + 2P grads + 12P AdamW/master, ZeRO stage 0) vs ZeRO-2 with the optimizer offloaded to the
    CPU (2P + 2P on the GPU), plus one micro-batch's activations (which neither touches), from
    :func:`labutils.distributed.zero_bytes_per_gpu` and :func:`labutils.estimate.estimate_memory`.

    Returns {"memory_saving": fraction, "plain_bytes": ..., "zero2_offload_bytes": ...}: a prediction.
    """
    from .distributed import zero_bytes_per_gpu
    from .estimate import estimate_memory

    est = estimate_memory(cfg, precision=precision)
    acts = est["activations_bytes"]
    plain = zero_bytes_per_gpu(est["parameters"], 0, 1, False, True)["total"] + acts
    offload = zero_bytes_per_gpu(est["parameters"], 2, 1, True, True)["total"] + acts
    return {"memory_saving": 1 - offload / plain, "plain_bytes": plain, "zero2_offload_bytes": offload}


# ------------------------------------------------------------------------------------------ C7 with DeepSpeed
ZERO2_OFFLOAD_ACCELERATE = "configs/accelerate/deepspeed_zero2_offload.yaml"


def zero2_offload_unavailable() -> str | None:
    """Why C7 cannot be measured here (DeepSpeed on a CUDA GPU is needed), or None when it can."""
    import importlib.util

    from . import device as dev

    missing = [p for p in ("deepspeed", "accelerate") if importlib.util.find_spec(p) is None]
    if not dev.cuda_available():
        return "it needs DeepSpeed on a CUDA GPU, and this machine has no CUDA GPU"
    if missing:
        return (f"it needs DeepSpeed on a CUDA GPU, and {' and '.join(missing)} is not installed "
                "(pip install -e '.[deepspeed]', which needs a CUDA toolkit)")
    return None


def measure_zero2_offload(config: str, overrides: list[str], workdir, *, timeout: int = 1800) -> dict:
    """C7 on one GPU: the same config and batch trained twice in subprocesses, plainly (``python -m labutils
    run``) and under DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (``accelerate launch`` with
    :data:`ZERO2_OFFLOAD_ACCELERATE`). Returns {"plain": run record, "zero2_offload": run record} (the
    ``--json`` records, with ``peak_memory_bytes``) or {"error": why}. Call only when
    :func:`zero2_offload_unavailable` is None."""
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
