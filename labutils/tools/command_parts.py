"""What ``regenerate`` runs besides the notebooks, each in a child process that a signal stops with it: the doctor
first (a gate only for what the labs need), the bench after; and ``run.json``, each part's predicted and actual time."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ..core.results import write_atomic
from .notebook_runner import REPO_ROOT, STOP_GRACE, Outcome, SignalGuard


def _not_a_gate(row: dict, gpu_memory_gb: float | None) -> str | None:
    """Why a failed doctor row does not stop the notebooks (only what the labs need gates them, issue 45 §4): a row
    marked ``"gates_regenerate": False``, or a fast-path row (the bench's compiled config); else None: a gate."""
    if row.get("gates_regenerate", True) is False:
        return row.get("detail", "")
    if str(row.get("name", "")).startswith("fast path"):
        cap = f" under the {gpu_memory_gb:g} GiB cap (--gpu-memory-gb)" if gpu_memory_gb else ""
        return (f"not judged{cap}: the fast config (the bench's, sized for the whole card) is not what the labs "
                f"run; reported, not a gate ({str(row.get('detail', ''))[:160]})")
    return None


def command_env(gpu_memory_gb: float | None, smoke_sizes: bool = False) -> dict:
    """The doctor's and the bench's environment: the notebooks' card (one budget, one compiled step), smoke sizes."""
    env = {k: v for k, v in os.environ.items() if k != "LAB_GPU_MEMORY_GB"}
    if smoke_sizes:
        env["LAB_SMOKE"] = "1"
    if gpu_memory_gb:
        env["LAB_GPU_MEMORY_GB"] = f"{gpu_memory_gb:g}"
    return env


def run_doctor_first(out: Path, gpu_memory_gb: float | None, smoke_sizes: bool = False) -> int:
    """``python -m labutils doctor`` (the notebooks' budget) into ``<out>/doctor.json``: 0 to go on, else its exit
    code (a failed row stops the notebooks unless :func:`_not_a_gate` says why not; so does an unreadable report)."""
    out.mkdir(parents=True, exist_ok=True)
    env = command_env(gpu_memory_gb, smoke_sizes)
    print("regenerate: checking this machine first (python -m labutils doctor)", flush=True)
    report = out / "doctor.json"
    report.unlink(missing_ok=True)  # a crashed doctor also exits 1: never judge it by an earlier run's report
    code = _child(["doctor", "--json", str(report)], env)
    if code != 1:  # 0: all passed; anything else: the doctor itself broke
        return code
    try:
        failed = [r for r in json.loads(report.read_text(encoding="utf-8"))["checks"] if r["status"] == "fail"]
        why = [_not_a_gate(r, gpu_memory_gb) for r in failed]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return code
    if not failed or any(w is None for w in why):
        return code
    for r, w in zip(failed, why):
        print(f"regenerate: doctor finding that does not stop the notebooks: {r['name']}: {w}", flush=True)
    return 0


def card_folder(name: str) -> str:
    """results/<this>, one folder per card: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def _child(argv: list[str], env: dict) -> int:
    """``python -m labutils ARGV``'s exit code; a SIGINT / SIGTERM stops the child too and raises Interrupted here."""
    proc = subprocess.Popen([sys.executable, "-m", "labutils", *argv], cwd=REPO_ROOT, env=env)
    try:
        with SignalGuard():
            return proc.wait()
    finally:
        if proc.poll() is None:  # stopped by a signal: never an orphan that goes on using the GPU (issue 45 §7)
            proc.terminate()
            try:
                proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_bench(out: Path, repeats: int, gpu_memory_gb: float | None = None, smoke_sizes: bool = False):
    """``bench configs/fast_config.yaml --repeats N --json <out>/bench.json`` after the labs, under the doctor's budget
    (:func:`command_env`): (seconds, exit code). A rehearsal: LAB_SMOKE=1, ``train.compile=false``."""
    t0 = time.perf_counter()
    cmd = ["bench", "configs/fast_config.yaml", "--repeats", str(repeats), "--json", str(out / "bench.json")]
    print(f"regenerate: the fast path against the reference (python -m labutils {' '.join(cmd[:4])})", flush=True)
    (out / "bench.json").unlink(missing_ok=True)  # a failed bench leaves no earlier run's numbers beside new ones
    code = _child(cmd + ["--set", "train.compile=false"] * smoke_sizes, command_env(gpu_memory_gb, smoke_sizes))
    if code:
        print(f"regenerate: bench failed (exit {code}; its output is above): no bench.json", flush=True)
    return time.perf_counter() - t0, code


def write_run_record(out: Path, gpu: str | None, plan: dict | None, actual: dict, outcomes: list[Outcome],
                     mode: str = "full") -> None:
    """``<out>/run.json``: the card, torch, CUDA, the date and commit, the mode ("full", or "rehearsal": smoke sizes,
    whose times are not the plan's), and each part's predicted and actual time."""
    from ..core.env import environment

    env = environment(mode="full")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:  # no git on the machine (a bare GPU image): the record says null, after all the work
        commit = None
    from .timeplan import commands
    predicted = None if plan is None else {k: v for c in commands(plan) for k, v in c["parts"].items()}
    labs = {o.stem: "ok" if o.ok else "FAILED" for o in outcomes}
    try:  # an earlier command of the sequence (regenerate --part) on this card, in this mode: its parts are kept
        old = json.loads((out / "run.json").read_text(encoding="utf-8"))
        if old.get("gpu") == gpu and old.get("mode") == mode:
            labs, actual = {**old.get("labs", {}), **labs}, {**old.get("seconds", {}), **actual}
    except (OSError, ValueError, AttributeError):
        pass
    record = {"gpu": gpu, "torch": env.get("torch"), "cuda": env.get("cuda"), "date": env.get("date"),
              "commit": commit, "mode": mode, "labs": labs, "seconds": actual, "predicted_seconds": predicted}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "run.json", (json.dumps(record, indent=2) + "\n").encode("utf-8"))


def print_plan(gpu: str, labs: list[str], doctor: bool, gpu_memory_gb: float | None,
               bench_repeats: int | None = None) -> dict:
    from .timeplan import course_plan, plan_lines

    plan = course_plan(gpu, labs, doctor=doctor, card_gb=gpu_memory_gb or None, bench_repeats=bench_repeats)
    print("\n".join(plan_lines(plan)), flush=True)
    return plan


def archive_line(out: Path, rehearsal: bool) -> str:
    """The README's two archives of ``out`` (results; executed notebooks and traces), gzip sizes; for a rehearsal also
    at full sizes: traces scale with the blocks lab 04 profiles, figures, tables and notebooks keep their sizes."""
    import tarfile
    import tempfile

    from ..core.config import load_config
    from ..models.spec import PRESETS

    size, mib = {}, lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        for name, paths in (("results", [p for p in out.iterdir() if p.name not in ("executed", "artifacts")]),
                            ("executed", [out / "executed"]), ("traces", [out / "artifacts"])):
            with tarfile.open(Path(tmp) / name, "w:gz") as tar:
                for p in filter(Path.exists, paths):
                    tar.add(p, arcname=p.relative_to(out))
            size[name] = (Path(tmp) / name).stat().st_size
    blocks = [PRESETS[load_config("configs/lab04_profile.yaml", mode=m).model.name].n_layer for m in ("full", "smoke")]
    full = (size["results"], size["executed"] + size["traces"] * (blocks[0] / blocks[1]) ** rehearsal)
    return (f"archives (the README's recipe, gzip): results.tgz {mib(size['results'])}, artifacts.tgz (notebooks and "
            f"traces) {mib(size['executed'] + size['traces'])}" + (
                f"; at full sizes about {mib(full[0])} and {mib(full[1])} (traces x {blocks[0] / blocks[1]:g}: "
                f"{blocks[0]} blocks profiled over {blocks[1]}; figures, tables, notebooks as here)" * rehearsal)
            + f": {'each under' if max(full) < 16 * 2**20 else 'OVER'} the 16 MiB a lent GPU hands back")
