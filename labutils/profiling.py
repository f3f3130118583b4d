"""Looking inside a training step (lab 04): what autograd saves per module, and allocator traces.

* :func:`saved_tensors_by_module` runs one forward pass under ``torch.autograd.graph.saved_tensors_hooks`` and
  attributes every tensor autograd saves for backward to the module that was running: the activations the
  estimator predicts, measured exactly, on CUDA and on CPU alike.
* :func:`trace_summary` reads the trace of a CUDA memory snapshot (``torch.cuda.memory._snapshot()`` after
  ``_record_memory_history``) and draws the same views as pytorch.org/memory_viz: allocated memory over time
  and who holds memory at the peak. :class:`CPUTraceRecorder` writes a trace in the same format on CPU (from
  the tensors operators create), so the same views run on a machine without a GPU (:func:`record_cpu_trace`).
* :func:`range_times` reads the ``record_function`` ranges of a ``torch.profiler`` profile;
  :func:`timed_steps` times training steps from an idle device to an idle device;
  :func:`cuda_memory_cap` makes the GPU behave like a smaller card.

Lab 04's figures are in :mod:`labutils.profiling_figures`, its experiments' rows in
:mod:`labutils.profiling_runs`.
"""
from __future__ import annotations

import contextlib
import gc
import re
import time
import warnings
from collections import defaultdict

import torch

from . import device as dev
from .memory import LiveStorages


# ----------------------------------------------------------------------------------------------------------
# What autograd saves, per module
# ----------------------------------------------------------------------------------------------------------
def _is_weight_copy(t: torch.Tensor) -> bool:
    """A cast of a parameter (autocast's cached half copy): ToCopyBackward whose input is a leaf."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
        fn = fn.next_functions[0][0] if fn.next_functions else None
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions[0][0] if fn.next_functions else None
    return nxt is not None and type(nxt).__name__ == "AccumulateGrad"


def saved_tensors_by_module(model: torch.nn.Module, batch: dict, autocast=None, depth: int = 3) -> list[dict]:
    """One forward pass (with the loss); returns, per module up to ``depth`` dots deep, the bytes of the
    tensors autograd saved for backward: ``activations`` and ``weight_copies`` (autocast's half weights).

    Storages are counted once (q, k, v are views of one tensor), parameters are not counted. The graph is
    dropped at the end, so nothing stays allocated."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, keep = ["(loss)"], set(), []
    rows: dict[str, dict] = {}
    handles = []

    def pre(mod, args):
        stack.append(mod._lab_profile_name)

    def post(mod, args, out):
        stack.pop()

    for name, mod in model.named_modules():
        if name and name.count(".") < depth:
            mod._lab_profile_name = name
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in seen and key not in params and st.nbytes() > 0:
            seen.add(key)
            r = rows.setdefault(stack[-1], {"module": stack[-1], "activations": 0, "weight_copies": 0,
                                            "tensors": 0})
            r["weight_copies" if _is_weight_copy(t) else "activations"] += st.nbytes()
            r["tensors"] += 1
        keep.append(st)  # the storage stays alive until we are done, so its address is not reused meanwhile
        # Return no tensor: returning ``t`` itself would tie an output to the node that saves it (a reference
        # cycle through C++ that the garbage collector cannot break: the whole graph would leak).
        return None

    def unpack(_):
        raise RuntimeError("saved_tensors_by_module() measures a forward pass; its graph cannot run backward")

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), (autocast or contextlib.nullcontext()):
            out = model(**batch, use_cache=False)
        del out
        keep.clear()
    finally:
        for h in handles:
            h.remove()
        for _, mod in model.named_modules():
            if hasattr(mod, "_lab_profile_name"):
                del mod._lab_profile_name
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(rows.values(), key=lambda r: order.get(r["module"], len(order)))


@contextlib.contextmanager
def cuda_memory_cap(gb: float | None):
    """Inside the block this GPU behaves like a ``gb``-GiB card: the allocator is capped at ``gb`` GiB minus the
    memory that lives outside it (CUDA context, libraries), never above a cap already set (``LAB_GPU_MEMORY_GB``
    or the user's own); the previous cap is restored exactly afterwards. Yields the allocator's cap in bytes,
    or None without CUDA (nothing to cap)."""
    if not gb or not dev.cuda_available():
        yield None
        return
    with dev.memory_cap(dev.card_allocator_bytes(gb)):
        yield dev.cap_bytes()


# ----------------------------------------------------------------------------------------------------------
# Allocator traces: CUDA snapshots and a CPU stand-in in the same format
# ----------------------------------------------------------------------------------------------------------
_BACKWARD_NODE = re.compile(r"(?:generated::|autograd::)(\w*Backward\w*)")
_INTERNAL = ("/torch/", "/site-packages/torch", "<frozen", "/tqdm/", "/contextlib.py", "/threading.py")


class PhaseMarks:
    """``mark = PhaseMarks(); ...; mark("after forward"); ...``: the phase of a training step that
    each later allocation belongs to, for :func:`trace_summary`'s ``phases=mark.phases``. With
    ``stacks="python"`` (lab 04's snapshot) backward allocates on autograd's own thread, with no Python frames;
    the phase names those allocations (forward / backward / optimizer step) instead of one "(no stack)" row.
    Each mark is a time marker in the trace's clock (``clock``, microseconds: a CUDA snapshot's ``time_us`` is
    Unix time, converted from the allocator's TSC clock in c10/cuda/CUDACachingAllocator.cpp). Not the
    allocator's ``_set_memory_metadata`` tag: torch documents it as thread-local, so autograd's thread never
    carries it. Stage names of :data:`CPU_TRACE_PHASES` become phase names."""

    def __init__(self, clock=None):
        self.clock = clock or (lambda: time.time_ns() / 1e3)
        self.phases: list[tuple[float, str]] = []

    def __call__(self, stage: str) -> None:
        label = CPU_TRACE_PHASES.get(stage, stage)
        self.phases.append((self.clock(), label))


def _phase_at(phases, t) -> str | None:
    """The label of the last phase marker at or before ``t`` (None before the first, or without markers)."""
    label = None
    for when, name in phases or ():
        if t is None or when > t:
            break
        label = name
    return label


def _site(frames: list[dict], phase: str | None = None) -> str:
    """Where an allocation came from: the innermost frame outside torch internals (model or lab code)."""
    def fmt(f, parts):
        where = "/".join(f.get("filename", "?").rsplit("/", parts)[-parts:])
        line = f":{f['line']}" if f.get("line") else ""
        return f"{where}{line} ({f.get('name', '?')})"

    for f in frames or []:
        fn = f.get("filename", "")
        if fn and not any(s in fn for s in _INTERNAL) and "::" not in f.get("name", ""):  # "::": a C++ frame
            return fmt(f, 2)
    # No Python frame of ours: backward runs on autograd's own thread, so its allocations have only C++ frames
    # (recorded with stacks="all"). The autograd node that allocated says what the memory is for.
    for f in frames or []:
        m = _BACKWARD_NODE.search(f.get("name", ""))
        if m:
            return f"backward: {m.group(1)}"
    if any("autograd" in f.get("name", "") for f in frames or []):
        return "backward (autograd engine)"
    # No frame at all, with stacks="python": on CUDA the autograd engine runs backward on its own thread,
    # which has no Python frames; the phase marker says which part of the step it was (PhaseMarks).
    if frames:
        return fmt(frames[0], 1)
    return f"{phase} (no Python frames)" if phase else "backward (autograd thread: no Python frames)"


def trace_summary(snapshot: dict, device: int = 0, start_bytes: int = 0, top: int = 10, phases=None) -> dict:
    """Allocated bytes over time and the largest holders at the peak, from a snapshot's trace.

    ``start_bytes``: what was allocated when recording started (the trace only sees later events).
    ``phases``: :class:`PhaseMarks`' markers; an allocation without Python frames is attributed to the phase it
    happened in, the last marker at or before its ``time_us``.
    Returns ``{"t": [...], "bytes": [...], "peak_bytes", "peak_index", "top_at_peak": [rows],
    "top_allocated": [rows], "events"}``."""
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[device] if device < len(traces) else []
    live: dict[int, tuple[int, str]] = {}
    cur = start_bytes
    ts, ys = [], []
    peak, peak_i, at_peak = cur, 0, {}
    allocated_by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    t0 = None
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            site = _site(e.get("frames"), _phase_at(phases, e.get("time_us")))
            live[e["addr"]] = (e["size"], site)
            cur += e["size"]
            allocated_by_site[site][0] += e["size"]
            allocated_by_site[site][1] += 1
        elif action == "free_completed" and e.get("addr") in live:
            cur -= live.pop(e["addr"])[0]
        else:
            continue
        t = e.get("time_us")
        if t is not None:
            t0 = t if t0 is None else t0
            ts.append((t - t0) / 1e3)
        else:
            ts.append(float(i))
        ys.append(cur)
        if cur > peak:
            peak, peak_i = cur, len(ys) - 1
            at_peak = dict(live)
    holders: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        holders[site][0] += size
        holders[site][1] += 1
    rank = lambda d: [{"site": s, "bytes": b, "count": n}  # noqa: E731
                      for s, (b, n) in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"t": ts, "bytes": ys, "time_unit": "ms" if t0 is not None else "event", "peak_bytes": peak,
            "peak_index": peak_i, "top_at_peak": rank(holders), "top_allocated": rank(allocated_by_site),
            "events": len(ys)}


class _RecordingStorages(LiveStorages):
    """The CPU tracker's storage counting, writing alloc/free_completed entries like the CUDA allocator."""

    def __init__(self, site_of):
        super().__init__()
        self.trace: list[dict] = []
        self.site_of = site_of
        self.t0 = time.perf_counter()
        self.op = "?"

    def _now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e6

    def add(self, t) -> None:
        n_before = len(self.live)
        super().add(t)
        if len(self.live) > n_before:
            st = t.untyped_storage()
            key = st.data_ptr()
            self.trace.append({"action": "alloc", "addr": key, "size": st.nbytes(), "time_us": self._now(),
                               "frames": [{"filename": self.site_of(), "line": 0, "name": self.op}]})

    def _forget(self, key: int) -> None:
        if key in self.live:
            self.trace.append({"action": "free_completed", "addr": key, "size": self.live[key],
                               "time_us": self._now(), "frames": []})
        super()._forget(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        return super().__torch_dispatch__(func, types, args, kwargs)


class CPUTraceRecorder:
    """``with CPUTraceRecorder(model) as rec: ...`` then ``rec.snapshot()``: a trace in the CUDA snapshot's
    format, built from the tensors CPU operators create (site = module running + operator). Tensors alive
    before the block are not in the trace (like ``_record_memory_history``); ``rec.start_bytes`` has them."""

    def __init__(self, model: torch.nn.Module | None = None, depth: int = 3):
        self.model, self.depth = model, depth
        self._stack = ["(outside modules)"]
        self._handles = []
        self.start_bytes = 0

    def _site(self) -> str:
        return self._stack[-1]

    def _pop(self, module, args, output) -> None:  # a forward hook must return None (or it replaces the output)
        self._stack.pop()

    def __enter__(self) -> "CPUTraceRecorder":
        if self.model is not None:
            for name, mod in self.model.named_modules():
                if name.count(".") < self.depth:
                    label = f"forward {name or type(mod).__name__}"
                    self._handles.append(mod.register_forward_pre_hook(
                        lambda m, a, _label=label: self._stack.append(_label)))
                    self._handles.append(mod.register_forward_hook(self._pop))
        gc.collect()
        self._mode = _RecordingStorages(self._site)
        with warnings.catch_warnings():  # gc also finds non-leaf tensors, whose .grad access warns
            warnings.simplefilter("ignore", UserWarning)
            self._mode.add_existing()
        self._mode.trace.clear()
        self.start_bytes = self._mode.current
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        # The storages' finalizers keep the recording mode alive until the storages die: it must not keep the
        # model (and so those very storages) alive in turn.
        self._mode.site_of = str
        self.model = None

    def mark(self, label: str) -> None:
        """Everything allocated from here on is attributed to ``label`` when no module is running."""
        self._stack[0] = label

    def snapshot(self) -> dict:
        return {"segments": [], "device_traces": [list(self._mode.trace)]}


# The phase an allocation belongs to when no module is running, after each mark of a training step
CPU_TRACE_PHASES = {"before forward": "forward (outside modules)", "after forward": "backward",
                    "after backward": "optimizer step", "after optimizer step": "zero_grad"}


def record_cpu_trace(model: torch.nn.Module, step, steps: int) -> tuple[dict, int]:
    """The CPU stand-in for a CUDA memory snapshot of ``steps`` training steps: ``step(mark)`` runs one step and
    calls ``mark(stage)`` after each stage. Says so in a printed line; returns ``(snapshot, start_bytes)`` for
    :func:`trace_summary`."""
    print("CPU: there is no CUDA allocator to record. On a GPU this cell writes memory_snapshot.pickle for "
          "pytorch.org/memory_viz; here labutils' CPU tracker writes the same kind of trace, with "
          "'module + operator' as the source instead of a file and line.")
    with CPUTraceRecorder(model) as rec:
        for _ in range(steps):
            step(lambda s: rec.mark(CPU_TRACE_PHASES.get(s, s)))
    return rec.snapshot(), rec.start_bytes


def operators_only(averages):
    """``prof.key_averages()`` without the ``record_function`` ranges (user annotations): they are spans, not
    operators. On a GPU a range's span on the device timeline counts as its self time, so on the first GPU run
    lab 04's "top operators" table was headed by ``forward`` at 570 % of the device time; :func:`range_times`
    reads the ranges instead."""
    from torch.autograd.profiler_util import EventList

    return EventList([e for e in averages if not getattr(e, "is_user_annotation", False)])


def range_times(events, names=("forward", "backward", "optimizer_step")) -> list[dict]:
    """One row per ``record_function`` range of a profile (``prof.events()``): calls and CPU time from the
    range's CPU-side event; device time = the kernels of every operator, on any thread, that ran inside the
    range's CPU interval (each operator's *self* device time, so nothing counts twice).

    Why not the profiler's own numbers: with CUDA activity each range is recorded twice (on the CPU and as a
    GPU user annotation), so ``key_averages()`` lists it twice; and both copies only see kernels launched from
    the range's own thread, while ``backward``'s kernels are launched by autograd's worker thread: they read ~0
    (kineto issue 1022). Without GPU activity in the profile the device time is None."""
    from torch.autograd import DeviceType

    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    has_gpu = any(e.device_type != DeviceType.CPU for e in events)
    rows = []
    for name in names:
        spans = [e for e in cpu_ops if e.name == name]
        if not spans:
            continue
        device_us = None
        if has_gpu:
            device_us = sum(op.self_device_time_total for op in cpu_ops for r in spans
                            if r.time_range.start <= op.time_range.start and op.time_range.end <= r.time_range.end)
        rows.append({"range": name, "calls": len(spans),
                     "cpu time (ms)": sum(e.time_range.elapsed_us() for e in spans) / 1e3,
                     "device time (ms)": device_us / 1e3 if device_us is not None else None})
    return rows


def timed_steps(step, n: int, device=None) -> list[float]:
    """Wall-clock seconds of each of ``n`` calls of ``step()``, timed from an idle device to an idle device
    (synchronised before and after on a GPU, so the kernels are timed and not only their launch)."""
    times = []
    for _ in range(n):
        dev.synchronize(device)
        t0 = time.perf_counter()
        step()
        dev.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times
