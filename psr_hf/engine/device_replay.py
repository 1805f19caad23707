"""The device decision kernel over a recorded trace: :func:`replay_on_device`, the device twin of
:func:`psr_hf.policy.replay`.

It feeds a :class:`~psr_hf.policy.Recording` (or score arrays) through
:class:`~psr_hf.engine.device_state.DeviceState` position by position and layer by layer, as the token graph
decides (``select(m)`` then ``prefetch(m + D)`` from layer ``m + D``'s pre-gate, D the prefetch distance), so that
the decisions the engine makes on the GPU can be checked against the numba kernels on real routing traces
(``benchmarks/engine/device_decisions_record.py``) and not only on random scores.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from psr_hf.policy import LogicalCache, Recording, RoutingConfig
from psr_hf.policy.config import DEFAULT_WINDOW
from psr_hf.policy.replaying import ReplayResult
from .device_decisions import R_DEMAND, R_PREFETCH, R_REPLACED
from .device_state import DeviceState


def replay_on_device(config: RoutingConfig | dict, recording: Recording | None = None, *,
                     scores: Any = None, pregate: Any = None, tokens: Any = None, top_k: int | None = None,
                     calibration: Any = None, default_window: int | None = None,
                     device: torch.device | str = "cuda") -> ReplayResult:
    """:func:`psr_hf.policy.replay` with every decision made by the engine's device kernel on ``device`` (a CUDA
    device; the CPU runs it in Triton's interpreter when ``TRITON_INTERPRET=1``). Give ``recording`` or the
    ``scores``/``pregate``/``tokens`` arrays and ``top_k`` as for :func:`~psr_hf.policy.replay`. Returns the same
    :class:`~psr_hf.policy.replaying.ReplayResult`: ``selected [T, L, K]`` sorted, and the prefetch, demand and
    replaced counts ``[T, L]``."""
    if recording is not None:
        if scores is not None or pregate is not None or tokens is not None:
            raise ValueError("pass either a Recording or scores/pregate/tokens arrays, not both")
        scores, pregate, tokens = recording.scores, recording.pregate, recording.tokens
        top_k = recording.top_k if top_k is None else top_k
        default_window = recording.default_window if default_window is None else default_window
    if scores is None or tokens is None or top_k is None:
        raise ValueError("replay_on_device needs a Recording, or scores, tokens and top_k")
    z = np.asarray(scores, dtype=np.float32)
    if z.ndim != 3 or z.shape[0] == 0:
        raise ValueError(f"scores must have shape [T, L, E] with T >= 1, got {z.shape}")
    T, L, E = z.shape
    g = np.zeros_like(z) if pregate is None else np.asarray(pregate, dtype=np.float32)
    if g.shape != z.shape:
        raise ValueError(f"pregate has shape {g.shape}; expected {z.shape} like scores")
    tok = np.asarray(tokens, dtype=np.int64)
    if tok.shape != (T,):
        raise ValueError(f"tokens must have shape [T] = ({T},), got {tok.shape}")
    if isinstance(config, dict):
        config = RoutingConfig(**config)
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=top_k, calibration=calibration, rows=1,
                         default_window=DEFAULT_WINDOW if default_window is None else default_window)
    state = DeviceState(cache, device, max_positions=T)
    state.upload(0)
    K = cache.top_k
    D = cache.distance  # layer m's scores carry the pre-gate of layer m + D: z_m | g_{m+D}
    joint = np.concatenate([z, np.concatenate([g[:, D:], np.zeros_like(g[:, :D])], axis=1)], axis=2)
    joint_device = torch.from_numpy(joint).to(state.device)
    tok_device = torch.from_numpy(tok).to(state.device)
    counts = np.empty((T + 1, L, 3), dtype=np.float64)
    counts[0] = 0.0
    for t in range(T):
        state.token.copy_(tok_device[t : t + 1])
        state.position.fill_(t)
        for m in range(L):
            state.scores.copy_(joint_device[t, m])
            state.decide(m)
        counts[t + 1] = state.counters[:, [R_PREFETCH, R_DEMAND, R_REPLACED]].cpu().numpy()
    state.check()
    plans = state.record_plans[:T].cpu().numpy()  # [T, L, W]: each position's select plans, K selected first
    per_token = np.diff(counts, axis=0).astype(np.int64)
    return ReplayResult(np.sort(plans[:, :, :K], axis=-1), per_token[..., 0], per_token[..., 1], per_token[..., 2])
