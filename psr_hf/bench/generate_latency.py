"""What a ``generate()`` user waits for (``psr-hf bench-generate``, docs/engine.md "Behind generate()"): time to first
token and decode ms/token of ``model.generate`` on a held-out prompt, for transformers unpatched, the engine all
resident, the engine offloaded and the transformers offload path, and beside each engine setup the engine's own
step on the same tokens, so that what ``generate()`` adds is a ratio measured side by side.

Per round and setup: ``generate(max_new_tokens=1)`` (time to first token), ``generate(max_new_tokens=N + 1)``
greedy and with sampling (decode = the time from the first new token to the last of that one call over ``N``, read
by a streamer as each token reaches the host: a difference of two calls would carry the prompt's variance, which
offloaded is several ms per token over 64 tokens), the engine's ``step`` teacher-forced on the greedy continuation
and on the round's sampled one (sampling is compared with the step on the tokens it drew: a sampled continuation
routes otherwise, and offloaded copies otherwise), and one forward of the prompt (the model's, or the patched one
beneath the engine: what the prefill costs without the engine's KV cache and the generate() around it); the order
of these rotates over the rounds. Ratios are paired by round on log latency
(:func:`~psr_hf.bench.common.paired_summary`). The batched prefill's routing decisions are compared with the
token-by-token prefill's on the same prompt (their share of identical expert sets: 1 in float32, near-ties aside in
bf16), and its time beside the token-by-token one.
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..eval.grid import routing_from_name
from ..hf.installation import CONTROLLER_ATTRIBUTE
from ..hf.patching import controller, patch, unpatch
from ..policy.config import RoutingConfig
from .common import (describe_model, device_sync, machine, paired_summary, rotated, summarize, teacher_forced_ms,
                     versions)
from .generate_sizes import CUDA_SIZES, SETUPS
from .runners import offload_config

logger = logging.getLogger(__name__)

#: the setups, in the order they run (the offloaded engine and the transformers offload path share one patch)
GOALS_MS = {"engine_resident": 60.0, "engine_offloaded": 300.0}  # time to first token (the goals)
GENERATE_OVER_STEP_GOAL = 1.10  # generate()'s decode at most 10% over the engine's own step


@dataclass(frozen=True)
class GenerateBenchConfig:
    """What ``psr-hf bench-generate`` measures: ``rounds`` interleaved rounds (at least 2) of a ``prompt_tokens``
    prompt and ``new_tokens`` decoded tokens; the offloaded setups route with ``routing`` at ``residency``. The
    sizes default to CUDA's (the command sizes them for its device: :mod:`.generate_sizes`)."""

    prompt_tokens: int = CUDA_SIZES.prompt_tokens
    new_tokens: int = CUDA_SIZES.new_tokens
    rounds: int = CUDA_SIZES.rounds
    residency: float = 0.5
    routing: str = "psr_lam0.3_n1"
    by_token: bool = True  # also time the token-by-token prefill of the engine setups (one per round)
    profile: bool = True  # a cProfile of one engine generate() per engine setup, its top functions in the record
    setups: tuple[str, ...] = SETUPS  # which setups run (always in SETUPS' order)

    def __post_init__(self) -> None:
        unknown = [name for name in self.setups if name not in SETUPS]
        if unknown or not self.setups:
            raise ValueError(f"--setups {','.join(self.setups)!r}: choose among {', '.join(SETUPS)}")
        if self.prompt_tokens < 2 or self.new_tokens < 1:
            raise ValueError(f"--prompt-tokens {self.prompt_tokens} must be >= 2 and --new-tokens "
                             f"{self.new_tokens} >= 1")
        if self.rounds < 2:
            raise ValueError(f"--rounds {self.rounds}: at least 2 rounds are needed for an interval")
        if not 0 < self.residency < 1:
            raise ValueError(f"--residency {self.residency} must be in (0, 1)")
        if routing_from_name(self.routing) is None:
            raise ValueError(f"--routing {self.routing!r} is not a configuration name (e.g. psr_lam0.3_n1, "
                             "cp_lam0.2, exact_lru)")

    def offloaded_routing(self) -> RoutingConfig:
        return RoutingConfig(**routing_from_name(self.routing), residency=self.residency)


def _timed(sync: Callable[[], None], call: Callable[[], Any]) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    result = call()
    sync()
    return (time.perf_counter() - start) * 1e3, result


class TokenClock:
    """A ``generate()`` streamer that notes when each new token reaches the host (transformers hands it the
    prompt first): the decode time of one call without its prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass

    def decode_ms(self) -> float:
        """Mean ms per token from the first new token to the last."""
        if len(self.times) < 2:
            raise RuntimeError(f"the streamer saw {len(self.times)} new tokens; decode needs at least 2")
        return (self.times[-1] - self.times[0]) * 1e3 / (len(self.times) - 1)


def _generate(model: Any, ids: torch.Tensor, new: int, *, sample: bool, seed: int, pad: int,
              streamer: Any = None) -> torch.Tensor:
    kwargs: dict[str, Any] = dict(do_sample=False)
    if sample:
        torch.manual_seed(seed)
        kwargs = dict(do_sample=True, top_k=50, temperature=1.0)
    if streamer is not None:
        kwargs["streamer"] = streamer
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          pad_token_id=pad, **kwargs)


def _decode_ms(sync: Callable[[], None], model: Any, ids: torch.Tensor, new: int, *, sample: bool, seed: int,
               pad: int) -> tuple[float, list[int]]:
    """Decode ms/token of one ``generate()`` of ``new`` tokens (:class:`TokenClock`) and its new tokens."""
    clock = TokenClock()
    _, out = _timed(sync, lambda: _generate(model, ids, new, sample=sample, seed=seed, pad=pad, streamer=clock))
    return clock.decode_ms(), out[0, ids.shape[1]:].tolist()


def prefill_agreement(model: Any, decoder: Any, prompt: list[int], sync: Callable[[], None]) -> dict[str, Any]:
    """The batched prefill against the token-by-token one on ``prompt``: the share of prompt token-layers that
    select the same expert set, and both prefill times (ms)."""
    ctl = controller(model)
    sets = {}
    times = {}
    for batched in (True, False):
        with ctl.record() as recorder:
            times[batched], _ = _timed(sync, lambda: decoder.prefill(prompt, batched=batched))
        sets[batched] = recorder.recordings[-1].selected  # [S, L, K], each sorted
    same = (sets[True] == sets[False]).all(axis=-1)
    return {"identical_expert_sets": float(same.mean()), "token_layers": int(same.size),
            "batched_ms": times[True], "by_token_ms": times[False]}


def _file_names_only(lines: list[str]) -> list[str]:
    """A record names a function by its file's name, not by where the file lies on the machine."""
    return [re.sub(r"(?:/[^/\s]+)+/([^/\s]+:\d+\()", r"\1", line.rstrip()) for line in lines if line.strip()]


def _profile(call: Callable[[], Any], top: int = 25) -> list[str]:
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return _file_names_only(out.getvalue().splitlines())


def _device_profile(call: Callable[[], Any], device: torch.device, top: int = 25) -> list[str]:
    """torch.profiler's table of one call: host time per operator and, on CUDA, device time (sorted by it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return _file_names_only(prof.key_averages().table(sort_by=key, row_limit=top).splitlines())


def _forward_ms(model: Any, ids: torch.Tensor, sync: Callable[[], None]) -> float:
    """One forward of the prompt as transformers runs a prefill (no cache kept, the last logits): the model's own
    forward, or with psr_hf patched the patched one beneath the engine."""
    from ..engine.prefill import patched_forward

    with torch.no_grad():
        ms, _ = _timed(sync, lambda: patched_forward(model)(input_ids=ids, use_cache=False, logits_to_keep=1))
    return ms


def _measure_setup(name: str, model: Any, prompt: torch.Tensor, config: GenerateBenchConfig, pad: int,
                   sync: Callable[[], None], progress: Callable[[str], None], bar: Any) -> dict[str, Any]:
    from ..engine import attached

    state = attached(model)
    decoder = state.decoder if state is not None else None
    N = config.new_tokens
    ids = prompt.to(next(model.parameters()).device)
    prompt_list = prompt[0].tolist()
    _generate(model, ids, 2, sample=False, seed=0, pad=pad)  # warm-up: first-call costs are not a round's
    runs: dict[str, list[float]] = {k: [] for k in ("ttft", "decode", "decode_sampling", "step", "step_sampled",
                                                    "ttft_by_token", "forward")}
    continuation: list[int] | None = None
    sampled: dict[int, list[int]] = {}  # each round's sampled continuation (its seed is the round)

    def sample_continuation(r: int) -> list[int]:
        if r not in sampled:
            sampled[r] = _generate(model, ids, N + 1, sample=True, seed=r, pad=pad)[0, ids.shape[1]:].tolist()
        return sampled[r]

    tasks = ["ttft", "greedy", "sampling", "forward"] + (["step", "step_sampled", "by_token"]
                                                         if decoder is not None else [])
    bar.set_description(name)
    for r in range(config.rounds):
        progress(f"{name}: round {r + 1}/{config.rounds}")
        ttft_ms, _ = _timed(sync, lambda: _generate(model, ids, 1, sample=False, seed=r, pad=pad))
        runs["ttft"].append(ttft_ms)
        for task in rotated(tasks[1:], r):
            if task == "greedy":
                ms, new = _decode_ms(sync, model, ids, N + 1, sample=False, seed=r, pad=pad)
                runs["decode"].append(ms)
                if continuation is not None and new != continuation:
                    raise RuntimeError(f"{name}: greedy generate() gave another continuation in round {r + 1}")
                continuation = new
            elif task == "sampling":
                ms, new = _decode_ms(sync, model, ids, N + 1, sample=True, seed=r, pad=pad)
                runs["decode_sampling"].append(ms)
                if sampled.setdefault(r, new) != new:
                    raise RuntimeError(f"{name}: sampling generate() with seed {r} drew another continuation")
            elif task == "step":
                greedy = continuation or _generate(model, ids, N + 1, sample=False, seed=r, pad=pad)[
                    0, ids.shape[1]:].tolist()
                runs["step"].append(teacher_forced_ms(decoder, prompt_list, greedy[:N], sync))
            elif task == "step_sampled":
                runs["step_sampled"].append(teacher_forced_ms(decoder, prompt_list, sample_continuation(r)[:N], sync))
            elif task == "forward":
                runs["forward"].append(_forward_ms(model, ids, sync))
            elif task == "by_token" and config.by_token:
                ms, _ = _timed(sync, lambda: decoder.prefill(prompt_list, batched=False))
                runs["ttft_by_token"].append(ms)
        bar.update()
    result: dict[str, Any] = {name: summarize(v) for name, v in runs.items() if v}
    if decoder is not None:
        result["generate_over_step"] = paired_summary(runs["decode"], runs["step"])
        result["sampling_over_step"] = paired_summary(runs["decode_sampling"], runs["step_sampled"])
        result["prefill"] = prefill_agreement(model, decoder, prompt_list, sync)
        result["engine_served"] = {"served": state.served, "fallbacks": state.fallbacks,
                                   "engine_loop_calls": state.loop_calls}
        if config.profile:
            result["profile"] = _profile(lambda: _generate(model, ids, N + 1, sample=False, seed=0, pad=pad))
            result["profile_first_token"] = _profile(lambda: _generate(model, ids, 1, sample=False, seed=0, pad=pad))
            result["device_profile_first_token"] = _device_profile(
                lambda: _generate(model, ids, 1, sample=False, seed=0, pad=pad), ids.device)
            result["profile_sampling"] = _profile(lambda: _generate(model, ids, N + 1, sample=True, seed=0, pad=pad))
            result["device_profile_sampling"] = _device_profile(
                lambda: _generate(model, ids, N + 1, sample=True, seed=0, pad=pad), ids.device)
    goal = GOALS_MS.get(name)
    if goal is not None:
        high = result["ttft"]["ci95"][1]
        result["ttft_goal"] = {"goal_ms": goal, "met": bool(np.isfinite(high) and high <= goal)}
    if decoder is not None:  # greedy and sampling, each against the step on its own tokens
        for goal_name, ratio in (("generate_goal", "generate_over_step"), ("sampling_goal", "sampling_over_step")):
            high = result[ratio]["ci95"][1]
            result[goal_name] = {"goal_ratio": GENERATE_OVER_STEP_GOAL,
                                 "met": bool(np.isfinite(high) and high <= GENERATE_OVER_STEP_GOAL)}
    return result


def run_generate_bench(model: Any, prompt: torch.Tensor, config: GenerateBenchConfig, *, calibration: Any = None,
                       pad: int = 0, progress: Callable[[str], None] = lambda _: None,
                       progress_bar: bool = False) -> dict[str, Any]:
    """Every setup of :data:`SETUPS` on ``model`` (loaded, unpatched; left unpatched) with ``prompt [1, S]``: one
    record per setup (:func:`_measure_setup`: summaries over rounds, ratios, goals). ``progress_bar``: a tqdm bar
    (stderr) over the setups' rounds, with its estimate of the time left."""
    from .._progress import tqdm
    from ..engine import attach, detach

    device = next(model.parameters()).device
    sync = device_sync(device)
    max_len = prompt.shape[1] + config.new_tokens + 2
    num_experts = describe_model(model)["num_experts"]
    results: dict[str, Any] = {}
    wanted = set(config.setups)

    bar = tqdm(total=len(wanted) * config.rounds, unit="round", desc="bench-generate", disable=not progress_bar)

    def measure(name: str) -> None:
        if name in wanted:
            results[name] = _measure_setup(name, model, prompt, config, pad, sync, progress, bar)

    measure("transformers")
    try:
        if "engine_resident" in wanted:
            patch(model, RoutingConfig(policy="exact", capacity=num_experts), calibration=calibration)
            attach(model, max_len=max_len)
            measure("engine_resident")
            detach(model)
            unpatch(model)
        if wanted & {"engine_offloaded", "transformers_offloaded"}:
            patch(model, config.offloaded_routing(), calibration=calibration, offload=offload_config(device))
            if "engine_offloaded" in wanted:
                attach(model, max_len=max_len)
                measure("engine_offloaded")
                results["engine_offloaded"]["copies_per_token"] = controller(model).stats().total["copies_per_token"]
                detach(model)
            measure("transformers_offloaded")
    finally:
        bar.close()
        detach(model)
        if getattr(model, CONTROLLER_ATTRIBUTE, None) is not None:
            unpatch(model)
    return {"config": {"prompt_tokens": int(prompt.shape[1]), "new_tokens": config.new_tokens,
                       "rounds": config.rounds, "residency": config.residency, "routing": config.routing,
                       "num_experts": num_experts, "setups": list(config.setups)},
            "setups": results}


def bench_generate(model: str, device: str | None, config: GenerateBenchConfig, *, calibration: str | None = None,
                   calibration_tokens: int = 20000, texts: Any = (), progress: Callable[[str], None] = lambda _: None,
                   progress_bar: bool = False) -> dict[str, Any]:
    """``psr-hf bench-generate``: load ``model`` (:func:`psr_hf.assets.loading.load_model`), cut a
    ``prompt_tokens`` prompt from its held-out text (or ``texts``), calibrate as ``psr-hf bench`` does, and run
    :func:`run_generate_bench` (``progress_bar``: its bar over the rounds). The record names the model, the
    calibration, the machine and the versions."""
    from ..assets.loading import load_model
    from ..assets.texts import measured_texts, text_windows
    from ..eval.calibration import model_calibration

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    progress(f"loading {model} on {device}")
    net, tokenizer, description = load_model(model, device)
    beside = description.pop("calibration_file", None)
    sources, names = measured_texts(model, list(texts), option="--text")
    prompt = text_windows(sources, tokenizer, windows=1, tokens=config.prompt_tokens - 1)[0]
    calib, calibration_info = model_calibration(net, tokenizer, tokens=calibration_tokens, calibration=calibration,
                                                beside=beside, beside_name=description.get("calibration"),
                                                progress=progress)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    record = run_generate_bench(net, prompt, config, calibration=calib, pad=int(pad), progress=progress,
                                progress_bar=progress_bar)
    device_used = next(net.parameters()).device
    return {"benchmark": "generate", "model": description, "texts": names, "calibration": calibration_info,
            **record, "machine": machine(device_used), "versions": versions()}


def generate_rows(record: dict[str, Any]) -> list[list[str]]:
    """The printed table: one row per setup (medians over rounds; ratios with their 95% intervals)."""
    def ms(entry: dict | None) -> str:
        return "-" if entry is None else f"{entry['median']:.2f}"

    def ratio(entry: dict | None) -> str:
        return "-" if entry is None else f"{entry['ratio']:.3f} [{entry['ci95'][0]:.3f}, {entry['ci95'][1]:.3f}]"

    rows = []
    for name in SETUPS:
        s = record["setups"].get(name)
        if s is None:
            continue
        prefill = s.get("prefill")
        rows.append([name, ms(s.get("ttft")), ms(s.get("forward")), ms(s.get("ttft_by_token")), ms(s.get("decode")),
                     ms(s.get("step")), ratio(s.get("generate_over_step")), ms(s.get("decode_sampling")),
                     ms(s.get("step_sampled")), ratio(s.get("sampling_over_step")),
                     "-" if prefill is None else f"{prefill['identical_expert_sets']:.4f}"])
    return rows


GENERATE_HEADER = ["setup", "first token ms", "prompt forward ms", "by-token prefill ms", "greedy ms/tok",
                   "step ms/tok", "generate/step (greedy)", "sampling ms/tok", "step on sampled ms/tok",
                   "generate/step (sampling)", "same expert sets"]
