"""Tests for labutils.precision and labutils.amp_speed_memory (lab 01's measuring helpers)."""
import math

import pytest
import torch

import labutils as lu
import labutils.amp_speed_memory as am
import labutils.precision as lp
from labutils.models import gpt2_config


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
    assert int(c.log2_hist.sum()) == 4


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


def test_comparison_rows_speedup_and_saving():
    cfg = lu.load_config(None, mode="smoke")
    a = lu.RunResult(config=cfg.to_dict(), env={}, losses=[2.0, 1.0], step_times=[1.0, 1.0],
                     step_time_seconds=1.0, peak_memory_bytes=1000)
    b = lu.RunResult(config=cfg.to_dict(), env={}, losses=[2.0, 1.5], step_times=[0.5, 0.5],
                     step_time_seconds=0.5, peak_memory_bytes=600)
    skipped = am.skipped_result(cfg, "no GPU")
    rows = {r["run"]: r for r in am.comparison_rows({"fp32": a, "fp16": b, "tf32": skipped})}
    assert rows["fp16"]["speedup_vs_fp32"] == pytest.approx(2.0)
    assert rows["fp16"]["memory_saving_vs_fp32"] == pytest.approx(0.4)
    assert rows["tf32"]["status"] == "skipped" and rows["tf32"]["note"] == "no GPU"
    assert rows["tf32"]["speedup_vs_fp32"] is None


def test_comparison_rows_times_say_which_steps_they_cover():
    # 1 warm-up step (3 s) and 2 timed steps (1 s each): the total counts all three, the rates only the timed two
    cfg = lu.load_config(None, mode="smoke")
    r = lu.RunResult(config=cfg.to_dict(), env={}, losses=[2.0, 1.5, 1.0], step_times=[3.0, 1.0, 1.0],
                     step_time_seconds=1.0, peak_memory_bytes=1000)
    row = am.comparison_rows({"fp32": r})[0]
    assert "time_s" not in row
    assert row["time_all_steps_s"] == pytest.approx(5.0)
    assert row["step_time_s"] == pytest.approx(1.0) and row["steps_per_s"] == pytest.approx(1 / row["step_time_s"])


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
    below = lu.legend_outside(ax, "below").get_window_extent()
    assert below.y1 <= box.y0
    with pytest.raises(ValueError, match="where='left'.*'right', 'below'"):
        lu.legend_outside(ax, "left")
    plt.close(fig)


def test_mfu_readings_on_a_gpu_say_whether_the_small_batch_is_launch_bound():
    """The GPU-only branch of lab 01's MFU cell (smoke has no MFU): the card's peak and its source, each batch's
    MFU, and the reading follows the measured ratio."""
    from types import SimpleNamespace as R

    gpu = "NVIDIA GeForce RTX 3070"
    peak = lu.peak_tflops(gpu, "fp16")
    busy = am.mfu_readings([(1, R(mfu=0.05, peak_tflops=peak)), (8, R(mfu=0.30, peak_tflops=peak))], "fp16", gpu, gpu)
    assert f"{peak:g} TFLOP/s" in busy[0] and "micro-batch 1: 5.0%" in busy[0] and "boost clock" in busy[0]
    assert "launch-bound" in busy[1] and "6.0x" in busy[1]
    flat = am.mfu_readings([(1, R(mfu=0.30, peak_tflops=peak)), (8, R(mfu=0.31, peak_tflops=peak))], "fp16", gpu, gpu)
    assert "hardly changes" in flat[1]
    assert "MFU not computed: no GPU" in am.mfu_readings([], "fp16", "CPU (x86_64)", None)[0]
