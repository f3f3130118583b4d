"""``python -m labutils run CONFIG [--set KEY=VALUE ...] [--json PATH]`` and ``bench``.

A bad config, override or corpus exits with code 2 and one line that names the file, key, value and what is
allowed; nothing runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError, load_config
from .results import write_json


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own code for usage errors)
        self.exit(2, f"error: {message} (see python -m labutils {self.prog.split()[-1]} --help)\n")


def _add_config_args(p):
    p.add_argument("config", help="YAML config, e.g. configs/fp16_config.yaml")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. --set train.steps=3 model.name=gpt2-medium (repeatable)")


def print_summary(result) -> None:
    from .memory import fmt_bytes

    d = result.to_dict()
    t = d["config"]["train"]
    rows = [
        ("model", f"{d['config']['model']['name']} ({result.parameters / 1e6:.1f}M params, {d['env'].get('weights')} weights)"),
        ("tokenizer", d["env"].get("tokenizer")),
        ("device", d["env"].get("gpu_name") or d["env"].get("device")),
        ("mode", d["env"].get("mode")),
        ("precision", t["precision"]),
        ("batch", f"{t['micro_batch_size']} x {t['accumulation_steps']}"
                  + (f" x {d['env']['world_size']} processes" if d["env"].get("world_size", 1) > 1 else "")
                  + f" = {result.effective_batch_size} sequences of {d['config']['data']['seq_length']} tokens"),
        ("checkpointing", t["gradient_checkpointing"]),
        ("status", result.status + (f": {result.error}" if result.error else "")),
    ]
    if result.ok:
        rows += [
            ("loss", f"{d['losses'][0]:.4f} -> {d['final_loss']:.4f} (avg {d['avg_loss']:.4f}, {len(d['losses'])} steps)"),
            ("step time", f"{result.step_time_seconds * 1000:.1f} ms"),
            ("throughput", f"{result.target_tokens_per_second:,.0f} target tokens/s (tokens that count in the loss; "
                           f"{result.positions_per_second:,.0f} positions/s, {result.padding_fraction:.0%} padding), "
                           f"{result.achieved_tflops:.3f} TFLOP/s"),
            ("attention", f"SDPA kernel: {result.attention_kernel}"),
            ("peak memory", fmt_bytes(result.peak_memory_bytes)),
            ("skipped steps", result.skipped_steps),
        ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def cmd_run(args) -> int:
    from .env import detect_mode
    from .train import run

    mode, reason = detect_mode()
    cfg = load_config(args.config, args.overrides, mode=mode)
    main_process = os.environ.get("RANK", "0") == "0"  # under accelerate/torchrun only rank 0 reports
    if main_process:
        print(f"mode: {mode} ({reason})")
    result = run(cfg, progress=not args.quiet)
    if not main_process:
        return 0 if result.ok else 1
    print_summary(result)
    if args.json:
        write_json(args.json, result.to_dict())
        print(f"wrote {args.json}")
    return 0 if result.ok else 1


def cmd_bench(args) -> int:
    from .bench import bench

    cfg = load_config(args.config, args.overrides)
    bench(cfg, repeats=args.repeats)
    return 0


def cmd_estimate(args) -> int:
    from .estimate import cli_estimate  # issue 6: the memory estimator and advisor

    cfg = load_config(args.config, args.overrides, mode="full")  # estimates are for the real sizes
    return cli_estimate(cfg, args)


def cmd_regenerate(args) -> int:
    from .regenerate import cli_regenerate  # issue 7: re-execute the labs and render the results

    return cli_regenerate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m labutils", description="GPT-2 single-GPU training-optimisation labs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("run", help="train one config and print what was measured")
    _add_config_args(p)
    p.add_argument("--json", metavar="PATH", help="write the full result record as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("bench", help="labutils' loop against a bare 15-line loop: tokens/s of both and the ratio")
    _add_config_args(p)
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats of each loop (default 3)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("estimate", help="predict memory (params, grads, optimizer, activations, peak) and advise")
    _add_config_args(p)
    p.add_argument("--gpu-memory-gb", type=float, default=None, metavar="G",
                   help="memory to fit in, in GiB (default: this GPU's, else 8)")
    p.add_argument("--gpus", type=int, default=8, metavar="N",
                   help="also print per-GPU memory under DDP / ZeRO-1/2/3 for 1..N GPUs (default 8)")
    p.add_argument("--json", metavar="PATH", help="write the estimate and recommendation as JSON")
    p.set_defaults(func=cmd_estimate)
    p = sub.add_parser("regenerate", help="re-execute the lab notebooks and regenerate results tables and figures")
    p.add_argument("--smoke", action="store_true", help="smoke mode (tiny model, CPU is fine); never writes results/")
    p.add_argument("--only", metavar="01,03", help="comma-separated lab numbers (default: all four)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: results/, or a temp folder with --smoke)")
    p.add_argument("--gpu-memory-gb", type=float, default=8.0, metavar="G",
                   help="cap CUDA memory to G GiB so any card behaves like the students' (default 8; 0 = no cap)")
    p.set_defaults(func=cmd_regenerate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
