"""Lab 01, where the memory goes under mixed precision: what autograd saves for backward, by kind, in one measured step
of the notebook's ``amp_step``, and the batch sweep of FP32 against AMP on an 8 GB card (in smoke its scale model). """
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ...core.env import matmul_precision, seed_everything
from ...core.memory import MemoryTracker, cpu_budget_kwargs, is_weight_copy, state_bytes
from ...core.precisions import BASELINE, PRECISIONS, dtype_name, get, scaler
from ...core.results import byte_unit

HALF_DTYPES = tuple(p.autocast for p in PRECISIONS.values() if p.amp)
PHASES = {"after forward": "forward", "after backward": "backward", "after optimizer step": "optimizer step"}


@dataclass
class SavedTensorCensus:
    """Bytes autograd saves for backward, each storage once, by kind: ``parameter`` (an FP32 weight: no new memory),
    ``half weight copy`` (autocast's cast of a weight), ``activation half``, ``activation fp32`` (the rest)."""
    param_ptrs: set
    by_kind: dict = field(default_factory=dict)
    _seen: set = field(default_factory=set)
    log_softmax_dtypes: set = field(default_factory=set)  # the logits' dtype as the loss reads them

    def pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = st.data_ptr()
        if t.grad_fn is not None and type(t.grad_fn).__name__ == "LogSoftmaxBackward0":
            self.log_softmax_dtypes.add(dtype_name(t.dtype))
        if key in self._seen or st.nbytes() == 0:
            return t
        self._seen.add(key)
        kind = ("parameter" if key in self.param_ptrs else "half weight copy" if is_weight_copy(t) else
                "activation half" if t.dtype in HALF_DTYPES else "activation fp32")
        self.by_kind[kind] = self.by_kind.get(kind, 0) + st.nbytes()
        return t

    def get(self, kind: str) -> int:
        return self.by_kind.get(kind, 0)


@contextlib.contextmanager
def saved_tensor_census(model: torch.nn.Module):
    """``with saved_tensor_census(model) as census: loss = model(...)`` then ``census.by_kind``."""
    census = SavedTensorCensus({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda t: t):
        yield census


def measure_step_memory(cfg, precision: str, step_fn, device) -> dict:
    """Two steps of ``step_fn`` (the notebook's ``amp_step``, calling ``mark(label)``), the second measured: weights,
    gradients, optimizer state, saved tensors by kind, the growth over the forward, the peak, its phase, dtypes."""
    from ...core.train import make_optimizer, prepare

    seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model.train()
    optimizer, _ = make_optimizer(model, cfg, device)
    grad_scaler = scaler(precision, device)
    windows = dataset.to(device).windows(cfg.train.micro_batch_size, cfg.train.accumulation_steps, cfg.train.seed)
    seen, marks = {}, {}

    def record_dtype(name):
        def hook(module, inputs, output):  # a forward hook must return None, or it replaces the output
            seen[name] = dtype_name(output.dtype)
        return hook

    hooks = [model.transformer.h[0].attn.c_attn.register_forward_hook(record_dtype("matmul output")),
             model.lm_head.register_forward_hook(record_dtype("logits (lm_head output)"))]

    def mark(label):
        marks[label] = mt.mark(label)
        if label == "after backward":  # gradients exist only between backward and zero_grad
            marks["gradient bytes"] = state_bytes(model)["grads"]
            params = list(model.parameters())  # the dtypes the training state is held in
            held = {"weights": params, "gradients": [p.grad for p in params if p.grad is not None],
                    "optimizer state": [v for s in optimizer.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor) and v.dim() > 0]}
            seen.update({k: ", ".join(sorted({dtype_name(t.dtype) for t in ts})) or "-" for k, ts in held.items()})

    amp_dtype, args = get(precision).autocast, (cfg.train.max_grad_norm,)
    with matmul_precision(tf32=False):
        step_fn(model, next(windows), optimizer, grad_scaler, amp_dtype, *args)  # step 1: AdamW's state
        with MemoryTracker(device) as mt, saved_tensor_census(model) as saved:
            mark("step start")
            loss = step_fn(model, next(windows), optimizer, grad_scaler, amp_dtype, *args, mark)
    for h in hooks:
        h.remove()
    # transformers' loss upcasts the logits (ForCausalLMLoss: logits.float()) before cross-entropy: the log-softmax
    # output autograd keeps shows the dtype the loss really reads
    seen["logits as the loss reads them"] = ", ".join(sorted(saved.log_softmax_dtypes)) or "-"
    seen["loss"] = dtype_name(loss.dtype)
    phase = next((PHASES.get(lb, lb) for lb, _, pk in mt.timeline if pk >= mt.peak_bytes), "end of the step")
    state = state_bytes(model, optimizer)
    return {"precision": precision, "micro_batch": cfg.train.micro_batch_size, "weights": state["params"],
            "gradients": marks["gradient bytes"], "optimizer": state["optimizer"],
            "half_weight_copies": saved.get("half weight copy"), "activations_fp32": saved.get("activation fp32"),
            "activations_half": saved.get("activation half"),
            "forward_leaves": marks["after forward"] - marks["step start"], "peak": mt.peak_bytes,
            "peak_phase": phase, "dtypes": seen, "n_params": sum(p.numel() for p in model.parameters()),
            "matmul_weight_numel": sum(p.numel() for n, p in model.named_parameters()
                                       if p.dim() == 2 and "wpe" not in n)}


def memory_breakdown_rows(mem: dict) -> list[dict]:
    """One row (bytes) per measurement of :func:`measure_step_memory` (``mem``: {key: result})."""
    return [{"precision": m["precision"], "micro_batch": m["micro_batch"], "weights_bytes": m["weights"],
             "gradients_bytes": m["gradients"], "optimizer_bytes": m["optimizer"],
             "saved_activations_bytes": m["activations_fp32"] + m["activations_half"],
             "half_weight_copies_bytes": m["half_weight_copies"], "forward_leaves_bytes": m["forward_leaves"],
             "peak_bytes": m["peak"], "peak_phase": m["peak_phase"]} for m in mem.values()]


def dtype_rows(mem: dict) -> list[dict]:
    """One row per part of the training state (weights ... loss), one column per measurement: its dtype."""
    return [{"tensor": k, **{m["precision"]: m["dtypes"].get(k, "-") for m in mem.values()}}
            for k in ("weights", "gradients", "optimizer state", "matmul output", "logits (lm_head output)",
                      "logits as the loss reads them", "loss")]


def plot_memory_breakdown(mem: dict, title: str):
    """A stacked bar per measurement (state, weight copies, activations; dtypes in the legend), its peak and phase."""
    import matplotlib.pyplot as plt

    d = lambda k: "/".join(sorted({m["dtypes"].get(k, "-") for m in mem.values()}))  # noqa: E731
    parts = [(f"weights ({d('weights')})", "weights", "#34495e"),
             (f"optimizer state ({d('optimizer state')})", "optimizer", "#7f8c8d"),
             (f"gradients ({d('gradients')})", "gradients", "#95a5a6"),
             ("half-precision weight copies", "half_weight_copies", "#f39c12"),
             ("saved activations, FP32", "activations_fp32", "#3498db"),
             ("saved activations, half", "activations_half", "#e74c3c")]
    ms = list(mem.values())
    unit, size = byte_unit(m["peak"] for m in ms)
    labels = [f"{m['precision']}\nmicro-batch {m['micro_batch']}" for m in ms]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(ms)
    for name, key, color in parts:
        vals = [m[key] / size for m in ms]
        ax.bar(labels, vals, bottom=bottom, label=name, color=color, width=0.5)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, m in enumerate(ms):
        ax.hlines(m["peak"] / size, i - 0.3, i + 0.3, color="black", lw=2.5, zorder=3,
                  label="measured peak" if i == 0 else None)
        ax.text(i, max(bottom[i], m["peak"] / size), f"peak in\n{m['peak_phase']}", ha="center", va="bottom",
                fontsize=8)
    ax.set(ylim=(0, 1.2 * max(bottom + [m["peak"] / size for m in ms])), ylabel=f"memory [{unit}]", title=title)
    ax.legend(fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def memory_saving(base, r) -> float | None:
    """1 - peak / ``base``'s peak, None unless both ran: every saving lab 01 shows (sections 4, 5, 9 and C1)."""
    ok = r.ok and base.ok and r.peak_memory_bytes and base.peak_memory_bytes
    return 1 - r.peak_memory_bytes / base.peak_memory_bytes if ok else None


def batch_sweep(cfgs: dict, rows: dict, reuse: dict, device, amp: str, budget_bytes: int | None = None,
                steps: int = 12) -> tuple[dict, list[dict]]:
    """Each of ``rows`` ({label: overrides}) run by ``lu.run`` for ``steps`` steps (CPU: within ``budget_bytes``), or
    ``reuse``'s run at that micro-batch; ``reuse``'s pair is a point too: ({label: RunResult}, row per micro-batch)."""
    from ...verdicts import claims as cl
    from ...core.train import run

    kw = cpu_budget_kwargs(budget_bytes, device) if budget_bytes is not None else {}
    pair4 = {f"{p} x {r.config['train']['micro_batch_size']}": {"train.precision": p, "train.micro_batch_size":
            r.config["train"]["micro_batch_size"]} for p, r in reuse.items() if p in (BASELINE, amp)}
    results, by = {}, {}
    for label, ov in {**rows, **pair4}.items():
        p, b = ov["train.precision"], ov["train.micro_batch_size"]
        if p in reuse and reuse[p].config["train"]["micro_batch_size"] == b:
            results[label] = reuse[p]
        else:
            c = cfgs[p].override({**ov, "train.steps": steps,
                                  "train.timing_warmup_steps": min(cfgs[p].train.timing_warmup_steps, steps - 1)})
            results[label] = run(c, device, desc=label, verbose=False, **kw)
        by[p, b] = results[label]
    table = []
    for b in sorted({b for _, b in by}):
        r32, ra = by["fp32", b], by[amp, b]
        ok = r32.ok and ra.ok
        ratio = cl.run_pair_evidence(r32, ra, ("fp32", amp))[0] if ok else None
        table.append({"micro_batch": b, "fp32_status": r32.status, f"{amp}_status": ra.status,
                      "fp32_peak_bytes": r32.peak_memory_bytes if r32.ok else None,
                      f"{amp}_peak_bytes": ra.peak_memory_bytes if ra.ok else None,
                      "memory_saving": memory_saving(r32, ra), "section_4_pair": r32 is reuse.get(BASELINE),
                      "fp32_target_tokens_per_s": r32.target_tokens_per_second,
                      f"{amp}_target_tokens_per_s": ra.target_tokens_per_second,
                      "speedup_vs_fp32": 1 / ratio if ratio else None, "fp32_mfu": r32.mfu, f"{amp}_mfu": ra.mfu})
    return results, table


def plot_batch_sweep(rows: list[dict], amp: str, budget_bytes: int | None, timed_on: str, title: str):
    """Peak memory (OOM rows marked at the budget), the saving and the throughput against the micro-batch."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.8))
    unit, size = byte_unit([r[f"{p}_peak_bytes"] for r in rows for p in (BASELINE, amp)] + [budget_bytes])
    for p in (BASELINE, amp):
        ok = [r for r in rows if r[f"{p}_status"] == "ok"]
        oom = [r["micro_batch"] for r in rows if r[f"{p}_status"] == "oom"]
        axes[0].plot([r["micro_batch"] for r in ok], [r[f"{p}_peak_bytes"] / size for r in ok], "o-",
                     color=get(p).color, label=p)
        if oom and budget_bytes:  # x and + stay apart where both precisions ran out at one micro-batch
            axes[0].scatter(oom, [budget_bytes / size] * len(oom), marker="x" if p == BASELINE else "+", s=120,
                            color=get(p).color, label=f"{p}: out of memory")
        axes[2].plot([r["micro_batch"] for r in ok], [r[f"{p}_target_tokens_per_s"] for r in ok], "o-",
                     color=get(p).color, label=p)
    if budget_bytes:
        axes[0].axhline(budget_bytes / size, color="red", ls=":", label="memory budget")
    both = [r for r in rows if r["memory_saving"] is not None]
    axes[1].plot([r["micro_batch"] for r in both], [100 * r["memory_saving"] for r in both], "o-", color=get(amp).color)
    axes[1].axhline(50, color="gray", ls=":", label='"halves memory"')
    axes[0].set(title="Peak memory vs batch", ylabel=f"peak memory [{unit}]")
    axes[1].set(title=f"Peak memory saved by {amp} vs FP32", ylabel="saving [%]")
    axes[2].set(title=f"Throughput vs batch ({timed_on})", ylabel="target tokens / s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["micro_batch"] for r in rows], [str(r["micro_batch"]) for r in rows])
        ax.set_xlabel("micro-batch [sequences]")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def sweep_sentence(rows: list[dict], amp: str, mem: dict) -> str:
    """The sweep in a sentence: the saving per micro-batch, what the smallest one's FP32 peak holds (``mem``), OOMs."""
    saved = [r for r in rows if r["memory_saving"] is not None]
    text = f"{amp} saves " + ", ".join(f"{r['memory_saving']:.0%} at micro-batch {r['micro_batch']}"
                                       + (" (section 4's runs)" if r.get("section_4_pair") else "") for r in saved)
    small = min((m for m in mem.values() if m["precision"] == BASELINE), key=lambda m: m["micro_batch"], default=None)
    if small is not None:
        state = (small["weights"] + small["gradients"] + small["optimizer"]) / small["peak"]
        acts = (small["activations_fp32"] + small["activations_half"]) / small["peak"]
        opt = small["peak_phase"] == "optimizer step"
        text += (f"; at micro-batch {small['micro_batch']} the FP32 step peaks in its {small['peak_phase']}"
                 + (f", after backward freed the saved activations ({acts:.0%} of the peak)" if opt else "")
                 + f": model state, which autocast does not shrink, is {state:.0%} of that peak"
                 + ("" if opt else f", the saved activations {acts:.0%}"))
    oom = [f"{r['micro_batch']} ({', '.join(p for p in ('fp32', amp) if r[f'{p}_status'] == 'oom')})" for r in rows
           if "oom" in (r["fp32_status"], r[f"{amp}_status"])]
    return text + (f"; out of memory at micro-batch {', '.join(oom)}" if oom else "") + "."
