"""Calibration: the per-layer bonus scale, the warm set and the token prior, estimated on held-out text.

The token prior ``token_prior[x, l, e]`` is the fraction of token ``x``'s calibration occurrences at MoE layer
``l`` whose own top-K contained expert ``e``. Dense, it would cost ``V * L * E * 4`` bytes (OLMoE: 50k x 16 x 64,
205 MB), yet almost all of it is zero: a token seen ``n`` times has at most ``n * K`` non-zeros per layer and most
of a vocabulary is rare. It is therefore stored row-compressed (CSR over the ``V * L`` rows ``x * L + l``) with
the exact float32 values, so decisions do not change with the storage.

Tokens that the calibration text never contained (``token_counts[x] == 0`` when occurrence counts are known)
fall back to the layer's marginal frequency ``expert_counts[l] / total_tokens``: the prior of an average token.
When a dense prior is given without occurrence counts, every row is taken as given (a zero row stays zero).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .._metadata import user_metadata

logger = logging.getLogger(__name__)

FORMAT_NAME = "psr_hf.calibration"
FORMAT_VERSION = 1
_MAX_TOTAL = float(2**53)  # counts above this lose integer precision in float64 arithmetic

# the tensors a calibration file holds: name -> (numpy dtype kinds allowed on disk, in-memory dtype, shape in terms of
# L (MoE layers), E (experts), V (vocabulary) and N (stored prior entries)); load() reads nothing else
_TENSORS: dict[str, tuple[str, Any, tuple[str, ...]]] = {
    "delta": ("f", np.float64, ("L",)),
    "expert_counts": ("f", np.float64, ("L", "E")),
    "prior_indptr": ("iu", np.int64, ("VL+1",)),
    "prior_experts": ("iu", np.uint16, ("N",)),
    "prior_values": ("f", np.float32, ("N",)),
    "token_counts": ("iu", np.int64, ("V",)),
}
_REQUIRED = ("delta", "expert_counts", "prior_indptr", "prior_experts", "prior_values")
# safetensors dtype names -> numpy kinds
_ST_KINDS = {"F16": "f", "BF16": "f", "F32": "f", "F64": "f", "I8": "i", "I16": "i", "I32": "i", "I64": "i",
             "U8": "u", "U16": "u", "U32": "u", "U64": "u", "BOOL": "b"}


def _as_array(name: str, value: Any, dtype, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(value)
    except Exception as exc:  # an object numpy cannot convert (a torch tensor on a GPU, a ragged list)
        raise ValueError(f"{name} must be array-like ({ndim}-D numbers); got {type(value).__name__}: {exc}") from exc
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise ValueError(f"{name} must hold numbers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=dtype)


@dataclass(frozen=True, eq=False)
class Calibration:
    """Calibration of one model: ``delta [L]``, ``expert_counts [L, E]`` and a compressed token prior.

    Build with :meth:`from_arrays` (or :class:`CalibrationBuilder` from router outputs), store with
    :meth:`save` / :meth:`load` (safetensors, no pickle), check against a model with :meth:`check`.
    """

    delta: np.ndarray  # [L] float64: mean max(z) - min(z) (finite entries) per MoE layer
    expert_counts: np.ndarray  # [L, E] float64: how often the router's own top-K picked each expert
    prior_indptr: np.ndarray  # [V * L + 1] int64: CSR row pointers, row = token * L + layer
    prior_experts: np.ndarray  # [nnz] uint16: expert of each stored entry (uint8 on disk when E <= 256)
    prior_values: np.ndarray  # [nnz] float32: token_prior value of each stored entry
    token_counts: np.ndarray | None = None  # [V] int64 occurrences; 0 = unseen -> marginal fallback
    metadata: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        L, E = self.expert_counts.shape
        if E > 65535:
            raise ValueError(f"{E} experts per layer: at most 65535 are supported")
        if self.delta.shape != (L,):
            raise ValueError(f"delta has shape {self.delta.shape}; expected ({L},) to match expert_counts {(L, E)}")
        if self.prior_indptr.ndim != 1 or (self.prior_indptr.size - 1) % max(L, 1) != 0:
            raise ValueError(f"prior_indptr of size {self.prior_indptr.size} is not V * {L} + 1")
        nnz = int(self.prior_indptr[-1]) if self.prior_indptr.size else 0
        if self.prior_experts.shape != (nnz,) or self.prior_values.shape != (nnz,):
            raise ValueError("prior_experts and prior_values must have one entry per stored prior value")
        if nnz and (self.prior_experts.min() < 0 or self.prior_experts.max() >= E):
            raise ValueError(f"prior_experts holds expert ids outside [0, {E})")
        if np.any(np.diff(self.prior_indptr) < 0) or (self.prior_indptr.size and self.prior_indptr[0] != 0):
            raise ValueError("prior_indptr must start at 0 and be non-decreasing")
        if self.token_counts is not None and self.token_counts.shape != (self.vocab_size,):
            raise ValueError(f"token_counts has shape {self.token_counts.shape}; expected ({self.vocab_size},)")
        if not np.all(np.isfinite(self.delta)) or np.any(self.delta < 0):
            raise ValueError("delta must be finite and >= 0 for every layer")
        if not np.all(np.isfinite(self.expert_counts)) or np.any(self.expert_counts < 0):
            raise ValueError("expert_counts must be finite and >= 0")
        if nnz and not np.all(np.isfinite(self.prior_values)):
            raise ValueError("token_prior must be finite")
        if nnz and (self.prior_values.min() < 0 or self.prior_values.max() > 1):
            # a fraction of a token's occurrences: anything else would outweigh every other priority term
            raise ValueError(
                f"token_prior values must lie in [0, 1] (fractions of a token's occurrences); got values in "
                f"[{self.prior_values.min():.4g}, {self.prior_values.max():.4g}]"
            )
        if self.token_counts is not None:
            if self.token_counts.size and self.token_counts.min() < 0:
                raise ValueError("token_counts must be >= 0")
            # their total divides expert_counts into the marginal prior: it must be exact in int64
            if float(self.token_counts.sum(dtype=np.float64)) >= _MAX_TOTAL:
                raise ValueError(f"token_counts sum to more than 2**53 occurrences (overflow); got "
                                 f"{self.token_counts.sum(dtype=np.float64):.4g}")

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return int(self.expert_counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.expert_counts.shape[1])

    @property
    def vocab_size(self) -> int:
        """Number of token ids the prior covers (0: no token prior, every token gets zero)."""
        return (self.prior_indptr.size - 1) // max(self.num_layers, 1)

    @property
    def token_seen(self) -> np.ndarray:
        """[V] bool: tokens whose prior row is used as stored (the others use the layer's marginal)."""
        if self.token_counts is None:
            return np.ones(self.vocab_size, dtype=np.bool_)
        return self.token_counts > 0

    @property
    def marginal(self) -> np.ndarray:
        """[L, E] float64: the fallback prior of unseen tokens, ``expert_counts / total calibration tokens``."""
        if self.token_counts is None or self.token_counts.sum() == 0:
            return np.zeros_like(self.expert_counts)
        return self.expert_counts / float(self.token_counts.sum())

    @property
    def nbytes(self) -> int:
        arrays = [self.delta, self.expert_counts, self.prior_indptr, self.prior_experts, self.prior_values]
        if self.token_counts is not None:
            arrays.append(self.token_counts)
        return int(sum(a.nbytes for a in arrays))

    def warm_set(self, layer: int, capacity: int) -> np.ndarray:
        """The ``capacity`` experts with the largest ``expert_counts[layer]`` (ties to the lower index), ascending."""
        order = np.lexsort((np.arange(self.num_experts), -self.expert_counts[layer]))
        return np.sort(order[:capacity])

    def prior(self, token: int, layer: int) -> np.ndarray:
        """[E] float64: the token prior of ``token`` at ``layer`` (the marginal for an unseen token)."""
        if self.vocab_size == 0:
            return np.zeros(self.num_experts)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is outside the calibration's vocabulary [0, {self.vocab_size})")
        if not self.token_seen[token]:
            return self.marginal[layer].copy()
        out = np.zeros(self.num_experts)
        row = token * self.num_layers + layer
        lo, hi = self.prior_indptr[row], self.prior_indptr[row + 1]
        out[self.prior_experts[lo:hi]] = self.prior_values[lo:hi]
        return out

    def dense_prior(self) -> np.ndarray:
        """[V, L, E] float32: the whole prior, fallbacks included (for inspection of small vocabularies)."""
        out = np.zeros((self.vocab_size, self.num_layers, self.num_experts), dtype=np.float32)
        flat = out.reshape(-1, self.num_experts)
        rows = np.repeat(np.arange(flat.shape[0]), np.diff(self.prior_indptr))
        flat[rows, self.prior_experts] = self.prior_values
        unseen = ~self.token_seen
        out[unseen] = self.marginal.astype(np.float32)
        return out

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(
        cls,
        *,
        delta: Any,
        expert_counts: Any,
        token_prior: Any = None,
        token_counts: Any = None,
        metadata: Mapping[str, str] | None = None,
    ) -> "Calibration":
        """Build from arrays: ``delta [L]``, ``expert_counts [L, E]``, ``token_prior`` dense ``[V, L, E]`` (or None
        for a zero prior) and optionally ``token_counts [V]`` (calibration occurrences; tokens with 0 fall back to
        the layer's marginal frequency). The prior is compressed on the way in; values are kept exactly (float32).
        """
        expert_counts = _as_array("expert_counts", expert_counts, np.float64, 2)
        L, E = expert_counts.shape
        delta = _as_array("delta", delta, np.float64, 1)
        if delta.shape != (L,):
            raise ValueError(f"delta has shape {delta.shape}; expected ({L},) (one value per MoE layer of expert_counts)")
        if token_prior is None:
            indptr = np.zeros(1, dtype=np.int64)
            experts = np.zeros(0, dtype=np.uint16)
            values = np.zeros(0, dtype=np.float32)
            if token_counts is not None:
                raise ValueError("token_counts needs a token_prior to go with it")
        else:
            prior = _as_array("token_prior", token_prior, np.float32, 3)
            if prior.shape[1:] != (L, E):
                raise ValueError(
                    f"token_prior has shape {prior.shape}; expected [V, {L}, {E}] to match expert_counts {(L, E)}"
                )
            if not np.all(np.isfinite(prior)):
                raise ValueError("token_prior contains NaN or inf")
            flat = prior.reshape(-1, E)
            rows, cols = np.nonzero(flat)
            indptr = np.zeros(flat.shape[0] + 1, dtype=np.int64)
            np.cumsum(np.bincount(rows, minlength=flat.shape[0]), out=indptr[1:])
            experts = cols.astype(np.uint16)
            values = flat[rows, cols].astype(np.float32)
        if token_counts is not None:
            token_counts = _as_array("token_counts", token_counts, np.int64, 1)
            V = (indptr.size - 1) // L
            if token_counts.shape != (V,):
                raise ValueError(f"token_counts has shape {token_counts.shape}; expected ({V},) to match token_prior")
            if np.any(token_counts < 0):
                raise ValueError("token_counts must be >= 0")
        return cls(delta, expert_counts, indptr, experts, values, token_counts, dict(metadata or {}))

    @classmethod
    def empty(cls, num_layers: int, num_experts: int) -> "Calibration":
        """No calibration: zero counts (warm set = the first C experts), zero prior, zero delta."""
        return cls.from_arrays(delta=np.zeros(num_layers), expert_counts=np.zeros((num_layers, num_experts)))

    @classmethod
    def coerce(cls, value: Any) -> "Calibration":
        """Accept a Calibration, a path to a saved one, or a mapping with ``delta``, ``expert_counts`` and
        optionally ``token_prior`` / ``token_counts``."""
        if isinstance(value, Calibration):
            return value
        if isinstance(value, (str, Path)):
            return cls.load(value)
        if isinstance(value, Mapping):
            allowed = {"delta", "expert_counts", "token_prior", "token_counts"}
            unknown = set(value) - allowed
            if unknown:
                raise ValueError(f"unknown calibration keys {sorted(unknown)}; allowed: {sorted(allowed)}")
            return cls.from_arrays(**value)
        raise ValueError(
            f"calibration must be a psr_hf.Calibration, a path to a .safetensors calibration or a mapping; "
            f"got {type(value).__name__}"
        )

    # ------------------------------------------------------------------ checks
    def check(
        self,
        *,
        num_layers: int,
        num_experts: int,
        vocab_size: int | None = None,
        capacity: int | None = None,
        top_k: int | None = None,
        source: str = "calibration",
    ) -> None:
        """Raise ``ValueError`` if this calibration does not fit a model with these dimensions (``top_k`` is
        compared with the top-k recorded when the calibration was built, where it was recorded)."""
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise ValueError(
                f"{source} was made for {self.num_layers} MoE layers x {self.num_experts} experts, but the model has "
                f"{num_layers} x {num_experts}; calibrate this model (psr-hf calibrate) or load its own calibration"
            )
        if vocab_size is not None and self.vocab_size not in (0, vocab_size):
            raise ValueError(
                f"{source} has a token prior over {self.vocab_size} token ids, but the model's vocabulary has "
                f"{vocab_size}; it was made with a different tokenizer: recalibrate this model"
            )
        if capacity is not None and capacity > num_experts:
            raise ValueError(f"capacity {capacity} exceeds the {num_experts} experts of {source}")
        recorded = self.top_k
        if top_k is not None and recorded is not None and recorded != top_k:
            raise ValueError(
                f"{source} was made with top-k {recorded} (its warm set, token prior and delta count the router's "
                f"own top-{recorded}), but the model routes to {top_k} experts per token; calibrate this model as "
                "it is configured (psr-hf calibrate)"
            )

    @property
    def top_k(self) -> int | None:
        """The router's top-k the calibration was built with (recorded by :class:`CalibrationBuilder`), or None."""
        value = (self.metadata or {}).get("top_k")
        try:
            return None if value is None else int(value)
        except (TypeError, ValueError):
            raise ValueError(f"calibration metadata top_k={value!r} is not an integer") from None

    # ------------------------------------------------------------------ storage
    def save(self, path: str | Path) -> None:
        """Write to ``path`` in safetensors format (no pickle)."""
        from safetensors.numpy import save_file

        # the smallest exact integer types on disk; load() widens them again
        nnz = self.prior_values.size
        tensors = {
            "delta": self.delta,
            "expert_counts": self.expert_counts,
            "prior_indptr": self.prior_indptr.astype(np.int32 if nnz < 2**31 else np.int64),
            "prior_experts": self.prior_experts.astype(np.uint8 if self.num_experts <= 256 else np.uint16),
            "prior_values": self.prior_values,
        }
        if self.token_counts is not None:
            tensors["token_counts"] = self.token_counts
        meta = {
            "format": FORMAT_NAME,
            "version": str(FORMAT_VERSION),
            "num_layers": str(self.num_layers),
            "num_experts": str(self.num_experts),
            "vocab_size": str(self.vocab_size),
            "user": json.dumps(dict(self.metadata or {})),
        }
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, *, num_layers: int | None = None, num_experts: int | None = None,
             vocab_size: int | None = None) -> "Calibration":
        """Read a file written by :meth:`save`; a file of another format raises ``ValueError``.

        Only the calibration's own tensors are read, and each one only after its shape and dtype were checked
        against the dimensions in the file's header (and against ``num_layers``, ``num_experts`` and
        ``vocab_size`` where given, e.g. the model's): a file with any other tensor is refused unread, so a
        hostile or mistaken file cannot make this allocate more than its calibration needs. Every value is then
        validated as :meth:`from_arrays` validates it.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise ValueError(f"calibration file {path} does not exist (make one with `psr-hf calibrate`)")
        try:
            handle_cm = safe_open(str(path), framework="numpy")
        except Exception as exc:
            raise ValueError(f"{path} is not a safetensors calibration file: {exc}") from exc
        with handle_cm as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT_NAME:
                raise ValueError(f"{path} is not a psr_hf calibration (format={meta.get('format')!r})")
            try:
                version = int(meta.get("version", -1))
            except ValueError:
                raise ValueError(f"{path}: calibration format version {meta.get('version')!r} is not an integer") from None
            if version > FORMAT_VERSION:
                raise ValueError(f"{path} has calibration format version {version}; upgrade psr_hf to read it")
            dims = {}
            for key in ("num_layers", "num_experts", "vocab_size"):
                try:
                    dims[key] = int(meta[key])
                except (KeyError, ValueError):
                    raise ValueError(f"{path}: the header's {key} is missing or not an integer") from None
                if dims[key] < 0 or (key != "vocab_size" and dims[key] < 1):
                    raise ValueError(f"{path}: the header's {key}={dims[key]} is out of range")
            L, E, V = dims["num_layers"], dims["num_experts"], dims["vocab_size"]
            expected = {"num_layers": num_layers, "num_experts": num_experts}
            for key, value in expected.items():
                if value is not None and dims[key] != value:
                    raise ValueError(
                        f"{path} was made for {L} MoE layers x {E} experts, but the model has {num_layers} x "
                        f"{num_experts}; calibrate this model (psr-hf calibrate) or load its own calibration")
            if vocab_size is not None and V not in (0, vocab_size):
                raise ValueError(f"{path} has a token prior over {V} token ids, but the model's vocabulary has "
                                 f"{vocab_size}; it was made with a different tokenizer: recalibrate this model")
            names = set(handle.keys())
            unknown = sorted(names - set(_TENSORS))
            if unknown:
                raise ValueError(f"{path} holds tensors that are not part of a psr_hf calibration: {unknown}; "
                                 f"a calibration holds only {sorted(_TENSORS)} (none of them was read)")
            missing = [name for name in _REQUIRED if name not in names]
            if missing:
                raise ValueError(f"{path} lacks the tensors {missing}")
            shapes = {}
            for name in names:
                piece = handle.get_slice(name)
                kinds, _, _ = _TENSORS[name]
                if _ST_KINDS.get(piece.get_dtype(), "?") not in kinds:
                    raise ValueError(f"{path}: tensor {name} has dtype {piece.get_dtype()}; expected "
                                     f"{'floating point' if kinds == 'f' else 'integer'}")
                shapes[name] = tuple(int(n) for n in piece.get_shape())
            nnz = shapes["prior_values"][0] if len(shapes["prior_values"]) == 1 else -1
            sizes = {"L": L, "E": E, "V": V, "VL+1": V * L + 1, "N": nnz}
            if not 0 <= nnz <= V * L * E:
                raise ValueError(f"{path}: prior_values has shape {shapes['prior_values']}; expected at most "
                                 f"V x L x E = {V * L * E} entries")
            for name, shape in shapes.items():
                want = tuple(sizes[d] for d in _TENSORS[name][2])
                if shape != want:
                    raise ValueError(f"{path}: tensor {name} has shape {shape}; the header ({L} layers, {E} experts, "
                                     f"vocabulary {V}) implies {want}")
            tensors = {name: handle.get_tensor(name) for name in names}
        user = user_metadata(meta.get("user"), path)
        converted = {}
        for name, array in tensors.items():
            target = _TENSORS[name][1]
            if np.issubdtype(array.dtype, np.integer) and array.size:
                info = np.iinfo(target)
                if array.min() < info.min or array.max() > info.max:
                    raise ValueError(f"{path}: tensor {name} holds values outside {np.dtype(target).name}")
            converted[name] = array.astype(target)
        return cls(
            delta=converted["delta"],
            expert_counts=converted["expert_counts"],
            prior_indptr=converted["prior_indptr"],
            prior_experts=converted["prior_experts"],
            prior_values=converted["prior_values"],
            token_counts=converted.get("token_counts"),
            metadata={str(k): str(v) for k, v in user.items()},
        )

    def __repr__(self) -> str:
        prior = (f"token prior over {self.vocab_size} ids ({self.prior_values.size} entries)" if self.vocab_size
                 else "no token prior")
        top_k = f", top_k={self.top_k}" if self.top_k is not None else ""
        return (f"Calibration({self.num_layers} MoE layers x {self.num_experts} experts{top_k}, {prior}, "
                f"delta mean {float(self.delta.mean()) if self.delta.size else 0.0:.3g})")


class CalibrationBuilder:
    """Accumulates router outputs into a :class:`Calibration` without ever holding a dense ``[V, L, E]`` prior.

    ``add(tokens [N], selected [N, L, K], score_range [N, L])`` takes the router's own top-K per position and
    layer and ``max z - min z`` over finite scores; call it per batch (padding already removed), then ``build()``.
    """

    def __init__(self, num_layers: int, num_experts: int, vocab_size: int, top_k: int):
        self.num_layers, self.num_experts, self.vocab_size, self.top_k = num_layers, num_experts, vocab_size, top_k
        self.expert_counts = np.zeros((num_layers, num_experts), dtype=np.float64)
        self.token_counts = np.zeros(vocab_size, dtype=np.int64)
        self.range_sum = np.zeros(num_layers, dtype=np.float64)
        self.range_count = np.zeros(num_layers, dtype=np.int64)
        self._keys: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []
        self._pending = 0

    def add(self, tokens: Any, selected: Any, score_range: Any) -> None:
        L, E, K = self.num_layers, self.num_experts, self.top_k
        tokens = _as_array("tokens", tokens, np.int64, 1)
        selected = _as_array("selected", selected, np.int64, 3)
        score_range = _as_array("score_range", score_range, np.float64, 2)
        N = tokens.shape[0]
        if selected.shape != (N, L, K):
            raise ValueError(f"selected has shape {selected.shape}; expected ({N}, {L}, {K})")
        if score_range.shape != (N, L):
            raise ValueError(f"score_range has shape {score_range.shape}; expected ({N}, {L})")
        if N and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        if N and (selected.min() < 0 or selected.max() >= E):
            raise ValueError(f"selected expert ids must lie in [0, {E})")
        np.add.at(self.token_counts, tokens, 1)
        np.add.at(self.expert_counts, (np.broadcast_to(np.arange(L)[None, :, None], selected.shape), selected), 1.0)
        finite = np.isfinite(score_range)
        self.range_sum += np.where(finite, score_range, 0.0).sum(axis=0)
        self.range_count += finite.sum(axis=0)
        keys = ((tokens[:, None, None] * L + np.arange(L)[None, :, None]) * E + selected).ravel()
        uniq, counts = np.unique(keys, return_counts=True)
        self._keys.append(uniq)
        self._counts.append(counts)
        self._pending += uniq.size
        if self._pending > 4_000_000:  # keep memory bounded on long calibration runs
            self._compact()

    def _compact(self) -> None:
        if len(self._keys) <= 1:
            return
        keys = np.concatenate(self._keys)
        counts = np.concatenate(self._counts)
        uniq, inverse = np.unique(keys, return_inverse=True)
        self._keys = [uniq]
        self._counts = [np.bincount(inverse, weights=counts).astype(np.int64)]
        self._pending = uniq.size

    def build(self, metadata: Mapping[str, str] | None = None) -> Calibration:
        self._compact()
        L, E = self.num_layers, self.num_experts
        if self.token_counts.sum() == 0:
            raise ValueError("no calibration tokens were added")
        keys = self._keys[0] if self._keys else np.zeros(0, dtype=np.int64)
        counts = self._counts[0] if self._counts else np.zeros(0, dtype=np.int64)
        rows, experts = np.divmod(keys, E)
        tokens = rows // L
        values = (counts / self.token_counts[tokens]).astype(np.float32)
        indptr = np.zeros(self.vocab_size * L + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=self.vocab_size * L), out=indptr[1:])
        delta = np.where(self.range_count > 0, self.range_sum / np.maximum(self.range_count, 1), 0.0)
        meta = {"top_k": str(self.top_k), **dict(metadata or {})}
        return Calibration(delta, self.expert_counts.copy(), indptr, experts.astype(np.uint16), values,
                           self.token_counts.copy(), meta)
