"""One training step op by op, from a ``torch.profiler`` profile: each ATen op's group (matmul-like against the
memory-bound rest), self time per step and input dtypes, the groups side by side (lab 01); the step times before and
after a fix (lab 04). Op time is the ops' self times under the profiler: a ratio of op times is not a step speed-up. """
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...verdicts import claims as cl
from ...core.figures import legend_outside
from ...core.precisions import dtype_name

# op_group: matmul-like ops run on tensor cores in half precision; every other ATen op that touches data (autocast's
# casts included) is bound by memory traffic; views, allocation and the framework's own events move no data.
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm", "aten::mv", "aten::addmv", "aten::dot"}
MATMUL_PREFIXES = ("aten::_scaled_dot_product_", "aten::scaled_dot_product_attention", "aten::_flash_attention",
                   "aten::_efficient_attention", "aten::_cudnn_attention")
CAST_OPS = {"aten::_to_copy", "aten::copy_", "aten::to", "aten::clone", "aten::contiguous"}
NO_DATA_OPS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::t",
               "aten::transpose", "aten::permute", "aten::expand", "aten::expand_as", "aten::as_strided", "aten::slice",
               "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::split", "aten::split_with_sizes",
               "aten::chunk", "aten::unbind", "aten::narrow", "aten::alias", "aten::detach", "aten::detach_",
               "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
               "aten::lift_fresh", "aten::view_as", "aten::flatten", "aten::unflatten", "aten::numpy_T", "aten::item",
               "aten::_local_scalar_dense", "aten::is_nonzero", "aten::result_type"}
MATMUL, ELEMENTWISE, CASTS, OTHER = ("matmul", "elementwise / reductions", "casts / copies",
                                     "other (views, allocation, framework)")
OP_GROUPS = (MATMUL, ELEMENTWISE, CASTS, OTHER)
MEMORY_BOUND = (ELEMENTWISE, CASTS)
GROUP_COLORS = {MATMUL: "#3498db", ELEMENTWISE: "#e67e22", CASTS: "#e74c3c", OTHER: "#bdc3c7"}
_FLOAT_INPUTS = {"float": torch.float32, "c10::Half": torch.float16, "c10::BFloat16": torch.bfloat16}  # profiler's


def op_group(name: str) -> str:
    """The group of a profiler event's name (see the comment above): one of :data:`OP_GROUPS`."""
    if name in MATMUL_OPS or name.startswith(MATMUL_PREFIXES):
        return MATMUL
    if name in CAST_OPS:
        return CASTS
    if name in NO_DATA_OPS or not name.startswith("aten::"):
        return OTHER
    return ELEMENTWISE


def _input_dtype(e, kineto: dict) -> str | None:
    """fp32 / fp16 / bf16: the dtype of an event's first floating-point tensor input (needs record_shapes=True)."""
    for d in getattr(e, "input_dtypes", None) or kineto.get(e.id) or []:
        if d in _FLOAT_INPUTS:
            return dtype_name(_FLOAT_INPUTS[d])
    return None


def _kineto_dtypes(prof) -> dict:
    """{correlation id: input dtypes} of a profile's CPU ops from its kineto events: before torch 2.12 only they carry
    the dtypes (``FunctionEvent.id`` is the kineto event's correlation id)."""
    from torch.autograd import DeviceType

    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return {}
    return {k.correlation_id(): list(k.dtypes()) for k in results.events() if k.device_type() == DeviceType.CPU}


@dataclass
class OpProfile:
    """One profile of ``steps`` training steps, op by op. ``basis``: what the times are (GPU kernel time when the
    profile has GPU activity, else CPU time); ``ops``: one row per operator name, times per step in ms."""
    basis: str
    on_gpu: bool
    steps: int
    ops: list
    dtypes_known: bool = True  # False: this torch gave no input dtypes (torch < 2.12 and only prof.events() passed)

    def group_ms(self, group: str) -> float:
        return sum(r["ms"] for r in self.ops if r["group"] == group)

    @property
    def total_ms(self) -> float:
        return sum(r["ms"] for r in self.ops)


def op_profile(prof, steps: int = 1) -> OpProfile:
    """Per operator of a ``torch.profiler`` profile (``record_shapes=True``): group, calls and self time per step (GPU:
    self device time, else self CPU time), and ``fp32_input_ms``: the part with an FP32 input outside the optimizer."""
    from torch.autograd import DeviceType

    events = prof.events() if callable(getattr(prof, "events", None)) else prof
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    kineto = {} if cpu_ops and hasattr(cpu_ops[0], "input_dtypes") else _kineto_dtypes(prof)  # torch >= 2.12: none
    dtypes_known = bool(kineto) or any(getattr(e, "input_dtypes", None) for e in cpu_ops)
    on_gpu = any(e.device_type != DeviceType.CPU for e in events)
    optim = [(e.time_range.start, e.time_range.end) for e in cpu_ops if e.name.startswith("Optimizer.step#")]
    rows: dict[str, dict] = {}
    for e in cpu_ops:
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        r = rows.setdefault(e.name, {"op": e.name, "group": op_group(e.name), "calls": 0, "ms": 0.0,
                                     "fp32_input_ms": 0.0, "optimizer_ms": 0.0, "dtypes": set()})
        r["calls"] += 1
        r["dtypes"].add(_input_dtype(e, kineto) or "-")
        r["ms"] += us / 1e3
        if any(a <= e.time_range.start and e.time_range.end <= b for a, b in optim):
            r["optimizer_ms"] += us / 1e3
        elif _input_dtype(e, kineto) == dtype_name(torch.float32):
            r["fp32_input_ms"] += us / 1e3
    for r in rows.values():
        r["dtypes"] = ", ".join(sorted(r["dtypes"] - {"-"})) or "-"  # every first float input dtype it was called with
        r["calls"] /= steps
        for k in ("ms", "fp32_input_ms", "optimizer_ms"):
            r[k] /= steps
    ops = sorted(rows.values(), key=lambda r: -r["ms"])
    return OpProfile("GPU kernel time" if on_gpu else "CPU time", on_gpu, steps, ops, dtypes_known)


def gpu_busy(profile: OpProfile, step_seconds: float | None) -> float | None:
    """The share of a training step that its GPU kernels fill: the profile's kernel time per step over the timed
    run's median step time (None on the CPU, or without a step time). Far below 1 the host sets the pace."""
    if not profile.on_gpu or not step_seconds:
        return None
    return profile.total_ms / 1e3 / step_seconds


def op_group_rows(profiles: dict, baseline: str = "fp32") -> list[dict]:
    """Per op group (then memory-bound, all ops) of ``profiles``: time, share, calls per step, op-time speed-ups."""
    rows = []
    for label, members in [(g, (g,)) for g in OP_GROUPS] + [("memory-bound (elementwise + casts)", MEMORY_BOUND),
                                                            ("all ops", OP_GROUPS)]:
        row = {"group": label}
        for p, prof in profiles.items():
            row[f"{p}_ms"] = sum(prof.group_ms(g) for g in members)
            row[f"{p}_share"] = row[f"{p}_ms"] / prof.total_ms if prof.total_ms else None
            row[f"{p}_calls"] = sum(r["calls"] for r in prof.ops if r["group"] in members)
        b = row[f"{baseline}_ms"]
        row.update({f"op_time_speedup_{p}": b / row[f"{p}_ms"] if b > 0 and row[f"{p}_ms"] > 0 else None
                    for p in profiles if p != baseline})
        rows.append(row)
    return rows


def top_op_rows(profile: OpProfile, n: int = 5) -> list[dict]:
    """The ``n`` ops with the most self time per step: group, calls, time, share, input dtypes, FP32-input time."""
    return [{"rank": i, "op": r["op"], "group": r["group"], "calls": r["calls"], "ms": r["ms"],
             "share": r["ms"] / profile.total_ms if profile.total_ms else None,
             "input_dtypes": r.get("dtypes", "-"), "fp32_input_ms": r["fp32_input_ms"]}
            for i, r in enumerate(profile.ops[:n], start=1)]


def plot_op_groups(profiles: dict, title: str):
    """One stacked bar per profile ``{precision: OpProfile}``: its op self time per step by op group."""
    import matplotlib.pyplot as plt

    labels = list(profiles)
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.6 * len(labels)))
    left = [0.0] * len(labels)
    for g in OP_GROUPS:
        ms = [profiles[p].group_ms(g) for p in labels]
        ax.barh(labels, ms, left=left, color=GROUP_COLORS[g], label=g, height=0.5)
        left = [a + b for a, b in zip(left, ms)]
    ax.invert_yaxis()
    ax.set(xlabel=f"{profiles[labels[0]].basis} per training step [ms], op self time under the profiler", title=title)
    ax.grid(axis="x", alpha=0.3)
    legend_outside(ax, fontsize=8)
    fig.tight_layout()
    return fig


def profile_reading(profiles: dict, amp: str, activation: str, baseline: str = "fp32") -> list[str]:
    """Two lines from the profiles: the op-time ratios ``baseline`` -> ``amp`` of matmuls and memory-bound ops, what
    still read FP32 inputs under ``amp``; then on a GPU the lesson the signs allow, from a CPU no GPU conclusion."""
    b, a = profiles[baseline], profiles[amp]
    mm = b.group_ms(MATMUL), a.group_ms(MATMUL)
    mem = tuple(sum(p.group_ms(g) for g in MEMORY_BOUND) for p in (b, a))
    ratio = {k: v[0] / v[1] if v[1] > 0 else None for k, v in (("mm", mm), ("mem", mem))}
    shown = {k: "-" if v is None else f"{v:.2f}x" for k, v in ratio.items()}
    fp32 = sorted((r for r in a.ops if r["group"] in MEMORY_BOUND and r["fp32_input_ms"] > 0),
                  key=lambda r: -r["fp32_input_ms"])
    first = (f"{a.basis} per step, {baseline} -> {amp}: matmul ops {mm[0]:.2f} -> {mm[1]:.2f} ms ({shown['mm']}), "
             f"memory-bound ops {mem[0]:.2f} -> {mem[1]:.2f} ms ({shown['mem']}); ")
    if a.dtypes_known:
        first += (f"under {amp} autocast {sum(r['fp32_input_ms'] for r in fp32):.2f} of those {mem[1]:.2f} ms still "
                  f"read FP32 inputs" + (": " + ", ".join(f"{r['op']} {r['fp32_input_ms']:.2f} of its {r['ms']:.2f} ms"
                                                          for r in fp32[:3]) if fp32 else "")
                  + f" (MLP activation '{activation}')")
    else:
        first += ("which ops still read FP32 inputs is not known: this profile has no input dtypes (pass the profile "
                  "itself to op_profile, recorded with record_shapes=True)")
    mm_x, mem_x = ratio["mm"], ratio["mem"]
    if not a.on_gpu:
        second = "these are CPU times (CPU timing, not a GPU result): no GPU conclusion is drawn from them."
    elif mm_x is not None and mem_x is not None and mm_x > 1 and mm_x > mem_x:
        second = (f"tensor cores make the matmuls {mm_x:.2f}x faster, the memory-bound ops only {mem_x:.2f}x (halving "
                  f"their bytes allows 2x at most): after AMP they are {mem[1] / a.total_ms:.0%} of the op time, "
                  f"what is left to speed up (fused kernels, torch.compile).")
    else:
        second = (f"on this GPU the matmuls did not speed up more than the rest ({shown['mm']} vs {shown['mem']}): no "
                  f"fast half-precision path, or launch-bound matmuls; this run does not show the tensor-core lesson.")
    return [first, second]


def step_time_rows(times: dict, baseline: str = "before") -> list[dict]:
    """Per run ``{label: [timed step seconds]}``: median step time, noise, steps, speed-up over ``baseline``, noise."""
    rows = []
    for label, ts in times.items():
        t = cl.timed_ratio(times[baseline], ts)
        median, noise = cl.median_spread(ts)
        rows.append({"run": label, "median_step_ms": median * 1e3 if median else None,
                     "noise_pct": 100 * noise if noise is not None else None, "timed_steps": len(ts),
                     f"speedup_vs_{baseline}": 1 / t["ratio"] if t["ratio"] else None,
                     "speedup_noise": (t["spread"] / t["ratio"] ** 2
                                       if t["spread"] is not None and t["ratio"] else None)})
    return rows
