"""The seven folklore claims of the original course (C1-C7), in its own words with where each comes from, and the
entries a lab records for them (``lu.record_results(..., claims=[claim_entry(...), ...])``); :func:`collect` builds the
C1-C7 table from every lab's results. Each claim is data: the course's words and one or more
:class:`~labutils.verdicts.verdict_rule.Quantity`, judged by :mod:`labutils.verdicts.verdict_rule`. In smoke mode C1-C4
and C6 are "not judged" (the tiny model's ratios do not carry over to GPT-2); C5's equal layers may be judged."""
from __future__ import annotations

from dataclasses import dataclass

from ..labs.registry import LABS
from .verdict_rule import (DOES_NOT_HOLD, HOLDS, JUDGED, MIN_LAYERS, MIN_TIMED_STEPS, NOT_DECIDED, NOT_JUDGED,
                           NOT_MEASURED, PARTLY, VERDICTS, Evidence, Quantity, evidence_for, hardware, judge_quantity,
                           median_spread, on_cpu, run_pair_evidence, summarise, timed_ratio, timed_step_times)

SMOKE_LABEL = "smoke measurement (tiny model, few steps, CPU): shows the code runs; not a GPU result"
PREDICTION_LABEL = "prediction of labutils.estimator.estimate (arithmetic, not a measurement)"
OWNER = {c: lab.stem for lab in LABS for c in lab.claims}  # the lab that measures and records each (labutils.labs.registry)
FULL = ("full_model",)


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str                     # the design's words (Traditional Chinese) and an English gloss
    source: str                    # where in the original course the claim is made (its README, a notebook)
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
          "the original Lab-1.4 course README, 核心技術概覽 1 and its lab 1 table (FP32 ~8 GB -> FP16 ~4.5 GB)",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "~50 %", 0.40, 0.20,
                    needs=FULL + ("batch_sweep",)),)),
    Claim("C2", "混合精度：速度提升 2-3x (AMP trains 2-3x faster)",
          "the original Lab-1.4 course README, 核心技術概覽 1 and its lab 1 table (FP16 2.2x, BF16 2.1x)",
          (Quantity("speedup", "speed-up", "x", "higher", "2-3x", 2.0, 1.5, kind="speed", needs=FULL),)),
    Claim("C3", "梯度累積：記憶體 0%，速度 -5% (accumulation costs no memory and ~5 % of the time)",
          "the original Lab-1.4 course README, 單一技術效果 table; its gradient-accumulation notebook: 慢 5-10%",
          (Quantity("memory_increase", "extra peak memory", "%", "lower", "0 %", 0.05, 0.20, needs=FULL),
           Quantity("time_cost", "throughput cost", "%", "lower", "~5 % (5-10 %)", 0.10, 0.20, kind="speed",
                    needs=FULL + ("same_micro_batch",)))),
    Claim("C4", "梯度檢查點：記憶體節省 30-50% (~12 GB -> ~7 GB)，代價 20-30% 時間 "
                "(checkpointing saves 30-50 % of the memory for +20-30 % time)",
          "the original Lab-1.4 course README, its lab 3 table and 單一技術效果 table",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "30-50 %", 0.30, 0.15, needs=FULL),
           Quantity("time_overhead", "step-time overhead", "%", "lower", "+20-30 %", 0.30, 0.60, kind="speed",
                    needs=FULL))),
    Claim("C5", "梯度檢查點：記憶體從 O(L) 降至 O(√L) (activation memory drops from O(L) to O(sqrt L))",
          "the original Lab-1.4 course README, 核心技術概覽 3",
          (Quantity("chain_optimum_over_sqrt_L", "best segment / sqrt(L), chain of equal layers", "x", "within",
                    "1 (segments of sqrt L)", (0.5, 2.0), (0.25, 4.0), kind="shape", needs=("layers",)),
           Quantity("gpt2_optimum_over_sqrt_L", "best segment / sqrt(L), GPT-2 blocks", "x", "within",
                    "1 (segments of sqrt L)", (0.5, 2.0), (0.25, 4.0), kind="shape", needs=("layers",)))),
    Claim("C6", "三者組合：記憶體節省 ~65-70%，速度持平或略慢 10-15% "
                "(mixed precision + accumulation + checkpointing: -65-70 % memory, 10-15 % slower at most)",
          "the original Lab-1.4 course README, 組合優化效果",
          (Quantity("memory_saving", "peak-memory saving", "%", "higher", "65-70 %", 0.65, 0.325, needs=FULL),
           Quantity("slowdown", "slowdown", "%", "lower", "0-15 %", 0.15, 0.30, kind="speed", needs=FULL))),
    Claim("C7", "單 GPU 上 DeepSpeed ZeRO-2 + CPU offload：節省 20-30% GPU 記憶體 "
                "(ZeRO-2 + CPU offload on one GPU saves 20-30 % of GPU memory)",
          "the original Lab-1.3 DeepSpeed README, 實驗 1",
          (Quantity("memory_saving", "GPU peak-memory saving", "%", "higher", "20-30 %", 0.20, 0.10),)),
)}
SPEED_QUANTITIES = {(c.id, q.name) for c in CLAIMS.values() for q in c.quantities if q.kind == "speed"}


def judge(claim_id: str, values: dict, evidence=None) -> tuple[str, str, dict]:
    """(verdict, why, {quantity name: {"verdict", "why"}}) for ``values`` ({quantity name: number or None}), with
    ``evidence`` checked against each quantity's needs; without it, what the numbers would mean *if* judged."""
    claim = CLAIMS[claim_id]
    evs = evidence_for(claim.quantities, evidence, None) if evidence is not None else {}
    parts = {q.name: dict(zip(("verdict", "why"), judge_quantity(q, values.get(q.name), evs.get(q.name))))
             for q in claim.quantities}
    return (*summarise(claim.quantities, parts), parts)


def verdict(claim_id: str, values: dict, evidence=None) -> tuple[str, str]:
    """(verdict, why): :func:`judge` without the parts."""
    return judge(claim_id, values, evidence)[:2]


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


def claim_entry(claim_id: str, values: dict | None, cond: dict, *, reason: str | None = None,
                not_measured: str | None = None, prediction: dict | None = None, extra: dict | None = None,
                prediction_for: str | None = None, evidence=None) -> dict:
    """One ``claims`` entry: id, claim, expected, measured (values with units), verdict, why, conditions, parts (each
    quantity's own verdict and clause), compares (each quantity's pair of runs), evidence, lab (its owner). ``values``:
    {quantity: number}, none: ``not measured`` (``not_measured``: why not); ``evidence``: one :class:`Evidence` or
    {quantity: Evidence}; ``reason``: a clause appended to the why; ``prediction``: the estimator's {quantity: number},
    labelled; ``extra``: more measured context."""
    claim = CLAIMS[claim_id]
    values = {k: v for k, v in (values or {}).items() if v is not None}
    evs = evidence_for(claim.quantities, evidence, cond.get("hardware"), cond.get("mode"), cond.get("model"))
    v, why, parts = judge(claim_id, values, evs)
    hw, smoke = str(cond.get("hardware") or "cpu"), cond.get("mode") != "full"
    on, tag = f"tiny model on {'CPU' if hw.lower().startswith('cpu') else hw}", smoke and v != NOT_MEASURED
    if tag and v == NOT_JUDGED and all("full_model" in q.all_needs() for q in claim.quantities):
        # every part waits for a full-mode run: said once, briefly; each part's own reasons stay in "parts"
        why, tag = f"A smoke measurement ({on}) is only shown: " + ", ".join(
            f"{q.label} {q.shown(values[q.name], evs[q.name])}" for q in claim.quantities if q.name in values), False
    if v == NOT_MEASURED:
        why = f"Not measured: {not_measured or 'this run produced none of the numbers it needs'}"
    elif reason:
        why = f"{why}: {reason}"
    if v == NOT_MEASURED and prediction:
        predicted = ", ".join(f"{m['label']} {m['text']}" for m in _measured(claim, prediction).values())
        why += (f". The estimator predicts{f' (for {prediction_for})' if prediction_for else ''} {predicted}, which "
                f"would make it '{verdict(claim_id, prediction)[0]}' (a prediction, not a measurement)")
    why += f" [smoke measurement: {on}]" if tag else ""
    entry = {"id": claim_id, "claim": claim.claim, "source": claim.source, "expected": claim.expected(),
             "expected_ranges": claim.expected_ranges(), "measured": _measured(claim, values, parts) or None,
             "measurement": (None if v == NOT_MEASURED else SMOKE_LABEL if smoke else
                             f"measured on {cond.get('hardware')}"),
             "verdict": v, "why": why + ("" if why.endswith(".") else "."), "conditions": dict(cond),
             "parts": parts if values else {},
             "compares": {k: " vs ".join(e.pair) for k, e in evs.items() if e.pair and k in values},
             "evidence": {k: e.record() for k, e in evs.items() if k in values}, "lab": OWNER[claim_id]}
    if prediction:
        entry["prediction"] = {"label": PREDICTION_LABEL, "for": prediction_for, **_measured(claim, prediction)}
    if extra:
        entry["extra"] = extra
    return entry


def not_measured(claim_id: str, why: str, cond: dict, *, prediction: dict | None = None,
                 prediction_for: str | None = None) -> dict:
    """A ``not measured`` entry, saying why; ``prediction`` (the estimator's, for ``prediction_for``): labelled."""
    return claim_entry(claim_id, None, cond, not_measured=why, prediction=prediction, prediction_for=prediction_for)


# ------------------------------------------------------------------------------------------ the whole C1-C7 table
_RANK = {HOLDS: 0, PARTLY: 0, DOES_NOT_HOLD: 0, NOT_DECIDED: 1, NOT_JUDGED: 2, NOT_MEASURED: 3}


def collect(results: dict[str, dict]) -> list[dict]:
    """C1-C7, one entry each from ``results`` ({anything: results JSON}), with the lab and time of the results file it
    came from ("recorded"): the best-judged entry, the owning lab's first; else a ``not measured`` entry."""
    by_lab: dict[str, dict[str, dict]] = {}
    for data in results.values():
        for e in data.get("claims") or []:
            lab = data.get("notebook") or e.get("lab")
            by_lab.setdefault(lab, {})[e["id"]] = {**e, "lab": lab, "recorded": (data.get("env") or {}).get("date")}
    table = []
    for cid in CLAIMS:
        stem = OWNER[cid]
        candidates = [e for _, got in sorted(by_lab.items(), key=lambda kv: kv[0] != stem) if (e := got.get(cid))]
        table.append(min(candidates, key=lambda e: _RANK.get(e["verdict"], 3)) if candidates else not_measured(
            cid, f"no lab recorded it (it belongs to {stem}, whose results are not here)",
            conditions(model=None, batch=None, sequence=None, precision=None, hardware=None, mode="-")))
    return table


def table_rows(entries: list[dict]) -> list[dict]:
    """Flat rows for a Markdown table: claim, verdict, measured (a value not judged labelled so), compares, why..."""
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
                     "compares": compares, "why": e["why"], "conditions": cond or "-", "lab": e.get("lab"),
                     "recorded": e.get("recorded") or "-"})
    return rows
