"""The reference (labutils.models.reference, a nanoGPT-style GPT-2) against the course's model: the same weights give the
same loss (an outside oracle for the weight port: transformers' GPT-2 computes it), and compiled, the course's fast
model moves the reference's bytes (inductor's own byte count of the kernels it generated)."""
import logging

import pytest
import torch
from conftest import INDUCTOR

from labutils.models import reference as R
from labutils.core.config import load_config
from labutils.models.gpt2 import load_model

FAST_MODEL = {"model.activation": "gelu_pytorch_tanh", "model.pad_vocab_to": 64,
              "model.attn_implementation": "sdpa_causal"}


def tiny(**over):
    return load_config(None, overrides={"model.name": "tiny", "model.dropout": 0.0, "model.pretrained": "false",
                                        **FAST_MODEL, **over}, mode="smoke")


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu_new"])
def test_reference_with_the_same_weights_gives_the_same_loss_and_gradients(activation):
    """fp32, unpadded vocabulary (the reference, like nanoGPT, does not mask padded rows), right-padded labels.
    Breaks if a Conv1D weight were copied untransposed (or a square one, c_proj, silently kept its layout), a
    bias or a LayerNorm went to the wrong block, the head were not tied, or the targets were not shifted."""
    hf = load_model(tiny(**{"model.pad_vocab_to": None, "model.activation": activation}).model).model
    ref = R.from_hf(hf)
    assert ref.lm_head.weight is ref.transformer.wte.weight
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 29:] = -100  # right padding, as labutils' unpacked data has it
    hf_loss = hf(input_ids=ids, labels=labels, use_cache=False).loss
    logits, loss = ref(ids, R.shift_labels(labels))
    assert loss.item() == pytest.approx(hf_loss.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(logits, hf(input_ids=ids, use_cache=False).logits, atol=1e-4)
    hf_loss.backward()
    loss.backward()
    for name, p in ref.named_parameters():
        g = hf.get_parameter(name).grad
        assert torch.allclose(p.grad, g.t() if name.endswith(R.CONV1D) else g, atol=1e-5), name


def test_reference_takes_the_padded_vocabulary():
    """The reference runs the course's padded width (tensor cores) with the padded rows as loaded (zero); without
    the course's bias its padded logits are 0, so only the unpadded model is a loss oracle (test above)."""
    hf = load_model(tiny().model).model
    ref = R.from_hf(hf)
    assert ref.lm_head.weight.shape[0] == 320 and ref.transformer.wte.weight[257:].abs().max() == 0
    assert ref.lm_head.bias is None


# --------------------------------------------------------------------------------------------- compiled traffic
# torch's own: inductor on the CPU imports torch.utils.mkldnn, whose classes use torch.jit.script_method
TORCH_INTERNAL = pytest.mark.filterwarnings(r"ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
METRICS_LOG = "torch._inductor.compile_fx.__inductor_metrics"  # inductor counts bytes only while this logs INFO


def compiled_bytes(step) -> tuple[int, list[int]]:
    """Bytes that inductor's generated kernels read and write (``torch._inductor.metrics.num_bytes_accessed``:
    each scheduler node's buffers, worst-case inputs, best-case fusion), summed over every graph ``step``
    compiles, and per graph; caches off so that every graph is really compiled here."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    log, per_graph = logging.getLogger(METRICS_LOG), []

    class Graphs(logging.Handler):
        def emit(self, record):
            per_graph.append(record.args["num_bytes_accessed"] if isinstance(record.args, dict)
                             else record.args[0]["num_bytes_accessed"])
    handler, level = Graphs(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    torch._dynamo.reset()
    metrics.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            step()
        return metrics.num_bytes_accessed, per_graph
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        torch._dynamo.reset()


def compiled_steps(hf, ref):
    """One compiled BF16-autocast forward + backward, B4 x T512, of the course's model and of the reference."""
    ids = torch.randint(0, 257, (4, 512), generator=torch.Generator().manual_seed(1))
    targets = R.shift_labels(ids)

    def course():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.compile(hf)(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    def reference():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = torch.compile(ref)(ids, targets)
        loss.backward()
    return course, reference


def spy_partitions(monkeypatch) -> list[list[tuple]]:
    """What each compiled graph saves for backward: the shapes of the forward graph's outputs beyond its own, as
    AOT autograd's min-cut partitioner (the one inductor calls) returns them; one list per graph, appended to."""
    import torch._inductor.compile_fx as compile_fx

    seen, partition = [], compile_fx.min_cut_rematerialization_partition

    def spy(joint, inputs, *args, num_fwd_outputs, **kwargs):
        fwd, bwd = partition(joint, inputs, *args, num_fwd_outputs=num_fwd_outputs, **kwargs)
        out = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
        seen.append([tuple(n.meta["val"].shape) for n in out[num_fwd_outputs:]
                     if isinstance(getattr(n, "meta", {}).get("val"), torch.Tensor)])
        return fwd, bwd
    monkeypatch.setattr(compile_fx, "min_cut_rematerialization_partition", spy)
    return seen


@pytest.fixture(scope="module")
def compiled_reference():
    """The reference's compiled step, compiled once for both tests below (its graphs depend on the shapes, not on
    the course model's loss keys): inductor's byte count, per graph, and the shapes its partition saves for backward."""
    with pytest.MonkeyPatch.context() as mp:
        saved = spy_partitions(mp)
        hf = load_model(tiny().model).model
        _, reference = compiled_steps(hf, R.from_hf(hf))
        total, graphs = compiled_bytes(reference)
    return total, graphs, [shape for graph in saved for shape in graph]


@pytest.fixture(scope="module")
def compiled_course():
    """The course's compiled step with the full loss: inductor's byte count, per graph (two tests below read it)."""
    hf = load_model(tiny().model).model
    course, _ = compiled_steps(hf, R.from_hf(hf))
    return compiled_bytes(course)


@INDUCTOR  # on one worker with the other compiling tests (tests/conftest.py)
@TORCH_INTERNAL
def test_compiled_traffic_of_the_fast_model_equals_the_reference(compiled_reference, compiled_course):
    """One compiled BF16-autocast forward + backward of the fast model (transformers' GPT-2 with the fast keys)
    and of the reference with its weights, B4 x T512 on the tiny model: inductor's byte counts within 1 %.
    Breaks if the padded vocabulary went back to an in-place write into the logits (a forward hook: measured
    +2.3 % here, a full copy of the logits forward and of their gradient backward), or anything else made the
    course's compiled step move more than the nanoGPT-style one."""
    ours, ours_graphs = compiled_course
    theirs, their_graphs, _ = compiled_reference
    print(f"\ncompiled traffic, forward / backward (MB): fast model "
          f"{' / '.join(f'{b / 1e6:.2f}' for b in ours_graphs)}, reference "
          f"{' / '.join(f'{b / 1e6:.2f}' for b in their_graphs)}; ratio {ours / theirs:.4f}")
    assert len(ours_graphs) == len(their_graphs) == 2  # one forward, one backward graph each: no graph break
    assert theirs > 0 and abs(ours - theirs) <= 0.01 * theirs


@INDUCTOR
@TORCH_INTERNAL
def test_compiled_chunked_loss_saves_no_logits_and_moves_the_references_bytes(monkeypatch, compiled_reference):
    """The fast model with ``model.loss: chunked`` (two chunks per micro-batch, as fast_config.yaml splits its
    micro-batch), one compiled BF16-autocast forward + backward, B4 x T512: the partition saves no [*, V] tensor for
    backward, and inductor's byte count is within +2 % of the reference's (measured +0.2 %; four chunks +1.8 %).
    Oracles: torch's own partitioner (the spy sees the reference's [B, T, V] logits saved, so it can see them) and
    inductor's byte count. The earlier design recomputed the logits in backward; AOT autograd's CSE merged the
    recompute with the forward's and every chunk's logits were saved (+6.5 % bytes here with four chunks)."""
    saved = spy_partitions(monkeypatch)
    hf = load_model(tiny(**{"model.loss": "chunked", "model.loss_chunk_size": 1024}).model).model
    ref = R.from_hf(hf)
    vocab = ref.lm_head.weight.shape[0]
    course, _ = compiled_steps(hf, ref)
    ours, ours_graphs = compiled_bytes(course)
    ours_saved = [shape for graph in saved for shape in graph]
    theirs, _, their_saved = compiled_reference
    print(f"\ncompiled traffic, chunked loss: {ours / 1e6:.2f} MB, reference {theirs / 1e6:.2f} MB, ratio "
          f"{ours / theirs:.4f}; saved for backward: {ours_saved}")
    assert (4, 512, vocab) in their_saved  # the spy sees the reference's logits saved
    assert len(ours_graphs) == 2 and not [shape for shape in ours_saved if shape and shape[-1] == vocab]
    assert ours <= 1.02 * theirs


@INDUCTOR
@TORCH_INTERNAL
def test_one_compiled_loss_chunk_moves_no_more_than_the_full_loss(compiled_course):
    """Issue 47 §3: where the logits fit, ``model.loss: chunked`` with no chunk size runs each micro-batch as one chunk,
    and compiled (BF16 autocast, B4 x T512) its step moves no more bytes than the full loss's: inductor's own count.
    Breaks if an unset size meant several chunks again (each re-reads the head: two chunks of 1,024 positions moved
    0.8 % more here), or the one-chunk path saved or copied the logits the full loss keeps."""
    hf = load_model(tiny(**{"model.loss": "chunked"}).model).model
    course, _ = compiled_steps(hf, R.from_hf(hf))
    ours, graphs = compiled_bytes(course)
    full, _ = compiled_course
    print(f"\ncompiled traffic, one loss chunk: {ours / 1e6:.2f} MB, full loss {full / 1e6:.2f} MB")
    assert len(graphs) == 2 and ours <= full

