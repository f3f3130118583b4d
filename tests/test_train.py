import math
import statistics

import pytest
import torch

import labutils as lu
from labutils.tools.cli import main
from labutils.core.train import NonFiniteLossError

from conftest import COMPILED_TINY, INDUCTOR, tiny_config


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
    assert lu.models.gpt2.checkpointed_layers(m2) == [0, 1]
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
    from labutils.tools import regenerate as rg
    assert rg.kernel_env("/tmp/r", smoke=True, gpu_memory_gb=None, base={"LAB_PROGRESS": "1"})["LAB_PROGRESS"] == "0"


def test_step_times_tile_the_loop_wall_clock():
    """Each step's time runs from the previous step's end to its own end: the loop's own post-step work (records,
    progress bar, the CPU tracker's stop) lands in some step, and what is not training (``on_step``, state_bytes)
    is measured and reported as ``untimed_seconds``. Oracle: the test's own clock between on_step calls.
    Breaks if a step's timer starts late or stops early (the old loop left everything after ``.item()`` out) or if
    the bookkeeping is silently dropped instead of accounted."""
    import time

    cfg = tiny_config(train__steps=4, train__timing_warmup_steps=1)
    stamps, naps = [], []

    def on_step(step, *_):
        t0 = time.perf_counter()
        time.sleep(0.05)  # caller work between steps: must not be in any step's time, and must be accounted
        naps.append(time.perf_counter() - t0)
        stamps.append(time.perf_counter())
    res, _ = _train(cfg, on_step=on_step)
    wall = stamps[-1] - stamps[0]  # from on_step(0)'s end to on_step(3)'s end: steps 1..3 and their bookkeeping
    accounted = sum(res.step_times[1:]) + res.untimed_seconds - naps[0]
    assert res.untimed_seconds >= sum(naps)
    assert abs(accounted - wall) < 0.01, (accounted, wall)
    for k in (1, 2, 3):  # and the naps are in none of the step times
        assert res.step_times[k] < stamps[k] - stamps[k - 1] - 0.04


@pytest.mark.real_kernels  # the CLI part trains in this process, on the default device
def test_no_timed_steps_is_said_not_filled_with_warm_up(capsys, root, tmp_path, monkeypatch):
    """steps <= timing_warmup_steps: every step is warm-up. Breaks if the speed numbers quietly come from warm-up
    steps again (the old loop timed the last step whatever the warm-up)."""
    import json

    res, _ = _train(tiny_config(train__steps=2, train__timing_warmup_steps=2))
    assert res.ok and len(res.losses) == 2 and res.timed_steps == 0
    assert res.step_time_seconds is None and res.tokens_per_second is None and res.target_tokens_per_second is None
    monkeypatch.setenv("LAB_SMOKE", "1")
    out = tmp_path / "r.json"
    assert main(["run", str(root / "configs/fp32_config.yaml"), "--set", "train.steps=1",
                 "train.timing_warmup_steps=1", "--json", str(out), "--quiet"]) == 0
    assert "no timed steps" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["timed_steps"] == 0 and d["step_time_seconds"] is None


@INDUCTOR
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.real_kernels(reason="torch.compile on the CUDA build asks the driver whether the current stream is being "
                                 "captured (torch.cuda.graphs), past the entry points the pretend driver replaces")
def test_compile_seconds_apart_from_step_times(ragged_corpus):
    """With train.compile the compiling step is never timed; its extra time is ``compile_seconds`` (in --json).
    Oracle for which step compiled: dynamo's own graph counter. Breaks if compilation lands in a timed step
    (timing_warmup_steps is 0 here, so only the compile rule keeps step 0 out) or compile time goes unreported."""
    # packed: every window has the same target count. (Padded windows differ, and dynamo recompiles the step
    # whose int num_items_in_batch is new: that step is then left out too.)
    cfg = tiny_config(ragged_corpus, **COMPILED_TINY, train__timing_warmup_steps=0)
    res, _ = _train(cfg, track_memory=False)  # (on the CPU the memory-tracked steps are not timed either)
    assert res.ok and res.timed_steps == 2  # step 0 compiled: left out although the warm-up is 0
    median = statistics.median(res.step_times[1:])
    assert res.step_time_seconds == pytest.approx(median)
    assert res.compile_seconds == pytest.approx(res.step_times[0] - median) and res.compile_seconds > 0
    assert res.to_dict()["compile_seconds"] == res.compile_seconds
    assert res.compiled_graphs >= 1 and res.compile_fallback is None and res.to_dict()["compiled_graphs"] >= 1
    eager, _ = _train(tiny_config(ragged_corpus, train__steps=3), track_memory=False)
    assert eager.compile_seconds is None and eager.timed_steps == 3 and eager.compiled_graphs is None


@pytest.mark.parametrize("profile,extra,want", [("t4", (), "fp16"), ("h100", (), "bf16"),
                                                ("t4", ("--set", "train.precision=bf16"), "bf16")])
def test_run_of_a_bf16_config_trains_fp16_where_the_gpu_has_no_native_bf16(monkeypatch, capsys, profile, extra, want):
    """A T4 (compute capability 7.5: fake_cuda's profile, NVIDIA's spec) emulates BF16, and
    torch.cuda.is_bf16_supported() says True there: `run` of the fast config (bf16) trained emulated BF16. Now it
    trains fp16 with one notice, as the labs and doctor decide (device.bf16_support); an H100 keeps bf16, and an
    explicit --set wins. Breaks if the choice read is_bf16_supported() again or the notice were missing or repeated."""
    from test_fit_micro_batch import run_cli

    t, out = run_cli(monkeypatch, capsys, profile, *extra)
    notices = [line for line in out.splitlines() if line.startswith("NOTICE") and "fp16" in line]
    assert t.precision == want and len(notices) == (want == "fp16")
