"""The engine room: the fast batch-1 decoder of ARCHITECTURE.md (rank 4), built from a loaded transformers model
whose weights it uses in place. ``compile(model)`` makes a patched model's batch-1 ``generate()`` run it
(:mod:`psr_hf.engine.generate`); on CUDA it replays CUDA graphs (:mod:`psr_hf.engine.graphs`, measured on an
H200 in docs/engine.md), on the CPU it runs the same step eagerly.

A decode step is meant to be replayed as CUDA graphs, two per MoE layer: graph A (input norm, attention over a
static KV cache, post-attention norm, this layer's router logits and the next layer's pre-gate from one matmul)
and graph B (the MoE over expert slots, plus the residual). Between them the host runs the routing policy through
the same ``Controller`` / ``LogicalCache`` / ``SlotScheduler`` as every other caller; the engine re-implements no
routing rule.

:mod:`psr_hf.engine.layers` holds the per-layer building blocks of graph A, the dense MLP, shared experts and
final norm + lm_head (written so that they can be captured: static shapes, the position as a device tensor,
outputs into preallocated buffers), the static KV cache and the eager reference decode step with exact routing;
:mod:`psr_hf.engine.moe` the MoE over expert slots of graph B. Importing this package imports nothing heavy (no
torch); the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "build_layers": "psr_hf.engine.layers",
    "DecodeLayers": "psr_hf.engine.layers",
    "OlmoeLayers": "psr_hf.engine.layers",
    "DeepseekV3Layers": "psr_hf.engine.layers",
    "DecodeBuffers": "psr_hf.engine.layers",
    "StaticKVCache": "psr_hf.engine.layers",
    "moe_slots": "psr_hf.engine.moe",
    "moe_slots_reference": "psr_hf.engine.moe",
    "moe_slots_triton": "psr_hf.engine.moe",
    "check_shapes": "psr_hf.engine.moe",
    "Decoder": "psr_hf.engine.decoder",
    "GraphDecoder": "psr_hf.engine.graphs",
    "compile": "psr_hf.engine.generate",
    "uncompile": "psr_hf.engine.generate",
    "compiled": "psr_hf.engine.generate",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psr_hf.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
