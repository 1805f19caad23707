"""Benchmarks of the policy kernels: the per-call cost at batch 1 and the replay throughput.

Interleaved rounds (every configuration once per round, in the same order), summarised per configuration by
the median over rounds and a 95% t-interval of the mean of the round means (:func:`~psr_hf.bench.common.summarize`).
Returned as plain dicts so the CLI can print a table and write a JSON record; the library only logs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
from .._progress import tqdm

from ..policy.cache import LogicalCache
from ..policy.config import RoutingConfig
from ..policy.replaying import replay
from ..policy.traces import calibration_from_trace, synthetic_trace
from .common import machine, summarize

logger = logging.getLogger(__name__)


def _call_case(E: int, K: int, how: str, calls: int, seed: int) -> Callable[[], float]:
    """A closure that times ``calls`` batch-1 calls for one layer and returns microseconds per call.

    ``how``: "step" (``LogicalCache.step`` with typed arrays), "split" (``prefetch`` + ``select``) or "io"
    (``step_io`` on the cache's own buffers, which a decoder fills by its device-to-host copy). For "io" each
    call's inputs are written into the buffers with numpy first, and the time of that fill alone, measured right
    after in the same round, is subtracted: the result is the policy call a decoder pays."""
    L, V = 4, 1024
    cal = calibration_from_trace(synthetic_trace(8000, L, E, vocab_size=V, seed=seed + 1), K, V)
    trace = synthetic_trace(calls, L, E, vocab_size=V, seed=seed + 2)
    config = RoutingConfig(policy="psr", residency=0.5)  # the paper's operating point: lam 0.2, budget 1, W 8
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal)
    layer = 1
    z = np.ascontiguousarray(trace.scores[:, layer].reshape(calls, 1, 1, E))  # [T, B=1, S=1, E]
    g = np.ascontiguousarray(trace.pregate[:, layer].reshape(calls, 1, 1, E))
    tok = np.ascontiguousarray(trace.tokens.reshape(calls, 1, 1))
    cache.step(layer, z[0], g[0], tok[0])  # compile / warm up

    io = cache.io

    def run() -> float:
        cache.reset()
        start = time.perf_counter()
        if how == "io":
            for i in range(calls):
                io.scores[...] = z[i]
                io.pregate[...] = g[i]
                io.tokens[...] = tok[i]
                cache.step_io(layer)
            with_fill = time.perf_counter() - start
            start = time.perf_counter()
            for i in range(calls):
                io.scores[...] = z[i]
                io.pregate[...] = g[i]
                io.tokens[...] = tok[i]
            return (with_fill - (time.perf_counter() - start)) / calls * 1e6
        elif how == "split":
            for i in range(calls):
                cache.prefetch(layer, g[i], tok[i])
                cache.select(layer, z[i], tok[i])
        else:
            for i in range(calls):
                cache.step(layer, z[i], g[i], tok[i])
        return (time.perf_counter() - start) / calls * 1e6

    return run


def _replay_case(E: int, K: int, policy: str, tokens: int, layers: int, seed: int) -> Callable[[], float]:
    """A closure that replays a trace and returns token-layer steps per second."""
    V = 1024
    cal = calibration_from_trace(synthetic_trace(8000, layers, E, vocab_size=V, seed=seed + 1), K, V)
    trace = synthetic_trace(tokens, layers, E, vocab_size=V, seed=seed + 3)
    config = RoutingConfig(policy=policy, residency=0.5)
    replay(config, trace.scores[:16], trace.pregate[:16], trace.tokens[:16], cal, K)  # warm up

    def run() -> float:
        start = time.perf_counter()
        replay(config, trace.scores, trace.pregate, trace.tokens, cal, K)
        return tokens * layers / (time.perf_counter() - start)

    return run


def bench_policy(
    *, rounds: int = 5, calls: int = 3000, tokens: int = 4000, layers: int = 16, seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the policy benchmark and return a JSON-ready record (see module docstring). ``progress``: called with
    a line after each round; given, a tqdm bar (stderr) also shows each case as it runs."""
    if rounds < 1 or calls < 1 or tokens < 1 or layers < 2:
        raise ValueError("rounds, calls and tokens must be >= 1 and layers >= 2")
    cases: dict[str, Callable[[], float]] = {}
    for E in (64, 256):
        cases[f"call step E={E} K=8"] = _call_case(E, 8, "step", calls, seed)
        cases[f"call step_io (net) E={E} K=8"] = _call_case(E, 8, "io", calls, seed)
        cases[f"call prefetch+select E={E} K=8"] = _call_case(E, 8, "split", calls, seed)
    for E in (64, 256):
        for policy in ("psr", "exact"):
            cases[f"replay {policy} E={E} K=8"] = _replay_case(E, 8, policy, tokens, layers, seed)
    results: dict[str, list[float]] = {name: [] for name in cases}
    # a tqdm bar (stderr) over rounds x cases whenever the caller asks for progress
    bar = tqdm(total=rounds * len(cases), unit="case", desc="bench-policy", disable=progress is None)
    try:
        for r in range(rounds):
            for name, run in cases.items():
                bar.set_postfix_str(f"round {r + 1}/{rounds}: {name}")
                results[name].append(run())
                bar.update(1)
            if progress is not None:
                progress(f"round {r + 1}/{rounds} done")
    finally:
        bar.close()
    rows = []
    for name, values in results.items():
        unit = "us/call" if name.startswith("call") else "steps/s"
        rows.append({"case": name, "unit": unit, **summarize(values)})
    return {
        "benchmark": "policy",
        "settings": {"rounds": rounds, "calls": calls, "replay_tokens": tokens, "replay_layers": layers,
                     "config": "psr lam 0.2 budget 1 window 8 score eviction, residency 0.5 (exact: LRU)",
                     "seed": seed},
        "machine": machine(),
        "results": rows,
    }
