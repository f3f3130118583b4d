"""``model.loss: chunked`` (labutils.models.loss_chunks): the LM head and cross-entropy a chunk of positions at a time.

Oracle: transformers' own causal-LM loss (``ForCausalLMLoss``) on the whole logits, and torch's autograd through it;
for memory, the CPU tracker (live tensor storages) on a real training step of GPT-2 small."""
import dataclasses

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import labutils as lu
from labutils.models import loss_chunks as LC
from labutils.core.config import ConfigError
from labutils.labs.lab04.profiling_runs import logits_share_rows
from labutils.models.spec import PRESETS

# (autocast dtype or None, relative tolerance for the loss, for the gradients). bf16 keeps 8 bits of mantissa: the
# full path rounds the head's weight gradient to bf16 once, the chunked path accumulates it in fp32.
PRECISIONS = {"fp32": (None, 1e-6, 1e-5), "bf16": (torch.bfloat16, 1e-3, 2e-2), "fp16": (torch.float16, 1e-3, 5e-3)}


def hook_masked(logits, real):
    """What labutils.models.gpt2' padded-vocabulary hook does to the head's output (out of place here)."""
    out = logits.clone()
    out[..., real:] = torch.finfo(out.dtype).min
    return out


def case(device, V=160, real=150, d=24, B=3, T=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, d, generator=g).to(device).requires_grad_()
    weight = (0.5 * torch.randn(V, d, generator=g)).to(device)
    weight[real:] = 0                                   # padded rows start at zero, as pad_vocabulary leaves them
    weight.requires_grad_()
    labels = torch.randint(0, real, (B, T), generator=g)
    labels[1, 25:] = -100                               # right padding
    labels[2, 5:] = -100
    return hidden, weight, labels.to(device)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("chunk,num_items", [(7, 40), (16, None), (4096, 55)])
def test_loss_and_gradients_equal_the_full_loss(precision, chunk, num_items):
    """Padding (-100), num_items_in_batch (the window's target count) or the mean, a padded vocabulary (the padded
    rows' constant bias vs the hook's masked logits), chunks that do not divide the positions and one that holds
    them all. Breaks on a missing shift, an ignored -100 counted, a wrong normaliser, padded rows that take part
    in the softmax, or a gradient share of a chunk lost."""
    device = "cpu"
    dtype, tol_loss, tol_grad = PRECISIONS[precision]
    hidden, weight, labels = case(device)
    real = 150
    bias = torch.zeros(weight.shape[0], device=device)
    bias[real:] = torch.finfo(torch.float32).min
    amp = torch.autocast(device, dtype=dtype) if dtype else torch.autocast(device, enabled=False)
    with amp:
        full = ForCausalLMLoss(hook_masked(torch.nn.functional.linear(hidden, weight), real), labels,
                               weight.shape[0], num_items_in_batch=num_items)
    ref = torch.autograd.grad(full, [hidden, weight])
    with amp:
        loss = LC.chunked_lm_loss(hidden, weight, labels, bias, num_items, chunk)
    got = torch.autograd.grad(loss, [hidden, weight])
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(full.item(), rel=tol_loss)
    for r, g in zip(ref, got):
        assert g.dtype == r.dtype
        assert (g - r).abs().max().item() <= tol_grad * r.abs().max().item()
    assert got[1][real:].abs().max().item() == 0       # the padded rows get no gradient


def test_the_bias_gets_its_gradient_and_a_head_bias_is_used():
    """A head with a trainable bias (nn.Linear(bias=True)): the loss, and the bias's gradient, equal the full
    head's. ``head_bias`` takes a tensor ``bias`` as it is (a constant buffer for padded rows works the same)."""
    hidden, weight, labels = case("cpu")
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    full = ForCausalLMLoss(head(hidden), labels, weight.shape[0], num_items_in_batch=50)
    ref = torch.autograd.grad(full, [hidden, head.weight, head.bias])
    assert LC.head_bias(head) is head.bias
    loss = LC.chunked_lm_loss(hidden, head.weight, labels, LC.head_bias(head), 50, chunk_size=9)
    got = torch.autograd.grad(loss, [hidden, head.weight, head.bias])
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def tiny_models(**over):
    """The tiny GPT-2 (padded vocabulary, fast keys) twice from the same seed: full loss and chunked loss."""
    keys = {"model.pad_vocab_to": 64, "model.dropout": 0.0, "model.activation": "gelu_pytorch_tanh",
            "model.attn_implementation": "sdpa_causal", **over}
    full = lu.load_model(lu.load_config(None, {**keys, "model.loss": "full"}, mode="smoke").model, "cpu").model
    cfg = lu.load_config(None, {**keys, "model.loss": "chunked", "model.loss_chunk_size": 24}, mode="smoke")
    chunked = lu.load_model(cfg.model, "cpu").model
    return full, chunked


def batch(B=4, T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate((T, 31, 12, 25)[:B]):
        mask[i, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_load_model_installs_it_and_training_returns_no_logits():
    full, chunked = tiny_models()
    assert LC.installed(chunked) and not LC.installed(full)
    b = batch()
    out = chunked(**b, num_items_in_batch=60, use_cache=False)
    assert out.logits is None and out.loss is not None    # the logits never leave the loss
    chunked.eval()
    with torch.no_grad():                                  # eval: the model's own forward, logits and all
        ev, ref = chunked(**b, use_cache=False), full.eval()(**b, use_cache=False)
    assert ev.logits.shape == ref.logits.shape
    torch.testing.assert_close(ev.loss, ref.loss)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_accumulated_micro_batches_equal_the_full_models_window(precision):
    """Token-exact accumulation (what labutils.core.train does): two padded micro-batches, each normalised by the whole
    window's target tokens, give the gradient of the full-loss model on the window in one batch. Breaks if the
    chunked loss ignored num_items_in_batch (a mean per micro-batch) or mis-shifted across the batch rows."""
    full, chunked = tiny_models()
    b = batch()
    window_targets = int((b["labels"][:, 1:] != -100).sum())
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cpu", enabled=False)
    with amp:
        ref = full(**b, num_items_in_batch=window_targets, use_cache=False).loss
    ref.backward()
    total = 0.0
    for half in (slice(0, 1), slice(1, 4)):
        with amp:
            loss = chunked(**{k: v[half] for k, v in b.items()}, num_items_in_batch=window_targets,
                           use_cache=False).loss
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(ref.item(), rel=1e-5 if precision == "fp32" else 1e-2)
    g_ref, g = grads(full), grads(chunked)
    assert g.keys() == g_ref.keys()
    tol = 1e-4 if precision == "fp32" else 3e-2
    for name in g_ref:
        scale = g_ref[name].abs().max().item() or 1.0
        assert (g[name] - g_ref[name]).abs().max().item() <= tol * scale, name


def test_with_gradient_checkpointing_and_compile():
    """nn.Module.compile traces the instance's forward (the chunked loss's autograd.Function included), with
    activation checkpointing on: same loss and gradients as the eager full-loss model. Breaks if compile skipped
    the replaced forward (the logits would come back) or checkpointing's recompute reached the loss."""
    full, chunked = tiny_models()
    lu.enable_checkpointing(chunked)
    chunked.compile(backend="aot_eager")
    b = batch()
    ref = full(**b, num_items_in_batch=70, use_cache=False)
    ref.loss.backward()
    out = chunked(**b, num_items_in_batch=70, use_cache=False)
    out.loss.backward()
    assert out.logits is None
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    g_ref, g = grads(full), grads(chunked)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


class HeadMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matmuls whose output has the vocabulary as its last dimension: the LM head's, one per chunk."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize("size", [None, 24])
def test_an_unset_chunk_size_runs_the_micro_batch_as_one_chunk(size):
    """Issue 47 §3: with no ``loss_chunk_size`` (and no card to fit, on a CPU) the head runs once over all of a
    micro-batch's positions; a size set is kept. Oracle: torch's dispatcher sees each [positions, V] head matmul of
    the forward. Breaks if an unset size fell back to a fixed chunk (1,024 positions: two chunks here)."""
    keys = {"model.pad_vocab_to": 64, "model.dropout": 0.0, "model.loss": "chunked"}
    chunked = lu.load_model(lu.load_config(None, {**keys, **({"model.loss_chunk_size": size} if size else {})},
                                           mode="smoke").model, "cpu").model
    b = batch(T=300)  # 1,200 positions: more than the fixed chunk an unset size once meant (1,024)
    positions = b["input_ids"].numel()
    with HeadMatmuls(chunked.lm_head.weight.shape[0]) as seen:
        chunked(**b, use_cache=False)
    assert seen.rows == ([positions] if size is None else [24] * (positions // 24)), seen.rows


def test_config_key_is_validated():
    cfg = lu.load_config(None, {"model.loss": "chunked"}, mode="smoke")
    assert cfg.model.loss == "chunked" and cfg.model.loss_chunk_size is None  # unset: sized by memory (issue 47)
    assert lu.load_config(None, mode="smoke").model.loss == "full"
    with pytest.raises(ConfigError, match=r"model\.loss = 'fused': must be one of full, chunked"):
        lu.load_config(None, {"model.loss": "fused"}, mode="smoke")
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_size = 0: must be >= 1"):
        lu.load_config(None, {"model.loss_chunk_size": 0}, mode="smoke")


LOGITS_BYTES = 2 * 256 * 50257 * 4  # GPT-2 small, micro-batch 2 x seq 256, fp32: one [B, T, V] tensor


def test_peak_memory_of_a_gpt2_small_step_drops_by_at_least_half_the_logits(monkeypatch):
    """The acceptance measurement: the real training step (lu.run: forward, backward, AdamW, two steps so the
    optimizer state is there) of GPT-2 small's widths (random weights, offline), 2 x 256 in fp32 on the CPU, peak live
    tensor bytes by the CPU tracker, each way. Six of its twelve blocks (half the time): the logits (B x T x V) do not
    depend on the depth, but with four or fewer blocks the step's peak is AdamW's update, where no logits live, and
    both losses peak alike (measured). Breaks if the chunked loss kept a chunk's logits (or the whole logits) for
    backward (checked: the full loss's forward in its place gives equal peaks), or added a head-sized gradient
    temporary per chunk."""
    monkeypatch.setitem(PRESETS, "gpt2", dataclasses.replace(PRESETS["gpt2"], n_layer=6))
    rows = logits_share_rows(lu.load_config(None, {
        "model.name": "gpt2", "model.pretrained": "false", "data.seq_length": 256, "data.num_samples": 8,
        "train.micro_batch_size": 2, "train.steps": 2, "train.precision": "fp32"}, mode="full"), device="cpu",
        chunk_size=256)
    full, chunked = rows
    assert full["status"] == chunked["status"] == "ok"
    assert full["logits_bytes"] == LOGITS_BYTES
    assert full["peak_bytes"] - chunked["peak_bytes"] >= LOGITS_BYTES // 2, rows
    assert chunked["final_loss"] == pytest.approx(full["final_loss"], rel=1e-5)


def test_a_chunk_that_holds_every_position_is_refused():
    """Issue 36: with a chunk larger than a micro-batch's positions the "chunked" loss is the full loss, and lab 04
    printed "peak lower by 0 B" as if that were a finding. Breaks if such a run is measured instead of refused."""
    cfg = lu.load_config(None, {"model.name": "tiny", "data.seq_length": 32, "train.micro_batch_size": 2}, mode="smoke")
    with pytest.raises(ValueError, match="holds all 64 positions"):
        logits_share_rows(cfg, device="cpu", chunk_size=64)


def test_tiny_chunks_under_compile_are_refused_before_any_work():
    """Issue 46 §2: model.loss_chunk_size: 1 under compile took 257 s to compile the tiny model (dynamo unrolls the
    chunk loop: one graph piece per chunk) and 3.9 GB. It is refused when the config is read, naming the smallest
    size allowed; eager runs keep any size, and the fast config's own chunks compile as before."""
    keys = {"model.loss": "chunked", "train.compile": True, "model.loss_chunk_size": 1}
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_size = 1: must be >= 16 under train\.compile"):
        lu.load_config(None, keys, mode="smoke")  # 4 x 64 positions: at most 16 chunks
    assert lu.load_config(None, {**keys, "model.loss_chunk_size": 16}, mode="smoke").model.loss_chunk_size == 16
    assert lu.load_config(None, {**keys, "train.compile": False}, mode="smoke").model.loss_chunk_size == 1
    assert lu.load_config("configs/fast_config.yaml", mode="full").train.compile


# Issue 45 §6: the chunked loss forms the head's weight gradient in the forward, before the loss scale reaches it. In
# fp16 a chunk's product g^T @ h overflowed when the hidden states have a large offset (GPT-2's massive activations:
# a few channels of pretrained hidden states in the hundreds), at every loss scale, even 1: GradScaler skipped every
# step and never recovered, while the full loss (its gradient divided by the target count and scaled in backward)
# recovers by backing off.
def offset_case(offset=300.0, rows=512, d=64, vocab=320):
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(rows, d, generator=g) + offset).requires_grad_()
    weight = (0.02 * torch.randn(vocab, d, generator=g)).requires_grad_()
    labels = torch.full((1, rows), 7)  # one frequent token: its column of g sums to about -rows
    return hidden, weight, labels


def test_an_fp16_chunk_with_a_large_hidden_offset_gives_the_full_losss_gradient():
    """512 positions x (hidden + 300) in one fp16 chunk: the weight-gradient product reaches 512 x 300 = 153,600,
    past fp16's 65,504 (inf before the fix, at any scale). Now finite and equal to the full loss's gradient (mean over
    the targets, autocast fp16: the oracle's overflow depends only on its loss scale, here 1) within fp16 rounding."""
    hidden, weight, labels = offset_case()
    with torch.autocast("cpu", dtype=torch.float16):
        LC.chunked_lm_loss(hidden[None], weight, labels, chunk_size=512).backward()
    chunked = weight.grad.clone()
    weight.grad = None
    with torch.autocast("cpu", dtype=torch.float16):
        logits = hidden[None] @ weight.t()
    ForCausalLMLoss(logits.float(), labels, vocab_size=weight.shape[0]).backward()
    assert torch.isfinite(chunked).all(), "the chunk's fp16 product overflowed"
    assert torch.isfinite(weight.grad).all()
    assert (chunked - weight.grad).abs().max() <= 2e-3 * weight.grad.abs().max(), (chunked - weight.grad).abs().max()


def test_fp16_training_with_the_chunked_loss_recovers_from_a_large_hidden_offset(ragged_corpus):
    """A short fp16 run of the tiny model whose final LayerNorm puts one channel of every hidden state at 5,000: the
    chunked loss trains (GradScaler skips at most a few steps, then every step is applied) instead of skipping every
    step. Breaks if the chunk's weight-gradient product overflows whatever the loss scale."""
    from conftest import tiny_config

    cfg = tiny_config(ragged_corpus, data__pack=True, train__steps=6, train__precision="fp16",
                      model__loss="chunked", model__loss_chunk_size=64)
    loaded, data = lu.prepare(cfg, "cpu", verbose=False)
    ln_f = loaded.model.transformer.ln_f
    with torch.no_grad():
        ln_f.weight[0], ln_f.bias[0] = 0.0, 5000.0  # channel 0 of every position: 5,000
    res = lu.train(cfg, loaded.model, data, "cpu", progress=False)
    assert res.ok and res.skipped_steps <= 3 and max(res.skipped, default=-1) < len(res.losses) - 2, \
        (res.status, res.skipped, res.loss_scales)
