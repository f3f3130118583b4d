"""Nothing outside the output folder (issue 24): `python -m labutils regenerate --smoke --out TMP` leaves the
repository's working tree exactly as it was, ignored files included.

Lab 04 used to write `runs/lab04/profile_trace.json` (and on a GPU its memory snapshot and the C7 folder) into the
repository even when `--out` was given, and every notebook run without `regenerate` recorded its smoke results in
`runs/smoke/`. `git status` alone does not see that (`runs/` is git-ignored), so the oracle here is the file
system itself: every path under the repository (but `.git`) with its size and modification time, before and after.
Breakage that fails it: any notebook or labutils code writing a file, or touching one, under the repository root
(a relative path such as `Path("runs/...")` resolves there, since regenerate runs kernels in the repository root).

By default lab 04 runs (the one that writes files besides its results: a trace, on a GPU a snapshot and the C7
folder); all four when the session runs them (tests/regen_once.py: the notebooks collected, or LAB_FULL_REGEN=1).
Notebooks run without regenerate (nbval, JupyterLab) are covered by the unit tests below: their default folders
are outside the repository.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".pytest_cache"}  # git's own store; pytest's cache is written by the test session itself


def tree_state(root: Path) -> dict[str, tuple]:
    """Every file and folder under ``root`` (ignored ones included): size and mtime for files, a marker for folders."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        state[str(rel) + "/"] = ("dir",)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            state[str(rel / name)] = (st.st_size, st.st_mtime_ns)
    return state


def git_status_ignored() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO,
                          check=True, capture_output=True, text=True).stdout


def test_tree_state_sees_an_ignored_file(tmp_path):
    """The oracle can fail: a file written in a git-ignored folder changes the state (git status would not)."""
    (tmp_path / "runs").mkdir()
    before = tree_state(tmp_path)
    (tmp_path / "runs" / "profile_trace.json").write_text("{}")
    assert set(tree_state(tmp_path)) - set(before) == {"runs/profile_trace.json"}


def test_default_folders_outside_the_repository(monkeypatch, tmp_path):
    """Without regenerate (nbval, JupyterLab) smoke results and a lab's artifacts go to a temp folder; the old
    defaults (runs/smoke/, runs/lab04/) were relative paths, i.e. inside the repository when run from its root."""
    from labutils.core import results

    monkeypatch.delenv("LAB_RESULTS_DIR", raising=False)
    monkeypatch.delenv(results.ARTIFACTS_ENV, raising=False)
    monkeypatch.chdir(REPO)
    for path in (results.results_dir("smoke"), results.artifacts_dir("lab04")):
        assert path.is_absolute() and REPO.resolve() not in path.resolve().parents, path
    monkeypatch.setenv(results.ARTIFACTS_ENV, str(tmp_path / "a"))
    assert results.artifacts_dir("lab04") == tmp_path / "a" / "lab04" and (tmp_path / "a" / "lab04").is_dir()


@pytest.mark.regen_labs("04")
def test_smoke_regenerate_leaves_the_worktree_unchanged():
    from tests import regen_once  # the session's one regenerate --smoke run, the tree recorded around it

    run = regen_once.run_for(regen_once.LABS if regen_once.ALL else ["04"])
    assert run.returncode == 0, run.stdout + run.stderr
    before, after, out = run.tree_before, run.tree_after, run.out
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), f"written in the repository: added {added}, removed {removed}, " \
                                              f"changed {changed}"
    assert run.status_after == run.status_before
    assert any((out / "artifacts" / "lab04").iterdir()), "lab 04's trace should be under --out/artifacts/lab04"
