"""Issue 29 §2: ``attn_implementation: sdpa_causal`` is causal SDPA without a mask. It is exact for no padding
and for right padding (a causal query never sees the padding after it); any other 2-D mask (left padding, a hole)
would be ignored: the logits would equal the unmasked model's. Such a mask is refused, naming the fix, eagerly and
under torch.compile, where the mask reaches the model as a traced input.

Oracle: transformers' own 'sdpa' path, which honours every mask: the masks refused here change its logits (so
ignoring them is wrong), the masks accepted here give its loss.
"""
import pytest
import torch

from labutils.core.config import load_config
from labutils.models.gpt2 import compile_model, load_model


def model(attn):
    cfg = load_config(None, overrides={"model.dropout": 0.0, "model.attn_implementation": attn}, mode="smoke")
    return load_model(cfg.model, "cpu", verbose=False).model


IDS = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))


def left_padded():
    mask = torch.ones_like(IDS)
    mask[0, :4] = 0  # row 0 left-padded
    return mask


def holed():
    mask = torch.ones_like(IDS)
    mask[2, 5] = 0  # a hole in row 2
    return mask


def right_padded():
    mask = torch.ones_like(IDS)
    mask[0, 7:] = 0
    mask[1, 2:] = 0
    return mask


def holed_3d():
    return holed()[:, None, :]  # [B, 1, T]: transformers' sdpa honours it; sdpa_causal ignored it (issue 38 §6)


@pytest.mark.parametrize("make_mask", [left_padded, holed, holed_3d])
def test_a_mask_it_cannot_honour_is_refused_naming_the_fix(make_mask):
    mask = make_mask()
    ref = model("sdpa")
    with torch.no_grad():  # the oracle: this mask matters
        assert not torch.allclose(ref(input_ids=IDS, attention_mask=mask).logits, ref(input_ids=IDS).logits)
    fast = model("sdpa_causal")
    with pytest.raises(ValueError, match=r"pad on the right .*data\.pack: true.*'sdpa'"):
        fast(input_ids=IDS, attention_mask=mask)


@pytest.mark.parametrize("make_mask", [right_padded, lambda: torch.ones_like(IDS)])
def test_right_padding_and_all_ones_are_taken_and_exact(make_mask):
    mask = make_mask()
    labels = IDS.masked_fill(mask == 0, -100)
    ref, fast = model("sdpa"), model("sdpa_causal")
    fast.load_state_dict(ref.state_dict())
    a = ref(input_ids=IDS, attention_mask=mask, labels=labels).loss
    b = fast(input_ids=IDS, attention_mask=mask, labels=labels).loss
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_mask_is_checked_under_torch_compile():
    """model.compile() traces the forward (hooks included); the check runs on the real mask. The "eager"
    backend keeps the test fast on a CPU: dynamo's tracing, which is where a check could be skipped, is the same."""
    fast = model("sdpa_causal")
    compile_model(fast, backend="eager")
    try:
        with pytest.raises(ValueError, match="pad on the right"):
            fast(input_ids=IDS, attention_mask=left_padded())
        assert torch.isfinite(fast(input_ids=IDS, attention_mask=right_padded(), labels=IDS).loss)
    finally:
        torch._dynamo.reset()


def test_no_mask_compiles_to_one_graph():
    """Packed batches pass no mask: the check adds no graph break there (the fast path's graph stays whole)."""
    fast = model("sdpa_causal")
    explanation = torch._dynamo.explain(fast)(input_ids=IDS, labels=IDS)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
