"""The model hub is unreachable (here, in CI and on the GPU machines): pretrained=auto must fall back fast."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest


def _run(root, tmp_path, extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(LAB_SMOKE="1", HF_HOME=str(tmp_path / "hf"), **extra_env)  # empty cache
    out = tmp_path / "out.json"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "labutils", "run", "configs/fp32_config.yaml", "--quiet", "--json", str(out),
         "--set", "model.name=gpt2", "model.pretrained=auto", "data.seq_length=16", "data.num_samples=4",
         "train.micro_batch_size=1", "train.steps=1"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text()), elapsed


def test_unresolvable_hub_falls_back_to_random_weights_fast(root, tmp_path):
    proc, d, elapsed = _run(root, tmp_path, {"HF_ENDPOINT": "https://hub.invalid"})
    assert elapsed < 30, elapsed
    assert d["env"]["weights"] == "random"
    assert proc.stdout.count("random weights of the same architecture") == 1


@pytest.fixture
def silent_server():
    """A local server that accepts connections and never answers: a hub that hangs."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in conns:
        c.close()
    srv.close()


def test_hanging_hub_falls_back_within_30_seconds(root, tmp_path, silent_server):
    proc, d, elapsed = _run(root, tmp_path, {"HF_ENDPOINT": silent_server})
    assert elapsed < 30, elapsed
    assert d["env"]["weights"] == "random"
    assert "random weights" in proc.stdout
