"""GPT-2 models: the four sizes plus ``tiny``, loaded from the hub when it is reachable, else random weights.

transformers (and huggingface_hub) are imported lazily, *after* the hub probe: ``HF_HUB_OFFLINE`` is read at
import time, so a probe that finds no network must set it first or every later call would wait on timeouts.
"""
from __future__ import annotations

import os
import threading
import urllib.request
from dataclasses import dataclass

import torch

from .config import ModelConfig

# Architecture of each size (n_layer, n_embd, n_head); all share the 50257-token vocabulary and 1024 positions.
PRESETS = {
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
    "tiny": (2, 128, 4),  # GPT-2 architecture, for smoke runs only; no hub checkpoint
}
TINY_VOCAB = 257  # tiny: bytes + EOS, so a 2-core CPU is not spending its time in a 50257-wide LM head
HUB_IDS = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
           "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}
VOCAB_SIZE, N_POSITIONS, EOS_ID = 50257, 1024, 50256

_hub_state: dict = {}
_last_weights: list[str] = []  # what load_model gave, most recent last


def last_weights() -> str | None:
    """"pretrained" or "random": the weights of the most recent model loaded in this process (None before any)."""
    return _last_weights[-1] if _last_weights else None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we talk to the model hub? Answers within ``timeout`` seconds even when DNS hangs.

    When it cannot, sets ``HF_HUB_OFFLINE=1`` (and huggingface_hub's already-read constant) so that
    ``from_pretrained`` only looks in the local cache and fails fast instead of retrying.
    """
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
    """Offline stand-in for the GPT-2 tokenizer: UTF-8 bytes as token ids (0-255), EOS = vocab_size - 1.

    GPT-2 sizes keep the 50257-entry vocabulary, so shapes, memory and speed are those of the real thing;
    only what a token means (a byte, not a BPE piece) differs. ``tiny`` uses a 257-entry vocabulary.
    """
    name = "byte-level (offline)"

    def __init__(self, vocab_size: int = VOCAB_SIZE):
        self.vocab_size, self.eos_token_id = vocab_size, vocab_size - 1

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids[:max_length] if max_length else ids

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HubTokenizer:
    """GPT-2's BPE tokenizer from the hub, behind the same two methods as :class:`ByteTokenizer`."""

    def __init__(self, tok):
        self.tok, self.name = tok, "gpt2 BPE"
        self.tok.model_max_length = int(1e9)  # we cut to seq_length ourselves: no "too long" warnings
        self.eos_token_id, self.vocab_size = tok.eos_token_id, VOCAB_SIZE

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        ids = self.tok.encode(text)
        return ids[:max_length] if max_length else ids

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def vocab_size(name: str) -> int:
    return TINY_VOCAB if name == "tiny" else VOCAB_SIZE


def gpt2_config(name: str, dropout: float | None = None, attn_implementation: str = "sdpa"):
    from transformers import GPT2Config

    n_layer, n_embd, n_head = PRESETS[name]
    vocab = vocab_size(name)
    kw = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=N_POSITIONS,
              bos_token_id=vocab - 1, eos_token_id=vocab - 1, use_cache=False)
    if dropout is not None:
        kw.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    cfg = GPT2Config(**kw)
    cfg._attn_implementation = attn_implementation
    return cfg


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    weights: str  # "pretrained" or "random"
    notice: str | None = None


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0, verbose: bool = True) -> Loaded:
    """Build the model of ``cfg`` on ``device``, with its tokenizer, and say which weights it has.

    pretrained=auto: the hub's weights when reachable (or cached), else random weights of the same
    architecture with a one-line notice. true: the hub's weights or an error. false: random weights.
    """
    device = torch.device(device)
    want = cfg.pretrained
    notice = None
    if cfg.name != "tiny" and want in ("auto", "true"):
        reachable = hub_reachable()
        try:
            from transformers import GPT2LMHeadModel, GPT2TokenizerFast

            kw = dict(use_cache=False, attn_implementation=cfg.attn_implementation)
            if cfg.dropout is not None:
                kw.update(resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout)
            model = GPT2LMHeadModel.from_pretrained(HUB_IDS[cfg.name], dtype=torch.float32, **kw).to(device)
            model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name maps to no loss type: avoid a warning
            tok = HubTokenizer(GPT2TokenizerFast.from_pretrained(HUB_IDS[cfg.name]))
            _last_weights.append("pretrained")
            return Loaded(model, tok, "pretrained")
        except (OSError, ValueError) as exc:
            if want == "true":
                raise RuntimeError(f"model.pretrained=true but {HUB_IDS[cfg.name]} could not be loaded "
                                   f"({'hub unreachable, not in the local cache' if not reachable else exc})") from None
            notice = (f"[labutils] {HUB_IDS[cfg.name]} is not available offline (hub unreachable, not cached): "
                      f"using random weights of the same architecture and a byte-level tokenizer. "
                      f"Memory and speed are the same; loss values are not comparable to pretrained GPT-2.")
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT2LMHeadModel(gpt2_config(cfg.name, cfg.dropout, cfg.attn_implementation))
    model.loss_type = "ForCausalLM"
    if notice and verbose:
        print(notice)
    _last_weights.append("random")
    return Loaded(model, ByteTokenizer(vocab_size(cfg.name)), "random", notice)


def enable_checkpointing(model, every_n_layers: int = 1, **checkpoint_kwargs) -> None:
    """Activation (gradient) checkpointing through the model's own API, non-reentrant.

    transformers >= 5.23 calls it ``activation_checkpointing_enable``; 5.16-5.22 had the same behaviour
    under ``gradient_checkpointing_enable`` (now a deprecated alias, so we only call it where the new name
    is missing). ``every_n_layers=k`` checkpoints blocks 0, k, 2k, ... Extra keyword arguments go to
    ``torch.utils.checkpoint.checkpoint`` (e.g. ``context_fn`` for selective checkpointing).
    """
    kwargs = {"use_reentrant": False, **checkpoint_kwargs}
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()  # enable() adds an embedding hook each time: keep only one
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    else:  # pragma: no cover - transformers < 5.23
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    model.config.use_cache = False


def disable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:  # pragma: no cover - transformers < 5.23
        model.gradient_checkpointing_disable()
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def checkpointed_layers(model) -> list[int]:
    """Indices of the transformer blocks that recompute in backward."""
    return [i for i, b in enumerate(model.transformer.h) if getattr(b, "gradient_checkpointing", False)]


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(name: str, seq_length: int) -> float:
    """Model FLOPs per token of one training step (forward + backward), no recompute: the numerator of MFU.

    PaLM's definition (Chowdhery et al. 2022, appendix B): 6N + 12 * L * T * d, where N counts the weights that
    take part in matmuls (each block's 4d^2 attention + 8d^2 MLP, and the LM head's d x vocab, tied to the
    token embedding) and 12 * L * T * d is the two attention matmuls (Q K^T and A V, full T x T as eager
    attention computes them), forward 4 * T * d per layer and token, backward twice that. Biases, LayerNorms,
    GELU, softmax and the position table are not matmuls and are left out, as torch's FLOP counter does.
    """
    n_layer, d, _ = PRESETS[name]
    blocks = n_layer * (12 * d * d + 2 * seq_length * d)  # one forward pass's multiply-adds per token
    head = d * vocab_size(name)
    return 6 * (blocks + head)


def recomputed_flops_per_token(name: str, seq_length: int, every_n_layers: int = 1, dropout: bool = True) -> float:
    """FLOPs per token that non-reentrant activation checkpointing re-runs in backward (0 with none).

    Each checkpointed block (0, k, 2k, ... for ``every_n_layers=k``) re-runs its forward, but non-reentrant
    checkpointing stops early: once every tensor the backward needs is back, it stops. The last matmul of a
    GPT-2 block, the MLP's output projection (c_proj, 8d^2 per token), produces nothing backward needs, unless
    a dropout follows it: dropout's mask is saved for backward and is drawn *after* c_proj runs, so with
    ``dropout`` (GPT-2's own 0.1) the whole forward is re-run, and without it c_proj is skipped.
    Checked against ``torch.utils.flop_counter.FlopCounterMode`` in tests/test_flops.py.
    """
    n_layer, d, _ = PRESETS[name]
    checkpointed = len(range(0, n_layer, every_n_layers))
    forward = 2 * (12 * d * d + 2 * seq_length * d)      # one block's forward: weights and attention matmuls
    skipped = 0 if dropout else 2 * 4 * d * d             # MLP c_proj, 4d -> d: not re-run (early stop)
    return checkpointed * (forward - skipped)


def flops_per_token(name: str, seq_length: int, recompute: bool = False, *, every_n_layers: int = 1,
                    dropout: bool = True, fused_attention: bool = False) -> float:
    """Executed training FLOPs per position (forward + backward + recompute): what the GPU really computes.

    ``recompute``: activation checkpointing on (every ``every_n_layers``-th block; see
    :func:`recomputed_flops_per_token` for the early stop and why ``dropout`` matters). ``fused_attention``:
    SDPA's fused kernels (flash / memory-efficient, CUDA) recompute the T x T scores in backward: one more
    matmul, 2 * T * d per layer and token, as torch's FLOP counter also counts. Without recompute and with
    eager attention this equals :func:`model_flops_per_token`.
    """
    n_layer, d, _ = PRESETS[name]
    flops = model_flops_per_token(name, seq_length)
    if fused_attention:
        flops += n_layer * 2 * seq_length * d
    if recompute:
        flops += recomputed_flops_per_token(name, seq_length, every_n_layers, dropout)
    return flops
