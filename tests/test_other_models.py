"""The course's loop on a causal LM that is not GPT-2 (issue 43, "A model spec"): a tiny random Llama (grouped-query
attention, gated MLP, untied head, RoPE) and a tiny random GPT-NeoX (fused QKV, parallel residual), both built from
a small config, no hub. ``lu.train`` trains them, FLOPs and checkpointing follow their spec, and what stays GPT-2
only (the estimator's replay, bench's reference) refuses in one line."""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import labutils as lu
from labutils.labs.lab03 import checkpointing as ck
from labutils.core.data import build_dataset
from labutils.estimator.estimate import Plan, estimate_plan, parameter_count
from labutils.core.flops import flops_per_token, model_flops_per_token
from labutils.models.hub import gpt2_tokenizer
from labutils.models.spec import PRESETS, spec_of
from labutils.models.gpt2 import checkpointed_layers, disable_checkpointing

from conftest import tiny_config

VOCAB = 300  # more than the smoke data's 257 byte tokens


def llama(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, use_cache=False, attn_implementation=attn)).train()


def neox(attn="sdpa"):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=128, use_cache=False, attn_implementation=attn)).train()


MODELS = {"llama": llama, "gpt_neox": neox}


def test_spec_is_read_from_each_family_s_own_config():
    s = spec_of(llama())
    assert (s.family, s.n_layer, s.d_model, s.n_head, s.n_kv_head, s.head_dim, s.d_ff) == \
        ("llama", 2, 64, 4, 2, 16, 176)
    assert s.gated_mlp and not s.tied_head and s.vocab == VOCAB and s.n_positions == 128
    assert (s.blocks, s.block_class) == ("model.layers", "LlamaDecoderLayer")
    n = spec_of(neox())
    assert (n.n_kv_head, n.d_ff, n.gated_mlp, n.blocks, n.block_class) == \
        (4, 256, False, "gpt_neox.layers", "GPTNeoXLayer")
    for make in MODELS.values():
        model = make()
        assert spec_of(model.config) == spec_of(model)  # from the config alone (a meta-device model)
        assert {spec_of(model).block_class} == set(model._no_split_modules)  # what FSDP wraps
        assert len(spec_of(model).blocks_of(model)) == 2
    # the presets and a live model agree: the sizes have one home
    tiny = lu.load_model(tiny_config().model, verbose=False).model
    assert spec_of(tiny) == PRESETS["tiny"] and spec_of(tiny.config) == PRESETS["tiny"]


@pytest.mark.parametrize("family", MODELS)
def test_lu_train_trains_another_family(family):
    cfg = tiny_config(train__steps=6, train__lr=3e-3, data__seq_length=32, data__num_samples=32)
    ds = build_dataset(cfg.data, gpt2_tokenizer("tiny"))
    model = MODELS[family]()
    res = lu.train(cfg, model, ds, "cpu", progress=False)
    assert res.status == "ok" and res.losses[-1] < res.losses[0] - 0.2, res.losses
    assert res.model_flops_per_step == pytest.approx(
        model_flops_per_token(model, 32) * sum(res.target_tokens[-res.timed_steps:]) / res.timed_steps)
    assert res.parameters == sum(p.numel() for p in model.parameters())


def counted_per_token(model, t, every_n=None):
    if every_n:
        lu.enable_checkpointing(model, every_n)
    ids = torch.randint(0, VOCAB, (1, t))
    try:
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        disable_checkpointing(model)
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / t


@pytest.mark.parametrize("family", MODELS)
def test_flops_follow_the_spec_within_one_percent_of_torch_s_counter(family):
    model, t = MODELS[family]("eager"), 64  # eager: both attention matmuls are counted on every device
    for every_n in (None, 1):
        modelled = flops_per_token(model, t, recompute=every_n is not None, dropout=False)
        counted = counted_per_token(model, t, every_n)
        assert abs(modelled / counted - 1) < 0.01, (every_n, modelled, counted)
    # and GPT-2's formula would be wrong here: grouped-query attention / gated MLP change the count
    gpt2_like = dataclasses.replace(spec_of(model), n_kv_head=4, gated_mlp=False, d_ff=256)
    if family == "llama":
        assert abs(model_flops_per_token(gpt2_like, t) / model_flops_per_token(model, t) - 1) > 0.01


@pytest.mark.parametrize("family", MODELS)
def test_checkpointing_gives_the_same_gradients_as_none(family):
    ids = torch.randint(0, VOCAB, (2, 32))

    def grads(model):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    reference = grads(MODELS[family]())
    model = MODELS[family]()
    lu.enable_checkpointing(model)
    assert checkpointed_layers(model) == [0, 1]
    torch.testing.assert_close(grads(model), reference)
    model = MODELS[family]()
    ck.notebook_variants()["segments"](2).apply(model)  # lab 03's Chen segments: the block list found by the spec
    torch.testing.assert_close(grads(model), reference)


def test_what_stays_gpt2_only_refuses_in_one_line():
    from labutils.models.reference import from_hf

    model = llama()
    for call in (lambda: estimate_plan(Plan(model=model)), lambda: parameter_count(model.config),
                 lambda: from_hf(model)):
        with pytest.raises(ValueError) as err:
            call()
        line = str(err.value)
        assert "\n" not in line and f"GPT-2 only ({', '.join(PRESETS)})" in line, line
        assert line.endswith(("got LlamaForCausalLM", "got llama")), line


def test_lab04_one_loop_trains_another_family_as_lu_train_does(root):
    """Notebook 04's capstone cell, run as written on a Llama: the same losses as ``lu.train`` (checkpointing and
    accumulation on, as in the lab's "all together" row)."""
    import json
    import math
    import time

    cells = json.loads((root / "04-Memory_Profiling.ipynb").read_text(encoding="utf-8"))["cells"]
    source = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("def one_loop("))
    ns = {"lu": lu, "torch": torch, "math": math, "time": time}
    exec(compile(source, "lab04 one_loop", "exec"), ns)
    cfg = tiny_config(train__steps=2, train__micro_batch_size=2, train__accumulation_steps=2,
                      train__gradient_checkpointing=True, data__seq_length=16, data__num_samples=8)
    ds = build_dataset(cfg.data, gpt2_tokenizer("tiny"))
    mine = ns["one_loop"](cfg, llama(), ds, torch.device("cpu"))["losses"]
    ref = lu.train(cfg, llama(), ds, "cpu", progress=False, track_memory=False).losses
    assert mine == pytest.approx(ref, rel=1e-5)


def test_fsdp_wraps_the_model_s_own_block_class():
    """The launch config named GPT2Block (configs/accelerate/fsdp.yaml did): accelerate then refuses a Llama; the
    loop sets the class from the model's spec before ``prepare``. The plugin is accelerate's own."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from labutils.core.distributed import wrap_blocks

    model = llama()
    with pytest.raises(ValueError, match="GPT2Block"):
        FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                       transformer_cls_names_to_wrap=["GPT2Block"]).set_auto_wrap_policy(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["GPT2Block"])
    wrap_blocks(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), model)  # an Accelerator's .state
    plugin.set_auto_wrap_policy(model)
    assert {c.__name__ for c in plugin.auto_wrap_policy.keywords["transformer_layer_cls"]} == {"LlamaDecoderLayer"}
