"""``python -m labutils regenerate``: re-execute the lab notebooks, collect their results, render the README tables.

    python -m labutils regenerate                       # full run on a GPU: results/ and README.md
    python -m labutils regenerate --smoke --only 03     # does lab 03 still run? results in a temp folder
    python -m labutils regenerate --gpu-memory-gb 0     # no cap: use the whole card

Each notebook runs top to bottom in its own fresh kernel (so one lab's CUDA memory never leaks into the next,
and ``LAB_GPU_MEMORY_GB`` is applied to a clean process), with the repository root as working directory and
``LAB_RESULTS_DIR`` pointing at a private staging folder. Its last cell, ``lu.record_results(...)``, writes
``<stem>.json`` and ``figures/<stem>-*.png`` there; we check them (written at all? the mode we asked for?) and
only then move them into the output folder. So a failed notebook keeps the previous results, and a "full" run
whose notebook fell back to smoke (no GPU after all) never lands smoke numbers in ``results/``.

Executed copies (with outputs and tracebacks) go to ``<out>/executed/``; the repository's notebooks are only
read. Rendering is pure: :func:`render_lab` (one JSON -> Markdown) and :func:`update_readme` (README text +
blocks -> README text, between ``<!-- results:NN -->`` and ``<!-- /results:NN -->``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .results import format_table

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = "results"  # the committed results folder, relative to the repository root
NOTEBOOK_GLOB = "[0-9][0-9]-*.ipynb"
SMOKE_CELL_TIMEOUT = 900  # s per cell; a smoke notebook takes ~1 min in all on a 2-core CPU
FULL_CELL_TIMEOUT = 4 * 3600  # s per cell; a full sweep cell can legitimately take long, but not forever


def lab_id(stem: str) -> str:
    """"03-Gradient_Checkpointing" -> "03" (the marker key)."""
    return stem.split("-", 1)[0]


def find_notebooks(folder: str | os.PathLike, only: str | list[str] | None = None) -> list[Path]:
    """The lab notebooks in ``folder`` (``NN-Name.ipynb``), optionally only the labs listed ("01,3" or [...])."""
    notebooks = sorted(Path(folder).glob(NOTEBOOK_GLOB))
    if not only:
        return notebooks
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
    labs = {lab_id(nb.stem): nb for nb in notebooks}
    chosen, unknown = [], []
    for w in wanted:
        key = w.zfill(2) if w.isdigit() else lab_id(Path(w).stem)
        (chosen.append(labs[key]) if key in labs else unknown.append(w))
    if unknown:
        have = ", ".join(labs) or "none"
        raise ValueError(f"--only {','.join(unknown)}: no such lab notebook in {folder} (labs found: {have})")
    return sorted(set(chosen))


def kernel_env(results_dir: str | os.PathLike, smoke: bool, gpu_memory_gb: float | None,
               base: dict | None = None) -> dict:
    """The kernel's environment: ours, plus where to record results, the mode and the memory cap."""
    env = dict(os.environ if base is None else base)
    env["LAB_RESULTS_DIR"] = str(results_dir)
    if smoke:
        env["LAB_SMOKE"] = "1"
    else:
        env.pop("LAB_SMOKE", None)  # an exported LAB_SMOKE=1 must not quietly turn a full run into a smoke run
    if gpu_memory_gb:
        env["LAB_GPU_MEMORY_GB"] = f"{gpu_memory_gb:g}"
    else:
        env.pop("LAB_GPU_MEMORY_GB", None)  # 0 = the whole card
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # an exported MPLBACKEND=Agg would warn on plt.show
    return env


# ---------------------------------------------------------------------------------------------------- execution
@dataclass
class Outcome:
    stem: str
    ok: bool
    seconds: float
    cell_index: int | None = None  # the failing cell (0-based index in the notebook, as nbformat counts)
    execution_count: int | None = None  # the failing cell's In [n]
    error: str | None = None  # the error's last line, e.g. "ValueError: boom"
    json_path: Path | None = None
    executed_path: Path | None = None
    kernel_log: Path | None = None  # the kernel process's own stdout/stderr, when it wrote any

    def where(self) -> str:
        """"at cell 14, In [9]: ValueError: boom", or ": <why>" when no cell is to blame."""
        if self.cell_index is None:
            return f": {self.error}"
        count = f", In [{self.execution_count}]" if self.execution_count else ""
        return f" at cell {self.cell_index}{count}: {self.error}"


def _current_env_kernel_manager():
    """A kernel manager that starts ipykernel with *this* interpreter (like nbval's --nbval-current-env), not
    whatever ``python`` an installed "python3" kernelspec happens to find on PATH."""
    import ipykernel.kernelspec
    import zmq
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    # CurveZMQ keys when pyzmq has them: encrypted local traffic, and no "running over TCP without encryption"
    # warning from ipykernel >= 7 in every run's output
    km = KernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnvSpecs())
    if zmq.has("curve") and "transport_encryption" in km.trait_names():
        km.transport_encryption = "auto"
    return km


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ARROW = re.compile(r"^\s*-+>\s*(\d+)\s?(.*)$")


def _culprit_line(cell) -> str | None:
    """From an IPython traceback in ``cell``'s outputs: "29: assert a > b", the cell's own line that raised."""
    for out in cell.get("outputs", []):
        if out.get("output_type") != "error":
            continue
        frames = [_ANSI.sub("", frame) for frame in out.get("traceback", [])]
        cell_frames = [f for f in frames if f.lstrip().startswith("Cell In[")] or frames
        arrows = [m for m in map(_ARROW.match, cell_frames[-1].splitlines()) if m]  # "----> 2     raise ..."
        if arrows:
            number, code = arrows[-1].group(1), arrows[-1].group(2).strip()
            return (f"{number}: {code[:100]}" + ("..." if len(code) > 100 else "")) if code else None
    return None


def execute_notebook(path: Path, env: dict, *, cwd: Path = REPO_ROOT, timeout: int | None = SMOKE_CELL_TIMEOUT,
                     executed_dir: Path | None = None, on_cell=None) -> Outcome:
    """Run one notebook top to bottom in a fresh kernel; never raises for the notebook's own errors.

    Why nbclient: it is the library underneath ``jupyter execute``/``nbconvert --execute`` and papermill, already
    a test dependency, and called in-process it gives what we need and the CLIs do not: per-cell hooks (the
    failing cell's index for the summary, progress), the kernel's env and cwd, and the executed notebook object
    to save somewhere other than the repository. papermill would add a dependency for parameter injection we
    don't use (the notebooks read their mode from the environment, as they do for students and CI).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    state = {"index": None}

    def cell_started(cell, cell_index, **_):
        state["index"] = cell_index
        if on_cell and cell.cell_type == "code":
            on_cell(cell_index, n_code)

    km = _current_env_kernel_manager()
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}}, on_cell_start=cell_started)
    t0 = time.perf_counter()
    outcome = Outcome(path.stem, ok=True, seconds=0.0)
    # the kernel process's own stdout/stderr (C++ libraries writing to the fd, crash messages) go to a log
    # beside the executed copy instead of interleaving with the progress lines; what cells print is in the copy
    if executed_dir is not None:
        executed_dir.mkdir(parents=True, exist_ok=True)
        outcome.kernel_log = executed_dir / f"{path.stem}.kernel.log"
    log = open(outcome.kernel_log, "wb") if outcome.kernel_log else subprocess.DEVNULL
    try:
        # cleanup_kc: nbclient shuts down only kernels it created itself; without it this kernel (and its GPU
        # memory) would live on beside the next notebook's until we exit
        client.execute(env=env, cwd=str(cwd), cleanup_kc=True, stdout=log, stderr=log)
    except CellExecutionError as exc:
        outcome.ok, outcome.error = False, f"{exc.ename}: {exc.evalue}".strip().splitlines()[-1]
    except CellTimeoutError:
        outcome.ok, outcome.error = False, f"timed out (a cell ran longer than {timeout} s)"
    except DeadKernelError as exc:
        outcome.ok, outcome.error = False, f"the kernel died ({exc}); out of host memory?"
    except Exception as exc:  # kernel failed to start, bad notebook JSON...
        outcome.ok, outcome.error = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        if km.has_kernel:  # belt and braces: never leave a kernel behind
            km.shutdown_kernel(now=True)
        if outcome.kernel_log:
            log.close()
            if outcome.kernel_log.stat().st_size == 0:
                outcome.kernel_log.unlink()
                outcome.kernel_log = None
    outcome.seconds = time.perf_counter() - t0
    if not outcome.ok and state["index"] is not None:
        outcome.cell_index = state["index"]
        outcome.execution_count = nb.cells[state["index"]].get("execution_count")
        culprit = _culprit_line(nb.cells[state["index"]])
        if culprit:  # "AssertionError:" alone says little; the line that raised says what broke
            outcome.error = f"{outcome.error.rstrip(': ')} (line {culprit})"
    if executed_dir is not None:
        outcome.executed_path = executed_dir / path.name
        tmp = outcome.executed_path.with_name(f".{path.name}.tmp")
        nbformat.write(nb, tmp)
        os.replace(tmp, outcome.executed_path)
    return outcome


def promote(staging: Path, out: Path, stem: str, expected_mode: str) -> tuple[Path | None, str | None]:
    """Check what a notebook recorded in ``staging`` and move it into ``out``.

    Returns (json path, None), (json path, a note) or (None, why nothing was kept).
    """
    found = {js: json.loads(js.read_text(encoding="utf-8")) for js in sorted(staging.glob("*.json"))}
    if not found:
        return None, "no results recorded (the notebook's last cell should call lu.record_results)"
    for js, data in found.items():
        if data.get("mode") != expected_mode:
            return None, (f"{js.name} was recorded in {data.get('mode')} mode, not {expected_mode}: not kept"
                          + (" (no CUDA GPU in the kernel?)" if expected_mode == "full" else ""))
        missing = [f for f in data.get("figures") or [] if not (staging / f).is_file()]
        if missing:
            return None, f"{js.name} lists figures that were not written: {', '.join(missing)}"
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for js, data in found.items():
        for old in (out / "figures").glob(f"{js.stem}-*.png"):  # this lab's figures from an earlier run
            old.unlink()
        for fig in data.get("figures") or []:
            (out / fig).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / fig, out / fig)
        os.replace(js, out / js.name)  # the JSON last: it is what says the lab's results are complete
    if stem not in {js.stem for js in found}:
        first = next(iter(found))
        return out / first.name, f"recorded as {first.stem!r}, not {stem!r} (record_results' first argument)"
    return out / f"{stem}.json", None


# ---------------------------------------------------------------------------------------------------- rendering
def load_results(out: str | os.PathLike) -> dict[str, dict]:
    """{lab id: recorded JSON} for every ``NN-*.json`` in ``out``."""
    results = {}
    for js in sorted(Path(out).glob("[0-9][0-9]-*.json")):
        results[lab_id(js.stem)] = json.loads(js.read_text(encoding="utf-8"))
    return results


def _gib(n) -> str:
    return f"{n / 2**30:.1f} GiB"


def hardware_line(env: dict) -> str:
    gpu = env.get("gpu") or {}
    if not gpu and not env.get("gpu_name"):
        return f"CPU ({env.get('cpu') or 'unknown'}), no GPU"
    parts = [gpu.get("name") or env.get("gpu_name")]
    total, budget = gpu.get("total_memory_bytes"), gpu.get("budget_bytes")
    if total:
        parts.append(_gib(total))
    if budget and total and budget < total:
        parts.append(f"capped to {_gib(budget)} (`--gpu-memory-gb {env.get('gpu_memory_budget_gb') or budget / 2**30:g}`)")
    elif total:
        parts.append("no memory cap")
    if gpu.get("compute_capability"):
        parts.append(f"compute capability {gpu['compute_capability']}")
    if gpu.get("driver"):
        parts.append(f"driver {gpu['driver']}")
    if gpu.get("cuda"):
        parts.append(f"CUDA {gpu['cuda']}")
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
    """One lab's recorded results as Markdown: provenance header, one table per recorded table, its figures.

    ``figure_prefix`` is prepended to the recorded figure paths (which are relative to the results folder),
    e.g. "results/" for the repository README. ``readme=True`` refuses anything but a full run.
    """
    mode = data.get("mode")
    if readme and mode != "full":
        raise ValueError(f"{data.get('notebook')}: {mode} results never go into README.md (only a full GPU run's)")
    env = data.get("env") or {}
    lines = []
    if mode != "full":
        lines += [f"> **{str(mode).upper()} RUN** (tiny model, few steps): these numbers only show that the "
                  "notebook runs; they are not results.", ""]
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers") if env.get(k))
    lines += [f"- Hardware: {hardware_line(env)}",
              f"- Weights: {weights_line(data)}",
              f"- Run: {mode} mode, {env.get('date') or 'date not recorded'}" + (f"; {versions}" if versions else ""),
              ""]
    lines += render_claims(data.get("claims") or [])
    for name, rows in (data.get("tables") or {}).items():
        lines += [f"*{name}*", "", format_table(rows), ""]
    for key, value in (data.get("notes") or {}).items():
        lines.append(f"- {key}: {value}")
    if data.get("notes"):
        lines.append("")
    for fig in data.get("figures") or []:
        lines.append(f"![{Path(fig).stem}]({figure_prefix}{fig})")
    return "\n".join(lines).rstrip() + "\n"


def render_claims(entries: list[dict], title: str = "Claims of the course design: verdicts from this run") -> list[str]:
    """The claims table (C1-C7 verdicts, labs' ``claims`` entries) as Markdown lines; nothing when there are none."""
    if not entries:
        return []
    from .claims import table_rows

    return [f"*{title}*", "", format_table(table_rows(entries), ["claim", "verdict", "measured", "why", "conditions",
                                                                  "lab"]), ""]


def render_results(results: dict[str, dict], figure_prefix: str = "") -> str:
    """``README-results.md``: every lab's block, under a banner saying which kind of run this was."""
    modes = {d.get("mode") for d in results.values()}
    lines = ["# Lab results", ""]
    if modes - {"full"}:
        lines += ["**Smoke results**: tiny model, few steps, possibly on a CPU. They show that the notebooks run "
                  "end to end; they are not GPU measurements and never go into README.md.", ""]
    if not results:
        lines += ["No lab recorded results.", ""]
    elif any(d.get("claims") for d in results.values()):
        from .claims import collect
        lines += ["## Claims C1-C7 across the labs", ""] + render_claims(collect(results), "Every claim, one verdict")
    for lab, data in sorted(results.items()):
        lines += [f"## {data.get('notebook') or lab}", "", render_lab(data, figure_prefix)]
    return "\n".join(lines).rstrip() + "\n"


def readme_blocks(results: dict[str, dict], figure_prefix: str = f"{RESULTS}/") -> tuple[dict[str, str], list[str]]:
    """({lab: block} for the full-run results, [labs refused because they are not full-run results])."""
    blocks, refused = {}, []
    for lab, data in sorted(results.items()):
        if data.get("mode") == "full":
            blocks[lab] = render_lab(data, figure_prefix, readme=True)
        else:
            refused.append(lab)
    return blocks, refused


def _marker_re(lab: str) -> re.Pattern:
    return re.compile(rf"(<!-- results:{re.escape(lab)} -->)(.*?)(<!-- /results:{re.escape(lab)} -->)", re.S)


def readme_labs(text: str) -> list[str]:
    """Labs that have a marker pair in ``text``."""
    return [lab for lab in sorted(set(re.findall(r"<!-- results:(\d+) -->", text))) if _marker_re(lab).search(text)]


def update_readme(text: str, blocks: dict[str, str]) -> str:
    """Replace what is between each lab's markers with its block; everything else is left byte for byte.

    A lab without a block keeps what it had; a block without markers is ignored (see :func:`readme_labs`).
    Unbalanced or repeated markers raise ValueError rather than guess.
    """
    for lab, block in blocks.items():
        opens, closes = text.count(f"<!-- results:{lab} -->"), text.count(f"<!-- /results:{lab} -->")
        if (opens, closes) == (0, 0):
            continue
        if (opens, closes) != (1, 1) or not _marker_re(lab).search(text):
            raise ValueError(f"README markers for lab {lab}: need exactly one '<!-- results:{lab} -->' followed by "
                             f"one '<!-- /results:{lab} -->' (found {opens} and {closes})")
        text = _marker_re(lab).sub(lambda m: f"{m.group(1)}\n{block.strip()}\n{m.group(3)}", text, count=1)
    return text


def _write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------- the command
def regenerate(notebooks: list[Path], out: Path, *, smoke: bool, gpu_memory_gb: float | None,
               readme: Path | None = None, timeout: int | None = None, log=print) -> list[Outcome]:
    """Execute ``notebooks``, keep what they record in ``out``, write ``out/README-results.md`` and, when
    ``readme`` is given (full runs into results/ only), update its marked sections. Returns one Outcome each."""
    out.mkdir(parents=True, exist_ok=True)
    mode = "smoke" if smoke else "full"
    timeout = timeout or (SMOKE_CELL_TIMEOUT if smoke else FULL_CELL_TIMEOUT)
    tty = sys.stdout.isatty()
    outcomes = []
    for i, nb in enumerate(notebooks, 1):
        head = f"[{i}/{len(notebooks)}] {nb.stem:<28}"
        log(f"{head} running", end="\r" if tty else "\n", flush=True)
        progress = (lambda idx, n: print(f"{head} running cell {idx}", end="\r", flush=True)) if tty else None
        staging = Path(tempfile.mkdtemp(dir=out, prefix=f".staging-{nb.stem}-"))
        try:
            # LAB_RESULTS_READ_DIR: where a lab finds the labs before it (lab 04's C1-C7 table reads them)
            o = execute_notebook(nb, kernel_env(staging, smoke, gpu_memory_gb) | {"LAB_RESULTS_READ_DIR": str(out)},
                                 timeout=timeout,
                                 executed_dir=out / "executed", on_cell=progress)
            if o.ok:
                o.json_path, why = promote(staging, out, nb.stem, mode)
                if o.json_path is None:
                    o.ok, o.error = False, why
                elif why:
                    log(f"  note: {why}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        outcomes.append(o)
        status = "ok" if o.ok else "FAILED"
        log(f"{head} {status:<6} {o.seconds:7.1f} s" + ("" if o.ok else f"  {o.where()[1:].lstrip()}") + " " * 12)

    results = load_results(out)
    _write_text(out / "README-results.md", render_results(results))
    log(f"wrote {out / 'README-results.md'} ({len(results)} labs)")
    if readme is not None:
        if not readme.exists():
            log(f"warning: {readme} not found: README not updated")
        else:
            text = readme.read_text(encoding="utf-8")
            prefix = Path(os.path.relpath(out.resolve(), readme.parent.resolve())).as_posix()
            blocks, refused = readme_blocks(results, "" if prefix == "." else f"{prefix}/")
            missing = sorted(set(blocks) - set(readme_labs(text)))
            try:
                new = update_readme(text, {k: v for k, v in blocks.items() if k not in missing})
            except ValueError as exc:  # broken markers: the results are saved; say so, fail the run
                log(f"error: {readme.name} not updated: {exc}")
                outcomes.append(Outcome(readme.name, ok=False, seconds=0.0, error=str(exc)))
                return outcomes
            if new != text:
                _write_text(readme, new)
            log(f"updated {readme.name}: labs {', '.join(sorted(set(blocks) - set(missing))) or 'none'}"
                + (f"; no markers for {', '.join(missing)}" if missing else "")
                + (f"; refused non-full results of {', '.join(refused)}" if refused else ""))
    return outcomes


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _summary(outcomes: list[Outcome], seconds: float) -> str:
    failed = [o for o in outcomes if not o.ok]
    took = f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.1f} s"
    lines = [f"summary: {len(outcomes) - len(failed)} ok, {len(failed)} failed, {took} in all"]
    for o in failed:
        lines.append(f"  {o.stem} failed{o.where()}")
        if o.executed_path:
            lines.append(f"    executed copy with the traceback: {o.executed_path}")
        if o.kernel_log:
            lines.append(f"    the kernel process's own output: {o.kernel_log}")
    return "\n".join(lines)


def cli_regenerate(args) -> int:
    smoke = bool(args.smoke)
    results_default = REPO_ROOT / RESULTS
    out = Path(args.out).expanduser().resolve() if args.out else None if smoke else results_default
    if smoke and out and (out == results_default or results_default in out.parents):
        print(f"error: --smoke --out {args.out}: smoke results never go into {RESULTS}/ (use a temporary folder, "
              "or leave --out out)", file=sys.stderr)
        return 2
    if out == REPO_ROOT:
        print(f"error: --out {args.out}: not the repository root (the results would litter it); use "
              f"{RESULTS}/ or another folder", file=sys.stderr)
        return 2
    gb = args.gpu_memory_gb
    if gb is not None and gb < 0:
        print(f"error: --gpu-memory-gb {gb:g}: must be >= 0 (0 = no cap)", file=sys.stderr)
        return 2
    try:
        notebooks = find_notebooks(REPO_ROOT, args.only)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not notebooks:
        print(f"error: no lab notebooks ({NOTEBOOK_GLOB}) in {REPO_ROOT}", file=sys.stderr)
        return 2
    if not smoke and not _cuda_available():
        print("error: a full run needs a CUDA GPU (without one every notebook falls back to the tiny smoke "
              "configuration); to check that the notebooks run, use --smoke", file=sys.stderr)
        return 2
    out = out or Path(tempfile.mkdtemp(prefix="lab-smoke-results-"))
    readme = REPO_ROOT / "README.md" if not smoke and out == results_default else None
    cap = f"memory cap {gb:g} GiB" if gb else "no memory cap"
    where = " (temporary folder)" if smoke and not args.out else ""
    print(f"regenerate: {len(notebooks)} notebook(s), {'smoke' if smoke else 'full'} mode, {cap}, "
          f"results -> {out}{where}")
    t0 = time.perf_counter()
    outcomes = regenerate(notebooks, out, smoke=smoke, gpu_memory_gb=gb, readme=readme)
    print(_summary(outcomes, time.perf_counter() - t0))
    return 0 if all(o.ok for o in outcomes) else 1
