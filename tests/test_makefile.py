"""The instructors' GPU command is a Makefile target (issue 45 §7): its variables reach regenerate whole, or are
refused. Oracle: GNU make itself (``make -n`` prints the recipe it would run; nothing runs, nothing is written).
Before: ``REHEARSE=0`` rehearsed, ``OUT`` was dropped from the full run (on a GPU it wrote results/ and README.md),
``OUT="my results"`` became two arguments, and a ``WHEELS`` folder without wheels ended in pip's own error."""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def make(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *(["-n"] if dry else []), *args],
                          capture_output=True, text=True, timeout=60)


def regenerate_args(*args: str) -> list[str]:
    p = make("gpu-results", "WHEELS=", "PYTHON=python", *args)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if " -m labutils regenerate " in x)
    return shlex.split(line.split(" -m labutils ", 1)[1])


@pytest.mark.parametrize("rehearse, out, want", [
    ("0", "my results", ["--out", "my results"]),          # the full run keeps OUT, whole
    ("", "", []),                                           # the full run into results/
    ("1", "", ["--rehearse"]),
    ("1", "/tmp/a b", ["--rehearse", "--out", "/tmp/a b"]),
])
def test_gpu_results_passes_rehearse_and_out_through_whole(rehearse, out, want):
    args = regenerate_args(f"REHEARSE={rehearse}", f"OUT={out}")
    assert args[0] == "regenerate" and [a for a in args if a in ("--rehearse", "--out") or a == out] == want


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_an_unknown_rehearse_value_is_refused_naming_the_allowed_ones(value):
    p = make("gpu-results", f"REHEARSE={value}", "WHEELS=")
    assert p.returncode != 0 and f"REHEARSE = '{value}'" in p.stderr and "allowed 1" in p.stderr, p.stderr


def test_a_wheels_folder_without_wheels_is_one_line_before_any_work(tmp_path):
    p = make("gpu-results", f"WHEELS={tmp_path}", "PYTHON=false", dry=False)  # PYTHON=false: nothing could run
    lines = [x for x in p.stderr.splitlines() if not x.startswith("make: ***")]
    assert p.returncode != 0 and len(lines) == 1 and "holds no wheel" in lines[0] and "make gpu-wheels" in lines[0]
