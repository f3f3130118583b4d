"""Results of a lab: tables (lists of row dicts) and figures, recorded with the hardware they came from.

Each notebook ends with one call, ``lu.record_results("01-Mixed_Precision", tables={...}, figures={...})``,
which writes ``<dir>/<stem>.json`` (atomically) and ``<dir>/figures/<stem>-<name>.png``.

Where: ``$LAB_RESULTS_DIR`` if set (the instructors' ``regenerate`` command sets it); otherwise ``results/``
for a full run and ``runs/smoke/`` for a smoke run, so smoke numbers never land in ``results/``.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

RESULTS_DIR = Path("results")
SMOKE_DIR = Path("runs") / "smoke"


def write_json(path: str | os.PathLike, data) -> None:
    """Write JSON atomically (temp file + rename): a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def results_dir(mode: str) -> Path:
    env = os.environ.get("LAB_RESULTS_DIR")
    if env:
        return Path(env)
    return RESULTS_DIR if mode == "full" else SMOKE_DIR


def _clean(v):
    """JSON-safe values: NaN/inf become None, numpy/torch scalars become Python numbers."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def record_results(notebook: str, tables: dict[str, list[dict]], figures: dict | None = None, *,
                   env: dict | None = None, mode: str | None = None, notes: dict | None = None,
                   out_dir: str | os.PathLike | None = None, claims: list[dict] | None = None) -> Path:
    """Write one lab's tables and figures; returns the JSON path. ``env`` defaults to this machine's facts.
    ``claims``: the lab's verdicts on the design's claims (entries from :func:`labutils.claims.claim_entry`)."""
    from .env import detect_mode, environment

    mode = mode or detect_mode()[0]
    env = dict(env or environment(mode=mode))
    if env.get("weights") is None:  # the notebook's models: pretrained or random, as load_model last gave
        from .models import last_weights
        env["weights"] = last_weights()
    env.setdefault("gpu_memory_budget_gb", float(os.environ["LAB_GPU_MEMORY_GB"])
                   if os.environ.get("LAB_GPU_MEMORY_GB") else None)
    out = Path(out_dir) if out_dir else results_dir(mode)
    stem = Path(notebook).stem
    fig_paths = []
    for name, fig in (figures or {}).items():
        path = out / "figures" / f"{stem}-{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
        fig_paths.append(str(path.relative_to(out)))
    path = out / f"{stem}.json"
    write_json(path, _clean({"notebook": stem, "mode": mode, "env": env, "tables": tables,
                             "figures": fig_paths, "notes": notes or {}, "claims": claims or []}))
    print(f"results recorded: {path} ({len(tables)} tables, {len(fig_paths)} figures, {len(claims or [])} claims, "
          f"mode {mode})")
    return path


def read_results(notebook: str, mode: str) -> dict | None:
    """Another lab's recorded results of the same ``mode``, or None: looked up in ``$LAB_RESULTS_READ_DIR``
    (``regenerate`` points it at the output folder, since each notebook records into its own staging folder),
    then where :func:`record_results` would write them."""
    stem = Path(notebook).stem
    folders = [Path(d) for d in (os.environ.get("LAB_RESULTS_READ_DIR"),) if d] + [results_dir(mode)]
    for folder in folders:
        path = folder / f"{stem}.json"
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if data.get("mode") == mode:
                return data
    return None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e7 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return str(v)


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A Markdown table from row dicts (columns: the first row's keys unless given)."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in columns) + " |")
    return "\n".join(lines)


def show_table(rows: list[dict], columns: list[str] | None = None) -> None:
    """Display a table: rendered Markdown in Jupyter, plain Markdown text elsewhere."""
    text = format_table(rows, columns)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


SMOKE_BANNER = ("SMOKE MODE: a tiny GPT-2 for a few steps, on the CPU. Every number this notebook prints only shows "
                "that the code runs: none is a GPU result, and nothing is extrapolated to GPU sizes or cards. Run it "
                "on a CUDA GPU (without LAB_SMOKE=1) for the real measurements.")


def mode_banner(mode: str) -> str:
    """The one banner a notebook's setup cell prints in smoke mode (instead of a tag on every line); "" when full."""
    if mode == "full":
        return ""
    rule = "=" * 100
    return f"{rule}\n{SMOKE_BANNER}\n{rule}"
