"""SpecPrefetch's window-aware budget (the SpecPrefetch paper, Sections 3.1 and 3.3, Figure 1b), measured
on psr_hf's engine: per adjacent MoE-layer pair ``(l, l + 1)`` the overlap window

    W_l = t_exec(l + 1) - t_pred(l)

from the moment the prediction for layer ``l + 1`` is available (layer ``l``'s scores, and with them the
prefetch ranking of the next layer, have reached the host: after graph A_l) to the start of layer ``l + 1``'s
expert computation (graph B_{l+1}), and the time one expert copy takes from host memory to the device. The
budget they allow is ``M_max = floor(W / t_copy)``: the copies that fit in the window on one ordered copy stream.

The windows are measured on the model as it is patched, best without offload (``RoutingConfig(policy="exact",
capacity=E)``: the computation alone, nothing waits for copies) with :class:`psr_hf.engine.graphs.GraphDecoder`'s
``marks`` (CUDA timing events on a GPU; on the CPU the same marks in host time, where nothing overlaps). One
expert copy is timed as the offload engine issues it: its weight tensors (``gate_up_proj`` then ``down_proj``),
from pinned host memory on a dedicated stream on CUDA, plain ``copy_`` on the CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ..engine.graphs import GraphDecoder
    from ..hf.controller import Controller


@dataclass
class WindowProfile:
    """What :func:`profile_window` measured. ``windows_ms`` ``[positions, L - 1]``: W_l of every decoded position
    and pair; ``copy_ms``: every timed copy of one expert."""

    windows_ms: np.ndarray
    copy_ms: np.ndarray
    bytes_per_expert: int
    device: str
    top_k: int
    quantile: float = 0.5
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def copy_time_ms(self) -> float:
        """The median time of one expert copy."""
        return float(np.median(self.copy_ms))

    def budgets(self) -> np.ndarray:
        """``[positions, L - 1]``: ``floor(W / t_copy)`` per event."""
        return np.floor(np.maximum(self.windows_ms, 0.0) / self.copy_time_ms).astype(np.int64)

    def layer_windows_ms(self) -> np.ndarray:
        """``[L - 1]``: the median window of each pair."""
        return np.median(self.windows_ms, axis=0)

    def layer_budgets(self) -> np.ndarray:
        """``[L - 1]``: ``floor(median W_l / t_copy)`` per pair."""
        return np.floor(self.layer_windows_ms() / self.copy_time_ms).astype(np.int64)

    @property
    def budget(self) -> int:
        """``M_max``: the ``quantile`` (default the median) over every event of ``floor(W / t_copy)``, at least 0."""
        return max(int(np.floor(np.quantile(self.budgets(), self.quantile))), 0)

    def exceeding(self, copies: int) -> float:
        """The share of events whose window is shorter than ``copies`` expert copies (Figure 1b's percentages)."""
        return float(np.mean(copies * self.copy_time_ms > self.windows_ms))

    def to_dict(self) -> dict[str, Any]:
        K = self.top_k
        return {
            "device": self.device, "bytes_per_expert": self.bytes_per_expert, "positions": int(self.windows_ms.shape[0]),
            "pairs": int(self.windows_ms.shape[1]), "copy_ms_median": self.copy_time_ms,
            "copy_ms": self.copy_ms.tolist(), "window_ms_median": float(np.median(self.windows_ms)),
            "window_ms_per_pair": self.layer_windows_ms().tolist(), "budget_per_pair": self.layer_budgets().tolist(),
            "budget": self.budget, "quantile": self.quantile,
            "exceeding": {str(k): self.exceeding(k) for k in sorted({max(K // 2, 1), K, K + 2})},
            "notes": dict(self.notes),
        }


def _expert_tensors(ctl: Controller) -> list[torch.Tensor]:
    """One expert's weight tensors as the offload engine copies them (the first MoE layer's expert 0)."""
    weights = ctl.expert_store.expert_weights(0)
    if any(name not in weights for name in ("gate_up_proj", "down_proj")):
        raise ValueError(f"{type(ctl.layers[0].block.experts).__name__} has no fused gate_up_proj / down_proj to time "
                         "a copy of")
    return [weights[name][0] for name in ("gate_up_proj", "down_proj")]


def time_expert_copy(ctl: Controller, device: torch.device, repeats: int = 20) -> tuple[np.ndarray, int]:
    """``(ms of each of repeats copies, bytes)`` of one expert from host memory (pinned on CUDA) to ``device``."""
    return time_tensor_copy(_expert_tensors(ctl), device, repeats)


def time_tensor_copy(shapes: Sequence[torch.Tensor], device: torch.device,
                     repeats: int = 20) -> tuple[np.ndarray, int]:
    """``(ms of each of repeats copies, bytes)`` of tensors like ``shapes`` (their values copied once) from host
    memory (pinned on CUDA) to ``device``, one after the other on a dedicated stream, as the offload copies an
    expert."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    cuda = device.type == "cuda"
    src = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in shapes]
    for s, t in zip(src, shapes):
        s.copy_(t.detach().to("cpu") if t.device.type != "meta" else torch.zeros_like(s))
    dst = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in shapes]
    nbytes = sum(s.numel() * s.element_size() for s in src)
    times = []
    if cuda:
        stream = torch.cuda.Stream(device)
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for d, s in zip(dst, src):
                    d.copy_(s, non_blocking=True)
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        times = times[1:]  # the first one warms the path up
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            for d, s in zip(dst, src):
                d.copy_(s)
            times.append((time.perf_counter() - begin) * 1e3)
    return np.asarray(times, dtype=np.float64), int(nbytes)


def windows_from_marks(marks: Sequence[tuple], num_layers: int, cuda: bool, distance: int = 1) -> np.ndarray:
    """``[positions, L - distance]`` W_l in ms from a :class:`~psr_hf.engine.graphs.GraphDecoder`'s ``marks`` of
    whole steps (``pred`` and ``exec`` of every MoE layer, in step order): from layer l's prediction to layer
    ``l + distance``'s experts, the layer it ranks (``RoutingConfig.prefetch_distance``; 1, the next layer, as
    SpecPrefetch defines the window)."""
    per_step = 2 * num_layers
    if len(marks) % per_step:
        raise ValueError(f"{len(marks)} marks are not whole steps of {num_layers} MoE layers")
    rows = []
    for start in range(0, len(marks), per_step):
        step = marks[start:start + per_step]
        pred = {m: mark for kind, m, mark in step if kind == "pred"}
        execute = {m: mark for kind, m, mark in step if kind == "exec"}
        if sorted(pred) != list(range(num_layers)) or sorted(execute) != list(range(num_layers)):
            raise ValueError("marks of a step do not cover every MoE layer once")
        row = []
        for m in range(num_layers - distance):
            a, b = pred[m], execute[m + distance]
            row.append(a.elapsed_time(b) if cuda else (b - a) * 1e3)
        rows.append(row)
    return np.asarray(rows, dtype=np.float64).reshape(-1, num_layers - distance)


@torch.no_grad()
def profile_window(model: torch.nn.Module, tokens: Sequence[int], *, warmup: int = 8, copies: int = 20,
                   quantile: float = 0.5, decoder: GraphDecoder | None = None) -> WindowProfile:
    """Measure the overlap windows and one expert's copy time on ``model`` (patched by :func:`psr_hf.patch`,
    with at least two MoE layers), decoding ``tokens`` teacher-forced with the engine (``decoder``: a
    :class:`~psr_hf.engine.graphs.GraphDecoder` of the model, built if None: CUDA graphs on CUDA). ``warmup``
    untimed steps first (compilation, allocator). ``quantile``: of the per-event budgets, for
    :attr:`WindowProfile.budget`."""
    from psr_hf.hf.patching import controller

    from ..engine.graphs import GraphDecoder

    ctl = controller(model)
    if ctl.num_layers < 2:
        raise ValueError("the overlap window lies between two MoE layers; this model has one")
    tokens = [int(t) for t in tokens]
    if len(tokens) < 2:
        raise ValueError("profile_window needs at least 2 tokens to decode")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile={quantile} must be in [0, 1]")
    if decoder is None:
        device = next(model.parameters()).device
        decoder = GraphDecoder(model, max(len(tokens), warmup) + 1, graphs=device.type == "cuda")
    cuda = decoder.cuda
    decoder.reset()
    for token in (tokens * math.ceil(warmup / len(tokens)))[:warmup]:
        decoder.step(token)
    decoder.reset()
    decoder.marks = []
    try:
        for token in tokens:
            decoder.step(token)
        if cuda:
            torch.cuda.synchronize(decoder.device)
        windows = windows_from_marks(decoder.marks, ctl.num_layers, cuda, ctl.config.prefetch_distance)
    finally:
        decoder.marks = None
    copy_ms, nbytes = time_expert_copy(ctl, decoder.device, copies)
    return WindowProfile(windows_ms=windows, copy_ms=copy_ms, bytes_per_expert=nbytes, device=str(decoder.device),
                         top_k=ctl.top_k, quantile=quantile,
                         notes={"routing": ctl.config.to_dict(), "offloaded": ctl.expert_store.offloaded,
                                "graphs": bool(getattr(decoder, "graphs", False))})


def profile_unpatched(model: torch.nn.Module, tokens: Sequence[int], *, warmup: int = 8, copies: int = 20,
                      quantile: float = 0.5) -> WindowProfile:
    """:func:`profile_window` on an unpatched model: the computation alone, patched for the measurement with every
    expert cached (exact routing, nothing offloaded, nothing waits for a copy), unpatched after. What
    ``psr-hf profile-window`` and ``psr-hf bench --prefetch-budgets window`` measure."""
    from ..hf.patching import patched
    from ..policy.config import RoutingConfig
    from .train import model_facts

    num_experts = model_facts(model)["num_experts"]
    with patched(model, RoutingConfig(policy="exact", capacity=num_experts)):  # no warm set or prior matters
        return profile_window(model, tokens, warmup=warmup, copies=copies, quantile=quantile)
