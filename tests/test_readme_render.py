"""Rendering results into README.md safely (issue 14, class 6).

- results are keyed by the notebook that wrote them: a stale or renamed ``NN-*.json`` never shadows a lab;
- a corrupt results file is refused in one line before any notebook runs;
- broken markers (nested, interleaved, repeated, unclosed, stray) refuse with one line, README byte-for-byte
  unchanged, and the log never says "updated";
- the rewrite keeps every byte outside the markers, the line endings (CRLF), the file mode and a symlink.

The README step is driven through ``regenerate()`` with no notebook to run (results already in the folder), so
no kernel starts; one test runs a real fixture notebook end to end.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from labutils.tools import cli, regenerate as rg, report as rp

from test_regenerate import FIX, outside_markers, write_notebooks

FIXTURE_STEMS = [p.stem for p in sorted((FIX / "results").glob("*.json"))]


def results_folder(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    shutil.copytree(FIX / "results", out)
    return out


def render_readme(out: Path, readme: Path, stems=FIXTURE_STEMS) -> list[str]:
    """What regenerate draws after each lab, and ``--render-only`` alone: the results page and the README's blocks."""
    lines, failed = [], []
    rg.render(out, stems, readme, failed, log=lambda *a, **k: lines.append(a[0]))
    return lines, failed[:1]


# ------------------------------------------------------------------------------------ keyed by notebook
@pytest.mark.parametrize("stale", ["01-Mixed_Precision_old", "01-ZZ_Renamed", "01-AA_Renamed"])
def test_stale_or_renamed_results_never_shadow_the_lab(tmp_path, stale):
    out = results_folder(tmp_path)
    data = json.loads((out / "01-Mixed_Precision.json").read_text())
    data["notebook"] = stale
    data["env"]["gpu"]["name"] = "STALE GPU"
    (out / f"{stale}.json").write_text(json.dumps(data))
    results = rp.load_results(out, FIXTURE_STEMS)
    assert results["01"]["notebook"] == "01-Mixed_Precision"
    assert "STALE GPU" not in rp.render_results(results)
    readme = tmp_path / "README.md"
    readme.write_text((FIX / "README.md").read_text())
    render_readme(out, readme)
    assert "STALE GPU" not in readme.read_text() and "NVIDIA H100 80GB HBM3" in readme.read_text()


def test_a_notebook_recording_under_another_name_is_not_kept(tmp_path):
    """The end-to-end path: a fixture notebook whose record_results names another notebook."""
    nb = write_notebooks(tmp_path / "nb", ["94-Full"])
    renamed = nb / "95-Renamed.ipynb"
    os.replace(nb / "94-Full.ipynb", renamed)
    (o,) = rg.regenerate([renamed], tmp_path / "out", smoke=False, gpu_memory_gb=8, log=lambda *a, **k: None)
    assert not o.ok and "recorded as 94-Full, not '95-Renamed'" in o.error
    assert not (tmp_path / "out" / "94-Full.json").exists()


# ------------------------------------------------------------------------------------ corrupt results
@pytest.mark.parametrize("content", [b"{", b"", b"\xff\xfe\x00", b"[1, 2]", b'{"tables": [1]}', b"NaN"],
                         ids=["truncated", "empty", "not UTF-8", "a list", "tables not a mapping", "bare NaN"])
def test_a_corrupt_results_file_is_refused_before_any_notebook_runs(tmp_path, capsys, content):
    nb = write_notebooks(tmp_path / "nb", ["93-Silent"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "93-Silent.json").write_bytes(content)
    code = cli.main(["regenerate", "--smoke", "--notebooks", str(nb), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "93-Silent.json" in err and "Traceback" not in err
    assert not (out / "executed").exists()  # nothing ran
    assert (out / "93-Silent.json").read_bytes() == content  # and the file is left for the user to look at


# ------------------------------------------------------------------------------------ markers
BROKEN = {
    "nested": "<!-- results:01 -->\na\n<!-- results:02 -->\nb\n<!-- /results:02 -->\n<!-- /results:01 -->\n",
    "interleaved": "<!-- results:01 -->\na\n<!-- results:02 -->\nb\n<!-- /results:01 -->\n<!-- /results:02 -->\n",
    "repeated": "<!-- results:01 -->a<!-- /results:01 -->\n<!-- results:01 -->b<!-- /results:01 -->\n",
    "unclosed": "<!-- results:03 -->\nnever closed\n",
    "stray close": "text\n<!-- /results:03 -->\n",
    "closed by another lab": "<!-- results:01 -->\na\n<!-- /results:03 -->\n",
    "broken lab elsewhere": "<!-- results:01 -->\na\n<!-- /results:01 -->\n<!-- results:04 -->\nno end\n",
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_markers_refuse_and_leave_the_readme_byte_for_byte(tmp_path, case):
    text = "# Course\r\n\r\nintro\r\n" + BROKEN[case] + "tail\n"
    with pytest.raises(ValueError) as info:
        rp.update_readme(text, {"01": "new table", "02": "new", "03": "new"})
    assert len(str(info.value).splitlines()) == 1 and "line " in str(info.value)
    readme = tmp_path / "README.md"
    readme.write_bytes(text.encode())
    before = readme.read_bytes()
    lines, outcomes = render_readme(results_folder(tmp_path), readme)
    assert readme.read_bytes() == before
    assert not any(line.startswith("updated") for line in lines)
    assert any(line.startswith("error: README.md not updated") for line in lines)
    assert not outcomes[-1].ok  # the run fails, so the summary says so


def test_marker_like_text_is_not_a_marker():
    text = "see `<!-- results:NN -->` and `<!-- /results:NN -->`\n<!-- results:01 -->\nx\n<!-- /results:01 -->\n"
    assert sorted(rp.marker_spans(text)) == ["01"]
    assert "see `<!-- results:NN -->`" in rp.update_readme(text, {"01": "y"})


# ------------------------------------------------------------------------------------ bytes, endings, mode, links
@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["LF", "CRLF"])
@pytest.mark.parametrize("mode", [0o644, 0o664, 0o600, 0o755])
def test_rewrite_keeps_bytes_line_endings_and_mode(tmp_path, newline, mode):
    text = (FIX / "README.md").read_text(encoding="utf-8").replace("\n", newline)
    readme = tmp_path / "README.md"
    readme.write_bytes(text.encode("utf-8"))
    readme.chmod(mode)
    lines, outcomes = render_readme(results_folder(tmp_path), readme)
    assert all(o.ok for o in outcomes), outcomes
    new = readme.read_bytes().decode("utf-8")
    assert new != text and "NVIDIA H100 80GB HBM3" in new
    assert outside_markers(new) == outside_markers(text)  # every byte outside the markers
    if newline == "\r\n":
        assert new.count("\n") == new.count("\r\n")  # no bare LF slipped in
    else:
        assert "\r" not in new
    assert stat.S_IMODE(readme.stat().st_mode) == mode
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("link", ["relative", "absolute"])
def test_rewrite_writes_through_a_symlink(tmp_path, link):
    target = tmp_path / "docs" / "README.real.md"
    target.parent.mkdir()
    target.write_text((FIX / "README.md").read_text(encoding="utf-8"))
    target.chmod(0o640)
    readme = tmp_path / "README.md"
    readme.symlink_to(os.path.relpath(target, tmp_path) if link == "relative" else target)
    link_text = os.readlink(readme)
    render_readme(results_folder(tmp_path), readme)
    assert readme.is_symlink() and os.readlink(readme) == link_text  # still the same link
    assert "NVIDIA H100 80GB HBM3" in target.read_text()  # the target got the update
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    # figure links are relative to the README's own folder (the link), where readers open it
    assert re.search(r"\]\(results/figures/01-Mixed_Precision-curves\.png\)", target.read_text())
