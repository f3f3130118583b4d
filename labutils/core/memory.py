"""Memory measurement for a region of code: the same meaning on CUDA and on CPU.

On CUDA the caching allocator is asked (allocated, reserved, and their peaks, reset when the region starts); a cap
limits *reserved*, cached free blocks included. On CPU, where RSS counts the Python heap and cached pages, the tracker
counts live tensor storages itself: those alive at the start (found through the garbage collector) plus every storage
an operator creates inside (a ``TorchDispatchMode``), minus those freed: ``torch.cuda.max_memory_allocated``'s meaning.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import gc
import re
import sys
import traceback
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import device as dev


def gib(n: float | None) -> float | None:
    """Bytes in GiB, as a number for a table or a plot (None stays None); :func:`fmt_bytes` writes it as text."""
    return None if n is None else n / 2**30


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class _StorageRef(weakref.ref):
    __slots__ = ("key",)


class LiveStorages(TorchDispatchMode):
    """Counts bytes of live CPU tensor storages, with a running peak (``with LiveStorages() as live: ...; live.peak``;
    ``add_existing()`` counts what was alive before): :class:`MemoryTracker` on the CPU. No ``ignore_compile_internals``
    (it must see every operator), so compiled code inside runs eagerly. A storage's death is queued by a C callback
    (``deque.append``) and counted at the next allocation or reading: a Ctrl-C never lands in a Python finaliser."""

    def __init__(self, budget_bytes: int | None = None):
        super().__init__()
        self.budget = budget_bytes
        self.live: dict[int, int] = {}
        self._refs: dict[int, _StorageRef] = {}
        self._dead: collections.deque[_StorageRef] = collections.deque()  # storages died since last counted
        self._current = 0
        self._peak = 0

    current = property(lambda self: self._count_dead() or self._current)  # bytes live now
    peak = property(lambda self: self._count_dead() or self._peak)

    def _count_dead(self) -> None:
        while self._dead:
            ref = self._dead.popleft()
            if self._refs.get(ref.key) is ref:
                del self._refs[ref.key]
                self._forget(ref.key)

    def _forget(self, key: int) -> None:
        self._current -= self.live.pop(key, 0)

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
            return
        if getattr(t, "fake_mode", None) is not None:  # a FakeTensor (torch.compile's tracing, which keeps some
            return                                      # alive afterwards): shapes only, no memory
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except (RuntimeError, NotImplementedError):
            return
        n = st.nbytes()
        self._count_dead()
        if n == 0 or key in self.live:
            return
        if self.budget is not None and self._current + n > self.budget:
            raise torch.OutOfMemoryError(
                f"simulated out of memory on CPU: tried to allocate {fmt_bytes(n)} with {fmt_bytes(self._current)} "
                f"live and a budget of {fmt_bytes(self.budget)}")
        self.live[key] = n
        self._current += n
        self._peak = max(self._peak, self._current)
        ref = self._refs[key] = _StorageRef(st, self._dead.append)
        ref.key = key

    def add_existing(self) -> None:
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no lazy-module side effects
                self.add(obj)
                if obj.is_leaf and obj.grad is not None:  # .grad of a non-leaf warns
                    self.add(obj.grad)

    def __exit__(self, *exc):
        self._count_dead()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        return out


@dataclass
class MemoryTracker:
    """``with MemoryTracker(device) as mt: ...`` then ``mt.peak_bytes``, ``mt.start_bytes``, ``mt.end_bytes``.

    ``mt.mark("after forward")`` records a point of the timeline (label, current, peak). On CPU, tracking costs Python
    work per operator (not for timing); ``cpu_budget_bytes`` makes it raise ``torch.OutOfMemoryError`` when live
    tensors would exceed it, so a lab's out-of-memory paths also run without a GPU."""
    device: torch.device | str | None = None
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0
    reserved_bytes: int | None = None
    peak_reserved_bytes: int | None = None   # CUDA: the allocator's peak reserved (what a memory cap limits)
    cpu_budget_bytes: int | None = None
    timeline: list[tuple[str, int, int]] = field(default_factory=list)

    def __post_init__(self):
        self.device = dev.resolve(self.device)
        self._cpu: LiveStorages | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def current_bytes(self) -> int:
        if self.is_cuda:
            return dev.allocated(self.device)
        if self._cpu is None:
            raise RuntimeError("the CPU tracker only counts inside its `with` block")
        return self._cpu.current

    def _peak_now(self) -> int:
        return dev.peak_allocated(self.device) if self.is_cuda else self._cpu.peak

    def mark(self, label: str) -> int:
        dev.synchronize(self.device)
        cur = self.current_bytes()
        self.timeline.append((label, cur, self._peak_now()))
        return cur

    def __enter__(self) -> "MemoryTracker":
        release_failed_cell()
        gc.collect()
        if self.is_cuda:
            dev.synchronize(self.device)
            dev.reset_peak(self.device)
        else:
            self._cpu = LiveStorages()
            self._cpu.add_existing()
            self._cpu.budget = self.cpu_budget_bytes
            self._cpu.__enter__()
        self.start_bytes = self.current_bytes()
        self.peak_bytes = self.start_bytes
        return self

    def __exit__(self, *exc) -> None:
        if self.is_cuda:
            dev.synchronize(self.device)
            self.reserved_bytes = dev.reserved(self.device)
            self.peak_reserved_bytes = dev.peak_reserved(self.device)
        else:
            self._cpu.__exit__(*exc)
        self.end_bytes = self.current_bytes()
        self.peak_bytes = max(self._peak_now(), self.end_bytes)

    @property
    def peak_above_start(self) -> int:
        return self.peak_bytes - self.start_bytes


def memory_in_use(device=None) -> int:
    """Bytes of tensors alive now, after :func:`release`: on CUDA the allocator's allocated bytes; on the CPU every
    live tensor storage. What a :class:`MemoryTracker` counts at the start of a region: it is in every peak."""
    release()
    with MemoryTracker(device) as t:
        pass
    return t.start_bytes


def cpu_budget_kwargs(budget: int, device) -> dict:
    """``lu.run``'s arguments for a budget: none on CUDA; on CPU the budget plus every CPU tensor alive now."""
    return {} if torch.device(device).type == "cuda" else {"cpu_budget_bytes": memory_in_use(device) + budget}


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


_VIEW_FNS = {"TBackward0", "TransposeBackward0", "TransposeBackward1", "ViewBackward0", "UnsafeViewBackward0",
             "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "ReshapeAliasBackward0"}


def _skip_views(fn):
    """Follow single-input view/transpose nodes (F.linear saves ``weight.t()``, a view of the cast copy)."""
    for _ in range(8):
        nxt = [f for f, _ in fn.next_functions if f is not None] if fn is not None else []
        if fn is None or type(fn).__name__ not in _VIEW_FNS or len(nxt) != 1:
            return fn
        fn = nxt[0]
    return fn


def is_weight_copy(t: torch.Tensor) -> bool:
    """True for autocast's cast of a parameter (or a view of it): a ``_to_copy`` of a leaf weight. Labs 01 and 04
    both sort the tensors autograd saves with it."""
    fn = _skip_views(t.grad_fn)
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(getattr(_skip_views(nf), "variable", None) is not None for nf, _ in fn.next_functions if nf is not None)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """What the training state holds right now: weights, gradients and optimizer state, in bytes."""
    params = list(model.parameters())
    opt = []
    if optimizer is not None:
        for s in optimizer.state.values():
            opt += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optimizer": tensor_bytes(opt)}


def freeze_import_state() -> bool:
    """``gc.freeze`` what exists now, if no tensor is alive (a frozen one would escape the CPU tracker), so each
    ``gc.collect()`` skips the imported modules' state; unfrozen at exit. Only in a notebook's kernel
    (:func:`labutils.setup`): beside regenerate's zmq sockets it can end in a libzmq abort. Returns whether it froze."""
    if any(issubclass(type(o), torch.Tensor) for o in gc.get_objects()):  # type(): no lazy-module side effects
        return False  # (a tensor in uncollected garbage counts too: no freeze, the safe side)
    # what every lab imports on first use, imported here so that it is frozen too: transformers' GPT-2 classes (its
    # lazy import structure: 200 thousand objects) and pyplot (40 thousand); classes and modules, no tensor
    import matplotlib.pyplot  # noqa: F401
    from transformers import GPT2LMHeadModel  # noqa: F401

    gc.collect()  # the garbage made so far is collected, not frozen
    gc.freeze()
    atexit.register(gc.unfreeze)
    return True


def release() -> None:
    """After every experiment: frees what a failed cell left, collects garbage, empties the GPU and pinned caches."""
    release_failed_cell()
    gc.collect()
    dev.empty_caches()


_CLEARED, _SAID = [], []  # the tracebacks release_failed_cell cleared last; their ids when start_check last ran


def _bytes_in_use() -> int:
    gc.collect()
    (live := LiveStorages()).add_existing()
    return live.current + (dev.allocated() or 0)


def release_failed_cell() -> int:
    """Free what the last cell that ended in an error (Ctrl-C included) left alive, say how much, return it: IPython
    keeps the error, and its traceback's frames hold the locals (model, optimizer, data) of every function it went
    through; clearing the frames frees them."""
    result = getattr(getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)(), "last_execution_result", None)
    errors = [getattr(sys, "last_value", None), getattr(sys, "last_exc", None), getattr(result, "error_in_exec", None)]
    tbs = [getattr(sys, "last_traceback", None)]
    while errors:  # each error, and the errors it was raised from or while handling
        if isinstance(e := errors.pop(), BaseException) and not any(e.__traceback__ is tb for tb in tbs):
            tbs.append(e.__traceback__)
            errors += [e.__cause__, e.__context__]
    if not (tbs := [tb for tb in tbs if tb is not None and not any(tb is c for c in _CLEARED)]):
        return 0
    before = _bytes_in_use()
    for tb in tbs:
        for frame, _ in traceback.walk_tb(tb):
            # a cleared frame keeps its function, whose closure keeps the cells its inner functions (a lambda, a
            # comprehension) closed over: emptied too; not the cells it borrowed (a decorator's, still in use)
            refs = gc.get_referents(frame)
            borrowed = {id(c) for f in refs if type(f) is types.FunctionType and f.__code__ is frame.f_code
                        for c in f.__closure__ or ()}
            with contextlib.suppress(RuntimeError):  # a frame still running is left as it is
                frame.clear()
                frame.f_locals  # noqa: B018  Python < 3.13: syncs (empties) the dict of locals a printer took
                for c in (c for c in refs if type(c) is types.CellType and id(c) not in borrowed):
                    c.cell_contents = None
            refs = None  # it held the frame's locals
    _CLEARED[:] = tbs
    if (freed := before - _bytes_in_use()) > 0:
        print(f"released {fmt_bytes(freed)} that a failed or interrupted cell had left alive (IPython keeps its "
              f"error, whose frames held them): not in the measurements from here")
    return max(freed, 0)


_BASELINE: dict[str, int] = {}  # device type -> the lab's baseline (set_baseline)
LEFTOVERS: list[dict] = []  # every start that found memory above the baseline: lu.record_results writes them


def set_baseline(device=None) -> int:
    """The lab's baseline, the memory in use now (``lu.setup()`` in a notebook): every measurement starts from it."""
    LEFTOVERS.clear()
    _BASELINE[dev.resolve(device).type] = base = memory_in_use(device)
    return base


def start_check(device=None, where: str = "this measurement") -> int:
    """A measurement starts here: what a failed cell kept is released, the memory in use compared with the lab's
    baseline; the bytes above it (0: none set), kept in :data:`LEFTOVERS`, said at the first check after a failed
    cell (whoever released it: a ``release()`` before this check too)."""
    release_failed_cell()
    failed, _SAID[:] = [id(tb) for tb in _CLEARED] != _SAID, [id(tb) for tb in _CLEARED]
    if (base := _BASELINE.get(dev.resolve(device).type)) is None:  # no lab here (outside a notebook's kernel)
        return 0
    if (extra := memory_in_use(device) - base) and failed:
        print(f"{where} starts {fmt_bytes(abs(extra))} {'above' if extra > 0 else 'below'} the lab's baseline "
              f"({fmt_bytes(base)}): tensors a name still holds, in its peaks")
    LEFTOVERS.extend([{"where": where, "bytes": extra, "baseline_bytes": base}] if extra else [])
    return extra


def oom_text(exc: BaseException) -> str:
    """An out-of-memory error as one short line: what ran out, the request, and the cap ("X allowed"), without the
    card's capacity and free memory (under a cap they read as if the card were full); else the first line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    head = re.match(r"(.*?out of memory\.)\s*(Tried to allocate [\d.]+ \w+)", text)
    if head is None:
        return text[:300]
    allowed = re.search(r"([\d.]+ \w+) allowed", text)
    return f"{head[1]} {head[2]}" + (f" ({allowed[1]} allowed by the memory cap)" if allowed else "")


def budget_words() -> str:
    """What a run that did not fit ran out of, in words: the emulated card's budget when the GPU is capped, else
    the memory this run could use. No number: the budget line printed at setup holds it."""
    b = dev.current_budget()
    return f"the {b['card_gib']:g} GB card's memory budget" if b else "the memory this run could use"


class CaughtOOM:
    """Falsy until an out-of-memory error ends :func:`oom_caught`'s block, then ``error`` is its :func:`oom_text`."""

    def __init__(self):
        self.error: str | None = None

    def __bool__(self) -> bool:
        return self.error is not None


@contextlib.contextmanager
def oom_caught():
    """``with oom_caught() as oom: ...`` then ``if oom: ... oom.error``: an out-of-memory error (not kept: its
    traceback's frames hold the activations) ends the block, a row's one line; any other error propagates."""
    caught = CaughtOOM()
    try:
        yield caught
    except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not dev.is_oom(exc):
            raise
        caught.error = oom_text(exc)
