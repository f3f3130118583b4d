"""``import labutils`` takes the imported modules' own objects out of the garbage collector's full scans
(``memory.freeze_import_state``): every experiment calls ``gc.collect()`` for an honest baseline, and each call
walked 200-300 thousand module objects (0.1-0.4 s a call; 157 s of the test suite's CPU time, 17 s of lab 04's
smoke run). Each check runs in a fresh interpreter, since the freeze happens once per process, at import."""
import subprocess
import sys
import textwrap



def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_import_leaves_the_collector_little_to_scan_and_later_garbage_is_still_freed():
    """The oracle is the collector's own count: objects in its generations (what a full collection walks) before
    and after the import. Breaks if the freeze went away (everything torch and transformers made stays in the
    generations: well over 100 thousand objects). Then a model in a reference cycle, dropped after the import (what
    every lab section does before the next one measures): ``release()`` frees it. Breaks if objects made later
    were frozen too (a leak that would inflate the next section's memory)."""
    out = run("""
        import gc, weakref
        import torch, transformers  # what labutils imports, made before the freeze
        before = len(gc.get_objects())
        import labutils as lu
        after, frozen = len(gc.get_objects()), gc.get_freeze_count()
        m = torch.nn.Linear(512, 512)
        m.me = [m]  # a cycle: only the collector frees it
        alive = weakref.ref(m.weight)
        del m
        lu.release()
        print(before, after, frozen, alive() is None)
    """)
    before, after, frozen, freed = out.split()
    before, after, frozen = int(before), int(after), int(frozen)
    assert before > 100_000 and after < before // 10 and frozen > before // 2, (before, after, frozen)
    assert freed == "True"


def test_no_freeze_while_a_tensor_is_alive_so_the_cpu_tracker_still_counts_it():
    """A tensor made before ``import labutils`` (a student's cell order) must stay where the CPU tracker's census
    finds it (``gc.get_objects`` does not list frozen objects). Breaks if the freeze ignored live tensors: the
    tracker's baseline would miss the 4 MB below."""
    out = run("""
        import gc, torch
        x = torch.ones(2**20)
        import labutils as lu
        with lu.MemoryTracker("cpu") as mt:
            y = x * 2
        print(gc.get_freeze_count(), mt.start_bytes >= 4 * 2**20, mt.peak_bytes - mt.start_bytes == 4 * 2**20)
    """)
    assert out == "0 True True", out
