"""SpecPrefetch's learned next-layer predictors (the SpecPrefetch paper, Section 3.2): for each adjacent
pair of MoE layers ``(l, l + 1)`` a rank-``r`` adapter on the router input ``x`` of layer ``l``,

    z_hat[l + 1] = B[l] A[l] x,    A[l]: [r, D],  B[l]: [E, r],

whose softmax ranks layer ``l + 1``'s experts for prefetching only (the native router still selects what runs).
``(L - 1) r (D + E)`` parameters for ``L`` MoE layers.

A :class:`Predictor` is what the runtime reads (``psr_hf.patch(model, RoutingConfig(prefetch="predictor"),
predictor=...)``: the logical cache's pre-gate ranking ``g`` of layer ``l + 1`` becomes ``softmax(B[l] A[l] x)``,
docs/ALGORITHM.md "Prefetch ranking source") and what ``psr-hf train-predictor`` writes: safetensors (no pickle)
with the model's shape recorded, checked on load against the model like a calibration.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .._metadata import read_file

FORMAT_NAME = "psr_hf.predictor"
FORMAT_VERSION = 1
MAX_WEIGHT = 1e4  # beyond any trained low-rank factor; larger values overflow the ranking's products


class Predictor:
    """Per adjacent MoE-layer pair ``l`` (``0 .. L - 2``) the factors ``A[l]`` ``[r, D]`` and ``B[l]`` ``[E, r]``
    (float32, on the CPU unless moved with :meth:`to`), and ``metadata``: ``model_type``, ``top_k`` and free-form
    training facts (strings). Build with ``Predictor(A, B, metadata)``, :meth:`load`, or
    :func:`psr_hf.prefetch.train.train_predictor`."""

    def __init__(self, A: Sequence[torch.Tensor], B: Sequence[torch.Tensor],
                 metadata: Mapping[str, Any] | None = None):
        A, B = [torch.as_tensor(a).detach().float() for a in A], [torch.as_tensor(b).detach().float() for b in B]
        for name, parts in (("A", A), ("B", B)):
            for i, t in enumerate(parts):
                if not torch.isfinite(t).all() or (t.numel() and float(t.abs().max()) > MAX_WEIGHT):
                    raise ValueError(f"predictor tensor {name}.{i} holds values that are not finite or beyond "
                                     f"{MAX_WEIGHT:g}; no trained predictor has such weights, and its rankings "
                                     "would overflow")
        if not A or len(A) != len(B):
            raise ValueError(f"a predictor needs one (A, B) pair per adjacent MoE-layer pair; got {len(A)} A and "
                             f"{len(B)} B")
        r, D = A[0].shape if A[0].ndim == 2 else (None, None)
        if r is None:
            raise ValueError(f"A[0] must be 2-D [rank, hidden]; got shape {tuple(A[0].shape)}")
        E = B[0].shape[0] if B[0].ndim == 2 else None
        for i, (a, b) in enumerate(zip(A, B)):
            if a.ndim != 2 or b.ndim != 2 or tuple(a.shape) != (r, D) or tuple(b.shape) != (E, r):
                raise ValueError(f"pair {i}: A {tuple(a.shape)} and B {tuple(b.shape)} must be [{r}, {D}] and "
                                 f"[{E}, {r}] like pair 0 (rank, hidden, experts)")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(f"pair {i}: the predictor's weights contain NaN or inf")
        self.A, self.B = A, B
        self.metadata = {str(k): str(v) for k, v in dict(metadata or {}).items()}

    # ------------------------------------------------------------------ shape
    @property
    def num_pairs(self) -> int:
        return len(self.A)

    @property
    def num_layers(self) -> int:
        """MoE layers of the model it predicts for (pairs + 1)."""
        return len(self.A) + 1

    @property
    def rank(self) -> int:
        return int(self.A[0].shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.A[0].shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.B[0].shape[0])

    @property
    def num_parameters(self) -> int:
        """``(L - 1) r (D + E)``: the trainable parameters (the paper's Table 3)."""
        return self.num_pairs * self.rank * (self.hidden_size + self.num_experts)

    @property
    def model_type(self) -> str | None:
        return self.metadata.get("model_type")

    @property
    def top_k(self) -> int | None:
        value = self.metadata.get("top_k")
        return None if value is None else int(value)

    def __repr__(self) -> str:
        return (f"Predictor({self.model_type or '?'}: {self.num_layers} MoE layers x {self.num_experts} experts, "
                f"hidden {self.hidden_size}, rank {self.rank}, {self.num_parameters:,} parameters)")

    # ------------------------------------------------------------------ compute
    def weight(self, pair: int) -> torch.Tensor:
        """``[E, D]`` float32: ``B[pair] @ A[pair]`` (one matmul turns a router input into the predicted logits,
        stacked under the router's own weight by the runtime)."""
        self._check_pair(pair)
        return self.B[pair] @ self.A[pair]

    def logits(self, pair: int, x: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` float32 predicted logits of layer ``pair + 1`` from router inputs ``x`` ``[N, D]`` of layer
        ``pair`` (through the rank-r bottleneck: ``(x A^T) B^T``)."""
        self._check_pair(pair)
        a, b = self.A[pair], self.B[pair]
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"router inputs of width {x.shape[-1]} given to a predictor of hidden size "
                             f"{self.hidden_size}")
        return (x.to(a.device, torch.float32) @ a.T) @ b.T

    def priorities(self, pair: int, x: torch.Tensor) -> torch.Tensor:
        """``[N, E]``: the token-level distributions ``softmax(B A x)`` (sum them over a batch's valid tokens for
        the paper's batch-level priorities)."""
        return torch.softmax(self.logits(pair, x), dim=-1)

    def batch_priorities(self, pair: int, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """``[E]``: the paper's batch-level priorities ``s = sum over valid tokens of softmax(B A x)`` (Section 3.2)
        for router inputs ``x`` ``[N, D]`` (or ``[B, S, D]``) with ``valid`` the matching mask (True / 1: a real
        token; None: every token). The runtime ranks per row (docs/ALGORITHM.md: the batch-level sum is a
        physical scheduling choice); this is for scheduling a batch's copies and for analysis."""
        p = self.priorities(pair, x.reshape(-1, x.shape[-1]))
        if valid is not None:
            mask = valid.reshape(-1).to(p.device)
            if mask.shape[0] != p.shape[0]:
                raise ValueError(f"valid has {mask.shape[0]} entries for {p.shape[0]} tokens")
            p = p[mask.bool()]
        return p.sum(dim=0)

    def _check_pair(self, pair: int) -> None:
        if not 0 <= int(pair) < self.num_pairs:
            raise ValueError(f"pair {pair} out of range: this predictor has {self.num_pairs} adjacent MoE-layer "
                             f"pairs (layers 0..{self.num_layers - 1})")

    def to(self, device: torch.device | str) -> "Predictor":
        """A copy on ``device``."""
        return Predictor([a.to(device) for a in self.A], [b.to(device) for b in self.B], self.metadata)

    # ------------------------------------------------------------------ checks
    def check(self, *, num_layers: int, num_experts: int, hidden_size: int, model_type: str | None = None,
              top_k: int | None = None, source: str = "predictor") -> None:
        """``ValueError`` naming the mismatch if this predictor was not made for a model of this shape."""
        have = (self.num_layers, self.num_experts, self.hidden_size)
        want = (num_layers, num_experts, hidden_size)
        if have != want:
            raise ValueError(
                f"{source} was trained for {have[0]} MoE layers x {have[1]} experts with hidden size {have[2]}, but "
                f"the model has {want[0]} x {want[1]} with hidden size {want[2]}; train one for this model "
                "(psr-hf train-predictor --model ...)"
            )
        if model_type is not None and self.model_type not in (None, model_type):
            raise ValueError(f"{source} was trained on a {self.model_type} model, this one is {model_type}; train "
                             "one for this model (psr-hf train-predictor --model ...)")
        if top_k is not None and self.top_k not in (None, top_k):
            raise ValueError(f"{source} was trained for top-{self.top_k} routing, the model routes to {top_k} experts")

    # ------------------------------------------------------------------ storage
    def save(self, path: str | Path) -> Path:
        """Write to ``path`` in safetensors format; returns the path."""
        from safetensors.torch import save_file

        tensors = {}
        for i, (a, b) in enumerate(zip(self.A, self.B)):
            tensors[f"A.{i}"] = a.detach().float().cpu().contiguous()
            tensors[f"B.{i}"] = b.detach().float().cpu().contiguous()
        meta = {"format": FORMAT_NAME, "version": str(FORMAT_VERSION), "num_layers": str(self.num_layers),
                "num_experts": str(self.num_experts), "hidden_size": str(self.hidden_size), "rank": str(self.rank),
                "user": json.dumps(self.metadata)}
        path = Path(path)
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Predictor":
        """Read a predictor written by :meth:`save`; ``ValueError`` for a file that is not one."""
        meta, user, tensors = read_file(path, FORMAT_NAME, "predictor", "train one with psr-hf train-predictor")
        try:
            pairs = int(meta.get("num_layers", "")) - 1
        except ValueError:
            raise ValueError(f"{path}: the header's num_layers {meta.get('num_layers')!r} is not an integer") from None
        present = sum(1 for k in tensors if k.startswith(("A.", "B.")))
        if pairs < 1 or 2 * pairs != present:
            raise ValueError(f"{path}: the header says {pairs + 1} layers ({2 * pairs} predictor tensors) but the file "
                             f"holds {present}; a truncated or altered file?")
        missing = [k for i in range(pairs) for k in (f"A.{i}", f"B.{i}") if k not in tensors]
        if missing:
            raise ValueError(f"{path}: predictor tensors {missing[:4]} are missing (a truncated file?)")
        try:
            return cls([tensors[f"A.{i}"] for i in range(pairs)], [tensors[f"B.{i}"] for i in range(pairs)], user)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    @classmethod
    def coerce(cls, value: Any) -> "Predictor":
        """A Predictor, or the path of a saved one."""
        if isinstance(value, Predictor):
            return value
        if isinstance(value, (str, Path)):
            return cls.load(value)
        raise ValueError(f"predictor must be a psr_hf.prefetch.Predictor or the path of a saved one; got "
                         f"{type(value).__name__}")
