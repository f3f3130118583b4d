"""Ctrl-C at any moment of a command is one line, "interrupted", and exit code 130 (issue 38 §6): in its first
seconds, while torch is imported, ``python -m labutils run`` / ``regenerate`` gave a KeyboardInterrupt traceback
from inside the import (once a ModuleNotFoundError from transformers). A real SIGINT to a real process, at moments
from inside torch's import (the moment its C library is mapped into the process) to the work itself. (Before Python
has started, or while it imports the `signal` module, no code of ours has run: those moments are not tested.)"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RUN = ["run", "configs/fp32_config.yaml", "--quiet", "--set", "train.steps=50"]


def torch_loading(pid: int) -> bool:
    """Has the process begun importing torch (its C library mapped)?"""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps (Linux)")
@pytest.mark.parametrize("command", ["run", "regenerate"])
@pytest.mark.parametrize("delay", [0.0, 1.0, 2.5])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(root, tmp_path, command, delay):
    """``delay``: seconds after torch's import began."""
    argv = RUN if command == "run" else ["regenerate", "--smoke", "--only", "02", "--out", str(tmp_path / "out")]
    env = {**os.environ, "LAB_SMOKE": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "labutils", *argv], cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not torch_loading(p.pid) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted"), err[-3000:]
