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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..assets.loading import GROWN_OLMOE
from .prompt_sets import HUMANEVAL_EVERY, TASKS, PromptSet, TokenizedPrompt
from .settings import frozen, settings_of

if TYPE_CHECKING:
    import torch

    from .rows import Row

__all__ = ["DEFAULT_CONFIGS", "DEFAULT_PROMPTS", "STOP_MODES", "FreeGenerationSettings", "run_free_generation"]

logger = logging.getLogger(__name__)

# the paper's Table 6 configurations on OLMoE: exact, Cache-Prior lam 0.2 and PSR's fast and quality points at 50%,
# Cache-Prior lam 0.2 and PSR lam 0.25 n1 at 25% (engine_resident, the engine rows' reference, is always added)
DEFAULT_CONFIGS = ("exact_lru_res50", "cp_lam0.2_res50", "psr_lam0.3_n1_res50", "psr_lam0.2_n1_res50",
                   "cp_lam0.2_res25", "psr_lam0.25_n1_res25")
DEFAULT_PROMPTS = 20  # per task (the gsm8k set has 8)
STOP_MODES = ("eos", "task")
MAX_LEN_CAP = 2048  # the default KV cache: the model's positions, at most this many
BOOTSTRAP_RESAMPLES = 10_000


# what the record says about how the continuations were decoded, ordered and summarised
DECODING = ("greedy, psr_hf's engine (GraphDecoder: CUDA graphs on CUDA, the same step eagerly elsewhere), one new "
            "sequence per prompt: the prompt through decoder.prefill and the argmax of its logits timed as one unit "
            "(prompt time), then one decoder.step and argmax per generated token, the device synchronised after "
            "each; stop checks between the timed steps; the last token is not fed back")
ORDER = ("every configuration once per round over every task's prompts, the configurations' order rotated by one "
         "per round")
STATISTICS = ("ms per generated token: the decode steps of a task's prompts per round, mean over rounds with a 95% "
              "t-interval; p99 over every step of every round; copies per token: the controller's statistics over "
              "the decode steps (reset after the prompt), token-weighted over prompts, mean over rounds; ratios over "
              "rounds: paired t on the per-round log ms/token; over prompts: bootstrap of the task's prompts "
              "(seeded, percentile); sign test: scipy binomtest over the prompts that are not ties; Holm over the "
              "table's ratios and, apart, over its sign tests")


@dataclass(frozen=True)
class FreeGenerationSettings:
    """What :func:`run_free_generation` measures; validated here, once, before the model loads (the limits that
    depend on the model, its positions and vocabulary, are checked once it is loaded).

    Attributes:
        model, device, seed: the model name, where it runs, and the seed of random weights and of the bootstrap.
        configs: row names with a residency (:func:`~psr_hf.bench.free_generation_timing.free_generation_rows`).
        tasks, prompts, prompt_file, humaneval_every: ``prompts`` prompts per task of ``tasks`` (None: all), from
            ``prompt_file`` where given, else the installed packages (HumanEval: every ``humaneval_every``-th).
        max_new_tokens, max_len: the continuation's length (>= 2) and the engine's KV cache (default: the model's
            positions, at most :data:`MAX_LEN_CAP`); every prompt keeps its last ``max_len - max_new_tokens`` tokens.
        stop: ``eos`` ends a continuation at the model's end-of-sequence token or after ``max_new_tokens``; ``task``
            also at the task's stop sequences.
        rounds, warmup, max_in_flight: interleaved rounds (>= 3), untimed warm-up rounds, prefetches in flight.
        calibration, calibration_tokens: a saved calibration (default: the one beside the model, else
            ``calibration_tokens`` tokens of standard-library sources, as ``psr-hf bench``).
        resamples: the bootstrap's resamples over prompts (>= 100).
    """

    model: str = GROWN_OLMOE
    device: str = "cuda:0"
    configs: Sequence[str] = DEFAULT_CONFIGS
    tasks: Sequence[str] = TASKS
    prompts: int | None = DEFAULT_PROMPTS
    prompt_file: str | None = None
    humaneval_every: int = HUMANEVAL_EVERY
    max_new_tokens: int = 128
    max_len: int | None = None
    stop: str = "eos"
    rounds: int = 3
    warmup: int = 1
    max_in_flight: int = 2
    calibration: str | None = None
    calibration_tokens: int | None = None
    seed: int = 0
    resamples: int = BOOTSTRAP_RESAMPLES

    def __post_init__(self) -> None:
        from .free_generation_timing import free_generation_rows
        from .prompt_sets import check_tasks
        from .timing import check_rounds

        check_rounds(self.rounds)
        free_generation_rows(self.configs)
        frozen(self, "configs", tuple(self.configs))
        frozen(self, "tasks", tuple(check_tasks(self.tasks)))
        if self.stop not in STOP_MODES:
            raise ValueError(f"--stop {self.stop}: allowed {', '.join(STOP_MODES)}")
        if self.max_new_tokens < 2:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: give at least 2 (one decode step after the "
                             "first token, which comes with the prompt)")
        if self.resamples < 100:
            raise ValueError(f"--resamples {self.resamples}: give at least 100 bootstrap resamples")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"--max-len {self.max_len}: give at least 2 positions")

    def rows(self) -> list[Row]:
        """``engine_resident`` and the engine row of each configuration."""
        from .free_generation_timing import free_generation_rows

        return free_generation_rows(self.configs)

    def prompt_sets(self) -> list[PromptSet]:
        """Each task's prompts (at most ``prompts`` of them), from ``prompt_file`` or the installed packages."""
        from .prompt_sets import build_prompt_sets, load_prompt_sets

        tasks = list(self.tasks)
        sets = (load_prompt_sets(self.prompt_file, tasks) if self.prompt_file
                else build_prompt_sets(tasks, humaneval_every=self.humaneval_every))
        return [s.select(self.prompts) for s in sets]


def _eos_ids(net: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The end-of-sequence ids of the model's generation config (else the tokenizer's)."""
    eos = getattr(getattr(net, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def _max_len(net: torch.nn.Module, max_len: int | None) -> int:
    """The engine's KV cache length: ``max_len`` (within the model's positions), else the model's positions (at
    most :data:`MAX_LEN_CAP`)."""
    positions = int(getattr(net.config.get_text_config(), "max_position_embeddings", 0) or 0)
    if max_len is None:
        return min(positions, MAX_LEN_CAP) if positions else MAX_LEN_CAP
    if positions and max_len > positions:
        raise ValueError(f"--max-len {max_len} exceeds the model's {positions} positions (max_position_embeddings)")
    return max_len


def run_free_generation(settings: FreeGenerationSettings | None = None, /, *,
                        progress: Callable[[str], None] | None = None, **fields: Any) -> dict[str, Any]:
    """Load the model, decode the greedy continuations of each task's prompts under each configuration over the
    rounds; returns the record: settings, model, prompts, calibration, machine, versions, results (task -> one
    record per row) and ratios (PSR over Cache-Prior per task,
    :func:`~psr_hf.bench.free_generation_stats.table_ratios`).

    ``settings``: a :class:`FreeGenerationSettings`, or its fields as keywords
    (``run_free_generation(model="tiny-moe", device="cpu")``). ``progress``: called with a line at each stage."""
    from .common import CALIBRATION_TOKENS, describe_model, machine, versions
    from .free_generation_stats import table_ratios, task_records
    from .free_generation_timing import bench_free_generation
    from .workloads import load_model, model_calibration

    s = settings_of(FreeGenerationSettings, settings, fields, "run_free_generation")
    rows = s.rows()
    sets = s.prompt_sets()
    if progress is not None:
        progress(f"loading {s.model} on {s.device}")
    net, tokenizer, description = load_model(s.model, s.device, seed=s.seed)
    beside = description.pop("calibration_file", None)
    kv_len = _max_len(net, s.max_len)
    ids = _tokenized(sets, net, tokenizer, kv_len - s.max_new_tokens, kv_len, s.max_new_tokens)
    tokens = CALIBRATION_TOKENS if s.calibration_tokens is None else s.calibration_tokens
    calib, calibration_info = model_calibration(net, tokenizer, tokens=tokens, calibration=s.calibration,
                                                beside=beside, beside_name=description.get("calibration"),
                                                progress=progress)
    eos = _eos_ids(net, tokenizer)
    results, capacity, memory = bench_free_generation(
        net, ids, configs=rows, calibration=calib, rounds=s.rounds, warmup=s.warmup,
        max_new_tokens=s.max_new_tokens, max_len=kv_len, stop_ids=eos,
        stop_strings={p.task: p.stop for p in sets} if s.stop == "task" else None, tokenizer=tokenizer,
        max_in_flight=s.max_in_flight, progress=progress)
    info = describe_model(net)
    records = task_records(rows, results, list(s.tasks), info, capacity, memory)
    device_used = next(net.parameters()).device
    return {
        "benchmark": "free_generation",
        "settings": _record_settings(s, rows, device_used, kv_len, eos, tokens),
        "model": {**description, **info},
        "prompts": {p.task: {"source": p.source, "stop": list(p.stop) if s.stop == "task" else [],
                             "prompts": [{"key": t.key, "tokens": len(t.ids), "dropped": t.dropped, "ids": list(t.ids)}
                                         for t in ids[p.task]]}
                    for p in sets},
        "calibration": calibration_info,
        "machine": machine(device_used),
        "versions": versions(),
        "results": records,
        "ratios": table_ratios(rows, records, seed=s.seed, resamples=s.resamples),
    }


def _tokenized(sets: Sequence[PromptSet], net: torch.nn.Module, tokenizer: Any, limit: int,
               kv_len: int, max_new_tokens: int) -> dict[str, list[TokenizedPrompt]]:
    """Each task's prompts as token ids, each cut to its last ``limit`` tokens (the KV cache less the new tokens);
    ``ValueError`` where no prompt fits or an id is outside the model's vocabulary."""
    from .prompt_sets import tokenized

    if limit < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in --max-len {kv_len}")
    ids = {p.task: tokenized(p, tokenizer, limit) for p in sets}
    vocab = int(net.config.get_text_config().vocab_size)
    if max(t for task in ids.values() for prompt in task for t in prompt.ids) >= vocab:
        raise ValueError(f"token ids exceed the model's vocabulary ({vocab}): is the tokenizer the model's?")
    return ids


def _record_settings(s: FreeGenerationSettings, rows: Sequence[Row], device_used: torch.device, kv_len: int,
                     eos: list[int], calibration_tokens: int) -> dict[str, Any]:
    """The record's ``settings``: what was asked, what it came to on this model, and how it was measured."""
    from .free_generation_timing import WARMUP_NEW_TOKENS

    return {
        "model": s.model, "device": str(device_used), "configs": [row.name for row in rows], "tasks": list(s.tasks),
        "prompts_per_task": s.prompts, "prompt_file": s.prompt_file, "humaneval_every": s.humaneval_every,
        "max_new_tokens": s.max_new_tokens, "max_len": kv_len, "max_prompt_tokens": kv_len - s.max_new_tokens,
        "stop": s.stop, "eos_token_ids": eos, "rounds": s.rounds, "warmup": s.warmup,
        "warmup_new_tokens": WARMUP_NEW_TOKENS, "max_in_flight": s.max_in_flight, "calibration": s.calibration,
        "calibration_tokens": calibration_tokens, "seed": s.seed, "bootstrap_resamples": s.resamples,
        "batch": 1, "engine_graphs": device_used.type == "cuda",
        "decoding": DECODING, "order": ORDER, "statistics": STATISTICS,
    }
