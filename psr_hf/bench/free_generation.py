"""``psr-hf bench-free-generation``: latency of greedy free generation in the engine on benchmark prompts, the
paper's Section 6.4 and Table 6 (docs/results.md, "Free generation"), as one JSON-ready record.

:func:`run_free_generation` loads the model, tokenizes the prompt sets (:mod:`psr_hf.bench.prompt_sets`, cut from
the left to fit the engine's KV cache less the new tokens), calibrates, times the continuations
(:mod:`psr_hf.bench.free_generation_timing`) and summarizes them (:mod:`psr_hf.bench.free_generation_stats`);
:mod:`psr_hf.bench.free_generation_report` writes its text. The library logs; the command prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..assets.loading import GROWN_OLMOE
from .prompt_sets import HUMANEVAL_EVERY, TASKS

__all__ = ["DEFAULT_CONFIGS", "DEFAULT_PROMPTS", "STOP_MODES", "run_free_generation"]

logger = logging.getLogger(__name__)

# the paper's Table 6 configurations on OLMoE: exact, Cache-Prior lam 0.2 and PSR's fast and quality points at 50%,
# Cache-Prior lam 0.2 and PSR lam 0.25 n1 at 25% (engine_resident, the engine rows' reference, is always added)
DEFAULT_CONFIGS = ("exact_lru_res50", "cp_lam0.2_res50", "psr_lam0.3_n1_res50", "psr_lam0.2_n1_res50",
                   "cp_lam0.2_res25", "psr_lam0.25_n1_res25")
DEFAULT_PROMPTS = 20  # per task (the gsm8k set has 8)
STOP_MODES = ("eos", "task")
MAX_LEN_CAP = 2048  # the default KV cache: the model's positions, at most this many
BOOTSTRAP_RESAMPLES = 10_000


def _eos_ids(net: Any, tokenizer: Any) -> list[int]:
    """The end-of-sequence ids of the model's generation config (else the tokenizer's)."""
    eos = getattr(getattr(net, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def _max_len(net: Any, max_len: int | None) -> int:
    positions = int(getattr(net.config.get_text_config(), "max_position_embeddings", 0) or 0)
    if max_len is None:
        return min(positions, MAX_LEN_CAP) if positions else MAX_LEN_CAP
    if max_len < 2:
        raise ValueError(f"--max-len {max_len}: give at least 2 positions")
    if positions and max_len > positions:
        raise ValueError(f"--max-len {max_len} exceeds the model's {positions} positions (max_position_embeddings)")
    return max_len


def run_free_generation(
    *, model: str = GROWN_OLMOE, device: str = "cuda:0", configs: Sequence[str] = DEFAULT_CONFIGS,
    tasks: Sequence[str] = TASKS, prompts: int | None = DEFAULT_PROMPTS, prompt_file: str | None = None,
    humaneval_every: int = HUMANEVAL_EVERY, max_new_tokens: int = 128, max_len: int | None = None,
    stop: str = "eos", rounds: int = 3, warmup: int = 1, max_in_flight: int = 2,
    calibration: str | None = None, calibration_tokens: int | None = None, seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES, progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Load ``model`` on ``device``, decode the greedy continuations of ``prompts`` prompts per task of ``tasks``
    (from ``prompt_file`` where given, else the installed packages) under ``configs`` (row names with a
    residency, :func:`~psr_hf.bench.free_generation_timing.free_generation_rows`) over ``rounds``; returns the
    record: settings, model, prompts, calibration, machine, versions, results (task -> one record per row) and
    ratios (PSR over Cache-Prior per task, :func:`~psr_hf.bench.free_generation_stats.table_ratios`).

    ``max_len``: the engine's KV cache (default: the model's positions, at most :data:`MAX_LEN_CAP`); every
    prompt keeps its last ``max_len - max_new_tokens`` tokens. ``stop``: ``eos`` ends a continuation at the
    model's end-of-sequence token or after ``max_new_tokens``; ``task`` also at the task's stop sequences.
    ``calibration``: a saved calibration (default: the one beside the model, else ``calibration_tokens`` tokens of
    standard-library sources, as ``psr-hf bench``). ``seed``: the random models' weights and the bootstrap over
    prompts (``resamples``)."""
    from .common import CALIBRATION_TOKENS, describe_model, machine, versions
    from .free_generation_stats import table_ratios, task_records
    from .free_generation_timing import WARMUP_NEW_TOKENS, bench_free_generation, free_generation_rows
    from .prompt_sets import build_prompt_sets, check_tasks, load_prompt_sets, tokenized
    from .timing import check_rounds
    from .workloads import load_model, model_calibration

    check_rounds(rounds)  # everything given is checked before the model loads
    rows = free_generation_rows(configs)
    tasks = check_tasks(tasks)
    if stop not in STOP_MODES:
        raise ValueError(f"--stop {stop}: allowed {', '.join(STOP_MODES)}")
    if max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: give at least 2 (one decode step after the first "
                         "token, which comes with the prompt)")
    if resamples < 100:
        raise ValueError(f"--resamples {resamples}: give at least 100 bootstrap resamples")
    sets = load_prompt_sets(prompt_file, tasks) if prompt_file else build_prompt_sets(tasks,
                                                                                       humaneval_every=humaneval_every)
    sets = [s.select(prompts) for s in sets]
    if progress is not None:
        progress(f"loading {model} on {device}")
    net, tokenizer, description = load_model(model, device, seed=seed)
    beside = description.pop("calibration_file", None)
    kv_len = _max_len(net, max_len)
    limit = kv_len - max_new_tokens
    if limit < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in --max-len {kv_len}")
    ids = {s.task: tokenized(s, tokenizer, limit) for s in sets}
    vocab = int(net.config.get_text_config().vocab_size)
    if max(t for task in ids.values() for p in task for t in p.ids) >= vocab:
        raise ValueError(f"token ids exceed the model's vocabulary ({vocab}): is the tokenizer the model's?")
    tokens = CALIBRATION_TOKENS if calibration_tokens is None else calibration_tokens
    calib, calibration_info = model_calibration(net, tokenizer, tokens=tokens, calibration=calibration,
                                                beside=beside, beside_name=description.get("calibration"),
                                                progress=progress)
    eos = _eos_ids(net, tokenizer)
    results, capacity, memory = bench_free_generation(
        net, ids, configs=rows, calibration=calib, rounds=rounds, warmup=warmup, max_new_tokens=max_new_tokens,
        max_len=kv_len, stop_ids=eos, stop_strings={s.task: s.stop for s in sets} if stop == "task" else None,
        tokenizer=tokenizer, max_in_flight=max_in_flight, progress=progress)
    info = describe_model(net)
    records = task_records(rows, results, tasks, info, capacity, memory)
    device_used = next(net.parameters()).device
    return {
        "benchmark": "free_generation",
        "settings": {
            "model": model, "device": str(device_used), "configs": [row.name for row in rows], "tasks": tasks,
            "prompts_per_task": prompts, "prompt_file": prompt_file, "humaneval_every": humaneval_every,
            "max_new_tokens": max_new_tokens, "max_len": kv_len, "max_prompt_tokens": limit, "stop": stop,
            "eos_token_ids": eos, "rounds": rounds, "warmup": warmup, "warmup_new_tokens": WARMUP_NEW_TOKENS,
            "max_in_flight": max_in_flight, "calibration": calibration,
            "calibration_tokens": tokens, "seed": seed, "bootstrap_resamples": resamples,
            "batch": 1, "engine_graphs": device_used.type == "cuda",
            "decoding": "greedy, psr_hf's engine (GraphDecoder: CUDA graphs on CUDA, the same step eagerly "
                        "elsewhere), one new sequence per prompt: the prompt through decoder.prefill and the "
                        "argmax of its logits timed as one unit (prompt time), then one decoder.step and argmax "
                        "per generated token, the device synchronised after each; stop checks between the timed "
                        "steps; the last token is not fed back",
            "order": "every configuration once per round over every task's prompts, the configurations' order "
                     "rotated by one per round",
            "statistics": "ms per generated token: the decode steps of a task's prompts per round, mean over "
                          "rounds with a 95% t-interval; p99 over every step of every round; copies per token: "
                          "the controller's statistics over the decode steps (reset after the prompt), "
                          "token-weighted over prompts, mean over rounds; ratios over rounds: paired t on the "
                          "per-round log ms/token; over prompts: bootstrap of the task's prompts (seeded, "
                          "percentile); sign test: scipy binomtest over the prompts that are not ties; Holm over "
                          "the table's ratios and, apart, over its sign tests",
        },
        "model": {**description, **info},
        "prompts": {s.task: {"source": s.source, "stop": list(s.stop) if stop == "task" else [],
                             "prompts": [{"key": p.key, "tokens": len(p.ids), "dropped": p.dropped, "ids": list(p.ids)}
                                         for p in ids[s.task]]}
                    for s in sets},
        "calibration": calibration_info,
        "machine": machine(device_used),
        "versions": versions(),
        "results": records,
        "ratios": table_ratios(rows, records, seed=seed, resamples=resamples),
    }
