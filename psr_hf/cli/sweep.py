"""``psr-hf sweep``: the resumable latency-divergence sweep and its frontier (docs/frontier.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .console import compile_notice, progress_line
from .options import (Subparsers, add_calibration, add_device, add_json, add_latency_rounds, add_model, add_plot,
                      add_seed, add_threads, comma_floats, comma_ints, set_threads_for_model)


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("sweep", help="the latency-divergence frontier: every policy, lam, budget, eviction "
                                            "and residency timed (engine on a GPU) and scored on selfgen and "
                                            "held-out text; resumable (the paper's Figure 1, Table 2, Section 6.6)")
    add_model(p, "grown-olmoe-routing", note="; a grown model's divergence is measured on the small trained model "
                                             "it was grown from (same function, float32)")
    add_device(p, None)
    p.add_argument("--residencies", default="0.5,0.25", help="residencies (default 0.5,0.25; the paper adds 0.375 "
                                                             "for Moonlight)")
    p.add_argument("--lams", default="0.1,0.15,0.2,0.25,0.3", help="bonus scales (default 0.1,0.15,0.2,0.25,0.3)")
    p.add_argument("--budgets", default="1,2,8", help="PSR prefetch budgets n (default 1,2,8; 8 = unbounded)")
    p.add_argument("--evictions", default="score,lru", help="Cache-Prior and PSR evictions (default score,lru)")
    p.add_argument("--psr-windows", default="",
                   help="also time PSR (A priority) with these pre-gate windows, e.g. 2 (rows psr_lam0.2_n1_w2; "
                        "default none: the architecture's window, 8, or 4 on Moonlight and Qwen3.6)")
    p.add_argument("--psr-distances", default="",
                   help="also time PSR (A priority) with these prefetch distances, e.g. 2 (rows psr_lam0.2_n1_d2: each "
                        "layer's prefetches ranked two MoE layers ahead; default none: the next layer)")
    p.add_argument("--no-published", action="store_true",
                   help="leave out Cache-Prior as published (top-J 1 and 2, running bonus scale)")
    p.add_argument("--configs", help="comma-separated grid names to keep (e.g. exact_lru,cp_lam0.2,psr_lam0.2_n1)")
    add_latency_rounds(p, "interleaved latency rounds")
    p.add_argument("--windows", type=int, default=2, help="latency windows per round (default 2)")
    p.add_argument("--tokens", type=int, default=64, help="timed decode positions per window (default 64)")
    p.add_argument("--selfgen-windows", type=int, default=8, help="windows sampled from the exact model (default 8)")
    p.add_argument("--selfgen-tokens", type=int, default=256, help="tokens sampled per window (default 256)")
    p.add_argument("--heldout-windows", type=int, default=8, help="held-out text windows (default 8)")
    p.add_argument("--heldout-tokens", type=int, default=256, help="tokens per held-out window (default 256)")
    p.add_argument("--engine", choices=("on", "off"),
                   help="time the engine's rows (default: on for a CUDA device) or the transformers offload path")
    add_calibration(p)
    p.add_argument("--quality-device", help="device of the divergence stage (default --device; cpu runs a grown "
                                            "model's small twin there)")
    p.add_argument("--stage", choices=("quality", "latency", "all"), default="all",
                   help="quality: only the divergence stage; latency: only the timing (each exits 3 while the "
                        "other is missing; --stage all with the same record completes it)")
    p.add_argument("--join", metavar="RECORD",
                   help="first take the stage that --json lacks from this record of the same sweep (the divergence "
                        "stage and the timing run on two machines at once), then complete as --stage all")
    p.add_argument("--max-minutes", type=float,
                   help="stop (saving the record) once this much time has passed; the same command continues")
    add_seed(p, "the selfgen sampling and random weights")
    add_json(p, "the record: written as the sweep goes, read to continue an interrupted sweep")
    add_plot(p, "the latency-vs-divergence frontier")
    p.add_argument("--markdown", help="write Table 2, the ablations and the orderings here (Markdown)")
    add_threads(p)
    p.set_defaults(func=sweep)


def sweep(args: argparse.Namespace) -> int:
    from ..bench.frontier import ablation_markdown, orderings_markdown, plot_frontier, table2_markdown
    from ..bench.sweep import SweepStopped, join_stages, run_sweep, select, sweep_grid

    grid = select(sweep_grid(lams=comma_floats("--lams", args.lams), budgets=comma_ints("--budgets", args.budgets),
                             evictions=[e.strip() for e in args.evictions.split(",") if e.strip()],
                             published=not args.no_published,
                             psr_windows=comma_ints("--psr-windows", args.psr_windows) if args.psr_windows else (),
                             psr_distances=(comma_ints("--psr-distances", args.psr_distances)
                                            if args.psr_distances else ())),
                  None if args.configs is None else args.configs.split(","))
    residencies = comma_floats("--residencies", args.residencies)
    set_threads_for_model(args)
    print(f"psr-hf sweep: {args.model} on {args.device}, {len(grid)} configurations x {len(residencies)} "
          f"residencies; latency: {args.windows} window(s) x {args.tokens} tokens, {args.rounds} interleaved rounds; "
          f"divergence: {args.selfgen_windows} selfgen and {args.heldout_windows} held-out windows")
    if args.join:
        if not args.json:
            raise ValueError("--join RECORD needs --json: the record it completes")
        join_stages(args.json, args.join)
        print(f"psr-hf sweep: took the stage {args.json} lacked from {args.join}")
    try:
        with compile_notice():
            record = run_sweep(
                model=args.model, device=args.device, residencies=residencies, grid=grid, rounds=args.rounds,
                windows=args.windows, tokens=args.tokens, selfgen_windows=args.selfgen_windows,
                selfgen_tokens=args.selfgen_tokens, heldout_windows=args.heldout_windows,
                heldout_tokens=args.heldout_tokens, seed=args.seed,
                engine=None if args.engine is None else args.engine == "on", calibration=args.calibration,
                calibration_tokens=args.calibration_tokens, json_path=args.json, max_minutes=args.max_minutes,
                quality_device=args.quality_device, stage=args.stage, progress=progress_line)
    except SweepStopped as stopped:
        print(f"psr-hf sweep: incomplete: {stopped}")
        return 3
    text = "\n\n".join([table2_markdown(record["points"]), ablation_markdown(record["points"]),
                         orderings_markdown(record["orderings"])])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
        print(f"Markdown: {args.markdown}")
    if args.json:
        print(f"JSON record: {args.json}")
    if args.plot:
        title = f"psr-hf sweep: {args.model}, latency vs selfgen divergence"
        print(f"plot: {plot_frontier(record['points'], args.plot, title=title)}")
    return 0
