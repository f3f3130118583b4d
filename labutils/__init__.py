"""labutils: what the four labs share. ``import labutils as lu``.

Modules: config (YAML -> dataclasses), env (mode, device, versions), data (corpus, sampler), models (GPT-2
sizes, offline fallback, checkpointing, FLOP counts), peaks (GPU peak TFLOP/s for MFU), memory (MemoryTracker), train (the one training loop), results (tables, figures, provenance), figures (step and
legend conventions), cli.
"""
from . import device
from .config import Config, ConfigError, load_config
from .data import LMDataset, build_dataset, load_documents
from .figures import legend_outside, step_axis, step_numbers
from .device import card_allocator_bytes, detect_mode
from .env import (apply_budget_from_env, bf16_supported, default_device, environment, matmul_precision,
                  seed_everything, set_memory_budget, setup, tf32_supported)
from .memory import MemoryTracker, fmt_bytes, release, state_bytes
from .flops import flops_per_token, model_flops_per_token
from .models import enable_checkpointing, load_model
from .peaks import peak_info, peak_tflops
from .results import format_table, mode_banner, read_results, record_results, show_table
from .train import RunResult, autocast_for, make_optimizer, prepare, run, scaler_for, step_scheduler, train

__all__ = [n for n in dir() if not n.startswith("_")]
