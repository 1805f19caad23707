"""A smooth surrogate of the gate's discrete selection, for training a margin head (the paper's Section 6.10).

The forward pass keeps the kernels' hard selection ``S`` and its weights, so the trained model computes what it will
run (the candidates outside ``S`` run with weight 0: only the rounding of the experts' batched matmuls changes). The gradients come from a relaxation: with the gate's scores ``z' = z + mu * m`` (``m``: the
logical cache the selection read, ``mu``: the token's margin) and the threshold ``theta`` halfway between the K-th
and the (K+1)-th of them, each of the ``2K`` candidates (``S`` and the best ``K`` outside it) is a member with
probability ``sigmoid((z'_e - theta) / tau)``. Where the weakest cached member and the best outsider meet at the
boundary this is ``sigmoid((z_out - z_weak - mu) / (2 tau))``, the paper's swap with margin ``mu``. The layer's
weights are the hard ones plus ``soft - stopgrad(soft)`` (``soft``: membership times the router's weight), so
their value is the hard selection's and their gradient the relaxation's; the smooth host loads are the summed
membership of the candidates outside the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class GateRelaxation:
    """The surrogate for one training run: ``unit [L]`` (``lam * delta[l]``, the untrained margin, which sets the
    temperature ``tau = temperature * unit[l]`` and is the margin where no head is trained) and ``top_j`` (the
    router's top-j that also gets the bonus). ``loads`` sums the smooth host loads of the open forward pass."""

    def __init__(self, unit: torch.Tensor, temperature: float, top_j: int = 0):
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: the relaxation's temperature must be > 0")
        self.unit = unit.detach().float()
        self.temperature = float(temperature)
        self.top_j = int(top_j)
        self.loads: torch.Tensor | float = 0.0
        self._before: dict[int, np.ndarray] = {}

    def begin_forward(self) -> None:
        self.loads = 0.0
        self._before = {}

    def snapshot(self, layer: int, before: np.ndarray) -> None:
        """The logical cache ``[B, E]`` of ``layer`` before the kernels route the block."""
        self._before[layer] = np.array(before, dtype=bool)

    def outputs(self, family: Any, layer: int, router: Any, result: tuple, plan: Any, gate: Any,
                hidden: torch.Tensor | None) -> tuple:
        """The router's triple ``(logits, weights [N, 2K], indices [N, 2K])`` for the hard ``result``, with the
        relaxation's gradients; adds this layer's smooth host loads to :attr:`loads`."""
        if layer not in self._before:
            raise RuntimeError(f"psr_hf: MoE layer {layer} was routed one position at a time; a gate trains on "
                               "whole windows (a forward pass over the training tokens)")
        logits, weights, chosen = result
        N, K = chosen.shape
        active = plan.selection_sets(self._before.pop(layer)).reshape(N, -1)
        active = torch.from_numpy(active).to(logits.device)
        z = family.selection_scores(router, logits).float()
        if self.top_j:
            active = active | torch.zeros_like(active).scatter_(1, z.topk(self.top_j, dim=-1).indices, True)
        unit = self.unit[layer].to(z.device)
        if gate is None:
            margin = unit.expand(N)
        else:
            if hidden is None:
                raise RuntimeError(f"psr_hf: MoE layer {layer}'s router input is needed to train the gate")
            margin = gate(layer, hidden.detach().reshape(N, -1)).to(z.device)
        gated = z + margin[:, None] * active
        outside = gated.scatter(1, chosen, float("-inf"))
        indices = torch.cat((chosen, outside.topk(K, dim=-1).indices), dim=1)  # [N, 2K], distinct
        top = gated.topk(K + 1, dim=-1).values
        theta = 0.5 * (top[:, K - 1] + top[:, K])
        member = torch.sigmoid((gated.gather(1, indices) - theta[:, None]) / (self.temperature * unit))
        soft = member * family.execution_weights(router, logits, indices).float()
        hard = torch.cat((weights.float(), torch.zeros_like(weights, dtype=torch.float32)), dim=1)
        self.loads = self.loads + (member * ~active.gather(1, indices)).sum()
        return logits, (hard + (soft - soft.detach())).to(weights.dtype), indices
