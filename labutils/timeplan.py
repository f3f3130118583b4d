"""How long the instructors' full run takes on a card, predicted before it starts (``regenerate --plan``), and what
it took afterwards, side by side.

A lab's cost is its training runs (:data:`LAB_RUNS`: the configs and overrides its cells train with ``lu.run`` /
``lu.train``, in full mode) plus a fresh kernel's fixed cost. One run costs ``steps x max(compute, host)``:

* compute: the step's executed FLOPs (:func:`labutils.flops.flops_per_token`, checkpointing's recompute and the
  fused attention's included) over the card's dense peak in that precision (:mod:`labutils.peaks`) times
  :data:`ACHIEVED`, the share of the peak such a step reaches;
* host: eager PyTorch's Python and kernel-launch time, which sets the pace of a model this small on a fast card:
  :data:`HOST_BLOCK_S` per transformer block and micro-batch (forward + backward), more under autocast (casts) and
  with checkpointing (the recompute launches again), plus :data:`HOST_STEP_S` per optimizer step.

The constants are assumptions, set from the one full GPU run so far (an H200, torch 2.11, on 2026-11-26: GPT-2
small at 8 x 256 tokens took 48.0 ms per FP32 step, 27.2 TF32, 35.8 FP16 and 38.1 BF16, its BF16 kernels busy 43 %
of the step; the doctor 64 s of checks and 64 s compiling the fast path). Every full ``regenerate`` prints its
prediction first and the lab's real time beside it at the end: that is how they are checked, and corrected.
"""
from __future__ import annotations

from .config import load_config
from .flops import flops_per_token
from .models import PRESETS, padded_vocab_size, vocab_size
from .peaks import peak_tflops

ACHIEVED = {"fp32": 0.5, "tf32": 0.3, "fp16": 0.25, "bf16": 0.25}  # share of the dense peak a GPT-2 step reaches
HOST_BLOCK_S = 1.6e-3      # host seconds per block and micro-batch, forward + backward, FP32 (TF32 run: 27.2 ms)
AUTOCAST_HOST = 1.5        # autocast's casts: more launches per block (BF16 run: 38.1 ms, host-bound)
CHECKPOINT_HOST = 1.4      # a checkpointed block launches its forward twice
HOST_STEP_S = 8e-3         # clipping + AdamW + zero_grad per optimizer step
LOAD_S = 1.0               # building a model on the GPU, moving the dataset there
KERNEL_S = 20.0            # a fresh kernel: imports, setup, the lab's figures and tables, record_results
DOCTOR_S = 64.0            # doctor's checks (H200 run)
COMPILE_S = 64.0           # doctor compiling the fast path (H200 run)
GOAL_S = 8 * 60            # the whole course (doctor + four labs) within one device command (issue 39)


def run_cost(cfg, gpu_name: str | None, device: str = "cuda") -> dict:
    """FLOPs and predicted seconds of ``lu.run(cfg)`` on ``gpu_name`` (``device="cpu"``: the FLOPs a CPU run counts,
    no fused attention, for checking against a smoke run's own counts; its seconds mean nothing)."""
    t, m, d = cfg.train, cfg.model, cfg.data
    fused = device == "cuda" and m.attn_implementation in ("sdpa", "sdpa_causal")
    per_token = flops_per_token(m.name, d.seq_length, recompute=t.gradient_checkpointing,
                                every_n_layers=t.checkpoint_every_n_layers, dropout=m.dropout is None or m.dropout > 0,
                                fused_attention=fused, causal_skip=fused and (d.pack or m.attn_implementation == "sdpa_causal"),
                                vocab=padded_vocab_size(vocab_size(m.name), m.pad_vocab_to),
                                head_recompute=m.loss == "chunked")
    step_flops = per_token * t.micro_batch_size * t.accumulation_steps * d.seq_length
    precision = t.precision
    peak = peak_tflops(gpu_name, precision) or peak_tflops(gpu_name, "fp32")
    compute = step_flops / (peak * 1e12 * ACHIEVED.get(precision, ACHIEVED["fp32"])) if peak else None
    host = (t.accumulation_steps * PRESETS[m.name][0] * HOST_BLOCK_S
            * (AUTOCAST_HOST if precision in ("fp16", "bf16") else 1)
            * (CHECKPOINT_HOST if t.gradient_checkpointing else 1) + HOST_STEP_S)
    step = max(compute or 0.0, host)
    return {"steps": t.steps, "flops": step_flops * t.steps, "compute_s": compute, "host_s": host,
            "bound": "host" if host >= (compute or 0.0) else "compute", "seconds": t.steps * step + LOAD_S}
