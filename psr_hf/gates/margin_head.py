"""A learned, bounded per-token margin for cache-aware routing (the paper's Section 6.10): per MoE layer ``l``

    mu[t, l] = floor + (ceiling[l] - floor) * sigmoid(w[l] . x_hat + b[l]),    x_hat = x / rms(x),

from the router input ``x`` of the token at that layer. With ``RoutingConfig(policy="cache_prior", eviction="lru")``
it is the change-based gate (an expert outside the persistent active set is swapped in only when its score exceeds
the weakest selected member's by ``mu``); with ``policy="psr"`` it is PSR's bonus learned per token. The runtime
scales each token's selection scores by ``lam * delta[l] / mu`` (:mod:`psr_hf.policy.margins`), so the decisions
are the policy kernels' on scores a recording keeps: deterministic, replayable, independent of transfer timing.
``w = 0`` with ``b`` set by :meth:`MarginHead.uniform` is the untrained rule (one margin, ``lam * delta[l]``).

Stored as safetensors (no pickle) with the model's shape, checked on load against the model like a predictor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .._metadata import read_file
from ..policy.margins import MIN_MARGIN

FORMAT_NAME = "psr_hf.margin_head"
FORMAT_VERSION = 1


class MarginHead(torch.nn.Module):
    """``weight [L, D]``, ``bias [L]`` (trainable) and ``ceiling [L]`` (a buffer: each layer's largest margin, in
    score units); ``metadata``: ``model_type`` and free-form training facts (strings)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, ceiling: torch.Tensor,
                 metadata: Mapping[str, Any] | None = None):
        super().__init__()
        weight, bias, ceiling = (torch.as_tensor(t).detach().float() for t in (weight, bias, ceiling))
        if weight.ndim != 2 or bias.shape != (weight.shape[0],) or ceiling.shape != (weight.shape[0],):
            raise ValueError(f"a margin head needs weight [L, D], bias [L] and ceiling [L]; got "
                             f"{tuple(weight.shape)}, {tuple(bias.shape)} and {tuple(ceiling.shape)}")
        for name, t in (("weight", weight), ("bias", bias), ("ceiling", ceiling)):
            if not torch.isfinite(t).all():
                raise ValueError(f"the margin head's {name} holds values that are not finite")
        if (ceiling <= 2 * MIN_MARGIN).any():
            raise ValueError(f"every layer's ceiling must exceed {2 * MIN_MARGIN:g}: a margin head bounds margins "
                             "between a floor near zero and its ceiling")
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(bias)
        self.register_buffer("ceiling", ceiling)
        self.metadata = {str(k): str(v) for k, v in dict(metadata or {}).items()}

    @classmethod
    def uniform(cls, margins: Sequence[float], hidden_size: int, *, ceiling_factor: float = 4.0,
                metadata: Mapping[str, Any] | None = None) -> "MarginHead":
        """The untrained rule: every token's margin at layer ``l`` is ``margins[l]`` (e.g. ``lam * delta[l]``);
        margins learned from it stay below ``ceiling_factor * margins[l]``."""
        m = torch.as_tensor(margins, dtype=torch.float64)
        if m.ndim != 1 or not torch.isfinite(m).all() or (m <= 2 * MIN_MARGIN).any():
            raise ValueError(f"margins must be one positive margin per MoE layer; got {m.tolist()}")
        if not ceiling_factor > 1:
            raise ValueError(f"ceiling_factor={ceiling_factor}: the ceiling must lie above the starting margin (> 1)")
        ceiling = m * ceiling_factor
        p = (m - MIN_MARGIN) / (ceiling - MIN_MARGIN)
        bias = torch.log(p / (1 - p))
        return cls(torch.zeros(m.shape[0], int(hidden_size)), bias, ceiling, metadata)

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def model_type(self) -> str | None:
        return self.metadata.get("model_type")

    def __repr__(self) -> str:
        return f"MarginHead({self.model_type or '?'}: {self.num_layers} MoE layers, hidden {self.hidden_size})"

    # ------------------------------------------------------------------ compute
    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[N]`` float32 margins of router inputs ``x [N, D]`` at MoE layer ``layer`` (differentiable)."""
        if not 0 <= int(layer) < self.num_layers:
            raise ValueError(f"layer {layer} out of range: this margin head has {self.num_layers} MoE layers")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"router inputs of width {x.shape[-1]} given to a margin head of hidden size "
                             f"{self.hidden_size}")
        w, b, top = self.weight[layer], self.bias[layer], self.ceiling[layer]
        x = x.to(w.device, torch.float32)
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return MIN_MARGIN + (top - MIN_MARGIN) * torch.sigmoid(x_hat @ w + b)

    # ------------------------------------------------------------------ checks
    def check(self, *, num_layers: int, hidden_size: int, model_type: str | None = None,
              source: str = "margin head") -> None:
        """``ValueError`` naming the mismatch if this head was not made for a model of this shape."""
        if (self.num_layers, self.hidden_size) != (num_layers, hidden_size):
            raise ValueError(f"{source} was made for {self.num_layers} MoE layers with hidden size "
                             f"{self.hidden_size}, but the model has {num_layers} with hidden size {hidden_size}; "
                             "make one for this model (MarginHead.uniform or psr-hf train-gate)")
        if model_type is not None and self.model_type not in (None, model_type):
            raise ValueError(f"{source} was made for a {self.model_type} model, this one is {model_type}")

    # ------------------------------------------------------------------ storage
    def save(self, path: str | Path) -> Path:
        """Write to ``path`` in safetensors format; returns the path."""
        from safetensors.torch import save_file

        tensors = {"weight": self.weight.detach().float().cpu().contiguous(),
                   "bias": self.bias.detach().float().cpu().contiguous(),
                   "ceiling": self.ceiling.detach().float().cpu().contiguous()}
        meta = {"format": FORMAT_NAME, "version": str(FORMAT_VERSION), "num_layers": str(self.num_layers),
                "hidden_size": str(self.hidden_size), "user": json.dumps(self.metadata)}
        path = Path(path)
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "MarginHead":
        """Read a head written by :meth:`save`; ``ValueError`` for a file that is not one."""
        _, user, tensors = read_file(path, FORMAT_NAME, "margin head", "make one with MarginHead.uniform and save it")
        missing = [k for k in ("weight", "bias", "ceiling") if k not in tensors]
        if missing:
            raise ValueError(f"{path}: tensors {missing} are missing (a truncated file?)")
        try:
            return cls(tensors["weight"], tensors["bias"], tensors["ceiling"], user)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    @classmethod
    def coerce(cls, value: Any) -> "MarginHead":
        """A MarginHead, or the path of a saved one."""
        if isinstance(value, MarginHead):
            return value
        if isinstance(value, (str, Path)):
            return cls.load(value)
        raise ValueError(f"gate must be a psr_hf.gates.MarginHead or the path of a saved one; got "
                         f"{type(value).__name__}")

