"""Speed counts what counts: target tokens (positions in the loss) per second, the padding share, the SDPA kernel."""
import importlib
import statistics

import pytest
import torch

import labutils as lu
from labutils.core.data import IGNORE_INDEX
from labutils.core.flops import attention_kernel
from labutils.core.run_result import finish_timing

from conftest import tiny_config


def test_target_tokens_and_padding_come_from_the_batches(ragged_corpus):
    cfg = tiny_config(ragged_corpus, data__pack=False, train__steps=3, train__timing_warmup_steps=1)
    r = lu.run(cfg, "cpu", progress=False, verbose=False)
    assert r.ok
    _, ds = lu.prepare(cfg, "cpu", verbose=False)  # the same samples, counted here from the tensors themselves
    windows = ds.windows(cfg.train.micro_batch_size, cfg.train.accumulation_steps, cfg.train.seed)
    targets, real = [], 0
    for _ in range(cfg.train.steps):
        w = next(windows)
        targets.append(sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in w.micro_batches))
        real += sum(int(mb["attention_mask"].sum()) for mb in w.micro_batches)
    assert r.target_tokens == targets
    assert r.padding_fraction == pytest.approx(1 - real / (cfg.train.steps * r.tokens_per_step))
    assert r.padding_fraction > 0  # the ragged corpus has documents shorter than 48 bytes
    # the timed steps are the last k (warm-up, and on the CPU the memory-tracked steps, are left out); the one step
    # time is their median, and every speed is read from it
    k = r.timed_steps
    timed = r.step_times[-k:]
    assert r.step_time_seconds == statistics.median(timed)
    assert r.target_tokens_per_second == pytest.approx(sum(targets[-k:]) / k / statistics.median(timed))
    assert r.positions_per_second == r.tokens_per_second == pytest.approx(r.tokens_per_step / statistics.median(timed))
    assert r.target_tokens_per_second < (1 - r.padding_fraction) * r.positions_per_second
    row = r.row()
    assert row["target_tokens_per_s"] == r.target_tokens_per_second and row["padding_fraction"] == r.padding_fraction
    assert r.attention_kernel  # recorded for every run


def test_packed_run_has_no_padding(ragged_corpus):
    r = lu.run(tiny_config(ragged_corpus, data__pack=True, train__steps=2), "cpu", progress=False, verbose=False)
    assert r.ok and r.padding_fraction == 0.0
    T = r.config["data"]["seq_length"]  # every position is a real token; the last of each sample has no target
    assert r.target_tokens_per_second == pytest.approx(r.positions_per_second * (T - 1) / T)


def test_attention_kernel_asks_torch():
    """On the CPU torch's flash kernel takes a mask but no dropout: training with attention dropout is math."""
    loaded = lu.load_model(lu.load_config(None, mode="smoke").model, "cpu", verbose=False)
    model = loaded.model
    assert model.training and model.config.attn_pdrop > 0
    assert attention_kernel(model, 64, padded=False) == "math"
    model.eval()  # no dropout at inference
    assert attention_kernel(model, 64, padded=False) == "flash (CPU kernel)"
    model.config._attn_implementation = "eager"
    assert attention_kernel(model, 64, padded=True) == "eager (not SDPA)"


def test_one_step_time_the_median_and_every_speed_reads_it():
    """The H200 run's lab 01 table gave fp16 a 1.34x speed-up (median over median) but 1.19x in tokens/s (a mean):
    one slow step moved the mean. Now the run's step time is the median of its timed steps, and tokens/s, target
    tokens/s and the speed-up of two runs agree. Breaks if any speed goes back to a mean (here: 2.33 s vs 1 s)."""
    import labutils.labs.lab01.amp_speed_memory as am
    lt = importlib.import_module("labutils.core.train")  # (labutils.core.train is also the function lu.train)

    cfg = tiny_config(train__steps=4, train__timing_warmup_steps=1)

    def finished(times):
        r = lt.RunResult(config=cfg.to_dict(), env={"device": "cpu"}, tokens_per_step=256, step_times=list(times),
                         target_tokens=[200] * len(times))
        finish_timing(r, cfg, 64, torch.device("cpu"), 1, [], 256 * len(times))
        return r

    slow_step = finished([3.0, 1.0, 1.0, 5.0])  # warm-up, then one host hiccup among three timed steps
    assert slow_step.step_time_seconds == 1.0 and slow_step.timed_steps == 3
    assert slow_step.tokens_per_second == 256.0 and slow_step.target_tokens_per_second == 200.0
    base = finished([3.0, 2.0, 2.0, 2.0])
    (row,) = [r for r in am.speedup_rows({"fp32": base, "fp16": slow_step}) if r["precision"] == "fp16"]
    assert row[am.SPEEDUP] == pytest.approx(slow_step.tokens_per_second / base.tokens_per_second) == 2.0
