"""Did a model's routers specialise? Statistics of its exact routing on text windows (the routing tables of
docs/models.md).

:func:`recordings` runs the windows through the patched model; :func:`router_stats` computes the statistics
(:class:`RouterStats`) from recordings (``psr_hf.Recording``), so recorded traces can be reused.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..policy.config import RoutingConfig
from ..policy.replaying import Recording


@dataclass
class RouterStats:
    """Per MoE layer, from the router's own top-K (exact routing, recorded by the controller):

    - **usage entropy**: the entropy (nats) of how often each expert is in the top-K, against the uniform ``ln E``.
      The load-balancing loss pushes it towards uniform, so on its own it says little;
    - **top-K reuse**: the mean share ``|S_t & S_t-1| / K`` of a token's top-K that the previous token also used; a
      router that ignores its input gives about ``K / E``. This locality is what an expert cache exploits;
    - **pre-gate accuracy**: the mean share of layer ``l``'s top-K that its router, applied one layer early to layer
      ``l-1``'s hidden state, also ranks in its top-K (what prefetching one layer ahead relies on);
    - **source information**: with a label per window (e.g. the text's source: prose, code, ...), the mutual
      information ``I(expert; source)`` in nats between the experts a token uses and the source of its text, i.e.
      how much the experts divide the work by domain. 0 when usage does not depend on the source.
    """

    tokens: int
    num_experts: int
    top_k: int
    usage_entropy: list[float]  # per layer, nats
    top_k_reuse: list[float]  # per layer
    pregate_accuracy: list[float | None]  # per layer; None for layer 0 (it has no pre-gate)
    source_information: list[float] | None  # per layer, nats; None without labels

    @property
    def uniform_entropy(self) -> float:
        return math.log(self.num_experts)

    @property
    def random_reuse(self) -> float:
        return self.top_k / self.num_experts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"uniform_entropy": self.uniform_entropy, "random_reuse": self.random_reuse}


@torch.no_grad()
def recordings(model: torch.nn.Module, windows: Sequence[torch.Tensor], calibration: Any = None) -> list[Recording]:
    """Exact-routing recordings of ``windows`` (each ``[1, T]`` token ids), one per window, in order.

    The model must not be patched; it is patched with exact routing (the router's own top-K, pre-gates computed)
    for the duration and unpatched after."""
    from ..hf.patching import controller, patched

    for w in windows:
        if w.dim() != 2 or w.shape[0] != 1:
            raise ValueError(f"every window must be [1, T] token ids, got shape {tuple(w.shape)}")
    config = RoutingConfig(policy="exact", eviction="score", budget=1, residency=1.0)  # budget 1: pre-gates
    device = next(model.parameters()).device
    with patched(model, config, calibration=calibration):
        with controller(model).record() as rec:
            for w in windows:
                model(input_ids=w.to(device))
    if len(rec.recordings) != len(windows):
        raise RuntimeError(f"{len(windows)} windows gave {len(rec.recordings)} recordings")
    return list(rec.recordings)


def _entropy(p: np.ndarray) -> np.ndarray:
    """Entropy (nats) along the last axis of distributions ``p`` (zeros allowed)."""
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)


def router_stats(recs: Sequence[Recording], labels: Sequence[Any] | None = None) -> RouterStats:
    """The :class:`RouterStats` of ``recs`` (``labels``: one per recording, e.g. its source)."""
    if not recs:
        raise ValueError("router_stats needs at least one recording")
    if labels is not None and len(labels) != len(recs):
        raise ValueError(f"{len(labels)} labels for {len(recs)} recordings: give one label per recording")
    T0, L, E = recs[0].scores.shape
    K = recs[0].top_k
    names = sorted(set(labels), key=str) if labels is not None else [None]
    counts = np.zeros((len(names), L, E))
    reuse, hits = np.zeros(L), np.zeros(L)
    tokens = pairs = 0
    for i, r in enumerate(recs):
        if r.scores.shape[1:] != (L, E) or r.top_k != K:
            raise ValueError("recordings of different models: every recording needs the same layers, experts, top-K")
        own = np.argsort(-r.scores, axis=-1, kind="stable")[:, :, :K]  # [T, L, K]
        member = np.zeros((own.shape[0], L, E), dtype=bool)
        np.put_along_axis(member, own, True, axis=-1)
        counts[names.index(labels[i]) if labels is not None else 0] += member.sum(axis=0)
        reuse += (member[1:] & member[:-1]).sum(axis=(0, 2)) / K
        pairs += own.shape[0] - 1
        pre = np.argsort(-r.pregate, axis=-1, kind="stable")[:, 1:, :K]  # layer l's router on layer l-1's state
        hits[1:] += np.take_along_axis(member[:, 1:], pre, axis=-1).sum(axis=(0, 2)) / K
        tokens += own.shape[0]
    total = counts.sum(axis=0)  # [L, E]
    entropy = _entropy(total / total.sum(axis=-1, keepdims=True))
    information = None
    if labels is not None:
        weight = counts.sum(axis=-1) / total.sum(axis=-1)  # [S, L] share of each label's tokens
        conditional = _entropy(counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1))  # [S, L]
        information = (entropy - (weight * conditional).sum(axis=0)).tolist()
    return RouterStats(
        tokens=tokens, num_experts=E, top_k=K, usage_entropy=entropy.tolist(),
        top_k_reuse=(reuse / max(pairs, 1)).tolist(),
        pregate_accuracy=[None] + (hits[1:] / tokens).tolist(), source_information=information,
    )
