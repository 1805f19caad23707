"""The ``psr-hf`` command. The library logs; this module prints.

Threads: on a CPU, a small model (hidden size <= :data:`SMALL_HIDDEN`: the shipped ``tiny-moe``, the random tiny
models) runs with one torch intra-op thread unless ``--threads N`` says otherwise or ``OMP_NUM_THREADS`` is set.
Its matrix products take microseconds, so more threads gain nothing alone, and on a busy machine every parallel
region waits for a worker that the OS has descheduled (OpenMP workers spin): ``psr-hf demo`` went from 9 s to
15-32 s with one other busy process on a 2-core machine. Larger models and GPU runs keep torch's default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from ._text import text_table as _table

DESCRIPTION = (
    "Cache-aware expert routing for transformers Mixture-of-Experts models: run the demo, measure how far a routing "
    "policy moves a model from exact routing (kl) and how many expert copies it needs, calibrate a model, grow a "
    "small trained model to real-size dimensions with the same routing (grow), benchmark "
    "the policy kernels and offloaded decoding, train a learned next-layer prefetch predictor and measure its expert "
    "recall (train-predictor, recall), compare lm-eval runs, or run lm-eval with --model psr_hf (eval). "
    "Models are named the same way everywhere: tiny-moe (shipped), a local model directory, or a hub id "
    "(owner/name; from the local cache when offline). `psr-hf COMMAND --help` describes each command."
)
# hidden size up to which a model counts as small: one torch thread on a CPU (see the module docstring)
from ._threads import SMALL_HIDDEN  # noqa: E402  (torch-free)
THREADS_HELP = ("torch intra-op threads (and numba's); default: 1 for a small model on a CPU (hidden size <= "
                f"{SMALL_HIDDEN}), torch's default otherwise, or OMP_NUM_THREADS where it is set")


def _err(message: str) -> None:
    """A line on stderr that does not break a progress bar."""
    from ._progress import tqdm

    tqdm.write(message, file=sys.stderr)


def _set_threads(args: argparse.Namespace, *, device: str = "cpu", hidden_size: int | None = None) -> int:
    """Apply the thread decision of the module docstring; returns torch's intra-op thread count."""
    import torch

    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: give at least 1")
        import numba

        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    else:
        from ._threads import decide

        decide(hidden_size, device)
    logging.getLogger("psr_hf.cli").info("torch intra-op threads: %d", torch.get_num_threads())
    return torch.get_num_threads()


def _hidden_size(model: str, built: dict[str, int]) -> int | None:
    """The hidden size of a ``--model`` name: ``built`` gives it for the names the command builds itself (random
    weights); any other name goes through the resolver, which reads its config (so a typo or a model psr_hf
    cannot patch fails here, before anything loads)."""
    from .assets import resolve_model

    return built[model] if model in built else resolve_model(model, also=tuple(built)).hidden_size


def _bench_models() -> dict[str, int]:
    """The benchmarks' random models and their hidden sizes."""
    from .bench.workloads import GROWN, OLMOE_1B_7B, RANDOM_OLMOE, TINY, TINY_SHAPE

    return {RANDOM_OLMOE: OLMOE_1B_7B["hidden_size"], TINY: TINY_SHAPE["hidden_size"],
            **{name: OLMOE_1B_7B["hidden_size"] for name in GROWN}}


@contextlib.contextmanager
def _compile_notice() -> Iterator[None]:
    """Say once on stderr when numba compiles the policy kernels (the first run after installation: it caches
    them), so a long first run is explained."""
    from numba.core import event

    class Notice(event.Listener):
        shown = False

        def on_start(self, ev: Any) -> None:
            if not self.shown:
                self.shown = True
                _err("psr-hf: compiling the policy kernels with numba (first run only: they are cached after; "
                     "about 15 s on a 2-core machine; `psr-hf warm-up`, which make install runs, does it ahead)")

        def on_end(self, ev: Any) -> None:
            pass

    listener = Notice()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)


# ---------------------------------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DEMO_SHAPE, RANDOM, run_demo

    _set_threads(args, hidden_size=_hidden_size(args.model, {RANDOM: DEMO_SHAPE["hidden_size"]}))  # a typo fails here, before anything loads
    with _compile_notice():
        result = run_demo(new_tokens=args.new_tokens, model=args.model, progress=True)
    print(f"psr-hf demo: {result['model']}")
    print(f"calibrated on {result['calibration_tokens']} tokens; {len(result['prompts'])} prompts in one "
          f"left-padded batch, {result['new_tokens']} greedy tokens each.")
    if args.model == "random":
        print("Random weights: the continuations are noise; the routing numbers are the point.")
    elif args.model == "tiny-moe":
        print("An 8.7 M-parameter model trained for 7.4 minutes on one GPU: expect locally fluent, globally "
              "meaningless text; the routing numbers are the point.")
    print()
    runs = result["runs"]
    for p, prompt in enumerate(result["prompts"]):
        print(f"prompt {p + 1}: {prompt!r}")
        for run in runs:
            if run.name.startswith("exact") and run.residency != runs[0].residency:
                continue  # exact routing gives the same text at every residency
            label = "exact" if run.name.startswith("exact") else f"{run.name} @ {run.residency:.0%}"
            print(f"  {label:<28} {run.texts[p]!r}")
        print()
    rows = []
    for run in runs:
        s = run.stats
        rows.append([run.name, f"{run.residency:.0%} (C={run.capacity})", f"{s['demand_per_token']:.2f}",
                     f"{s['prefetch_per_token']:.2f}", f"{s['copies_per_token']:.2f}", f"{s['replaced_per_token']:.2f}",
                     f"{s['displaced_mass']:.3f}", f"{s['excess_nll']:.4f}", f"{s['same_tokens_as_exact']:.0%}"])
    print(_table(rows, ["policy", "residency", "demand/tok", "prefetch/tok", "copies/tok", "replaced/tok",
                        "displaced mass", "excess NLL", "tokens = exact"]))
    print("\ncopies are logical expert loads summed over the MoE layers, per token (prompt and generated);")
    print("demand copies stall the layer, prefetch copies are issued one layer early and overlap computation;")
    print("replaced = selected experts outside the router's own top-K; displaced mass = the share of the router's")
    print("own top-K weight that was not executed (mean over token-layers); excess NLL = nats per token over exact")
    print(f"routing on {result['kl']} (an estimate of the KL divergence from exact routing).")
    if args.plot:
        from .eval.divergence import plot_divergence

        print(f"plot: {plot_divergence(result['divergence'], args.plot, title=f'psr-hf demo: {args.model}, ' + result['kl'])}")
    return 0


# ---------------------------------------------------------------------------------------------------- warm-up
def cmd_warm_up(args: argparse.Namespace) -> int:
    import time

    from .testing import warm_up

    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    with _compile_notice():
        runs = warm_up(progress=True)
    print(f"psr-hf warm-up: policy kernels compiled and cached ({runs} runs, {time.perf_counter() - start:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------------- calibrate
def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .assets import resolve_model
    from .hf.calibrate import calibrate

    source = resolve_model(args.model)  # a typo or a model psr_hf cannot patch fails here, before loading
    _set_threads(args, device=args.device, hidden_size=source.hidden_size)
    texts = []
    for name in args.text:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--text {name}: no such file")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(source.location, **source.from_pretrained_kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **source.from_pretrained_kwargs)
    model = model.to(args.device).eval()
    calibration = calibrate(model, texts, tokenizer=tokenizer, max_length=args.max_length,
                            batch_size=args.batch_size, max_tokens=args.max_tokens, progress=True)
    calibration.save(args.out)
    print(f"calibration of {calibration.num_layers} MoE layers x {calibration.num_experts} experts, "
          f"token prior over {calibration.vocab_size} ids: {args.out}")
    print("delta per layer: " + " ".join(f"{d:.3f}" for d in calibration.delta))
    return 0


# ---------------------------------------------------------------------------------------------------- grow
GROW_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32"}


def _count(n: int) -> str:
    """A parameter count for people: 8.7 M, 6.92 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def cmd_grow(args: argparse.Namespace) -> int:
    import torch

    from .assets import resolve_model
    from .assets.grow import default_target, grow_pretrained, target_by_name

    source = resolve_model(args.model)  # a typo or a model psr_hf cannot patch fails here, before loading
    if source.directory is None:
        raise ValueError(f"--model {args.model}: grow needs a local model directory; download it first "
                         f"(huggingface-cli download {args.model}) and give the directory")
    target = target_by_name(args.target) if args.target else default_target(source.model_type)
    changes = {}
    for item in args.override:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise ValueError(f"--override {item!r}: give FIELD=VALUE, e.g. hidden_size=512")
        changes[field.strip().replace("-", "_")] = value
    target = target.with_dims(**changes)
    dtype = getattr(torch, GROW_DTYPES[args.dtype])
    out = grow_pretrained(source.directory, args.out, target, dtype=dtype, device=args.device)
    record = json.loads((out / "grown_from.json").read_text(encoding="utf-8"))
    print(f"grew {args.model} ({record['model_type']}, {_count(record['parameters_before'])} parameters) to "
          f"{target.name} ({_count(record['parameters_after'])} parameters, {record['dtype']}): {out}")
    return 0


# ---------------------------------------------------------------------------------------------------- bench-policy
def cmd_bench_policy(args: argparse.Namespace) -> int:
    from .bench.policy import bench_policy

    _set_threads(args)
    print(f"psr-hf bench-policy: {args.rounds} interleaved rounds (median over rounds, 95% t-interval of the mean)")
    with _compile_notice():
        record = bench_policy(rounds=args.rounds, calls=args.calls, tokens=args.tokens, layers=args.layers,
                              progress=lambda msg: _err("  " + msg))
    rows = []
    for r in record["results"]:
        lo, hi = r["ci95"]
        if r["unit"] == "steps/s":
            rows.append([r["case"], f"{r['median'] / 1e6:.3f} M", f"[{lo / 1e6:.3f}, {hi / 1e6:.3f}] M", r["unit"]])
        else:
            rows.append([r["case"], f"{r['median']:.2f}", f"[{lo:.2f}, {hi:.2f}]", r["unit"]])
    print(_table(rows, ["case", "median", "95% CI of mean", "unit"]))
    m = record["machine"]
    print(f"\nmachine: {m['processor']}, {m['cpu_count']} CPUs, python {m['python']}, numba {m['numba']}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"JSON record: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------- bench-patch
def cmd_bench_patch(args: argparse.Namespace) -> int:
    from .bench.patch import format_table, report_lines, run_bench_patch

    from .bench.workloads import OLMOE_1B_7B, TINY_SHAPE

    shape = "tiny OLMoE" if args.tiny else "OLMoE-1B-7B"
    _set_threads(args, device=args.device, hidden_size=(TINY_SHAPE if args.tiny else OLMOE_1B_7B)["hidden_size"])
    print(f"psr-hf bench-patch: {shape}-shaped random model, batch-1 greedy decode of {args.new_tokens} tokens "
          f"after {args.prompt_tokens} prompt tokens, {args.rounds} interleaved rounds")
    record = run_bench_patch(
        device=args.device, dtype=args.dtype, tiny=args.tiny, rounds=args.rounds, new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens, warmup=args.warmup, seed=args.seed, experts_implementation=args.experts,
        calibrate_tokens=args.calibrate_tokens, progress=lambda msg: _err("  " + msg),
    )
    print(format_table(record))
    print("\n".join(report_lines(record)))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"JSON record: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.offload import format_table, report_lines, run_bench
    from .bench.plot import plot

    capacities = _floats("--capacities", args.capacities)
    configs = None if args.configs is None else [c for c in args.configs.split(",") if c.strip()]
    hf_configs = None if args.hf_configs is None else [c for c in args.hf_configs.split(",") if c.strip()]
    budgets = ([] if not args.prefetch_budgets else args.prefetch_budgets.strip()
               if args.prefetch_budgets.strip() == "window" else _ints("--prefetch-budgets", args.prefetch_budgets))
    if args.predictor and not budgets:
        raise ValueError("--predictor is used by the specprefetch_mM rows: give --prefetch-budgets too (e.g. 2,4,8)")
    _set_threads(args, device=args.device, hidden_size=_hidden_size(args.model, _bench_models()))  # a typo fails here
    print(f"psr-hf bench: {args.model} on {args.device}, teacher-forced batch-1 decode of {args.windows} window(s) "
          f"x {args.tokens} tokens, {args.rounds} interleaved rounds")
    record = run_bench(
        model=args.model, device=args.device, rounds=args.rounds, windows=args.windows, tokens=args.tokens,
        capacities=capacities, configs=configs, max_in_flight=args.max_in_flight, copy_delay_ms=args.copy_delay_ms,
        accelerate_tokens=args.accelerate_tokens, accelerate=not args.no_accelerate, calibration=args.calibration,
        texts=args.text, seed=args.seed, warmup=args.warmup, calibration_tokens=args.calibration_tokens,
        engine=args.engine, hf_configs=hf_configs, prefetch_budgets=budgets, predictor=args.predictor,
        progress=lambda msg: _err("  " + msg),
    )
    print(format_table(record))
    print("\n".join(report_lines(record)))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"JSON record: {args.json}")
    if args.plot:
        print(f"plot: {plot(record, args.plot)}")
    return 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    from .bench.plot import plot

    path = Path(args.record)
    if not path.is_file():
        raise ValueError(f"{args.record}: no such file")
    record = json.loads(path.read_text())
    if record.get("benchmark") != "latency":
        raise ValueError(f"{args.record} is not a psr-hf bench record (benchmark: {record.get('benchmark')!r})")
    print(f"plot: {plot(record, args.out)}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .bench.frontier import ablation_markdown, orderings_markdown, plot_frontier, table2_markdown
    from .bench.sweep import SweepStopped, run_sweep, select, sweep_grid

    grid = select(sweep_grid(lams=_floats("--lams", args.lams), budgets=_ints("--budgets", args.budgets),
                             evictions=[e.strip() for e in args.evictions.split(",") if e.strip()],
                             published=not args.no_published),
                  None if args.configs is None else args.configs.split(","))
    residencies = _floats("--residencies", args.residencies)
    _set_threads(args, device=args.device, hidden_size=_hidden_size(args.model, _bench_models()))
    print(f"psr-hf sweep: {args.model} on {args.device}, {len(grid)} configurations x {len(residencies)} "
          f"residencies; latency: {args.windows} window(s) x {args.tokens} tokens, {args.rounds} interleaved rounds; "
          f"divergence: {args.selfgen_windows} selfgen and {args.heldout_windows} held-out windows")
    try:
        with _compile_notice():
            record = run_sweep(
                model=args.model, device=args.device, residencies=residencies, grid=grid, rounds=args.rounds,
                windows=args.windows, tokens=args.tokens, selfgen_windows=args.selfgen_windows,
                selfgen_tokens=args.selfgen_tokens, heldout_windows=args.heldout_windows,
                heldout_tokens=args.heldout_tokens, seed=args.seed,
                engine=None if args.engine is None else args.engine == "on", calibration=args.calibration,
                calibration_tokens=args.calibration_tokens, json_path=args.json, max_minutes=args.max_minutes,
                quality_device=args.quality_device, stage=args.stage, progress=lambda msg: _err("  " + msg))
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


def _load_model(args: argparse.Namespace, command: str) -> tuple[Any, Any, dict]:
    """``--threads`` for ``--model`` on ``--device`` (a typo in the model's name fails here), then the model: what
    the commands that run one model (kl, train-predictor, recall, profile-window) do first."""
    from .bench.workloads import load_model

    _set_threads(args, device=args.device, hidden_size=_hidden_size(args.model, _bench_models()))
    _err(f"psr-hf {command}: loading {args.model} on {args.device}")
    return load_model(args.model, args.device, seed=args.seed)


# ---------------------------------------------------------------------------------------------------- kl
def cmd_kl(args: argparse.Namespace) -> int:
    from .bench.workloads import WINDOW_MODULES, default_texts, model_calibration, module_sources, text_windows
    from .eval.divergence import divergence, format_rows, predictor_pairs, sweep_configs

    held_out = default_texts(args.model)  # a shipped trained model never saw it; the standard library is in its training
    if held_out and not args.text:
        texts, text_names = [t for _, t in held_out], [n for n, _ in held_out]
    else:
        texts = _read_texts("--text", args.text) or [t for _, t in module_sources(WINDOW_MODULES)]
        text_names = args.text or [f"stdlib:{m}" for m in WINDOW_MODULES]
    residencies, lams = _floats("--residencies", args.residencies), _floats("--lams", args.lams)
    sweep_configs(residencies, lams, args.budget, predictor=bool(args.predictor))  # bad values fail before loading
    model, tokenizer, info = _load_model(args, "kl")
    beside = info.pop("calibration_file", None)  # the record names it by info["calibration"]
    windows = text_windows(texts, tokenizer, windows=args.windows, tokens=args.tokens)
    # the file given, else the one saved beside the model, else other standard-library modules than the windows'
    calibration, how = model_calibration(model, tokenizer, tokens=args.calibration_tokens,
                                         calibration=args.calibration or None, beside=beside,
                                         beside_name=info.get("calibration"), bar=True)
    calibrated_on = how["file"] if "file" in how else f"{how['tokens']} tokens of stdlib {', '.join(how['modules'])}"
    print(f"psr-hf kl: {info['name']}, {len(windows)} window(s) x {args.tokens + 1} tokens, excess NLL over exact "
          f"routing (nats per token; 95% interval over windows); text: {', '.join(text_names)}; calibration: "
          f"{calibrated_on}")
    predictor = None
    if args.predictor:
        from .bench.offload import load_bench_predictor

        predictor, _ = load_bench_predictor(args.predictor, model)  # a shipped model's serves its grown version
    with _compile_notice():
        rows = divergence(model, windows, sweep_configs(residencies, lams, args.budget, predictor=bool(predictor)),
                          calibration=calibration, progress=True, predictor=predictor)
    print(format_rows(rows))
    pairs = predictor_pairs(rows)
    for pair in pairs:
        lo, hi = pair["excess_nll_diff_ci95"]
        print(f"{pair['predictor']} - {pair['pregate']}: excess NLL {pair['excess_nll_diff']:+.4f} [{lo:+.4f}, "
              f"{hi:+.4f}] nats/token (paired over windows); demand copies/token {pair['demand_per_token'][0]:.2f} "
              f"vs {pair['demand_per_token'][1]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": info, "windows": len(windows), "tokens": args.tokens,
                                               "texts": text_names,
                                               "calibration": calibrated_on, "predictor": args.predictor,
                                               "rows": [r.to_dict() for r in rows], "predictor_pairs": pairs},
                                              indent=2))
        print(f"JSON record: {args.json}")
    if args.plot:
        from .eval.divergence import plot_divergence

        title = f"psr-hf kl: {info['name']}, {len(windows)} windows x {args.tokens + 1} tokens"
        print(f"plot: {plot_divergence(rows, args.plot, title=title)}")
    return 0


def _ints(option: str, text: str) -> list[int]:
    values = _floats(option, text)
    if any(v != int(v) or v < 1 for v in values):
        raise ValueError(f"{option} {text}: expected comma-separated integers >= 1, e.g. 2,4,8")
    return [int(v) for v in values]


def _floats(option: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} {text}: expected comma-separated numbers, e.g. 0.5,0.25") from None
    if not values:
        raise ValueError(f"{option} {text!r}: give at least one number")
    return values


# ---------------------------------------------------------------------------------------------------- prefetch
# the predictors' default training text: standard-library modules other than the windows' (WINDOW_MODULES)
PREDICTOR_MODULES = ("functools", "heapq", "string", "contextlib", "dataclasses", "enum", "typing", "inspect",
                     "pathlib", "tarfile", "zipfile", "subprocess", "pickle", "ast", "difflib", "shutil")
PREDICTOR_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _read_texts(option: str, files: Sequence[str]) -> list[str]:
    texts = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{option} {name}: no such file")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def _token_windows(texts: Sequence[str], tokenizer: Any, *, tokens: int, window: int, option: str) -> list[Any]:
    """Token-id windows of at most ``window`` tokens cut from each text in turn (never across texts) until
    ``tokens`` tokens; ``ValueError`` naming ``option`` when the texts hold fewer."""
    import torch

    if tokens < 2 or window < 2:
        raise ValueError(f"{option} {tokens} and --window {window} must be at least 2")
    out, total = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        for start in range(0, len(ids), window):
            piece = ids[start:start + min(window, tokens - total)]
            if len(piece) < 2:  # a window needs a token with a previous one
                continue
            out.append(torch.tensor(piece, dtype=torch.long))
            total += len(piece)
            if total >= tokens:
                return out
    raise ValueError(f"{option} {tokens}: the texts hold only {total} tokens; give fewer tokens or more text")


def _text_name(path: str) -> str:
    """How a record names a text file: ``stdlib:<path>`` for a file of Python's standard library (its location is
    the machine's, not the record's), the path as given otherwise."""
    import sysconfig

    try:
        return "stdlib:" + Path(path).resolve().relative_to(Path(sysconfig.get_paths()["stdlib"]).resolve()).as_posix()
    except ValueError:
        return str(path)


def _predictor_texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The predictors' training texts and their names: --text files, else :data:`PREDICTOR_MODULES`' sources."""
    from .bench.workloads import module_sources

    if args.text:
        return _read_texts("--text", args.text), [_text_name(f) for f in args.text]
    return [t for _, t in module_sources(PREDICTOR_MODULES)], [f"stdlib:{m}" for m in PREDICTOR_MODULES]


def _rank(args: argparse.Namespace, model: Any) -> int:
    """--rank, or the paper's r = 64 capped at the model's experts and hidden size (the rank of B A)."""
    from .prefetch.train import model_facts

    if args.rank is not None:
        return args.rank
    facts = model_facts(model)
    return min(64, facts["num_experts"], facts["hidden_size"])


def cmd_train_predictor(args: argparse.Namespace) -> int:
    import torch

    from .prefetch.train import train_predictor

    model, tokenizer, info = _load_model(args, "train-predictor")
    texts, names = _predictor_texts(args)
    windows = _token_windows(texts, tokenizer, tokens=args.tokens, window=args.window, option="--tokens")
    _err(f"psr-hf train-predictor: {sum(w.numel() for w in windows)} tokens in {len(windows)} windows of "
         f"{', '.join(names)}")
    predictor = train_predictor(model, windows, rank=_rank(args, model), epochs=args.epochs, lr=args.lr,
                                batch_size=args.batch_size, dtype=getattr(torch, PREDICTOR_DTYPES[args.dtype]),
                                seed=args.seed, progress=True)
    predictor.metadata.update(model=str(info["name"]), texts=", ".join(names))
    predictor.save(args.out)
    meta = predictor.metadata
    print(f"psr-hf train-predictor: {info['name']}: {predictor.num_pairs} layer pairs, rank {predictor.rank}, "
          f"{predictor.num_parameters:,} parameters; {meta['tokens']} tokens, {meta['steps']} steps "
          f"({meta['precision']}); KL {float(meta['initial_loss']):.4f} -> {float(meta['final_loss']):.4f} "
          f"(final loss)")
    print(f"predictor: {args.out}")
    return 0


def cmd_recall(args: argparse.Namespace) -> int:
    import time

    import torch

    from .bench.workloads import WINDOW_MODULES, default_texts, module_sources
    from .prefetch.recall import format_recall_table, recall_table

    started = time.perf_counter()
    model, tokenizer, info = _load_model(args, "recall")
    texts, names = _predictor_texts(args)
    train = _token_windows(texts, tokenizer, tokens=args.train_tokens, window=args.window, option="--train-tokens")
    held_out = default_texts(args.model)  # a shipped trained model never saw it
    if args.heldout_text:
        held_texts = _read_texts("--heldout-text", args.heldout_text)
        held_names = [_text_name(f) for f in args.heldout_text]
    elif held_out:
        held_texts, held_names = [t for _, t in held_out], [n for n, _ in held_out]
    else:
        held_texts = [t for _, t in module_sources(WINDOW_MODULES)]
        held_names = [f"stdlib:{m}" for m in WINDOW_MODULES]
    held = _token_windows(held_texts, tokenizer, tokens=args.heldout_tokens, window=args.window,
                          option="--heldout-tokens")
    budgets = [int(x) for x in _floats("--budgets", args.budgets)] if args.budgets else None
    _err(f"psr-hf recall: training on {args.train_tokens} tokens of {', '.join(names)}; evaluating on "
         f"{args.heldout_tokens} tokens of {', '.join(held_names)}")
    record = recall_table(model, train, held, rank=_rank(args, model), budgets=budgets, predictor=args.predictor,
                          epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                          dtype=getattr(torch, PREDICTOR_DTYPES[args.dtype]), seed=args.seed, progress=True)
    record.update(model_name=str(info["name"]), train_texts=names, heldout_texts=held_names,
                  wall_seconds=time.perf_counter() - started)
    print(f"psr-hf recall: {info['name']}: next-layer ExpertRecall@M on held-out text ({', '.join(held_names)})")
    print(format_recall_table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2, ensure_ascii=False))
        print(f"JSON record: {args.json}")
    return 0


def cmd_profile_window(args: argparse.Namespace) -> int:
    from .bench.common import quiet_uncalibrated
    from .bench.workloads import WINDOW_MODULES, default_texts, module_sources, text_windows
    from .prefetch.window import profile_unpatched

    model, tokenizer, info = _load_model(args, "profile-window")
    texts = default_texts(args.model) or module_sources(WINDOW_MODULES)
    (ids,) = text_windows([t for _, t in texts][:1], tokenizer, windows=1, tokens=args.tokens)
    with quiet_uncalibrated(), _compile_notice():
        profile = profile_unpatched(model, ids[0].tolist(), warmup=args.warmup, copies=args.copies,
                                    quantile=args.quantile)
    record = profile.to_dict()
    record.update(model=str(info["name"]), tokens=args.tokens)
    rows = [[str(pair), f"{w:.3f}", str(m)] for pair, (w, m) in
            enumerate(zip(record["window_ms_per_pair"], record["budget_per_pair"]))]
    from ._text import text_table

    print(f"psr-hf profile-window: {info['name']} on {profile.device} "
          f"({'CUDA graphs' if record['notes']['graphs'] else 'eager'}), {record['positions']} decode positions; "
          f"one expert ({profile.bytes_per_expert / 1e6:.2f} MB) copies in {profile.copy_time_ms:.3f} ms (median of "
          f"{len(record['copy_ms'])})")
    print(text_table(rows, ["pair l -> l+1", "window W_l ms (median)", "floor(W_l / t_copy)"]))
    exceeding = ", ".join(f"{k} copies {100 * v:.0f}%" for k, v in record["exceeding"].items())
    print(f"M_max = {profile.budget} (the {args.quantile:g} quantile over every event of floor(W / t_copy)); events "
          f"whose window is shorter than: {exceeding}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"JSON record: {args.json}")
    return 0


def _prefetch_options(p: argparse.ArgumentParser) -> None:
    """Options that train-predictor and recall share."""
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="training text (repeatable; default: standard-library sources other than the kl and bench "
                        "windows': " + ", ".join(PREDICTOR_MODULES) + ")")
    p.add_argument("--rank", type=int, help="SpecPrefetch's adapter rank r (default: the paper's 64, capped at the "
                                            "model's experts and hidden size)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (default 1, the paper's)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (default 1e-3: the paper's 1e-4 is for millions of tokens; a CPU run "
                        "trains on tens of thousands)")
    p.add_argument("--batch-size", type=int, default=64, help="tokens per optimiser step (default 64)")
    p.add_argument("--window", type=int, default=256, help="tokens per forward window (default 256)")
    p.add_argument("--dtype", default="bf16", choices=list(PREDICTOR_DTYPES),
                   help="training precision: bf16 (autocast over float32 master weights, the default) or fp32")
    p.add_argument("--device", default="cpu", help="torch device to run the model on (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training and of random models (default 0)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)


# ---------------------------------------------------------------------------------------------------- compare
def cmd_compare(args: argparse.Namespace) -> int:
    from .eval.compare import compare_runs, load_run, parse_run_argument

    if len(args.runs) < 2:
        raise ValueError("give a reference run and at least one run to compare with it")
    metrics: dict[str, list[str]] = {}
    for spec in args.metric:
        task, sep, metric = spec.partition("=")
        if not (sep and task and metric):
            raise ValueError(f"--metric {spec}: expected TASK=METRIC or TASK=METRIC,FILTER")
        metrics.setdefault(task, []).append(metric)
    runs = [load_run(path, label) for label, path in map(parse_run_argument, args.runs)]
    tasks = [t for t in args.tasks.split(",") if t] if args.tasks else None
    comparison = compare_runs(runs[0], runs[1:], metrics=metrics, tasks=tasks, alpha=args.alpha,
                              permutations=args.permutations, seed=args.seed)
    print(comparison.to_markdown())
    units = {c.name: c.unit for c in comparison.columns}
    rows = []
    for cell in comparison.cells:
        ref_side = cell.counts.get("reference_only", cell.counts.get("reference_better", 0))
        run_side = cell.counts.get("run_only", cell.counts.get("run_better", 0))
        digits = 2 if units[cell.column] == "points" else 4
        rows.append([cell.run, cell.column, cell.n, f"{cell.difference:+.{digits}f}", f"{cell.se:.{digits}f}",
                     f"{ref_side}/{run_side}", cell.test, f"{cell.p:.3g}", f"{cell.p_holm:.3g}"])
    print(_table(rows, ["run", "column", "n", "difference", "SE", "discordant ref/run", "test", "p", "p Holm"]))
    print("\ndiscordant: questions only the reference / only the run got right (clustered and other metrics: units "
          "where the reference / the run scored higher); n: paired units (IFE-I: prompts).")
    if args.json:
        Path(args.json).write_text(json.dumps(comparison.to_dict(), indent=2, ensure_ascii=False))
        print(f"JSON record: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------- eval
def cmd_eval(args: argparse.Namespace) -> int:
    """``psr-hf eval ARGS...`` runs ``lm-eval ARGS...`` with psr_hf's model registered (``--model psr_hf``)."""
    from lm_eval.__main__ import cli_evaluate

    from .eval.lm_eval_hook import register

    register()  # what the start-up hook does, also where site-packages .pth files are not read (python -S)
    saved, sys.argv = sys.argv, ["lm-eval", *args.lm_eval_args]  # lm-eval's CLI reads sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psr-hf", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="generate under exact and cache-aware routing on a small model: copies per token")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--model", default="tiny-moe",
                   help="tiny-moe (default: the shipped trained tiny OLMoE with its calibration), random (a seeded "
                        "random tiny OLMoE, byte vocabulary) or a saved MoE model directory with its tokenizer "
                        "(and calibration.safetensors), or a hub id owner/name")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.add_argument("--plot", metavar="FILE", help="also write a PNG of excess NLL against copies per token here")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("warm-up", help="compile the policy kernels into numba's cache (make install runs this; "
                                       "the first demo or generate() then starts without compiling)")
    p.set_defaults(func=cmd_warm_up)

    p = sub.add_parser("calibrate", help="calibrate a model's routing policy on held-out text")
    p.add_argument("--model", required=True, help="tiny-moe, a model directory (transformers format, with its "
                                                   "tokenizer) or a hub id owner/name")
    p.add_argument("--text", required=True, nargs="+", help="held-out text files (UTF-8)")
    p.add_argument("--out", required=True, help="calibration file to write (.safetensors)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    p.add_argument("--device", default="cpu", help="torch device to run the model on (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="weights' dtype (default auto: as saved)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("grow", help="grow a small trained MoE model to real-size dimensions (OLMoE-1B-7B, "
                                    "Moonlight-16B-A3B) that compute exactly its function: same routing, real-size "
                                    "experts for latency benchmarks")
    p.add_argument("--model", required=True, help="tiny-moe, olmoe-routing, a model directory (transformers format, "
                                                   "with its tokenizer) or a hub id owner/name in the local hub "
                                                   "cache")
    p.add_argument("--target", help="olmoe-1b-7b or moonlight-16b-a3b (default: the preset of the model's family)")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="replace one dimension of the target (repeatable), e.g. a reduced target of the same code "
                        "path for tests: --override hidden_size=512 --override num_attention_heads=8 "
                        "--override num_key_value_heads=8 --override head_dim=64 --override "
                        "expert_intermediate_size=96; fields: hidden_size, num_attention_heads, num_key_value_heads, "
                        "expert_intermediate_size, head_dim (OLMoE), dense_intermediate_size, kv_lora_rank, "
                        "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim (DeepSeek-V3)")
    p.add_argument("--out", required=True, help="directory to write the grown model to (new or empty)")
    p.add_argument("--dtype", default="bfloat16", choices=list(GROW_DTYPES),
                   help="dtype of the grown model's weights (default bfloat16)")
    p.add_argument("--device", default="cpu", help="torch device to build the grown model on (default cpu; cuda "
                                                   "builds a real-size model faster)")
    p.set_defaults(func=cmd_grow)

    p = sub.add_parser("bench-policy", help="per-call cost of the policy kernel and replay throughput")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--calls", type=int, default=3000, help="batch-1 calls per round and case (default 3000)")
    p.add_argument("--tokens", type=int, default=4000, help="tokens of the replayed trace (default 4000)")
    p.add_argument("--layers", type=int, default=16, help="MoE layers of the replayed trace (default 16)")
    p.add_argument("--json", help="write the JSON record here")
    p.add_argument("--threads", type=int, help="numba threads of the replay's layer-parallel kernel (and torch's); "
                                               "default: numba's (the CPU count)")
    p.set_defaults(func=cmd_bench_policy)

    p = sub.add_parser("bench-patch", help="decode ms/token of generate(), unpatched vs patched exact and psr")
    p.add_argument("--device", default="cuda", help="torch device (default cuda; cpu with --tiny)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="dtype of the random weights (default bf16)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each configuration first (default 1)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per run (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="seeded random prompt length (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    p.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="experts_implementation of the model (default grouped_mm)")
    p.add_argument("--calibrate-tokens", type=int, default=0,
                   help="calibrate on this many random tokens first (default 0: patched runs uncalibrated)")
    p.add_argument("--tiny", action="store_true", help="a tiny OLMoE shape that runs on a CPU in seconds")
    p.add_argument("--json", help="write the JSON record here")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=cmd_bench_patch)

    p = sub.add_parser("bench", help="offload latency: teacher-forced decode ms/token and copies per token of "
                                     "resident, accelerate and routed rows (the paper's Section 6.1)")
    p.add_argument("--model", default="grown-olmoe-routing",
                   help="grown-olmoe-routing (the default: the shipped trained olmoe-routing grown exactly to "
                        "OLMoE-1B-7B's size, bf16 on a GPU; trained routing, real-size experts), "
                        "grown-moonlight-routing (the same for Moonlight-16B-A3B), random-olmoe-1b-7b (random "
                        "weights, bf16), tiny (random, CPU-sized, float32), a shipped model (tiny-moe, "
                        "olmoe-routing, moonlight-routing: float32), a model directory or a hub id owner/name")
    p.add_argument("--device", default=None, help="torch device (default: cpu for the small models tiny, tiny-moe, "
                                                  "olmoe-routing and moonlight-routing, cuda:0 for the others)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, at least 3 (default 3)")
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
    p.add_argument("--calibration", help="a saved calibration (.safetensors); default: calibrate on stdlib sources")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="tokens of the default calibration (default 8192)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="text file to cut the windows from (repeatable; default: standard-library sources)")
    p.add_argument("--warmup", type=int, default=1, help="untimed short warm-up rounds first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--json", help="write the JSON record here")
    p.add_argument("--plot", help="write the latency-vs-copies plot here (PNG)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("sweep", help="the latency-divergence frontier: every policy, lam, budget, eviction and "
                                     "residency timed (engine on a GPU) and scored on selfgen and held-out text; "
                                     "resumable (the paper's Figure 1, Table 2, Section 6.6)")
    p.add_argument("--model", default="grown-olmoe-routing",
                   help="as in psr-hf bench (default grown-olmoe-routing); a grown model's divergence is measured "
                        "on the small trained model it was grown from (same function, float32)")
    p.add_argument("--device", default=None, help="torch device (default: cpu for the small models tiny, tiny-moe, "
                                                  "olmoe-routing and moonlight-routing, cuda:0 for the others)")
    p.add_argument("--residencies", default="0.5,0.25", help="residencies (default 0.5,0.25; the paper adds 0.375 "
                                                             "for Moonlight)")
    p.add_argument("--lams", default="0.1,0.15,0.2,0.25,0.3", help="bonus scales (default 0.1,0.15,0.2,0.25,0.3)")
    p.add_argument("--budgets", default="1,2,8", help="PSR prefetch budgets n (default 1,2,8; 8 = unbounded)")
    p.add_argument("--evictions", default="score,lru", help="Cache-Prior and PSR evictions (default score,lru)")
    p.add_argument("--no-published", action="store_true",
                   help="leave out Cache-Prior as published (top-J 1 and 2, running bonus scale)")
    p.add_argument("--configs", help="comma-separated grid names to keep (e.g. exact_lru,cp_lam0.2,psr_lam0.2_n1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved latency rounds, at least 3 (default 3)")
    p.add_argument("--windows", type=int, default=2, help="latency windows per round (default 2)")
    p.add_argument("--tokens", type=int, default=64, help="timed decode positions per window (default 64)")
    p.add_argument("--selfgen-windows", type=int, default=8, help="windows sampled from the exact model (default 8)")
    p.add_argument("--selfgen-tokens", type=int, default=256, help="tokens sampled per window (default 256)")
    p.add_argument("--heldout-windows", type=int, default=8, help="held-out text windows (default 8)")
    p.add_argument("--heldout-tokens", type=int, default=256, help="tokens per held-out window (default 256)")
    p.add_argument("--engine", choices=("on", "off"),
                   help="time the engine's rows (default: on for a CUDA device) or the transformers offload path")
    p.add_argument("--calibration", help="a saved calibration (.safetensors); default: the model's, else calibrate "
                                         "on stdlib sources")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="tokens of the default calibration (default 8192)")
    p.add_argument("--quality-device", help="device of the divergence stage (default --device; cpu runs a grown "
                                            "model's small twin there)")
    p.add_argument("--stage", choices=("quality", "latency", "all"), default="all",
                   help="quality: only the divergence stage; latency: only the timing (each exits 3 while the "
                        "other is missing; --stage all with the same record completes it)")
    p.add_argument("--max-minutes", type=float,
                   help="stop (saving the record) once this much time has passed; the same command continues")
    p.add_argument("--seed", type=int, default=0, help="seed of the selfgen sampling and random weights (default 0)")
    p.add_argument("--json", help="the record: written as the sweep goes, read to continue an interrupted sweep")
    p.add_argument("--plot", help="write the latency-vs-divergence frontier here (PNG)")
    p.add_argument("--markdown", help="write Table 2, the ablations and the orderings here (Markdown)")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("bench-plot", help="the latency-vs-copies plot (PNG) of a psr-hf bench JSON record")
    p.add_argument("record", help="JSON record written by psr-hf bench --json")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.set_defaults(func=cmd_bench_plot)

    p = sub.add_parser("kl", help="excess NLL over exact routing (a KL diagnostic) and copies per token of exact+LRU, "
                                  "cache_prior and psr over a lam grid at each residency, on text windows")
    p.add_argument("--model", default="tiny-moe",
                   help="tiny-moe (default: the shipped trained tiny OLMoE), olmoe-routing or moonlight-routing "
                        "(shipped, trained, with OLMoE-1B-7B's and Moonlight-16B-A3B's routing shapes), their "
                        "grown-* versions (real-size; for a GPU), tiny (random, CPU-sized), random-olmoe-1b-7b, a "
                        "model directory or a hub id owner/name; shipped and grown models default to held-out text")
    p.add_argument("--device", default="cpu", help="torch device to run the model on (default cpu)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="text to cut windows from (repeatable; default: the held-out Persuasion text for tiny-moe, "
                        "standard-library sources otherwise)")
    p.add_argument("--windows", type=int, default=4, help="text windows to score (default 4)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per window after the first (default 256)")
    p.add_argument("--residencies", default="0.5,0.25",
                   help="comma-separated shares of each layer's experts that are resident (default 0.5,0.25)")
    p.add_argument("--lams", default="0.1,0.2,0.3",
                   help="comma-separated cache bonuses lam of cache_prior and psr (default 0.1,0.2,0.3)")
    p.add_argument("--budget", type=int, default=1, help="psr's budget (default 1)")
    p.add_argument("--predictor", help="a SpecPrefetch predictor (.safetensors) of this model: adds psr rows that "
                                       "rank their prefetches by it (..._pred_...) and compares each with its "
                                       "pre-gate twin (paired excess NLL, demand copies)")
    p.add_argument("--calibration", help="a saved calibration (.safetensors) of this model (default: the "
                                         "calibration.safetensors beside the model, else calibrate on "
                                         "standard-library modules other than the default windows')")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="tokens of the default calibration on standard-library modules (default 8192)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random models' weights")
    p.add_argument("--json", help="write the JSON record here")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of excess NLL (95%% interval) against copies per "
                                                  "token here: one line per policy, one panel per residency")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=cmd_kl)

    p = sub.add_parser("train-predictor", help="train SpecPrefetch's low-rank next-layer expert predictor of a model "
                                               "(prefetch ranking only) on text; writes .safetensors")
    p.add_argument("--model", required=True, help="tiny-moe, olmoe-routing, moonlight-routing, tiny (random), a "
                                                   "model directory or a hub id owner/name")
    p.add_argument("--tokens", type=int, default=32768, help="training tokens (default 32768)")
    p.add_argument("--out", required=True, help="predictor file to write (.safetensors)")
    _prefetch_options(p)
    p.set_defaults(func=cmd_train_predictor)

    p = sub.add_parser("profile-window", help="SpecPrefetch's window-aware budget: per layer pair the overlap window "
                                              "(prediction available -> next layer's experts start) on the engine, "
                                              "one expert's copy time, and the budget M_max they allow")
    p.add_argument("--model", default="grown-olmoe-routing",
                   help="grown-olmoe-routing (default; for a GPU), tiny-moe, olmoe-routing, tiny, a model directory "
                        "or a hub id owner/name")
    p.add_argument("--device", default=None, help="torch device (default: cpu for the small models tiny, tiny-moe, "
                                                  "olmoe-routing and moonlight-routing, cuda:0 for the others)")
    p.add_argument("--tokens", type=int, default=64, help="decode positions measured (default 64)")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (default 8)")
    p.add_argument("--copies", type=int, default=20, help="timed copies of one expert (default 20)")
    p.add_argument("--quantile", type=float, default=0.5,
                   help="M_max = this quantile of floor(W / t_copy) over every event (default 0.5, the median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random models' weights")
    p.add_argument("--json", help="write the JSON record here")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=cmd_profile_window)

    p = sub.add_parser("recall", help="next-layer ExpertRecall@M of SpecPrefetch and baselines (pre-gate, previous "
                                      "token, single MLP, ProMoE-style MLP) on held-out text (the paper's Tables 1-3)")
    p.add_argument("--model", default="tiny-moe", help="tiny-moe (default), olmoe-routing, moonlight-routing, tiny "
                                                       "(random), a model directory or a hub id owner/name")
    p.add_argument("--predictor", help="a trained SpecPrefetch predictor (.safetensors) to evaluate instead of "
                                       "training one (the baselines still train)")
    p.add_argument("--train-tokens", type=int, default=16384, help="training tokens of the learned methods "
                                                                   "(default 16384)")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="evaluated tokens (default 4096)")
    p.add_argument("--heldout-text", action="append", default=[], metavar="FILE",
                   help="held-out text (repeatable; default: the held-out Persuasion text for the shipped models, "
                        "standard-library window modules otherwise)")
    p.add_argument("--budgets", help="comma-separated candidate budgets M (default K/2,K,K+2)")
    p.add_argument("--json", help="write the JSON record here")
    _prefetch_options(p)
    p.set_defaults(func=cmd_recall)

    p = sub.add_parser("compare", help="paired comparison of lm-eval --log_samples runs with a reference: points, "
                                       "McNemar, Holm (the paper's Tables 3-4)")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="lm-eval --output_path directories (or LABEL=PATH); the first is the reference")
    p.add_argument("--metric", action="append", default=[], metavar="TASK=METRIC[,FILTER]",
                   help="metric (and filter) of a task instead of the default; repeat for several (columns)")
    p.add_argument("--tasks", help="comma-separated tasks to compare (default: every task of the reference)")
    p.add_argument("--json", help="write the JSON record here")
    p.add_argument("--alpha", type=float, default=0.05, help="level of Holm's correction and of the dagger (0.05)")
    p.add_argument("--permutations", type=int, default=100_000,
                   help="sign-flip test (IFEval instruction level): exact when 2^k <= N, else N Monte Carlo draws")
    p.add_argument("--seed", type=int, default=0, help="seed of the Monte Carlo sign flips (default 0)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("eval", add_help=False, help="lm-eval with --model psr_hf registered; every argument after "
                                                    "`eval` goes to lm-eval as it is (psr-hf eval --help: lm-eval's)")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, passed on as they are")
    p.set_defaults(func=cmd_eval)
    return parser


#: commands whose --out is a folder; every other command's --out, --json, --plot and --markdown is a file
_FOLDER_OUTPUTS = {"grow"}


#: the models small enough for a CPU: where --device is not given, they run there
SMALL_MODELS = ("tiny", "tiny-moe", "olmoe-routing", "moonlight-routing")


def _check_device(args: argparse.Namespace) -> None:
    """Resolve a --device left out (small models: cpu, others: cuda:0) and refuse a CUDA device that this torch
    cannot use, before anything loads."""
    if not hasattr(args, "device"):
        return
    if args.device is None:
        args.device = "cpu" if getattr(args, "model", None) in SMALL_MODELS else "cuda:0"
    if str(args.device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no CUDA device visible"
            raise ValueError(f"--device {args.device}: torch sees no CUDA device ({build}); use --device cpu")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path of the command checked before its work (a failed write after an hour of work loses it)."""
    from ._paths import check_output

    for name in ("out", "json", "plot", "markdown"):
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            check_output(f"--{name}", value, directory=name == "out" and args.command in _FOLDER_OUTPUTS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:  # argparse cannot pass on arguments that look like options: lm-eval gets them all
        args = argparse.Namespace(command="eval", verbose=False, func=cmd_eval, lm_eval_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_device(args)
        _check_outputs(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"psr-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
