"""``regenerate`` refuses bad input before any lab runs, and loses nothing (issue 29, §3): a results file in
``--out`` whose content has the wrong shape, a notebook that is not valid JSON (a merge conflict), an empty or
unknown ``--only``, an ``--out`` inside the repository, and a ``figures`` symlink inside ``--out`` (never followed:
no file outside ``--out`` is deleted).

Each refusal is one line on stderr with exit code 2, naming the file / option and the key or the allowed values.
"Before any lab runs" is observed by replacing the notebook runner (not the code under test: the checks are)
with one that fails the test if it is ever called.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from labutils.tools import cli, regenerate as rg, report as rp
from labutils.labs.registry import IDS
from tests.test_regenerate import write_notebooks

REPO = Path(__file__).resolve().parent.parent
VALID = {"notebook": "91-Tiny", "mode": "smoke", "env": {"device": "cpu"}, "tables": {"runs": [{"a": 1}]},
         "figures": ["figures/91-Tiny-curve.png"], "notes": {}, "claims": []}


@pytest.fixture
def no_lab_runs(monkeypatch):
    def never(path, *args, **kwargs):
        raise AssertionError(f"a lab ran ({Path(path).name}): it should have been refused first")

    monkeypatch.setattr(rg, "execute_notebook", never)


def refused(capsys, argv) -> str:
    code = cli.main(["regenerate", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# ------------------------------------------------------------------------------------- results files in --out
BAD = {
    "tables value not a list": ({"tables": {"runs": "fast"}}, "'tables'"),
    "tables row not an object": ({"tables": {"runs": [1, 2]}}, "'tables'"),
    "tables not an object": ({"tables": [{"a": 1}]}, "'tables'"),
    "env a string": ({"env": "cpu"}, "'env'"),
    "env a list": ({"env": ["cpu"]}, "'env'"),
    "figures a string": ({"figures": "figures/91-Tiny-curve.png"}, "'figures'"),
    "figures not strings": ({"figures": [1]}, "'figures'"),
    "figures outside the folder": ({"figures": ["../../etc/passwd"]}, "'figures'"),
    "claims an object": ({"claims": {"C1": "supported"}}, "'claims'"),
    "claims entries not objects": ({"claims": ["C1"]}, "'claims'"),
    "claims entry without id": ({"claims": [{"verdict": "supported"}]}, "'claims'"),
    "notes a list": ({"notes": ["n"]}, "'notes'"),
}


@pytest.mark.parametrize("change, key", list(BAD.values()), ids=list(BAD))
def test_results_file_of_the_wrong_shape_is_refused_before_any_lab(tmp_path, capsys, no_lab_runs, change, key):
    nbs = write_notebooks(tmp_path / "nb", ["91-Tiny"])
    out = tmp_path / "out"
    out.mkdir()
    bad = out / "91-Tiny.json"
    bad.write_text(json.dumps(VALID | change))
    err = refused(capsys, ["--smoke", "--notebooks", str(nbs), "--out", str(out)])
    assert str(bad) in err and key in err, err
    assert json.loads(bad.read_text()) == VALID | change  # left as it was


def test_a_results_file_of_the_right_shape_is_read(tmp_path):
    (tmp_path / "91-Tiny.json").write_text(json.dumps(VALID))
    assert rp.load_results(tmp_path, ["91-Tiny"]) == {"91": VALID}
    (tmp_path / "91-Tiny.json").write_text(json.dumps({"tables": {}, "env": None, "figures": None, "claims": None}))
    assert rp.load_results(tmp_path, ["91-Tiny"])["91"]["tables"] == {}  # null: nothing recorded, renders


def test_a_notebook_recording_the_wrong_shape_is_not_kept(tmp_path):
    """The same check on what a notebook records, before it moves into --out (it would break rendering later)."""
    staging, out = tmp_path / "staging", tmp_path / "out"
    staging.mkdir()
    out.mkdir()
    (staging / "91-Tiny.json").write_text(json.dumps(VALID | {"figures": [], "tables": {"runs": "x"}}))
    path, why = rg.promote(staging, out, "91-Tiny", "smoke")
    assert path is None and "'tables'" in why and not (out / "91-Tiny.json").exists()


# ------------------------------------------------------------------------------------------------- notebooks
CONFLICT = ('{\n "cells": [],\n<<<<<<< HEAD\n "metadata": {"a": 1},\n=======\n "metadata": {"a": 2},\n'
            '>>>>>>> other-branch\n "nbformat": 4,\n "nbformat_minor": 5\n}\n')


def test_notebook_that_is_not_json_is_refused_before_any_lab(tmp_path, capsys, no_lab_runs):
    nbs = write_notebooks(tmp_path / "nb", ["91-Tiny", "92-Broken"])
    (nbs / "92-Broken.ipynb").write_text(CONFLICT)
    err = refused(capsys, ["--smoke", "--notebooks", str(nbs), "--out", str(tmp_path / "out")])
    assert "92-Broken.ipynb" in err and "merge conflict" in err and "line 3" in err, err
    assert not (tmp_path / "out").exists()  # nothing written either


def test_a_broken_notebook_that_is_not_selected_is_not_in_the_way(tmp_path, capsys, no_lab_runs):
    nbs = write_notebooks(tmp_path / "nb", ["91-Tiny", "92-Broken"])
    (nbs / "92-Broken.ipynb").write_text(CONFLICT)
    with pytest.raises(AssertionError, match=r"a lab ran \(91-Tiny.ipynb\)"):  # got as far as running lab 91
        cli.main(["regenerate", "--smoke", "--notebooks", str(nbs), "--only", "91", "--out", str(tmp_path / "out")])


def test_a_notebook_unreadable_at_run_time_fails_that_lab_only(tmp_path):
    """Checked before the run, but a file can change during a 4-hour run (a git checkout): that lab FAILED, the
    others go on, no traceback."""
    nbs = write_notebooks(tmp_path / "nb", ["93-Silent"])
    (nbs / "93-Silent.ipynb").write_text(CONFLICT)
    (o,) = rg.regenerate(rg.find_notebooks(nbs), tmp_path / "out", smoke=True, gpu_memory_gb=None,
                         log=lambda *a, **k: None)
    assert not o.ok and "not a readable notebook" in o.error and "merge conflict" in o.error


# ----------------------------------------------------------------------------------------------------- --only
@pytest.mark.parametrize("only", ["", ",", " ", "01-Nonsense.ipynb", "01-Nonsense", "1x"])
def test_only_must_name_a_lab(capsys, no_lab_runs, only, tmp_path):
    err = refused(capsys, ["--smoke", "--only", only, "--out", str(tmp_path / "out")])
    assert "--only" in err and ", ".join(IDS) in err, err  # the allowed values
    assert "01-Mixed_Precision" in err, err  # ... and the names that are allowed too


def test_only_accepts_numbers_and_names():
    names = [nb.stem for nb in rg.find_notebooks(REPO)]
    assert [nb.stem for nb in rg.find_notebooks(REPO, "1, 03")] == [names[0], names[2]]
    assert [nb.stem for nb in rg.find_notebooks(REPO, f"{names[1]}.ipynb,{names[3]}")] == [names[1], names[3]]


# ------------------------------------------------------------------------------------------------------ --out
def inside_repo_targets():
    yield "configs"
    yield "labutils"
    yield "tests/fixtures"
    if (REPO / ".git").is_dir():  # a worktree's .git is a file (refused as such already)
        yield ".git"


@pytest.mark.parametrize("smoke", [True, False], ids=["smoke", "full"])
@pytest.mark.parametrize("folder", list(inside_repo_targets()))
def test_out_inside_the_repository_is_refused(capsys, no_lab_runs, monkeypatch, folder, smoke):
    monkeypatch.setattr(rg, "_cuda_available", lambda: True)  # the full run's other refusal out of the way
    monkeypatch.setattr(rg, "run_doctor_first", lambda *a, **k: pytest.fail("doctor ran"))
    target = REPO / folder / f".regen-test-{uuid.uuid4().hex[:8]}"
    try:
        err = refused(capsys, (["--smoke"] if smoke else []) + ["--out", str(target)])
        assert "inside the repository" in err and str(target) in err, err
        assert not target.exists()  # nothing created
    finally:
        if target.exists():
            shutil.rmtree(target)


def test_out_through_a_symlink_into_the_repository_is_refused(capsys, no_lab_runs, tmp_path):
    link = tmp_path / "looks-outside"
    link.symlink_to(REPO / "configs")
    err = refused(capsys, ["--smoke", "--out", str(link / "sub")])
    assert "inside the repository" in err, err


def test_full_run_into_results_is_still_allowed(monkeypatch, capsys, no_lab_runs):
    """results/ (the default of a full run) is the one place in the repository regenerate writes to. Its first
    write (run.json, issue 45 §2) is caught here: the test itself never writes into the repository (it did:
    results/run.json of a run with no labs was committed twice)."""
    monkeypatch.setattr(rg, "_cuda_available", lambda: True)
    monkeypatch.setattr(rg, "run_doctor_first", lambda *a, **k: 7)  # stops right after the checks: nothing is run
    records = []
    monkeypatch.setattr(rg, "write_run_record", lambda out, *a, **k: records.append(out))
    before = sorted((REPO / "results").rglob("*")) if (REPO / "results").exists() else None
    assert cli.main(["regenerate", "--only", "01"]) == 1
    assert "doctor` failed (exit 7" in capsys.readouterr().err
    assert records and set(records) == {REPO / "results"}, records
    assert (sorted((REPO / "results").rglob("*")) if (REPO / "results").exists() else None) == before


# ------------------------------------------------------------------------------------------ symlinks in --out
@pytest.mark.parametrize("sub", ["figures", "executed", "artifacts"])
def test_a_symlinked_folder_in_out_is_refused_before_any_lab(tmp_path, capsys, no_lab_runs, sub):
    nbs = write_notebooks(tmp_path / "nb", ["91-Tiny"])
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    out.mkdir()
    keep = elsewhere / "91-Tiny-curve.png"
    keep.write_bytes(b"not ours")
    (out / sub).symlink_to(elsewhere, target_is_directory=True)
    err = refused(capsys, ["--smoke", "--notebooks", str(nbs), "--out", str(out)])
    assert str(out / sub) in err and "symlink" in err, err
    assert keep.read_bytes() == b"not ours"


def test_promote_never_follows_a_figures_symlink(tmp_path):
    """A figures symlink that appears during the run: this lab's old figures are deleted only inside --out."""
    elsewhere, staging, out = tmp_path / "elsewhere", tmp_path / "staging", tmp_path / "out"
    for d in (elsewhere, staging / "figures", out):
        d.mkdir(parents=True)
    keep = elsewhere / "91-Tiny-old.png"
    keep.write_bytes(b"not ours")
    (out / "figures").symlink_to(elsewhere, target_is_directory=True)
    (staging / "figures" / "91-Tiny-curve.png").write_bytes(b"png")
    (staging / "91-Tiny.json").write_text(json.dumps(VALID))
    path, why = rg.promote(staging, out, "91-Tiny", "smoke")
    assert keep.read_bytes() == b"not ours"  # the file outside --out is untouched
    assert path is None and "symlink" in why
    assert not (elsewhere / "91-Tiny-curve.png").exists()


def test_a_folder_without_notebooks_says_where_it_looked_and_how_to_point_at_them(tmp_path, capsys):
    """Issue 46 §5: installed without -e and run from another folder, `regenerate --smoke --only 01` said "no such
    lab notebook ...; allowed: lab numbers none". Now one line names the folder searched and the two ways out.
    Breaks if an empty folder is reported as a wrong lab number again."""
    from labutils.tools import cli

    assert cli.main(["regenerate", "--smoke", "--only", "01", "--notebooks", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path) in err[0] and "--notebooks DIR" in err[0] and "pip install -e" in err[0]
    assert "allowed: lab numbers none" not in err[0]


@pytest.mark.parametrize("blocked", ["nbformat", "nbclient", "ipykernel"])
def test_the_gpu_command_without_jupyters_packages_is_one_line_within_seconds(tmp_path, blocked):
    """Issue 45 §1: a lent GPU's image has no nbformat / nbclient / ipykernel unless .whl/ travelled with the checkout;
    regenerate died with a ModuleNotFoundError traceback (19-59 lines), for nbclient after the doctor ran 17-19 s. Now:
    the GPU command under the pretend H100 (tests/pretend_gpu.py), the package made unimportable as a missing one is
    (None in sys.modules: importlib finds no spec), exits 2 in seconds with one line naming it and .whl/, and writes
    nothing (its --out is not even created)."""
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    code = (f"import sys, runpy; sys.modules[{blocked!r}] = None; "
            f"sys.argv = ['tests/pretend_gpu.py', 'h100', '-m', 'labutils', 'regenerate', '--rehearse', '--out', "
            f"{str(out)!r}]; runpy.run_path('tests/pretend_gpu.py', run_name='__main__')")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "LAB_SMOKE"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"regenerate needs {blocked}" in lines[0] and ".whl/" in lines[0] and "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 60 and not out.exists() and "doctor" not in p.stdout


def test_a_rehearsal_never_writes_over_someone_elses_readme(tmp_path, capsys, no_lab_runs):
    """Issue 45: ``regenerate --rehearse --out DIR`` copied the course's README over ``DIR/README.md``, whatever was
    there. Now a folder holding another README is refused in one line before any work, and the file is kept byte for
    byte; a folder holding the course's own README (an earlier rehearsal's copy) is fine."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    nb = write_notebooks(tmp_path / "nb", ["91-Tiny"])
    assert cli.main(["regenerate", "--rehearse", "--skip-doctor", "--notebooks", str(nb), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not this course's README" in err[0] and str(out / "README.md") in err[0]
    assert (out / "README.md").read_text() == "# my notes\n" and sorted(p.name for p in out.iterdir()) == ["README.md"]
