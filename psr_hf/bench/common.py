"""What the benchmarks share: interleaved rounds and their summaries, the quiet patching log, device synchronisation,
a call captured as a CUDA graph and timed between events, and the description of the model, the machine and the
package versions that every record carries.

Summaries are JSON-ready dicts (the records' keys) around :mod:`psr_hf.eval.stats`, where the intervals are
computed. Importing this module imports neither torch nor transformers (the policy benchmark runs without them);
the functions that need torch import it when called.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from typing import Any

import numpy as np

from ..eval.stats import mean_interval, paired_log_ratio

# the loggers whose "no calibration" warning a benchmark silences (it patches once per run and says so once)
UNCALIBRATED_LOGGERS = ("psr_hf.hf.patching", "psr_hf.policy.cache")
UNCALIBRATED_MESSAGES = ("psr_hf.patch without a calibration", "no calibration given")
VERSIONED_PACKAGES = ("torch", "transformers", "accelerate", "numpy", "scipy", "numba")
# the default calibration of the latency benchmarks: this many tokens of workloads.CALIBRATION_MODULES (never the
# windows' text)
CALIBRATION_TOKENS = 8192


# ---------------------------------------------------------------------------------------------------- rounds
def rotated(items: list, round_index: int) -> list:
    """``items`` in the order of an interleaved round: rotated left by ``round_index`` (so drift in clocks or
    temperature falls on every item alike over the rounds)."""
    k = round_index % len(items)
    return items[k:] + items[:k]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Per-round values as a record: ``median``, ``mean``, ``ci95`` (the 95% t-interval of the mean,
    :func:`~psr_hf.eval.stats.mean_interval`; nan bounds with one round) and the ``rounds`` themselves."""
    a = np.asarray(values, dtype=np.float64)
    interval = mean_interval(a)
    return {"median": float(np.median(a)), "mean": interval.mean, "ci95": [interval.low, interval.high],
            "rounds": a.tolist()}


def paired_ratio(values: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """Ratio of per-round ``values`` to ``baseline`` paired by round, as a record: ``ratio`` (exp of the mean
    per-round log ratio), ``ci95`` (its exponentiated 95% t-interval; nan with one round) and the per-round
    ``rounds`` ratios (:func:`~psr_hf.eval.stats.paired_log_ratio`)."""
    r = paired_log_ratio(values, baseline)
    return {"ratio": r.ratio, "ci95": [r.low, r.high], "rounds": list(r.ratios)}


def matched_round_means(a: list[list[list[float]]], b: list[list[list[float]]]) -> tuple[list[float], list[float]]:
    """Per-round mean ms of two rows over the tokens both decoded (``[round][window][position]``)."""
    means_a, means_b = [], []
    for rounds_a, rounds_b in zip(a, b):
        xs, ys = [], []
        for wa, wb in zip(rounds_a, rounds_b):
            n = min(len(wa), len(wb))
            xs.extend(wa[:n])
            ys.extend(wb[:n])
        means_a.append(float(np.mean(xs)))
        means_b.append(float(np.mean(ys)))
    return means_a, means_b


def paired_summary(values: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """:func:`paired_ratio` plus ``p``: the two-sided p-value of ``scipy.stats.ttest_1samp`` of the per-round log
    ratios against 0 (None where it is undefined: one round, or identical log ratios)."""
    r = paired_log_ratio(values, baseline)
    return {"ratio": r.ratio, "ci95": [r.low, r.high], "rounds": list(r.ratios), "p": r.p}


# ---------------------------------------------------------------------------------------------------- running
class QuietUncalibrated(logging.Filter):
    """Drops the warning that :func:`psr_hf.patch` logs on every uncalibrated install."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(UNCALIBRATED_MESSAGES)


@contextmanager
def quiet_uncalibrated() -> Iterator[None]:
    """Within the block, :class:`QuietUncalibrated` filters :data:`UNCALIBRATED_LOGGERS` (removed on exit)."""
    quiet = QuietUncalibrated()
    for name in UNCALIBRATED_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        yield
    finally:
        for name in UNCALIBRATED_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)


def device_sync(device: Any) -> Callable[[], None]:
    """A function that waits for every queued kernel of the torch ``device`` (``torch.cuda.synchronize``); a
    no-op for the CPU, whose operations are done when they return."""
    if device.type == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def teacher_forced_ms(decoder: Any, prompt: list[int], tokens: Sequence[int], sync: Callable[[], None], *,
                      batched: bool | None = None) -> float:
    """Mean ms of an engine decoder's step over ``tokens`` fed in turn (teacher-forced: the host never waits for a
    token), after an untimed prefill of ``prompt`` (``batched``: :meth:`prefill`'s); ``sync`` waits for the device
    (:func:`device_sync`)."""
    decoder.prefill(prompt, batched=batched)
    sync()
    start = time.perf_counter()
    for token in tokens:
        decoder.step(token)
    sync()
    return (time.perf_counter() - start) * 1e3 / len(tokens)


def graph_replay(run: Callable[[], None], device: Any) -> Callable[[], None]:
    """``run`` captured as one CUDA graph on the torch ``device``, after two warm-up calls on a side stream (they
    compile its kernels), returned as the graph's replay, which keeps ``run`` and so the tensors it reads alive (the
    graph reads their memory, which must not be freed and reused while it can replay); on the CPU ``run`` itself,
    called once."""
    if device.type != "cuda":
        run()
        return run
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()

    def replay() -> None:
        graph.replay()

    replay.captured = run  # type: ignore[attr-defined]
    return replay


def timed_us(call: Callable[[], None], replays: int, device: Any) -> float:
    """Microseconds for ``replays`` calls of ``call`` back to back on the torch ``device``: between two CUDA events
    on a GPU, by the wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            call()
        return (time.perf_counter() - t0) * 1e6
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


# ---------------------------------------------------------------------------------------------------- records
def experts_modules(model: Any) -> list[str]:
    """Names of the routed-experts modules (``...mlp.experts``) of the torch ``model``."""
    return [name for name, _ in model.named_modules() if name.endswith("mlp.experts")]


def describe_model(model: Any) -> dict[str, Any]:
    """Class, dtype, device, parameter count, MoE shape and the bytes of the routed experts of ``model``."""
    config = model.config.get_text_config()
    experts = experts_modules(model)
    expert_bytes = sum(p.numel() * p.element_size() for name in experts
                       for p in model.get_submodule(name).parameters())
    param = next(model.parameters())
    return {
        "class": type(model).__name__,
        "model_type": str(getattr(config, "model_type", "")),
        "dtype": str(param.dtype).replace("torch.", ""),
        "device": str(param.device),
        "device_type": param.device.type,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "moe_layers": len(experts),
        "num_experts": int(getattr(config, "num_experts", getattr(config, "n_routed_experts", 0)) or 0),
        "top_k": int(getattr(config, "num_experts_per_tok", 0) or 0),
        "expert_bytes": int(expert_bytes),
        "experts_implementation": getattr(config, "_experts_implementation", None),
    }


def machine(device: Any = None) -> dict[str, Any]:
    """The machine a record was measured on: platform, processor, CPU count, Python, numpy and numba versions;
    with a torch ``device`` also its type and name, torch and transformers versions, torch's thread count and,
    on CUDA, the CUDA version and compute capability."""
    import numba

    out: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    if device is None:
        return out
    import torch
    import transformers

    out.update({"device_type": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads()})
    if device.type == "cuda":
        out["device"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        out["capability"] = list(torch.cuda.get_device_capability(device))
    else:
        out["device"] = out["processor"]
    return out


def versions() -> dict[str, str]:
    """Versions of psr_hf and of the packages a benchmark's numbers depend on (``not installed`` if absent)."""
    from .. import __version__

    out = {"psr_hf": __version__}
    for package in VERSIONED_PACKAGES:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out
