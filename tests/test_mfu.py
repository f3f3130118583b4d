"""MFU / HFU in every run, the compile switch, and bench's refusal of steps it cannot time."""
import importlib
import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import COMPILED_TINY, INDUCTOR, tiny_config

import labutils as lu
from tests import fake_cuda
from labutils.tools.cli import main
from labutils.core.flops import account_flops, flops_per_token, model_flops_per_token

lt = importlib.import_module("labutils.core.train")  # the module (labutils.core.train is the function)


# torch's own inductor imports torch/utils/mkldnn.py, which uses the deprecated torch.jit.script_method: not ours
TORCH_INTERNAL = pytest.mark.filterwarnings(r"ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def test_cli_json_has_mfu_and_hfu_null_on_cpu(root, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "labutils", "run", "configs/fp32_config.yaml", "--set",
                           "train.steps=3", "--json", str(out), "--quiet"], check=False, cwd=root, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "LAB_SMOKE": "1"})
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert "mfu" in d and "hfu" in d
    assert d["model_flops_per_step"] > 0 and d["executed_flops_per_step"] > d["model_flops_per_step"]
    peak = lu.peak_tflops(d["env"]["gpu_name"], "fp32")  # None on CPU (the CPU CI) and on a GPU not in the table
    if peak is None:
        assert d["mfu"] is None and d["hfu"] is None and d["peak_tflops"] is None  # never an invented peak
        assert "MFU / HFU      - (" in proc.stdout
    else:  # the GPU smoke job: a real card, a real (tiny) utilisation
        assert d["peak_tflops"] == peak and 0 < d["mfu"] < d["hfu"] < 1


def _finished(cfg, times=(1.0, 0.5, 0.5), targets=(1000, 900, 800)):
    seq = cfg.data.seq_length
    r = lt.RunResult(config=cfg.to_dict(), env={}, tokens_per_step=cfg.effective_batch_size * seq,
                     step_times=list(times), target_tokens=list(targets))
    r.step_time_seconds = sum(times[1:]) / 2
    r.tokens_per_second = r.tokens_per_step / r.step_time_seconds
    return r


@pytest.mark.parametrize("ckpt", [False, True])
def test_mfu_uses_target_tokens_and_the_precisions_peak(monkeypatch, ckpt):
    fake_cuda.install(monkeypatch, "h100", name="NVIDIA A100-SXM4-40GB")  # a pretend card: the name is real input
    cfg = tiny_config(model__name="gpt2", data__seq_length=128, train__precision="bf16", train__micro_batch_size=8,
                      train__gradient_checkpointing=ckpt, model__dropout=0.1)
    r = _finished(cfg)
    account_flops(r, cfg, 128, torch.device("cuda"), n_timed=2)  # the last two steps are timed
    model = model_flops_per_token("gpt2", 128) * (900 + 800) / 1.0
    # no attention kernel recorded here: the loop assumes flash, whose causal mask skips the scores above the diagonal
    executed = flops_per_token("gpt2", 128, recompute=ckpt, fused_attention=True, causal_skip=True) * 8 * 128 * 2 / 1.0
    assert r.peak_tflops == 312.0
    assert r.mfu == pytest.approx(model / 312e12)
    assert r.hfu == pytest.approx(executed / 312e12)
    assert r.hfu > r.mfu  # padding, the untargeted last position, and recompute all count in HFU only
    assert r.row()["mfu"] == r.mfu


def test_mfu_is_none_on_an_unknown_gpu_or_format(monkeypatch):
    cfg = tiny_config(model__name="gpt2", train__precision="bf16")
    fake_cuda.install(monkeypatch, "t4")  # no BF16 tensor cores
    r = _finished(cfg)
    account_flops(r, cfg, cfg.data.seq_length, torch.device("cuda"), n_timed=2)
    assert r.mfu is None and r.hfu is None and r.achieved_tflops > 0
    with monkeypatch.context() as m:
        fake_cuda.install(m, "h100", name="Some Future GPU")
        r = _finished(cfg)
        account_flops(r, cfg, cfg.data.seq_length, torch.device("cuda"), n_timed=2)
    assert r.mfu is None and r.hfu is None
    r = _finished(cfg)  # and on the CPU
    account_flops(r, cfg, cfg.data.seq_length, torch.device("cpu"), n_timed=2)
    assert r.mfu is None and r.hfu is None


def test_compile_key_is_validated_and_off_by_default():
    assert lu.load_config(None, mode="smoke").train.compile is False
    with pytest.raises(lu.ConfigError, match="train.compile.*true or false"):
        lu.load_config(None, overrides=["train.compile=maybe"], mode="smoke")


@INDUCTOR
@TORCH_INTERNAL
def test_training_loop_compiles_the_model_when_asked(ragged_corpus):
    """A real torch.compile of the tiny model on the CPU (inductor + gcc); measured ~10-30 s on the 2-core CI box."""
    cfg = tiny_config(ragged_corpus, **{**COMPILED_TINY, "train__compile": False})
    eager, ds = lu.prepare(cfg, "cpu", verbose=False)
    compiled, _ = lu.prepare(cfg, "cpu", verbose=False)
    start = time.perf_counter()
    a = lu.train(cfg, eager.model, ds, "cpu", progress=False)
    b = lu.train(cfg.override({"train.compile": True}), compiled.model, ds, "cpu", progress=False)
    assert time.perf_counter() - start < 120
    assert getattr(eager.model, "_compiled_call_impl", None) is None
    assert compiled.model._compiled_call_impl is not None
    assert max(abs(x - y) for x, y in zip(a.losses, b.losses)) < 1e-3  # same training, compiled


def test_bench_refuses_steps_at_or_below_the_warmup(root, capsys, monkeypatch):
    monkeypatch.setenv("LAB_SMOKE", "1")
    for steps in (1, 2):
        assert main(["bench", str(root / "configs/fp32_config.yaml"), "--set", f"train.steps={steps}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "train.steps" in err[0] and f"= {steps}" in err[0] and ">= 3" in err[0]
    assert main(["bench", str(root / "configs/fp32_config.yaml"), "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


@INDUCTOR
@TORCH_INTERNAL
def test_bench_compares_eager_and_compiled(ragged_corpus):
    from labutils.tools.bench import bench

    cfg = tiny_config(ragged_corpus, **COMPILED_TINY)
    out = bench(cfg, repeats=1, device="cpu", verbose=False)
    for key in ("eager", "compiled"):
        assert out[key]["ratio"] > 0 and out[key]["reference"]["positions_per_second"]["median"] > 0
    assert out["headline"] == "compiled" and out["ratio"] == out["compiled"]["ratio"]  # the config's own setting
    assert all(x > 0 for x in out["compile_speedup"].values())


def test_cpu_memory_tracker_skips_fake_tensors_that_compile_leaves_behind():
    """torch.compile traces with FakeTensors, and some outlive the compile (dynamo keeps them); they own no memory.
    The CPU tracker walks every live tensor when it starts: it counted them (and crashed in ``bench`` with
    train.compile=true, where their storage refuses its data pointer)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2**28, dtype=torch.uint8)  # 256 MiB that do not exist
    with lu.MemoryTracker("cpu") as mt:
        real = torch.ones(1000)
    assert fake.numel() == 2**28 and real.numel() == 1000
    assert mt.start_bytes < 2**28  # the fake tensor is not counted as live memory
