"""The lab registry (labutils.labs.registry, issue 43): the one list of labs, what each trains and which claims it owns.

The oracles: the repository's own notebooks and configs, the claims of labutils.verdicts.claims, and what each lab's smoke run
recorded. What would fail them: a notebook the registry does not know (or an entry without one) that regenerate
runs anyway, a claim owned by two labs or by none, a lab that records another lab's claims again (lab 04 built the
C1-C7 table from the other labs' results files: a later lab's claim never appeared there).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labutils.verdicts import claims as cl
from labutils.tools import cli
from labutils.labs import registry as labs
from labutils.tools import regenerate as rg
from labutils.tools import timeplan

REPO = Path(__file__).resolve().parent.parent


def test_the_registry_is_the_repositorys_notebooks_and_configs():
    assert [nb.stem for nb in rg.find_notebooks(REPO)] == [lab.stem for lab in labs.LABS]
    assert labs.mismatch(nb.stem for nb in rg.find_notebooks(REPO)) is None
    assert all((REPO / c).is_file() for lab in labs.LABS for c in lab.configs)
    assert [lab.id for lab in labs.LABS] == [lab.stem.split("-")[0] for lab in labs.LABS] == list(labs.IDS)
    assert labs.lab("03").stem == labs.lab(labs.lab("03").stem).stem
    with pytest.raises(KeyError):
        labs.lab("05")


def test_each_claim_has_one_owner():
    owned = [c for lab in labs.LABS for c in lab.claims]
    assert sorted(owned) == sorted(cl.CLAIMS) and len(owned) == len(set(owned))
    assert cl.claim_entry("C4", None, {"mode": "smoke"})["lab"] == cl.OWNER["C4"]


def test_mismatch_names_both_sides():
    stems = [lab.stem for lab in labs.LABS]
    why = labs.mismatch(stems[:-1] + ["05-Extra"])
    assert "05-Extra.ipynb is not in the registry" in why and f"{stems[-1]} of the registry" in why


@pytest.mark.parametrize("change", ["extra entry", "missing entry"])
def test_regenerate_refuses_notebooks_the_registry_does_not_list(monkeypatch, capsys, change):
    """The registry's data changed (not the notebooks: tests never write into the repository): regenerate names
    the notebook or the entry that has no counterpart, and runs nothing."""
    extra, last = labs.Lab("05", "05-Extra", "Extra", (), lambda mode, device: []), labs.LABS[-1].stem
    monkeypatch.setattr(labs, "LABS", labs.LABS + (extra,) if change == "extra entry" else labs.LABS[:-1])
    assert cli.main(["regenerate", "--plan", "--gpu", "NVIDIA H100 80GB HBM3"]) != 0
    err = capsys.readouterr().err
    named = "lab 05-Extra of the registry" if change == "extra entry" else f"notebook {last}.ipynb"
    assert named in err, err


def test_the_plan_prices_every_lab_of_the_registry():
    plan = timeplan.course_plan("NVIDIA H100 80GB HBM3")
    assert [p["lab"] for p in plan["labs"]] == list(labs.IDS)
    assert all(p["runs"] for p in plan["labs"])


def test_lab04_reads_no_other_labs_results():
    nb = json.loads((REPO / f"{labs.lab('04').stem}.ipynb").read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "read_results" not in code and "cl.collect" not in code


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.regen_labs(lab)) for lab in labs.IDS])
def test_each_lab_records_only_the_claims_it_owns(lab):
    from tests import regen_once

    run, stem = regen_once.run_for([lab]), labs.lab(lab).stem
    assert run.lab_ok(stem), run.lab_failure(stem)
    data = json.loads((run.out / f"{stem}.json").read_text(encoding="utf-8"))
    assert sorted(e["id"] for e in data["claims"]) == sorted(labs.lab(lab).claims)


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.regen_labs(lab)) for lab in labs.IDS])
def test_a_clean_run_records_no_leftover(lab):
    """issue 46 §1: every measurement starts by comparing memory with the lab's baseline, and a difference is
    recorded in the lab's results (notes["leftovers"]) because it is in that measurement's peak. In a clean run of
    the notebook nothing may be there. Before: lab 01's ``x`` (4 KiB) and its gradient census's histogram tensor,
    lab 02's replay keeping its first model while it loaded the second (2.3 MB, twice), lab 03's loop variable
    ``mod`` keeping lm_head and its tied embedding (128.5 KiB) for the rest of the lab."""
    from tests import regen_once

    run, stem = regen_once.run_for([lab]), labs.lab(lab).stem
    assert run.lab_ok(stem), run.lab_failure(stem)
    data = json.loads((run.out / f"{stem}.json").read_text(encoding="utf-8"))
    assert "leftovers" not in data["notes"], data["notes"]["leftovers"][:4]
