"""Lab 01's op-group profile (labutils.labs.lab01.op_profile, reached as am.op_profile and friends) on a real torch.profiler
run of the tiny GPT-2 on the CPU, fp32 and under bf16 autocast (CPU autocast runs bfloat16 on every CPU, emulated or
native). The oracles are the profiler's own events and totals and autocast's documented behaviour, not the
grouping code's own arithmetic."""
import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import labutils as lu
import labutils.labs.lab01.amp_speed_memory as am
from labutils.core.train import make_optimizer

from conftest import tiny_config

STEPS = 2


def _profile(precision: str):
    """Warm-up step, then STEPS profiled training steps (autocast forward, backward, AdamW) of the tiny model."""
    cfg = tiny_config(train__precision=precision)
    lu.seed_everything(cfg.train.seed)
    loaded, dataset = lu.prepare(cfg, "cpu", verbose=False)
    model = loaded.model.train()
    optimizer, _ = make_optimizer(model, cfg, torch.device("cpu"))
    windows = dataset.windows(cfg.train.micro_batch_size, 1, cfg.train.seed)
    dtype = {"bf16": torch.bfloat16}.get(precision)

    def step():
        for mb in next(windows).micro_batches:
            with torch.amp.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(**mb).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    return prof, am.op_profile(prof, STEPS), model.config.activation_function


@pytest.fixture(scope="module")
def profiles():
    return {p: _profile(p) for p in ("fp32", "bf16")}


def test_matmul_group_holds_the_profilers_mm_and_addmm_events_and_nothing_elementwise(profiles):
    """Breaks if the matmul rule misses mm/addmm (GPT-2's Conv1D is addmm, its backward mm: the group would be
    empty or short), if a loose prefix pulls elementwise ops (aten::mul, aten::add ...) into it, or if calls are
    lost: the group's calls must equal the number of mm/addmm events the profiler itself recorded."""
    prof, op, _ = profiles["fp32"]
    counted = {n: sum(1 for e in prof.events() if e.name == n) for n in ("aten::mm", "aten::addmm")}
    assert counted["aten::mm"] > 0 and counted["aten::addmm"] > 0
    by_op = {r["op"]: r for r in op.ops}
    for name, n in counted.items():
        assert by_op[name]["group"] == am.op_group(name) == "matmul"
        assert by_op[name]["calls"] * STEPS == n
    elementwise = {"aten::add", "aten::mul", "aten::native_layer_norm", "aten::gelu", "aten::tanh", "aten::pow",
                   "aten::_log_softmax", "aten::_softmax", "aten::bernoulli_"} & set(by_op)
    assert "aten::native_layer_norm" in elementwise and "aten::mul" in elementwise  # present in every GPT-2 step
    for name in elementwise:
        assert by_op[name]["group"] == "elementwise / reductions", name
    assert by_op["aten::_to_copy"]["group"] == "casts / copies"
    assert by_op["aten::view"]["group"].startswith("other")


def test_times_are_self_times_the_profiler_totals_and_the_top_op_is_the_profilers(profiles):
    """Breaks if inclusive times were summed (aten::linear contains addmm: the matmul time would count twice and
    the total would exceed the profiler's), if events were dropped, or if the top list were sorted the wrong way:
    the sum over all groups equals the profiler's own total self CPU time, and the first row of top_op_rows is the
    profiler's own slowest op by self CPU time."""
    for prof, op, _ in profiles.values():
        averages = prof.key_averages()
        assert op.total_ms * STEPS * 1e3 == pytest.approx(averages.self_cpu_time_total, rel=1e-6)
        rows = [r for r in am.op_group_rows({"fp32": op}) if r["group"] == "all ops"]
        assert rows[0]["fp32_ms"] == pytest.approx(op.total_ms)
        slowest = max(averages, key=lambda a: a.self_cpu_time_total)
        top = am.top_op_rows(op, n=5)
        assert top[0]["op"] == slowest.key and len(top) == 5
        assert [r["ms"] for r in top] == sorted((r["ms"] for r in top), reverse=True)


def test_input_dtypes_show_what_autocast_cast(profiles):
    """Breaks if the inputs' dtype is not read (record_shapes lost, or the profiler's dtype names not mapped):
    CPU autocast runs aten::mm in bfloat16 (torch.amp's CPU lower-precision list), so under bf16 none of mm's time
    has an FP32 input while in the fp32 run all of it does; and autocast's casts of the weights show up as more
    aten::_to_copy calls per step than in fp32."""
    f32 = {r["op"]: r for r in profiles["fp32"][1].ops}
    b16 = {r["op"]: r for r in profiles["bf16"][1].ops}
    assert f32["aten::mm"]["fp32_input_ms"] == pytest.approx(f32["aten::mm"]["ms"])
    assert b16["aten::mm"]["fp32_input_ms"] == 0
    assert b16["aten::_to_copy"]["calls"] > f32["aten::_to_copy"]["calls"]


class _Torch211Profile:
    """The same profile as torch < 2.12 hands it over: its ``events()`` carry no ``input_dtypes`` (pytorch#179714 added
    them in 2.12), its kineto results are the real ones."""

    def __init__(self, prof):
        self.profiler = prof.profiler
        self._events = []
        for e in prof.events():
            old = copy.copy(e)
            del old.input_dtypes
            self._events.append(old)

    def events(self):
        return self._events


def test_input_dtypes_without_torchs_input_dtypes_field(profiles):
    """The first GPU run (torch 2.11) read every dtype as "-" and lab 01 said 0.00 ms of work read FP32 inputs under
    autocast. Oracle: this torch's own ``input_dtypes`` of the same events. Breaks if the kineto fallback is dropped
    or keyed to the wrong events; and, given only the bare events, the reading must say the dtypes are unknown
    instead of printing 0.00 ms."""
    for precision in ("fp32", "bf16"):
        prof, new, _ = profiles[precision]
        old = am.op_profile(_Torch211Profile(prof), STEPS)
        assert old.dtypes_known
        assert [(r["op"], r["dtypes"], r["fp32_input_ms"]) for r in old.ops] == \
            [(r["op"], r["dtypes"], r["fp32_input_ms"]) for r in new.ops]
    bare = am.op_profile(_Torch211Profile(profiles["bf16"][0]).events(), STEPS)
    assert not bare.dtypes_known and all(r["dtypes"] == "-" for r in bare.ops)
    ops = {"fp32": profiles["fp32"][1], "bf16": bare}
    text = " ".join(am.profile_reading(ops, "bf16", activation="gelu_new"))
    assert "is not known" in text and "work still read FP32 inputs" not in text


def test_cpu_reading_names_the_activation_and_draws_no_gpu_conclusion(profiles):
    """Breaks if a CPU profile is read as the GPU lesson (tensor cores speeding up matmuls), or if the reading
    hard-codes the activation instead of reading it from the model's config."""
    ops = {p: v[1] for p, v in profiles.items()}
    activation = profiles["bf16"][2]
    text = "\n".join(am.profile_reading(ops, "bf16", activation))
    assert "CPU time per step" in text
    assert f"MLP activation '{activation}'" in text
    assert "no GPU conclusion" in text
    assert "tensor cores make" not in text and "did not speed up more" not in text


def _fake(on_gpu: bool, mm: float, elementwise: float, fp32_part: float | None = None) -> am.OpProfile:
    ops = [{"op": "aten::mm", "group": "matmul", "calls": 1, "ms": mm, "fp32_input_ms": 0.0, "optimizer_ms": 0.0},
           {"op": "aten::mul", "group": "elementwise / reductions", "calls": 2, "ms": elementwise,
            "fp32_input_ms": elementwise if fp32_part is None else fp32_part, "optimizer_ms": 0.0}]
    return am.OpProfile("GPU kernel time" if on_gpu else "CPU time", on_gpu, 1, ops)


def test_gpu_reading_follows_the_sign_of_what_was_measured():
    """Breaks if the tensor-core lesson is printed whatever the numbers say: with matmuls 4x faster and the
    memory-bound ops 1.25x it is stated; with matmuls no faster than the rest it is not."""
    lesson = "\n".join(am.profile_reading({"fp32": _fake(True, 8.0, 5.0), "bf16": _fake(True, 2.0, 4.0)},
                                          "bf16", "gelu_new"))
    assert "tensor cores make" in lesson and "4.00x" in lesson and "1.25x" in lesson
    assert "no GPU conclusion" not in lesson
    flat = "\n".join(am.profile_reading({"fp32": _fake(True, 8.0, 5.0), "bf16": _fake(True, 8.0, 4.0)},
                                        "bf16", "gelu_new"))
    assert "did not speed up more" in flat and "tensor cores make" not in flat


def test_one_question_one_answer_and_no_speed_up_for_an_op_read_partly_in_fp32():
    """Issue 36: the bf16 profile cell answered one question with 29 lines and three speed-ups (the op-time ratio of
    all ops, the step's, and one per op), and said "aten::mul still read FP32 inputs (op speed-up 2.15x)" of an op
    whose calls were partly half, partly FP32. Now: two lines, the two groups' op-time ratios only, and an op's FP32
    part as a part of its time. Breaks if a step or per-op speed-up, or the all-ops ratio, comes back."""
    lines = am.profile_reading({"fp32": _fake(True, 8.0, 5.0), "bf16": _fake(True, 2.0, 4.0, fp32_part=1.5)},
                               "bf16", "gelu_new")
    text = "\n".join(lines)
    assert len(lines) == 2 and text.count("x)") == 2  # matmul ops (4.00x), memory-bound ops (1.25x)
    assert "aten::mul 1.50 of its 4.00 ms" in text and "1.50 of those 4.00 ms still read FP32 inputs" in text
    assert "op speed-up" not in text and "all ops" not in text and "step speed-up" not in text
    rows = {r["group"]: r for r in am.op_group_rows({"fp32": _fake(True, 8.0, 5.0), "bf16": _fake(True, 2.0, 4.0)})}
    assert rows["all ops"]["op_time_speedup_bf16"] == pytest.approx(13 / 6) and "speedup_bf16" not in rows["all ops"]
    assert rows["matmul"]["bf16_calls"] == 1 and rows["elementwise / reductions"]["fp32_calls"] == 2
