"""The results pages: recorded lab results (``<stem>.json``) rendered as Markdown for ``README-results.md`` and the
README's ``<!-- results:NN -->`` blocks (full runs only); pure but the readers. ``regenerate`` writes them."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..labs.registry import LABS
from ..core.results import RESULTS_DIR, format_table


def lab_id(stem: str) -> str:
    """"03-Gradient_Checkpointing" -> "03" (the marker key)."""
    return stem.split("-", 1)[0]


class ResultsError(ValueError):
    """A results file that cannot be read: one line naming it."""


def load_results(out: str | os.PathLike, stems: list[str] | None = None) -> dict[str, dict]:
    """{lab id: recorded JSON} of ``<stem>.json`` for each notebook stem (default: the registry's labs; a stale
    ``NN-Old_Name.json`` never stands in). ResultsError (one line) for a file that is not a results file."""
    files = [Path(out) / f"{s}.json" for s in stems or [lb.stem for lb in LABS] if (Path(out) / f"{s}.json").is_file()]
    results = {}
    for js in files:
        try:
            data = json.loads(js.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ResultsError(f"{js}: not a readable results file ({str(exc).splitlines()[0][:120]}); "
                               "restore it (git checkout) or delete it") from None
        why = results_shape_error(data)
        if why:
            raise ResultsError(f"{js}: {why}; restore it (git checkout) or delete it")
        results[lab_id(js.stem)] = data
    return results


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def results_shape_error(data) -> str | None:
    """Why ``data`` (a parsed ``<stem>.json``) is not what ``record_results`` writes, naming the key; else None."""
    if not isinstance(data, dict):
        return f"not a results file (a JSON object expected, found {_kind(data)})"
    tables = data.get("tables")
    if tables is not None:
        if not isinstance(tables, dict):
            return f"'tables' must be an object {{name: [rows]}}, found {_kind(tables)}"
        for name, rows in tables.items():
            if not isinstance(rows, list):
                return f"'tables'.{name!r} must be a list of rows, found {_kind(rows)}"
            bad = [r for r in rows if not isinstance(r, dict)]
            if bad:
                return f"'tables'.{name!r}: every row must be an object {{column: value}}, found {_kind(bad[0])}"
    for key in ("env", "notes"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"{key!r} must be an object, found {_kind(data[key])}"
    figures = data.get("figures")
    if figures is not None:
        if not isinstance(figures, list):
            return f"'figures' must be a list of paths, found {_kind(figures)}"
        for fig in figures:
            parts = Path(fig).parts if isinstance(fig, str) else ()
            if len(parts) != 2 or parts[0] != "figures" or parts[1] in ("..", "."):
                return f"'figures': {fig!r} is not a path figures/<name> inside the results folder"
    claims = data.get("claims")
    if claims is not None:
        if not isinstance(claims, list):
            return f"'claims' must be a list of claim entries, found {_kind(claims)}"
        for e in claims:
            if not isinstance(e, dict) or any(not isinstance(e.get(k), str) for k in ("id", "claim", "verdict", "why")):
                return (f"'claims': every entry must be an object with \"id\", \"claim\", \"verdict\" and \"why\" "
                        f"strings, found {json.dumps(e, default=str)[:60]}")
            for key in ("measured", "conditions", "compares", "prediction"):
                if e.get(key) is not None and not isinstance(e[key], dict):
                    return f"'claims' entry {e['id']}: {key!r} must be an object, found {_kind(e[key])}"
    return None


def hardware_line(env: dict) -> str:
    """One line: the GPU a run used (memory, cap, compute capability, driver, CUDA), or the CPU when none."""
    gpu = env.get("gpu") or {}
    if not gpu and not env.get("gpu_name"):
        return f"CPU ({env.get('cpu') or 'unknown'}), no GPU"
    parts = [gpu.get("name") or env.get("gpu_name")]
    total, budget = gpu.get("total_memory_bytes"), gpu.get("budget_bytes")
    if total:
        cap = env.get("gpu_memory_budget_gb") or (budget or 0) / 2**30
        parts += [f"{total / 2**30:.1f} GiB", f"capped to {budget / 2**30:.1f} GiB (`--gpu-memory-gb {cap:g}`)"
                  if budget and budget < total else "no memory cap"]
    parts += [f"{word} {gpu[key]}" for key, word in (("compute_capability", "compute capability"),
                                                     ("driver", "driver"), ("cuda", "CUDA")) if gpu.get(key)]
    return ", ".join(str(p) for p in parts)


def weights_line(data: dict) -> str:
    """Pretrained or random, from the env record (or, failing that, a "weights" column of the tables)."""
    w = (data.get("env") or {}).get("weights")
    kinds = {w} if w else {r.get("weights") for rows in (data.get("tables") or {}).values() for r in rows
                           if isinstance(r, dict) and r.get("weights")}
    if not kinds:
        return "not recorded"
    if kinds == {"random"}:
        return "random init" + (" (no model hub: memory and speed are GPT-2's, loss values are not those of "
                                "pretrained GPT-2)" if data.get("mode") == "full" else "")
    if kinds == {"pretrained"}:
        return "pretrained GPT-2"
    return "mixed: " + ", ".join(sorted(map(str, kinds)))


def render_lab(data: dict, figure_prefix: str = "", *, readme: bool = False) -> str:
    """One lab's recorded results as Markdown: provenance header, one table per recorded table, its figures
    (``figure_prefix`` before their paths, e.g. "results/" for the README). ``readme=True`` refuses a smoke run."""
    mode = data.get("mode")
    if readme and mode != "full":
        raise ValueError(f"{data.get('notebook')}: {mode} results never go into README.md (only a full GPU run's)")
    env = data.get("env") or {}
    lines = []
    if mode != "full":
        lines += [f"> **{str(mode).upper()} RUN** (tiny model, few steps): these numbers only show that the "
                  "notebook runs; they are not results.", ""]
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers") if env.get(k))
    lines += [f"- Hardware: {hardware_line(env)}", f"- Weights: {weights_line(data)}",
              f"- Run: {mode} mode, {env.get('date') or 'date not recorded'}" + (f"; {versions}" if versions else ""),
              ""]
    lines += render_claims(data.get("claims") or [])
    for name, rows in (data.get("tables") or {}).items():  # structured cells (a row's config) stay in the JSON
        columns = [c for c in (rows[0] if rows else {}) if not any(isinstance(r.get(c), (dict, list)) for r in rows)]
        lines += [f"*{name}*", "", format_table(rows, columns or None), ""]
    if data.get("notes"):
        lines += [f"- {key}: {value}" for key, value in data["notes"].items()] + [""]
    for fig in data.get("figures") or []:
        lines.append(f"![{Path(fig).stem}]({figure_prefix}{fig})")
    return "\n".join(lines).rstrip() + "\n"


def render_claims(entries: list[dict], title: str = "Claims of the course design: verdicts from this run") -> list[str]:
    """The claims table (C1-C7 verdicts) as Markdown lines, nothing when there are none: each row with its pair of runs
    and when its results file was recorded; a value that was not judged is labelled so."""
    if not entries:
        return []
    from ..verdicts.claims import table_rows

    return [f"*{title}*", "", format_table(table_rows(entries), ["claim", "verdict", "measured", "compares", "why",
                                                                  "conditions", "lab"]
                                           + ["recorded"] * any("recorded" in e for e in entries)), ""]


def render_results(results: dict[str, dict]) -> str:
    """``README-results.md``: the C1-C7 table from every lab's recorded claims (each row: the lab and the time of
    the results file it came from), then every lab's block, under a banner saying which kind of run this was."""
    modes = {d.get("mode") for d in results.values()}
    lines = ["# Lab results", ""]
    if modes - {"full"}:
        lines += ["**Smoke results**: tiny model, few steps, possibly on a CPU. They show that the notebooks run "
                  "end to end; they are not GPU measurements and never go into README.md.", ""]
    if not results:
        lines += ["No lab recorded results.", ""]
    elif any(d.get("claims") for d in results.values()):
        from ..verdicts.claims import collect
        lines += ["## Claims C1-C7 across the labs", ""] + render_claims(collect(results), "Every claim, one verdict")
    for lab, data in sorted(results.items()):
        lines += [f"## {data.get('notebook') or lab}", "", render_lab(data)]
    return "\n".join(lines).rstrip() + "\n"


def readme_blocks(results: dict[str, dict],
                  figure_prefix: str = f"{RESULTS_DIR.as_posix()}/") -> tuple[dict[str, str], list[str]]:
    """({lab: block} for the full-run results, [labs refused because they are not full-run results])."""
    blocks = {lab: render_lab(data, figure_prefix, readme=True) for lab, data in sorted(results.items())
              if data.get("mode") == "full"}
    return blocks, [lab for lab in sorted(results) if lab not in blocks]


_MARKER = re.compile(r"<!-- (/?)results:(\d+) -->")


def marker_spans(text: str) -> dict[str, tuple[int, int]]:
    """{lab: (start, end) of what lies between ``<!-- results:NN -->`` and ``<!-- /results:NN -->``}. Every marker
    is checked: one block per lab, closed before any other marker appears; else ValueError (one line)."""
    spans: dict[str, tuple[int, int]] = {}
    opened = None  # (lab, content start, line)
    for m in _MARKER.finditer(text):
        closing, lab, line = m.group(1) == "/", m.group(2), text.count("\n", 0, m.start()) + 1
        if not closing:
            if opened:
                raise ValueError(f"line {line}: '<!-- results:{lab} -->' inside lab {opened[0]}'s block (opened on "
                                 f"line {opened[2]}, not yet closed); blocks must not nest or interleave")
            if lab in spans:
                raise ValueError(f"line {line}: a second '<!-- results:{lab} -->' block; need exactly one per lab")
            opened = (lab, m.end(), line)
        elif not opened:
            raise ValueError(f"line {line}: '<!-- /results:{lab} -->' closes no open block")
        elif opened[0] != lab:
            raise ValueError(f"line {line}: '<!-- /results:{lab} -->' inside lab {opened[0]}'s block (opened on "
                             f"line {opened[2]}); blocks must not nest or interleave")
        else:
            spans[lab] = (opened[1], m.start())
            opened = None
    if opened:
        raise ValueError(f"line {opened[2]}: '<!-- results:{opened[0]} -->' is never closed by "
                         f"'<!-- /results:{opened[0]} -->'")
    return spans


def update_readme(text: str, blocks: dict[str, str]) -> str:
    """Replace what is between each lab's markers with its block; everything else is left byte for byte (a lab
    without a block keeps what it had; broken markers raise ValueError). The block takes the text's line ending."""
    spans = marker_spans(text)
    newline = "\r\n" if "\r\n" in text else "\n"
    for lab in sorted((lab for lab in blocks if lab in spans), key=lambda lab: spans[lab][0], reverse=True):
        start, end = spans[lab]
        body = blocks[lab].strip().replace("\r\n", "\n").replace("\n", newline)
        text = f"{text[:start]}{newline}{body}{newline}{text[end:]}"
    return text


def read_readme(path: Path) -> str:
    """The README's text exactly as stored (no newline translation); ValueError (one line) when unreadable."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (offset {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None

