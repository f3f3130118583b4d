"""The instructors' run never hangs (issue 29, §1): a notebook whose kernel dies (``os._exit``, a SIGKILL as the
host's OOM killer sends, a segfault) ends as FAILED within seconds naming the cell, and the next lab still runs;
a cell that prints nothing past its timeout is stopped and reported.

Each case runs ``regenerate`` in a child process with a hard wall-clock limit of its own, so a hang is a test
failure (``subprocess.TimeoutExpired``), never a stuck test session. The notebooks write their results without
importing labutils (no torch import: the short cell timeout is for the silent cell, not for a slow import).
The oracle is the kernel's real behaviour: a process that really exits, a cell that really sleeps.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.xdist_group("kernel_failures")  # one worker runs the module's one regenerate (failing_run)

PID = ("import os, pathlib\n"
       "pathlib.Path(os.environ['KERNEL_PIDS'], '{stem}').write_text(str(os.getpid()))")
RECORD = ("import json, os\n"
          "with open(os.path.join(os.environ['LAB_RESULTS_DIR'], '{stem}.json'), 'w') as f:\n"
          "    json.dump({{'notebook': '{stem}', 'mode': 'smoke', 'tables': {{'t': [{{'a': 1}}]}}, 'figures': []}}, f)")
DEATHS = {
    "os._exit": "import os\nos._exit(3)",
    "SIGKILL": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does",
    "segfault": "import ctypes\nctypes.string_at(0)  # reads address 0: SIGSEGV",
}


def write(folder: Path, cells: dict[str, list[str]]) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    folder.mkdir(parents=True, exist_ok=True)
    for stem, sources in cells.items():
        nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [new_markdown_cell(f"# {stem}")] + [new_code_cell(s.format(stem=stem)) for s in sources]
        nbformat.write(nb, folder / f"{stem}.ipynb")
    return folder


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


def run_regenerate(notebooks: Path, out: Path, pids: Path, *, timeout: int, limit: float) -> tuple[list[dict], float]:
    """regenerate(timeout=...) over the notebooks in a child process; its outcomes and how long it took. Also
    checks that no kernel it started outlives it."""
    script = (
        "import json, sys\nfrom pathlib import Path\nfrom labutils.tools import regenerate as rg\n"
        f"nbs = rg.find_notebooks({str(notebooks)!r})\n"
        f"outcomes = rg.regenerate(nbs, Path({str(out)!r}), smoke=True, gpu_memory_gb=None, timeout={timeout},\n"
        "                          log=lambda *a, **k: print(*a, file=sys.stderr, flush=True))\n"
        "print(json.dumps([{'stem': o.stem, 'ok': o.ok, 'cell': o.cell_index, 'count': o.execution_count,\n"
        "                   'error': o.error, 'where': o.where()} for o in outcomes]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_SMOKE", "LAB_RESULTS_DIR")}
    env["KERNEL_PIDS"] = str(pids)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    left = []
    try:
        p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=limit)
        took = time.monotonic() - t0
        time.sleep(0.5)
        left = [f.name for f in pids.glob("*") if alive(int(f.read_text()))]
    finally:  # a hung run (today's bug) must not leave its sleeping kernel behind
        for f in pids.glob("*"):
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert p.returncode == 0, p.stdout + p.stderr
    assert left == [], f"kernels still running after regenerate returned: {left}"
    return json.loads(p.stdout.strip().splitlines()[-1]), took


STEMS = {"os._exit": "71-Exits", "SIGKILL": "72-Killed", "segfault": "73-Segfault"}  # one lab per way of dying


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    """ONE regenerate run (a child process, 4 s cell timeout) over a lab per way a kernel dies, a lab whose cell sleeps
    silently past the timeout, and a lab after them all: its outcomes by stem, its seconds, its folders."""
    tmp = tmp_path_factory.mktemp("kernel_failures")
    pids = tmp / "pids"
    pids.mkdir()
    labs = {STEMS[death]: [PID, "x = 1", code, RECORD] for death, code in DEATHS.items()}
    labs["74-Silent"] = [PID, "import time\ntime.sleep(120)  # prints nothing", RECORD]
    nbs = write(tmp / "nb", {**labs, "75-After": [PID, RECORD]})
    outcomes, took = run_regenerate(nbs, tmp / "out", pids, timeout=4, limit=150)
    return {o["stem"]: o for o in outcomes}, took, tmp / "out"


@pytest.mark.parametrize("death", list(DEATHS))
def test_dead_kernel_fails_that_lab_fast_and_the_next_lab_runs(failing_run, death):
    outcomes, took, out = failing_run
    dies, after = outcomes[STEMS[death]], outcomes["75-After"]
    assert not dies["ok"] and dies["cell"] == 3, dies  # the cell that killed it (0-based; markdown is cell 0)
    assert "kernel died" in dies["error"], dies
    assert " at cell 3" in dies["where"], dies
    assert after["ok"], after  # the other labs go on
    assert not (out / f"{STEMS[death]}.json").exists() and (out / "75-After.json").exists()
    assert took < 60, f"took {took:.0f} s"  # seconds each, not a cell timeout per death (nor forever)


def test_silent_cell_past_its_timeout_is_stopped_and_reported(failing_run):
    outcomes, took, out = failing_run
    silent, after = outcomes["74-Silent"], outcomes["75-After"]
    assert not silent["ok"] and silent["cell"] == 2, silent
    assert "timed out" in silent["error"] and "4 s" in silent["error"], silent
    assert after["ok"], after
    assert not (out / "74-Silent.json").exists()
    assert took < 60, f"took {took:.0f} s: the 4 s timeout was not enforced"
