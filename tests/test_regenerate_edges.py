"""``regenerate``'s edges (issue 38 §3, §6): a disk that fills up while the executed copy is written is one line and
a non-zero exit, the earlier results whole; nothing prints after the summary when a kernel never starts; and
``--notebooks DIR`` runs DIR's notebooks in DIR, with DIR's configs (it ran them with the repository's).

The notebooks write their results without importing labutils, so a kernel takes seconds. The kernel that never
starts is a real process that exits at once: an ``ipykernel_launcher`` module earlier on the kernel's path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from labutils.tools import cli
from tests.test_cli_inputs import full_disk  # noqa: F401 - a fixture
from tests.test_kernel_failures import RECORD, write

REPO = Path(__file__).resolve().parent.parent
READS_ITS_FOLDER = ("import json, os\n"
                    "with open(os.path.join(os.environ['LAB_RESULTS_DIR'], '{stem}.json'), 'w') as f:\n"
                    "    row = {{'cwd': os.getcwd(), 'config': open('configs/x.yaml').read()}}\n"
                    "    json.dump({{'notebook': '{stem}', 'mode': 'smoke', 'tables': {{'t': [row]}},\n"
                    "               'figures': []}}, f)")


def test_notebooks_dir_runs_in_its_own_folder_with_its_configs(tmp_path, capsys):
    """§6: a copy's `seq_length: 48` ran as the repository's 64, reported ok."""
    copy = write(tmp_path / "copy", {"81-Copy": [READS_ITS_FOLDER]})
    (copy / "configs").mkdir()
    (copy / "configs" / "x.yaml").write_text("data:\n  seq_length: 48\n")
    code = cli.main(["regenerate", "--smoke", "--notebooks", str(copy), "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr()
    row = json.loads((tmp_path / "out" / "81-Copy.json").read_text())["tables"]["t"][0]
    assert row == {"cwd": str(copy), "config": "data:\n  seq_length: 48\n"}


def test_nothing_prints_after_the_summary_when_a_kernel_never_starts(tmp_path):
    """§6: "Exception ignored in atexit callback ... nbclient ... AssertionError" came after the summary."""
    never = tmp_path / "never"
    never.mkdir()
    (never / "ipykernel_launcher.py").write_text("import sys\nsys.exit(3)  # the kernel process ends at once\n")
    nbs = write(tmp_path / "nb", {"82-Never": [RECORD]})
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_SMOKE", "LAB_RESULTS_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(never), str(REPO)])
    p = subprocess.run([sys.executable, "-m", "labutils", "regenerate", "--smoke", "--notebooks", str(nbs),
                        "--out", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "summary: 0 ok, 1 failed" in p.stdout and "82-Never failed" in p.stdout, p.stdout
    for noise in ("Traceback", "Exception ignored", "Task was destroyed"):
        assert noise not in p.stderr, p.stderr


def test_a_full_disk_while_writing_the_executed_copy_is_one_line(tmp_path, capsys, full_disk):  # noqa: F811
    """§3: regenerate ended in an OSError [Errno 28] traceback while writing the executed copy."""
    nbs = write(tmp_path / "nb", {"83-Full": [RECORD]})
    out = tmp_path / "out"
    argv = ["regenerate", "--smoke", "--notebooks", str(nbs), "--out", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr()
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    full_disk(out / "executed")
    code = cli.main(argv)
    _, err = capsys.readouterr()
    assert code == 1, err
    assert err.strip().splitlines() == [f"error: cannot write {out / 'executed' / '83-Full.ipynb'}: no space left on "
                                        "device"], err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # whole, nothing half-written
