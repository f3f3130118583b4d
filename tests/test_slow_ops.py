"""Lab 04's slowest-ops lesson (section 6.1) on a real torch.profiler run of the tiny GPT-2 on the CPU: the
published maths ("before": gelu_new, unpadded vocabulary, sdpa) against the same maths with the fast kernels
("after": gelu_pytorch_tanh, vocabulary padded to 64, sdpa_causal), both under bf16 autocast (CPU autocast runs
bfloat16 on every CPU, emulated or native). Every key is set explicitly, as the lab does. The oracles are the
profiler's own events and totals, autocast's documented CPU op lists and hand-made times, not the bookkeeping's
own arithmetic."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import labutils as lu
import labutils.amp_speed_memory as am
from labutils.profiling import timed_steps
from labutils.profiling_runs import setup_training

from conftest import tiny_config

WARMUP, STEPS, TIMED, TOP = 2, 2, 3, 8  # as lab 04's section 6.1, fewer timed steps
FIXES = {"before": {"model.activation": "gelu_new", "model.pad_vocab_to": None, "model.attn_implementation": "sdpa"},
         "after": {"model.activation": "gelu_pytorch_tanh", "model.pad_vocab_to": 64,
                   "model.attn_implementation": "sdpa_causal"}}


def _run(keys: dict):
    """WARMUP warm-up steps, STEPS profiled training steps and TIMED timed ones of the tiny model, as lab 04 runs them."""
    device = torch.device("cpu")
    cfg = tiny_config(**{**keys, "train.precision": "bf16"})
    lu.seed_everything(cfg.train.seed)
    model, optimizer, data, windows = setup_training(cfg, device)
    autocast = lu.autocast_for("bf16", device)

    def step():  # lab 04's training_step: token-normalised loss, clipping, AdamW
        window = next(windows)
        for mb in window.micro_batches:
            with autocast:
                loss = model(**mb, num_items_in_batch=window.num_targets, use_cache=False).loss
            loss.backward()
            del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    return {"prof": prof, "ops": am.op_profile(prof, STEPS), "times": timed_steps(step, TIMED, device),
            "activation": model.config.activation_function}


@pytest.fixture(scope="module")
def runs():
    return {label: _run(keys) for label, keys in FIXES.items()}


def _events(run, name):
    return sum(1 for e in run["prof"].events() if e.name == name)


def test_the_fix_replaces_gelu_news_pieces_by_one_gelu_and_the_reading_counts_them(runs):
    """Breaks if the before/after keys do not reach the model (a default silently used on one side, the activation
    key ignored by the model loader), or if the reading miscounts or invents the ops the fix removed. Oracle: the
    profiler's own events: gelu_new runs aten::pow and aten::tanh (x**3 and the tanh of its formula) and no
    aten::gelu; gelu_pytorch_tanh runs aten::gelu and neither of them."""
    before, after = runs["before"], runs["after"]
    assert (before["activation"], after["activation"]) == ("gelu_new", "gelu_pytorch_tanh")
    for name in ("aten::pow", "aten::tanh"):
        assert _events(before, name) > 0 and _events(after, name) == 0, name
    assert _events(before, "aten::gelu") == 0 and _events(after, "aten::gelu") > 0
    text = "\n".join(am.slow_op_readings({k: v["ops"] for k, v in runs.items()}, {k: v["times"] for k, v in runs.items()},
                                         TOP))
    assert f"aten::pow {_events(before, 'aten::pow') / STEPS:.0f} -> 0 calls per step" in text
    assert f"aten::gelu 0 -> {_events(after, 'aten::gelu') / STEPS:.0f} calls" in text
    rows = {r["op"]: r for r in am.slowest_op_rows({"before": before["ops"], "after": after["ops"]}, n=200)}
    assert rows["aten::gelu"]["before_rank"] is None and rows["aten::gelu"]["before_dtypes"] == "-"
    assert rows["aten::pow"]["after_ms"] is None and rows["aten::pow"]["before_ms"] > 0


def test_top_table_is_the_profilers_slowest_aten_ops_in_its_order_with_its_times(runs):
    """Breaks if the table is sorted the wrong way or by the wrong time (inclusive instead of self: aten::linear
    would hold addmm's time), if its times drift from the profiler's, or if record_function ranges / autograd nodes
    (no data moved) crowd the ATen ops out. Oracle: the profiler's own key_averages(), by self CPU time."""
    for label, run in runs.items():
        averages = [a for a in run["prof"].key_averages() if a.key.startswith("aten::")]
        expected = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:TOP]
        rows = am.slowest_op_rows({label: run["ops"]}, TOP)
        assert [r["op"] for r in rows] == [a.key for a in expected]
        assert [r[f"{label}_rank"] for r in rows] == list(range(1, TOP + 1))
        for r, a in zip(rows, expected):
            assert r[f"{label}_ms"] * STEPS * 1e3 == pytest.approx(a.self_cpu_time_total, rel=1e-6)


def test_input_dtypes_show_what_cpu_autocast_ran_in_bf16(runs):
    """Breaks if the input dtypes are not read (record_shapes lost, the profiler's dtype names not mapped) or are
    read from the wrong op: CPU autocast's lower-precision list has mm/addmm (torch.amp docs), so under bf16 the
    matmuls' inputs include bf16, and the FP32 embedding output that the first layer norm reads is FP32."""
    rows = {r["op"]: r for r in am.slowest_op_rows({"before": runs["before"]["ops"]}, n=200)}
    assert "bf16" in rows["aten::mm"]["before_dtypes"]
    assert "fp32" in rows["aten::native_layer_norm"]["before_dtypes"]
    top = am.top_op_rows(runs["before"]["ops"], 3)
    assert all("input_dtypes" in r for r in top)


def test_cpu_reading_says_what_the_cpu_measured_and_draws_no_gpu_conclusion(runs):
    """Breaks if CPU timing is read as a GPU speed verdict (a speed-up or "not decided" stated for a GPU), or if
    the medians it quotes are not the timed steps' medians."""
    import statistics

    times = {k: v["times"] for k, v in runs.items()}
    text = "\n".join(am.slow_op_readings({k: v["ops"] for k, v in runs.items()}, times, TOP))
    assert "the CPU measured" in text and "no GPU conclusion" in text
    assert "on this GPU" not in text and "not decided" not in text and "as fast" not in text
    assert f"{statistics.median(times['before']) * 1e3:.2f} ms (before)" in text
    assert f"{statistics.median(times['after']) * 1e3:.2f} ms (after)" in text


def _fake(ops: list[tuple[str, float, str]]) -> am.OpProfile:
    rows = [{"op": op, "group": am.op_group(op), "calls": 1, "ms": ms, "dtypes": dt,
             "fp32_input_ms": ms if dt == "fp32" else 0.0, "optimizer_ms": 0.0} for op, ms, dt in ops]
    return am.OpProfile("GPU kernel time", True, 1, sorted(rows, key=lambda r: -r["ms"]))


def test_gpu_reading_names_the_suspects_that_topped_the_table_and_follows_the_noise():
    """Breaks if the GPU conclusion ignores what topped the table (suspects named whether or not they are there),
    or if a speed-up smaller than its noise is stated as a result instead of "not decided". Hand-made profiles and
    times: before 10 ms every step, after 8 ms (1.25x, no noise); then after times spread 4-12 ms (noise larger
    than the effect)."""
    before = _fake([("aten::pow", 5.0, "fp32"), ("aten::_to_copy", 3.0, "fp32"), ("aten::mm", 2.0, "bf16")])
    after = _fake([("aten::gelu", 1.0, "bf16"), ("aten::_to_copy", 2.0, "fp32"), ("aten::mm", 2.0, "bf16")])
    profiles = {"before": before, "after": after}
    clear = "\n".join(am.slow_op_readings(profiles, {"before": [0.010] * 5, "after": [0.008] * 5}, n=2))
    assert "gelu_new's pieces: in the top 2 (aten::pow #1, 5.00 of 5.00 ms with FP32 inputs)" in clear
    assert "the logits' log_softmax: not in the top 2" in clear
    assert "1.25x as fast (faster)" in clear and "no GPU conclusion" not in clear
    noisy = "\n".join(am.slow_op_readings(profiles, {"before": [0.010] * 5,
                                                     "after": [0.004, 0.006, 0.008, 0.010, 0.012]}, n=2))
    assert "not decided (noise ±" in noisy and "as fast" not in noisy
    rows = am.step_time_rows({"before": [0.010] * 5, "after": [0.008] * 5})
    assert rows[1]["speedup_vs_before"] == pytest.approx(1.25) and rows[1]["noise_pct"] == 0
    assert rows[0]["median_step_ms"] == pytest.approx(10.0)
