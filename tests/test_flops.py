"""FLOP counts held against torch's own counter, on a real CPU forward + backward of GPT-2 124M (random weights)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import labutils as lu
from labutils.core.flops import flops_per_token, model_flops_per_token, recomputed_flops_per_token
from labutils.models.gpt2 import disable_checkpointing, gpt2_config


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2", 0.0, attn_implementation="eager"))
    model.loss_type = "ForCausalLM"
    model.train()
    return model


def counted_per_token(model, seq_length, every_n, dropout):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    if every_n:
        lu.enable_checkpointing(model, every_n)
    else:
        disable_checkpointing(model)
    ids = torch.randint(0, 50257, (1, seq_length))
    try:
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        disable_checkpointing(model)
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / seq_length


# (seq_length, every_n_layers or None, dropout). Dropout changes what early stop can skip, so both are held.
CASES = [(t, k, 0.0) for t in (32, 96) for k in (None, 1, 2)] + [(32, 1, 0.1), (96, 2, 0.1)]


@pytest.mark.parametrize("seq_length,every_n,dropout", CASES)
def test_executed_flops_match_torch_counter(gpt2, seq_length, every_n, dropout):
    counted = counted_per_token(gpt2, seq_length, every_n, dropout)
    modelled = flops_per_token("gpt2", seq_length, recompute=every_n is not None, every_n_layers=every_n or 1,
                               dropout=dropout > 0)
    assert abs(modelled / counted - 1) < 0.01, (modelled, counted)


def test_early_stop_is_cheaper_than_one_extra_forward_without_dropout():
    t = 128
    forward = model_flops_per_token("gpt2", t) / 3  # forward is a third of forward + backward
    assert recomputed_flops_per_token("gpt2", t, 1, dropout=True) < forward  # the LM head is never re-run
    no_dropout = recomputed_flops_per_token("gpt2", t, 1, dropout=False)
    assert no_dropout < recomputed_flops_per_token("gpt2", t, 1, dropout=True)
    # every other block: 6 of gpt2's 12 blocks recompute
    assert recomputed_flops_per_token("gpt2", t, 2, dropout=False) == pytest.approx(no_dropout / 2)
    # the course's old rule (blocks x 8/6) is the dropout case only
    assert flops_per_token("gpt2", t, recompute=True) == flops_per_token("gpt2", t, recompute=True, dropout=True)


def test_model_flops_are_executed_flops_without_recompute():
    assert model_flops_per_token("gpt2", 256) == flops_per_token("gpt2", 256)
    assert flops_per_token("gpt2", 256, fused_attention=True) > flops_per_token("gpt2", 256)


def test_fast_config_flops_match_torch_counter():
    """configs/fast_config.yaml's model (gelu_pytorch_tanh, 50304-row padded head, dropout 0), counted with eager
    attention so torch's counter sees every matmul. Breaks if the padded head's rows were left out of the count."""
    from transformers import GPT2LMHeadModel
    from labutils.models.gpt2 import pad_vocabulary

    cfg = lu.load_config("configs/fast_config.yaml", mode="full")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2", 0.0, attn_implementation="eager", activation=cfg.model.activation))
    vocab = pad_vocabulary(model, cfg.model.pad_vocab_to)
    model.loss_type = "ForCausalLM"
    assert vocab == 50304
    ids = torch.randint(0, 50257, (1, 32))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    counted = counter.get_total_flops() / 32
    assert abs(flops_per_token("gpt2", 32, vocab=vocab) / counted - 1) < 0.001, counted


def test_causal_kernels_count_the_scores_a_causal_mask_keeps():
    """HFU of causal flash: the attention matmuls shrink to the share of T x T scores a causal mask keeps.
    Oracle: torch's own tril count. Breaks if the discount touched the weight matmuls or missed the recompute."""
    t, spec = 1024, lu.models.gpt2.PRESETS["gpt2"]
    n_layer, d = spec.n_layer, spec.d_model
    kept = torch.ones(t, t).tril().sum().item() / t**2
    full = flops_per_token("gpt2", t, fused_attention=True)
    causal = flops_per_token("gpt2", t, fused_attention=True, causal_skip=True)
    attention = n_layer * 14 * t * d  # forward 4Td + backward 8Td + the fused recompute 2Td per layer and token
    assert causal == pytest.approx(full - attention * (1 - kept))


@pytest.mark.parametrize("pad_vocab_to,chunk", [(None, 12), (64, 4096)])
def test_chunked_loss_flops_match_torch_counter(pad_vocab_to, chunk):
    """model.loss: chunked computes the head's gradients in its forward (no recompute): the full head's FLOPs,
    counted by torch's counter through the loss's autograd.Function (chunks that do not divide the positions, and
    one chunk). Breaks if the loss re-ran the head in backward (the old design: 2 * d * vocab more per position) or
    skipped a gradient matmul."""
    from transformers import GPT2LMHeadModel
    from labutils.models import loss_chunks
    from labutils.models.gpt2 import pad_vocabulary

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2", 0.0, attn_implementation="eager"))
    vocab = pad_vocabulary(model, pad_vocab_to)
    model.loss_type = "ForCausalLM"
    loss_chunks.install(model, chunk)
    model.train()
    ids = torch.randint(0, 50257, (1, 32))
    with FlopCounterMode(display=False) as counter:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    assert out.logits is None
    counted = counter.get_total_flops() / 32
    modelled = flops_per_token("gpt2", 32, vocab=vocab)
    assert abs(modelled / counted - 1) < 0.001, (modelled, counted)


def test_account_flops_counts_the_same_head_for_both_losses():
    from labutils.core.flops import account_flops
    from labutils.core.train import RunResult

    executed = {}
    for loss in ("full", "chunked"):
        cfg = lu.load_config(None, {"model.name": "gpt2", "model.loss": loss, "data.seq_length": 64}, mode="full")
        res = RunResult(config=cfg.to_dict(), env={}, tokens_per_step=64, target_tokens=[63], step_times=[1.0],
                        tokens_per_second=64.0)
        account_flops(res, cfg, 64, torch.device("cpu"), 1)
        executed[loss] = res.executed_flops_per_step
        assert res.model_flops_per_step == pytest.approx(model_flops_per_token("gpt2", 64) * 63)
    assert executed["chunked"] == executed["full"]  # HFU counts what runs: no recompute of the head
