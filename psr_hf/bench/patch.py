"""``psr-hf bench-patch``: the patching overhead of ``generate()``, decode ms per token unpatched vs patched.

An OLMoE-1B-7B-shaped model with random weights (every expert resident on the device), batch-1 greedy decoding of
a fixed seeded prompt; each round runs every configuration once in an order rotated by one per round (interleaved),
a configuration patched right before its run and unpatched right after. Decode-only time comes from a streamer
that synchronises the device and takes a timestamp at each token: ``(t[n] - t[1]) / (n - 1)`` per decode step,
prefill excluded (``t[1] - t[0]``, recorded beside it); the routing statistics cover the same decode steps.

Per configuration: mean and median over rounds with a 95% t-interval, and the ratio to the unpatched baseline
paired by round (exponentiated mean of the per-round log ratios with its 95% t-interval). The exact
configuration's tokens are compared with the same round's unpatched tokens (bitwise identity is a correctness
claim the table shows). The library logs; ``psr-hf bench-patch`` (:mod:`psr_hf.cli`) prints.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from .._progress import tqdm

from ..hf.patching import controller, patch, unpatch
from ..policy.config import RoutingConfig
from .common import device_sync, machine, paired_ratio, quiet_uncalibrated, rotated, summarize
from .workloads import TINY_SHAPE, build_random_model, olmoe_1b_7b_config, prompt_ids, router_weight_std

if TYPE_CHECKING:
    from ..policy.calibration import Calibration

logger = logging.getLogger(__name__)

BASELINE = "unpatched"
# the three rows: unpatched, exact routing with LRU and no prefetch, PSR at the paper's operating point
DEFAULT_CONFIGS: dict[str, RoutingConfig | None] = {
    BASELINE: None,
    "exact": RoutingConfig(policy="exact", eviction="lru", budget=0, residency=0.5),
    "psr": RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5),
}
GOAL_RATIO = 1.10  # the goal: patching costs at most 10%

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the model config fields a record names
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings",
              "rope_parameters", "rms_norm_eps")


# ---------------------------------------------------------------------------------------------------- one run
class _DecodeClock:  # duck-typed transformers BaseStreamer (put, end): generate() only calls those
    """A ``generate()`` streamer that timestamps each call (after synchronising the device).

    ``generate()`` calls ``put`` with the prompt before the prefill, then with every new token once it is on the
    host; ``on_first_token`` runs at the first new token (before the first decode step). ``generate()`` already
    waits for each token on the host (it reads the stop flag every step), so the synchronisation adds nothing but
    the timestamp."""

    def __init__(self, sync: Callable[[], None], on_first_token: Callable[[], None] | None = None):
        self.sync = sync
        self.on_first_token = on_first_token
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.sync()
        self.times.append(time.perf_counter())
        if len(self.times) == 2 and self.on_first_token is not None:
            self.on_first_token()

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class DecodeRun:
    """One timed ``generate()``: decode-only ms per token, prefill ms, wall ms, the new tokens, routing stats."""

    ms_per_token: float
    prefill_ms: float
    total_ms: float
    tokens: list[int]
    experts_during_decode: str | None
    decode_stats: dict[str, float] | None  # Controller totals over the decode steps (None: unpatched)
    sequence_stats: dict[str, float] | None  # row 0 over prompt + decode
    effective: dict[str, Any] | None  # what the logical cache runs: capacity, window, budget, delta_mode


def _experts_implementation(model: torch.nn.Module) -> str | None:
    getter = getattr(model, "get_experts_implementation", None)
    if getter is not None:
        return str(getter().get(""))
    return getattr(model.config, "_experts_implementation", None)


def decode_run(model: torch.nn.Module, config: RoutingConfig | None, input_ids: torch.Tensor,
               new_tokens: int, calibration: Calibration | None = None) -> DecodeRun:
    """Patch ``model`` with ``config`` and ``calibration`` (config None: leave it unpatched), greedy-decode
    ``new_tokens`` tokens after ``input_ids`` ``[1, P]``, unpatch; returns the timings, tokens and routing
    statistics (see module docstring)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 (decode-only time needs a step after the first token)")
    device = input_ids.device
    sync = device_sync(device)
    if config is not None:
        patch(model, config, calibration=calibration)
    try:
        ctl = controller(model) if config is not None else None
        seen: dict[str, str | None] = {}

        def first_token() -> None:
            seen["experts"] = _experts_implementation(model)  # what the decode steps run (generate may switch it)
            if ctl is not None:
                ctl.reset_stats()  # from here on, the totals count decode steps only

        clock = _DecodeClock(sync, first_token)
        mask = torch.ones_like(input_ids)
        sync()
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, use_cache=True, streamer=clock)
        sync()
        stop = time.perf_counter()
        decode_stats = sequence_stats = effective = None
        if ctl is not None:
            effective = {"capacity": int(ctl.cache.capacity), "window": int(ctl.cache.window),
                         "budget": int(ctl.cache.budget), "delta_mode": ctl.cache.delta_mode}
            s = ctl.stats()
            decode_stats = dict(s.total)
            sequence_stats = {name: float(v[0]) for name, v in s.to_dict()["rows"].items()}
    finally:
        if config is not None:
            unpatch(model)
    t = clock.times
    tokens = out[0, input_ids.shape[1]:].tolist()
    if len(t) != new_tokens + 1 or len(tokens) != new_tokens:
        raise RuntimeError(
            f"generate() produced {len(tokens)} tokens and {len(t) - 1} streamed ones, not {new_tokens}; "
            "an end-of-sequence token or a stopping criterion ended it early"
        )
    return DecodeRun(
        ms_per_token=(t[-1] - t[1]) / (new_tokens - 1) * 1e3,
        prefill_ms=(t[1] - t[0]) * 1e3,
        total_ms=(stop - start) * 1e3,
        tokens=tokens,
        experts_during_decode=seen.get("experts"),
        decode_stats=decode_stats,
        sequence_stats=sequence_stats,
        effective=effective,
    )


# ---------------------------------------------------------------------------------------------------- benchmark
def bench_patch(
    model: torch.nn.Module, *, configs: Mapping[str, RoutingConfig | None] | None = None, prompt_tokens: int = 32,
    new_tokens: int = 256, rounds: int = 5, warmup: int = 1, seed: int = 0, baseline: str | None = None,
    calibration: Calibration | None = None, progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Time greedy decoding of ``model`` under each configuration, interleaved over ``rounds``.

    Args:
        model: a transformers MoE model psr_hf can patch (unpatched on entry and on return).
        configs: name -> :class:`RoutingConfig`, or None for the unpatched model; default :data:`DEFAULT_CONFIGS`.
        prompt_tokens, new_tokens: prompt length (seeded random ids, :func:`prompt_ids`) and tokens generated.
        rounds: timed rounds; each runs every configuration once, the order rotated by one per round.
        warmup: untimed runs of every configuration before the rounds (kernel compilation, allocator, clocks).
        seed: seed of the prompt.
        baseline: the configuration ratios and token identity refer to; default the first unpatched one (else
            the first configuration).
        calibration: passed to :func:`psr_hf.patch` for every patched run (None: uncalibrated; psr then uses
            the running bonus scale).

    Returns one dict per configuration, in ``configs`` order: ``ms_per_token`` and ``prefill_ms``
    (:func:`~psr_hf.bench.common.summarize` over rounds), ``ratio`` (:func:`~psr_hf.bench.common.paired_ratio`
    to the baseline), decode-only routing statistics (means over rounds; None when unpatched),
    ``tokens_identical_to_baseline`` (every round's tokens equal the same round's baseline tokens) and the tokens
    of the last round.
    """
    configs = dict(DEFAULT_CONFIGS if configs is None else configs)
    baseline = _baseline_of(configs, rounds, warmup, baseline)
    device = next(model.parameters()).device
    ids = prompt_ids(int(model.config.get_text_config().vocab_size), prompt_tokens, seed).to(device)
    if calibration is None and any(config is not None for config in configs.values()):
        logger.info("bench_patch: patched runs are uncalibrated (warm set = the first C experts, no token prior, "
                    "running bonus scale)")
    runs, baseline_tokens = _timed_runs(model, configs, ids, new_tokens, rounds, warmup, baseline, calibration,
                                        progress)
    repeatable = all(tokens == baseline_tokens[0] for tokens in baseline_tokens)
    return [_result(name, configs[name], runs[name], runs[baseline], name == baseline, repeatable) for name in runs]


def _baseline_of(configs: Mapping[str, RoutingConfig | None], rounds: int, warmup: int, baseline: str | None) -> str:
    """The baseline configuration (given, else the first unpatched one, else the first); ``ValueError`` for no
    configurations, a bad count of rounds, or a baseline that is not one of them."""
    if not configs:
        raise ValueError("configs is empty; give at least one name -> RoutingConfig or None")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} must be >= 1 and warmup={warmup} >= 0")
    if baseline is None:
        baseline = next((name for name, config in configs.items() if config is None), next(iter(configs)))
    if baseline not in configs:
        raise ValueError(f"baseline={baseline!r} is not one of the configurations: {', '.join(configs)}")
    return baseline


def _timed_runs(model: torch.nn.Module, configs: Mapping[str, RoutingConfig | None], ids: torch.Tensor,
                new_tokens: int, rounds: int, warmup: int, baseline: str, calibration: Calibration | None,
                progress: Callable[[str], None] | None) -> tuple[dict[str, list[DecodeRun]], list[list[int]]]:
    """The warm-up runs and the timed rounds; returns each configuration's timed runs and the tokens of every
    baseline run, warm-up included (is the baseline repeatable?)."""
    names = list(configs)
    runs: dict[str, list[DecodeRun]] = {name: [] for name in names}
    baseline_tokens: list[list[int]] = []
    # a tqdm bar (stderr) over every run of every warm-up and timed round when the caller asks for progress
    bar = tqdm(total=(warmup + rounds) * len(names), unit="run", desc="bench-patch", disable=progress is None)
    with quiet_uncalibrated(), bar:
        for w in range(warmup):
            for name in names:
                bar.set_postfix_str(f"warm-up: {name}")
                run = decode_run(model, configs[name], ids, new_tokens, calibration)
                bar.update()
                if name == baseline:
                    baseline_tokens.append(run.tokens)
            if progress is not None:
                progress(f"warm-up {w + 1}/{warmup} done")
        for r in range(rounds):
            for name in rotated(names, r):
                bar.set_postfix_str(f"round {r + 1}: {name}")
                runs[name].append(decode_run(model, configs[name], ids, new_tokens, calibration))
                bar.update()
            baseline_tokens.append(runs[baseline][-1].tokens)
            if progress is not None:
                line = ", ".join(f"{name} {runs[name][-1].ms_per_token:.2f}" for name in names)
                progress(f"round {r + 1}/{rounds}: ms/token {line}")
    return runs, baseline_tokens


def _result(name: str, config: RoutingConfig | None, done: Sequence[DecodeRun], reference: Sequence[DecodeRun],
            is_baseline: bool, repeatable: bool) -> dict[str, Any]:
    """One configuration's result from its timed runs and the baseline's (``reference``, paired by round)."""
    ms = [run.ms_per_token for run in done]
    same = [run.tokens == ref.tokens for run, ref in zip(done, reference)]
    divergence = [next((i for i, (a, b) in enumerate(zip(run.tokens, ref.tokens)) if a != b), None)
                  for run, ref in zip(done, reference)]
    stats = None
    if done[0].decode_stats is not None:
        keys = ("tokens", "copies_per_token", "prefetch_per_token", "demand_per_token", "replaced_per_token",
                "displaced_mass")
        stats = {key: float(np.mean([run.decode_stats[key] for run in done])) for key in keys}
        stats["sequence"] = {key: float(np.mean([run.sequence_stats[key] for run in done])) for key in keys}
    return {
        "configuration": name,
        "routing": None if config is None else config.to_dict(),
        "routing_effective": done[0].effective,
        "baseline": is_baseline,
        "ms_per_token": summarize(ms),
        "prefill_ms": summarize([run.prefill_ms for run in done]),
        "total_ms": summarize([run.total_ms for run in done]),
        "ratio": paired_ratio(ms, [run.ms_per_token for run in reference]),
        "routing_stats": stats,
        "tokens_identical_to_baseline": all(same),
        "rounds_identical_to_baseline": int(sum(same)),
        "first_divergence": divergence,
        "baseline_repeatable": repeatable,
        "experts_implementation_during_decode": done[0].experts_during_decode,
        "tokens": done[-1].tokens,
    }


# ---------------------------------------------------------------------------------------------------- record
def run_bench_patch(
    *, device: str = "cuda", dtype: str = "bf16", tiny: bool = False, rounds: int = 5, new_tokens: int = 256,
    prompt_tokens: int = 32, warmup: int = 1, seed: int = 0, experts_implementation: str = "grouped_mm",
    calibrate_tokens: int = 0, configs: Mapping[str, RoutingConfig | None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build the random model (OLMoE-1B-7B shape, or :data:`TINY_SHAPE` with ``tiny``), run :func:`bench_patch`
    and return a JSON-ready record: settings, model, machine (device name, torch/transformers versions), results.

    ``calibrate_tokens`` > 0 calibrates the model (:func:`psr_hf.calibrate`) on that many seeded random token ids
    first, so the patched runs pay for a fixed bonus scale and a token prior as a calibrated deployment does (the
    values mean nothing for random weights); 0 runs them uncalibrated."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    if new_tokens < 2 or prompt_tokens < 1 or rounds < 1 or warmup < 0 or calibrate_tokens < 0:
        raise ValueError("new_tokens must be >= 2, prompt_tokens and rounds >= 1, warmup and calibrate_tokens >= 0")
    config = olmoe_1b_7b_config(**(TINY_SHAPE if tiny else {}))
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; run with --device cpu --tiny here")
    if progress is not None:
        progress(f"building the random {'tiny' if tiny else 'OLMoE-1B-7B'}-shaped model on {device} ({dtype})")
    model = build_random_model(config, target, DTYPES[dtype], seed=seed, experts_implementation=experts_implementation)
    target = next(model.parameters()).device
    configs = dict(DEFAULT_CONFIGS if configs is None else configs)
    calibration = _random_calibration(model, calibrate_tokens, seed + 1, progress) if calibrate_tokens else None
    rows = bench_patch(model, configs=configs, prompt_tokens=prompt_tokens, new_tokens=new_tokens, rounds=rounds,
                       warmup=warmup, seed=seed, calibration=calibration, progress=progress)
    record = {
        "benchmark": "patch",
        "settings": {
            "rounds": rounds, "warmup": warmup, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "seed": seed, "batch": 1, "decoding": "greedy generate(), min_new_tokens = max_new_tokens, no eos",
            "prompt": f"uniform random ids from a CPU torch.Generator seeded {seed}",
            "prompt_ids": prompt_ids(config.vocab_size, prompt_tokens, seed)[0].tolist(),
            "order": "every configuration once per round, order rotated by one per round; patched right before "
                     "its run, unpatched right after",
            "timing": "decode only: streamer timestamps (device synchronised) from the first new token to the "
                      "last, divided by new_tokens - 1; prefill_ms from the prompt to the first token",
            "routing_stats": "Controller totals over the decode steps (reset at the first token), mean over rounds",
            "calibration": None if calibration is None else
                f"psr_hf.calibrate on {calibrate_tokens} uniform random token ids (CPU generator seed {seed + 1})",
            "goal": f"ratio to {BASELINE} <= {GOAL_RATIO}",
        },
        "model": {
            "class": type(model).__name__,
            "shape": "tiny" if tiny else "OLMoE-1B-7B",
            "config": {key: getattr(config, key) for key in SHAPE_KEYS},
            "dtype": dtype,
            "device": str(target),
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "experts_implementation": _experts_implementation(model),
            "experts_implementation_during_decode": rows[0]["experts_implementation_during_decode"],
            "router_weight_std": router_weight_std(config.hidden_size),
            "weights": f"random, torch.manual_seed({seed}) on {target.type}; routers at router_weight_std",
        },
        "machine": machine(target),
        "results": rows,
    }
    return record


def _random_calibration(model: torch.nn.Module, tokens: int, seed: int,
                        progress: Callable[[str], None] | None) -> Calibration:
    """:func:`psr_hf.calibrate` on ``tokens`` seeded random token ids (windows of 256): what a calibrated deployment
    pays for, with values that mean nothing for random weights."""
    from ..hf.calibrate import calibrate

    if progress is not None:
        progress(f"calibrating on {tokens} random tokens")
    window = 256
    vocab = int(model.config.get_text_config().vocab_size)
    ids = prompt_ids(vocab, -(-tokens // window) * window, seed).reshape(-1, window)
    return calibrate(model, ids, max_length=window, batch_size=4, max_tokens=tokens, progress=False)


# ---------------------------------------------------------------------------------------------------- CLI
def format_table(record: dict[str, Any]) -> str:
    """The results of :func:`run_bench_patch` as a text table."""
    from .._text import text_table

    rows = []
    for row in record["results"]:
        ms = row["ms_per_token"]
        lo, hi = ms["ci95"]
        mean = f"{ms['mean']:.2f} ± {(hi - lo) / 2:.2f}" if math.isfinite(hi) else f"{ms['mean']:.2f}"
        if row["baseline"]:
            ratio, identical = "1 (baseline)", "-"
        else:
            r = row["ratio"]
            ratio = f"{r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
            n = len(ms["rounds"])
            identical = f"{'yes' if row['tokens_identical_to_baseline'] else 'no'} ({row['rounds_identical_to_baseline']}/{n})"
        stats = row["routing_stats"]
        copies = "-" if stats is None else f"{stats['copies_per_token']:.2f}"
        replaced = "-" if stats is None else f"{stats['replaced_per_token']:.2f}"
        rows.append([row["configuration"], mean, f"{ms['median']:.2f}", ratio, copies, replaced, identical])
    header = ["configuration", "ms/token mean ± 95% CI", "median", "ratio vs unpatched [95% CI]", "copies/tok",
              "replaced/tok", "tokens = unpatched"]
    return text_table(rows, header)


def report_lines(record: dict[str, Any]) -> list[str]:
    """The lines ``psr-hf bench-patch`` prints under the table: how it was measured, the goal, model and machine."""
    model, machine = record["model"], record["machine"]
    lines = ["", "decode-only ms per token (prefill excluded; mean ± half-width of the 95% t-interval over rounds); "
                 "ratio: paired per round, geometric mean"]
    calibrated = "uncalibrated" if record["settings"]["calibration"] is None else "calibrated on random tokens"
    lines.append(f"exact: policy exact, LRU, budget 0, residency 0.5; psr: lam 0.2, budget 1, residency 0.5 "
                 f"({calibrated}); copies and replaced router slots per decoded token, all MoE layers")
    baseline_ok = record["results"][0]["baseline_repeatable"]
    lines.append(f"unpatched tokens identical across all runs: "
                 f"{'yes' if baseline_ok else 'NO (nondeterministic kernels)'}")
    for row in record["results"]:
        if not row["baseline"]:
            hi = row["ratio"]["ci95"][1]
            verdict = "met" if hi <= GOAL_RATIO else ("not shown" if row["ratio"]["ratio"] <= GOAL_RATIO else "missed")
            lines.append(f"goal ratio <= {GOAL_RATIO:.2f} for {row['configuration']}: {verdict} "
                         f"(ratio {row['ratio']['ratio']:.3f}, upper 95% bound {hi:.3f})")
    decode = model["experts_implementation_during_decode"]
    note = "" if decode == model["experts_implementation"] else " (generate() switches it for decode steps)"
    n = model["parameters"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    lines.append(f"model: {size} parameters, {model['dtype']}, experts "
                 f"{model['experts_implementation']}, during decode {decode}{note}")
    lines.append(f"machine: {machine['device']}, torch {machine['torch']}, transformers {machine['transformers']}")
    return lines
