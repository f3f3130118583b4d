"""Host syncs inside a training step: the loop reads the device back once per step (the loss read), nowhere else.

The oracle is torch's own dispatcher: every host read of a tensor's value goes through an ATen op that a
``TorchDispatchMode`` sees (``_local_scalar_dense`` is what ``.item()``, ``bool()``, ``float()``, ``int()`` call;
``nonzero`` / ``masked_select`` / ``unique`` size their output from the data), or through ``Tensor.tolist`` /
``.numpy()``, which the test wraps (counting, then calling torch's own method). On a GPU each of these waits for
the device. The CPU cannot tell a device tensor from a host one, so two reads that exist only on the CPU are
attributed, not hidden: the unfused AdamW's per-parameter ``step.item()`` and GradScaler's ``found_inf.item()``
for an optimizer without fused AMP support. On CUDA ``make_optimizer`` builds the fused AdamW, whose step (with a
GradScaler) reads nothing back: checked on the CPU's fused kernel below.
"""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import labutils as lu

from conftest import tiny_config

READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
         "unique_consecutive", "repeat_interleave", "equal", "is_nonzero"}


def cpu_only(frame) -> bool:
    """A read that only the CPU's unfused optimizer makes (see the module docstring): inside ``optimizer.step``,
    or GradScaler's ``_maybe_opt_step`` (``found_inf.item()``, for optimizers without fused AMP support)."""
    return "torch/optim/" in frame.filename or (frame.filename.endswith("grad_scaler.py")
                                                and frame.name == "_maybe_opt_step")


def infrastructure(frame) -> bool:
    """Frames of the dispatch machinery between an op's caller and this spy (dispatch modes, dynamo's disable
    wrappers, the CPU memory tracker's own dispatch mode): not where a read was asked for."""
    f = frame.filename
    return ("test_syncs.py" in f or "torch/_dynamo/" in f or f.endswith(("torch/_compile.py", "torch/_ops.py"))
            or "torch/utils/_python_dispatch.py" in f
            or (f.endswith("labutils/core/memory.py") and frame.name == "__torch_dispatch__"))


class HostReads(TorchDispatchMode):
    """Records each host read of tensor data as (phase, what, where); ``phase`` is set from outside."""

    def __init__(self):
        super().__init__()
        self.phase, self.events = None, []

    def note(self, what):
        if self.phase is None:
            return
        frames = [f for f in traceback.extract_stack()[:-2] if not infrastructure(f)]
        show = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames]
        # reported as: the innermost labutils frame (where the loop asked), then the innermost frame of all
        ours = next((f[f.index("labutils/"):] for f in reversed(show) if "labutils/" in f), "?")
        where = f"{ours} (in {show[-1]})" if show else ours
        self.events.append((self.phase, what, where, any(cpu_only(f) for f in frames)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS or (name == "index" and any(  # boolean-mask indexing calls nonzero inside
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))):
            self.note(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    mode = HostReads()
    for name in ("tolist", "numpy", "__array__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _original=original, _name=name, **k):
            mode.note(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, spy)
    with mode:
        yield mode


# The course's own causal attention (labutils.models.gpt2.causal_sdpa_attention, config key model.attn_implementation):
# transformers builds no mask for it and SDPA gets is_causal=True, so the model's forward reads nothing back.
# The stock "sdpa" path reads its mask or position ids back every forward (test_stock_sdpa_reads_back_every_step).
CAUSAL = "sdpa_causal"


def run_counted(cfg, host_reads, accum=1):
    """Train 3 steps; return the reads of step 1 and of step 2 (phases set by ``on_step``: phase k runs from the
    end of step k-1's on_step to the end of step k's, so it holds all of step k's loop body)."""
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    model = loaded.model

    def on_step(step, *_):
        host_reads.phase = step + 1
    lu.train(cfg, model, ds, "cpu", progress=False, on_step=on_step)
    host_reads.phase = None
    per_step = {}
    for phase, what, where, cpu_only in host_reads.events:
        if phase in (1, 2) and not cpu_only:
            per_step.setdefault(phase, []).append(f"{what} at {where}")
    return per_step


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_host_read_per_step(precision, host_reads):
    """Breaks if the loop reads the device anywhere but its one end-of-step read: ``scaler.get_scale()`` (fp16,
    twice per step before this fix), ``float(norm)``, an ``if loss_tensor`` / ``.item()`` added to the step."""
    cfg = tiny_config(data__pack=True, train__precision=precision, train__micro_batch_size=2,
                      train__accumulation_steps=2, train__steps=3, train__timing_warmup_steps=1,
                      model__attn_implementation=CAUSAL)
    per_step = run_counted(cfg, host_reads)
    for step in (1, 2):
        reads = per_step.get(step, [])
        assert len(reads) == 1 and reads[0].startswith("tolist at labutils/core/train.py"), (step, reads)


def test_stock_sdpa_reads_back_every_step(host_reads):
    """Why the course's fast path names ``sdpa_causal``: with transformers' stock ``sdpa`` the model itself reads
    the device back in every micro-batch's forward (transformers 5.x: ``masking_utils.find_packed_sequence_indices``
    reads the position ids on the host to detect packed sequences before building the mask), so the count above
    fails on it. Also shows the counter sees a read inside the model's forward: if this fails, the test above
    proves nothing about the model's side."""
    cfg = tiny_config(data__pack=True, train__micro_batch_size=2, train__accumulation_steps=2, train__steps=3,
                      train__timing_warmup_steps=1, model__attn_implementation="sdpa")
    per_step = run_counted(cfg, host_reads)
    for step in (1, 2):
        reads = per_step.get(step, [])
        assert len(reads) > 1 and any("transformers/masking_utils.py" in r for r in reads), (step, reads)


def test_fused_adamw_with_grad_scaler_reads_nothing(host_reads):
    """What CUDA runs: ``make_optimizer`` asks for the fused AdamW there, and its step under a GradScaler (unscale_,
    clip, step, update) reads nothing back. Breaks if make_optimizer stops fusing on CUDA, or if torch's fused path
    starts reading ``found_inf`` on the host (then the GPU step would have a second sync)."""
    cfg = tiny_config()
    model = torch.nn.Linear(8, 8)
    opt, _ = lu.make_optimizer(model, cfg, torch.device("cuda"))  # only the device type is read: no GPU needed
    assert opt.defaults["fused"] is True
    scaler = torch.amp.GradScaler("cpu")
    host_reads.phase = "step"
    for _ in range(2):
        scaler.scale(model(torch.randn(4, 8)).square().sum()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert host_reads.events == []


def test_packed_batches_carry_no_attention_mask(ragged_corpus):
    """Breaks if packed batches pass an all-ones mask again (gathered per micro-batch, and inspected by
    transformers); padded batches must keep theirs (lab 02's padding lesson needs it)."""
    packed = tiny_config(ragged_corpus, data__pack=True)
    padded = tiny_config(ragged_corpus, data__pack=False)
    for cfg, has_mask in ((packed, False), (padded, True)):
        _, ds = lu.prepare(cfg, "cpu", verbose=False)
        mb = next(ds.windows(2, 1, 0)).micro_batches[0]
        assert ("attention_mask" in mb) is has_mask


@pytest.mark.real_kernels  # trains on "cuda": under LAB_PRETEND_GPU that is the pretend GPU, which has no kernels
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch's own sync detector")
def test_one_sync_per_step_on_cuda():
    """On a GPU, torch's own detector (``set_sync_debug_mode``) counts the synchronising calls of steps 1 and 2:
    one each, the loss read. Breaks on any sync the CPU test cannot see (a synchronous host-to-device copy)."""
    import warnings

    cfg = tiny_config(data__pack=True, train__steps=3, train__timing_warmup_steps=1,
                      model__attn_implementation=CAUSAL).override(
        {"train.micro_batch_size": 2, "train.accumulation_steps": 2})
    loaded, ds = lu.prepare(cfg, "cuda", verbose=False)
    model = loaded.model
    counts = {}

    def on_step(step, *_):
        torch.cuda.set_sync_debug_mode("warn" if step in (0, 1) else 0)
        counts[step] = len(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lu.train(cfg, model, ds, "cuda", progress=False, track_memory=False, on_step=on_step)
    torch.cuda.set_sync_debug_mode(0)
    assert counts[1] - counts[0] == 1 and counts[2] - counts[1] == 1, counts
