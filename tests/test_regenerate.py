"""``python -m labutils regenerate``: rendering (pure, on stored JSON fixtures), execution (on tiny fixture
notebooks), the CLI's guards, and end to end on the real lab notebooks in smoke mode.

The end-to-end tests read the session's one ``regenerate --smoke`` run of the real notebooks (tests/regen_once.py):
one lab (``LAB_REGEN_LAB``, default 03) by default; the acceptance of all four when the session collects the four
notebooks (``pytest tests *.ipynb``, the README's test command) or with ``LAB_FULL_REGEN=1`` (``make test-regen-all``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labutils.tools import cli, regenerate as rg, report as rp
from labutils.verdicts.claims import OWNER
from labutils.labs.registry import IDS

REPO = Path(__file__).resolve().parent.parent
FIX = Path(__file__).resolve().parent / "fixtures"
LABS = list(IDS)


# Tiny notebooks, written into a temporary folder by the tests (stored as .ipynb under tests/ they would be
# collected by `pytest --nbval-lax tests`, and 92 fails on purpose).
TINY = {
    "91-Tiny": [
        "import os\nimport matplotlib.pyplot as plt\nimport labutils as lu\nfrom labutils.core.device import detect_mode\n"
        "mode, reason = detect_mode()\nprint(mode, reason, os.getcwd())\n"
        "_ = os.write(2, b'written to the kernel process stderr, below the notebook\\n')  # like C++ library logs",
        "rows = [{'run': 'a', 'cwd_is_its_folder': os.path.exists('91-Tiny.ipynb'),\n"
        "         'budget_gb': os.environ.get('LAB_GPU_MEMORY_GB')},\n"
        "        {'run': 'b', 'cwd_is_its_folder': True, 'budget_gb': None}]\n"
        "fig, ax = plt.subplots(figsize=(3, 2))\nax.plot([0, 1], [1, 0], label='loss')\n"
        "ax.set(title='Tiny', xlabel='step', ylabel='loss')\nax.legend()\nplt.show()",
        "lu.record_results('91-Tiny', tables={'runs': rows}, figures={'curve': fig},\n"
        "                  env=lu.environment(mode=mode, weights='random'))",
    ],
    "92-Broken": [  # the fourth cell (index 3, In [2]) raises
        "x = 1",
        "# markdown: the next cell fails",
        "def check(v):\n    raise ValueError(f'boom {v}')\ncheck(x)",
        "import labutils as lu\nlu.record_results('92-Broken', tables={'never': [{'a': 1}]})",
    ],
    "93-Silent": ["print('runs, records nothing')"],
    "94-Full": [  # records mode "full" with a made-up GPU, so the README path is tested on a CPU
        "import matplotlib.pyplot as plt\nimport labutils as lu\n"
        "env = {'device': 'cuda', 'gpu_name': 'Fixture GPU', 'gpu': {'name': 'Fixture GPU', 'total_memory_bytes': 2**34,\n"
        "       'budget_bytes': 2**33, 'cuda': '12.8'}, 'weights': 'random', 'date': '2030-01-01T00:00:00+00:00'}\n"
        "fig, ax = plt.subplots(figsize=(3, 2))\nax.bar(['a', 'b'], [1, 2])\nax.set(title='Fixture', ylabel='GiB')\n"
        "plt.close(fig)\nlu.record_results('94-Full', tables={'runs': [{'run': 'fixture', 'peak_gib': 1.5}]},\n"
        "                  figures={'bars': fig}, env=env, mode='full')",
    ],
}


def write_notebooks(folder: Path, stems) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    folder.mkdir(parents=True, exist_ok=True)
    for stem in stems:
        nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [new_markdown_cell(f"# {stem} (test notebook)")] + [
            new_markdown_cell(src[2:]) if src.startswith("# markdown") else new_code_cell(src) for src in TINY[stem]]
        nbformat.write(nb, folder / f"{stem}.ipynb")
    return folder


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_notebooks(tmp_path / "notebooks", ["91-Tiny", "92-Broken", "93-Silent"])


def fixture_results() -> dict[str, dict]:
    return rp.load_results(FIX / "results")


def outside_markers(text: str) -> str:
    """The README with every marked region's content cut out: what must never change."""
    return re.sub(r"(<!-- results:(\w+) -->).*?(<!-- /results:\2 -->)", r"\1\3", text, flags=re.S)


def digest(paths) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def kernel_children() -> list[int]:
    """ipykernel processes that this test process started and that are still alive (Linux /proc)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(os.getpid()) and b"ipykernel" in cmdline:
            pids.append(int(status.parent.name))
    return pids


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout


# ------------------------------------------------------------------------------------------------ rendering
def test_render_full_lab_has_provenance_table_and_figures():
    data = fixture_results()["01"]
    md = rp.render_lab(data, "results/", readme=True)
    assert "NVIDIA H100 80GB HBM3" in md and "79.2 GiB" in md
    assert "capped to 8.0 GiB (`--gpu-memory-gb 8`)" in md
    assert "CUDA 12.8" in md and "compute capability 9.0" in md
    assert "random init" in md and "not those of pretrained GPT-2" in md
    assert "2030-01-02T03:04:05+00:00" in md and "torch 2.13.0+cu128" in md
    assert "SMOKE" not in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    # byte columns are shown in the unit their values call for (the JSON keeps bytes)
    assert table[0] == "| precision | status | step_time_s | tokens_per_s | peak_memory_gib | skipped_steps | error |"
    assert len(table) == 2 + 3  # header, rule, one row per run
    assert "| bf16 | oom | - |" in md  # missing numbers shown as "-", not "None"
    assert "CUDA out of memory / fixture" in md  # a "|" inside a cell cannot break the table
    assert "![01-Mixed_Precision-curves](results/figures/01-Mixed_Precision-curves.png)" in md
    assert "fixture: made-up numbers" in md  # notes are rendered


def test_render_leaves_structured_cells_in_the_json():
    """A row's config (the scale_model table's full_config, a dict of ~40 keys) stays in the results JSON; the page
    shows the row's scalar columns (the whole dict used to land in one table cell)."""
    data = {"mode": "full", "env": {}, "tables": {"scale_model": [
        {"row": "fp32 x 16", "full_fits": False, "status": "oom", "full_config": {"train.micro_batch_size": 16},
         "overrides": {"train.micro_batch_size": 16}}]}}
    table = [line for line in rp.render_lab(data).splitlines() if line.startswith("|")]
    assert table[0] == "| row | full_fits | status |" and "micro_batch_size" not in "".join(table)


def test_render_weights_from_rows_and_uncapped_card():
    md = rp.render_lab(fixture_results()["03"])
    assert "Weights: pretrained GPT-2" in md  # env has weights null; the rows say pretrained
    assert "NVIDIA GeForce RTX 3070, 8.0 GiB, no memory cap" in md
    assert "*checkpointing*" in md and "*recompute cost*" in md
    assert "![03-Gradient_Checkpointing-speed](figures/03-Gradient_Checkpointing-speed.png)" in md


def test_smoke_results_are_refused_as_readme_results():
    results = fixture_results()
    with pytest.raises(ValueError, match="smoke results never go into README.md"):
        rp.render_lab(results["02"], readme=True)
    blocks, refused = rp.readme_blocks(results)
    assert sorted(blocks) == ["01", "03"] and refused == ["02"]
    md = rp.render_lab(results["02"])  # outside the README a smoke run is rendered, and labelled
    assert "**SMOKE RUN**" in md and "CPU (x86_64), no GPU" in md
    page = rp.render_results(results)
    assert "**Smoke results**" in page and page.index("## 01-Mixed_Precision") < page.index("## 03-Gradient")


def test_update_readme_replaces_marked_blocks_only():
    text = (FIX / "README.md").read_text(encoding="utf-8")
    blocks, _ = rp.readme_blocks(fixture_results())
    new = rp.update_readme(text, blocks)
    assert outside_markers(new) == outside_markers(text)  # other README text untouched, byte for byte
    assert "old lab 03 text" not in new and "NVIDIA GeForce RTX 3070" in new
    lab01 = re.search(r"<!-- results:01 -->\n(.*?)\n<!-- /results:01 -->", new, re.S).group(1)
    assert lab01 == blocks["01"].strip()
    assert "results/figures/01-Mixed_Precision-curves.png" in lab01
    placeholder = "<!-- results:02 -->\n_No full GPU run yet._ Run `make results` on a CUDA GPU.\n<!-- /results:02 -->"
    assert placeholder in text and placeholder in new  # smoke-only lab 02: left as it was
    assert placeholder.replace("02", "04") in new  # lab 04 has no JSON: left as it was
    assert rp.update_readme(new, blocks) == new  # idempotent
    assert rp.update_readme(text, {}) == text


def test_update_readme_markers_checked():
    assert sorted(rp.marker_spans((FIX / "README.md").read_text(encoding="utf-8"))) == LABS
    assert rp.update_readme("no markers here\n", {"01": "table"}) == "no markers here\n"
    twice = "<!-- results:01 -->a<!-- /results:01 -->\n<!-- results:01 -->b<!-- /results:01 -->"
    with pytest.raises(ValueError, match="exactly one"):
        rp.update_readme(twice, {"01": "x"})
    with pytest.raises(ValueError, match="never closed"):
        rp.update_readme("<!-- results:01 --> unclosed", {"01": "x"})
    with pytest.raises(ValueError, match="closes no open block"):
        rp.update_readme("<!-- /results:01 --> <!-- results:01 -->", {"01": "x"})  # wrong order


def test_find_notebooks_and_kernel_env(tiny):
    (tiny / "notes.ipynb").write_text("{}")  # not a lab: no NN- prefix
    nbs = rg.find_notebooks(tiny)
    assert [nb.stem for nb in nbs] == ["91-Tiny", "92-Broken", "93-Silent"]
    assert [nb.stem for nb in rg.find_notebooks(tiny, "93, 91")] == ["91-Tiny", "93-Silent"]
    assert [nb.stem for nb in rg.find_notebooks(tiny, ["92-Broken.ipynb"])] == ["92-Broken"]
    with pytest.raises(ValueError, match="--only 7: no such lab.*91, 92, 93"):
        rg.find_notebooks(tiny, "91,7")
    env = rg.kernel_env("/tmp/r", smoke=False, gpu_memory_gb=0, base={"LAB_SMOKE": "1", "LAB_GPU_MEMORY_GB": "4"})
    assert env["LAB_RESULTS_DIR"] == "/tmp/r" and "LAB_SMOKE" not in env and "LAB_GPU_MEMORY_GB" not in env
    env = rg.kernel_env("/tmp/r", smoke=True, gpu_memory_gb=8.0, base={})
    assert env["LAB_SMOKE"] == "1" and env["LAB_GPU_MEMORY_GB"] == "8"


# ------------------------------------------------------------------------------------------------ execution
def test_regenerate_fixture_notebooks(tmp_path, tiny):
    nbs = rg.find_notebooks(tiny)
    tmp_path = tmp_path / "out"
    before = digest(nbs)
    lines = []
    outcomes = rg.regenerate(nbs, tmp_path, smoke=True, gpu_memory_gb=8, log=lambda *a, **k: lines.append(a[0]))
    ok, broken, silent = outcomes
    assert ok.ok and ok.json_path == tmp_path / "91-Tiny.json"
    data = json.loads(ok.json_path.read_text())
    assert data["mode"] == "smoke" and data["env"]["mode"] == "smoke" and data["env"]["gpu_memory_budget_gb"] == 8
    assert data["tables"]["runs"][0] == {"run": "a", "cwd_is_its_folder": True, "budget_gb": "8"}  # cwd, env reached it
    assert data["figures"] == ["figures/91-Tiny-curve.png"] and (tmp_path / data["figures"][0]).stat().st_size > 0
    assert not broken.ok and (broken.cell_index, broken.execution_count) == (3, 2)
    assert broken.error == "ValueError: boom 1 (line 2: raise ValueError(f'boom {v}'))"  # the line that raised
    assert not silent.ok and "no results recorded" in silent.error and silent.cell_index is None
    assert not (tmp_path / "92-Broken.json").exists()
    executed = json.loads((tmp_path / "executed" / "92-Broken.ipynb").read_text())
    assert any(o.get("ename") == "ValueError" for c in executed["cells"] for o in c.get("outputs", []))
    assert "below the notebook" in (tmp_path / "executed" / "91-Tiny.kernel.log").read_text()  # not in the log lines
    assert not any("below the notebook" in line for line in lines)
    assert not (tmp_path / "executed" / "93-Silent.kernel.log").exists()  # no empty logs left behind
    assert not list(tmp_path.glob(".staging-*"))  # staging folders cleaned up
    if Path("/proc/self/status").exists():
        assert kernel_children() == []  # each notebook's kernel (and its GPU memory) is gone when it ends
    assert digest(nbs) == before  # the notebooks themselves are only read
    page = (tmp_path / "README-results.md").read_text()
    assert "## 91-Tiny" in page and "**Smoke results**" in page and "| a | yes | 8 |" in page
    assert any("92-Broken" in line and "FAILED" in line and "cell 3, In [2]: ValueError: boom 1 (line 2" in line
               for line in lines)
    summary = rg.summary_line(outcomes, 1.0)
    assert "1 ok, 2 failed" in summary and "92-Broken failed at cell 3" in summary


def test_full_run_never_keeps_smoke_numbers(tmp_path):
    """A full run whose kernel has no GPU records smoke numbers: they are not kept, earlier results stay."""
    nb = rg.find_notebooks(write_notebooks(tmp_path / "notebooks", ["91-Tiny"]))
    previous = json.dumps({"notebook": "91-Tiny", "mode": "full", "env": {"gpu_name": "Earlier GPU"},
                           "tables": {"runs": [{"run": "earlier"}]}, "figures": []})
    (tmp_path / "91-Tiny.json").write_text(previous)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:91 -->\nkept\n<!-- /results:91 -->\n")
    from tests import fake_cuda
    (o,) = rg.regenerate(nb, tmp_path, smoke=False, gpu_memory_gb=8, readme=readme, log=lambda *a, **k: None)
    if fake_cuda.real_gpu_present():  # the GPU runner: the kernel (a subprocess: real hardware) ran in full mode
        assert o.ok and json.loads((tmp_path / "91-Tiny.json").read_text())["mode"] == "full"
        assert "kept" not in readme.read_text() and "| a | yes | 8 |" in readme.read_text()
    else:
        assert not o.ok and "recorded in smoke mode, not full" in o.error
        assert (tmp_path / "91-Tiny.json").read_text() == previous
        assert not (tmp_path / "figures" / "91-Tiny-curve.png").exists()
        text = readme.read_text()  # rendered from the earlier full results, never from this run's smoke numbers
        assert "Earlier GPU" in text and "| earlier |" in text and "CPU" not in text and "kept" not in text


def test_full_run_updates_readme_between_markers(tmp_path):
    """The README path of a full run, on a CPU: a fixture notebook that records mode "full" (made-up GPU)."""
    (tmp_path / "results").mkdir()
    readme = tmp_path / "README.md"
    text = ("# Course\n\nintro\n<!-- results:94 -->\nNo full GPU run yet.\n<!-- /results:94 -->\n"
            "<!-- results:95 -->\nlab 95 placeholder\n<!-- /results:95 -->\nend\n")
    readme.write_text(text)
    lines = []
    (o,) = rg.regenerate(rg.find_notebooks(write_notebooks(tmp_path / "nb", ["94-Full"])), tmp_path / "results", smoke=False, gpu_memory_gb=8,
                         readme=readme, log=lambda *a, **k: lines.append(a[0]))
    assert o.ok, o
    new = readme.read_text()
    assert outside_markers(new) == outside_markers(text)
    assert "lab 95 placeholder" in new and "No full GPU run yet" not in new
    assert "Fixture GPU, 16.0 GiB, capped to 8.0 GiB" in new and "| fixture | 1.5 |" in new
    assert "![94-Full-bars](results/figures/94-Full-bars.png)" in new  # links relative to the README
    assert (tmp_path / "results" / "figures" / "94-Full-bars.png").exists()
    assert "![94-Full-bars](figures/94-Full-bars.png)" in (tmp_path / "results" / "README-results.md").read_text()
    assert any(line.startswith("updated README.md: labs 94") for line in lines)


# ------------------------------------------------------------------------------------------------ CLI guards
@pytest.mark.parametrize("kind", ["--smoke", "--rehearse"])
@pytest.mark.parametrize("out", ["results", "results/sub", str(REPO / "results")])
def test_smoke_never_writes_results(out, kind, capsys, monkeypatch):
    """Neither a smoke run nor a rehearsal (the GPU command at smoke sizes) writes into results/; a rehearsal with
    --smoke is refused too. Breaks if smoke-sized numbers could land beside a GPU's."""
    monkeypatch.chdir(REPO)
    assert cli.main(["regenerate", kind, "--out", out]) == 2
    assert "smoke results never go into results/" in capsys.readouterr().err
    assert cli.main(["regenerate", "--smoke", "--rehearse", "--out", out]) == 2
    assert "--rehearse already runs smoke sizes" in capsys.readouterr().err


def test_cli_usage_errors(capsys, monkeypatch):
    lab = sorted(REPO.glob("01-*.ipynb"))  # a real notebook (it is read before the run), never run here
    monkeypatch.setattr(rg, "find_notebooks", lambda folder, only=None: lab)
    monkeypatch.setattr(rg, "_cuda_available", lambda: False)
    assert cli.main(["regenerate"]) == 2  # full run without a GPU
    assert "a full run needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["regenerate", "--smoke", "--gpu-memory-gb", "-1"]) == 2
    assert "must be a number of GiB from 0" in capsys.readouterr().err
    assert cli.main(["regenerate", "--smoke", "--out", str(REPO)]) == 2
    assert "not the repository root" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.main(["regenerate", "--smoke", "--only", "7"]) == 2
    assert "--only 7: no such lab" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ end to end
def run_cli(*args, timeout):
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_SMOKE", "LAB_RESULTS_DIR")}
    return subprocess.run([sys.executable, "-m", "labutils", "regenerate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_smoke_output(out: Path, stems: list[str]):
    page = (out / "README-results.md").read_text()
    assert "**Smoke results**" in page
    for stem in stems:
        data = json.loads((out / f"{stem}.json").read_text())
        assert data["notebook"] == stem and data["mode"] == "smoke"
        env = data["env"]
        for key in ("device", "torch", "transformers", "python", "date", "mode", "weights"):
            assert env.get(key), f"{stem}: env[{key!r}] not filled"
        assert env["gpu_memory_budget_gb"] == 8
        assert any(data["tables"].values()), f"{stem} recorded no table rows"  # one may be empty (e.g. CPU: no fragmentation)
        assert data["figures"], f"{stem} recorded no figures"
        for fig in data["figures"]:
            assert (out / fig).stat().st_size > 1000
        assert f"## {stem}" in page and f"]({data['figures'][0]})" in page
        assert (out / "executed" / f"{stem}.ipynb").exists()
        check_claims(data)
    if len(stems) == len(LABS):  # the acceptance: the results page's C1-C7, each from the results file of the lab
        table = page.split("## Claims C1-C7 across the labs")[1].split("\n## ")[0]  # that owns it, with its time
        rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| C")}
        assert sorted(rows) == [f"C{i}" for i in range(1, 8)], table
        for cid, line in rows.items():
            stem = OWNER[cid]
            date = json.loads((out / f"{stem}.json").read_text())["env"]["date"]
            assert line.endswith(f"| {stem} | {date} |"), line


def check_claims(data: dict):
    """Each recorded claim: a verdict from the vocabulary, a measured value unless not measured (then a why),
    and in smoke mode labelled a smoke measurement with the tiny model, on the hardware the notebook kernel ran on
    (a subprocess: this machine's real GPU by name if it has one, else "cpu"; a session's pretend GPU is
    in-process only)."""
    import torch
    from tests import fake_cuda
    hardware = torch.cuda.get_device_name(0) if fake_cuda.real_gpu_present() else "cpu"
    from labutils.verdicts.claims import VERDICTS

    assert data["claims"], f"{data['notebook']} recorded no claims"
    from labutils.core.config import load_config
    from labutils.labs.registry import lab

    smoke_models = {load_config(c, mode="smoke").model.name for c in lab(data["notebook"]).configs}  # the lab's own
    for e in data["claims"]:
        assert e["verdict"] in VERDICTS, e
        if e["verdict"] == "not measured":
            assert e["why"].startswith("Not measured: ") and len(e["why"]) > 20, e
        else:
            assert e["measured"] and all(m["value"] is not None and m["unit"] is not None
                                         for m in e["measured"].values()), e
            if data["mode"] == "smoke":
                assert e["measurement"].startswith("smoke measurement"), e
                assert e["conditions"]["hardware"] == hardware and e["conditions"]["model"] in smoke_models, e


def lab_stems(labs):
    stems = [nb.stem for nb in rg.find_notebooks(REPO, labs)]
    assert stems, f"no lab notebooks {labs} in {REPO}"
    return stems


@pytest.mark.regen_labs(os.environ.get("LAB_REGEN_LAB", "03"))
def test_cli_smoke_one_lab():
    """One lab end to end through the real command (the session's shared run, tests/regen_once.py)."""
    from tests import regen_once

    lab = os.environ.get("LAB_REGEN_LAB", "03")
    stems = lab_stems([lab])
    run = regen_once.run_for([lab])
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.lab_ok(stems[0]) and re.search(r"summary: \d+ ok, 0 failed", run.stdout), run.stdout
    check_smoke_output(run.out, stems)
    assert run.status_after == run.status_before  # the git tree is unchanged, ignored files included


@pytest.mark.regen_labs("all")
def test_cli_smoke_all_labs():
    """The acceptance: all four notebooks regenerated in smoke mode (the session's one run of them, which also
    passes or fails each notebook collected by `pytest tests *.ipynb`)."""
    from tests import regen_once

    stems = lab_stems(LABS)
    assert len(stems) == len(LABS)
    run = regen_once.run_for(LABS)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "summary: 4 ok, 0 failed" in run.stdout, run.stdout
    check_smoke_output(run.out, stems)
    assert run.status_after == run.status_before
    # every file under the repository, ignored ones included, as it was (issue 24: nothing outside --out)
    before, after = run.tree_before, run.tree_after
    assert after == before, sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))[:20]


@pytest.mark.regen_labs("all")
def test_the_one_gpu_command_rehearsed_under_the_pretend_h100():
    """The session's run of all four labs is ``make gpu-results REHEARSE=1`` (tests/regen_once.py), its Python under
    the pretend H100. What the first real run needs of it: the plan for that card printed before anything runs, then
    the doctor, the four labs and the bench, and one folder holding what results/<gpu>/ holds (lab JSON, figures,
    doctor.json, bench.json, README-results.md, run.json naming the card, torch and date) in a few MB, the README's
    markers read and written back in a copy. Breaks if the Makefile's recipe, regenerate's order, a report's file
    name or run.json's keys change, or the folder grows past what a commit should carry."""
    import torch

    from tests import regen_once

    run = regen_once.run_for(LABS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = run.stdout
    order = [text.find(s) for s in ("time plan for NVIDIA H100 80GB HBM3", "make gpu-results PART=1 ",
                                    "checking this machine first", "] 01-", "] 04-", "the fast path against the reference",
                                    "archives (the README's recipe", "summary: 4 ok, 0 failed")]
    assert -1 not in order and order == sorted(order), text[:3000]
    out = run.out
    doctor = json.loads((out / "doctor.json").read_text())
    assert doctor["checks"] and not [c for c in doctor["checks"] if c["status"] == "fail"]
    bench = json.loads((out / "bench.json").read_text())
    assert bench["repeats"] == 1 and {"labutils", "reference", "verdict"} <= set(bench)
    record = json.loads((out / "run.json").read_text())
    assert record["gpu"] == "NVIDIA H100 80GB HBM3" and record["mode"] == "rehearsal"
    assert record["torch"] == torch.__version__ and record["date"][:4].isdigit()
    assert set(record["labs"].values()) == {"ok"} and len(record["labs"]) == len(LABS)
    parts = {"doctor", *LABS, "bench"}
    assert set(record["seconds"]) == parts == set(record["predicted_seconds"])
    assert all(v > 0 for v in record["seconds"].values())
    assert (out / "README.md").read_text() == (REPO / "README.md").read_text()  # smoke results never fill it
    kept = [f for f in out.rglob("*") if f.is_file() and f.relative_to(out).parts[0] not in ("executed", "artifacts")]
    assert sum(f.stat().st_size for f in kept) < 5e6, sorted((f.stat().st_size, str(f)) for f in kept)[-5:]
    # issue 45 §5: the two archives the README's recipe packs, listed with their sizes and estimated at full sizes;
    # the oracle is the tar command itself, run here on the same folder (its gzip level differs: within 15 %)
    line = next(l for l in text.splitlines() if l.startswith("archives (the README's recipe"))
    said = [float(x) for x in re.findall(r"([\d.]+) MiB", line)]
    packed = []
    for name, args in (("r.tgz", ["--exclude=executed", "--exclude=artifacts", "."]), ("a.tgz", ["executed", "artifacts"])):
        subprocess.run(["tar", "czf", str(out.parent / name), "-C", str(out), *args], check=True)
        packed.append((out.parent / name).stat().st_size / 2**20)
    assert said[:2] == pytest.approx(packed, rel=0.15, abs=0.06), (line, packed)
    assert "at full sizes about" in line and "traces x 6" in line and line.endswith("each under the 16 MiB a lent GPU hands back")
    assert said[2] == said[0] and said[3] > said[1]  # the traces grow with the blocks profiled, the rest does not
    # ... and no figure is kept twice: the PNGs are in figures/, the executed copies keep the figures' text line only
    outputs = [o for nb in (out / "executed").glob("*.ipynb") for c in json.loads(nb.read_text())["cells"]
               for o in c.get("outputs", [])]
    assert outputs and not [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(list((out / "figures").glob("*.png"))) >= len(LABS)
