"""Beyond one GPU: the same loop on an existing engine (DDP, FSDP, DeepSpeed ZeRO) through Hugging Face accelerate.

``accelerate launch --config_file configs/accelerate/<x>.yaml -m labutils run CONFIG`` starts N processes;
:func:`maybe_accelerator` builds an ``Accelerator`` from the YAML config, and the loop hands autocast, loss scaling,
accumulation and clipping to the engine. Each rank normalises its token-loss sum by ``global_targets / (accum * world)``
(the engine divides by ``accum``, data parallelism averages over ``world``): the token-mean of the global window.
"""
from __future__ import annotations

import importlib.util
import os

from .config import Config, ConfigError
from ..models.spec import spec_of
from .precisions import get

LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launcher_env() -> dict[str, int]:
    """The launcher variables that are set (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), as integers; a malformed
    one, even left in a shell by hand, raises ConfigError (one line)."""
    environ = os.environ
    allowed = "set by torchrun / accelerate launch; unset it when not launching several processes"
    got = {}
    for name in LAUNCHER_VARS:
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            raise ConfigError("environment", name, raw, f"must be a whole number ({allowed})") from None
        low = 1 if name.endswith("WORLD_SIZE") else 0
        if value < low:
            raise ConfigError("environment", name, raw, f"must be >= {low} ({allowed})")
        got[name] = value
    world = got.get("WORLD_SIZE", 1)
    if world > 1 and "RANK" not in got:
        raise ConfigError("environment", "RANK", None, f"must be set when WORLD_SIZE={world} ({allowed})")
    if world > 1 and got["RANK"] >= world:
        raise ConfigError("environment", "RANK", environ["RANK"], f"must be < WORLD_SIZE={world} ({allowed})")
    return got


def launched_by_accelerate() -> bool:
    """``accelerate launch`` (which always sets ACCELERATE_MIXED_PRECISION) or ``torchrun`` with >1 process."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ or launcher_env().get("WORLD_SIZE", 1) > 1


def is_main_process() -> bool:
    """Whether this process reports (prints the summary, writes --json): only RANK 0 in a launch of several processes
    (WORLD_SIZE > 1), else always."""
    env = launcher_env()
    return env.get("WORLD_SIZE", 1) <= 1 or env["RANK"] == 0


def compile_refusal(cfg: Config) -> ConfigError:
    """The one line for ``train.compile: true`` under ``accelerate launch`` / torchrun: the engine path does not
    compile (an engine-wrapped model would need the engine's own compile plugin), and never pretends to."""
    source = cfg.origins.get("train.compile", cfg.source)
    return ConfigError(source, "train.compile", True,
                       "not supported when launched by accelerate / torchrun (the engine path trains eagerly); "
                       "--set train.compile=false, or run in one process to compile")


def maybe_accelerator(cfg: Config):
    """An ``Accelerator`` when this process was started by ``accelerate launch``; None otherwise. ``train.compile:
    true`` is refused here, before any work (:func:`compile_refusal`)."""
    if not launched_by_accelerate():
        return None
    if cfg.train.compile:
        raise compile_refusal(cfg)
    wanted = {name: os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true" for name in ("FSDP", "DEEPSPEED")}
    if wanted["DEEPSPEED"] and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("accelerate config", "distributed_type", "DEEPSPEED",
                          "DeepSpeed was requested but the deepspeed package is not installed; "
                          "pip install -e '.[deepspeed]' (needs a CUDA toolkit), or use a DDP/FSDP config")
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError("accelerate launch", None, "accelerate", "the accelerate package is not installed; "
                                                                   "pip install -e '.[distributed]'")
    from . import device as dev
    from accelerate import Accelerator

    mixed = cfg.train.precision if get(cfg.train.precision).amp else "no"  # accelerate's names for fp16 / bf16
    acc = Accelerator(mixed_precision=mixed, cpu=not dev.cuda_available(),
                      gradient_accumulation_steps=cfg.train.accumulation_steps)
    for name, asked in wanted.items():
        if asked and acc.distributed_type.name != name:  # never run something else silently
            raise ConfigError("accelerate config", "distributed_type", name,
                              f"accelerate started {acc.distributed_type.name} instead (it supports {name} on CUDA "
                              f"GPUs only); on a CPU use DDP: torchrun --nproc_per_node 2 -m labutils run CONFIG")
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is not None:  # we feed batches ourselves (no DataLoader), so tell DeepSpeed the micro-batch size
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
        if cfg.train.max_grad_norm is not None and ds.is_auto("gradient_clipping"):
            ds.deepspeed_config["gradient_clipping"] = cfg.train.max_grad_norm
    return acc


def wrap_blocks(acc, model) -> None:
    """FSDP's wrap unit: the model's own block class (its spec's: GPT2Block, LlamaDecoderLayer), before prepare."""
    if getattr(acc.state, "fsdp_plugin", None) is not None:
        acc.state.fsdp_plugin.transformer_cls_names_to_wrap = [spec_of(model).block_class]


def uses_engine_optimizer(acc) -> bool:
    """DeepSpeed configs that name their own optimizer (CPU offload needs DeepSpeed's CPU Adam)."""
    ds = getattr(acc.state, "deepspeed_plugin", None) if acc else None
    return bool(ds and "optimizer" in ds.deepspeed_config)


def zero_bytes_per_gpu(params: int, stage: int, n_gpus: int, offload_optimizer: bool = False,
                       mixed_precision: bool = True) -> dict:
    """Model-state bytes per GPU under ZeRO (Rajbhandari et al. 2020), mixed precision: 2P weights + 2P gradients + 12P
    optimizer state (stage 1 shards the 12P, stage 2 also the gradients, stage 3 also the weights; offload moves the
    optimizer state to the CPU). Without mixed precision: 4P + 4P + 8P (the master copy is the weights)."""
    w, g, o = (2, 2, 12) if mixed_precision else (4, 4, 8)
    n = max(1, n_gpus)
    weights = w * params / (n if stage >= 3 else 1)
    grads = g * params / (n if stage >= 2 else 1)
    optim = 0 if offload_optimizer else o * params / (n if stage >= 1 else 1)
    return {"weights": int(weights), "grads": int(grads), "optimizer": int(optim),
            "total": int(weights + grads + optim), "cpu_optimizer": int(o * params / n) if offload_optimizer else 0}


def zero_table(params: int, activations_bytes: int, max_gpus: int = 8, mixed_precision: bool = True) -> list[dict]:
    """Per-GPU memory for ZeRO stages 0-3 (and ZeRO-2 + CPU optimizer offload) on 1..max_gpus GPUs:
    model state from :func:`zero_bytes_per_gpu` plus one micro-batch's activations, which sharding does not touch."""
    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_gpus} | {max(1, max_gpus)})
    rows = []
    for label, stage, off in (("DDP (no ZeRO)", 0, False), ("ZeRO-1", 1, False), ("ZeRO-2", 2, False),
                              ("ZeRO-2 + CPU offload", 2, True), ("ZeRO-3", 3, False)):
        row = {"setup": label}
        for n in counts:
            row[f"{n} GPU"] = zero_bytes_per_gpu(params, stage, n, off, mixed_precision)["total"] + activations_bytes
        rows.append(row)
    return rows
