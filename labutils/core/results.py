"""Results of a lab: tables (lists of row dicts) and figures, recorded with the hardware they came from.

Each notebook ends with ``lu.record_results("01-Mixed_Precision", tables={...}, figures={...})``: ``<dir>/<stem>.json``
(atomically) and ``<dir>/figures/<stem>-<name>.png``, into ``$LAB_RESULTS_DIR`` if set (by ``regenerate``), else
``results/`` for a full run and a temp folder for a smoke run. Other files (traces, snapshots): :func:`artifacts_dir`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .figures import unseen

RESULTS_DIR = Path("results")
SMOKE_DIR = Path(tempfile.gettempdir()) / "labutils-smoke"  # not the repository: smoke runs leave it unchanged
ARTIFACTS_ENV = "LAB_ARTIFACTS_DIR"  # regenerate sets it to <out>/artifacts


class OutputPathError(ValueError):
    """An output path that cannot be written: one line naming the option, the path and why."""


class WriteError(OutputPathError, OSError):
    """Writing an output failed after the work was done (a full disk...): "cannot write PATH: why", one line."""


REPO = Path(__file__).resolve().parents[2]


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _tracked(path: Path) -> bool:
    """Is ``path`` (inside the repository) a file git tracks? Without git: any existing file there counts."""
    try:
        proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "--error-unmatch", "--", str(path)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True
    return proc.returncode == 0


def check_output_file(path, option: str = "--json", inputs: dict | None = None) -> Path | None:
    """The one check of every command's output file, before any work: refuse a path the result would be lost on or
    that writing it would destroy (``inputs``: role -> path of this command's inputs). Creates nothing; None passes."""
    if path is None:
        return None
    text = os.fspath(path)
    where = f"{option} {shown_path(text) or repr(text)}"
    if not text.strip():
        raise OutputPathError(f"{where}: an empty file name; give a file path such as result.json")
    p = Path(text).expanduser()
    if text.endswith(("/", os.sep)) or p.name in ("", ".", ".."):
        raise OutputPathError(f"{where}: not a file name (a folder?); give a file path such as {p / 'result.json'}")
    try:
        for part in (p, *p.parents):
            if part.is_symlink() and not os.path.exists(part):
                raise OutputPathError(f"{where}: {shown_path(part)} is a symbolic link that leads nowhere (a missing "
                                      "target or a loop)")
        if p.is_dir():
            raise OutputPathError(f"{where}: is a directory; give a file path such as {p / 'result.json'}")
        if p.exists() and not p.is_file():
            raise OutputPathError(f"{where}: exists and is not a regular file")
        real = Path(os.path.realpath(p))
        base = _nearest_existing(real.parent)
    except OSError as exc:  # a name too long, ...
        raise OutputPathError(f"{where}: {exc.strerror or exc}") from None
    _check_creatable(where, base, "nothing")
    if not real.is_file():
        return p
    for role, other in (inputs or {}).items():
        with contextlib.suppress(OSError):
            if other is not None and os.path.samefile(real, other):
                raise OutputPathError(f"{where}: is the {role} this command reads; write the output elsewhere")
    if (REPO / ".git").exists() and real.is_relative_to(REPO) and _tracked(real):
        raise OutputPathError(f"{where}: would overwrite {real.relative_to(REPO)}, a file of the repository; write "
                              "it elsewhere")
    return p


def _check_creatable(where: str, base: Path, what: str) -> None:
    """``base`` (the nearest existing ancestor) must be a folder this process can create files in: tried, not
    guessed from the mode bits."""
    if not base.is_dir():
        raise OutputPathError(f"{where}: {shown_path(base)} is a file, so {what} can be created under it")
    try:
        fd, tmp = tempfile.mkstemp(dir=base, prefix=".write-check-", suffix=".tmp")
    except OSError as exc:
        raise OutputPathError(f"{where}: cannot create files in {shown_path(base)} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(tmp)


def check_output_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """Refuse, before any work, a folder path that is a file, lies under a file, or cannot be written."""
    p = Path(path).expanduser()
    where = f"{option} {shown_path(path)}"
    try:
        if p.exists() and not p.is_dir():
            raise OutputPathError(f"{where}: is a file, not a folder")
        base = _nearest_existing(p)
    except OSError as exc:
        raise OutputPathError(f"{where}: {exc.strerror or exc}") from None
    _check_creatable(where, base, "no folder")
    return p


def shown_path(path) -> str:
    text = str(path)
    return text if len(text) <= 120 else text[:117] + "..."


def write_json(path: str | os.PathLike, data) -> None:
    """Write strict JSON (NaN and infinities as null, numpy/torch scalars as numbers) as :func:`write_keeping_file`
    does: atomically, through a link, never half a file."""
    write_keeping_file(Path(path), json.dumps(_clean(data), indent=2, default=str, allow_nan=False) + "\n")


def write_atomic(path: Path, data) -> None:
    """Write ``data`` (bytes, or a function that writes into a binary file) to ``path`` through a temp file of its own,
    keeping the mode an existing file had: a crash or a full disk never leaves half a file (:class:`WriteError`)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            data(f) if callable(data) else f.write(data)
        try:  # the temp file (mkstemp makes them 0600) takes the mode the file had, or a new file's
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise WriteError(f"cannot write {shown_path(path)}: {why[:1].lower()}{why[1:]}") from exc
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def write_keeping_file(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically, keeping what the file is: through a symlink (the link stays, its
    target is rewritten), with the file's mode, and the exact bytes of ``text`` (no newline translation)."""
    write_atomic(Path(os.path.realpath(path)), text.encode("utf-8"))


def results_dir(mode: str) -> Path:
    env = os.environ.get("LAB_RESULTS_DIR")
    if env:
        return Path(env)
    return RESULTS_DIR if mode == "full" else SMOKE_DIR


def artifacts_dir(lab: str) -> Path:
    """The folder (created) for ``lab``'s files other than results: ``$LAB_ARTIFACTS_DIR/<lab>`` under
    ``regenerate``, otherwise ``<temp>/labutils-artifacts/<lab>``: never the repository's working tree."""
    base = os.environ.get(ARTIFACTS_ENV)
    path = (Path(base) if base else Path(tempfile.gettempdir()) / "labutils-artifacts") / lab
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clean(v):
    """JSON-safe values: NaN/inf become None, numpy/torch scalars become Python numbers."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        v = dataclasses.asdict(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


SETUP_CALL = re.compile(r"\.setup\(")  # the setup cell: ``info = lu.setup()`` in every lab


def partial_record() -> str | None:
    """Why this kernel's record of the lab would be partial, or None: the setup cell ran again (from IPython's ``In``)
    after cells that have not run since, so what they recorded is gone."""
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    ran = list(enumerate(getattr(shell, "user_ns", {}).get("In") or []))
    setups = [i for i, cell in ran if SETUP_CALL.search(cell)]
    if len(setups) < 2:
        return None
    again = {cell for i, cell in ran if i > setups[-1]}
    lost = [i for i, cell in ran if setups[0] < i < setups[-1] and cell.strip() and cell not in again
            and not SETUP_CALL.search(cell)]
    return (f"the setup cell ran again (In [{setups[-1]}]) after {len(lost)} cells that have not run since (In "
            f"[{lost[0]}] first): what they added to the lab's tables and figures is not in this record; run the "
            "notebook from the top (Kernel > Restart Kernel and Run All Cells)") if lost else None


def record_results(notebook: str, tables: dict[str, list[dict]], figures: dict | None = None, *,
                   env: dict | None = None, mode: str | None = None, notes: dict | None = None,
                   out_dir: str | os.PathLike | None = None, claims: list[dict] | None = None) -> Path:
    """Write one lab's tables and figures; returns the JSON path. ``env`` defaults to this machine's facts.
    ``claims``: the lab's verdicts on the design's claims (entries from :func:`labutils.verdicts.claims.claim_entry`)."""
    from .device import detect_mode
    from .env import environment

    mode = mode or detect_mode()[0]
    env = dict(env or environment(mode=mode))
    if env.get("weights") is None:  # the notebook's models: pretrained or random, as load_model last gave
        from ..models.gpt2 import last_weights
        env["weights"] = last_weights()
    env.setdefault("gpu_memory_budget_gb", float(os.environ["LAB_GPU_MEMORY_GB"])
                   if os.environ.get("LAB_GPU_MEMORY_GB") else None)
    from .memory import LEFTOVERS

    notes = {**(notes or {}), "leftovers": list(LEFTOVERS)} if LEFTOVERS else notes  # memory.start_check's
    partial = partial_record()
    if partial:
        print(f"warning: {partial}", file=sys.stderr)
        notes = {**(notes or {}), "incomplete": partial}
    out = Path(out_dir) if out_dir else results_dir(mode)
    stem = Path(notebook).stem
    fig_paths = []
    for name, fig in (figures or {}).items():
        for problem in unseen(fig):
            print(f"warning: figure {name!r}: {problem}", file=sys.stderr)
        path = out / "figures" / f"{stem}-{name}.png"
        write_atomic(path, functools.partial(fig.savefig, format="png", dpi=110, bbox_inches="tight"))
        fig_paths.append(str(path.relative_to(out)))
    path = out / f"{stem}.json"
    from . import env as _env
    from .run_result import RUN_LOG

    elapsed = time.perf_counter() - _env.SETUP_AT if _env.SETUP_AT is not None else None
    write_json(path, _clean({"notebook": stem, "mode": mode, "env": env, "tables": tables,
                             "figures": fig_paths, "notes": notes or {}, "claims": claims or [],
                             "runs": list(RUN_LOG), "elapsed_seconds": elapsed}))
    # under `regenerate`, where the file is moved when the notebook ends: its staging folder is gone after the run
    final = Path(os.environ["LAB_RESULTS_FINAL_DIR"]) / path.name if os.environ.get("LAB_RESULTS_FINAL_DIR") else path
    print(f"results recorded: {final} ({len(tables)} tables, {len(fig_paths)} figures, {len(claims or [])} claims, "
          f"mode {mode})")
    return path


def read_results(notebook: str, mode: str) -> dict | None:
    """Another lab's recorded results of the same ``mode``, or None: from ``$LAB_RESULTS_READ_DIR`` (``regenerate``'s
    output folder), then where :func:`record_results` would write them."""
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
        return f"{v:,.0f}" if 1000 <= abs(v) < 1e7 else f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return str(v)


BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
_UNIT_SIZE = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "bytes": 1}  # the unit words a memory column's name ends in


def byte_unit(values) -> tuple[str, int]:
    """(name, bytes per unit) a column of byte counts is shown in: the largest unit in which the smallest nonzero
    value is at least 1 (11.6 and 11.5 MiB, not 0.0113 and 0.0113 GiB); None and NaN are ignored."""
    sizes = [abs(float(v)) for v in values
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v != 0]
    if not sizes:
        return BYTE_UNITS[-1]
    smallest = min(sizes)
    return next((name, size) for name, size in BYTE_UNITS if smallest >= size) if smallest >= 1 else BYTE_UNITS[-1]


def _byte_column(column: str) -> tuple[str, str, int] | None:
    """(text before the unit, text after it, bytes per unit) of a column whose name says it holds memory in a byte
    unit: ``peak_gib``, ``weights_bytes``, ``allocated (MiB)``, ``memory [GiB]``, ``MiB``; else None. A rate such as
    ``KiB_per_token`` is not a size and keeps its unit."""
    low = column.lower()
    for unit, size in _UNIT_SIZE.items():
        for before, after in (("_", ""), (" (", ")"), (" [", "]"), ("", "")):
            tail = f"{before}{unit}{after}"
            if low.endswith(tail) and (before or low == unit):
                return column[:len(column) - len(tail)] + before, after, size
    return None


def adapt_byte_units(rows: list[dict], columns: list[str]) -> tuple[list[dict], list[str]]:
    """Rows and column names for display, each memory column (:func:`_byte_column`) converted to the unit its own
    values call for (:func:`byte_unit`) and renamed to say it: ``peak_gib`` 0.0113 becomes ``peak_mib`` 11.6."""
    renamed, new_columns = {}, []
    for c in columns:
        spec = _byte_column(c)
        if spec is None:
            new_columns.append(c)
            continue
        head, tail, size = spec
        name, unit = byte_unit(r.get(c) * size for r in rows if isinstance(r.get(c), (int, float)))
        unit_text = ("bytes" if name == "B" else name.lower()) if head.endswith("_") else name  # a bare "MiB": name
        new = f"{head}{unit_text}{tail}"
        renamed[c] = (new, size / unit)
        new_columns.append(new)
    if not renamed:
        return rows, columns
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k not in renamed}
        for c, (new, factor) in renamed.items():
            v = r.get(c)
            row[new] = v * factor if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        out.append(row)
    return out, new_columns


def format_table(rows: list[dict], columns: list[str] | None = None, *, adapt_units: bool = True) -> str:
    """A Markdown table from row dicts (columns: the first row's keys unless given), memory columns in the unit their
    values call for (:func:`adapt_byte_units`) unless ``adapt_units=False``."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    if adapt_units:
        rows, columns = adapt_byte_units(rows, columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in columns) + " |")
    return "\n".join(lines)


def show_table(rows: list[dict], columns: list[str] | None = None, *, adapt_units: bool = True) -> None:
    """Display a table: rendered Markdown in Jupyter, plain Markdown text elsewhere (units as :func:`format_table`)."""
    text = format_table(rows, columns, adapt_units=adapt_units)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def mode_banner(mode: str) -> str:
    """The one banner a notebook's setup cell prints in smoke mode (instead of a tag on every line); "" when full.
    Smoke on a CUDA machine (LAB_SMOKE=1) runs on the GPU, and says so."""
    if mode == "full":
        return ""
    from . import device as dev

    gpu = dev.cuda_available()
    text = (f"SMOKE MODE{' (LAB_SMOKE=1)' if gpu else ''}: a tiny GPT-2 for a few steps, on "
            f"{'this GPU' if gpu else 'the CPU'}. Every number this notebook prints only shows that the code runs: "
            + ("none is a result for GPT-2's sizes, and nothing is extrapolated to them. Run it without LAB_SMOKE=1"
               if gpu else "none is a GPU result, and nothing is extrapolated to GPU sizes or cards. Run it on a "
               "CUDA GPU (without LAB_SMOKE=1)") + " for the real measurements.")
    return f"{'=' * 100}\n{text}\n{'=' * 100}"
