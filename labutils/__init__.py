"""labutils: what the four labs share, imported with one line: ``import labutils as lu``.

A map, one line a module. A lab imports its own module by name (``import labutils.labs.lab03.checkpointing as ck``);
``lu.`` holds what every lab uses. No import cycles, no use of another module's private names (tests/test_structure.py).

core/  the one training loop and what it measures with (every lab and command builds on these)
  config              YAML -> typed dataclasses, with the mode's defaults, --set overrides, strict validation
  precisions          every precision as data (autocast dtype, scaler, native support) and which one a device gets
  device              every CUDA/CPU difference in one place: memory counters, the cap, the mode, BF16/TF32
  device_facts        device's lowest layer: which device, its name, capability, BF16/TF32, compile support
  cards               the memory torch reports on common GPUs, from real OOM messages: what "a G GB card" means
  env                 where we run: the setup cell, device and version facts, seeds, TF32 switch, budget
  data                the offline corpus, tokenised into fixed-length samples; the accumulation-exact sampler
  memory              MemoryTracker: peak and live memory of a region, the same meaning on CUDA and CPU
  compiling           train.compile that really compiles: dynamo reset, backend probe, graph count, loud fallback
  run_result          RunResult (what a run measured), the divergence rule, the step-time rule (median of timed steps)
  train               the one training loop (AMP, accumulation, clipping, checkpointing); run, prepare
  distributed         the same loop under accelerate (DDP, FSDP, DeepSpeed ZeRO); ZeRO memory per GPU
  flops               FLOPs of a training step (model and executed), the SDPA kernel, MFU and HFU of a run
  peaks               dense peak TFLOP/s of NVIDIA GPUs per precision (the denominator of MFU)
  figures             conventions every lab's figures follow (step axis, legends)
  results             tables, figures and result files with the hardware and weights they came from
models/  the model family (GPT-2 sizes and tiny), weights and tokenizers, the spec of any causal LM
  gpt2                GPT-2 (sizes: model_spec): pretrained or random weights, the course's changes, checkpointing
  hub                 where weights and tokenizers come from: the hub probe, the local cache, GPT-2's BPE
  loss_chunks         model.loss chunked: LM head + cross-entropy a chunk of positions at a time, grads in forward
  reference           a nanoGPT-style GPT-2 that loads the course model's weights: bench's reference
  spec                a model's shape as data (ModelSpec), read from any causal LM's config; PRESETS: GPT-2 + tiny
estimator/  a training step's peak memory predicted without a GPU, and what fits a budget
  estimate            a training step's peak memory, predicted without a GPU, and what fits a budget
  replay              one training step replayed as tensor allocations: the estimator's engine
  replay_ledger       the replay's ledger: live tensors by name and kind, current and peak bytes
  replay_attention    the replay's attention: what SDPA / math / eager attention saves and frees
  replay_loss         the replay's LM head and loss: the full loss's logits, or the chunked loss's
  advise              what to run when a config does not fit (or could run faster); `labutils estimate`
labs/  the lab registry, the one 8 GB card, and one folder per lab (the technique is written out in the notebook)
  registry            the one list of labs: id, notebook, title, configs, the runs it trains, the claims it owns
  scale_model         "an 8 GB card" in every lab: its bytes for tensors, and in smoke one scale model for all four
labs/lab01/  lab 01, mixed precision
  precision           number formats, underflow and overflow, loss scaling
  amp_memory          where one step's memory goes under AMP (saved tensors, dtypes, peak phase); batch sweep
  amp_speed_memory    each precision timed once (the one speed-up), matmul speed, comparison, C1/C2
  op_profile          a training step op by op from torch.profiler: op groups, slowest ops, a fix
labs/lab02/  lab 02, gradient accumulation
  accumulation        bookkeeping of the cells' gradient experiments (memory, OOM rows)
  accumulation_sweeps the batch-split sweeps read out: fits, stability, learning rate, advice, C3
labs/lab03/  lab 03, gradient checkpointing
  checkpointing       Variant, and the model's own API (every k); the notebook writes out the others
  checkpoint_measure  each variant trained under a budget and checked (gradients, FLOPs, calls)
  checkpoint_report   tables, figures, conclusions and C4/C5 from what was measured
labs/lab04/  lab 04, memory profiling
  profiling           what autograd saves per module, profiler ops and ranges, allocator snapshot traces
  profiling_runs      every experiment as rows next to the estimator's prediction, under a budget
  profiling_figures   the lab's figures, from the rows its cells measured
  profiling_claims    C6 (all techniques in one loop) and C7 (ZeRO-2 + CPU offload, predicted or measured)
verdicts/  the original course's claims and the one rule that judges them
  claims              C1-C7, the original course's claims in its words, and the entries a lab records for them
  verdict_rule        the one rule that turns a run's numbers into a verdict: thresholds, evidence, not judged
tools/  the commands and what they share
  cli                 `python -m labutils run | bench | estimate | doctor | regenerate`
  doctor              `python -m labutils doctor`: every GPU path of the course, checked in minutes
  doctor_checks       the doctor's correctness checks: device functions, training, OOM, snapshots, estimator
  doctor_formats      the doctor's BF16 / TF32 checks: real ops on the device against labutils' answers
  doctor_speed        the doctor's speed checks: matmul TFLOP/s per format, the fast path's MFU (never a fail)
  bench               `python -m labutils bench`: the one loop against the reference, side by side
  regenerate          `python -m labutils regenerate`: re-run the notebooks, render results and README
  command_parts       what regenerate runs besides them (doctor, bench), each a child process; run.json
  notebook_runner     runs one notebook in a kernel, safely: timeouts, Ctrl-C, the failing line
  report              Markdown from result files: the results page and the README's tables
  timeplan            how long the full regeneration takes on a card: predicted first, then against actual
"""
import os as _os
import signal as _signal
import sys as _sys

if _sys.argv[:1] == ["-m"] and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    # `python -m labutils`: a Ctrl-C while the imports below load torch (seconds) is one line and exit 130, not a
    # traceback from inside torch; nothing is written yet. cli.main takes Ctrl-C over once it runs.
    _signal.signal(_signal.SIGINT, lambda *_: (print("interrupted", file=_sys.stderr, flush=True), _os._exit(130)))

from .core import device, precisions, results  # noqa: E402
from .core.config import ConfigError, load_config
from .core.data import LMDataset
from .core.figures import legend_outside, step_axis, step_numbers
from .core.device import card_allocator_bytes
from .core.env import environment, matmul_precision, seed_everything, set_memory_budget, setup
from .core.memory import MemoryTracker, fmt_bytes, release, set_baseline, start_check, state_bytes
from .models.spec import spec_of
from .models.gpt2 import disable_checkpointing, enable_checkpointing, load_model
from .core.peaks import peak_info, peak_tflops
from .core.precisions import amp_precision
from .core.results import mode_banner, read_results, record_results, show_table
from .core.train import RunResult, autocast_for, make_optimizer, prepare, run, scaler_for, step_scheduler, train

__all__ = [n for n in dir() if not n.startswith("_")]
