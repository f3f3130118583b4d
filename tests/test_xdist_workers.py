"""How many pytest-xdist workers `-n auto` (the README's test command) starts: conftest.py's
``pytest_xdist_auto_num_workers``. The oracle for "a GPU is there" is the pretend GPU of tests/fake_cuda.py, which
makes ``torch.cuda.is_available()`` answer as a CUDA machine's torch does."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tests import fake_cuda

# the repository's conftest.py (``import conftest`` finds tests/conftest.py), loaded as a module of its own
_spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).resolve().parent.parent / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_a_worker_per_core_as_memory_allows(monkeypatch):
    """Breaks if the count ignored the cores or the memory (a 16-core laptop with 16 GiB would start 16 workers of
    up to 3 GiB each), or started a lone worker (all of xdist's cost, none of its use)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 * 2**30 // 4096}[name])
    assert conftest.pytest_xdist_auto_num_workers(None) == 4          # 16 GiB: 4 workers, not 16
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 128 * 2**30 // 4096}[name])
    assert conftest.pytest_xdist_auto_num_workers(None) == 16         # the cores decide
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0          # one core: no xdist


def test_no_workers_where_torch_can_use_a_gpu(monkeypatch):
    """Breaks if tests on a GPU machine ran in parallel workers on one card: their memory peaks, budgets and timings
    would see each other's kernels."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    fake_cuda.install(monkeypatch)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0
