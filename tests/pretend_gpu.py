"""Run a module under the pretend GPU: ``python tests/pretend_gpu.py PROFILE -m MODULE [ARGS...]``.

The process that runs MODULE sees the pretend GPU of ``PROFILE`` (a key of tests/fake_cuda.py's PROFILES); the
processes it starts do not (they see this machine: on CI, a CPU). The one-command GPU run is rehearsed this way
(tests/regen_once.py): ``regenerate``'s own CUDA branches (the card's name, its results folder, the time plan) run
on the pretend card, while the doctor, the notebooks and the bench it starts run at smoke sizes on the CPU.
"""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import fake_cuda  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit("usage: python tests/pretend_gpu.py PROFILE -m MODULE [ARGS...]")
    profile, module, args = sys.argv[1], sys.argv[3], sys.argv[4:]
    fake_cuda.install_session(profile)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
