"""Running one lab notebook safely: in a fresh kernel of this interpreter, in a worker thread, stoppable by a signal.
:func:`execute_notebook` runs it top to bottom with nbclient and returns an :class:`Outcome` (ok, seconds, the failing
cell and line; never raises for the notebook's errors); the kernel's output goes to a log beside the executed copy, and
the kernel is always shut down. Ctrl-C and SIGTERM: :class:`SignalGuard`. ``regenerate`` runs every lab through it."""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.results import write_atomic

REPO_ROOT = Path(__file__).resolve().parents[2]  # the notebooks' working directory
SMOKE_CELL_TIMEOUT = 900  # s per cell; a smoke notebook takes ~1 min in all on a 2-core CPU
FULL_CELL_TIMEOUT = 4 * 3600  # s per cell; a full sweep cell can legitimately take long, but not forever


class KernelPollNoise(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for nbclient's kernel-alive poll, and nothing else: that
    poll can outlive a kernel killed on Ctrl-C, and its traceback would bury the line that says what stopped."""
    def filter(self, record: logging.LogRecord) -> bool:
        return "_async_poll_kernel_alive" not in record.getMessage()


def quiet_kernel_poll() -> None:
    """Install :class:`KernelPollNoise` on asyncio's logger, once per process (:func:`execute_notebook` calls it)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, KernelPollNoise) for f in log.filters):
        log.addFilter(KernelPollNoise())


@dataclass
class Outcome:
    """How one notebook run went: ok or not, how long, and where it failed (see :meth:`where`)."""

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
    """A kernel manager that starts ipykernel with *this* interpreter, not whatever ``python`` a "python3" kernelspec
    finds on PATH. Async, as nbclient's default: a blocking client would wait forever on a dead kernel."""
    import ipykernel.kernelspec
    import zmq
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    # CurveZMQ keys when pyzmq has them: encrypted local traffic, and no "running over TCP without encryption"
    # warning from ipykernel >= 7 in every run's output
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnvSpecs())
    if zmq.has("curve") and "transport_encryption" in km.trait_names():
        km.transport_encryption = "auto"
    return km


def _death(returncode: int | None) -> str:
    """How the kernel process ended, in words: "killed by SIGKILL", "exit code 3"."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


_CONFLICT = re.compile(r"^(<{7}|={7}|>{7})( |$)", re.M)


def read_notebook(path: Path):
    """The notebook at ``path`` (nbformat v4), or ValueError with one line naming the file and what is wrong: not
    UTF-8, not JSON (at which line; git merge conflict markers said as such), or not a notebook."""
    import nbformat

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a readable notebook (not UTF-8 text, offset {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{path}: not a readable notebook ({exc.strerror or exc})") from None
    conflict = _CONFLICT.search(text)
    try:
        json.loads(text)
    except ValueError as exc:
        if conflict:
            line = text.count("\n", 0, conflict.start()) + 1
            marker = text[conflict.start():].split("\n", 1)[0][:40]
            raise ValueError(f"{path}: not a readable notebook: git merge conflict markers (line {line}: {marker!r}); "
                             "resolve the conflict (or git checkout the file)") from None
        msg = getattr(exc, "msg", str(exc))
        raise ValueError(f"{path}: not a readable notebook: not JSON "
                         f"(line {getattr(exc, 'lineno', '?')}: {msg})") from None
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as exc:  # noqa: BLE001 - nbformat raises several kinds; one line says which
        raise ValueError(f"{path}: not a readable notebook ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    if not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path}: not a readable notebook (no list of 'cells')")
    return nb


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
    """SIGINT or SIGTERM arrived: stop now. A BaseException, so no ``except Exception`` swallows it; ``finished`` /
    ``current`` / ``not_started`` are filled in by :func:`labutils.tools.regenerate.regenerate`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.finished: list[Outcome] = []
        self.current: str | None = None
        self.not_started: list[str] = []
        self.rendered = False  # the results pages were written (after a finished lab): they show what finished

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
            parts.append(f"stopped {self.current}")
        if self.not_started:
            parts.append(f"not started {', '.join(self.not_started)}")
        parts.append("the results pages show the finished labs (regenerate --render-only redraws them)" if self.rendered
                     else "README-results.md and README.md not updated")
        return "; ".join(parts)


class SignalGuard:
    """While active (main thread only), SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, which then
    shuts the kernel down itself. Inside ``critical()`` a signal is held until the block ends, so a file is never half
    replaced. nbclient runs in a worker thread (:func:`execute_notebook`), where it cannot install its own handlers."""

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
    """Run one notebook top to bottom in a fresh kernel, nbclient in a worker thread while the main thread waits for a
    signal (:class:`SignalGuard`); the executed copy is saved outside the repository. On :class:`Interrupted` the
    kernel is killed, nothing is written, and it propagates."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    from jupyter_core.utils import run_sync

    try:
        nb = read_notebook(path)
    except ValueError as exc:  # checked before the run; it may have changed since (a git checkout mid-run)
        return Outcome(path.stem, ok=False, seconds=0.0, error=str(exc).removeprefix(f"{path}: "))
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    state = {"index": None, "stop": False, "process": None}

    def kernel_ready(**_):  # the kernel process, to say how it ended if it dies (the provisioner forgets it)
        state["process"] = getattr(getattr(km, "provisioner", None), "process", None)

    def cell_started(cell, cell_index, **_):
        if state["stop"]:  # interrupted while the kernel was starting: run no cell
            raise RuntimeError("interrupted")
        state["index"] = cell_index
        if on_cell and cell.cell_type == "code":
            on_cell(cell_index, n_code)

    quiet_kernel_poll()  # its traceback after a killed kernel would land after our summary line
    km = _current_env_kernel_manager()
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}}, on_cell_start=cell_started,
                            on_notebook_start=kernel_ready)
    t0 = time.perf_counter()
    outcome = Outcome(path.stem, ok=True, seconds=0.0)
    # the kernel process's own stdout/stderr (C++ libraries, crash messages) go to a log beside the executed copy,
    # under a name of this run's own, renamed at the end: runs into one folder never touch each other's log
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
            proc = state["process"]
            code = proc.poll() if proc is not None else None
            why = " (the host's OOM killer? out of host memory)" if code == -signal.SIGKILL else ""
            outcome.ok, outcome.error = False, f"the kernel died: {_death(code)}{why}"
        elif isinstance(exc, Exception):  # kernel failed to start, bad notebook JSON...
            outcome.ok, outcome.error = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
        elif exc is not None:
            raise exc
    finally:
        # nbclient's clean-up at exit, left armed by a kernel that never started, fails an assert then: the kernel
        # is shut down here
        atexit.unregister(client._cleanup_kernel)
        if km.has_kernel:  # belt and braces: never leave a kernel behind
            if interrupted:
                _kill_kernel(km)
            with contextlib.suppress(Exception):
                run_sync(km.shutdown_kernel)(now=True)
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
    if executed_dir is not None:  # its figures go to figures/: not kept twice (issue 45 §5), their text line stays
        for data in (o["data"] for c in nb.cells for o in c.get("outputs", ()) if "image/png" in o.get("data", {})):
            data["text/plain"], _ = data.get("text/plain") or "<figure: in the lab's figures/>", data.pop("image/png")
        outcome.executed_path = executed_dir / path.name
        with guard.critical():
            write_atomic(outcome.executed_path, nbformat.writes(nb).encode("utf-8"))
    return outcome
