"""Looking inside a training step (lab 04): what autograd saves per module, allocator traces (a CUDA snapshot's, or the
CPU stand-in in the same format) and their memory_viz views, ``torch.profiler`` operators and ranges, the slowest ops
before and after a fix (each op with its own noise), and a GPU capped to a smaller card. """
from __future__ import annotations

import contextlib
import gc
import re
import statistics
import time
import warnings
from collections import defaultdict

import torch

from ...core import device as dev
from ...core.memory import LiveStorages, is_weight_copy
from ..lab01.op_profile import op_group, op_profile

MiB = 2**20


def saved_tensors_by_module(model: torch.nn.Module, batch: dict, autocast=None, depth: int = 3) -> list[dict]:
    """One forward pass (with the loss); per module up to ``depth`` dots deep, the bytes autograd saved for backward:
    ``activations`` and ``weight_copies`` (autocast's half weights), each storage once, parameters not at all."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, keep, rows, handles = ["(loss)"], set(), [], {}, []
    for name, mod in model.named_modules():
        if name and name.count(".") < depth:
            handles += [mod.register_forward_pre_hook(lambda m, a, _n=name: stack.append(_n)),
                        mod.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.data_ptr() not in params and st.nbytes() > 0:
            seen.add(st.data_ptr())
            r = rows.setdefault(stack[-1], {"module": stack[-1], "activations": 0, "weight_copies": 0, "tensors": 0})
            r["weight_copies" if is_weight_copy(t) else "activations"] += st.nbytes()
            r["tensors"] += 1
        keep.append(st)  # alive until we are done, so its address is not reused meanwhile
        # no tensor returned: returning ``t`` would tie an output to the node saving it (a C++ reference cycle)
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
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(rows.values(), key=lambda r: order.get(r["module"], len(order)))


_BACKWARD_NODE = re.compile(r"(?:generated::|autograd::)(\w*Backward\w*)")
_INTERNAL = ("/torch/", "/site-packages/torch", "<frozen", "/tqdm/", "/contextlib.py", "/threading.py")
# The phase an allocation belongs to when no module is running, after each mark of a training step
CPU_TRACE_PHASES = {"before forward": "forward (outside modules)", "after forward": "backward",
                    "after backward": "optimizer step", "after optimizer step": "zero_grad"}


class PhaseMarks:
    """``mark("after forward")``: the phase of each later allocation (backward's have no Python frames), in the trace's
    clock (``time_us``), for :func:`trace_summary` (``phases=mark.phases``)."""

    def __init__(self, clock=None):
        self.clock = clock or (lambda: time.time_ns() / 1e3)
        self.phases: list[tuple[float, str]] = []

    def __call__(self, stage: str) -> None:
        self.phases.append((self.clock(), CPU_TRACE_PHASES.get(stage, stage)))


def _site(frames: list[dict], phase: str | None = None) -> str:
    """Where an allocation came from: the innermost frame outside torch internals (model or lab code); else the
    autograd node of a C++ stack (stacks="all"); else, without frames, the phase it happened in."""
    def fmt(f, parts):
        where = "/".join(f.get("filename", "?").rsplit("/", parts)[-parts:])
        line = f":{f['line']}" if f.get("line") else ""
        return f"{where}{line} ({f.get('name', '?')})"

    frames = frames or []
    for f in frames:
        if f.get("filename") and not any(s in f["filename"] for s in _INTERNAL) and "::" not in f.get("name", ""):
            return fmt(f, 2)
    for f in frames:
        if m := _BACKWARD_NODE.search(f.get("name", "")):
            return f"backward: {m.group(1)}"
    if any("autograd" in f.get("name", "") for f in frames):
        return "backward (autograd engine)"
    if frames:
        return fmt(frames[0], 1)
    return f"{phase} (no Python frames)" if phase else "backward (autograd thread: no Python frames)"


def trace_summary(snapshot: dict, device: int = 0, start_bytes: int = 0, top: int = 10, phases=None) -> dict:
    """Allocated bytes over time and the largest holders at the peak, from a snapshot's trace (``start_bytes``
    allocated when recording started; a frameless allocation belongs to the last of :class:`PhaseMarks`' ``phases``)."""
    traces = snapshot.get("device_traces") or [[]]
    live: dict[int, tuple[int, str]] = {}
    cur, ts, ys, t0 = start_bytes, [], [], None
    peak, peak_i, at_peak, allocs = cur, 0, {}, []
    for i, e in enumerate(traces[device] if device < len(traces) else []):
        if e.get("action") == "alloc":
            t = e.get("time_us")
            phase = next((name for when, name in reversed(phases or []) if t is not None and when <= t), None)
            site = _site(e.get("frames"), phase)
            live[e["addr"]] = (e["size"], site)
            cur += e["size"]
            allocs.append(live[e["addr"]])
        elif e.get("action") == "free_completed" and e.get("addr") in live:
            cur -= live.pop(e["addr"])[0]
        else:
            continue
        if e.get("time_us") is not None:
            t0 = e["time_us"] if t0 is None else t0
        ts.append((e["time_us"] - t0) / 1e3 if e.get("time_us") is not None else float(i))
        ys.append(cur)
        if cur > peak:
            peak, peak_i, at_peak = cur, len(ys) - 1, dict(live)

    def rank(pairs) -> list[dict]:  # (bytes, site) pairs -> the ``top`` sites by bytes, with their counts
        by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for size, site in pairs:
            by_site[site][0] += size
            by_site[site][1] += 1
        ranked = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"site": s, "bytes": b, "count": n} for s, (b, n) in ranked]
    return {"t": ts, "bytes": ys, "time_unit": "ms" if t0 is not None else "event", "peak_bytes": peak,
            "peak_index": peak_i, "top_at_peak": rank(at_peak.values()), "top_allocated": rank(allocs),
            "events": len(ys)}


class _RecordingStorages(LiveStorages):
    """The CPU tracker's storage counting, writing alloc/free_completed entries like the CUDA allocator."""
    def __init__(self, site_of):
        super().__init__()
        self.trace, self.site_of, self.t0, self.op = [], site_of, time.perf_counter(), "?"

    def add(self, t) -> None:
        self._count_dead()  # the storages that died first (frees): else an alloc beside a free is not logged
        n_before = len(self.live)
        super().add(t)
        if len(self.live) > n_before:
            st = t.untyped_storage()
            self.trace.append({"action": "alloc", "addr": st.data_ptr(), "size": st.nbytes(),
                               "time_us": (time.perf_counter() - self.t0) * 1e6,
                               "frames": [{"filename": self.site_of(), "line": 0, "name": self.op}]})

    def _forget(self, key: int) -> None:
        if key in self.live:
            self.trace.append({"action": "free_completed", "addr": key, "size": self.live[key],
                               "time_us": (time.perf_counter() - self.t0) * 1e6, "frames": []})
        super()._forget(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        return super().__torch_dispatch__(func, types, args, kwargs)


class CPUTraceRecorder:
    """``with CPUTraceRecorder(model) as rec: ...`` then ``rec.snapshot()``: a CUDA-snapshot-format trace of the tensors
    CPU operators create (site = module running + operator); those alive before the block are ``rec.start_bytes``."""

    def __init__(self, model: torch.nn.Module | None = None, depth: int = 3):
        self.model, self.depth, self._stack, self._handles = model, depth, ["(outside modules)"], []
        self.start_bytes = 0

    def __enter__(self) -> "CPUTraceRecorder":
        for name, mod in (self.model.named_modules() if self.model is not None else ()):
            if name.count(".") < self.depth:
                label = f"forward {name or type(mod).__name__}"
                self._handles += [mod.register_forward_pre_hook(lambda m, a, _l=label: self._stack.append(_l)),
                                  mod.register_forward_hook(lambda m, a, o: (self._stack.pop(), None)[1])]
        gc.collect()
        self._mode = _RecordingStorages(lambda: self._stack[-1])
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
        # the storages' finalizers keep the mode alive: it must not keep the model (and those storages) alive
        self._mode.site_of = str
        self.model = None

    def mark(self, label: str) -> None:
        """Everything allocated from here on is attributed to ``label`` when no module is running."""
        self._stack[0] = label

    def snapshot(self) -> dict:
        return {"segments": [], "device_traces": [list(self._mode.trace)]}


def record_cpu_trace(model: torch.nn.Module, step, steps: int) -> tuple[dict, int]:
    """The CPU stand-in for a CUDA memory snapshot of ``steps`` training steps (``step(mark)`` runs one step,
    calling ``mark(stage)`` after each stage); says so in one printed line. ``(snapshot, start_bytes)``."""
    print("CPU: no CUDA allocator to record (a GPU writes memory_snapshot.pickle for pytorch.org/memory_viz); the "
          "CPU tracker writes the same kind of trace, with 'module + operator' as the source instead of a line")
    with CPUTraceRecorder(model) as rec:
        for _ in range(steps):
            step(lambda s: rec.mark(CPU_TRACE_PHASES.get(s, s)))
    return rec.snapshot(), rec.start_bytes


def operators_only(averages):
    """``prof.key_averages()`` without the ``record_function`` ranges (spans, not operators), keeping its columns."""
    from torch.autograd.profiler_util import EventList

    return EventList([e for e in averages if not getattr(e, "is_user_annotation", False)],
                     use_device=getattr(averages, "_use_device", None),
                     profile_memory=getattr(averages, "_profile_memory", False),
                     with_flops=getattr(averages, "_with_flops", False))


def profiler_op_rows(averages, steps: int, on_gpu: bool) -> list[dict]:
    """One row per operator of ``prof.key_averages()`` over ``steps`` steps, slowest first: group, calls, self time
    and self memory per step (allocated minus freed inside the op); device time and memory on a GPU."""
    rows = [{"op": e.key, "group": op_group(e.key), "calls": e.count / steps,
             "self time (ms)": (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e3 / steps,
             "self memory (MiB)": (e.self_device_memory_usage if on_gpu else e.self_cpu_memory_usage) / MiB / steps}
            for e in operators_only(averages)]
    return sorted(rows, key=lambda r: -r["self time (ms)"])


def range_times(events, names=("forward", "backward", "optimizer_step")) -> list[dict]:
    """One row per ``record_function`` range of ``prof.events()``: calls and CPU time; device time = the self device
    time of every operator, on any thread (backward's included), inside the range's CPU interval. None without a GPU."""
    from torch.autograd import DeviceType

    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    has_gpu = any(e.device_type != DeviceType.CPU for e in events)
    rows = []
    for name in names:
        spans = [e for e in cpu_ops if e.name == name]
        if spans:
            inside = [op.self_device_time_total for op in cpu_ops for r in spans
                      if r.time_range.start <= op.time_range.start and op.time_range.end <= r.time_range.end]
            rows.append({"range": name, "calls": len(spans),
                         "cpu time (ms)": sum(e.time_range.elapsed_us() for e in spans) / 1e3,
                         "device time (ms)": sum(inside) / 1e3 if has_gpu else None})
    return rows


def timed_steps(step, n: int, device=None) -> list[float]:
    """Wall-clock seconds of each of ``n`` calls of ``step()``, from an idle device to an idle device."""
    times = []
    for _ in range(n):
        dev.synchronize(device)
        t0 = time.perf_counter()
        step()
        dev.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def profile_each_step(step, n: int, device, trace=None) -> list:
    """``n`` calls of ``step()``, each under its own ``torch.profiler`` session: one OpProfile per step, so each op's
    time has a spread of its own. ``trace``: a path for the last session's Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    out = []
    for _ in range(n):
        with profile(activities=acts, record_shapes=True) as prof:
            step()
        out.append(op_profile(prof, 1))
    if trace:
        prof.export_chrome_trace(str(trace))
    return out


def op_change_rows(before: list, after: list, n: int = 8) -> list[dict]:
    """The ``n`` slowest ATen ops of each side, side by side: median self time and noise of the op's OWN per-step
    times, calls per step, input dtypes, and a reading: a change in calls, else the time change against the noise."""
    def per_step(profiles, name, key):
        return [next((r[key] for r in p.ops if r["op"] == name), 0.0) for p in profiles]

    def slowest(profiles):
        names = {r["op"] for p in profiles for r in p.ops if r["op"].startswith("aten::")}
        return sorted(names, key=lambda k: -statistics.median(per_step(profiles, k, "ms")))[:n]

    rows = []
    for name in dict.fromkeys(slowest(before) + slowest(after)):
        row = {"op": name, "group": op_group(name)}
        for side, profiles in (("before", before), ("after", after)):
            ms = per_step(profiles, name, "ms")
            q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [0, 0, 0]
            row.update({f"{side} (ms)": statistics.median(ms), f"{side} noise (ms)": (q[2] - q[0]) / 2,
                        f"{side} calls": statistics.median(per_step(profiles, name, "calls")),
                        f"{side} dtypes": next((r["dtypes"] for p in profiles for r in p.ops if r["op"] == name), "-")})
        b, a = row["before calls"], row["after calls"]
        d = row["change (ms)"] = row["after (ms)"] - row["before (ms)"]
        row["reading"] = ("removed by the fix" if a == 0 < b else "added by the fix" if b == 0 < a else
                          "fewer calls" if a < b else "more calls" if a > b else
                          "within its own noise" if abs(d) <= row["before noise (ms)"] + row["after noise (ms)"]
                          else "beyond its own noise")
        rows.append(row)
    return rows
