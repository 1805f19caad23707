"""The Recorder: a patched model's routing trace, per row, for :func:`psr_hf.policy.replay`.

``with psr_hf.controller(model).record() as rec: model.generate(...)`` keeps, for every MoE layer of every real
position, the selection scores, the pre-gate used, the token id and the selected experts (docs/transformers.md).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..policy.replaying import Recording


class Recorder:
    """Captures, per row, the selection scores, pre-gates, token ids and selected experts of every MoE layer.

    Use as a context manager (``with psr_hf.controller(model).record() as rec: model.generate(...)``) or call
    :meth:`stop`. ``rec.recordings`` then holds one :class:`~psr_hf.policy.Recording` per (sequence, row) with only
    the real positions; ``psr_hf.policy.replay(config, recording, calibration=...)`` reproduces its ``selected``.
    Made by :meth:`Controller.record`, which feeds it through the methods below.
    """

    def __init__(self, *, num_layers: int, top_k: int, default_window: int,
                 on_stop: Callable[["Recorder"], None] | None = None):
        self.num_layers, self.top_k, self.default_window = num_layers, top_k, default_window
        self._on_stop = on_stop  # tells the controller to stop feeding this recorder
        self.recordings: list[Recording] = []
        self._chunks: list[tuple[np.ndarray, ...]] = []  # per forward: z [B,S,L,E], g, selected [B,S,L,K], tokens, valid
        self._layers: dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray]] = {}
        self._sequence = 0
        self.active = True

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> list[Recording]:
        """Stop recording; returns :attr:`recordings` (the open sequence is closed)."""
        if self.active:
            self.close_sequence()
            self.active = False
            if self._on_stop is not None:
                self._on_stop(self)
        return self.recordings

    # ------------------------------------------------------------------ fed by the controller
    def add_layer(self, layer: int, z: np.ndarray, g: np.ndarray | None, selected: np.ndarray) -> None:
        """One MoE layer of the open forward pass: scores ``z`` and pre-gate ``g`` ``[B, S, E]`` (None: none),
        selected experts ``[B, S, K]``."""
        self._layers[layer] = (np.array(z, dtype=np.float32), None if g is None else np.array(g, dtype=np.float32),
                               np.array(selected))

    def end_forward(self, tokens: np.ndarray, valid: np.ndarray | None) -> None:
        """The forward pass of ``tokens`` ``[B, S]`` (``valid``: its real positions, None: all) ended: keep its
        layers, unless it did not reach every MoE layer."""
        if len(self._layers) != self.num_layers:  # the forward did not reach every MoE layer (an error)
            self._layers.clear()
            return
        L = self.num_layers
        z = np.stack([self._layers[layer][0] for layer in range(L)], axis=2)  # [B, S, L, E]
        g = np.zeros_like(z)
        for layer in range(L):
            if self._layers[layer][1] is not None:
                g[:, :, layer] = self._layers[layer][1]
        selected = np.stack([self._layers[layer][2] for layer in range(L)], axis=2)  # [B, S, L, K]
        valid = np.ones(tokens.shape, dtype=bool) if valid is None else valid.astype(bool)
        self._chunks.append((z, g, selected, tokens.copy(), valid))
        self._layers.clear()

    def drop_forward(self) -> None:
        """The open forward pass stopped part-way: its layers are not recorded."""
        self._layers.clear()

    def drop_sequence(self) -> None:
        """Forget the current sequence's forward passes (it is run again from its start)."""
        self._chunks = []

    def reorder(self, index: np.ndarray) -> None:
        """Reorder the rows like the KV cache: new row ``i`` continues old row ``index[i]``."""
        self._chunks = [tuple(a[index] for a in chunk) for chunk in self._chunks]

    def close_sequence(self) -> None:
        """The sequence ended: one :class:`~psr_hf.policy.Recording` per row, of its real positions."""
        if not self._chunks:
            return
        z, g, selected, tokens, valid = (np.concatenate(parts, axis=1) for parts in zip(*self._chunks))
        for row in range(z.shape[0]):
            keep = valid[row]
            self.recordings.append(Recording(
                scores=np.ascontiguousarray(z[row, keep]),
                pregate=np.ascontiguousarray(g[row, keep]),
                tokens=np.ascontiguousarray(tokens[row, keep], dtype=np.int64),
                selected=np.sort(selected[row, keep], axis=-1).astype(np.int64),
                top_k=self.top_k,
                default_window=self.default_window,
                sequence=self._sequence,
                row=row,
            ))
        self._chunks = []
        self._sequence += 1
