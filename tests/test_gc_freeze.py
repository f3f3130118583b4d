"""``lu.setup()`` (every lab's setup cell) in a notebook's kernel takes the imported modules' own objects out of the
garbage collector's full scans (``memory.freeze_import_state``): every experiment calls ``gc.collect()`` for an honest
baseline, and in a kernel each call walked 300-450 thousand module objects (about 0.2 s a call, a quarter of the four
labs' smoke run). Outside a kernel nothing is frozen: the process that drives the kernels (``regenerate``) aborted in
libzmq at exit under load with a freeze (023f631). Each check runs in a fresh interpreter, since the freeze is
process state; ``import ipykernel`` first is what a kernel has imported when a lab's setup cell runs."""
import os
import subprocess
import sys
import textwrap


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_kernel_leaves_the_collector_little_to_scan_and_later_garbage_is_still_freed(tmp_path):
    """The oracle is the collector's own count: objects in its generations (what a full collection walks) and in
    the permanent generation (``gc.get_freeze_count``). Breaks if the freeze went away, or came before transformers'
    GPT-2 classes were imported (their lazy import structure alone is 200 thousand objects left to scan). Then a
    model in a reference cycle, dropped after the import (what every lab section does before the next one
    measures): ``release()`` frees it. Breaks if objects made later were frozen too (a leak that would inflate the
    next section's memory). Last, the interpreter's final collection sees what it would see without the freeze: an
    exit handler registered before ``lu.setup()`` runs after labutils' own (last in, first out) and finds
    nothing frozen. Breaks if the unfreeze at exit went away. And with the hub unreachable, huggingface_hub (which the
    freeze imports, through transformers) reads the offline switch setup's hub probe sets. Breaks if the probe's
    switch stopped reaching it (every later download attempt would wait on the network)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="https://hub.invalid", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import atexit, gc, weakref
        import ipykernel
        atexit.register(lambda: print("at exit:", gc.get_freeze_count()))
        import labutils as lu
        lu.setup(verbose=False)
        from huggingface_hub import constants
        assert constants.HF_HUB_OFFLINE is True, "the hub probe's offline switch did not reach huggingface_hub"
        from transformers import GPT2LMHeadModel
        import matplotlib.pyplot
        left, frozen = len(gc.get_objects()), gc.get_freeze_count()
        m = lu.load_model(lu.load_config(None, mode="smoke").model, "cpu", verbose=False).model
        m.me = [m]  # a cycle: only the collector frees it
        alive = weakref.ref(m.lm_head.weight)
        del m
        lu.release()
        print(left, frozen, alive() is None)
    """)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    left, frozen, freed, *at_exit = proc.stdout.split()
    assert int(frozen) > 200_000 and int(left) < 20_000, (left, frozen)
    assert freed == "True"
    assert at_exit == ["at", "exit:", "0"], proc.stdout


def test_no_freeze_while_a_tensor_is_alive_so_the_cpu_tracker_still_counts_it():
    """A tensor made before the setup cell (a student's cell order) must stay where the CPU tracker's census
    finds it (``gc.get_objects`` does not list frozen objects). Breaks if the freeze ignored live tensors: the
    tracker's baseline would miss the 4 MB below."""
    out = run("""
        import gc, ipykernel, torch
        x = torch.ones(2**20)
        import labutils as lu
        lu.setup(verbose=False)
        with lu.MemoryTracker("cpu") as mt:
            y = x * 2
        print(gc.get_freeze_count(), mt.start_bytes >= 4 * 2**20, mt.peak_bytes - mt.start_bytes == 4 * 2**20)
    """)
    assert out == "0 True True", out


def test_outside_a_kernel_nothing_is_frozen():
    """``python -m labutils regenerate`` (the kernels' driver, jupyter_client over zmq), the CLI and scripts keep the
    collector as it was. Breaks if the freeze were applied in every process again."""
    assert run("import gc, labutils; labutils.setup(verbose=False); print(gc.get_freeze_count())") == "0"
