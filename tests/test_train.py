import math

import pytest
import torch

import labutils as lu
from labutils.cli import main
from labutils.train import NonFiniteLossError

from conftest import tiny_config


def _train(cfg, **kw):
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    res = lu.train(cfg, loaded.model, ds, "cpu", progress=False, **kw)
    return res, loaded.model


def _naive_first_step_grads(cfg, micro, accum):
    """The seed notebooks' way: mean loss of each micro-batch / accumulation_steps."""
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    model = loaded.model.train()
    window = next(ds.windows(micro, accum, cfg.train.seed))
    for mb in window.micro_batches:
        (model(**mb).loss / accum).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _exact_first_step_grads(cfg, micro, accum):
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    model = loaded.model.train()
    window = next(ds.windows(micro, accum, cfg.train.seed))
    for mb in window.micro_batches:
        model(**mb, num_items_in_batch=window.num_targets).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_accumulation_is_exact_on_padded_variable_length_documents(ragged_corpus):
    runs = {}
    for micro, accum in [(8, 1), (1, 8), (2, 4)]:
        cfg = tiny_config(ragged_corpus, train__micro_batch_size=micro, train__accumulation_steps=accum,
                          train__steps=4)
        runs[(micro, accum)] = _train(cfg)
    ref_res, ref_model = runs[(8, 1)]
    assert all(math.isfinite(x) for x in ref_res.losses)
    for key, (res, model) in runs.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref_res.losses))
        assert rel < 1e-5, (key, res.losses, ref_res.losses)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_loss_over_accum_steps_is_not_exact_on_padded_batches(ragged_corpus):
    cfg = tiny_config(ragged_corpus)
    full = _exact_first_step_grads(cfg, 8, 1)
    exact = _exact_first_step_grads(cfg, 1, 8)
    naive = _naive_first_step_grads(cfg, 1, 8)
    naive_full = _naive_first_step_grads(cfg, 8, 1)
    assert torch.allclose(naive_full, full, rtol=1e-5, atol=1e-7)  # one micro-batch: both agree
    err = lambda g: float((g - full).norm() / full.norm())  # noqa: E731
    assert err(exact) < 1e-5
    assert err(naive) > max(1e-3, 1000 * err(exact)), (err(naive), err(exact))  # the padding pitfall


def test_fp16_overflow_step_is_skipped_counted_and_training_continues(ragged_corpus):
    cfg = tiny_config(ragged_corpus, train__precision="fp16", train__steps=5)
    snapshots = {}

    def snap(step, result, model, optimizer, scaler):
        snapshots[step] = [p.detach().clone() for p in model.parameters()]

    res, model = _train(cfg, inject_overflow_at={2}, on_step=snap)
    assert res.skipped == [2] and res.skipped_steps == 1
    assert len(res.losses) == 5 and all(math.isfinite(x) for x in res.losses)
    assert res.loss_scales[3] == res.loss_scales[2] / 2  # backoff
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))  # the skipped step changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))  # and training went on


def test_nonfinite_loss_stops_fp32_with_clear_error(ragged_corpus):
    cfg = tiny_config(ragged_corpus, train__steps=3)

    def poison(step, result, model, optimizer, scaler):
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))

    with pytest.raises(NonFiniteLossError, match="loss is nan with precision fp32"):
        _train(cfg, on_step=poison)


@pytest.mark.parametrize("precision,expected", [("fp32", "ieee"), ("tf32", "tf32"), ("bf16", "ieee")])
def test_tf32_switch_is_set_inside_and_restored_after(ragged_corpus, precision, expected):
    before = torch.backends.cuda.matmul.fp32_precision
    seen = []
    cfg = tiny_config(ragged_corpus, train__precision=precision, train__steps=3)
    _train(cfg, on_step=lambda *a: seen.append(torch.backends.cuda.matmul.fp32_precision))
    assert seen == [expected] * 3
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_checkpointing_matches_plain_training(ragged_corpus):
    plain, m1 = _train(tiny_config(ragged_corpus))
    ckpt, m2 = _train(tiny_config(ragged_corpus, train__gradient_checkpointing=True))
    assert lu.models.checkpointed_layers(m2) == [0, 1]
    assert max(abs(a - b) for a, b in zip(plain.losses, ckpt.losses)) < 1e-5


@pytest.mark.real_kernels  # the CLI trains in this process, on the default device
@pytest.mark.parametrize("name", ["fp32_config", "fp16_config", "bf16_config", "optimized_config"])
def test_cli_run_each_config_writes_full_json(root, tmp_path, monkeypatch, name):
    import json

    monkeypatch.setenv("LAB_SMOKE", "1")
    out = tmp_path / "out.json"
    assert main(["run", str(root / "configs" / f"{name}.yaml"), "--set", "train.steps=3", "--json", str(out),
                 "--quiet"]) == 0
    d = json.loads(out.read_text())
    for key in ("config", "env", "losses", "tokens_per_second", "step_time_seconds", "peak_memory_bytes",
                "skipped_steps", "effective_batch_size"):
        assert key in d, key
    for key in ("device", "gpu_name", "torch", "transformers", "weights", "mode"):
        assert key in d["env"], key
    assert d["env"]["weights"] == "random" and d["env"]["mode"] == "smoke"
    assert len(d["losses"]) == 3 and all(math.isfinite(x) for x in d["losses"])
    assert d["peak_memory_bytes"] > 0 and d["tokens_per_second"] > 0
    assert d["config"]["train"]["steps"] == 3


def test_run_turns_oom_into_a_result_and_releases(ragged_corpus):
    cfg = tiny_config(ragged_corpus)
    res = lu.run(cfg, "cpu", progress=False, verbose=False, cpu_budget_bytes=4 * 2**20)
    assert res.status == "oom" and "out of memory" in res.error and res.losses == []
    ok = lu.run(cfg, "cpu", progress=False, verbose=False)  # and the next run is unaffected
    assert ok.status == "ok"


def test_no_deprecation_warnings_from_a_full_featured_run(ragged_corpus, tmp_path):
    import warnings

    cfg = tiny_config(ragged_corpus, train__precision="fp16", train__gradient_checkpointing=True,
                      train__accumulation_steps=2, train__steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = lu.run(cfg, "cpu", progress=False, verbose=False)
        lu.record_results("test-lab", {"runs": [res.row()]}, out_dir=tmp_path, mode="smoke")
    bad = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not bad, [f"{w.filename}:{w.lineno}: {w.message}" for w in bad]


def test_run_reports_a_diverged_run_as_a_status(ragged_corpus):
    def poison(step, result, model, optimizer, scaler):
        with torch.no_grad():
            next(model.parameters()).fill_(float("inf"))

    res = lu.run(tiny_config(ragged_corpus), "cpu", progress=False, verbose=False, on_step=poison)
    assert res.status == "diverged" and "loss is nan" in res.error


def test_skipped_first_fp16_step_prints_no_scheduler_warning(ragged_corpus):
    """On a GPU, GradScaler's first step often overflows at its initial scale and is skipped: torch then warned
    "lr_scheduler.step() before optimizer.step()" in lab 01's and lab 02's output. The schedule still advances
    once per step (every loop of the course does the same), without the warning."""
    import warnings

    cfg = tiny_config(ragged_corpus, train__precision="fp16", train__steps=3, train__warmup_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = lu.run(cfg, "cpu", progress=False, verbose=False, inject_overflow_at={0})
    assert res.skipped == [0]
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("setting, bar_shown", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_progress_bars_follow_lab_progress(capsys, monkeypatch, setting, bar_shown):
    # regenerate sets LAB_PROGRESS=0 for its kernels: a saved bar reads "0%|" in an executed copy
    if setting is None:
        monkeypatch.delenv("LAB_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("LAB_PROGRESS", setting)
    cfg = tiny_config(**{"train__steps": 2})
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    capsys.readouterr()
    lu.train(cfg, loaded.model, ds, "cpu", progress=True, desc="bar-check")
    assert ("bar-check" in capsys.readouterr().err) == bar_shown


def test_regenerate_kernels_run_without_progress_bars():
    from labutils import regenerate as rg
    assert rg.kernel_env("/tmp/r", smoke=True, gpu_memory_gb=None, base={"LAB_PROGRESS": "1"})["LAB_PROGRESS"] == "0"
