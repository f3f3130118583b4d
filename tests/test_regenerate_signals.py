"""Interrupting ``python -m labutils regenerate`` (issue 14, class 3): Ctrl-C (SIGINT) or a CI cancellation
(SIGTERM) during a notebook stops the command within seconds, shuts the kernel down, starts no further notebook,
leaves nothing half-written, exits 130 / 143 and says in one line what finished and what did not.

Small notebooks of our own (a cell that sleeps, a cell that computes and prints), run through the real command
in a real process that receives a real signal: nbclient installs signal handlers of its own, which is what broke.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from labutils.tools import notebook_runner as nr, regenerate as rg

REPO = Path(__file__).resolve().parent.parent

STARTED = ("import os, pathlib\n"
           "pathlib.Path(os.environ['SIGTEST_DIR'], '{stem}.started').write_text(str(os.getpid()))")
CELLS = {
    "80-Done": ["import labutils as lu\nlu.record_results('80-Done', tables={'t': [{'a': 1}]}, env={'weights': 'random'})"],
    "81-Quiet": [STARTED.format(stem="81-Quiet"), "import time\ntime.sleep(120)  # a quiet cell",
                 "import labutils as lu\nlu.record_results('81-Quiet', tables={'t': [{'a': 1}]}, env={'weights': 'random'})"],
    "81-Busy": [STARTED.format(stem="81-Busy"),
                "import time\nt0 = time.time()\nwhile time.time() - t0 < 120:  # a busy cell that prints\n"
                "    print(sum(i * i for i in range(20000)), flush=True)",
                "import labutils as lu\nlu.record_results('81-Busy', tables={'t': [{'a': 1}]}, env={'weights': 'random'})"],
    "82-Next": [STARTED.format(stem="82-Next")],
}


def write(folder: Path, stems) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    folder.mkdir(parents=True, exist_ok=True)
    for stem in stems:
        nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [new_code_cell(src) for src in CELLS[stem]]
        nbformat.write(nb, folder / f"{stem}.ipynb")
    return folder


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is dead


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


@pytest.mark.parametrize("sig, code, middle, first", [
    (signal.SIGINT, 130, "81-Quiet", False),
    (signal.SIGTERM, 143, "81-Quiet", True),
    (signal.SIGINT, 130, "81-Busy", False),
    (signal.SIGTERM, 143, "81-Busy", False),
], ids=["SIGINT-quiet-cell", "SIGTERM-quiet-cell-after-a-finished-lab", "SIGINT-busy-cell",
        "SIGTERM-busy-cell"])
def test_signal_stops_regenerate_cleanly(tmp_path, sig, code, middle, first):
    stems = (["80-Done"] if first else []) + [middle, "82-Next"]
    notebooks, out, marks = write(tmp_path / "nb", stems), tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_SMOKE", "LAB_RESULTS_DIR")}
    env["SIGTEST_DIR"] = str(marks)
    # after a finished lab: the GPU command's path (--rehearse: run.json, a README copy), without its doctor
    mode = ["--rehearse", "--skip-doctor"] if first else ["--smoke"]
    proc = subprocess.Popen([sys.executable, "-m", "labutils", "regenerate", *mode, "--notebooks", str(notebooks),
                             "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        started = marks / f"{middle}.started"
        deadline = time.monotonic() + 180
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), proc.communicate(timeout=30)
        time.sleep(1.0)  # well inside the long cell
        kernel = int(started.read_text())
        t0 = time.monotonic()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stdout + stderr
    assert took < 10, f"took {took:.1f} s to stop"
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted by {signal.Signals(sig).name}: "), stderr
    assert f"stopped {middle}" in last and "not started 82-Next" in last
    assert ("the results pages show the finished labs" if first else "not updated") in last
    assert ("finished 80-Done (ok)" if first else "finished none") in last
    assert "Traceback" not in stderr and "AssertionError" not in stdout + stderr
    assert not (marks / "82-Next.started").exists()  # no next notebook
    for _ in range(50):  # the kernel is gone (killed, not left running with its memory)
        if not alive(kernel):
            break
        time.sleep(0.1)
    assert not alive(kernel)
    # nothing half-written: no staging folder, no temp file, nothing of the stopped lab, no results page;
    # a lab that finished before the signal is kept whole
    # (issue 45 §2) a lab that finished is rendered at once: its results page is there, and --render-only redraws
    # the same page from the folder
    kept = ["80-Done.json", "README-results.md", "README.md", "executed/80-Done.ipynb", "run.json"] if first else []
    assert files_under(out) == kept
    if first:
        assert json.loads((out / "80-Done.json").read_text())["tables"] == {"t": [{"a": 1}]}
        record = json.loads((out / "run.json").read_text())  # written at the start, then after each lab
        assert record["labs"] == {"80-Done": "ok"} and set(record["seconds"]) == {"80"}, record
        page = (out / "README-results.md").read_text()
        assert "80-Done" in page and "81-" not in page
        (out / "README-results.md").unlink()
        again = subprocess.run([sys.executable, "-m", "labutils", "regenerate", "--render-only", "--rehearse",
                                "--notebooks", str(notebooks), "--out", str(out)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and (out / "README-results.md").read_text() == page, again.stdout + again.stderr


def test_signal_guard_holds_a_signal_until_the_critical_section_ends():
    """Moving results into place is never cut in half: a signal inside critical() is raised after it."""
    steps = []
    with nr.SignalGuard() as guard:
        with pytest.raises(nr.Interrupted) as info:
            with guard.critical():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now: held, not raised
                steps.append("finished the critical part")
        assert info.value.exit_code == 143
    assert steps == ["finished the critical part"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_concurrent_runs_into_one_folder_do_not_share_a_kernel_log(tmp_path):
    """Two regenerate runs into one --out: each writes its kernel log under a name of its own and renames it at
    the end, so one run finishing (and removing an empty log) never breaks the other. The notebook here removes
    every kernel log it finds, as a concurrent run's clean-up would, while its own kernel is still writing."""
    cells = ("import glob, os\n_ = os.write(2, b'kernel output\\n')\n"
             "for p in glob.glob(os.path.join(os.environ['EXECUTED'], '*kernel*')):\n    os.unlink(p)\n"
             "import labutils as lu\nlu.record_results('83-Shared', tables={'t': [{'a': 1}]}, env={'weights': 'random'})")
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb_path = tmp_path / "nb" / "83-Shared.ipynb"
    nb_path.parent.mkdir()
    nbformat.write(new_notebook(cells=[new_code_cell(cells)]), nb_path)
    out = tmp_path / "out"
    os.environ["EXECUTED"] = str(out / "executed")
    try:
        results, errors = [], []

        def one():
            try:
                results.append(nr.execute_notebook(nb_path, rg.kernel_env(tmp_path / "st", True, None),
                                                   executed_dir=out / "executed"))
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        del os.environ["EXECUTED"]
    assert errors == [] and len(results) == 2
    assert all(o.ok for o in results), [o.error for o in results]
    assert not [p for p in (out / "executed").iterdir() if p.name.endswith(".tmp")]


def test_only_the_kernel_poll_of_a_killed_kernel_is_silenced(caplog):
    """nbclient's kernel-alive poll can fail after we kill the kernel on a signal (its client is gone); asyncio
    then printed that task's traceback after our summary line, now and then (a race with the 1 s poll). Only that
    task is silenced: any other task's unretrieved exception still prints."""
    import asyncio
    import gc

    from labutils.tools import notebook_runner

    notebook_runner.quiet_kernel_poll()
    notebook_runner.quiet_kernel_poll()  # once: a second call adds no second filter
    assert sum(isinstance(f, notebook_runner.KernelPollNoise) for f in logging.getLogger("asyncio").filters) == 1

    async def _async_poll_kernel_alive():
        raise AssertionError  # as nbclient's check does once the kernel client is cleaned up

    async def other_task():
        raise AssertionError("a real error")

    loop = asyncio.new_event_loop()
    try:
        for coro in (_async_poll_kernel_alive, other_task):
            task = loop.create_task(coro())
            loop.run_until_complete(asyncio.sleep(0.01))
            assert task.done()
            del task
            gc.collect()
    finally:
        loop.close()
    err = "\n".join(r.getMessage() for r in caplog.records if r.name == "asyncio")
    assert "other_task" in err and "a real error" in err
    assert "_async_poll_kernel_alive" not in err


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux: /proc/PID/task/*/children)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc (Linux)")
def test_sigterm_during_the_doctor_stops_its_process_too(tmp_path):
    """issue 45 §7: the doctor (and the bench) run as child processes; SIGTERM to regenerate (a CI cancellation, a
    lent machine's time running out) used to kill regenerate at once and leave the child running, an orphan holding
    the GPU, with exit 143 and no word. Now the child is stopped with it, one line says what was stopped, no lab
    ran. Breaks if the child outlives regenerate, or regenerate does not end within seconds."""
    notebooks, out = write(tmp_path / "nb", ["80-Done"]), tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_SMOKE", "LAB_RESULTS_DIR")}
    proc = subprocess.Popen([sys.executable, "-m", "labutils", "regenerate", "--rehearse", "--notebooks",
                             str(notebooks), "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, doctor = time.monotonic() + 120, None
        while doctor is None and proc.poll() is None and time.monotonic() < deadline:
            doctor = next((c for c in children(proc.pid) if b"doctor" in Path(f"/proc/{c}/cmdline").read_bytes()),
                          None)
            time.sleep(0.1)
        assert doctor is not None, proc.communicate(timeout=30)
        time.sleep(1.0)  # the doctor is importing torch or checking
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to regenerate alone, as `timeout` sends it
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and took < 10, (took, stdout + stderr)
    for _ in range(50):
        if not alive(doctor):
            break
        time.sleep(0.1)
    assert not alive(doctor), "the doctor's process outlived regenerate"
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted by SIGTERM: finished none; stopped the doctor"), stderr
    assert "not started 80-Done" in last and "Traceback" not in stderr
    assert not (out / "80-Done.json").exists()


def test_a_failed_bench_fails_the_run_and_leaves_no_earlier_bench_json(tmp_path, capsys):
    """issue 45 §7: a bench that fails (here: a memory budget it refuses, exit 2) used to leave the previous run's
    bench.json beside the new results, and regenerate exited 0. Now the old file is gone, the exit code says so."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.json").write_text('{"from": "an earlier run"}')
    seconds, code = rg.run_bench(out, 1, gpu_memory_gb=0.001, smoke_sizes=True)
    assert code == 2 and seconds > 0
    assert not (out / "bench.json").exists()
    assert "bench failed (exit 2" in capsys.readouterr().out
