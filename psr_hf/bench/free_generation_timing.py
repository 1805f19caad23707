"""The timing of free generation (:mod:`psr_hf.bench.free_generation`): greedy continuations in the engine, timed
per prompt and per decode step (:func:`generate_timed`), configurations interleaved over rounds
(:func:`bench_free_generation`) on :class:`~psr_hf.bench.runners.EngineRunner`'s copies and decoders.

A prompt is timed as one unit (the decoder's ``prefill`` and the first generated token), apart from the decode
steps: each step feeds the last token and produces the next one, so a continuation of ``n`` tokens has ``n - 1``
timed steps, and the controller's copy statistics are reset after the prompt and read after the last step. The
logical cache makes a configuration's continuation the same in every round (the record says whether it was).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._progress import tqdm
from .common import device_sync, quiet_uncalibrated, rotated
from .decode import WindowRun
from .prompt_sets import TokenizedPrompt
from .rows import ENGINE, ENGINE_RESIDENT, OFFLOAD, Row
from .runners import EngineRunner, offload_config, release
from .timing import MIN_ROUNDS, check_rounds

if TYPE_CHECKING:
    from ..policy.calibration import Calibration

logger = logging.getLogger(__name__)

WARMUP_NEW_TOKENS = 8  # tokens each warm-up continuation generates (graph capture, compilation, the first copies)
EOS, STOP_SEQUENCE, LENGTH = "eos", "stop sequence", "max_new_tokens"


def free_generation_rows(names: Sequence[str]) -> list[Row]:
    """``engine_resident`` (the reference of the engine rows' ratios) and the engine row of each name: a row
    name of ``psr-hf bench`` with its residency (``psr_lam0.3_n1_res50``, ``engine_cp_lam0.2_res25``);
    ``ValueError`` for an unknown name, a name without a residency or one given twice."""
    rows = [Row(ENGINE_RESIDENT)]
    for name in (n.strip() for n in names):
        if not name or name == ENGINE_RESIDENT:
            continue
        row = Row.from_name(name)
        if row is None or row.routing is None:
            raise ValueError(f"--configs: {name!r} is not a routed row name with a residency; give names like "
                             "psr_lam0.3_n1_res50 or cp_lam0.2_res25 (psr-hf bench's row names)")
        row = row.replace(kind=ENGINE) if row.kind == OFFLOAD else row
        if row.name in {r.name for r in rows}:
            raise ValueError(f"--configs: {name!r} is given twice")
        rows.append(row)
    if len(rows) == 1:
        raise ValueError("--configs: give at least one routed configuration, e.g. psr_lam0.3_n1_res50")
    return rows


@dataclass(frozen=True)
class Continuation:
    """One prompt's greedy continuation under one configuration: the prompt's length and wall time (prefill and
    the first token), the generated ``tokens``, the ms of each decode step (one per generated token after the
    first) and the host's share of each, why it ``stopped``, and the controller's statistics over the prompt
    (``prompt_stats``, with ``offload`` where offloaded) and over the decode steps (``routing_stats``,
    ``offload_stats``)."""

    key: str
    prompt_tokens: int
    prompt_ms: float
    tokens: tuple[int, ...]
    ms: tuple[float, ...]
    host_ms: tuple[float, ...] | None
    stopped: str
    prompt_stats: dict[str, Any]
    routing_stats: dict[str, float]
    offload_stats: dict[str, float] | None

    def window_run(self) -> WindowRun:
        """The decode steps as a :class:`~psr_hf.bench.decode.WindowRun` (the bench's summaries read those)."""
        return WindowRun(ms=list(self.ms), routing_stats=self.routing_stats, offload_stats=self.offload_stats,
                         start_stats=self.prompt_stats, host_ms=None if self.host_ms is None else list(self.host_ms))


def _totals(ctl: Any) -> tuple[dict[str, float], dict[str, float] | None]:
    stats = ctl.stats()
    offload = None if stats.offload is None else {k: float(v) for k, v in stats.offload.to_dict().items()}
    return dict(stats.total), offload


def _stop_reason(token: int, new: list[int], max_new_tokens: int, stop_ids: frozenset[int],
                 stop_strings: Sequence[str], tokenizer: Any) -> str | None:
    if token in stop_ids:
        return EOS
    if stop_strings and any(s in tokenizer.decode(new) for s in stop_strings):
        return STOP_SEQUENCE
    return LENGTH if len(new) >= max_new_tokens else None


@torch.no_grad()
def generate_timed(decoder: Any, prompt: TokenizedPrompt, max_new_tokens: int, *, device: torch.device,
                   stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer: Any = None
                   ) -> Continuation:
    """Greedy continuation of ``prompt`` by ``decoder`` (a :class:`~psr_hf.engine.decoder.DecoderBase` of a patched
    model), the device synchronised after the prompt and after every step: the prompt (``decoder.prefill``, a new
    sequence) and the argmax of its logits are timed as one unit, then each ``decoder.step`` with the argmax of
    its logits as one generated token. Generation stops after an end-of-sequence token (``stop_ids``), once the
    text generated so far holds one of ``stop_strings`` (checked between the timed steps) or after
    ``max_new_tokens``; as in ``generate()``, the last token is not fed back."""
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens={max_new_tokens}: give at least 2 (the first token comes with the "
                         "prompt; the decode steps are the ones after it)")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer that decodes the generated tokens")
    stops = frozenset(int(t) for t in stop_ids)
    sync = device_sync(device)
    ctl = decoder.controller
    blocked = hasattr(decoder, "blocked_s")
    ctl.reset_stats()
    sync()
    begin = time.perf_counter()
    logits = decoder.prefill(list(prompt.ids))
    token = int(torch.argmax(logits[0]))
    sync()
    prompt_ms = (time.perf_counter() - begin) * 1e3
    prompt_stats, prompt_offload = _totals(ctl)
    if prompt_offload is not None:
        prompt_stats["offload"] = prompt_offload
    ctl.reset_stats()
    new, ms, host = [token], [], []
    stopped = _stop_reason(token, new, max_new_tokens, stops, stop_strings, tokenizer)
    while stopped is None:
        waited = decoder.blocked_s if blocked else 0.0
        begin = time.perf_counter()
        logits = decoder.step(token)
        stepped = time.perf_counter()
        token = int(torch.argmax(logits[0]))
        sync()
        end = time.perf_counter()
        ms.append((end - begin) * 1e3)
        if blocked:  # the step's wall time less its waits on the device (events, final sync)
            host.append(((stepped - begin) - (decoder.blocked_s - waited)) * 1e3)
        new.append(token)
        stopped = _stop_reason(token, new, max_new_tokens, stops, stop_strings, tokenizer)
    routing_stats, offload_stats = _totals(ctl)
    return Continuation(prompt.key, len(prompt.ids), prompt_ms, tuple(new), tuple(ms),
                        tuple(host) if blocked else None, stopped, prompt_stats, routing_stats, offload_stats)


class FreeGenerationRunner(EngineRunner):
    """The engine rows of :class:`~psr_hf.bench.runners.EngineRunner` (the same copies and decoders: one offloaded
    copy per residency, configurations switched on it), decoding greedy continuations instead of windows."""

    def generate(self, row: Row, prompts: Sequence[TokenizedPrompt], max_new_tokens: int, **stop: Any
                 ) -> list[Continuation]:
        """One continuation of each of ``prompts`` under ``row`` (:func:`generate_timed`; ``stop``: its stop
        arguments)."""
        decoder = self._activate(row)
        ctl = decoder.controller
        self._note(row, ctl)
        return [generate_timed(decoder, p, max_new_tokens, device=self.device, **stop) for p in prompts]


# results[configuration][round][task] -> one Continuation per prompt of the task
Results = dict[str, list[dict[str, list[Continuation]]]]


def bench_free_generation(
    model: torch.nn.Module, prompts: Mapping[str, Sequence[TokenizedPrompt]], *, configs: Sequence[Row],
    calibration: Calibration | None = None, rounds: int = MIN_ROUNDS, warmup: int = 1, max_new_tokens: int = 128,
    max_len: int,
    stop_ids: Sequence[int] = (), stop_strings: Mapping[str, Sequence[str]] | None = None, tokenizer: Any = None,
    max_in_flight: int = 2, graphs: bool | None = None, progress: Callable[[str], None] | None = None,
) -> tuple[Results, dict[str, int], dict[str, Any]]:
    """Greedy continuations of ``prompts`` (task -> its tokenized prompts) under each of ``configs`` (engine rows,
    :func:`free_generation_rows`), interleaved over ``rounds``: every round runs every configuration once over
    every task's prompts, the order of the configurations rotated by one per round. ``warmup`` untimed rounds
    first generate :data:`WARMUP_NEW_TOKENS` tokens of each task's first prompt per configuration.

    ``model``: unpatched, every expert on its device; the rows run patched copies of it (offloaded with
    ``max_in_flight`` prefetches in flight), decoded by a static KV cache of ``max_len`` positions, which each
    prompt plus ``max_new_tokens`` must fit. ``stop_strings``: task -> the strings that end its continuations
    (decoded by ``tokenizer``). Returns ``(results, capacity, memory)``: the continuations, and each row's cache
    slots per layer and offload memory as the runner noted them."""
    _check(model, prompts, configs, rounds=rounds, warmup=warmup, max_new_tokens=max_new_tokens, max_len=max_len)
    names = [row.name for row in configs]
    device = next(model.parameters()).device
    graphs = device.type == "cuda" if graphs is None else graphs
    model.eval()
    runner = FreeGenerationRunner(model, device, calibration, offload_config(device, max_in_flight=max_in_flight),
                                  max_len, bool(graphs))
    stop_strings = stop_strings or {}

    def run(row: Row, task: str, items: Sequence[TokenizedPrompt], new_tokens: int) -> list[Continuation]:
        return runner.generate(row, items, new_tokens, stop_ids=stop_ids, stop_strings=stop_strings.get(task, ()),
                               tokenizer=tokenizer)

    results: Results = {name: [] for name in names}
    with quiet_uncalibrated(), contextlib.ExitStack() as stack:
        bar = tqdm(total=(warmup + rounds) * len(configs), unit="row", desc="free generation",
                   disable=progress is None)
        stack.callback(bar.close)
        try:
            for w in range(warmup):
                for row in configs:
                    bar.set_postfix_str(f"warm-up {w + 1}/{warmup}: {row.name}")
                    for task, items in prompts.items():
                        run(row, task, items[:1], min(WARMUP_NEW_TOKENS, max_new_tokens))
                    bar.update(1)
            for r in range(rounds):
                for row in rotated(list(configs), r):
                    bar.set_postfix_str(f"round {r + 1}/{rounds}: {row.name}")
                    results[row.name].append({task: run(row, task, items, max_new_tokens)
                                              for task, items in prompts.items()})
                    bar.update(1)
                if progress is not None:
                    progress(f"round {r + 1}/{rounds}: ms/token " + ", ".join(
                        f"{name} {_mean_ms(results[name][-1]):.2f}" for name in names))
        finally:
            runner.close()
            release(device)
    return results, dict(runner.capacity), dict(runner.memory)


def _check(model: torch.nn.Module, prompts: Mapping[str, Sequence[TokenizedPrompt]], configs: Sequence[Row], *,
           rounds: int, warmup: int, max_new_tokens: int, max_len: int) -> None:
    """``ValueError`` naming what :func:`bench_free_generation` cannot run, and the fix."""
    check_rounds(rounds)
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    if not prompts or not all(prompts.values()):
        raise ValueError("no prompts to decode (every task needs at least one)")
    longest = max(len(p.ids) for task in prompts.values() for p in task)
    if longest + max_new_tokens > max_len:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds max_len="
                         f"{max_len}: cut the prompts to at most max_len - max_new_tokens tokens")
    if getattr(model, "_psr_hf_controller", None) is not None:
        raise ValueError("the model is patched by psr_hf; give the unpatched model (the rows run patched copies)")
    if any(row.kind not in (ENGINE, ENGINE_RESIDENT) for row in configs):
        raise ValueError("free generation runs engine rows only (free_generation_rows)")
    names = [row.name for row in configs]
    if ENGINE_RESIDENT not in names or len(set(names)) != len(names):
        raise ValueError(f"configs {names}: each row once, '{ENGINE_RESIDENT}' among them (the reference of the "
                         "engine rows' ratios; free_generation_rows adds it)")


def _mean_ms(round_result: Mapping[str, list[Continuation]]) -> float:
    steps = [t for task in round_result.values() for c in task for t in c.ms]
    return sum(steps) / max(len(steps), 1)
