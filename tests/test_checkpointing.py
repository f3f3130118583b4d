"""Lab 03: every checkpointing variant must give the plain run's gradients, and must actually do what it says
(recompute, save less, offload) -- a variant that silently did nothing would pass an equality test alone. The
variants the notebook writes out (segments, selective, offload) are its cells' own code (ck.notebook_variants)."""
import math

import pytest
import torch

import labutils as lu
import labutils.labs.lab03.checkpoint_measure as cm
import labutils.labs.lab03.checkpointing as ck
from labutils.models.gpt2 import checkpointed_layers, gpt2_config

from conftest import tiny_config

N_LAYER = 6  # enough blocks for every_n(2), every_n(4) and segments(4) to differ


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: a second intra-op thread only adds synchronisation (and, on a shared CPU, long waits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(n_layer=N_LAYER, dropout=0.0):
    from transformers import GPT2LMHeadModel

    cfg = gpt2_config("tiny", dropout=dropout)
    cfg.n_layer = n_layer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model.train()


def _batch(b=2, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


NB = ck.notebook_variants()
VARIANTS = {
    "full": ck.full, "every 2": lambda: ck.every_n(2), "every 4": lambda: ck.every_n(4),
    "segments of 2": lambda: NB["segments"](2), "segments of 4": lambda: NB["segments"](4),
    "selective": NB["selective"], "offload": NB["offload"], "checkpoint + offload": lambda: NB["offload"](True),
}


@pytest.fixture(scope="module")
def plain():
    model, batch = _model(), _batch()
    return model, batch, cm.step_grads(model, batch)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_gives_the_plain_gradients(plain, name):
    model, batch, reference = plain
    grads = cm.step_grads(model, batch, VARIANTS[name]())
    assert all(g is not None for g in grads)
    assert cm.max_rel_diff(grads, reference) < 1e-6, name
    assert cm.max_rel_diff(cm.step_grads(model, batch), reference) == 0.0  # the variant was switched off again


def test_the_gradient_check_can_fail():
    """Negative control: with dropout, a recompute that does not restore the RNG state draws other masks."""
    model, batch = _model(dropout=0.1), _batch()
    torch.manual_seed(1)
    reference = cm.step_grads(model, batch)
    torch.manual_seed(1)
    same = cm.step_grads(model, batch, ck.full())  # preserve_rng_state=True (default): same masks
    torch.manual_seed(1)
    wrong = cm.step_grads(model, batch, ck.full(preserve_rng_state=False))
    assert cm.max_rel_diff(same, reference) < 1e-6
    assert cm.max_rel_diff(wrong, reference) > 1e-3
    assert cm.max_rel_diff(reference[:-1] + [None], reference) == math.inf


@pytest.mark.parametrize("name, expected", [
    ("baseline", N_LAYER), ("full", 2 * N_LAYER), ("every 2", N_LAYER + 3), ("every 4", N_LAYER + 2),
    ("segments of 4", 2 * N_LAYER), ("selective", 2 * N_LAYER), ("offload", N_LAYER)])
def test_recompute_happens_where_it_should(plain, name, expected):
    model, batch, _ = plain
    variant = ck.baseline() if name == "baseline" else VARIANTS[name]()
    assert cm.forward_calls(model, batch, variant) == expected


def test_every_n_checkpoints_blocks_0_k_2k_and_undo_restores():
    model = _model()
    undo = ck.every_n(4).apply(model)
    assert checkpointed_layers(model) == [0, 4]
    undo()
    assert checkpointed_layers(model) == []
    keys = list(model.state_dict())
    undo = NB["segments"](4).apply(model)
    assert len(model.transformer.h) == 2 and len(model.transformer.h[1].blocks) == 2
    undo()
    assert list(model.state_dict()) == keys


def test_flops_full_recomputes_the_forward_selective_recomputes_no_matmul(plain):
    model, batch, _ = plain
    base = cm.step_flops(model, batch)
    full = cm.step_flops(model, batch, ck.full())
    sel = cm.step_flops(model, batch, NB["selective"]())
    assert sel == base                       # matmuls and attention come from the cache
    assert 1.15 < full / base <= 4 / 3 + 1e-9  # the blocks' forward once more; the LM head is not recomputed


def test_memory_order_and_offload_counts_bytes(plain):
    model, _, _ = plain
    batch = _batch(b=8, t=64)  # activations (~7 MB a block) well above the gradients (~5 MB): they set the peak

    def peak(variant):
        model.zero_grad(set_to_none=True)
        undo = variant.apply(model)
        try:
            with lu.MemoryTracker("cpu") as mt:
                model(**batch, use_cache=False).loss.backward()
        finally:
            undo()
            model.zero_grad(set_to_none=True)
        return mt.peak_bytes - mt.start_bytes

    base, full, sel = peak(ck.baseline()), peak(ck.full()), peak(NB["selective"]())
    assert full < sel < base
    off = NB["offload"]()
    peak(off)
    both = NB["offload"](checkpointing=True)
    peak(both)
    # offload packs every saved activation; with checkpointing only block inputs and the head are left
    assert off.info["host_bytes"] > both.info["host_bytes"] > N_LAYER * 8 * 64 * 128 * 4
    # the weights that matmuls save for backward are not moved (plain save_on_cpu would copy them every step)
    block_weights = sum(p.numel() * 4 for n, p in model.named_parameters() if ".h." in n and p.dim() == 2)
    assert off.info["weights_not_moved_bytes"] >= block_weights


def test_offload_hooks_do_not_leak_after_an_error(plain):
    model, batch, _ = plain
    off = NB["offload"]()
    undo = off.apply(model)
    with pytest.raises(RuntimeError):
        model(input_ids=batch["input_ids"][:, :0].float())  # a broken call: fails inside the forward
    undo()
    assert "forward" not in model.__dict__
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        model(**batch, use_cache=False).loss.backward()
    assert packed  # our hooks are the top of the stack again: nothing left pushed by the failed forward
    model.zero_grad(set_to_none=True)


def test_measure_and_largest_batch_under_a_budget():
    cfg = tiny_config(train__steps=2, train__micro_batch_size=4, data__seq_length=32)
    free = cm.measure(cfg, [ck.baseline(), ck.full()], "cpu", progress=False)
    assert all(m.ok for m in free)
    base, full = (m.peak for m in free)
    assert full < base
    budget = (base + full) // 2
    capped = cm.measure(cfg, [ck.baseline(), ck.full()], "cpu", budget_bytes=budget, progress=False)
    assert [m.result.status for m in capped] == ["oom", "ok"]
    assert "simulated out of memory" in capped[0].result.error
    assert capped[0].row(capped[0])["status"] == "OOM"
    row = free[1].row(free[0])
    assert 0 < row["memory_saving_pct"] < 100
    b_base, probes = cm.largest_batch(cfg, ck.baseline(), "cpu", budget_bytes=budget, max_batch=16)
    assert 1 <= b_base < 4 and [p.micro_batch for p in probes] == list(range(1, b_base + 2))
    assert all(p.ok for p in probes[:-1]) and not probes[-1].ok  # every batch up to b_base fit, the next did not
    b_full, probes = cm.largest_batch(cfg, ck.full(), "cpu", budget_bytes=budget, max_batch=16)
    assert 4 <= b_full
    assert b_full == 16 or not probes[-1].ok
    assert cm.largest_batch(cfg, ck.baseline(), "cpu", budget_bytes=1, max_batch=4)[0] == 0  # nothing fits


def test_peak_during_counts_what_the_function_allocates():
    assert cm.peak_during(lambda: torch.empty(1000, dtype=torch.float32) + 1, "cpu") >= 2 * 4000


def test_memory_budget_on_cpu_yields_the_budget():
    with cm.memory_budget(123, "cpu") as b:
        assert b == 123
    with cm.memory_budget(None, "cpu") as b:
        assert b is None


def test_every_k_accounting_follows_the_measured_peaks(plain):
    """Issue 27: lab 03's every-k formula predicted 17.9 MiB at k = 2 where 13.3 MiB was measured: it added the
    recomputed block's A to the start of backward. The oracle is the memory tracker: the measured peak differences
    between k = 1 and larger k on a 6-block model, against the accounting with this model's own A (saved-tensor
    hooks on one block) and x (one block's input). The old sum is off by about one A; the largest-moment rule is not."""
    import labutils.labs.lab03.checkpoint_report as cr

    model, _, _ = plain
    b, t = 8, 64
    batch = _batch(b=b, t=t)
    x = b * t * model.config.n_embd * 4
    saved = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    h = model.transformer.h[1]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h(torch.randn(b, t, model.config.n_embd, requires_grad=True))
    a = sum(n for ptr, n in saved.items() if ptr not in weights)

    def peak(variant):
        model.zero_grad(set_to_none=True)
        undo = variant.apply(model)
        try:
            with lu.MemoryTracker("cpu") as mt:
                model(**batch, use_cache=False).loss.backward()
        finally:
            undo()
            model.zero_grad(set_to_none=True)
        return mt.peak_bytes - mt.start_bytes

    L = N_LAYER
    measured = {k: peak(ck.every_n(k)) for k in (1, 2, 3)}
    for k in (2, 3):
        got = measured[k] - measured[1]
        new = cr.every_k_accounting(L, k, x, a) - cr.every_k_accounting(L, 1, x, a)
        old = ((L - math.ceil(L / k)) * a + math.ceil(L / k) * x + a) - (L * x + a)
        assert abs(new - got) < abs(old - got), (k, got, new, old)
        assert abs(new - got) <= 0.4 * a, (k, got / a, new / a)   # transients: within half a block


def test_a_pair_has_one_step_time_and_one_overhead():
    """Issue 27: lab 03 printed full checkpointing's overhead as +15 % (mean step times), -2.75 % and +8 % (C4, medians
    of other runs). A Measured run's step time is the median of its timed steps, and the overhead every table shows is
    the same number claim C4 judges (labutils.verdicts.claims.run_pair_evidence). Breaks if a table reads the mean."""
    import labutils.verdicts.claims as cl
    from labutils.core.train import RunResult

    def result(times, peak):
        return RunResult(config={"train": {"timing_warmup_steps": 1, "micro_batch_size": 4, "precision": "fp32",
                                           "gradient_checkpointing": False},
                                 "data": {"seq_length": 64}},
                         env={"device": "cpu"}, step_times=times, peak_memory_bytes=peak, timed_steps=len(times) - 1,
                         step_time_seconds=sum(times[1:]) / (len(times) - 1))

    off = cm.Measured("no checkpointing", "baseline", None, result([9.0, 1.0, 1.0, 1.0, 4.0], 1000))  # one slow step
    on = cm.Measured("checkpointing", "every_n", 1, result([9.0, 1.2, 1.2, 1.2, 1.2], 800))
    assert off.step_time == 1.0 and off.result.step_time_seconds == 1.75    # median, not the mean
    ratio, _ = cl.run_pair_evidence(off.result, on.result, ("off", "on"))
    row = on.row(off)
    assert row["time_overhead_pct"] == pytest.approx(100 * (ratio - 1)) == pytest.approx(100 * cm.overhead(off, on))
    assert row["memory_saving_pct"] == pytest.approx(100 * cm.saving(off, on)) == pytest.approx(20)
    assert row["step_spread_pct"] is not None


def test_every_k_figure_has_one_legend_inside_the_figure():
    """The H200 run's every_k figure had two legends side by side below its panels: they overlapped and the right
    one ran off the figure. It is now one panel (step time is the Pareto figure's) with one legend. Breaks if the
    figure grows a second panel or legend, or the legend does not fit on the saved figure (bbox_inches="tight")."""
    import io
    from types import SimpleNamespace

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import labutils.labs.lab03.checkpoint_report as cr

    ks = [1, 2, 3, 4]
    run = lambda ok, peak=0, t=0.0: SimpleNamespace(ok=ok, peak=peak, step_time=t)  # noqa: E731
    every = {k: run(k < 3, 5e9 + k * 1e8, 0.16) for k in ks}
    segs = {k: run(k < 4, 5e9 + k * 2e8, 0.158) for k in ks}
    pred = {k: 5e9 + k * 1e8 for k in ks}
    fig = cr.plot_every_k(ks, every, segs, pred, pred, run(False), 7 * 2**30, "Peak memory vs k", 24)
    fig.canvas.draw()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    assert len(fig.axes) == 1 and len(legends) == 1
    labels = [t.get_text() for t in legends[0].get_texts()]
    assert "every_n_layers = k (model API): OOM (at the budget)" in labels and "budget" in labels
    fig.savefig(io.BytesIO(), bbox_inches="tight")   # how regenerate saves it: the legend is inside the saved box
    box, canvas = legends[0].get_window_extent(), fig.get_tightbbox().transformed(fig.dpi_scale_trans)
    assert canvas.x0 <= box.x0 + 1 and box.x1 <= canvas.x1 + 1
    plt.close(fig)
