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

Nothing a user types loses work: bad options, an --out that cannot be written, a corrupt results file or broken
README markers are refused (exit 2, one line) before any notebook runs. Results are keyed by the notebook that
wrote them (``<stem>.json``), so a stale ``NN-Old_Name.json`` never shadows a lab. The README is rewritten only
between well-formed markers, keeping every other byte, its line endings, its mode, and a symlink as a symlink.
Ctrl-C / SIGTERM stop the run within seconds (the kernel is killed, no further notebook starts, nothing
half-written is left) with exit code 130 / 143 and one line saying what finished and what did not.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .results import format_table, write_atomic

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
    labs = {lab_id(nb.stem): nb for nb in notebooks}
    if len(labs) < len(notebooks):
        ids = [lab_id(nb.stem) for nb in notebooks]
        raise ValueError(f"{folder}: several notebooks for lab {', '.join(sorted({i for i in ids if ids.count(i) > 1}))}"
                         "; results are keyed by lab number, so keep one notebook per NN-")
    if not only:
        return notebooks
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
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
    env["LAB_PROGRESS"] = "0"  # no tqdm bars in executed copies: saved, a bar reads "0%|" (env.progress_bars)
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


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: stop now. A BaseException, like KeyboardInterrupt, so that no ``except Exception``
    on the way swallows it. ``finished``/``current``/``not_started`` are filled in by :func:`regenerate`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.finished: list[Outcome] = []
        self.current: str | None = None
        self.not_started: list[str] = []
        self.rendered = False  # the signal came while the results pages were being written: they are complete

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def summary(self) -> str:
        """One line: what finished, what was stopped, what never started."""
        done = ", ".join(f"{o.stem} ({'ok' if o.ok else 'failed'})" for o in self.finished) or "none"
        parts = [f"interrupted by {self.name}: finished {done}"]
        if self.current:
            parts.append(f"stopped {self.current} (kernel shut down, nothing of it kept)")
        if self.not_started:
            parts.append(f"not started {', '.join(self.not_started)}")
        parts.append("results pages written" if self.rendered else "README-results.md and README.md not updated")
        return "; ".join(parts)


class SignalGuard:
    """While active (main thread only), SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, which
    then shuts the kernel down itself. Inside ``critical()`` (moving results into place, writing a README) a
    signal is held until the block ends, so a file is never half replaced. nbclient installs its own handlers on
    the event loop it runs in; that loop runs in a worker thread (see :func:`execute_notebook`), where nbclient
    cannot install them, so ours stay in charge."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.pending: int | None = None
        self.depth = 0
        self.stopping = False
        self._saved: dict = {}

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum, frame) -> None:
        if self.stopping:  # already stopping: a second Ctrl-C must not cut the clean-up short
            return
        if self.depth:
            self.pending = self.pending or signum
            return
        self.stopping = True
        raise Interrupted(signum)

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending and not self.stopping:
                signum, self.pending, self.stopping = self.pending, None, True
                raise Interrupted(signum)


NO_GUARD = SignalGuard()  # never entered: critical() only nests
STOP_GRACE = 5.0  # s to wait for the execution thread once the kernel is killed


def _kill_kernel(km) -> None:
    """Kill the kernel's process group now (jupyter_client starts each kernel in a session of its own)."""
    prov = getattr(km, "provisioner", None)
    proc = getattr(prov, "process", None)
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(getattr(prov, "pgid", None) or proc.pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):
            proc.kill()


def execute_notebook(path: Path, env: dict, *, cwd: Path = REPO_ROOT, timeout: int | None = SMOKE_CELL_TIMEOUT,
                     executed_dir: Path | None = None, on_cell=None, guard: SignalGuard = NO_GUARD) -> Outcome:
    """Run one notebook top to bottom in a fresh kernel; never raises for the notebook's own errors.

    Why nbclient: it is the library underneath ``jupyter execute``/``nbconvert --execute`` and papermill, already
    a test dependency, and called in-process it gives what we need and the CLIs do not: per-cell hooks (the
    failing cell's index for the summary, progress), the kernel's env and cwd, and the executed notebook object
    to save somewhere other than the repository. papermill would add a dependency for parameter injection we
    don't use (the notebooks read their mode from the environment, as they do for students and CI).

    nbclient runs in a worker thread: the main thread only waits, so a signal reaches our handler (see
    :class:`SignalGuard`); on :class:`Interrupted` the kernel is killed, nothing is written, and it propagates.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    state = {"index": None, "stop": False}

    def cell_started(cell, cell_index, **_):
        if state["stop"]:  # interrupted while the kernel was starting: run no cell
            raise RuntimeError("interrupted")
        state["index"] = cell_index
        if on_cell and cell.cell_type == "code":
            on_cell(cell_index, n_code)

    km = _current_env_kernel_manager()
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}}, on_cell_start=cell_started)
    t0 = time.perf_counter()
    outcome = Outcome(path.stem, ok=True, seconds=0.0)
    # the kernel process's own stdout/stderr (C++ libraries writing to the fd, crash messages) go to a log
    # beside the executed copy instead of interleaving with the progress lines; what cells print is in the copy.
    # It is written under a name of this run's own and renamed at the end, so that runs into one folder at the
    # same time never write to, or delete, each other's log.
    log_tmp, log = None, subprocess.DEVNULL
    failure: list[BaseException] = []

    def work():
        try:
            # cleanup_kc: nbclient shuts down only kernels it created itself; without it this kernel (and its GPU
            # memory) would live on beside the next notebook's until we exit
            client.execute(env=env, cwd=str(cwd), cleanup_kc=True, stdout=log, stderr=log)
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)

    interrupted = True
    try:
        if executed_dir is not None:
            executed_dir.mkdir(parents=True, exist_ok=True)
            fd, log_tmp = tempfile.mkstemp(dir=executed_dir, prefix=f".{path.stem}.kernel.", suffix=".log.tmp")
            log = os.fdopen(fd, "wb")
        worker = threading.Thread(target=work, name=f"nbclient {path.stem}", daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.2)  # signals are handled between waits
        except Interrupted:
            state["stop"] = True
            deadline = time.monotonic() + STOP_GRACE
            while worker.is_alive() and time.monotonic() < deadline:
                _kill_kernel(km)  # again each turn: a kernel may have been starting at the first try
                worker.join(0.2)
            raise
        interrupted = False
        exc = failure[0] if failure else None
        if isinstance(exc, CellExecutionError):
            outcome.ok, outcome.error = False, f"{exc.ename}: {exc.evalue}".strip().splitlines()[-1]
        elif isinstance(exc, CellTimeoutError):
            outcome.ok, outcome.error = False, f"timed out (a cell ran longer than {timeout} s)"
        elif isinstance(exc, DeadKernelError):
            outcome.ok, outcome.error = False, f"the kernel died ({exc}); out of host memory?"
        elif isinstance(exc, Exception):  # kernel failed to start, bad notebook JSON...
            outcome.ok, outcome.error = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
        elif exc is not None:
            raise exc
    finally:
        if km.has_kernel:  # belt and braces: never leave a kernel behind
            if interrupted:
                _kill_kernel(km)
            with contextlib.suppress(Exception):
                km.shutdown_kernel(now=True)
        if log is not subprocess.DEVNULL:
            log.close()
        if log_tmp:
            final = executed_dir / f"{path.stem}.kernel.log"
            with contextlib.suppress(FileNotFoundError):
                if not interrupted and os.path.getsize(log_tmp) > 0:
                    os.replace(log_tmp, final)
                    outcome.kernel_log = final
                else:
                    os.unlink(log_tmp)
    outcome.seconds = time.perf_counter() - t0
    if not outcome.ok and state["index"] is not None:
        outcome.cell_index = state["index"]
        outcome.execution_count = nb.cells[state["index"]].get("execution_count")
        culprit = _culprit_line(nb.cells[state["index"]])
        if culprit:  # "AssertionError:" alone says little; the line that raised says what broke
            outcome.error = f"{outcome.error.rstrip(': ')} (line {culprit})"
    if executed_dir is not None:
        outcome.executed_path = executed_dir / path.name
        with guard.critical():
            write_atomic(outcome.executed_path, nbformat.writes(nb).encode("utf-8"))
    return outcome


def promote(staging: Path, out: Path, stem: str, expected_mode: str) -> tuple[Path | None, str | None]:
    """Check what a notebook recorded in ``staging`` and move it into ``out``.

    Results are keyed by the notebook that wrote them: only ``<stem>.json`` (the notebook's own name) is kept.
    Returns (json path, None) or (None, why nothing was kept).
    """
    found = sorted(staging.glob("*.json"))
    if not found:
        return None, "no results recorded (the notebook's last cell should call lu.record_results)"
    if [js.stem for js in found] != [stem]:
        names = ", ".join(js.stem for js in found)
        return None, (f"recorded as {names}, not {stem!r}: not kept (record_results' first argument must be the "
                      "notebook's own name, so that results are keyed by the notebook that wrote them)")
    js = found[0]
    try:
        data = json.loads(js.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        return None, f"{js.name} is not readable JSON ({str(exc).splitlines()[0][:120]}): not kept"
    if not isinstance(data, dict) or data.get("mode") != expected_mode:
        mode = data.get("mode") if isinstance(data, dict) else None
        return None, (f"{js.name} was recorded in {mode} mode, not {expected_mode}: not kept"
                      + (" (no CUDA GPU in the kernel?)" if expected_mode == "full" else ""))
    figures = data.get("figures") or []
    missing = [f for f in figures if not (staging / f).is_file()]
    if missing:
        return None, f"{js.name} lists figures that were not written: {', '.join(missing)}"
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for old in (out / "figures").glob(f"{stem}-*.png"):  # this lab's figures from an earlier run
        old.unlink(missing_ok=True)  # missing_ok: a run beside this one may have moved it already
    for fig in figures:
        (out / fig).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / fig, out / fig)
    os.replace(js, out / js.name)  # the JSON last: it is what says the lab's results are complete
    return out / f"{stem}.json", None


# ---------------------------------------------------------------------------------------------------- rendering
class ResultsError(ValueError):
    """A results file that cannot be read: one line naming it."""


def load_results(out: str | os.PathLike, stems: list[str] | None = None) -> dict[str, dict]:
    """{lab id: recorded JSON}, keyed by the notebook that wrote it: ``<stem>.json`` for each notebook stem, so a
    stale or renamed ``NN-Old_Name.json`` lying in ``out`` never stands in for the current lab. Without
    ``stems``, every ``NN-*.json`` in ``out`` (one per lab id, else ResultsError). A file that is not a JSON
    object raises ResultsError (one line)."""
    out = Path(out)
    if stems is None:
        files = sorted(out.glob("[0-9][0-9]-*.json"))
        ids = [lab_id(js.stem) for js in files]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ResultsError(f"{out}: several results files for lab {', '.join(twice)}; name the notebooks")
    else:
        files = [out / f"{stem}.json" for stem in stems if (out / f"{stem}.json").is_file()]
    results = {}
    for js in files:
        try:
            data = json.loads(js.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ResultsError(f"{js}: not a readable results file ({str(exc).splitlines()[0][:120]}); "
                               "restore it (git checkout) or delete it") from None
        if not isinstance(data, dict) or not isinstance(data.get("tables", {}), dict):
            raise ResultsError(f"{js}: not a results file (a JSON object with 'tables' expected); restore it "
                               "(git checkout) or delete it")
        results[lab_id(js.stem)] = data
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


_MARKER = re.compile(r"<!-- (/?)results:(\d+) -->")


def marker_spans(text: str) -> dict[str, tuple[int, int]]:
    """{lab: (start, end) of what lies between ``<!-- results:NN -->`` and ``<!-- /results:NN -->``}.

    Every marker in ``text`` is checked, whichever labs are being rendered: one block per lab, each closed by its
    own closing marker before any other marker appears (no nesting, no interleaving, nothing unclosed, no stray
    closing marker). Any problem raises ValueError with one line naming the line and the marker."""
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


def readme_labs(text: str) -> list[str]:
    """Labs that have a marker pair in ``text`` (ValueError when the markers are broken)."""
    return sorted(marker_spans(text))


def update_readme(text: str, blocks: dict[str, str]) -> str:
    """Replace what is between each lab's markers with its block; everything else is left byte for byte.

    A lab without a block keeps what it had; a block without markers is ignored (see :func:`readme_labs`).
    Broken markers anywhere (see :func:`marker_spans`) raise ValueError rather than guess. The block takes the
    text's line ending (CRLF stays CRLF)."""
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


def write_keeping_file(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically, keeping what the file is: through a symlink (the link stays, its
    target is rewritten), with the file's mode, and the exact bytes of ``text`` (no newline translation)."""
    write_atomic(Path(os.path.realpath(path)), text.encode("utf-8"))


def _write_text(path: Path, text: str) -> None:
    write_keeping_file(path, text)


# ---------------------------------------------------------------------------------------------------- the command
def regenerate(notebooks: list[Path], out: Path, *, smoke: bool, gpu_memory_gb: float | None,
               readme: Path | None = None, timeout: int | None = None, log=print,
               stems: list[str] | None = None) -> list[Outcome]:
    """Execute ``notebooks``, keep what they record in ``out``, write ``out/README-results.md`` and, when
    ``readme`` is given (full runs into results/ only), update its marked sections. Returns one Outcome each.

    ``stems``: the notebooks whose results are rendered (default: those run); results are keyed by them.
    SIGINT/SIGTERM (main thread) stop it: the running notebook's kernel is killed, nothing more is run or
    rendered, and :class:`Interrupted` propagates with what finished and what did not."""
    out.mkdir(parents=True, exist_ok=True)
    mode = "smoke" if smoke else "full"
    timeout = timeout or (SMOKE_CELL_TIMEOUT if smoke else FULL_CELL_TIMEOUT)
    stems = stems or [nb.stem for nb in notebooks]
    tty = sys.stdout.isatty()
    outcomes = []
    with SignalGuard() as guard:
        current, rendered = None, False
        try:
            for i, nb in enumerate(notebooks, 1):
                current = nb.stem
                head = f"[{i}/{len(notebooks)}] {nb.stem:<28}"
                log(f"{head} running", end="\r" if tty else "\n", flush=True)
                progress = (lambda idx, n: print(f"{head} running cell {idx}", end="\r", flush=True)) if tty else None
                staging = None
                try:
                    staging = Path(tempfile.mkdtemp(dir=out, prefix=f".staging-{nb.stem}-"))
                    # LAB_RESULTS_READ_DIR: where a lab finds the labs before it (lab 04's C1-C7 table reads them)
                    o = execute_notebook(nb, kernel_env(staging, smoke, gpu_memory_gb) | {"LAB_RESULTS_READ_DIR": str(out)},
                                         timeout=timeout, executed_dir=out / "executed", on_cell=progress, guard=guard)
                    if o.ok:
                        with guard.critical():  # results move in whole or not at all
                            o.json_path, why = promote(staging, out, nb.stem, mode)
                        if o.json_path is None:
                            o.ok, o.error = False, why
                        elif why:
                            log(f"  note: {why}")
                finally:
                    if staging is not None:
                        shutil.rmtree(staging, ignore_errors=True)
                with guard.critical():
                    outcomes.append(o)
                    current = None
                status = "ok" if o.ok else "FAILED"
                log(f"{head} {status:<6} {o.seconds:7.1f} s" + ("" if o.ok else f"  {o.where()[1:].lstrip()}")
                    + " " * 12)

            with guard.critical():
                results = load_results(out, stems)
                write_atomic(out / "README-results.md", render_results(results).encode("utf-8"))
                log(f"wrote {out / 'README-results.md'} ({len(results)} labs)")
                if readme is not None:
                    _update_readme_file(readme, out, results, outcomes, log)
                rendered = True
        except Interrupted as exc:
            exc.rendered = rendered
            exc.finished, exc.current = list(outcomes), current
            exc.not_started = [nb.stem for nb in notebooks[len(outcomes) + (current is not None):]]
            raise
    return outcomes


def _update_readme_file(readme: Path, out: Path, results: dict, outcomes: list[Outcome], log) -> None:
    if not readme.exists():
        log(f"warning: {readme} not found: README not updated")
        return
    try:
        text = read_readme(readme)
        prefix = Path(os.path.relpath(out.resolve(), readme.parent.resolve())).as_posix()  # the link's folder
        blocks, refused = readme_blocks(results, "" if prefix == "." else f"{prefix}/")
        present = set(marker_spans(text))
        missing = sorted(set(blocks) - present)
        new = update_readme(text, {k: v for k, v in blocks.items() if k in present})
    except ValueError as exc:  # broken markers: the results are saved; say so, fail the run
        log(f"error: {readme.name} not updated: {exc}")
        outcomes.append(Outcome(readme.name, ok=False, seconds=0.0, error=str(exc)))
        return
    if new != text:
        write_keeping_file(readme, new)
    log(f"updated {readme.name}: labs {', '.join(sorted(set(blocks) - set(missing))) or 'none'}"
        + (f"; no markers for {', '.join(missing)}" if missing else "")
        + (f"; refused non-full results of {', '.join(refused)}" if refused else ""))


def _cuda_available() -> bool:
    from . import device as dev

    return dev.cuda_available()


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


def run_doctor_first(out: Path, gpu_memory_gb: float | None) -> int:
    """``python -m labutils doctor`` in its own process, with the notebooks' memory budget; its JSON goes to
    ``<out>/doctor.json``. Returns its exit code (1: something failed)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "LAB_GPU_MEMORY_GB"}
    if gpu_memory_gb:
        env["LAB_GPU_MEMORY_GB"] = f"{gpu_memory_gb:g}"
    print("regenerate: checking this machine first (python -m labutils doctor)", flush=True)
    return subprocess.run([sys.executable, "-m", "labutils", "doctor", "--json", str(out / "doctor.json")],
                          cwd=REPO_ROOT, env=env).returncode


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cli_regenerate(args) -> int:
    """Everything a user typed is checked first (exit 2, one line); only then does any notebook run."""
    from .results import OutputPathError, check_output_dir

    smoke = bool(args.smoke)
    results_default = REPO_ROOT / RESULTS
    out = Path(args.out).expanduser().resolve() if args.out else None if smoke else results_default
    if smoke and out and (out == results_default or results_default in out.parents):
        return _refuse(f"--smoke --out {args.out}: smoke results never go into {RESULTS}/ (use a temporary folder, "
                       "or leave --out out)")
    if out == REPO_ROOT:
        return _refuse(f"--out {args.out}: not the repository root (the results would litter it); use "
                       f"{RESULTS}/ or another folder")
    gb = args.gpu_memory_gb
    if gb is not None and not (gb >= 0):  # the CLI's type already refuses these; regenerate() may be called too
        return _refuse(f"--gpu-memory-gb {gb:g}: must be >= 0 (0 = no cap: the whole card)")
    folder = Path(args.notebooks).expanduser().resolve() if getattr(args, "notebooks", None) else REPO_ROOT
    if not folder.is_dir():
        return _refuse(f"--notebooks {args.notebooks}: not a folder")
    try:
        every = find_notebooks(folder)
        notebooks = find_notebooks(folder, args.only)
        if out is not None:
            check_output_dir(out, "--out")
    except (ValueError, OutputPathError) as exc:
        return _refuse(str(exc))
    if not notebooks:
        return _refuse(f"no lab notebooks ({NOTEBOOK_GLOB}) in {folder}")
    stems = [nb.stem for nb in every]
    readme = REPO_ROOT / "README.md" if not smoke and out == results_default and folder == REPO_ROOT else None
    try:  # refuse now, not after the run: a corrupt results file
        if out is not None and out.is_dir():
            load_results(out, stems)
    except ResultsError as exc:
        return _refuse(str(exc))
    if readme is not None and readme.exists():  # ... or README markers that would refuse the rendering
        try:
            marker_spans(read_readme(readme))
        except ValueError as exc:
            return _refuse(f"{exc}" if str(exc).startswith(str(readme)) else f"{readme}: {exc}")
    if not smoke and not _cuda_available():
        return _refuse("a full run needs a CUDA GPU (without one every notebook falls back to the tiny smoke "
                       "configuration); to check that the notebooks run, use --smoke")
    out = out or Path(tempfile.mkdtemp(prefix="lab-smoke-results-"))
    cap = f"memory cap {gb:g} GiB" if gb else "no memory cap"
    where = " (temporary folder)" if smoke and not args.out else ""
    print(f"regenerate: {len(notebooks)} notebook(s), {'smoke' if smoke else 'full'} mode, {cap}, "
          f"results -> {out}{where}", flush=True)
    t0 = time.perf_counter()
    if not smoke and not getattr(args, "skip_doctor", False):
        code = run_doctor_first(out, gb)
        if code != 0:
            print(f"regenerate: `python -m labutils doctor` failed (exit {code}; its table is above, its JSON in "
                  f"{out / 'doctor.json'}): no notebook was run. Fix what failed, or pass --skip-doctor to run "
                  f"the labs anyway.", file=sys.stderr)
            return 1
    try:
        outcomes = regenerate(notebooks, out, smoke=smoke, gpu_memory_gb=gb, readme=readme, stems=stems)
    except Interrupted as exc:
        print(exc.summary(), file=sys.stderr, flush=True)
        return exc.exit_code
    print(_summary(outcomes, time.perf_counter() - t0))
    return 0 if all(o.ok for o in outcomes) else 1
