"""A lab notebook's cells run in a real Jupyter kernel, as a student runs them (tests/test_interrupts.py).

:class:`LabKernel` starts ipykernel with this interpreter (cwd: the repository root, smoke mode, every output folder
of the lab under a private temp folder, as ``regenerate`` points them), runs code cells one at a time and can
interrupt one partway (``KernelManager.interrupt_kernel``: the SIGINT of Jupyter's stop button). :func:`table_state`
reads the lab's ``TABLES`` through the kernel: for each table, the identity of its list and every row's measured
memory columns, so a test can tell which cell recorded a table with a peak or a time (a *measuring cell*) and
compare its memory columns with a clean run's.
"""
from __future__ import annotations

import json
import os
import queue
import re
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# a table's column that holds memory (compared after an interrupt) or time (it marks a measuring cell, not compared)
MEMORY_COLUMN = r"peak|bytes|mib|gib|memory|saving|alloc"
MEASURED_COLUMN = r"peak|time|\bstep_s\b|_ms\b|\(ms\)|per_s\b|tokens/s|tflops|overhead"  # a peak or a time: a measurement
NOT_IDENTITY = r"error|why|reason|note|reading|status"  # text columns that quote numbers, or compared: not a name

PROBE = r'''
def _lab_kernel_probe(memory=%r, measured=%r, not_ident=%r):
    import json, math, re
    out = {}
    for name, rows in (globals().get("TABLES") or {}).items():
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            continue
        cols = {c for r in rows for c in r}
        mem = sorted(c for c in cols if re.search(memory, c, re.I) or c == "status")  # "ok" / "oom" compared too
        ident = sorted(c for c in cols if c not in mem and not re.search(not_ident, c, re.I)
                       and all(isinstance(r.get(c), (str, bool, type(None))) for r in rows))
        num = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v
        out[name] = {"id": id(rows), "measured": any(re.search(measured, c, re.I) for c in cols), "memory": mem,
                     "rows": [[[r.get(c) for c in ident], {c: num(r.get(c)) for c in mem if c in r}] for r in rows]}
    print(json.dumps(out, default=str))
''' % (MEMORY_COLUMN, MEASURED_COLUMN, NOT_IDENTITY)


@dataclass
class Reply:
    status: str            # "ok" or "error"
    ename: str | None      # the error's class name ("KeyboardInterrupt")
    text: str              # everything the cell printed or displayed as text
    seconds: float
    interrupted_at: float | None = None  # seconds after the start when interrupt_kernel was sent
    widget_views: int = 0  # outputs drawn as a Jupyter widget (a saved notebook reopens them as "model not found")

    def bars_left(self) -> list[str]:
        """Progress bars still on screen when the cell ended: each output line's text after its last carriage
        return (how tqdm redraws and clears a bar), where it reads as a bar ("40%|####      | 2/5 [")."""
        return [seen for line in self.text.split("\n") if BAR.search(seen := line.rsplit("\r", 1)[-1])]


BAR = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")
WIDGET = "application/vnd.jupyter.widget-view+json"


def code_cells(notebook: Path) -> list[tuple[int, str]]:
    """(index in the notebook, source) of every code cell."""
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    return [(i, "".join(c["source"])) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def notebook_of(lab: str) -> Path:
    return next(REPO.glob(f"{lab}-*.ipynb"))


class LabKernel:
    """``with LabKernel(out) as k: k.run(code)``: one fresh kernel, shut down at the end whatever happens."""

    def __init__(self, out: Path):
        import ipykernel.kernelspec
        import zmq
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        from labutils.core.results import ARTIFACTS_ENV
        from labutils.tools.regenerate import kernel_env

        class ThisPython(KernelSpecManager):  # ipykernel of this interpreter, not whatever "python3" is on PATH
            def get_kernel_spec(self, kernel_name):
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                              **ipykernel.kernelspec.get_kernel_dict())

        out = Path(out)
        (out / "results").mkdir(parents=True, exist_ok=True)
        env = kernel_env(out / "results", smoke=True, gpu_memory_gb=8) | {
            "LAB_RESULTS_READ_DIR": str(out / "results"), ARTIFACTS_ENV: str(out / "artifacts"),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "LAB_PROGRESS": "1"}  # progress bars on, as a student has them (regenerate turns them off)
        self.km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())
        if zmq.has("curve") and "transport_encryption" in self.km.trait_names():  # no "without encryption" warning
            self.km.transport_encryption = "auto"
        self.km.start_kernel(cwd=str(REPO), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=120)
            assert self.run(PROBE).status == "ok"
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "LabKernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def run(self, code: str, interrupt_after: float | None = None, timeout: float = 900) -> Reply:
        """Execute ``code``; with ``interrupt_after``, interrupt the kernel that many seconds after the start."""
        msg_id = self.kc.execute(code, store_history=True)
        start, sent, text, ename, widgets = time.monotonic(), None, [], None, 0
        while True:
            now = time.monotonic() - start
            if now > timeout:
                raise TimeoutError(f"cell still running after {timeout:.0f} s:\n{code[:300]}")
            wait = 0.5 if interrupt_after is None or sent is not None else max(0.001, interrupt_after - now)
            try:
                msg = self.kc.get_iopub_msg(timeout=wait)
            except queue.Empty:
                msg = None
            if sent is None and interrupt_after is not None and time.monotonic() - start >= interrupt_after:
                self.km.interrupt_kernel()
                sent = time.monotonic() - start
            if msg is None or msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind in ("display_data", "execute_result"):
                widgets += WIDGET in content["data"]
                text.append(content["data"].get("text/markdown") or content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                ename = content["ename"]
                text.append(f"{content['ename']}: {content['evalue']}\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=60)
        status = reply["content"]["status"]
        return Reply(status, ename or reply["content"].get("ename"), "".join(text), time.monotonic() - start, sent,
                     widgets)

    def tables(self) -> dict:
        """The lab's TABLES now (see :data:`PROBE`): {name: {"id", "timed", "memory", "rows"}}."""
        r = self.run("_lab_kernel_probe()")
        assert r.status == "ok", r.text
        return json.loads(r.text.strip().splitlines()[-1])


    def leftovers(self) -> list:
        """labutils.core.memory.LEFTOVERS in the kernel: every measurement start that found memory above the lab's
        baseline (what the lab's results record)."""
        r = self.run("import json as _j, labutils.core.memory as _m; print(_j.dumps(getattr(_m, 'LEFTOVERS', []))); del _j, _m")
        assert r.status == "ok", r.text
        return json.loads(r.text.strip().splitlines()[-1])


def recorded(before: dict, after: dict) -> dict:
    """The tables a cell recorded (assigned anew, or whose rows changed) that hold a peak or a time: a cell that
    records one is a measuring cell."""
    return {name: t for name, t in after.items()
            if (name not in before or before[name]["id"] != t["id"] or before[name]["rows"] != t["rows"])
            and t["measured"] and t["rows"]}


def added(before: dict, after: dict, names) -> dict:
    """The rows a run put into each of ``names``: all of a table it assigned anew, only the new ones of a table it
    appended to (lab 03's toy table grows by its rows on every run of the cell)."""
    out = {}
    for name in names:
        t, old = after.get(name), before.get(name)
        if t is not None:
            kept = old is not None and old["id"] == t["id"] and t["rows"][:len(old["rows"])] == old["rows"]
            out[name] = {**t, "rows": t["rows"][len(old["rows"]):] if kept else t["rows"]}
    return out


def memory_by_row(table: dict) -> dict:
    """{row identity: its memory columns}: identity is the row's text columns (its name, kind...) with its place
    among the rows of that identity."""
    out, seen = {}, {}
    for ident, memory in table["rows"]:
        key = json.dumps(ident)
        seen[key] = seen.get(key, 0) + 1
        out[f"{key}#{seen[key]}"] = memory
    return out


def differences(clean: dict, again: dict) -> list[str]:
    """Lines naming every memory value of a re-run that differs from the clean run's (same table, same row)."""
    lines = []
    for name, t in clean.items():
        if name not in again:
            lines.append(f"{name}: not recorded by the re-run")
            continue
        a, b = memory_by_row(t), memory_by_row(again[name])
        for row, cols in a.items():
            if row not in b:  # a table ranked by time (lab 04's top profiler ops) may hold other rows: not memory
                lines += [f"{name} {row}: row missing in the re-run"] if len(a) != len(b) else []
                continue
            lines += [f"{name} {row} {c}: clean {v!r}, re-run {b[row].get(c)!r}" for c, v in cols.items()
                      if b[row].get(c) != v]
    return lines


LEFTOVER_LINE = re.compile(r"starts .+ (above|below) the lab's baseline")  # labutils.core.memory.start_check's
