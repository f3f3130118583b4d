"""``python -m labutils regenerate``: re-execute the lab notebooks, collect their results, render the README tables.

    python -m labutils regenerate                       # full run on a GPU: results/ and README.md
    python -m labutils regenerate --smoke --only 03     # does lab 03 still run? results in a temp folder
    python -m labutils regenerate --rehearse --bench 1  # make gpu-results' whole path at smoke sizes, in a temp dir
    python -m labutils regenerate --render-only --out results/<card>   # redraw the pages from what is there

Each notebook runs in a fresh kernel (:mod:`labutils.tools.notebook_runner`), writing into a staging folder; what it
records is checked before it moves into the output folder, then the pages are redrawn and ``run.json`` updated. Bad
input is refused (exit 2, one line) before any notebook runs; the README changes only between well-formed markers.
Ctrl-C / SIGTERM stop within seconds, child processes too (exit 130 / 143), nothing half-written.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..labs.registry import mismatch
from .command_parts import archive_line, card_folder, print_plan, run_bench, run_doctor_first, write_run_record
from .notebook_runner import (FULL_CELL_TIMEOUT, REPO_ROOT, SMOKE_CELL_TIMEOUT, Interrupted, Outcome, SignalGuard,
                              execute_notebook, read_notebook)
from .report import (ResultsError, lab_id, load_results, marker_spans, read_readme, readme_blocks,
                     render_results, results_shape_error, update_readme)
from ..core.results import ARTIFACTS_ENV, RESULTS_DIR, write_atomic, write_keeping_file

NOTEBOOK_GLOB = "[0-9][0-9]-*.ipynb"


def find_notebooks(folder: str | os.PathLike, only: str | list[str] | None = None) -> list[Path]:
    """The lab notebooks in ``folder`` (the repository's: exactly the registry's labs), or ``only`` those ("01,3")."""
    notebooks = sorted(Path(folder).glob(NOTEBOOK_GLOB))
    if not notebooks:  # e.g. labutils installed without -e, run outside the checkout: say where it looked
        raise ValueError(f"no lab notebooks (NN-Name.ipynb) in {folder}: pass --notebooks DIR (the course's folder, "
                         f"with its configs/), or run from a clone of the course installed with `pip install -e .`")
    if Path(folder).resolve() == REPO_ROOT and (why := mismatch(nb.stem for nb in notebooks)):
        raise ValueError(f"{folder}: {why}")
    labs = {lab_id(nb.stem): nb for nb in notebooks}
    if len(labs) < len(notebooks):
        ids = [lab_id(nb.stem) for nb in notebooks]
        twice = ", ".join(sorted({i for i in ids if ids.count(i) > 1}))
        raise ValueError(f"{folder}: several notebooks for lab {twice}"
                         "; results are keyed by lab number, so keep one notebook per NN-")
    if only is None:
        return notebooks
    allowed = (f"allowed: lab numbers {', '.join(labs) or 'none'} or the notebooks' names "
               f"({', '.join(nb.stem for nb in notebooks) or 'none'}), comma-separated")
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
    if not wanted:
        raise ValueError(f"--only {only!r}: names no lab; {allowed}")
    by_name = {n: nb for nb in notebooks for n in (nb.stem, nb.name)}
    chosen, unknown = [], []
    for w in wanted:  # a number, or a notebook's exact name: "01-Nonsense.ipynb" is not lab 01
        nb = labs.get(w.zfill(2)) if w.isdigit() else by_name.get(w)
        (chosen.append(nb) if nb else unknown.append(w))
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: no such lab notebook in {folder}; {allowed}")
    return sorted(set(chosen))


FINAL_ENV = "LAB_RESULTS_FINAL_DIR"  # where promote() moves a lab's results: the path its last cell prints


def kernel_env(results_dir: str | os.PathLike, smoke: bool, gpu_memory_gb: float | None,
               base: dict | None = None) -> dict:
    """The kernel's environment: ours, plus where to record results, the mode and the memory cap."""
    env = dict(os.environ if base is None else base)
    env["LAB_RESULTS_DIR"] = str(results_dir)
    env["LAB_PROGRESS"] = "0"  # no tqdm bars in executed copies: saved, a bar reads "0%|" (env.progress_bar)
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


OUT_FOLDERS = ("figures", "executed", "artifacts")  # what regenerate writes into, and deletes from, inside --out


def linked_folder(out: Path) -> str | None:
    """Why a folder regenerate writes into inside ``out`` cannot be used (a symlink, or not a folder), or None."""
    for sub in OUT_FOLDERS:
        p = out / sub
        if p.is_symlink():
            return (f"{p} is a symlink (to {os.readlink(p)}); regenerate never follows links inside --out, so "
                    "nothing outside it is written or deleted: remove the link or choose another --out")
        if p.exists() and not p.is_dir():
            return f"{p} is not a folder: move it away or choose another --out"
    return None


def promote(staging: Path, out: Path, stem: str, expected_mode: str) -> tuple[Path | None, str | None]:
    """Check what a notebook recorded in ``staging`` and move it into ``out``: (path, None) or (None, why not)."""
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
    shape = results_shape_error(data)
    if shape:
        return None, f"{js.name}: {shape}: not kept"
    if data.get("mode") != expected_mode:
        mode = data.get("mode")
        return None, (f"{js.name} was recorded in {mode} mode, not {expected_mode}: not kept"
                      + (" (no CUDA GPU in the kernel?)" if expected_mode == "full" else ""))
    figures = data.get("figures") or []
    missing = [f for f in figures if not (staging / f).is_file()]
    if missing:
        return None, f"{js.name} lists figures that were not written: {', '.join(missing)}"
    linked = linked_folder(out)
    if linked:  # appeared since the check before the run: never followed (it could delete files elsewhere)
        return None, f"{linked}: not kept"
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for old in (out / "figures").glob(f"{stem}-*.png"):  # this lab's figures from an earlier run
        old.unlink(missing_ok=True)  # missing_ok: a run beside this one may have moved it already
    for fig in figures:
        (out / fig).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / fig, out / fig)
    os.replace(js, out / js.name)  # the JSON last: it is what says the lab's results are complete
    return out / f"{stem}.json", None


# ---------------------------------------------------------------------------------------------------- the command
def regenerate(notebooks: list[Path], out: Path, *, smoke: bool, gpu_memory_gb: float | None,
               readme: Path | None = None, timeout: int | None = None, log=print,
               stems: list[str] | None = None, on_lab=None) -> list[Outcome]:
    """Execute ``notebooks`` into ``out``; after each, :func:`render` and ``on_lab(outcomes)``. One Outcome each.
    SIGINT/SIGTERM kill the running kernel and raise :class:`Interrupted` with what finished and what did not."""
    out.mkdir(parents=True, exist_ok=True)
    mode = "smoke" if smoke else "full"
    timeout = timeout or (SMOKE_CELL_TIMEOUT if smoke else FULL_CELL_TIMEOUT)
    stems = stems or [nb.stem for nb in notebooks]
    tty = sys.stdout.isatty()
    outcomes, readme_failed = [], []
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
                    # LAB_RESULTS_READ_DIR: where a lab finds the labs before it (lab 04's `estimate`: lab 01's speeds)
                    env = kernel_env(staging, smoke, gpu_memory_gb) | {
                        "LAB_RESULTS_READ_DIR": str(out), FINAL_ENV: str(out), ARTIFACTS_ENV: str(out / "artifacts")}
                    o = execute_notebook(nb, env, timeout=timeout, executed_dir=out / "executed", on_cell=progress,
                                         guard=guard, cwd=nb.parent)  # its own folder's configs, as a student's
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
                status = "ok" if o.ok else "FAILED"
                log(f"{head} {status:<6} {o.seconds:7.1f} s" + ("" if o.ok else f"  {o.where()[1:].lstrip()}")
                    + " " * 12)
                with guard.critical():
                    outcomes.append(o)
                    current = None
                    rendered = render(out, stems, readme, readme_failed, log)
                    on_lab and on_lab(outcomes)
        except Interrupted as exc:
            exc.rendered = rendered
            exc.finished, exc.current = list(outcomes), current and f"{current} (kernel shut down, nothing of it kept)"
            exc.not_started = [nb.stem for nb in notebooks[len(outcomes) + (current is not None):]]
            raise
    return outcomes + readme_failed[:1]


def render(out: Path, stems: list[str], readme: Path | None, failed: list[Outcome], log=print) -> bool:
    """``out/README-results.md`` and ``readme``'s blocks from whatever results ``out`` holds (after each lab, and
    ``regenerate --render-only``); a README that cannot be updated adds an Outcome to ``failed``. Returns True."""
    results = load_results(out, stems)
    write_atomic(out / "README-results.md", render_results(results).encode("utf-8"))
    log(f"wrote {out / 'README-results.md'} ({len(results)} labs)")
    if readme is not None:
        _update_readme_file(readme, out, results, failed, log)
    return True


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
    from ..core import device as dev
    return dev.cuda_available()


def _gpu_name() -> str | None:
    """This machine's GPU as torch names it, or None (no CUDA GPU that answers)."""
    from ..core import device as dev
    try:
        return dev.name("cuda") if dev.cuda_available() else None
    except (RuntimeError, AssertionError):  # a CPU build of torch, a driver that does not answer
        return None


def summary_line(outcomes: list[Outcome], seconds: float) -> str:
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


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cli_regenerate(args) -> int:
    """Everything a user typed is checked first (exit 2, one line); only then does any notebook run."""
    from ..core.results import OutputPathError, check_output_dir

    smoke, rehearse = bool(args.smoke), bool(getattr(args, "rehearse", False))
    results_default = REPO_ROOT / RESULTS_DIR
    runs = not (getattr(args, "plan", False) or getattr(args, "render_only", False))  # executes notebooks
    if missing := [m for m in ("nbformat", *("nbclient", "jupyter_client", "ipykernel") * runs)
                   if importlib.util.find_spec(m) is None]:  # issue 45 §1: in its first second, not after the doctor
        return _refuse(f"regenerate needs {', '.join(missing)} (Jupyter's packages that run the notebooks), not "
                       "installed here: pip install -e '.[test]'; a GPU machine without a package index: copy the "
                       ".whl/ folder `make gpu-wheels` fills (git-ignored: not in a checkout) and run make gpu-results")
    if smoke and rehearse:
        return _refuse("--rehearse already runs smoke sizes (the full run's path, smoke-sized): leave --smoke out")
    if getattr(args, "gpu", None) is not None and not getattr(args, "plan", False):
        return _refuse("--gpu NAME only goes with --plan (a run plans for the GPU it runs on)")
    gpu = _gpu_name() if getattr(args, "gpu", None) is None else args.gpu  # --gpu "": named, and refused below
    if getattr(args, "plan", False):
        from ..core.peaks import peak_tflops
        if gpu is None or peak_tflops(gpu, "fp32") is None:
            return _refuse(f"--plan: {'no CUDA GPU here: name one with --gpu' if gpu is None else repr(gpu)}: the "
                           "plan needs a GPU in labutils.core.peaks' table, as torch names it, e.g. --gpu "
                           "'NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-80GB', 'NVIDIA GeForce RTX 3070'")
    out = (Path(args.out).expanduser().resolve() if args.out else None if smoke or rehearse or args.plan
           else results_default / card_folder(gpu) if gpu else results_default)
    if (smoke or rehearse) and out and (out == results_default or results_default in out.parents):
        return _refuse(f"--{'smoke' if smoke else 'rehearse'} --out {args.out}: smoke results never go into "
                       f"{RESULTS_DIR}/ (use a temporary folder, or leave --out out)")
    if out == REPO_ROOT:
        return _refuse(f"--out {args.out}: not the repository root (the results would litter it); use "
                       f"{RESULTS_DIR}/ or another folder")
    in_results = out is not None and (out == results_default or results_default in out.parents)
    if out is not None and REPO_ROOT in out.parents and not in_results:  # configs/, .git/, labutils/...
        return _refuse(f"--out {args.out}: inside the repository ({REPO_ROOT}); regenerate writes only to "
                       f"{RESULTS_DIR}/ (full runs) or to a folder outside the repository")
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
            if linked := linked_folder(out):
                return _refuse(linked)
            own = out / "README.md"  # a rehearsal writes its README copy there: never over someone else's file
            if rehearse and own.exists() and own.read_bytes() != (REPO_ROOT / "README.md").read_bytes():
                return _refuse(f"--rehearse --out {args.out}: {own} is not this course's README (the rehearsal "
                               "writes its copy there): choose a new or empty folder")
        for nb in notebooks:  # all of them now: a merge conflict in lab 04 must not wait for labs 01-03 to run
            read_notebook(nb)
    except (ValueError, OutputPathError) as exc:
        return _refuse(str(exc))
    if not notebooks:
        return _refuse(f"no lab notebooks ({NOTEBOOK_GLOB}) in {folder}")
    stems = [nb.stem for nb in every]
    scope = [lab_id(nb.stem) for nb in notebooks], not args.skip_doctor, getattr(args, "bench", None)  # all planned
    if (part := getattr(args, "part", None)) is not None:  # one command of the plan's sequence (issue 45 §3)
        from .timeplan import commands, course_plan
        if smoke or gpu is None or args.plan:
            return _refuse(f"--part {part}: a command of a GPU's plan (make gpu-results PART=K, or --rehearse under a "
                           "GPU); not with --smoke or --plan, nor without a CUDA GPU")
        cmds = commands(course_plan(gpu, scope[0], scope[1], gb or None, scope[2]))  # printed whole, run in part
        if part > len(cmds):
            return _refuse(f"--part {part}: the plan for {gpu} has {len(cmds)} command(s): allowed 1-{len(cmds)} "
                           "(regenerate --plan lists them)")
        todo = cmds[part - 1]["parts"]
        notebooks = [nb for nb in notebooks if lab_id(nb.stem) in todo]
        args.skip_doctor, args.bench = args.skip_doctor or "doctor" not in todo, args.bench if "bench" in todo else None
    if getattr(args, "plan", False):
        print_plan(gpu, scope[0], scope[1], gb, scope[2])
        return 0
    readme = REPO_ROOT / "README.md" if not smoke and not rehearse and in_results and folder == REPO_ROOT else None
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
    if getattr(args, "render_only", False):  # what a cut run left in the folder, rendered (issue 45 §2)
        if out is None or not out.is_dir():
            return _refuse(f"--render-only: no results folder {out or '(give --out DIR)'}")
        failed = []
        render(out, stems, readme or (out / "README.md" if rehearse and (out / "README.md").exists() else None), failed)
        return 1 if failed else 0
    if not smoke and not rehearse and not _cuda_available():
        return _refuse("a full run needs a CUDA GPU (without one every notebook falls back to the tiny smoke "
                       "configuration); to check that the notebooks run, use --smoke")
    out = out or Path(tempfile.mkdtemp(prefix="lab-smoke-results-"))
    cap = f"memory cap {gb:g} GiB" if gb else "no memory cap"
    where = " (temporary folder)" if (smoke or rehearse) and not args.out else ""
    kind = "smoke" if smoke else "rehearsal (the full run's path at smoke sizes)" if rehearse else "full"
    print(f"regenerate: {len(notebooks)} notebook(s), {kind} mode, {cap}, results -> {out}{where}", flush=True)
    t0 = time.perf_counter()
    plan, actual = None, {}
    if not smoke and gpu:
        plan = print_plan(gpu, scope[0], scope[1], gb, scope[2])
    if rehearse:  # the README's markers are read and written as a full run would, in a copy
        readme = out / "README.md"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO_ROOT / "README.md", readme)
    mode = "rehearsal" if rehearse else "full"
    record = (lambda done: None) if smoke else (  # run.json from the start, after each part (issue 45 §2)
        lambda done: write_run_record(out, gpu, plan, actual, done, mode=mode))
    record([])
    outcomes, bench_code = [], 0
    try:  # a signal during the doctor or the bench stops its child process too (_child)
        if not smoke and not getattr(args, "skip_doctor", False):
            code = run_doctor_first(out, gb, smoke_sizes=rehearse)
            actual["doctor"] = time.perf_counter() - t0
            record([])
            if code != 0:
                print(f"regenerate: `python -m labutils doctor` failed (exit {code}; its table is above, its JSON in "
                      f"{out / 'doctor.json'}): no notebook was run. Fix what failed, or pass --skip-doctor to run "
                      f"the labs anyway.", file=sys.stderr)
                return 1
        outcomes = regenerate(notebooks, out, smoke=smoke or rehearse, gpu_memory_gb=gb, readme=readme, stems=stems,
                              on_lab=lambda done: (actual.update({lab_id(done[-1].stem): done[-1].seconds}),
                                                   record(done)))
        if getattr(args, "bench", None):
            actual["bench"], bench_code = run_bench(out, args.bench, gb, smoke_sizes=rehearse)
    except Interrupted as exc:
        if not exc.finished and not exc.current:  # the doctor's or the bench's process (the labs fill these in)
            exc.finished, exc.rendered = outcomes, bool(outcomes) and readme is not None
            exc.current = f"the {'bench' if outcomes else 'doctor'} (its process too, nothing of it kept)"
            exc.not_started = [] if outcomes else [nb.stem for nb in notebooks]
        print(exc.summary(), file=sys.stderr, flush=True)
        return exc.exit_code
    if plan is not None and not rehearse:
        from .timeplan import against_actual

        print("\n".join(against_actual(plan, actual)), flush=True)
    elif rehearse:
        print("regenerate: rehearsal at smoke sizes: the times are not the plan's (it is for the full run)")
    record(outcomes)
    if not smoke:  # what the README's recipe hands back (issue 45 §5)
        print(archive_line(out, rehearse), flush=True)
    print(summary_line(outcomes, time.perf_counter() - t0) + (f"; bench failed (exit {bench_code})" if bench_code
                                                               else ""))
    return 0 if all(o.ok for o in outcomes) and not bench_code else 1
