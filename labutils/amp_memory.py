"""Lab 01, where one training step's memory goes under mixed precision: what autograd saves for backward, by kind
(references to the FP32 weights, autocast's half-precision weight copies, FP32 and half activations:
:func:`saved_tensor_census`), the dtypes the training state is held in (:func:`dtype_report`), and one measured
step of the notebook's own ``amp_step`` (:func:`measure_step_memory`) with its tables.

The speed comparison of the precisions is in :mod:`labutils.amp_speed_memory`, the numerics (formats, underflow,
loss scaling) in :mod:`labutils.precision`. ``import labutils.amp_memory as amem`` (lab 01 reaches it as ``am.``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .env import matmul_precision, seed_everything
from .memory import MemoryTracker, state_bytes
from .precision import AMP_DTYPES, DTYPE_NAMES

HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------- saved tensors
_VIEW_FNS = {"TBackward0", "TransposeBackward0", "TransposeBackward1", "ViewBackward0", "UnsafeViewBackward0",
             "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "ReshapeAliasBackward0"}


def _skip_views(fn):
    """Follow single-input view/transpose nodes (F.linear saves ``weight.t()``, a view of the cast copy)."""
    for _ in range(8):
        if fn is None or type(fn).__name__ not in _VIEW_FNS:
            return fn
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return fn
        fn = nxt[0]
    return fn


def _is_weight_copy(t: torch.Tensor) -> bool:
    """True for autocast's cast of a parameter (or a view of it): a ``_to_copy`` of a leaf weight."""
    fn = _skip_views(t.grad_fn)
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(getattr(_skip_views(nf), "variable", None) is not None for nf, _ in fn.next_functions if nf is not None)


@dataclass
class SavedTensorCensus:
    """Bytes autograd saves for backward, by kind, each storage counted once.

    kinds: ``parameter`` (a reference to an FP32 weight: no new memory), ``half weight copy`` (autocast's
    FP16/BF16 cast of a weight, kept alive for backward), ``activation fp32`` and ``activation half``.
    """
    param_ptrs: set
    by_kind: dict = field(default_factory=dict)
    _seen: set = field(default_factory=set)
    log_softmax_dtypes: set = field(default_factory=set)  # dtypes of the log-softmax outputs autograd keeps: the
    #                                                       logits as the loss's cross-entropy reads them

    def pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = st.data_ptr()
        if t.grad_fn is not None and type(t.grad_fn).__name__ == "LogSoftmaxBackward0":
            self.log_softmax_dtypes.add(DTYPE_NAMES.get(t.dtype, str(t.dtype)))
        if key in self._seen or st.nbytes() == 0:
            return t
        self._seen.add(key)
        if key in self.param_ptrs:
            kind = "parameter"
        elif _is_weight_copy(t):
            kind = "half weight copy"
        elif t.dtype in HALF_DTYPES:
            kind = "activation half"
        else:
            kind = "activation fp32"
        self.by_kind[kind] = self.by_kind.get(kind, 0) + st.nbytes()
        return t

    def get(self, kind: str) -> int:
        return self.by_kind.get(kind, 0)

    @property
    def new_bytes(self) -> int:
        """Saved bytes that are new memory (everything except references to the weights)."""
        return sum(v for k, v in self.by_kind.items() if k != "parameter")


@contextlib.contextmanager
def saved_tensor_census(model: torch.nn.Module):
    """``with saved_tensor_census(model) as census: loss = model(...)`` then ``census.by_kind`` (and
    ``census.log_softmax_dtypes``: the dtype the loss's log-softmax ran in, from the output it keeps)."""
    census = SavedTensorCensus({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda t: t):
        yield census


def dtype_report(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The dtypes the training state is held in: weights, gradients, optimizer state (sets of names)."""
    name = lambda d: DTYPE_NAMES.get(d, str(d))
    out = {"weights": {name(p.dtype) for p in model.parameters()},
           "gradients": {name(p.grad.dtype) for p in model.parameters() if p.grad is not None}}
    if optimizer is not None:
        out["optimizer state"] = {name(v.dtype) for s in optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor) and v.dim() > 0}
    return {k: ", ".join(sorted(v)) or "-" for k, v in out.items()}


# --------------------------------------------------------------------------------------------- one step's memory
def measure_step_memory(cfg, precision: str, step_fn, device) -> dict:
    """Two training steps with ``step_fn`` (the notebook's ``amp_step``); the second one (AdamW state already
    allocated) is measured: weights, gradients, optimizer state, what autograd saves (activations FP32 / half,
    half weight copies), what the forward adds, the peak, and the dtype of each part of the training state.

    ``step_fn(model, window, optimizer, scaler, amp_dtype, max_grad_norm, mark)`` calls ``mark(label)`` after
    the forward, after the backward and after the optimizer step."""
    from .train import make_optimizer, prepare

    amp_dtype = AMP_DTYPES.get(precision)
    seed_everything(cfg.train.seed)
    loaded, dataset = prepare(cfg, device, verbose=False)
    model = loaded.model.train()
    optimizer, _ = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    windows = dataset.to(device).windows(cfg.train.micro_batch_size, cfg.train.accumulation_steps, cfg.train.seed)
    seen, marks = {}, {}

    def record_dtype(name):
        def hook(module, inputs, output):  # a forward hook must return None, or it replaces the output
            seen[name] = DTYPE_NAMES[output.dtype]
        return hook

    hooks = [model.transformer.h[0].attn.c_attn.register_forward_hook(record_dtype("matmul output")),
             model.lm_head.register_forward_hook(record_dtype("logits (lm_head output)"))]

    def mark(label):
        marks[label] = mt.mark(label)
        if label == "after backward":  # gradients exist only between backward and zero_grad
            marks["gradient bytes"] = state_bytes(model)["grads"]
            seen.update(dtype_report(model, optimizer))

    with matmul_precision(tf32=False):
        step_fn(model, next(windows), optimizer, scaler, amp_dtype, cfg.train.max_grad_norm)  # step 1: Adam state
        with MemoryTracker(device) as mt, saved_tensor_census(model) as saved:
            mark("step start")
            loss = step_fn(model, next(windows), optimizer, scaler, amp_dtype, cfg.train.max_grad_norm, mark)
    for h in hooks:
        h.remove()
    # the model's loss upcasts the logits (transformers' ForCausalLMLoss: logits.float()) before cross-entropy:
    # the log-softmax output autograd keeps for the loss's backward shows the dtype the loss really reads
    seen["logits as the loss reads them"] = ", ".join(sorted(saved.log_softmax_dtypes)) or "-"
    seen["loss"] = DTYPE_NAMES[loss.dtype]
    state = state_bytes(model, optimizer)
    return {"precision": precision, "weights": state["params"], "gradients": marks["gradient bytes"],
            "optimizer": state["optimizer"], "half_weight_copies": saved.get("half weight copy"),
            "activations_fp32": saved.get("activation fp32"), "activations_half": saved.get("activation half"),
            "forward_adds": marks["after forward"] - marks["step start"], "peak": mt.peak_bytes,
            "step_start": marks["step start"], "dtypes": seen,
            "n_params": sum(p.numel() for p in model.parameters()),
            "matmul_weight_numel": sum(p.numel() for n, p in model.named_parameters()
                                       if p.dim() == 2 and "wpe" not in n)}


def memory_breakdown_rows(mem: dict) -> list[dict]:
    """One row (bytes) per precision of :func:`measure_step_memory`'s results ``{precision: result}``."""
    return [{"precision": p, "weights_bytes": m["weights"], "gradients_bytes": m["gradients"],
             "optimizer_bytes": m["optimizer"],
             "saved_activations_bytes": m["activations_fp32"] + m["activations_half"],
             "half_weight_copies_bytes": m["half_weight_copies"], "forward_adds_bytes": m["forward_adds"],
             "model_state_bytes": m["weights"] + m["gradients"] + m["optimizer"], "peak_bytes": m["peak"],
             # model state during the step = weights + gradients + AdamW state: what autocast does not shrink
             "peak_minus_model_state_bytes": m["peak"] - m["weights"] - m["gradients"] - m["optimizer"]}
            for p, m in mem.items()]


def dtype_rows(mem: dict) -> list[dict]:
    """One row per part of the training state (weights ... loss), one column per precision: its dtype."""
    return [{"tensor": k, **{p: m["dtypes"].get(k, "-") for p, m in mem.items()}}
            for k in ("weights", "gradients", "optimizer state", "matmul output", "logits (lm_head output)",
                      "logits as the loss reads them", "loss")]


__all__ = ["HALF_DTYPES", "SavedTensorCensus", "saved_tensor_census", "dtype_report", "measure_step_memory",
           "memory_breakdown_rows", "dtype_rows"]
