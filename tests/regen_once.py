"""One ``regenerate --smoke`` run of the real lab notebooks per test session, shared by everything that needs one
(issue 29, §5: CI executed each notebook two or three times).

Who asks: the notebooks themselves when pytest is given them (``pytest tests *.ipynb``, the README's test command:
the repository's conftest.py collects each ``NN-*.ipynb`` as a test that passes when that notebook ran top to
bottom in that run), the acceptance test of all four labs (tests/test_regenerate.py), the one-lab end-to-end test,
and the worktree-unchanged test (tests/test_worktree_clean.py). Collection registers what the session will need
(:func:`want`); the first test that runs starts one run over all of it, and the others read that run.

The run is the real command in a child process (``python -m labutils regenerate --smoke --only ... --out TMP``),
with the repository's file tree and ``git status`` recorded just before and just after it, so the "nothing
outside --out" oracle still brackets exactly that run. A run of all four labs is the one command for a lent GPU,
rehearsed: ``make gpu-results REHEARSE=1 OUT=TMP BENCH_REPEATS=1`` from the Makefile as it stands, its Python
under the pretend H100 (tests/pretend_gpu.py), so regenerate plans for that card and runs the doctor, the four
notebooks and the bench at smoke sizes on this machine (issue 39); the notebooks' results are the same smoke run.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labutils.labs.registry import IDS

REPO = Path(__file__).resolve().parent.parent
LABS = IDS  # every lab of the registry (labutils.labs.registry)
REHEARSAL_GPU = "h100"  # the card the rehearsal pretends to be (tests/fake_cuda.py's PROFILES)

ALL = False  # the session runs all four labs (conftest.py: all four notebooks collected, or LAB_FULL_REGEN=1)
_wanted: set[str] = set()
_runs: dict[frozenset, "Run"] = {}


@dataclass
class Run:
    labs: list[str]
    out: Path
    returncode: int
    stdout: str
    stderr: str
    tree_before: dict
    tree_after: dict
    status_before: str  # git status --porcelain --ignored --untracked-files=all
    status_after: str

    def lab_ok(self, stem: str) -> bool:
        """The run's own progress line says this notebook ran to the end and its results were kept."""
        return re.search(rf"^\[\d+/\d+\] {re.escape(stem)} +ok\b", self.stdout, re.M) is not None

    def lab_failure(self, stem: str) -> str:
        """What the run said about this notebook (its summary lines), or the whole output when it said nothing."""
        lines = self.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"  {stem} failed"):
                tail = [l.strip() for l in lines[i + 1:i + 3] if l.startswith("    ")]
                return "\n".join([line.strip(), *tail])
        return f"exit {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}"


def want(labs) -> None:
    """Collection says this session will need these labs (the registry's ids, labutils.labs.registry)."""
    _wanted.update(labs)


def wanted() -> set[str]:
    return set(_wanted)


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO,
                          check=True, capture_output=True, text=True).stdout


def run_for(labs) -> Run:
    """A run that executed at least ``labs``: the session's run if it covers them, else one run over these and
    everything collection asked for."""
    labs = set(labs)
    for key, run in _runs.items():
        if labs <= key:
            return run
    key = frozenset(labs | _wanted)
    claim(os.environ.get("PYTEST_XDIST_TESTRUNUID"))
    _runs[key] = _run(sorted(key))
    return _runs[key]


def claim(testrun: str | None, folder: Path | None = None) -> None:
    """Under pytest-xdist the session's run belongs to one worker: conftest.py puts every test that reads it in one
    xdist group. A second worker starting a run of its own would double the longest piece of CI (it did, silently,
    while the group marks were added after xdist had read them); here it is an error naming the cause. The first
    process to run writes its pid into a file named by xdist's test-run id; another pid finding it raises."""
    if not testrun:
        return
    path = (folder or Path(tempfile.gettempdir())) / f"labutils-regen-once-{testrun}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        owner = path.read_text().strip()
        if owner != str(os.getpid()):
            raise RuntimeError(f"the session's regenerate --smoke run was already started by process {owner}: the "
                               f"tests that read it are on more than one xdist worker (conftest.py must mark them "
                               f"with one xdist_group before xdist reads the marks, and --dist must be loadgroup)")
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    atexit.register(lambda: path.unlink(missing_ok=True))


def _run(labs: list[str]) -> Run:
    from tests.test_worktree_clean import tree_state

    out = Path(tempfile.mkdtemp(prefix="labutils-regen-once-")) / "out"
    atexit.register(shutil.rmtree, out.parent, True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LAB_SMOKE", "LAB_RESULTS_DIR", "LAB_RESULTS_READ_DIR", "LAB_ARTIFACTS_DIR")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the interpreter's .pyc caches are not the labs' output
    before, status = tree_state(REPO), git_status()
    if set(labs) == set(LABS):  # all of them: the one command for a lent GPU, rehearsed (see the module docstring)
        cmd = ["make", "--no-print-directory", "gpu-results", "REHEARSE=1", f"OUT={out}", "BENCH_REPEATS=1",
               f"PYTHON={sys.executable} tests/pretend_gpu.py {REHEARSAL_GPU}", "WHEELS="]  # this machine's packages (.whl/ holds another Python's)
    else:
        cmd = [sys.executable, "-m", "labutils", "regenerate", "--smoke", "--only", ",".join(labs), "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    return Run(labs, out, r.returncode, r.stdout, r.stderr, before, tree_state(REPO), status, git_status())
