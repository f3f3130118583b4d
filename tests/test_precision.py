"""Tests for labutils.labs.lab01.precision, labutils.labs.lab01.amp_memory and labutils.labs.lab01.amp_speed_memory (lab 01's helpers)."""
import math

import pytest
import torch

import labutils as lu
import labutils.labs.lab01.amp_speed_memory as am
import labutils.verdicts.claims as cl
import labutils.core.device as dev
import labutils.labs.lab01.precision as lp
from labutils.models.gpt2 import gpt2_config


def test_format_rows_match_finfo():
    rows = {r["format"]: r for r in lp.format_rows()}
    assert (rows["FP16"]["exponent"], rows["FP16"]["mantissa"]) == (5, 10)
    assert (rows["BF16"]["exponent"], rows["BF16"]["mantissa"]) == (8, 7)
    assert (rows["TF32"]["exponent"], rows["TF32"]["mantissa"], rows["TF32"]["bits"]) == (8, 10, 19)
    assert rows["FP16"]["max"] == torch.finfo(torch.float16).max
    assert rows["FP16"]["smallest_subnormal"] == 2.0**-24
    assert rows["TF32"]["max"] < rows["FP32"]["max"]


def test_bit_fields_and_stored():
    assert lp.bit_fields(1.0, torch.float16) == "0 01111 0000000000"
    assert lp.bit_fields(-2.0, torch.bfloat16) == "1 10000000 0000000"
    assert lp.stored(65520.0, torch.float16) == math.inf
    assert lp.stored(1 + 2**-9, torch.bfloat16) == 1.0


def test_half_gradient_census_counts():
    g = torch.tensor([1e-9, 1e-6, 1e-3, 0.0, 10.0])
    c = lp.half_gradient_census([g], scale=2.0**16)
    assert c.nonzero == 4
    assert c.underflow == 1            # 1e-9 flushes to 0 in fp16
    assert c.subnormal == 1            # 1e-6 is below fp16's smallest normal
    assert c.underflow_scaled == 0     # x 65536 rescues 1e-9
    assert c.overflow_scaled == 1      # 10 x 65536 > 65504
    assert int(sum(c.log2_hist)) == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_saved_tensor_census_finds_half_weight_copies(dtype):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config("tiny"))
    model.loss_type = "ForCausalLM"
    x = torch.randint(0, 256, (2, 16))
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n)
    with am.saved_tensor_census(model) as fp32:
        model(input_ids=x, labels=x)
    with am.saved_tensor_census(model) as amp, torch.amp.autocast("cpu", dtype=dtype):
        model(input_ids=x, labels=x)
    assert fp32.get("half weight copy") == 0 and fp32.get("activation half") == 0
    assert amp.get("half weight copy") == 2 * matmul
    assert amp.get("activation half") > 0


def _result(cfg, step_times, peak, warm=0, env=None, losses=None):
    timed = step_times[warm:]
    return lu.RunResult(config=cfg.to_dict(), env=env or {}, losses=losses or [2.0] * len(step_times),
                        step_times=step_times, step_time_seconds=sum(timed) / len(timed), timed_steps=len(timed),
                        peak_memory_bytes=peak, target_tokens_per_second=100 / (sum(timed) / len(timed)))


def test_comparison_rows_speedup_and_saving():
    cfg = lu.load_config(None, mode="smoke")
    a = _result(cfg, [1.0, 1.0], 1000)
    b = _result(cfg, [0.5, 0.5], 600)
    skipped = am.skipped_result(cfg, "no GPU")
    runs = {"fp32": a, "fp16": b, "tf32": skipped}
    rows = {r["run"]: r for r in am.comparison_rows(runs, am.speedup_rows(runs))}
    assert rows["fp16"]["speedup_vs_fp32"] == pytest.approx(2.0)
    assert rows["fp16"]["memory_saving_vs_fp32"] == pytest.approx(0.4)
    assert rows["fp16"]["peak_memory_bytes"] == 600   # the key says the unit: bytes, shown in the unit they call for
    assert rows["tf32"]["status"] == "skipped" and rows["tf32"]["note"] == "no GPU"
    assert rows["tf32"]["speedup_vs_fp32"] is None


def test_comparison_rows_times_say_which_steps_they_cover():
    # 1 warm-up step (3 s) and 3 timed steps: the total counts all four, the step time is the timed steps' median
    cfg = lu.load_config(None, mode="smoke")
    r = _result(cfg, [3.0, 1.0, 1.0, 4.0], 1000, warm=1)
    row = am.comparison_rows({"fp32": r}, am.speedup_rows({"fp32": r}))[0]
    assert "time_s" not in row and "step_time_s" not in row
    assert row["time_all_steps_s"] == pytest.approx(9.0)
    assert row["median_step_ms"] == pytest.approx(1000.0)   # median of 1, 1, 4: the slow step does not move it


def test_one_speed_up_per_precision_read_by_every_table_and_c2():
    """Issue 27: lab 01 showed 1.11x (mean), 1.23 (table) and 1.4 (profiler) for one comparison. Now each run is
    timed once (median of the timed steps) and the comparison table, the course's expectations table and C2 read
    that number. Breaks if any of them computes its own speed-up (e.g. from the mean step time, which the slow
    outlier step here moves: mean ratio 1.5x, median ratio 2.0x)."""
    cfg = lu.load_config(None, mode="smoke")
    env = {"device": "cpu"}
    runs = {"fp32": _result(cfg, [1.0] * 9 + [10.0], 1000, env=env),
            "fp16": _result(cfg, [0.5] * 10, 800, env=env),
            "bf16": am.skipped_result(cfg, "no native BF16")}
    speed = am.speedup_rows(runs)
    x = am.speedups(speed)["fp16"]
    assert x == pytest.approx(2.0)
    assert {r["run"]: r["speedup_vs_fp32"] for r in am.comparison_rows(runs, speed)}["fp16"] == x
    course = {r["precision"]: r for r in am.course_rows(runs, speed, {"fp32": (8.0, 1.0), "fp16": (4.5, 2.2),
                                                                     "bf16": (4.5, 2.1)})}
    assert course["fp16"]["measured_speedup"] == x and course["bf16"]["measured_speedup"] is None
    cond = cl.conditions(model="tiny", batch="4 x 1", sequence=64, precision="fp16 vs fp32", hardware="cpu",
                         mode="smoke")
    c2 = am.c1_c2_claims(runs, cond, amp="fp16", speed_rows=speed)[1]
    assert c2["measured"]["speedup"]["value"] == x
    assert am.SPEED_TABLE == "precision_comparison" and am.SPEEDUP == "speedup_vs_fp32"


def test_speed_readings_are_made_on_a_gpu_only_and_follow_the_noise():
    """Issue 27, item 7: no paragraph reads CPU timing. On a GPU the Amdahl estimate is computed from the step and
    matmul speed-ups; a speed-up inside its noise is "not decided" (issue 36: it was read as "no difference")."""
    big = {"matmul": "1 micro-batch", "fp32_tflops": 1.0, "fp16_tflops": 4.0, "bf16_tflops": 4.0}
    rows = [{"precision": "fp32", "speedup_vs_fp32": 1.0, "speedup_noise": None},
            {"precision": "fp16", "speedup_vs_fp32": 1.5, "speedup_noise": 0.05},
            {"precision": "bf16", "speedup_vs_fp32": 1.03, "speedup_noise": 0.05}]
    assert am.speed_reading_rows(rows, big, ["fp32", "fp16", "bf16"], "cpu") == []
    gpu = {r["precision"]: r for r in am.speed_reading_rows(rows, big, ["fp32", "fp16", "bf16"], "NVIDIA H100")}
    share = (1 - 1 / 1.5) / (1 - 1 / 4.0)
    assert f"about {share:.0%} of the FP32 step" in gpu["fp16"]["reading"] and gpu["fp16"]["largest matmul"] == "4.00x"
    assert "not decided" in gpu["bf16"]["reading"] and "Amdahl" not in gpu["bf16"]["reading"]


def test_a_speed_up_inside_its_noise_is_not_decided_never_no_difference():
    """Issue 36: a speed-up within its noise was called "no difference". Breaks if the words ignore the noise: 1.03x
    +- 0.05 cannot be told from 1.00x; 1.20x +- 0.05 is faster, 0.80x +- 0.05 slower."""
    assert am.speed_words(1.03, 0.05) == "1.03x +- 0.05, within its noise: not decided"
    assert am.speed_words(0.97, 0.05).endswith("not decided")
    assert am.speed_words(1.20, 0.05).endswith("faster") and am.speed_words(0.80, 0.05).endswith("slower")
    assert "no difference" not in am.speed_words(1.0, 0.0) and "unknown" in am.speed_words(1.2, None)
    assert am.speed_words(0.12, 0.01, judged=False) == "0.12x +- 0.01, CPU timing: not judged"


def test_fp16_on_a_cpu_says_whether_it_is_emulated():
    """Issue 36: CPU FP16 ran 5x slower than FP32 and nothing said it was emulated. The oracle is oneDNN's own check
    of the CPU's FP16 instructions; breaks if the answer ignores it or the sentence under the comparison omits it."""
    ok, why = dev.fp16_support("cpu")
    assert ok == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert ("emulated" in why) != ok
    assert dev.fp16_support("cuda")[0]
    rows = [{"run": "fp32", "status": "ok", "final_loss": 3.0}, {"run": "fp16", "status": "ok", "final_loss": 3.01},
            {"run": "bf16", "status": "skipped", "final_loss": None}]
    line = am.speed_sentence(rows, "CPU timing, not a GPU result", {"fp16": "emulated here", "bf16": "emulated too"})
    assert "fp16 is emulated here" in line and "bf16" not in line and "within 0.0100 of FP32" in line


def test_logits_dtypes_are_what_the_model_and_its_loss_use():
    """Issue 27: the dtype table said logits 'bf16' while a later line spoke of 'the FP32 logits of the loss'.
    Both are true, and now both are measured: under fp16 autocast lm_head returns fp16 logits, and transformers'
    loss upcasts them (ForCausalLMLoss: logits.float()), so the logits-shaped tensors autograd keeps are FP32.
    Breaks if the table reports one 'logits' dtype for both, or the census misses the upcast copy."""
    cfg = lu.load_config(None, mode="smoke", overrides={"train.precision": "fp16", "data.num_samples": 16,
                                                         "model.dropout": 0.0})

    def step(model, window, optimizer, scaler, amp_dtype, max_grad_norm, mark=lambda label: None):
        total = 0.0
        for mb in window.micro_batches:
            with torch.amp.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = model(**mb, num_items_in_batch=window.num_targets).loss
            mark("after forward")
            scaler.scale(loss).backward() if scaler else loss.backward()
            total = total + loss.detach()
        mark("after backward")
        if scaler:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        mark("after optimizer step")
        optimizer.zero_grad(set_to_none=True)
        return total

    mem = am.measure_step_memory(cfg, "fp16", step, torch.device("cpu"))
    assert mem["dtypes"]["logits (lm_head output)"] == "fp16"
    assert mem["dtypes"]["logits as the loss reads them"] == "fp32"
    rows = {r["tensor"]: r for r in am.dtype_rows({"fp16": mem})}
    assert rows["logits as the loss reads them"]["fp16"] == "fp32" and rows["loss"]["fp16"] == "fp32"
    assert all(k.endswith("_bytes") or k in ("precision", "micro_batch", "peak_phase")
               for k in am.memory_breakdown_rows({"fp16": mem})[0])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_forward_leaves_what_the_saved_tensor_census_counts(precision):
    """Issue 36: ``forward_adds_mib`` stood unexplained. It is the tracker's growth of live memory over the forward,
    what the forward leaves for backward; the saved-tensor hooks count the same thing another way. Breaks if either
    counter misses a kind (the half weight copies, the loss's FP32 logits) or the name loses its meaning. Also: the
    phase of the peak is one of the step's marks."""
    cfg = lu.load_config(None, mode="smoke", overrides={"train.precision": precision, "data.num_samples": 16,
                                                         "model.dropout": 0.0})

    def step(model, window, optimizer, scaler, amp_dtype, max_grad_norm, mark=lambda label: None):
        for mb in window.micro_batches:
            with torch.amp.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = model(**mb, num_items_in_batch=window.num_targets).loss
            mark("after forward")
            loss.backward()
        mark("after backward")
        optimizer.step()
        mark("after optimizer step")
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    m = am.measure_step_memory(cfg, precision, step, torch.device("cpu"))
    census = m["activations_fp32"] + m["activations_half"] + m["half_weight_copies"]
    assert m["forward_leaves"] == pytest.approx(census, rel=0.02), (m["forward_leaves"], census)
    assert (m["half_weight_copies"] > 0) == (precision == "bf16")
    assert m["peak_phase"] in ("forward", "backward", "optimizer step")


NOTEBOOKS = ["01-Mixed_Precision.ipynb", "02-Gradient_Accumulation.ipynb"]
ABSENT = ("規格書", "課程設計文件", "課程 README 的「預期結果」", "README_EXPECTED", "the spec")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_quote_the_course_instead_of_citing_documents_the_student_lacks(root, name):
    """Issue 27, item 6: prose cited documents the student does not have. Lab 01 quotes the course's table and
    names where it comes from."""
    import nbformat

    text = "\n".join(c.source for c in nbformat.read(root / name, as_version=4).cells)
    assert [w for w in ABSENT if w in text] == []
    if name.startswith("01"):
        assert "Lab-1.4" in text and "| FP16 | ~4.5GB | 45% | 2.2x |" in text


def test_step_figures_number_steps_from_one_with_integer_ticks():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot(lu.step_numbers([5.0, 4.0, 3.5, 3.2]), [5.0, 4.0, 3.5, 3.2])
    lu.step_axis(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert list(lu.step_numbers([0, 0, 0])) == [1, 2, 3]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert ax.get_xlabel() == "optimizer step"
    plt.close(fig)


def test_guarded_turns_oom_into_none(capsys):
    def boom():
        raise torch.OutOfMemoryError("simulated")
    assert lp.guarded(boom) is None
    assert "OOM" in capsys.readouterr().out


def test_matmul_tflops_positive():
    assert am.matmul_tflops(32, 32, 32, "fp32", torch.device("cpu"), min_run_time=0.01) > 0


def test_legend_outside_places_the_legend_off_the_axes():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], label="a")
    fig.canvas.draw()
    box = ax.get_window_extent()
    right = lu.legend_outside(ax).get_window_extent()
    assert right.x0 >= box.x1
    plt.close(fig)


def test_mfu_reading_on_a_gpu_says_whether_the_small_batch_is_launch_bound():
    """The GPU-only branch of lab 01's MFU line (smoke has no MFU): the card's peak and its source, each batch's
    MFU, and the reading follows the measured ratio."""
    from types import SimpleNamespace as R

    gpu = "NVIDIA GeForce RTX 3070"
    peak = lu.peak_tflops(gpu, "fp16")
    busy = am.mfu_reading([(1, R(mfu=0.05, peak_tflops=peak)), (8, R(mfu=0.30, peak_tflops=peak))], "fp16", gpu)
    assert f"{peak:g} TFLOP/s" in busy and "micro-batch 1: 5.0%" in busy and "boost clock" in busy
    assert "micro-batch 1 is launch-bound" in busy
    flat = am.mfu_reading([(1, R(mfu=0.30, peak_tflops=peak)), (8, R(mfu=0.31, peak_tflops=peak))], "fp16", gpu)
    assert "hardly changes" in flat and "launch-bound" in flat.split(":")[-1]
    assert "MFU not computed: no GPU" in am.mfu_reading([], "fp16", None)
