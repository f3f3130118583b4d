"""Lab 01 helpers, what mixed precision saves: where one training step's memory goes (what autograd saves under
autocast, the dtypes of the training state), matmul throughput per dtype, the comparison table and figure of
the four precisions, what the speed-ups say (Amdahl, MFU), and the README's expectations and claims C1/C2.
One training step op by op (:func:`op_profile` on a ``torch.profiler`` profile): matmul-like ops against the
memory-bound rest, and what that says (:func:`profile_readings`); lab 04's slowest ops of a step before and after a
fix of the same maths (:func:`slowest_op_rows`, :func:`step_time_rows`, :func:`slow_op_readings`).

The training step measured here is the notebook's own written-out ``amp_step``, passed in. The numerics
(formats, underflow, overflow, loss scaling) are in :mod:`labutils.precision`.
``import labutils.amp_speed_memory as am``.
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field, replace

import torch

from . import claims as cl
from .env import matmul_precision, seed_everything
from .figures import step_axis, step_numbers
from .memory import MemoryTracker, fmt_bytes, state_bytes
from .peaks import peak_info
from .precision import AMP_DTYPES, COLORS, DTYPE_NAMES

HALF_DTYPES = (torch.float16, torch.bfloat16)
PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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

    def pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = st.data_ptr()
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
    """``with saved_tensor_census(model) as census: loss = model(...)`` then ``census.by_kind``."""
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
             model.lm_head.register_forward_hook(record_dtype("logits"))]

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
    """One row (GiB) per precision of :func:`measure_step_memory`'s results ``{precision: result}``."""
    G = 2**30
    return [{"precision": p, "weights_gib": m["weights"] / G, "gradients_gib": m["gradients"] / G,
             "optimizer_gib": m["optimizer"] / G,
             "saved_activations_gib": (m["activations_fp32"] + m["activations_half"]) / G,
             "half_weight_copies_gib": m["half_weight_copies"] / G, "forward_adds_gib": m["forward_adds"] / G,
             "model_state_gib": (m["weights"] + m["gradients"] + m["optimizer"]) / G, "peak_gib": m["peak"] / G,
             # model state during the step = weights + gradients + AdamW state: what autocast does not shrink
             "peak_minus_model_state_gib": (m["peak"] - m["weights"] - m["gradients"] - m["optimizer"]) / G}
            for p, m in mem.items()]


def dtype_rows(mem: dict) -> list[dict]:
    """One row per part of the training state (weights ... loss), one column per precision: its dtype."""
    return [{"tensor": k, **{p: m["dtypes"].get(k, "-") for p, m in mem.items()}}
            for k in ("weights", "gradients", "optimizer state", "matmul output", "logits", "loss")]


# --------------------------------------------------------------------------------------------- matmul speed
def matmul_tflops(m: int, k: int, n: int, precision: str, device: torch.device, min_run_time: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul in ``precision`` (tf32: FP32 tensors, TF32 math).

    Timed with ``torch.utils.benchmark`` (which synchronises CUDA); inputs are freed on return."""
    from torch.utils import benchmark

    dtype = PRECISION_DTYPES[precision]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    with matmul_precision(tf32=precision == "tf32"):
        t = benchmark.Timer("a @ b", globals={"a": a, "b": b}).blocked_autorange(min_run_time=min_run_time)
    del a, b
    return 2 * m * k * n / t.median / 1e12


def speedup_readings(runs: dict, big: dict, small: dict, precisions: list, baseline: str = "fp32") -> list[str]:
    """What each precision's matmul speed-up (``big``/``small``: rows of the matmul table) says about the whole
    training step's speed-up: no fast path, Amdahl's share of matmul work, or a step that is not matmul-bound."""
    base = runs[baseline]
    lines = [f"{p} matmul vs fp32: {big[f'{p}_tflops'] / big['fp32_tflops']:.2f}x at '{big['matmul']}', "
             f"{small[f'{p}_tflops'] / small['fp32_tflops']:.2f}x at '{small['matmul']}'" for p in precisions[1:]]
    for p in ("tf32", "fp16", "bf16"):
        r = runs[p]
        if not (r.ok and base.ok and p in precisions):
            continue
        model_x = base.step_time_seconds / r.step_time_seconds
        mm_x = big[f"{p}_tflops"] / big["fp32_tflops"]
        line = f"{p}: whole training step at {model_x:.2f}x FP32 speed, its largest matmul at {mm_x:.2f}x"
        if mm_x <= 1:
            line += " -> this device has no fast path for this precision: nothing to gain (or a loss)"
        elif model_x > 1 and mm_x > model_x:
            share = (1 - 1 / model_x) / (1 - 1 / mm_x)  # Amdahl: S = 1 / ((1 - f) + f / X)  =>  f
            line += f" -> as if about {share:.0%} of the FP32 step time were matmul work that sped up (Amdahl)"
        elif model_x <= 1:
            line += " -> the faster matmuls did not make the step faster: the step is not matmul-bound here"
        lines.append(line)
    return lines


def mfu_readings(points: list, amp: str, hardware: str, gpu_name: str | None) -> list[str]:
    """What the MFU of the ``amp`` runs ``[(micro_batch, result), ...]`` (smallest batch first) says: whether the
    small micro-batch leaves the card idle (launch-bound); or why no MFU was computed."""
    if not points:
        return [(f"MFU not computed: {peak_info(gpu_name, amp)[1]}. On a GPU in labutils' peak table this "
                 f"line prints the MFU of each micro-batch (model FLOPs per second / the card's dense {amp} peak): "
                 f"whether the small micro-batch leaves the card idle (launch-bound) next to a busy one. Smoke mode "
                 f"cannot: a CPU has no tensor-core peak, and the tiny model's FLOP rates say nothing about a GPU.")]
    (b_lo, r_lo), (b_hi, r_hi) = points[0], points[-1]
    lines = [f"{amp} MFU on {hardware} (dense {amp} peak {r_hi.peak_tflops:g} TFLOP/s, "
             f"{peak_info(hardware, amp)[1]}): " + ", ".join(f"micro-batch {b}: {r.mfu:.1%}" for b, r in points)]
    if len(points) > 1 and r_hi.mfu > 1.5 * r_lo.mfu:
        lines.append(f"micro-batch {b_lo} keeps the card {r_lo.mfu:.1%} busy, micro-batch {b_hi} {r_hi.mfu:.1%} "
                     f"({r_hi.mfu / r_lo.mfu:.1f}x): the small batch is launch-bound, the big one feeds the tensor "
                     f"cores.")
    elif len(points) > 1:
        lines.append(f"MFU hardly changes with the batch here ({r_lo.mfu:.1%} -> {r_hi.mfu:.1%}): even micro-batch "
                     f"{b_lo} keeps this card as busy as the larger ones, or none of them is matmul-bound.")
    return lines


# --------------------------------------------------------------------------------------------- one step, op by op
# How the profile of a training step is grouped (op_group): matmul-like ops run on tensor cores in half precision;
# every other ATen op that touches data is bound by memory traffic (elementwise, reductions, norms, softmax,
# dropout, the optimizer's update), the casts and copies autocast adds among them; views, allocation and the
# framework's own events (autograd nodes, optimizer ranges) move no data.
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm", "aten::mv", "aten::addmv", "aten::dot"}
MATMUL_PREFIXES = ("aten::_scaled_dot_product_", "aten::scaled_dot_product_attention", "aten::_flash_attention",
                   "aten::_efficient_attention", "aten::_cudnn_attention")
CAST_OPS = {"aten::_to_copy", "aten::copy_", "aten::to", "aten::clone", "aten::contiguous"}
NO_DATA_OPS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose",
               "aten::permute", "aten::expand", "aten::expand_as", "aten::as_strided", "aten::slice", "aten::select",
               "aten::unsqueeze", "aten::squeeze", "aten::split", "aten::split_with_sizes", "aten::chunk",
               "aten::unbind", "aten::narrow", "aten::alias", "aten::detach", "aten::detach_", "aten::empty",
               "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
               "aten::lift_fresh", "aten::view_as", "aten::flatten", "aten::unflatten", "aten::numpy_T",
               "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::result_type"}
MATMUL, ELEMENTWISE, CASTS, OTHER = ("matmul", "elementwise / reductions", "casts / copies",
                                     "other (views, allocation, framework)")
OP_GROUPS = (MATMUL, ELEMENTWISE, CASTS, OTHER)
MEMORY_BOUND = (ELEMENTWISE, CASTS)
_FLOAT_INPUTS = {"float": "fp32", "c10::Half": "fp16", "c10::BFloat16": "bf16"}


def op_group(name: str) -> str:
    """The group of a profiler event's name (see the comment above): one of :data:`OP_GROUPS`."""
    if name in MATMUL_OPS or name.startswith(MATMUL_PREFIXES):
        return MATMUL
    if name in CAST_OPS:
        return CASTS
    if name in NO_DATA_OPS or not name.startswith("aten::"):
        return OTHER
    return ELEMENTWISE


def _input_dtype(e) -> str | None:
    """fp32 / fp16 / bf16: the dtype of an event's first floating-point tensor input (needs record_shapes=True)."""
    for d in getattr(e, "input_dtypes", None) or []:
        if d in _FLOAT_INPUTS:
            return _FLOAT_INPUTS[d]
    return None


@dataclass
class OpProfile:
    """One profile of ``steps`` training steps, op by op. ``basis``: what the times are (GPU kernel time when the
    profile has GPU activity, else CPU time); ``ops``: one row per operator name, times per step in ms."""
    basis: str
    on_gpu: bool
    steps: int
    ops: list

    def group_ms(self, group: str) -> float:
        return sum(r["ms"] for r in self.ops if r["group"] == group)

    @property
    def total_ms(self) -> float:
        return sum(r["ms"] for r in self.ops)


def op_profile(events, steps: int = 1) -> OpProfile:
    """Per operator of a ``torch.profiler`` profile (``prof.events()``, recorded with ``record_shapes=True``): its
    group, calls per step, self time per step (each op's own time without its children, so nothing counts twice:
    on a GPU the self *device* time of the kernels it launched, on any thread, as
    :func:`labutils.profiling.range_times` reads it; else self CPU time), and how much of that time had an FP32
    first input outside the optimizer step (``fp32_input_ms``: what autocast left in FP32)."""
    from torch.autograd import DeviceType

    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    on_gpu = any(e.device_type != DeviceType.CPU for e in events)
    optim = [(e.time_range.start, e.time_range.end) for e in cpu_ops if e.name.startswith("Optimizer.step#")]
    rows: dict[str, dict] = {}
    for e in cpu_ops:
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        r = rows.setdefault(e.name, {"op": e.name, "group": op_group(e.name), "calls": 0, "ms": 0.0,
                                     "fp32_input_ms": 0.0, "optimizer_ms": 0.0, "dtypes": set()})
        r["calls"] += 1
        r["dtypes"].add(_input_dtype(e) or "-")
        r["ms"] += us / 1e3
        if any(a <= e.time_range.start and e.time_range.end <= b for a, b in optim):
            r["optimizer_ms"] += us / 1e3
        elif _input_dtype(e) == "fp32":
            r["fp32_input_ms"] += us / 1e3
    for r in rows.values():
        r["dtypes"] = ", ".join(sorted(r["dtypes"] - {"-"})) or "-"  # every first float input dtype it was called with
        r["calls"] /= steps
        for k in ("ms", "fp32_input_ms", "optimizer_ms"):
            r[k] /= steps
    ops = sorted(rows.values(), key=lambda r: -r["ms"])
    return OpProfile("GPU kernel time" if on_gpu else "CPU time", on_gpu, steps, ops)


def op_group_rows(profiles: dict, baseline: str = "fp32") -> list[dict]:
    """One row per op group (then memory-bound = elementwise + casts, then all ops): time per step in each
    profile of ``profiles`` ``{precision: OpProfile}``, its share of that profile's total, and the speed-up of each
    non-baseline precision (baseline time / its time)."""
    base = profiles[baseline]
    groups = [(g, (g,)) for g in OP_GROUPS] + [("memory-bound (elementwise + casts)", MEMORY_BOUND),
                                               ("all ops", OP_GROUPS)]
    rows = []
    for label, members in groups:
        row = {"group": label}
        for p, prof in profiles.items():
            ms = sum(prof.group_ms(g) for g in members)
            row[f"{p}_ms"] = ms
            row[f"{p}_share"] = ms / prof.total_ms if prof.total_ms else None
        for p in profiles:
            if p != baseline:
                b, x = row[f"{baseline}_ms"], row[f"{p}_ms"]
                row[f"speedup_{p}"] = b / x if b > 0 and x > 0 else None
        row["calls"] = ", ".join(f"{p}: {sum(r['calls'] for r in prof.ops if r['group'] in members):.0f}"
                                 for p, prof in profiles.items())
        rows.append(row)
    return rows


def top_op_rows(profile: OpProfile, n: int = 5) -> list[dict]:
    """The ``n`` operators with the most self time per step: group, calls, time, share of the step's op time,
    the dtypes of their first floating-point input, and the time spent with FP32 inputs outside the optimizer
    step."""
    return [{"rank": i, "op": r["op"], "group": r["group"], "calls": r["calls"], "ms": r["ms"],
             "share": r["ms"] / profile.total_ms if profile.total_ms else None,
             "input_dtypes": r.get("dtypes", "-"), "fp32_input_ms": r["fp32_input_ms"]}
            for i, r in enumerate(profile.ops[:n], start=1)]


def profile_readings(profiles: dict, amp: str, activation: str, baseline: str = "fp32") -> list[str]:
    """What the op-group profile of ``baseline`` and ``amp`` says, every number from the profiles: the matmul
    group's speed-up next to the memory-bound ops', the casts autocast added, and the memory-bound work that still
    ran with FP32 inputs under autocast. On a GPU it states the lesson the signs allow; from a CPU profile it says
    what the CPU measured and draws no GPU conclusion (a CPU has no tensor cores)."""
    b, a = profiles[baseline], profiles[amp]
    mm_b, mm_a = b.group_ms(MATMUL), a.group_ms(MATMUL)
    mem_b, mem_a = (sum(p.group_ms(g) for g in MEMORY_BOUND) for p in (b, a))
    mm_x = mm_b / mm_a if mm_a > 0 else None
    mem_x = mem_b / mem_a if mem_a > 0 else None
    fmt_x = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    casts = {p: sum(r["calls"] for r in prof.ops if r["op"] == "aten::_to_copy") for p, prof in ((baseline, b), (amp, a))}
    fp32_ops = sorted((r for r in a.ops if r["group"] in MEMORY_BOUND and r["fp32_input_ms"] > 0),
                      key=lambda r: -r["fp32_input_ms"])
    fp32_ms = sum(r["fp32_input_ms"] for r in fp32_ops)
    by_name = {r["op"]: r for r in b.ops}
    lines = [
        f"{a.basis} per training step, {baseline} -> {amp}: matmul ops {mm_b:.2f} -> {mm_a:.2f} ms ({fmt_x(mm_x)}), "
        f"memory-bound ops (elementwise, reductions, casts) {mem_b:.2f} -> {mem_a:.2f} ms ({fmt_x(mem_x)}); "
        f"matmuls were {mm_b / b.total_ms:.0%} of the {baseline} op time and {mm_a / a.total_ms:.0%} of the "
        f"{amp} op time.",
        f"casts (aten::_to_copy) per step: {casts[baseline]:.0f} in {baseline}, {casts[amp]:.0f} under {amp} autocast "
        f"({a.group_ms(CASTS):.2f} ms of casts and copies vs {b.group_ms(CASTS):.2f} ms).",
        f"MLP activation of this run: model.config.activation_function = '{activation}'. Under {amp} autocast "
        f"{fp32_ms:.2f} ms per step of memory-bound forward/backward work still read FP32 inputs"
        + (": " + ", ".join(f"{r['op']} {r['fp32_input_ms']:.2f} ms"
                            + (f" (op speed-up {by_name[r['op']]['ms'] / r['ms']:.2f}x)"
                               if by_name.get(r["op"], {}).get("ms", 0) >= 0.01 else " (next to nothing in fp32)")
                            for r in fp32_ops[:4]) if fp32_ops else "") + "."]
    if not a.on_gpu:
        lines.append(f"these are CPU times: on this CPU the matmuls ran at {fmt_x(mm_x)} and the memory-bound ops at "
                     f"{fmt_x(mem_x)} their {baseline} speed. A CPU has no tensor cores and its own memory system, so "
                     f"this profile says nothing about how the same step runs on a GPU: no GPU conclusion is drawn. "
                     f"On a GPU this cell reads the tensor-core lesson from the GPU kernel times.")
        return lines
    if mm_x is None or mem_x is None:
        lines.append("a group is empty in one of the profiles: no reading.")
    elif mm_x > 1 and mm_x > mem_x:
        lines.append(f"the matmuls sped up {mm_x:.2f}x, the memory-bound ops {mem_x:.2f}x: tensor cores make the "
                     f"half-precision matmuls faster, while an elementwise op is bound by the bytes it moves, which "
                     f"half precision at best halves (2x)" + (", and the ops that autocast kept in FP32 move as many "
                     f"bytes as before plus the casts around them" if fp32_ms > 0 else "") + ".")
        lines.append(f"so the memory-bound ops grow from {mem_b / b.total_ms:.0%} of the {baseline} step's GPU time "
                     f"to {mem_a / a.total_ms:.0%} of the {amp} step's: after AMP they are what is left to speed up "
                     f"(fused kernels, torch.compile), not the matmuls.")
        if mem_x > 2.05:
            lines.append(f"the memory-bound ops gained more than the 2x that halving their bytes allows "
                         f"({mem_x:.2f}x): fewer or different kernels ran, or the profile is noisy.")
    else:
        lines.append(f"on this GPU the matmuls did not speed up more than the rest ({fmt_x(mm_x)} vs {fmt_x(mem_x)}): "
                     f"no fast half-precision path, or matmuls this small leave the card idle (launch-bound); this run "
                     f"does not show the tensor-core lesson.")
    return lines


# --------------------------------------------------------------------------------------------- the slowest ops, a fix
# Where a profile of HF GPT-2's published maths is expected to spend its time on a GPU (lab 04), by op name: the
# pieces of gelu_new (its pow is on CUDA autocast's FP32 list, so the 4d-wide activation runs in FP32), the casts
# (the loss's FP32 copy of the logits among them) and the FP32 log-softmax of the logits. Only names are listed
# here; whether they top a table is read from the profile.
SUSPECTS = {"gelu_new's pieces": ("aten::pow", "aten::tanh", "aten::tanh_backward"),
            "casts / copies (the FP32 logits copy among them)": ("aten::_to_copy", "aten::copy_"),
            "the logits' log_softmax": ("aten::_log_softmax", "aten::_log_softmax_backward_data")}


def aten_ops(profile: OpProfile) -> list[dict]:
    """The profile's ATen operators, slowest first: the ops that move data. Left out: ``record_function`` ranges
    (``forward``), autograd's nodes and the optimizer's range, whose self time is the Python and framework time
    between operators (on a GPU: none, their kernels belong to the ATen ops)."""
    return [r for r in profile.ops if r["op"].startswith("aten::")]


def slowest_op_rows(profiles: dict, n: int = 8) -> list[dict]:
    """The ``n`` slowest ATen ops (self time per step, :func:`aten_ops`) of each profile ``{label: OpProfile}``,
    side by side: one row per op in any of the top lists, in the first profile's order (then the others'), with
    its rank, time, share of the step's op time and input dtypes in every profile (None / "-": that profile never
    ran the op)."""
    names: list[str] = []
    for prof in profiles.values():
        names += [r["op"] for r in aten_ops(prof)[:n] if r["op"] not in names]
    rows = []
    for name in names:
        row = {"op": name, "group": op_group(name)}
        for label, prof in profiles.items():
            ops = aten_ops(prof)
            rank = next((i for i, r in enumerate(ops, start=1) if r["op"] == name), None)
            r = ops[rank - 1] if rank else None
            row.update({f"{label}_rank": rank, f"{label}_ms": r["ms"] if r else None,
                        f"{label}_share": r["ms"] / prof.total_ms if r and prof.total_ms else None,
                        f"{label}_dtypes": r.get("dtypes", "-") if r else "-"})
        rows.append(row)
    return rows


def step_time_rows(times: dict, baseline: str = "before") -> list[dict]:
    """One row per run ``{label: [seconds per timed step]}``: median step time, its noise (+- half the
    inter-quartile range, relative), the timed steps, and the speed-up over ``baseline`` with its noise
    (:func:`labutils.claims.timed_ratio`)."""
    rows = []
    for label, ts in times.items():
        t = cl.timed_ratio(times[baseline], ts)
        q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else None
        median = statistics.median(ts) if ts else None
        speedup = 1 / t["ratio"] if t["ratio"] else None
        rows.append({"run": label, "median_step_ms": median * 1e3 if median else None,
                     "noise_pct": 100 * (q[2] - q[0]) / 2 / median if q and median else None,
                     "timed_steps": len(ts),
                     f"speedup_vs_{baseline}": speedup,
                     "speedup_noise": t["spread"] / t["ratio"] ** 2 if t["spread"] is not None and t["ratio"] else None})
    return rows


def slow_op_readings(profiles: dict, times: dict, n: int = 8, before: str = "before", after: str = "after") -> list[str]:
    """What the ``before`` profile's slowest ops and the timed steps of both runs say, every number from them: the
    top ``n`` ops of ``before``, which of :data:`SUSPECTS` are among them, the gelu_new ops that the fix removed
    (calls per step, a count, true on any device), and the step time. On a GPU the speed-up of the fix, or "not
    decided" when its noise is as large as the effect; from a CPU profile what the CPU measured and no GPU
    conclusion (a CPU's kernels and memory system are not a GPU's)."""
    b, a = profiles[before], profiles[after]
    top = aten_ops(b)[:n]
    share = lambda r, p: f"{r['ms'] / p.total_ms:.0%}" if p.total_ms else "-"  # noqa: E731
    lines = [f"top {len(top)} ATen ops of the '{before}' step by self {b.basis}: "
             + ", ".join(f"{r['op']} {r['ms']:.2f} ms ({share(r, b)}, inputs {r.get('dtypes', '-')})" for r in top)
             + "."]
    in_top = {label: [r for r in top if r["op"] in ops] for label, ops in SUSPECTS.items()}
    lines.append("; ".join(
        (f"{label}: in the top {n} ("
         + ", ".join(f"{r['op']} #{top.index(r) + 1}, {r['fp32_input_ms']:.2f} of {r['ms']:.2f} ms with FP32 inputs"
                     for r in found) + ")") if found else f"{label}: not in the top {n}"
        for label, found in in_top.items()) + ".")
    calls = lambda p, op: sum(r["calls"] for r in p.ops if r["op"] == op)  # noqa: E731
    gelu = [(op, calls(b, op), calls(a, op)) for op in SUSPECTS["gelu_new's pieces"] if calls(b, op)]
    if gelu:
        lines.append("the fix removed gelu_new's separate ops: " + ", ".join(
            f"{op} {nb:.0f} -> {na:.0f} calls per step" for op, nb, na in gelu)
            + f"; aten::gelu {calls(b, 'aten::gelu'):.0f} -> {calls(a, 'aten::gelu'):.0f} calls (one kernel).")
    t = cl.timed_ratio(times[before], times[after])
    if t["ratio"] is None:
        return lines + ["no timed steps: no step time to compare."]
    x = 1 / t["ratio"]
    noise = t["spread"] / t["ratio"] ** 2 if t["spread"] is not None else None
    noise_txt = f"noise ±{100 * noise:.1f} %" if noise is not None else "noise unknown (fewer than 2 timed steps)"
    measured = (f"median step {t['median_a'] * 1e3:.2f} ms ({before}) -> {t['median_b'] * 1e3:.2f} ms ({after}) over "
                f"{t['timed_steps']} timed steps: {x:.2f}x, {noise_txt}")
    if not b.on_gpu:
        lines.append(f"the CPU measured: {measured}. These are CPU times: a CPU has neither tensor cores nor a GPU's "
                     f"memory system, and autocast's CPU op lists are not CUDA's, so this says nothing about the same "
                     f"step on a GPU: no GPU conclusion is drawn. On a GPU this line reports the fix's speed-up.")
        return lines
    if noise is None or noise >= abs(x - 1):
        lines.append(f"on this GPU: {measured}: the speed-up of the fix is not decided ({noise_txt}).")
    else:
        lines.append(f"on this GPU: {measured}: the fix made the step {x:.2f}x as fast "
                     + ("(faster)." if x > 1 else "(slower: the 'after' maths did not pay off here)."))
    return lines


# --------------------------------------------------------------------------------------------- the four runs
def skipped_result(cfg, reason: str, device=None):
    """A RunResult row for an experiment this machine cannot run, with the reason."""
    from .env import environment
    from .train import RunResult

    return RunResult(config=cfg.to_dict(), env=environment(device, cfg.mode), status="skipped", error=reason,
                     effective_batch_size=cfg.effective_batch_size)


def comparison_rows(runs: dict, baseline: str = "fp32") -> list[dict]:
    """One row per run: loss, time, throughput, TFLOP/s, peak memory, and speed-up/saving against ``baseline``."""
    base = runs.get(baseline)
    base_ok = base is not None and base.ok
    rows = []
    for label, r in runs.items():
        d = r.to_dict()
        ok = r.ok
        rows.append({
            "run": label, "status": r.status,
            "avg_loss": d["avg_loss"], "final_loss": d["final_loss"],
            # wall time of every step, warm-up included (the spec's "training time"); everything else below is
            # over the timed steps only (train.timing_warmup_steps left out): step_time_s and steps_per_s = 1 / it
            "time_all_steps_s": sum(r.step_times) if ok else None,
            "step_time_s": r.step_time_seconds if ok else None,
            "steps_per_s": 1 / r.step_time_seconds if ok else None,
            "target_tokens_per_s": r.target_tokens_per_second, "tflops": r.achieved_tflops,
            "peak_memory_gib": r.peak_memory_bytes / 2**30 if r.peak_memory_bytes else None,
            "speedup_vs_fp32": base.step_time_seconds / r.step_time_seconds if ok and base_ok else None,
            "memory_saving_vs_fp32": 1 - r.peak_memory_bytes / base.peak_memory_bytes
            if ok and base_ok and r.peak_memory_bytes and base.peak_memory_bytes else None,
            "skipped_steps": r.skipped_steps if ok else None,
            "note": r.error or "",
        })
    return rows


def plot_comparison(runs: dict, title: str):
    """The spec's 2x2 figure: training time, throughput, peak memory, loss curves. Skipped runs are labelled."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    fig.suptitle(title, fontsize=13, fontweight="bold")
    labels = list(runs)
    colors = [COLORS.get(k, "gray") for k in labels]
    panels = [
        (axes[0, 0], "Training time (all steps)", "time [s]", lambda r: sum(r.step_times)),
        (axes[0, 1], "Throughput (timed steps)", "target tokens / s", lambda r: r.target_tokens_per_second),
        (axes[1, 0], "Peak memory", "peak memory [GiB]", lambda r: r.peak_memory_bytes / 2**30),
    ]
    for ax, name, unit, get in panels:
        values = [get(runs[k]) if runs[k].ok else 0.0 for k in labels]
        bars = ax.bar(labels, values, color=colors)
        for bar, k in zip(bars, labels):
            if not runs[k].ok:
                ax.text(bar.get_x() + bar.get_width() / 2, 0, runs[k].status, ha="center", va="bottom",
                        rotation=90, fontsize=9, color="gray")
        ax.set_title(name)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[1, 1]
    for k in labels:
        if runs[k].ok:
            ax.plot(step_numbers(runs[k].losses), runs[k].losses, label=k, color=COLORS.get(k), lw=1.5)
    ax.set_title("Training loss")
    step_axis(ax)
    ax.set_ylabel("loss [nats / token]")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------- claims C1, C2
def speed_evidence(base, r, names: tuple[str, str]) -> tuple[float | None, cl.Evidence]:
    """The speed-up of run ``r`` over ``base`` (median step time over median step time) and its evidence: the
    pair compared, the hardware, the timed steps behind each and the noise (from their inter-quartile ranges)."""
    ratio, ev = cl.run_pair_evidence(base, r, names)
    if ratio is None:
        return None, ev
    return 1 / ratio, replace(ev, spread=None if ev.spread is None else ev.spread / ratio ** 2)


def readme_rows(runs: dict, expected: dict, baseline: str = "fp32") -> list[dict]:
    """The course README's expected (peak GB, speed vs FP32) per precision next to the measured ratios, with what
    the course's one rule (:mod:`labutils.claims`) makes of them at this one batch size: memory (C1) is "not
    judged" here (C1 is judged over the batch sweep), speed (C2) only on a GPU with enough timed steps."""
    base = runs[baseline]
    claimed_base = expected[baseline][0]
    rows = []
    for p, (gb, speed) in expected.items():
        r = runs[p]
        ok = r.ok and base.ok
        saving = 1 - r.peak_memory_bytes / base.peak_memory_bytes if ok else None
        speedup, ev = speed_evidence(base, r, (baseline, p)) if ok else (None, None)
        if not r.ok:
            verdict = f"not measured: {r.status} ({r.error})"
        elif p == baseline:
            verdict = "baseline"
        else:
            hw = cl.hardware(base.env)
            verdict = (f"memory: {cl.verdict('C1', {'memory_saving': saving}, cl.Evidence(sweep={0: saving}), hardware=hw)[0]} "
                       f"(one batch size; C1 is judged over the sweep); "
                       f"speed: {cl.verdict('C2', {'speedup': speedup}, ev)[0]}")
        rows.append({"precision": p, "README_peak_GB": gb,
                     "measured_peak_GB": r.peak_memory_bytes / 1e9 if r.ok else None,
                     "README_saving": 1 - gb / claimed_base, "measured_saving": saving,
                     "README_speedup": speed, "measured_speedup": speedup, "verdict": verdict})
    return rows


def c1_c2_claims(runs: dict, cond: dict, *, amp: str, model_state: int | None = None,
                 fp16_matmul_x: float | None = None, sweep_rows=()) -> list[dict]:
    """C1 (memory) and C2 (speed) as recorded claims.

    C1 is judged over the batch sweep (``sweep_rows``: ``amp`` against fp32 at each micro-batch; the value shown
    is the median saving, every point is judged), with the reason from the memory breakdown (``model_state``:
    weights + gradients + AdamW bytes). C2 is fp16 against fp32 at the config's batch: median step times over
    the timed steps, judged only on a GPU with enough timed steps (CPU fp16 is an emulation: the CPU ratio is
    shown, not judged), with the matmul table's fp16 speed-up (``fp16_matmul_x``) as the reason."""
    base, r16 = runs["fp32"], runs["fp16"]
    hw = cl.hardware(base.env)
    sweep_savings = {r["micro_batch"]: r["memory_saving"] for r in sweep_rows if r["memory_saving"] is not None}
    if sweep_savings:
        vals = sorted(sweep_savings.values())
        median = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
        mem_reason = (f"FP32 weights, gradients and AdamW state ({fmt_bytes(model_state)}) are "
                      f"{model_state / base.peak_memory_bytes:.0%} of the FP32 peak at micro-batch "
                      f"{base.config.get('train', {}).get('micro_batch_size')} and autocast does not shrink them"
                      if model_state is not None and base.ok else None)
        bs = sorted(sweep_savings)
        c1 = cl.claim_entry("C1", {"memory_saving": median}, cond, reason=mem_reason,
                            evidence=cl.Evidence(pair=(f"fp32 at micro-batch {bs}", f"{amp} at micro-batch {bs}"),
                                                 sweep=sweep_savings, note="value shown: the median over the sweep"),
                            extra={f"{amp}_saving_by_micro_batch": sweep_savings})
    else:
        c1 = cl.not_measured("C1", f"no micro-batch of the sweep ran in both fp32 and {amp}", cond)
    if not (r16.ok and base.ok):
        failed = r16 if not r16.ok else base
        why = f"the {'fp16' if failed is r16 else 'fp32'} run ended with status {failed.status} ({failed.error})"
        return [c1, cl.not_measured("C2", why, cond)]
    x16, ev = speed_evidence(base, r16, ("fp32", "fp16"))
    judged_here = cl.judge("C2", {"speedup": x16}, ev)[0] in cl.JUDGED
    speed_reason = (None if fp16_matmul_x is None or not judged_here else
                    f"this device's largest fp16 matmul runs at {fp16_matmul_x:.2f}x FP32"
                    + (" and the rest of the step speeds up less" if fp16_matmul_x > 1
                       else ": no fast half-precision path"))
    others = {p: speed_evidence(base, runs[p], ("fp32", p))[0] for p in ("tf32", "bf16") if p in runs and runs[p].ok}
    c2 = cl.claim_entry("C2", {"speedup": x16}, cond, reason=speed_reason, evidence=ev,
                        extra={f"speedup_on_{'cpu' if cl.on_cpu(hw) else 'gpu'}": {"fp16": x16, **others}})
    return [c1, c2]


__all__ = ["HALF_DTYPES", "PRECISION_DTYPES", "SavedTensorCensus", "saved_tensor_census", "dtype_report",
           "measure_step_memory", "memory_breakdown_rows", "dtype_rows", "matmul_tflops", "speedup_readings",
           "mfu_readings", "OP_GROUPS", "MEMORY_BOUND", "op_group", "OpProfile", "op_profile", "op_group_rows",
           "top_op_rows", "profile_readings", "SUSPECTS", "aten_ops", "slowest_op_rows", "step_time_rows", "slow_op_readings",
           "skipped_result", "comparison_rows", "plot_comparison", "readme_rows", "c1_c2_claims"]
