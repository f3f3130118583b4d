"""Issue 21: ``python -m labutils run configs/fast_config.yaml`` on a card where its micro-batch does not fit picks
the largest micro-batch the estimator fits, accumulating to the same effective batch, and says so.

Run through the real CLI (``labutils.tools.cli.main``) under the pretend GPU (tests/fake_cuda.py: only driver entry points
replaced). ``labutils.core.train.run`` is replaced by a recorder that stops the command: what is checked is the config
that would be trained. Oracles from outside the fitting code: the effective batch read from the YAML file with
``yaml`` itself, each card's memory from the fake_cuda profiles, and the config's own statement (issue 21) that
B16 x T1024 needs roughly 12 GB, so it cannot fit an 8 GB card and does fit an 80 GB one.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from labutils.core import cards
from labutils.tools import cli
from labutils.core import device as dev
from labutils.estimator.advise import fit_micro_batch
from labutils.core.config import load_config
from tests import fake_cuda

tr = importlib.import_module("labutils.core.train")
FAST = Path(__file__).resolve().parent.parent / "configs" / "fast_config.yaml"
REAL_GPU = fake_cuda.real_gpu_present()  # a session-wide pretend GPU (LAB_PRETEND_GPU) is not a real one

with open(FAST) as f:
    FILE = yaml.safe_load(f)["train"]
EFFECTIVE = FILE["micro_batch_size"] * FILE["accumulation_steps"]


class Stop(Exception):
    """Raised by the recorder in place of training."""


def run_cli(monkeypatch, capsys, profile, *extra, env_gib=None, whole=False):
    """``python -m labutils run configs/fast_config.yaml [extra]`` on a pretend ``profile`` card, full mode;
    returns (the train section of the config handed to train.run, or ``whole`` config, stdout)."""
    if REAL_GPU:
        pytest.skip("a real CUDA GPU is present: the pretend driver would not be the one answering")
    monkeypatch.delenv("LAB_SMOKE", raising=False)  # full mode: the mode follows the (pretend) GPU
    monkeypatch.setattr(dev, "_state", {})
    if env_gib is None:
        monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    else:
        monkeypatch.setenv("LAB_GPU_MEMORY_GB", str(env_gib))
    fake_cuda.install(monkeypatch, profile)
    seen = []

    def record(cfg, *a, **kw):
        seen.append(cfg)
        raise Stop
    monkeypatch.setattr(tr, "run", record)
    with pytest.raises(Stop):
        cli.main(["run", str(FAST), "--quiet", *extra])
    assert seen, "train.run was never reached"
    return (seen[0] if whole else seen[0].train), capsys.readouterr().out


def test_an_8gb_card_gets_a_smaller_micro_batch_and_the_same_effective_batch(monkeypatch, capsys):
    """Breaks if the fit is skipped (an OOM instead), changes the effective batch, or says nothing."""
    t, out = run_cli(monkeypatch, capsys, "rtx3070-8gb")
    assert t.micro_batch_size < FILE["micro_batch_size"]
    assert t.micro_batch_size * t.accumulation_steps == EFFECTIVE
    assert EFFECTIVE % t.micro_batch_size == 0
    line = next(x for x in out.splitlines() if "effective batch" in x)
    assert f"{FILE['micro_batch_size']} x {FILE['accumulation_steps']} does not fit" in line
    assert f"running {t.micro_batch_size} x {t.accumulation_steps}" in line and f"of {EFFECTIVE}" in line


def test_an_h100_keeps_the_config_micro_batch(monkeypatch, capsys):
    """Breaks if the fit shrinks a batch that fits (an 80 GB card, a ~12 GB step) or prints a line for nothing."""
    t, out = run_cli(monkeypatch, capsys, "h100")
    assert (t.micro_batch_size, t.accumulation_steps) == (FILE["micro_batch_size"], FILE["accumulation_steps"])
    assert "effective batch" not in out


def test_an_h100_told_to_behave_like_an_8gb_card_is_fitted_to_8gb(monkeypatch, capsys):
    """LAB_GPU_MEMORY_GB=8: the budget is the 8 GB card (7.78 GiB to torch), not the H100's 80 GB (breaks if the fit reads the
    device's total memory instead of the budget the run is capped to)."""
    t, out = run_cli(monkeypatch, capsys, "h100", env_gib=8)
    assert t.micro_batch_size < FILE["micro_batch_size"] and t.micro_batch_size * t.accumulation_steps == EFFECTIVE
    # the card an "8 GB" GeForce really is to torch (labutils.core.cards, from public OOM messages), not 8.0 GiB
    assert f"{cards.card_total_bytes(8)[0] / 2**30:.1f} GiB" in out and "8.0 GiB" not in out


@pytest.mark.parametrize("micro", [FILE["micro_batch_size"], 4])
def test_an_explicit_micro_batch_is_respected(monkeypatch, capsys, micro):
    """``--set train.micro_batch_size=`` wins on an 8 GB card, even where it will not fit (the run then reports
    its own OOM): breaks if the fit overrides what the user asked for."""
    t, out = run_cli(monkeypatch, capsys, "rtx3070-8gb", "--set", f"train.micro_batch_size={micro}")
    assert (t.micro_batch_size, t.accumulation_steps) == (micro, FILE["accumulation_steps"])
    assert "effective batch" not in out


def test_fit_micro_batch_against_the_pretend_cards_memory():
    """The function itself, with each pretend card's total memory as the budget: an 8 GB card is fitted (the same
    effective batch), an H100's 80 GB leaves the config as it is."""
    cfg = load_config(FAST, mode="full")
    small, line = fit_micro_batch(cfg, fake_cuda.PROFILES["rtx3070-8gb"].total)
    assert small.train.micro_batch_size < FILE["micro_batch_size"] and line
    assert small.train.micro_batch_size * small.train.accumulation_steps == EFFECTIVE
    assert small.model == cfg.model and small.data == cfg.data  # only the batch split changes
    same, line = fit_micro_batch(cfg, fake_cuda.PROFILES["h100"].total)
    assert line is None and same.train.micro_batch_size == FILE["micro_batch_size"]


# ---- issue 47 §3: the loss chunk sized by memory ---------------------------------------------------------------------
def test_an_unset_loss_chunk_is_one_chunk_where_the_logits_fit_else_the_fewest_that_fit(monkeypatch, capsys):
    """fast_config.yaml leaves ``model.loss_chunk_size`` unset. On an H100 (80 GB; the config says its step needs
    about 12 GB) the whole micro-batch's logits fit: one chunk, and nothing is said. On an 8 GB card, at the micro-batch
    fitted for it, the fewest chunks the estimator fits, said in one line; one chunk fewer would not fit. Breaks if the
    size stays a fixed number of positions (extra chunks, each re-reading the LM head), if one chunk is taken where it
    does not fit, or if a size set with --set is overridden."""
    from labutils.estimator.estimate import estimate_memory, fits

    assert "loss_chunk_size" not in yaml.safe_load(FAST.read_text())["model"]
    cfg, out = run_cli(monkeypatch, capsys, "h100", whole=True)
    positions = cfg.train.micro_batch_size * cfg.data.seq_length
    assert cfg.model.loss_chunk_size == positions and "loss_chunk_size" not in out
    cfg, out = run_cli(monkeypatch, capsys, "rtx3070-8gb", whole=True)
    positions, size = cfg.train.micro_batch_size * cfg.data.seq_length, cfg.model.loss_chunk_size
    chunks, budget = -(-positions // size), fake_cuda.PROFILES["rtx3070-8gb"].total
    assert fits(estimate_memory(cfg), budget)
    if chunks > 1:
        assert not fits(estimate_memory(cfg, loss_chunk=-(-positions // (chunks - 1))), budget)
        assert f"model.loss_chunk_size: {size}, {chunks} chunks" in out
    cfg, _ = run_cli(monkeypatch, capsys, "rtx3070-8gb", "--set", "model.loss_chunk_size=2048", whole=True)
    assert cfg.model.loss_chunk_size == 2048



def test_estimate_sizes_an_unset_loss_chunk_for_its_budget(capsys):
    """``python -m labutils estimate configs/fast_config.yaml --gpu-memory-gb 12`` (the command the config's own comment
    names): the chunk is sized for the 12 GB card as run sizes it, said in one line, and the config fits. Breaks if
    estimate reads an unset chunk as one chunk of all 16,384 positions (13 GiB: "does NOT fit", a false advice)."""
    assert cli.main(["estimate", str(FAST), "--gpu-memory-gb", "12"]) == 0
    out = capsys.readouterr().out
    assert "this config: fits" in out and "model.loss_chunk_size: 8192, 2 chunks" in out


def test_lu_run_sizes_an_unset_loss_chunk_for_the_card(monkeypatch, capsys):
    """``lu.run`` from a notebook or script (no CLI, so no for_this_card) on an 8 GB card: the model it loads gets the
    chunk sized for the card, not one chunk of every position. Recorder in place of prepare (the model load), which
    stops the run: what is checked is the config run() hands on. Breaks if run() skips the sizing."""
    if REAL_GPU:
        pytest.skip("a real CUDA GPU is present: the pretend driver would not be the one answering")
    monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    monkeypatch.setattr(dev, "_state", {})
    fake_cuda.install(monkeypatch, "rtx3070-8gb")
    seen = []

    def record(cfg, *a, **kw):
        seen.append(cfg)
        raise Stop
    monkeypatch.setattr(tr, "prepare", record)
    cfg = load_config(FAST, mode="full", overrides={"train.micro_batch_size": 4, "train.accumulation_steps": 4})
    with pytest.raises(Stop):
        tr.run(cfg, "cuda", progress=False)
    from labutils.estimator.estimate import estimate_memory, fits

    assert seen[0].model.loss_chunk_size is not None  # sized, not left to mean "every position in one chunk"
    assert fits(estimate_memory(seen[0]), fake_cuda.PROFILES["rtx3070-8gb"].total)
