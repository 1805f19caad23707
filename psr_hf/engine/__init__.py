"""The engine room: the fast batch-1 decoder of ARCHITECTURE.md (rank 4), built from a loaded transformers model
whose weights it uses in place. ``attach(model)`` makes a patched model's batch-1 ``generate()`` run it
(:mod:`psr_hf.engine.generate`); on CUDA it replays CUDA graphs (:mod:`psr_hf.engine.graphs`), on the CPU it
runs the same step eagerly (:mod:`psr_hf.engine.decoder`). Page: docs/engine.md.

Per MoE layer a step is graph A (norms, attention over a static KV cache, this layer's router logits and the
next layer's pre-gate from one matmul) and graph B (the MoE over expert slots, :mod:`psr_hf.engine.moe`, plus
the residual); between them the host routes through the same ``Controller`` as every other caller. The layers'
functions: :mod:`psr_hf.engine.layers` (what every family shares), :mod:`psr_hf.engine.attention` (RoPE, norms,
the static KV cache) and one module per family in :mod:`psr_hf.engine.families`. Importing this package imports
nothing heavy (no torch); the names below load on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "build_layers": "psr_hf.engine.families",
    "EngineFamily": "psr_hf.engine.families",
    "DecodeLayers": "psr_hf.engine.layers",
    "DecodeBuffers": "psr_hf.engine.layers",
    "StaticKVCache": "psr_hf.engine.attention",
    "register_layers": "psr_hf.engine.families",
    "supported_model_types": "psr_hf.engine.families",
    "moe_slots": "psr_hf.engine.moe",
    "moe_slots_reference": "psr_hf.engine.moe",
    "moe_slots_triton": "psr_hf.engine.moe",
    "check_shapes": "psr_hf.engine.moe",
    "Decoder": "psr_hf.engine.decoder",
    "GraphDecoder": "psr_hf.engine.graphs",
    "TokenGraphDecoder": "psr_hf.engine.token_graph",
    "graph_decoder": "psr_hf.engine.token_graph",
    "attach": "psr_hf.engine.generate",
    "detach": "psr_hf.engine.generate",
    "attached": "psr_hf.engine.generate",
    "SpeculativeEngine": "psr_hf.engine.speculative",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=())
