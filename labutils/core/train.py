"""The course's one training loop, used by every notebook, the CLI and the benchmark.

Each optimizer step (lab 02 writes the same thing out by hand): for each micro-batch of the step's window, under
autocast (fp16 / bf16), ``loss = model(..., labels, num_items_in_batch=N).loss`` (the sum over tokens / N, the
window's target count) and ``scaler.scale(loss).backward()``; then ``scaler.unscale_`` (fp16, once, before clipping),
``clip_grad_norm_``, ``scaler.step(optimizer)`` and ``scaler.update()`` (fp16 skips a step whose grads overflowed),
``optimizer.zero_grad(set_to_none=True)``. Normalising by the *whole window's* N makes accumulation exact: (8 x 1),
(2 x 4) and (1 x 8) give the same gradient, padded or not; ``loss / accumulation_steps`` does not.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from . import device as dev
from . import env as _env
from .config import Config, validate
from .precisions import amp_precision, autocast as autocast_for, get, scaler as scaler_for  # noqa: F401 (lu's names)
from .data import LMDataset, build_dataset
from .compiling import compile_for_training, compiled_graphs, cpu_compile_untracked
from .memory import MemoryTracker, oom_text, release, start_check, state_bytes
from .flops import AttentionProbe, attention_kernel
from ..models.gpt2 import count_parameters, enable_checkpointing, load_model
from .run_result import (ALL_SKIPPED_MIN, NONFINITE_WINDOW, STATUSES, NonFiniteLossError,  # noqa: F401 (re-exported)
                         RunResult, divergence, first_timed_step, finish_timing, log_run)

def step_scheduler(scheduler) -> None:
    """Advance the learning-rate schedule by one optimizer step, skipped or not, as every loop of the course does;
    the warning torch gives when fp16's GradScaler skips the first step is expected here, so it is not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before",
                                category=UserWarning)
        scheduler.step()


def make_optimizer(model, cfg: Config, device: torch.device, accelerator=None):
    t = cfg.train
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    from .distributed import uses_engine_optimizer
    if uses_engine_optimizer(accelerator):  # DeepSpeed builds the optimizer its config names ("auto" = ours)
        from accelerate.utils import DummyOptim
        return DummyOptim(groups, lr=t.lr, weight_decay=t.weight_decay), None
    opt = torch.optim.AdamW(groups, lr=t.lr, fused=device.type == "cuda")
    warm = t.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched


def _start(cfg: Config, model, dataset: LMDataset, env: dict, device: torch.device, world: int = 1) -> RunResult:
    """A run's result before its first step (with the SDPA kernel it should use); the model in training mode,
    checkpointed as the config says."""
    result = RunResult(config=cfg.to_dict(), env=env, effective_batch_size=cfg.effective_batch_size * world,
                       tokens_per_step=cfg.effective_batch_size * world * dataset.seq_length,
                       parameters=count_parameters(model))
    model.train()
    if cfg.train.gradient_checkpointing:
        enable_checkpointing(model, cfg.train.checkpoint_every_n_layers)
    result.attention_kernel = attention_kernel(model, dataset.seq_length, dataset.padding_fraction > 0,
                                               cfg.train.precision, device)
    return result


def _aside(fn, *args) -> float:
    """Call ``fn(*args)``: bookkeeping that is not training; the seconds it took are left out of the step's time."""
    u = time.perf_counter()
    fn(*args)
    return time.perf_counter() - u


def train(cfg: Config, model: torch.nn.Module, dataset: LMDataset, device: torch.device | str | None = None, *,
          env: dict | None = None, progress: bool = True, desc: str | None = None, track_memory: bool = True,
          cpu_budget_bytes: int | None = None, inject_overflow_at=(), on_step=None, accelerator=None,
          scaler_kwargs: dict | None = None) -> RunResult:
    """Train ``model`` for ``cfg.train.steps`` optimizer steps on ``dataset``; return what was measured.
    ``inject_overflow_at``: steps at which one gradient is set to inf after backward (lab 01's demo); ``on_step(step,
    result, model, optimizer, scaler)`` after every step; ``scaler_kwargs``: fp16's ``torch.amp.GradScaler``;
    ``accelerator`` (:mod:`labutils.core.distributed`): the engine does autocast, scaling, accumulation, clipping."""
    validate(cfg)  # a config changed in code (a notebook cell) is checked as a file is, before any work
    if accelerator is not None:
        return _train_accelerated(cfg, model, dataset, accelerator, env=env, progress=progress, desc=desc,
                                  on_step=on_step)
    t = cfg.train
    device = torch.device(device or _env.default_device())
    result = _start(cfg, model, dataset, env or {}, device)
    compiling = compile_for_training(model, device) if t.compile else None  # in place; None: not asked
    compiled = compiling is not None and compiling.active
    data = dataset.to(device)
    real_positions = 0
    windows = data.windows(t.micro_batch_size, t.accumulation_steps, t.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    # On CUDA the allocator counts for free: track every step. On CPU the tracker costs Python work per operator,
    # so it covers the first two steps only (the second holds optimizer state), left out of the timing, and no
    # compiled step (cpu_compile_untracked), which the result says.
    untracked_why = cpu_compile_untracked(device, compiled, track_memory, cpu_budget_bytes)
    tracker = (MemoryTracker(device, cpu_budget_bytes=cpu_budget_bytes)
               if track_memory and untracked_why is None else None)
    tracked_steps = t.steps if device.type == "cuda" or tracker is None else min(t.steps, 2)
    optimizer = scheduler = None
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_env.matmul_precision(tf32=get(t.precision).tf32))
        if tracker:
            stack.enter_context(tracker)
        optimizer, scheduler = make_optimizer(model, cfg, device)
        autocast = autocast_for(t.precision, device)
        scaler = scaler_for(t.precision, device, **(scaler_kwargs or {}))
        probe = AttentionProbe()
        one = torch.ones((), device=device) if scaler else None
        graphs, compile_steps = compiled_graphs(), []
        retries = dev.memory_stats(device).get("num_alloc_retries")
        with _env.progress_bar(t.steps, desc or f"{cfg.model.name} {t.precision}", progress) as bar:
            mark = time.perf_counter()  # each step's time runs from the previous step's end to its own end
            for step in bar:
                untimed = 0.0  # bookkeeping that is not training: measured and left out of this step's time
                window = next(windows)
                loss_sum = torch.zeros((), device=device)
                for i, mb in enumerate(window.micro_batches):
                    # step 0's first forward (a warm-up) records the SDPA kernel that really ran (eager or compiled)
                    with autocast, (probe if step == 0 and i == 0 else contextlib.nullcontext()):
                        loss = model(**mb, num_items_in_batch=window.num_targets, use_cache=False).loss
                    (scaler.scale(loss) if scaler else loss).backward()
                    loss_sum += loss.detach()
                if step in inject_overflow_at:
                    params[0].grad.view(-1)[0] = float("inf")
                if scaler:
                    used = scaler.scale(one)  # the scale this step used, kept on the device (get_scale() would sync)
                    scaler.unscale_(optimizer)
                if t.max_grad_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
                else:
                    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                step_scheduler(scheduler)
                if step == t.steps - 1:  # model state as the run ends, gradients still allocated
                    u = time.perf_counter()
                    result.memory = state_bytes(model, optimizer)
                    untimed += time.perf_counter() - u
                optimizer.zero_grad(set_to_none=True)
                # The step's one host read: loss, grad norm and (fp16) the scale before and after update(), in one
                # transfer. It waits for the device, so the step time is real.
                read = [loss_sum, norm.float()] + ([used, scaler.scale(one)] if scaler else [])
                value, grad_norm, *scales = torch.stack(read).tolist()
                if scaler:
                    result.loss_scales.append(scales[0])
                    if scales[1] < scales[0]:  # update() lowers the scale exactly when step() skipped
                        result.skipped.append(step)
                result.attention_kernel = probe.kernel or result.attention_kernel
                if not math.isfinite(value) and not scaler:
                    raise NonFiniteLossError(
                        f"step {step}: loss is {value} with precision {t.precision}. Lower train.lr, set "
                        f"train.max_grad_norm, or check the data; fp16 needs its GradScaler (this loop uses one).")
                result.losses.append(value)
                result.grad_norms.append(grad_norm)
                result.target_tokens.append(window.num_targets)
                real_positions += window.num_real
                if progress:
                    bar.set_postfix(loss=f"{value:.3f}", refresh=False)
                if compiled and compiled_graphs() != graphs:  # torch.compile compiled during this step
                    graphs = compiled_graphs()
                    compile_steps.append(step)
                if step == 0:  # lazily loaded kernels and backward's cuBLAS workspace now exist: the cap follows
                    untimed += _aside(dev.follow_outside, device)
                if on_step:
                    untimed += _aside(on_step, step, result, model, optimizer, scaler)
                if tracker and step + 1 == tracked_steps:
                    u = time.perf_counter()
                    stack.close()  # ends the tracker (and restores TF32 flags: re-entered below)
                    stack.enter_context(_env.matmul_precision(tf32=get(t.precision).tf32))
                    untimed += time.perf_counter() - u
                now = time.perf_counter()
                result.step_times.append(now - mark - untimed)
                result.untimed_seconds += untimed
                mark = now
        if retries is not None:
            result.num_alloc_retries = dev.memory_stats(device).get("num_alloc_retries", retries) - retries
    except torch.OutOfMemoryError as exc:
        stack.close()  # ends the tracker: its peak is the memory reached when allocation failed
        if tracker:
            exc.peak_memory_bytes = tracker.peak_bytes
        raise
    finally:
        stack.close()
        del optimizer, scheduler
    why = divergence(result.losses, result.skipped, t.precision)
    if why:
        result.status, result.error = "diverged", why
    if tracker:
        result.peak_memory_bytes = tracker.peak_bytes
        result.peak_reserved_bytes = tracker.peak_reserved_bytes
        result.memory.update(start_bytes=tracker.start_bytes, peak_bytes=tracker.peak_bytes,
                             end_bytes=tracker.end_bytes, reserved_bytes=tracker.reserved_bytes,
                             peak_reserved_bytes=tracker.peak_reserved_bytes, tracked_steps=tracked_steps)
    elif untracked_why:
        result.memory.update(tracked_steps=0, not_tracked=untracked_why)
    slow = tracked_steps if device.type != "cuda" and tracker is not None else 0
    first = first_timed_step(t.steps, t.timing_warmup_steps, compile_steps, slow)
    finish_timing(result, cfg, dataset.seq_length, device, first, compile_steps, real_positions, compiling, model)
    log_run(result, cfg, desc)
    return result


def prepare(cfg: Config, device: torch.device | str | None = None, verbose: bool = True):
    """Model, tokenizer and dataset for a config: ``loaded, dataset = prepare(cfg)``."""
    device = torch.device(device or _env.default_device())
    start_check(device, f"loading {cfg.model.name}")  # from the lab's baseline, whatever a cell left before
    loaded = load_model(cfg.model, device, seed=cfg.train.seed, verbose=verbose)
    return loaded, build_dataset(cfg.data, loaded.tokenizer)


def for_this_card(cfg: Config, device: torch.device | str | None = None) -> tuple[Config, list[str]]:
    """What ``run`` and ``bench`` train on this GPU, with one line per change: a mixed precision the GPU lacks becomes
    :func:`labutils.core.precisions.amp_precision`'s choice, and in full mode the micro-batch is the largest the
    estimator fits on this card (:func:`labutils.estimator.advise.default_budget_bytes`), accumulating to the same
    effective batch; an unset loss chunk is sized by the same estimate. A key set with ``--set`` wins. On the CPU: the
    config as it is (an unset chunk: one)."""
    device = torch.device(device or _env.default_device())
    if device.type != "cuda":
        return cfg, []
    lines = []
    p = get(cfg.train.precision)
    native, why = p.native(device)
    if p.amp and not native and "train.precision" not in cfg.origins:
        cfg = cfg.override({"train.precision": amp_precision(device)[0]})
        scaled = " with its GradScaler" * get(cfg.train.precision).scaler
        lines.append(f"NOTICE: {why}: training in {cfg.train.precision}{scaled} instead of emulated {p.name} "
                     f"(--set train.precision={p.name} to insist)")
    from ..estimator.advise import default_budget_bytes, fit_loss_chunk, fit_micro_batch

    if cfg.mode == "full" and "train.micro_batch_size" not in cfg.origins:
        cfg, line = fit_micro_batch(cfg, *default_budget_bytes())
        lines += [line] if line else []
    cfg, line = fit_loss_chunk(cfg, *default_budget_bytes())  # an unset chunk: one, where the logits fit
    return cfg, lines + ([line] if line else [])


def run(cfg: Config, device: torch.device | str | None = None, *, progress: bool = True, desc: str | None = None,
        verbose: bool = True, **train_kw) -> RunResult:
    """Load, train, measure and clean up one configuration: an OOM becomes ``status="oom"`` (with the memory reached), a
    non-finite loss ``status="diverged"``, never a crash; memory is released either way."""
    from .distributed import maybe_accelerator

    validate(cfg)  # before loading anything: a config changed in code is checked as a file is
    accelerator = maybe_accelerator(cfg)
    if accelerator is not None:
        device, train_kw = accelerator.device, {**train_kw, "accelerator": accelerator}
        progress = progress and accelerator.is_main_process
        verbose = verbose and accelerator.is_main_process
    device = torch.device(device or _env.default_device())
    if device.type == "cuda":  # an unset loss chunk, sized for this card as the CLI sizes it (for_this_card)
        from ..estimator.advise import default_budget_bytes, fit_loss_chunk

        cfg, line = fit_loss_chunk(cfg, *default_budget_bytes())
        if line and verbose:
            print(line)
    _env.seed_everything(cfg.train.seed)
    env = _env.environment(device, cfg.mode)
    loaded = dataset = None
    cuda = device.type == "cuda"
    if cuda:
        release()
        dev.reset_peak(device)
    try:
        loaded, dataset = prepare(cfg, device, verbose=verbose)
        env["weights"], env["tokenizer"] = loaded.weights, loaded.tokenizer.name
        result = train(cfg, loaded.model, dataset, device, env=env, progress=progress, desc=desc, **train_kw)
    except RuntimeError as exc:  # torch.OutOfMemoryError, or an OOM outside the allocator (cuBLAS, kernel load)
        if not dev.is_oom(exc):
            raise
        env.setdefault("weights", None)
        # CPU: the tracker's peak when the budget was hit
        peak = dev.peak_allocated(device) if cuda else getattr(exc, "peak_memory_bytes", None)
        result = RunResult(config=cfg.to_dict(), env=env, status="oom", error=oom_text(exc),
                           effective_batch_size=cfg.effective_batch_size, peak_memory_bytes=peak,
                           peak_reserved_bytes=dev.peak_reserved(device) if cuda else None)
    except NonFiniteLossError as exc:
        result = RunResult(config=cfg.to_dict(), env=env, status="diverged", error=str(exc),
                           effective_batch_size=cfg.effective_batch_size)
    finally:
        loaded = dataset = None  # the model and data go before release() frees their memory
        release()
    return result


def _train_accelerated(cfg: Config, model, dataset: LMDataset, acc, *, env=None, progress=True, desc=None,
                       on_step=None) -> RunResult:
    """The same step as :func:`train`, with the engine doing what the single-process loop does by hand."""
    t, world, rank = cfg.train, acc.num_processes, acc.process_index
    from .distributed import compile_refusal, wrap_blocks
    if t.compile:  # maybe_accelerator refuses it before any work; a caller passing its own accelerator too
        raise compile_refusal(cfg)
    device = acc.device
    result = _start(cfg, model, dataset, {**(env or {}), "world_size": world,
                                          "distributed_type": str(acc.distributed_type)}, device, world)
    data = dataset.to(device)
    real_positions = 0
    # the global window of each step, identical on every rank; rank r takes micro-batches [r*accum, (r+1)*accum)
    windows = data.windows(t.micro_batch_size, t.accumulation_steps * world, t.seed)
    optimizer, scheduler = make_optimizer(model, cfg, device, acc)
    if scheduler is None:
        from accelerate.utils import DummyScheduler
        scheduler = DummyScheduler(optimizer, total_num_steps=t.steps, warmup_num_steps=t.warmup_steps)
    wrap_blocks(acc, model)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    tracker = MemoryTracker(device) if device.type == "cuda" else None
    shown, desc = progress and acc.is_main_process, desc or f"{cfg.model.name} {t.precision} x{world}"
    with (tracker or contextlib.nullcontext()), _env.matmul_precision(tf32=get(t.precision).tf32), \
            _env.progress_bar(t.steps, desc, shown) as bar:
        mark = time.perf_counter()  # as in train(): each step's time runs from the previous step's end to its own
        for step in bar:
            untimed = 0.0
            window = next(windows)
            mine = window.micro_batches[rank * t.accumulation_steps:(rank + 1) * t.accumulation_steps]
            norm_items = window.num_targets / (t.accumulation_steps * world)  # engine: /accum, DDP: mean
            token_loss, norm = torch.zeros((), device=device), None
            for mb in mine:
                with acc.accumulate(model):
                    loss = model(**mb, num_items_in_batch=norm_items, use_cache=False).loss
                    acc.backward(loss)
                    token_loss += loss.detach() * norm_items
                    if acc.sync_gradients and t.max_grad_norm is not None:
                        norm = acc.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            value = (acc.reduce(token_loss, reduction="sum") / window.num_targets).item()
            if step == 0:  # as in train(): lazily loaded kernels, backward's cuBLAS workspace: the cap follows
                untimed += _aside(dev.follow_outside, device)
            if acc.optimizer_step_was_skipped:
                result.skipped.append(step)
            if not math.isfinite(value) and not get(t.precision).scaler:
                raise NonFiniteLossError(f"step {step}: loss is {value} with precision {t.precision}")
            result.losses.append(value)
            if t.max_grad_norm is not None and norm is not None:
                result.grad_norms.append(float(norm))
            result.target_tokens.append(window.num_targets)
            real_positions += window.num_real
            if on_step:
                untimed += _aside(on_step, step, result, model, optimizer, None)
            now = time.perf_counter()
            result.step_times.append(now - mark - untimed)
            result.untimed_seconds += untimed
            mark = now
    why = divergence(result.losses, result.skipped, t.precision)
    if why:
        result.status, result.error = "diverged", why
    if tracker:  # CPU ranks: no peak (None, as _start left it)
        peak = torch.tensor(tracker.peak_bytes, device=device)
        result.peak_memory_bytes = int(acc.reduce(peak, reduction="max"))  # the busiest rank
    finish_timing(result, cfg, dataset.seq_length, device,
                   first_timed_step(t.steps, t.timing_warmup_steps), (), real_positions, model=acc.unwrap_model(model))
    acc.free_memory()
    return result
