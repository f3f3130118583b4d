"""The seven folklore claims of the course's design (C1-C7), and the one rule that turns a run's numbers into a
verdict: ``holds | partly | does not hold | not measured``, with a one-sentence ``why`` computed from the numbers.

Each claim is data: the design's words, and one or more :class:`Quantity` (what to measure, its unit, which
direction is good, the range the design claims, and the thresholds of the verdict). The rule is sign-aware:

* a *benefit* (``better="higher"``: a saving, a speed-up) holds at or above ``holds_at``; a larger benefit than
  claimed still holds; between ``partly_at`` and ``holds_at`` it holds partly; below ``partly_at`` (a negative
  saving included) it does not hold;
* a *cost* (``better="lower"``: a time overhead, extra memory) holds at or below ``holds_at``; a smaller cost
  than claimed (or a gain) still holds; up to ``partly_at`` partly; above, it does not hold;
* a *target* (``better="within"``) holds inside ``holds_at=(lo, hi)``, partly inside ``partly_at=(lo, hi)``.

Several quantities combine: all hold -> holds; none holds, even partly -> does not hold; otherwise partly. A
quantity that was not measured caps the verdict at ``partly`` and the ``why`` says which; nothing measured ->
``not measured``, always with the reason and, where the estimator can, its prediction labelled as a prediction.

A lab records ``claims=[claim_entry(...), ...]`` with its results (``lu.record_results(..., claims=...)``);
:func:`collect` builds the whole C1-C7 table from every lab's results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED = "holds", "partly", "does not hold", "not measured"
VERDICTS = (HOLDS, PARTLY, DOES_NOT_HOLD, NOT_MEASURED)
SMOKE_LABEL = "smoke measurement (tiny model, few steps, CPU): shows the code runs; not a GPU result"
PREDICTION_LABEL = "prediction of labutils.estimate (arithmetic, not a measurement)"
OWNER = {"C1": "01-Mixed_Precision", "C2": "01-Mixed_Precision", "C3": "02-Gradient_Accumulation",
         "C4": "03-Gradient_Checkpointing", "C5": "03-Gradient_Checkpointing", "C6": "04-Memory_Profiling",
         "C7": "04-Memory_Profiling"}


@dataclass(frozen=True)
class Quantity:
    name: str                      # key of the value in ``values``
    label: str                     # "peak-memory saving"
    unit: str                      # "%" (values are fractions: 0.3 = 30 %) or "x" (ratios) or "" (plain numbers)
    better: str                    # "higher" (a benefit), "lower" (a cost) or "within" (a target range)
    claimed: str                   # the design's number, as the design puts it: "~50 %", "2-3x"
    holds_at: float | tuple        # threshold (higher/lower) or (lo, hi) range (within)
    partly_at: float | tuple       # the same for "partly"

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
        return "; ".join(f"{q.label} {q.claimed} ({q.rule()})" for q in self.quantities)

    def expected_ranges(self) -> dict:
        return {q.name: {"claimed": q.claimed, "unit": q.unit, "better": q.better,
                         "holds_at": q.holds_at, "partly_at": q.partly_at} for q in self.quantities}


CLAIMS: dict[str, Claim] = {c.id: c for c in (
    Claim("C1", "混合精度：記憶體減少 ~50% (mixed precision / FP16 saves ~50 % of the memory)",
          "000 README, 核心技術概覽 1 and the lab 1 table (FP32 ~8 GB -> FP16 ~4.5 GB)",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "~50 %", 0.40, 0.20),)),
    Claim("C2", "混合精度：速度提升 2-3x (AMP trains 2-3x faster)",
          "000 README, 核心技術概覽 1 and the lab 1 table (FP16 2.2x, BF16 2.1x)",
          (Quantity("speedup", "speed-up", "x", "higher", "2-3x", 2.0, 1.5),)),
    Claim("C3", "梯度累積：記憶體 0%，速度 -5% (accumulation costs no memory and ~5 % of the time)",
          "000 README, 單一技術效果 table; 002 notebook: 慢 5-10%",
          (Quantity("memory_increase", "extra peak memory", "%", "lower", "0 %", 0.05, 0.20),
           Quantity("time_cost", "throughput cost", "%", "lower", "~5 % (5-10 %)", 0.10, 0.20))),
    Claim("C4", "梯度檢查點：記憶體節省 30-50% (~12 GB -> ~7 GB)，代價 20-30% 時間 "
                "(checkpointing saves 30-50 % of the memory for +20-30 % time)",
          "000 README, lab 3 table and 單一技術效果 table",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "30-50 %", 0.30, 0.15),
           Quantity("time_overhead", "step-time overhead", "%", "lower", "+20-30 %", 0.30, 0.60))),
    Claim("C5", "梯度檢查點：記憶體從 O(L) 降至 O(√L) (activation memory drops from O(L) to O(sqrt L))",
          "000 README, 核心技術概覽 3",
          (Quantity("chain_optimum_over_sqrt_L", "best segment / sqrt(L), chain of equal layers", "x", "within",
                    "1 (segments of sqrt L)", (0.5, 2.0), (0.25, 4.0)),
           Quantity("gpt2_optimum_over_sqrt_L", "best segment / sqrt(L), GPT-2 blocks", "x", "within",
                    "1 (segments of sqrt L)", (0.5, 2.0), (0.25, 4.0)))),
    Claim("C6", "三者組合：記憶體節省 ~65-70%，速度持平或略慢 10-15% "
                "(mixed precision + accumulation + checkpointing: -65-70 % memory, 10-15 % slower at most)",
          "000 README, 組合優化效果",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "65-70 %", 0.65, 0.325),
           Quantity("slowdown", "slowdown", "%", "lower", "0-15 %", 0.15, 0.30))),
    Claim("C7", "單 GPU 上 DeepSpeed ZeRO-2 + CPU offload：節省 20-30% GPU 記憶體 "
                "(ZeRO-2 + CPU offload on one GPU saves 20-30 % of GPU memory)",
          "003 Lab-1.3 README, 實驗 1",
          (Quantity("memory_saving", "GPU peak-memory saving", "%", "higher", "20-30 %", 0.20, 0.10),)),
)}


def verdict(claim_id: str, values: dict) -> tuple[str, str]:
    """(verdict, why) for ``values`` ({quantity name: number or None}). The rule of the module docstring."""
    claim = CLAIMS[claim_id]
    judged = [(q, values.get(q.name), q.judge(values.get(q.name))) for q in claim.quantities]
    measured = [(q, v, j) for q, v, j in judged if j != NOT_MEASURED]
    missing = [q.label for q, _, j in judged if j == NOT_MEASURED]
    if not measured:
        return NOT_MEASURED, "nothing was measured"
    kinds = {j for _, _, j in measured}
    if kinds == {HOLDS}:
        v = HOLDS
    elif kinds == {DOES_NOT_HOLD}:
        v = DOES_NOT_HOLD
    else:
        v = PARTLY
    if missing and v == HOLDS:
        v = PARTLY
    why = "; ".join(q.explain(x) for q, x, _ in measured)
    if missing:
        why += f"; {', '.join(missing)} not measured"
    return v, why[0].upper() + why[1:]


def _measured(claim: Claim, values: dict) -> dict:
    return {q.name: {"value": values.get(q.name), "unit": q.unit, "text": q.fmt(values.get(q.name)),
                     "label": q.label} for q in claim.quantities if values.get(q.name) is not None}


def conditions(*, model: str | None, batch: str | None, sequence: int | None, precision: str | None,
               hardware: str | None, mode: str, **extra) -> dict:
    """The conditions a claim entry was measured under (anything extra is kept, e.g. budget="8 GiB")."""
    return {"model": model, "batch": batch, "sequence": sequence, "precision": precision,
            "hardware": hardware, "mode": mode, **extra}


def hardware(env: dict | None) -> str:
    """The hardware of a run for a claim's conditions: the GPU's name, else "cpu"."""
    env = env or {}
    return env.get("gpu_name") or ("cpu" if env.get("device", "cpu") == "cpu" else str(env.get("device")))


def claim_entry(claim_id: str, values: dict | None, cond: dict, *, reason: str | None = None,
                not_measured: str | None = None, prediction: dict | None = None, lab: str | None = None,
                extra: dict | None = None, prediction_for: str | None = None) -> dict:
    """One ``claims`` entry: id, claim, expected, measured (values with units), verdict, why, conditions.

    ``values``: {quantity: number}; None or empty with ``not_measured`` (why not) gives ``not measured``.
    ``reason``: a clause the lab computed from its numbers (e.g. which memory term did not shrink), appended
    to the why. ``prediction``: {quantity: number} from the estimator, recorded and labelled as a prediction,
    never as a measurement. ``extra``: more measured context (e.g. the largest batch each setup fits).
    In smoke mode (``cond["mode"] != "full"``) the measurement is labelled a smoke measurement.
    """
    claim = CLAIMS[claim_id]
    values = {k: v for k, v in (values or {}).items() if v is not None}
    v, why = verdict(claim_id, values)
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
             "measured": _measured(claim, values) or None,
             "measurement": (None if v == NOT_MEASURED else SMOKE_LABEL if smoke else
                             f"measured on {cond.get('hardware')}"),
             "verdict": v, "why": why + ("" if why.endswith(".") else "."), "conditions": dict(cond),
             "lab": lab or OWNER[claim_id]}
    if prediction:
        entry["prediction"] = {"label": PREDICTION_LABEL, "for": prediction_for, **_measured(claim, prediction)}
    if extra:
        entry["extra"] = extra
    return entry


def _plain(claim: Claim, values: dict) -> str:
    return ", ".join(f"{q.label} {q.fmt(values[q.name])}" for q in claim.quantities if values.get(q.name) is not None)


def not_measured(claim_id: str, why: str, cond: dict, *, prediction: dict | None = None, lab: str | None = None,
                 prediction_for: str | None = None) -> dict:
    """A ``not measured`` entry: always says why; ``prediction`` (from the estimator, for the setup named in
    ``prediction_for``) is labelled as one."""
    return claim_entry(claim_id, None, cond, not_measured=why, prediction=prediction, lab=lab,
                       prediction_for=prediction_for)


# ------------------------------------------------------------------------------------------ the whole C1-C7 table
def collect(results: dict[str, dict], fallback: list[dict] | None = None) -> list[dict]:
    """C1-C7, one entry each: from the lab that owns the claim when its results carry a measured entry, else
    from ``fallback`` (entries computed elsewhere, e.g. lab 04), else from any lab's entry (``not measured``
    included), else a ``not measured`` entry saying no lab recorded it. ``results``: {anything: results JSON}.
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
        candidates = [own, fb.get(cid), *others]
        pick = next((e for e in candidates if e and e["verdict"] != NOT_MEASURED), None)
        pick = pick or next((e for e in candidates if e), None)
        if pick is None:
            pick = not_measured(cid, f"no lab recorded it (it belongs to {OWNER[cid]}, whose results are not here)",
                                conditions(model=None, batch=None, sequence=None, precision=None, hardware=None,
                                           mode="-"))
        table.append(pick)
    return table


def table_rows(entries: list[dict]) -> list[dict]:
    """Flat rows for a Markdown table: id, verdict, measured, expected, why, conditions, lab."""
    rows = []
    for e in entries:
        m = e.get("measured") or {}
        c = e.get("conditions") or {}
        measured = ", ".join(f"{x['label']} {x['text']}" for x in m.values()) or "-"
        if e.get("measurement", "") and e["measurement"].startswith("smoke"):
            measured = f"{measured} (smoke)"
        if not m and e.get("prediction"):
            p = {k: v for k, v in e["prediction"].items() if isinstance(v, dict)}
            measured = "prediction: " + ", ".join(f"{x['label']} {x['text']}" for x in p.values())
        cond = ", ".join(str(c[k]) for k in ("model", "batch", "sequence", "precision", "hardware") if c.get(k))
        rows.append({"claim": e["id"], "design says": e["claim"], "verdict": e["verdict"], "measured": measured,
                     "why": e["why"], "conditions": cond or "-", "lab": e.get("lab")})
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
