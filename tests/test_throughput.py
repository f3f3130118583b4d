"""Speed counts what counts: target tokens (positions in the loss) per second, the padding share, the SDPA kernel."""
import pytest

import labutils as lu
from labutils.data import IGNORE_INDEX
from labutils.flops import attention_kernel

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
    # the timed steps are the last k (warm-up, and on the CPU the memory-tracked steps, are left out)
    k = next(k for k in range(1, len(r.step_times) + 1)
             if sum(r.step_times[-k:]) / k == pytest.approx(r.step_time_seconds, rel=1e-12))
    timed = r.step_times[-k:]
    assert r.target_tokens_per_second == pytest.approx(sum(targets[-k:]) / sum(timed))
    assert r.positions_per_second == r.tokens_per_second == pytest.approx(r.tokens_per_step * len(timed) / sum(timed))
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
