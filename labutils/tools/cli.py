"""``python -m labutils run CONFIG [--set KEY=VALUE ...] [--json PATH]`` and ``bench``.

A bad config, override or corpus exits with code 2 and one line that names the file, key, value and what is
allowed; nothing runs.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading

from ..core.cards import budget_from_env, card_gb
from ..core.config import ConfigError, load_config, shown
from ..core.results import OutputPathError, WriteError, check_output_file, write_json


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own code for usage errors)
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------------------------ typed CLI numbers
# argparse calls these on the raw text; ArgumentTypeError becomes "error: argument --x: <message>", exit 2.
def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not {'an integer' if kind is int else 'a number'}") \
            from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown(text)}: must be a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (--repeats, --gpus)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{shown(text)}: must be an integer >= 1")
    return value


def gpu_memory_gb(text: str) -> float:
    """``--gpu-memory-gb``: GiB of GPU memory by the one rule (:func:`labutils.core.cards.card_gb`); 0 = no cap."""
    value = _number(text, float)
    try:
        card_gb(value, "--gpu-memory-gb")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(" = ", 1)[1]) from None
    return value


def env_gpu_memory_gb() -> float | None:
    """``LAB_GPU_MEMORY_GB`` by :func:`gpu_memory_gb`'s rule (:func:`labutils.core.cards.budget_from_env`), in every
    command: None when unset, empty or 0; a bad value is a :class:`ConfigError` (exit 2) before any work."""
    try:
        return budget_from_env()
    except ValueError as exc:
        raise ConfigError("environment", "LAB_GPU_MEMORY_GB", os.environ["LAB_GPU_MEMORY_GB"].strip()[:40],
                          str(exc).split(": ", 1)[1]) from None


def _inputs(args, cfg) -> dict:
    corpus = cfg.data.corpus if cfg.data.corpus != "builtin" else None
    return {"config file": args.config, "corpus (data.corpus)": corpus}


GPU_MEMORY_HELP = "0 = no cap: the whole card"


def _add_config_args(p):
    p.add_argument("config", help="YAML config, e.g. configs/fp16_config.yaml")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. --set train.steps=3 model.name=gpt2-medium (repeatable)")


def print_summary(result) -> None:
    from ..core.memory import fmt_bytes
    from ..core.peaks import peak_info

    d = result.to_dict()
    t = d["config"]["train"]
    rows = [("model", f"{d['config']['model']['name']} ({result.parameters / 1e6:.1f}M params, "
                  f"{d['env'].get('weights')} weights)"),
        ("tokenizer", d["env"].get("tokenizer")), ("device", d["env"].get("gpu_name") or d["env"].get("device")),
        ("mode", d["env"].get("mode")), ("precision", t["precision"]),
        ("batch", f"{t['micro_batch_size']} x {t['accumulation_steps']}"
                  + (f" x {d['env']['world_size']} processes" if d["env"].get("world_size", 1) > 1 else "")
                  + f" = {result.effective_batch_size} sequences of {d['config']['data']['seq_length']} tokens"),
        ("checkpointing", t["gradient_checkpointing"]),
        ("status", result.status + (f": {result.error}" if result.error else "")),
    ]
    if result.ok:
        rows.append(("loss", f"{d['losses'][0]:.4f} -> {d['final_loss']:.4f} (avg {d['avg_loss']:.4f}, "
                             f"{len(d['losses'])} steps)"))
        if result.compile_seconds is not None:
            rows.append(("compile", f"{result.compile_seconds:.1f} s (the compiling steps' extra time; not in the "
                                    f"step time), {result.compiled_graphs} graphs, "
                                    f"{len(result.graph_breaks)} graph breaks"))
        if result.compile_fallback:
            rows.append(("compile", f"NOT COMPILED: {result.compile_fallback}"))
    if result.ok and not result.timed_steps:
        rows.append(("step time", f"no timed steps: train.steps ({t['steps']}) <= train.timing_warmup_steps "
                                  f"({t['timing_warmup_steps']}), or the last step compiled; raise train.steps"))
    elif result.ok:
        rows += [
            ("step time", f"{result.step_time_seconds * 1000:.1f} ms (median of the last {result.timed_steps} steps)"),
            ("throughput", f"{result.target_tokens_per_second:,.0f} target tokens/s (tokens that count in the loss; "
                           f"{result.positions_per_second:,.0f} positions/s, {result.padding_fraction:.0%} padding), "
                           f"{result.achieved_tflops:.3f} TFLOP/s"),
            ("attention", f"SDPA kernel: {result.attention_kernel}"),
            ("MFU / HFU", f"{result.mfu:.1%} / {result.hfu:.1%} of {result.peak_tflops:g} TFLOP/s "
                          f"({t['precision']} peak)" if result.mfu is not None else
                          "- (" + peak_info(d["env"].get("gpu_name"), t["precision"])[1] + ")"),
        ]
    if result.ok:
        rows += [("peak memory", fmt_bytes(result.peak_memory_bytes)
                  + (f", {result.num_alloc_retries} allocator retries (frees and retries near the cap: they slow the "
                     "step)" if result.num_alloc_retries else "")), ("skipped steps", result.skipped_steps)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _apply_budget(verbose: bool = True) -> None:
    """``LAB_GPU_MEMORY_GB``: behave like a card of that size, as the notebooks do (bad values exit 2 first)."""
    from ..core.env import apply_budget_from_env

    env_gpu_memory_gb()  # the --gpu-memory-gb rule (exit 2 on a bad value)
    budget = apply_budget_from_env()
    if budget and verbose:
        from ..core.device import budget_line
        print(budget_line(budget))


def cmd_run(args) -> int:
    from ..core.distributed import is_main_process
    from ..core.device import detect_mode
    from ..core.train import for_this_card, run

    mode, reason = detect_mode()
    cfg = load_config(args.config, args.overrides, mode=mode)
    main_process = is_main_process()  # a real launch of N processes: only rank 0 reports
    if main_process:
        check_output_file(args.json, "--json", _inputs(args, cfg))  # before any work: a bad path must not cost the run
    _apply_budget(verbose=main_process)
    # on a GPU: fp16 where it has no native BF16, in full mode the largest micro-batch that fits: a line per change
    cfg, changes = for_this_card(cfg)
    for line in [f"mode: {mode} ({reason})"] + changes if main_process else ():
        print(line)
    result = run(cfg, progress=not args.quiet)
    if not main_process:
        return 0 if result.ok else 1
    print_summary(result)
    if args.json:
        write_json(args.json, result.to_dict())
        print(f"wrote {args.json}")
    return 0 if result.ok else 1


def cmd_bench(args) -> int:
    from .bench import bench, check_steps

    cfg = load_config(args.config, args.overrides)  # (--repeats >= 1: checked by argparse, positive_int)
    check_steps(cfg)  # steps at or below the warm-up: nothing to time
    check_output_file(args.json, "--json", _inputs(args, cfg))  # before any work
    _apply_budget()
    out = bench(cfg, repeats=args.repeats)
    if args.json:
        write_json(args.json, {"config": cfg.to_dict(), **out})
        print(f"wrote {args.json}")
    return 0


def cmd_estimate(args) -> int:
    from ..estimator.advise import cli_estimate

    cfg = load_config(args.config, args.overrides, mode="full")  # estimates are for the real sizes
    check_output_file(args.json, "--json", _inputs(args, cfg))
    from_env = env_gpu_memory_gb()  # checked in every command, by the --gpu-memory-gb rule
    if args.gpu_memory_gb is None and from_env:  # the card to behave like: on a GPU and on the CPU alike
        args.gpu_memory_gb, args.gpu_memory_source = from_env, "LAB_GPU_MEMORY_GB="
    if args.gpu_memory_gb == 0:  # no cap: the whole card (as for regenerate), not a 0 GiB card
        args.gpu_memory_gb, args.whole_card = None, True
    return cli_estimate(cfg, args)


def cmd_doctor(args) -> int:
    from .doctor import cli_doctor

    check_output_file(args.json, "--json")  # before the checks run
    _apply_budget(verbose=False)  # (a bad LAB_GPU_MEMORY_GB exits 2 here; the doctor prints the budget itself)

    return cli_doctor(args)


def cmd_regenerate(args) -> int:
    from .regenerate import cli_regenerate

    return cli_regenerate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m labutils", description="GPT-2 single-GPU training-optimisation labs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("run", help="train one config and print what was measured")
    _add_config_args(p)
    p.add_argument("--json", metavar="PATH", help="write the full result record as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("bench", help="the one loop against a nanoGPT-style GPT-2 with the same weights in a bare loop: "
                                     "median step times (spread over ABBA repeats), their ratio and its verdict")
    _add_config_args(p)
    p.add_argument("--repeats", type=positive_int, default=5, help="runs of each loop, in ABBA order (default 5)")
    p.add_argument("--json", metavar="PATH", help="write both sides' step times, spread and the ratio as JSON")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("estimate", help="predict memory (params, grads, optimizer, activations, peak) and advise")
    _add_config_args(p)
    p.add_argument("--gpu-memory-gb", type=gpu_memory_gb, default=None, metavar="G",
                   help=f"GiB to fit in (default: this GPU's or its cap, else 8; {GPU_MEMORY_HELP})")
    p.add_argument("--gpus", type=positive_int, default=8, metavar="N", help="per-GPU memory under DDP / ZeRO, 1..N")
    p.add_argument("--json", metavar="PATH", help="write the estimate and recommendation as JSON")
    p.set_defaults(func=cmd_estimate)
    p = sub.add_parser("doctor", help="check this machine's GPU paths (run this first on a new machine)")
    p.add_argument("--json", metavar="PATH", help="write the checks and the environment as JSON")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("regenerate", help="re-execute the lab notebooks and regenerate results tables and figures")
    p.add_argument("--smoke", action="store_true", help="smoke mode (tiny model, CPU is fine); never writes results/")
    p.add_argument("--only", metavar="01,03", help="comma-separated lab numbers (default: every lab)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: results/<this GPU>/; --smoke: a temp one)")
    p.add_argument("--notebooks", metavar="DIR", help="folder of NN-*.ipynb notebooks to run there, with its configs/ "
                                                      "(default: the checkout's labs; never updates README.md)")
    p.add_argument("--gpu-memory-gb", type=gpu_memory_gb, default=8.0, metavar="G",
                   help=f"cap CUDA memory to G GiB, a student's card (default 8; {GPU_MEMORY_HELP})")
    p.add_argument("--skip-doctor", action="store_true", help="do not run the doctor first (full mode runs it)")
    p.add_argument("--bench", nargs="?", const=5, type=positive_int, metavar="N", help="then bench, N repeats (5)")
    p.add_argument("--part", type=positive_int, metavar="K", help="only the plan's K-th command (--plan lists them)")
    p.add_argument("--rehearse", action="store_true", help="the full run's path at smoke sizes, never into results/")
    p.add_argument("--plan", action="store_true", help="print the predicted time per lab on this GPU (or --gpu)")
    p.add_argument("--render-only", action="store_true", help="run nothing: the results page from --out's results")
    p.add_argument("--gpu", metavar="NAME", help="with --plan: the GPU to plan for, as torch names it (on a CPU too)")
    p.set_defaults(func=cmd_regenerate)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # usage errors (exit 2, one line already printed) and --help (0) return a code too
        return exc.code if isinstance(exc.code, int) else 2
    interrupted = []

    def on_ctrl_c(signum, frame):  # noted: an import interrupted inside transformers can surface as another error
        interrupted.append(signum)
        raise KeyboardInterrupt

    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN
    previous = signal.signal(signal.SIGINT, on_ctrl_c) if ours else None
    try:
        code = args.func(args)
        if interrupted:  # a library caught the KeyboardInterrupt and went on: still a Ctrl-C, and said so
            raise KeyboardInterrupt
        return code
    except (ConfigError, OutputPathError) as exc:  # bad input: 2, before any work; a write that failed after it: 1
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, WriteError) else 2
    except BaseException as exc:
        if not (isinstance(exc, KeyboardInterrupt) or interrupted):
            raise
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)
