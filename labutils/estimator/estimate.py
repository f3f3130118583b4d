"""Predict the memory of a training run before running it (lab 04): ``estimate_memory(cfg)`` replays one step
(:mod:`labutils.estimator.replay`) and returns the peak and its parts. Here: the :class:`Plan` a replay follows, what
fits a budget (:func:`fits`, :func:`largest_batch`), an estimate against a measurement. Advice: :mod:`.advise`."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.cards import CUDA_CONTEXT_BYTES
from ..core.config import validate
from ..models.spec import gpt2_only
from ..core import device as dev
from ..core.precisions import get
from .replay import CUBLAS_WORKSPACE_BYTES, Replay, cublas_workspace_bytes
from .replay_ledger import KINDS

GiB = 2**30
HEADROOM = 0.10                       # allocator rounding / fragmentation: reserved is usually 5-15 % above peak
EAGER_BASIS = "the eager step, tensor by tensor"
# inductor fuses elementwise chains and its partitioner may recompute cheap ops instead of saving them
COMPILE_BASIS = ("torch.compile assumed to hold what the eager step holds (inductor usually saves less); "
                 "not measured on a compiled step")


# ---- What a run looks like, in numbers -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Everything the estimate depends on. Built from a labutils Config by :func:`plan_from_config`."""
    model: str = "gpt2"         # a GPT-2 preset (another model, its spec or config: refused in one line)
    seq: int = 128
    micro: int = 4
    accum: int = 1
    precision: str = "fp32"
    checkpointing: bool = False
    every_n: int = 1
    attn: str = "sdpa"          # sdpa | sdpa_causal (no mask even when padded) | eager
    activation: str = "gelu_new"  # gelu_new (a chain of pow/mul/tanh) | gelu_pytorch_tanh (one kernel)
    pad_vocab_to: int | None = None  # the LM head / wte rows rounded up to this multiple (padded logits too)
    compile: bool = False       # torch.compile: memory modelled as the eager step (see COMPILE_BASIS)
    loss: str = "full"          # full | chunked: the LM head and loss a chunk of positions at a time
    loss_chunk: int | None = None  # chunked: positions per chunk (None: one chunk, the whole micro-batch)
    dropout: bool = True        # GPT-2's own 0.1 unless the config sets 0
    padded: bool = False        # batches with padding get a 4-D attention mask (no flash kernel)
    num_samples: int = 0        # the dataset lives on the device: 3 int64 tensors of num_samples x seq
    device: str = "cuda"        # cuda: predict CUDA; cpu: the CPU kernels (to check against the CPU tracker)
    workspace_bytes: int = 2 * CUBLAS_WORKSPACE_BYTES  # forward thread + autograd thread each get one

    @property
    def amp(self) -> bool:
        return get(self.precision).amp

    @property
    def effective_batch(self) -> int:
        return self.micro * self.accum


def plan_from_config(cfg, device: str = "cuda", **overrides) -> Plan:
    """A :class:`Plan` from a labutils Config, checked as ``lu.run`` checks it (a value set in code: "FP16", "4");
    keyword overrides win (micro=, accum=, precision=, ...)."""
    t, d, m = validate(cfg).train, cfg.data, cfg.model
    plan = Plan(model=m.name, seq=d.seq_length, micro=t.micro_batch_size, accum=t.accumulation_steps,
                precision=t.precision, checkpointing=t.gradient_checkpointing, every_n=t.checkpoint_every_n_layers,
                attn=m.attn_implementation, dropout=(m.dropout is None or m.dropout > 0), padded=not d.pack,
                num_samples=d.num_samples, device=device, activation=m.activation, pad_vocab_to=m.pad_vocab_to,
                compile=t.compile, loss=m.loss, loss_chunk=m.loss_chunk_size,
                workspace_bytes=gpu_workspace_bytes(device))
    return replace(plan, **overrides)


def gpu_workspace_bytes(device: str = "cuda") -> int:
    """The two cuBLAS workspaces of a training step (the forward's thread and autograd's each get one) on the GPU
    the prediction is for: this machine's when it has one, else a student's pre-Hopper card's."""
    cap = dev.capability("cuda") if device == "cuda" and dev.cuda_available() else None
    return 2 * cublas_workspace_bytes(cap[0] if cap else None)


def parameter_count(model, pad_vocab_to: int | None = None) -> int:
    """Parameters of a GPT-2 preset (LM head tied to the token embedding), from its shape alone: the replay's AdamW
    groups; with ``pad_vocab_to`` the embedding has the padded vocabulary's rows."""
    return sum(map(sum, Replay(Plan(model=model, pad_vocab_to=pad_vocab_to)).param_groups()))


# ---- The estimate, and what fits a budget ----------------------------------------------------------------------------
def estimate_plan(plan: Plan) -> dict:
    """The estimate for a :class:`Plan` (see :func:`estimate_memory`)."""
    replay = Replay(plan)
    led = replay.run()
    P = parameter_count(plan.model, plan.pad_vocab_to)
    # activations: what one micro-batch's forward leaves saved for backward (replayed once more to read it)
    probe = Replay(plan)
    probe.forward("probe")
    acts = probe.led.saved_bytes()
    half = probe.led.saved_bytes(("half_weights",))
    kinds = {k: int(led.peak_kinds.get(k, 0)) for k in KINDS}
    return {"model": plan.model, "parameters": P, "device": plan.device,
        "precision": plan.precision, "micro_batch_size": plan.micro, "accumulation_steps": plan.accum,
        "seq_length": plan.seq, "gradient_checkpointing": plan.checkpointing,
        "checkpoint_every_n_layers": plan.every_n, "attn_implementation": plan.attn,
        "activation": plan.activation, "vocab_rows": replay.V, "compile": plan.compile,
        "basis": COMPILE_BASIS if plan.compile else EAGER_BASIS, "params_bytes": 4 * P, "grads_bytes": 4 * P,
        "optimizer_bytes": 8 * P,
        "activations_bytes": acts,                      # saved for backward by one micro-batch's forward
        "half_weights_bytes": half,                     # autocast's weight copies saved for backward
        "logits_bytes": 4 * replay.N * replay.V,        # one FP32 [B, T, V] tensor (the loss holds 2-3)
        "loss": plan.loss,                              # chunked: never more than one chunk's logits at once
        "saved_logits_bytes": probe.led.saved_bytes(("logits",)),  # chunked: none (its gradients are saved)
        "loss_chunk_bytes": (4 * min(plan.loss_chunk or replay.N, replay.N) * replay.V  # None: one chunk of all
                             if plan.loss == "chunked" else None),
        "peak_bytes": led.peak,                         # compare with torch.cuda.max_memory_allocated()
        "peak_phase": led.peak_phase, "peak_breakdown": kinds,
        "resident_bytes": led.timeline[0][1],           # weights + dataset (+ workspace) before training
        "timeline": [{"label": lb, "bytes": cur, "peak": pk} for lb, cur, pk in led.timeline],
    }


def estimate_memory(cfg, device: str = "cuda", **overrides) -> dict:
    """Predicted memory of ``lu.run(cfg)`` in bytes: params/grads/optimizer/activations/peak and more.

    ``device="cuda"`` (default) predicts CUDA on any machine; ``device="cpu"`` replays the CPU kernels, to compare with
    the CPU tracker. Overrides: micro=, accum=, precision=, checkpointing=, every_n=, seq=, padded=, dropout=, attn=,
    num_samples=, activation=, pad_vocab_to=, compile=, loss=, loss_chunk=."""
    return estimate_plan(plan_from_config(cfg, device=device, **overrides))


def activation_table(cfg=None, device: str = "cuda", **overrides) -> list[dict]:
    """What one transformer block saves for backward, tensor by tensor, in bytes per token (and per layer)."""
    plan = plan_from_config(cfg, device=device, **overrides) if cfg is not None else Plan(device=device, **overrides)
    plan = replace(plan, checkpointing=False)
    r = Replay(plan)
    r.led.alloc("res.0", 4 * r.N * r.h, "activations", True)
    r.block_forward(0)
    rows = []
    for name, (nbytes, kind, saved) in r.led.live.items():
        if not saved or name == "res.1":
            continue
        what = name.split(".", 1)[1] if name.startswith("h0.") else "block input (residual, fp32)"
        rows.append({"tensor": what, "kind": kind, "bytes": nbytes, "bytes_per_token": nbytes / r.N,
                     "per_token_hidden": nbytes / (r.N * r.h)})
    return rows


def korthikanti_bytes_per_layer(model, seq: int, micro: int, flash: bool = True) -> int:
    """Korthikanti et al. 2022, eq. (1): s*b*h*(34 + 5*a*s/h) bytes per layer (16-bit activations)."""
    s = gpt2_only("labutils.estimator.estimate", model)
    h, a = s.d_model, s.n_head
    return int(seq * micro * h * (34 + (0 if flash else 5 * a * seq / h)))


def fits(estimate: dict, budget_bytes: int, context_bytes: int = CUDA_CONTEXT_BYTES,
         headroom: float = HEADROOM) -> bool:
    """Fits if the allocator's peak plus headroom plus the CUDA context stays within the budget."""
    return estimate["peak_bytes"] * (1 + headroom) + context_bytes <= budget_bytes


def compare(estimate: dict, measured_peak: int | None, measured_start: int | None = None, device: str = "cuda") -> dict:
    """Estimate vs measurement. CUDA: absolute peaks (what decides an OOM). CPU: peaks above the start of the run, as
    the CPU tracker also counts every other CPU tensor alive in the process."""
    if device == "cuda" or measured_start is None:
        e, m, basis = estimate["peak_bytes"], measured_peak, "absolute peak"
    else:
        e, m, basis = estimate["peak_bytes"] - estimate["resident_bytes"], measured_peak - measured_start, \
            "peak above start"
    err = 100.0 * (e - m) / m if m else None
    return {"basis": basis, "estimated_bytes": e, "measured_bytes": m, "error_pct": err}


def largest_batch(cfg, budget_bytes: int, *, device: str = "cuda", safe: bool = True, limit: int = 4096,
                  context_bytes: int = CUDA_CONTEXT_BYTES, headroom: float = HEADROOM, **overrides) -> int:
    """The largest micro-batch predicted to fit: ``safe`` applies the CUDA context and the headroom
    (:func:`fits`); otherwise the raw allocator peak is compared with the budget."""
    def ok(b):
        e = estimate_memory(cfg, device=device, micro=b, **overrides)
        return fits(e, budget_bytes, context_bytes, headroom) if safe else e["peak_bytes"] <= budget_bytes

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
