"""The benchmark commands (docs/results.md): ``psr-hf bench-policy`` (the policy kernels), ``psr-hf
bench-patch`` (``generate()`` patched and unpatched), ``psr-hf bench`` (offloaded decode latency), ``psr-hf bench-generate`` (what ``generate()`` users wait for) and ``psr-hf
bench-plot`` (the plot of a bench record)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .._text import text_table
from ..bench.generate_sizes import SETUPS as GENERATE_SETUPS, sizes_for, sizes_help  # torch-free, for --help
from .console import HeaderFirst, compile_notice, progress_line, write_json
from .options import (Subparsers, add_calibration, add_device, add_json, add_latency_rounds, add_model, add_out,
                      add_plot, add_rounds, add_seed, add_texts, add_threads, comma_floats, comma_ints, set_threads,
                      set_threads_for_model)


def register(subparsers: Subparsers) -> None:
    for register_command in (_register_bench_policy, _register_bench_patch, _register_bench,
                             _register_bench_generate, _register_bench_plot):
        register_command(subparsers)


def _register_bench_policy(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("bench-policy", help="per-call cost of the policy kernel and replay throughput")
    add_rounds(p, 5)
    p.add_argument("--calls", type=int, default=3000, help="batch-1 calls per round and case (default 3000)")
    p.add_argument("--tokens", type=int, default=4000, help="tokens of the replayed trace (default 4000)")
    p.add_argument("--layers", type=int, default=16, help="MoE layers of the replayed trace (default 16)")
    add_json(p)
    add_threads(p, help="numba threads of the replay's layer-parallel kernel (and torch's); default: numba's (the "
                        "CPU count)")
    p.set_defaults(func=bench_policy)


def _register_bench_patch(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("bench-patch", help="decode ms/token of generate(), unpatched vs patched exact and psr")
    add_device(p, "cuda", note="; cpu with --tiny")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="dtype of the random weights (default bf16)")
    add_rounds(p, 5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each configuration first (default 1)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per run (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="seeded random prompt length (default 32)")
    add_seed(p, "the weights and the prompt")
    p.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="experts_implementation of the model (default grouped_mm)")
    p.add_argument("--calibrate-tokens", type=int, default=0,
                   help="calibrate on this many random tokens first (default 0: patched runs uncalibrated)")
    p.add_argument("--tiny", action="store_true", help="a tiny OLMoE shape that runs on a CPU in seconds")
    add_json(p)
    add_threads(p)
    p.set_defaults(func=bench_patch)


def _register_bench(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("bench", help="offload latency: teacher-forced decode ms/token and copies per token of "
                                            "resident, accelerate and routed rows (the paper's Section 6.1)")
    add_model(p, "grown-olmoe-routing", note=" (bf16 on a GPU: trained routing, real-size experts; the shipped "
                                             "models run in float32)")
    add_device(p, None)
    add_latency_rounds(p)
    p.add_argument("--windows", type=int, default=2, help="text windows per round (default 2)")
    p.add_argument("--tokens", type=int, default=128, help="timed decode positions per window (default 128)")
    p.add_argument("--capacities", default="0.5,0.25", help="residencies of the routed rows (default 0.5,0.25)")
    p.add_argument("--configs", help="comma-separated rows to run (full names like psr_lam0.3_n1_res50, or policy "
                                     "names for every capacity; resident always runs)")
    p.add_argument("--hf-configs", help="with --engine: the routed transformers rows to keep as references "
                                        "(comma-separated, as --configs; '' keeps none); the engine rows still "
                                        "mirror every row --configs keeps")
    p.add_argument("--prefetch-budgets", help="SpecPrefetch's system comparison: comma-separated budgets M, or "
                                              "'window': M_max = the budget psr-hf profile-window measures on "
                                              "the model first (at least 1); adds "
                                              "naive_mM (previous token's experts) and, with --predictor, "
                                              "specprefetch_mM rows at every capacity (and their engine rows, "
                                              "PRED0 = the copies-skipped specprefetch row, against the "
                                              "copies-skipped exact_lru row)")
    p.add_argument("--predictor", help="a SpecPrefetch predictor (.safetensors, psr-hf train-predictor) for the "
                                       "specprefetch_mM rows; one trained on a shipped model serves its grown-* "
                                       "version")
    p.add_argument("--max-in-flight", type=int, default=2, help="prefetch copies in flight at most (default 2)")
    p.add_argument("--copy-delay-ms", type=float, default=0.0,
                   help="emulated extra time per copy (default 0): a slower link")
    p.add_argument("--accelerate-tokens", type=int, default=8,
                   help="timed positions of the accelerate row per round (default 8)")
    p.add_argument("--no-accelerate", action="store_true", help="skip the accelerate dispatch_model row")
    p.add_argument("--engine", action="store_true",
                   help="also time psr_hf's batch-1 decoder (GraphDecoder: CUDA graphs on CUDA, eager on the CPU) "
                        "on the same windows: engine_resident (every expert cached, not offloaded) and "
                        "engine_<row> for every routed row (same routing, offloaded); engine goals need a GPU")
    p.add_argument("--device-routing", choices=("auto", "on", "off"), default="auto",
                   help="the engine rows' decode steps routed on the GPU, one CUDA graph per token: auto (default: "
                        "where the row allows it, see docs/engine.md), on (required), off (the host decides per "
                        "layer); each row's record says where it was decided (decided_on)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop timing before a round that would end past this many seconds from the start (the last "
                        "round's duration is the estimate); the record keeps the rounds timed (settings.rounds_timed)")
    p.add_argument("--count-late", action="store_true",
                   help="the engine rows routed on the GPU also count the prefetches each layer still waits for "
                        "(one small kernel per MoE layer, timed with the row: a diagnostic run, not a timing)")
    add_calibration(p)
    add_texts(p, "text file to cut the windows from (repeatable; default: standard-library sources)")
    p.add_argument("--warmup", type=int, default=1, help="untimed short warm-up rounds first (default 1)")
    add_seed(p)
    add_json(p)
    add_plot(p, "the latency-vs-copies plot")
    add_threads(p)
    p.set_defaults(func=bench)


def _register_bench_generate(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("bench-generate", help="what generate() users wait for: time to first token and "
                                                     "decode ms/token, transformers and the engine, resident and "
                                                     "offloaded, beside the engine's own step")
    add_model(p, "grown-olmoe-routing", note=" (bf16 on a GPU; the shipped models run in float32)")
    add_device(p, None)
    # the sizes' defaults depend on the device (generate_sizes): None here, decided when the command runs
    add_rounds(p, None, minimum=2, why="an interval needs two", default_help=sizes_help("rounds"))
    p.add_argument("--prompt-tokens", type=int,
                   help=f"prompt length, from held-out text ({sizes_help('prompt_tokens')})")
    p.add_argument("--new-tokens", type=int, help=f"timed decode tokens ({sizes_help('new_tokens')})")
    p.add_argument("--residency", type=float, default=0.5, help="residency of the offloaded setups (default 0.5)")
    p.add_argument("--routing", default="psr_lam0.3_n1", help="routing of the offloaded setups (default psr_lam0.3_n1)")
    p.add_argument("--no-by-token", action="store_true", help="skip timing the engine's token-by-token prefill")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile of one engine generate()")
    p.add_argument("--setups", default=",".join(GENERATE_SETUPS),
                   help="comma-separated setups to time, in their fixed order (default: all: %(default)s)")
    add_calibration(p)
    add_texts(p, "text file to cut the prompt from (default: the model's held-out text)")
    add_json(p)
    add_threads(p)
    p.set_defaults(func=bench_generate)


def _register_bench_plot(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("bench-plot", help="the latency-vs-copies plot (PNG) of a psr-hf bench JSON record")
    p.add_argument("record", help="JSON record written by psr-hf bench --json")
    add_out(p, "PNG file to write")
    p.set_defaults(func=bench_plot)


def bench_policy(args: argparse.Namespace) -> int:
    from ..bench.policy import bench_policy as run

    set_threads(args)
    print(f"psr-hf bench-policy: {args.rounds} interleaved rounds (median over rounds, 95% t-interval of the mean)")
    with compile_notice():
        record = run(rounds=args.rounds, calls=args.calls, tokens=args.tokens, layers=args.layers,
                     progress=progress_line)
    rows = []
    for r in record["results"]:
        lo, hi = r["ci95"]
        if r["unit"] == "steps/s":
            rows.append([r["case"], f"{r['median'] / 1e6:.3f} M", f"[{lo / 1e6:.3f}, {hi / 1e6:.3f}] M", r["unit"]])
        else:
            rows.append([r["case"], f"{r['median']:.2f}", f"[{lo:.2f}, {hi:.2f}]", r["unit"]])
    print(text_table(rows, ["case", "median", "95% CI of mean", "unit"]))
    m = record["machine"]
    print(f"\nmachine: {m['processor']}, {m['cpu_count']} CPUs, python {m['python']}, numba {m['numba']}")
    if args.json:
        write_json(args.json, record)
    return 0


def bench_patch(args: argparse.Namespace) -> int:
    from ..assets.loading import OLMOE_1B_7B, TINY_SHAPE
    from ..bench.patch import format_table, report_lines, run_bench_patch

    shape = "tiny OLMoE" if args.tiny else "OLMoE-1B-7B"
    set_threads(args, device=args.device, hidden_size=(TINY_SHAPE if args.tiny else OLMOE_1B_7B)["hidden_size"])
    print(f"psr-hf bench-patch: {shape}-shaped random model, batch-1 greedy decode of {args.new_tokens} tokens "
          f"after {args.prompt_tokens} prompt tokens, {args.rounds} interleaved rounds")
    record = run_bench_patch(
        device=args.device, dtype=args.dtype, tiny=args.tiny, rounds=args.rounds, new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens, warmup=args.warmup, seed=args.seed, experts_implementation=args.experts,
        calibrate_tokens=args.calibrate_tokens, progress=progress_line,
    )
    print(format_table(record))
    print("\n".join(report_lines(record)))
    if args.json:
        write_json(args.json, record)
    return 0


def _names(text: str | None) -> list[str] | None:
    """The names of a comma-separated option (None where it was not given)."""
    return None if text is None else [c for c in text.split(",") if c.strip()]


def bench(args: argparse.Namespace) -> int:
    from ..bench.offload import format_table, report_lines, run_bench
    from ..bench.plot import plot

    capacities = comma_floats("--capacities", args.capacities)
    configs, hf_configs = _names(args.configs), _names(args.hf_configs)
    budgets = ([] if not args.prefetch_budgets else args.prefetch_budgets.strip()
               if args.prefetch_budgets.strip() == "window" else comma_ints("--prefetch-budgets", args.prefetch_budgets))
    if args.predictor and not budgets:
        raise ValueError("--predictor is used by the specprefetch_mM rows: give --prefetch-budgets too (e.g. 2,4,8)")
    set_threads_for_model(args)  # a typo fails here
    progress = HeaderFirst(f"psr-hf bench: {args.model} on {args.device}, teacher-forced batch-1 decode of "
                           f"{args.windows} window(s) x {args.tokens} tokens, {args.rounds} interleaved rounds")
    record = run_bench(
        model=args.model, device=args.device, rounds=args.rounds, windows=args.windows, tokens=args.tokens,
        capacities=capacities, configs=configs, max_in_flight=args.max_in_flight, copy_delay_ms=args.copy_delay_ms,
        accelerate_tokens=args.accelerate_tokens, accelerate=not args.no_accelerate, calibration=args.calibration,
        texts=args.text, seed=args.seed, warmup=args.warmup, calibration_tokens=args.calibration_tokens,
        engine=args.engine, hf_configs=hf_configs, prefetch_budgets=budgets, predictor=args.predictor,
        progress=progress, device_routing={"auto": None, "on": True, "off": False}[args.device_routing],
        count_late=args.count_late, max_seconds=args.max_seconds,
    )
    progress.show()
    print(format_table(record))
    print("\n".join(report_lines(record)))
    if record["settings"]["rounds_timed"] < args.rounds:
        print(f"psr-hf bench: {record['settings']['rounds_timed']} of {args.rounds} rounds timed within --max-seconds "
              f"{args.max_seconds:g}")
    if args.json:
        write_json(args.json, record)
    if args.plot:
        print(f"plot: {plot(record, args.plot)}")
    return 0


def bench_generate(args: argparse.Namespace) -> int:
    from ..bench.generate_latency import GENERATE_HEADER, GenerateBenchConfig, bench_generate as run, generate_rows

    sizes = sizes_for(args.device, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, rounds=args.rounds)
    config = GenerateBenchConfig(prompt_tokens=sizes.prompt_tokens, new_tokens=sizes.new_tokens, rounds=sizes.rounds,
                                 residency=args.residency, routing=args.routing, by_token=not args.no_by_token,
                                 profile=not args.no_profile, setups=tuple(args.setups.split(",")))
    set_threads_for_model(args)
    print(f"psr-hf bench-generate: {args.model} on {args.device}, a {config.prompt_tokens}-token prompt, "
          f"{config.new_tokens} decoded tokens, {config.rounds} interleaved rounds (medians; ratios paired by round, "
          "95% intervals)")
    record = run(args.model, args.device, config, calibration=args.calibration,
                 calibration_tokens=args.calibration_tokens, texts=args.text or (), progress=progress_line,
                 progress_bar=True)
    print(text_table(generate_rows(record), GENERATE_HEADER))
    for name, setup in record["setups"].items():
        for key, what in (("ttft_goal", "time to first token"), ("generate_goal", "generate/step (greedy)"),
                          ("sampling_goal", "generate/step (sampling)")):
            goal = setup.get(key)
            if goal is not None:
                target = f"{goal['goal_ms']:.0f} ms" if key == "ttft_goal" else f"x{goal['goal_ratio']:.2f}"
                print(f"goal {name} {what} <= {target}: {'met' if goal['met'] else 'not shown'}")
    if args.json:
        write_json(args.json, record)
    return 0


def bench_plot(args: argparse.Namespace) -> int:
    from ..bench.plot import plot

    path = Path(args.record)
    if not path.is_file():
        raise ValueError(f"{args.record}: no such file")
    record = json.loads(path.read_text())
    if record.get("benchmark") != "latency":
        raise ValueError(f"{args.record} is not a psr-hf bench record (benchmark: {record.get('benchmark')!r})")
    print(f"plot: {plot(record, args.out)}")
    return 0
