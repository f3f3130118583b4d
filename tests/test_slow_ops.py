"""Lab 04's slowest-ops lesson (section 6.1) on real torch.profiler runs of the tiny GPT-2 on the CPU: the
published maths ("before": gelu_new, unpadded vocabulary, sdpa) against the same maths with the fast kernels
("after": gelu_pytorch_tanh, vocabulary padded to 64, sdpa_causal), both under bf16 autocast (CPU autocast runs
bfloat16 on every CPU, emulated or native), each profiled step in its own profiler session
(labutils.labs.lab04.profiling.profile_each_step), so each op gets a noise of its own. The oracles are the profiler's own
events, autocast's documented CPU op lists and hand-made per-step times, not the bookkeeping's own arithmetic."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import labutils as lu
import labutils.labs.lab01.amp_speed_memory as am
from labutils.labs.lab04.profiling import op_change_rows, profile_each_step, timed_steps
from labutils.labs.lab04.profiling_runs import setup_training

from conftest import tiny_config

WARMUP, STEPS, TIMED, TOP = 2, 3, 3, 8  # as lab 04's section 6.1, fewer profiled and timed steps
FIXES = {"before": {"model.activation": "gelu_new", "model.pad_vocab_to": None, "model.attn_implementation": "sdpa"},
         "after": {"model.activation": "gelu_pytorch_tanh", "model.pad_vocab_to": 64,
                   "model.attn_implementation": "sdpa_causal"}}


def _run(keys: dict):
    """WARMUP warm-up steps, STEPS profiled steps (one session each), one more under a plain profiler session (the
    oracle's events) and TIMED timed steps of the tiny model, as lab 04 runs them."""
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
    ops = profile_each_step(step, STEPS, device)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return {"prof": prof, "ops": ops, "times": timed_steps(step, TIMED, device),
            "activation": model.config.activation_function}


@pytest.fixture(scope="module")
def runs():
    return {label: _run(keys) for label, keys in FIXES.items()}


def _events(run, name):
    return sum(1 for e in run["prof"].events() if e.name == name)


def test_the_fix_replaces_gelu_news_pieces_by_one_gelu_and_the_rows_count_them(runs):
    """Breaks if the before/after keys do not reach the model (a default silently used on one side, the activation
    key ignored by the model loader), or if the rows miscount the ops the fix removed or added. Oracle: the
    profiler's own events of one more step: gelu_new runs aten::pow and aten::tanh (x**3 and the tanh of its
    formula) and no aten::gelu; gelu_pytorch_tanh runs aten::gelu and neither of them. The issue-36 reading named
    "gelu_new's pieces" from a fixed list and missed gelu's aten::mul at #1: the rows now flag every op whose calls
    the fix changed, aten::mul among them."""
    before, after = runs["before"], runs["after"]
    assert (before["activation"], after["activation"]) == ("gelu_new", "gelu_pytorch_tanh")
    for name in ("aten::pow", "aten::tanh"):
        assert _events(before, name) > 0 and _events(after, name) == 0, name
    assert _events(before, "aten::gelu") == 0 and _events(after, "aten::gelu") > 0
    rows = {r["op"]: r for r in op_change_rows(before["ops"], after["ops"], n=200)}
    assert rows["aten::pow"]["reading"] == "removed by the fix" and rows["aten::gelu"]["reading"] == "added by the fix"
    for name in ("aten::pow", "aten::mul", "aten::gelu"):
        assert rows[name]["before calls"] == _events(before, name) and rows[name]["after calls"] == _events(after, name)
    assert rows["aten::mul"]["reading"] == "fewer calls"   # gelu_new's 0.5 * x * (...) and x * x * x
    assert rows["aten::pow"]["after (ms)"] == 0 and rows["aten::pow"]["before (ms)"] > 0


def test_rows_are_the_slowest_ops_by_median_self_time(runs):
    """Breaks if the rows are sorted the wrong way or by the wrong statistic, or if record_function ranges and
    autograd nodes (no data moved) crowd the ATen ops out. Oracle: each side's per-step profiles, by hand."""
    import statistics

    rows = op_change_rows(runs["before"]["ops"], runs["after"]["ops"], TOP)
    assert all(r["op"].startswith("aten::") for r in rows)
    for side in ("before", "after"):
        per_op = {}
        for p in runs[side]["ops"]:
            for r in p.ops:
                if r["op"].startswith("aten::"):
                    per_op.setdefault(r["op"], [0.0] * STEPS)[runs[side]["ops"].index(p)] = r["ms"]
        top = sorted(per_op, key=lambda k: -statistics.median(per_op[k]))[:TOP]
        assert set(top) <= {r["op"] for r in rows}
        for r in rows:
            if r["op"] in per_op:
                assert r[f"{side} (ms)"] == pytest.approx(statistics.median(per_op[r["op"]]))


def test_input_dtypes_show_what_cpu_autocast_ran_in_bf16(runs):
    """Breaks if the input dtypes are not read (record_shapes lost, the profiler's dtype names not mapped) or are
    read from the wrong op: CPU autocast's lower-precision list has mm/addmm (torch.amp docs), so under bf16 the
    matmuls' inputs include bf16, and the FP32 embedding output that the first layer norm reads is FP32."""
    rows = {r["op"]: r for r in op_change_rows(runs["before"]["ops"], runs["after"]["ops"], n=200)}
    assert "bf16" in rows["aten::mm"]["before dtypes"]
    assert "fp32" in rows["aten::native_layer_norm"]["before dtypes"]


def _fake(ops: dict) -> am.OpProfile:
    """One step's profile from {op: (ms, calls)}."""
    rows = [{"op": op, "group": am.op_group(op), "calls": calls, "ms": ms, "dtypes": "fp32", "fp32_input_ms": ms,
             "optimizer_ms": 0.0} for op, (ms, calls) in ops.items()]
    return am.OpProfile("GPU kernel time", True, 1, sorted(rows, key=lambda r: -r["ms"]))


def test_each_op_is_judged_against_its_own_noise_not_the_steps():
    """Issue 36: lab 04 used the whole step's +/-32 % noise as the threshold for every single op, so a steady op that
    lost a third of its time read "within noise". Hand-made per-step times: aten::mm is steady (10.0-10.2 ms) and
    drops 3 ms; aten::add swings 4-12 ms and drops 1 ms; aten::pow's calls go 4 -> 0. Breaks if a threshold other
    than each op's own spread decides, or if a change of calls is read as a timing."""
    before = [_fake({"aten::mm": (10.0 + 0.1 * (i % 3), 12), "aten::add": (4.0 + 4 * (i % 3), 8),
                     "aten::pow": (2.0, 4)}) for i in range(4)]
    after = [_fake({"aten::mm": (7.0 + 0.1 * (i % 3), 12), "aten::add": (3.0 + 4 * (i % 3), 8)}) for i in range(4)]
    rows = {r["op"]: r for r in op_change_rows(before, after, n=3)}
    assert rows["aten::mm"]["reading"] == "beyond its own noise"
    assert rows["aten::mm"]["change (ms)"] == pytest.approx(-3)
    assert rows["aten::add"]["reading"] == "within its own noise"
    assert rows["aten::pow"]["reading"] == "removed by the fix" and rows["aten::pow"]["after calls"] == 0
    assert rows["aten::mm"]["before noise (ms)"] < 0.2 < rows["aten::add"]["before noise (ms)"]


def test_step_time_rows_give_the_median_and_the_speedup():
    rows = am.step_time_rows({"before": [0.010] * 5, "after": [0.008] * 5})
    assert rows[1]["speedup_vs_before"] == pytest.approx(1.25) and rows[1]["noise_pct"] == 0
    assert rows[0]["median_step_ms"] == pytest.approx(10.0)
