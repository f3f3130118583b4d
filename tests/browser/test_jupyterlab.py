"""What a student sees in JupyterLab (issue 44 §7, §9): a lab opened in a real browser, run cell by cell, saved,
and reopened after its kernel is gone, as a student who comes back to it the next day.

JupyterLab (``jupyter lab --no-browser``, a free port, a token) serves a private temp folder holding one lab and the
configs it reads; its kernel runs as a student's does (smoke mode, progress bars ON, every output folder in the temp
folder), and Debian's Chromium, driven by Playwright (headless, 1440x900), presses Shift+Enter on every cell. It fails
on: (a) "Error displaying widget" / "model not found" in the reopened page; (b) a progress bar left on screen (a line
reading "NN%|...| n/m [" in an output, or a widget drawn in one); (c) any error in the browser's console (none is
excused: a clean run of JupyterLab 4.6 in Chromium 150 logs none, offline too); (d) an error output in a cell. It
also fails if anything was written into the repository. Before the text bar of ``labutils.core.env.progress_bar``
(e7233e6: tqdm.auto drew an ipywidgets bar, left red and frozen after an out-of-memory run) lab 01 failed on (a),
(b) and (c).

Not part of ``pytest tests``: it needs Chromium, Playwright and a few minutes, so it runs only with ``LAB_BROWSER=1``
(``make test-browser``). ``LAB_BROWSER_LAB=02`` opens another lab (default 01: its section 5 sweep runs out of
memory, the stopped runs a student sees).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.lab_kernel import BAR, WIDGET, notebook_of
from tests.test_worktree_clean import tree_state

REPO = Path(__file__).resolve().parents[2]
LAB = os.environ.get("LAB_BROWSER_LAB", "01")
CELL_TIMEOUT_S = 300
CHROMIUM = shutil.which(os.environ.get("LAB_CHROMIUM") or "chromium") or shutil.which("chromium-browser")

if os.environ.get("LAB_BROWSER") != "1":
    pytest.skip("the browser test runs only with LAB_BROWSER=1 (make test-browser): it needs Chromium and Playwright "
                "and takes minutes, so neither `pytest tests` nor CI runs it", allow_module_level=True)
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    pytest.skip("Playwright is not installed (pip install playwright; its own browser download is not needed)",
                allow_module_level=True)
if not CHROMIUM:
    pytest.skip("no Chromium on PATH (Debian: apt-get install chromium; or LAB_CHROMIUM=/path/to/chromium)",
                allow_module_level=True)

STOPPED_WIDGET = "Error displaying widget"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_env(root: Path) -> dict:
    """The server's environment, which its kernels inherit: the kernel's as regenerate and tests/lab_kernel.py set
    it (smoke, output folders in ``root``), with progress bars on as a student has them, and every Jupyter, IPython
    and matplotlib folder in ``root``: nothing is written into the repository or the home folder."""
    from labutils.core.results import ARTIFACTS_ENV
    from labutils.tools.regenerate import kernel_env

    state = root.parent / "state"
    env = kernel_env(root / "results", smoke=True, gpu_memory_gb=8) | {
        "LAB_RESULTS_READ_DIR": str(root / "results"), ARTIFACTS_ENV: str(root / "artifacts"),
        "LAB_PROGRESS": "1", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_RUNTIME_DIR", "run"),
                     ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                     ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "mpl")]:
        env[var] = str(state / sub)
    return env


class Server:
    """``jupyter lab --no-browser`` on a free port with a token, serving ``root``; stopped at the end."""

    def __init__(self, root: Path, log: Path):
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={root}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
            + ["--allow-root"] * (os.geteuid() == 0),  # a container's root
            cwd=root, env=lab_env(root), stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("status")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"jupyter lab did not start:\n{self.log_tail()}")
                time.sleep(0.5)

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self) -> None:
        for k in self.api("kernels"):
            self.api(f"kernels/{k['id']}", method="DELETE")

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bars_in(text: str) -> list[str]:
    """Lines of an output's text that read as a progress bar (what is on screen after its carriage returns)."""
    return [seen.strip() for line in text.split("\n") if BAR.search(seen := line.rsplit("\r", 1)[-1])]


def saved_problems(nb: dict) -> list[str]:
    """What the saved notebook holds that a student would see on reopening: error outputs, widget views, bars."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                found.append(f"cell {i}: error output {out['ename']}: {out['evalue'][:200]}")
            text = "".join(out.get("text") or out.get("data", {}).get("text/plain", ""))
            if WIDGET in out.get("data", {}):  # its text is what a viewer without widgets shows (GitHub)
                found.append(f"cell {i}: a widget view saved (reopens as 'model not found'; as text: {text!r})")
            else:
                found += [f"cell {i}: progress bar saved: {b!r}" for b in bars_in(text)]
    return found


def wait_idle(page, timeout_s: float = 120) -> None:
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_s * 1000)


def test_a_lab_run_saved_and_reopened_shows_no_stale_bar_widget_error_or_console_error(tmp_path):
    t_start = time.monotonic()
    before = tree_state(REPO)
    src = notebook_of(LAB)
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(src, root / src.name)
    shutil.copytree(REPO / "configs", root / "configs", ignore=shutil.ignore_patterns("__pycache__"))

    console, problems, timings = [], [], {}
    server = Server(root, tmp_path / "jupyter.log")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.on("console", lambda m: m.type == "error" and console.append(f"console error: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            page.goto(f"{server.url}/lab/tree/{src.name}?token={server.token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            wait_idle(page)

            n = len(json.loads(src.read_text(encoding="utf-8"))["cells"])
            cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
            page.wait_for_function(f"() => document.querySelectorAll('.jp-NotebookPanel .jp-Cell').length == {n}",
                                   timeout=60_000)
            cells.first.click()
            page.keyboard.press("Escape")  # command mode: Shift+Enter runs the cell and selects the next
            t_run = time.monotonic()
            for i in range(n):
                cell = cells.nth(i)
                code = "jp-CodeCell" in (cell.get_attribute("class") or "")
                t0 = time.monotonic()
                page.keyboard.press("Shift+Enter" if i < n - 1 else "Control+Enter")  # no new cell after the last
                if not code:
                    continue
                cell.locator(".jp-InputPrompt").filter(has_text=re.compile(r"\[\d+\]")).wait_for(
                    timeout=CELL_TIMEOUT_S * 1000)
                timings[i] = time.monotonic() - t0
                outputs = cell.locator(".jp-OutputArea-output")
                text = "\n".join(outputs.all_text_contents())
                problems += [f"cell {i} after its run: progress bar left on screen: {b!r}" for b in bars_in(text)]
                for w in outputs.filter(has=page.locator(".jupyter-widgets")).all():  # a closed one is empty
                    red = " red (bar_style danger)" * bool(w.locator(".progress-bar-danger").count())
                    problems.append(f"cell {i} after its run: a{red} widget left in its output: "
                                    f"{' '.join((w.text_content() or '').split())!r}")
            timings["run"] = time.monotonic() - t_run

            page.keyboard.press("Control+s")
            page.wait_for_function("() => !document.querySelector('.jp-NotebookPanel.jp-mod-dirty, "
                                   ".lm-TabBar-tab.jp-mod-dirty')", timeout=60_000)
            saved = json.loads((root / src.name).read_text(encoding="utf-8"))
            problems += [f"saved notebook: {p}" for p in saved_problems(saved)]
            unrun = [i for i, c in enumerate(saved["cells"]) if c["cell_type"] == "code" and not c["execution_count"]]
            assert len(saved["cells"]) == n and not unrun, f"cells not run: {unrun} (of {n})"

            server.shut_down_kernels()  # the student comes back later: the kernel (and its widget models) are gone
            page.reload()
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            wait_idle(page)
            page.wait_for_timeout(5000)  # the widget manager renders saved widget views (or their error) meanwhile
            body = page.locator("body").text_content() or ""
            for needle in (STOPPED_WIDGET, "model not found"):
                if needle in body:
                    problems.append(f"reopened page: {body.count(needle)} x {needle!r}")
            text = "\n".join(page.locator(".jp-OutputArea-output").all_text_contents())
            problems += [f"reopened page: progress bar on screen: {b!r}" for b in bars_in(text)]
            browser.close()
    finally:
        server.stop()

    firsts = [c.splitlines()[0] for c in console]  # the message, not its stack
    problems += [f"{c} (x{firsts.count(c)})" for c in dict.fromkeys(firsts)]
    after = tree_state(REPO)
    written = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    problems += [f"written into the repository: {w}" for w in written]
    slowest = sorted(((s, i) for i, s in timings.items() if i != "run"), reverse=True)[:3]
    print(f"lab {LAB} in JupyterLab: {n} cells run in {timings.get('run', 0):.0f} s, whole test "
          f"{time.monotonic() - t_start:.0f} s; slowest cells {[(i, round(s)) for s, i in slowest]}")
    assert not problems, "\n".join(problems) + f"\n--- jupyter log (tail) ---\n{server.log_tail()}"
