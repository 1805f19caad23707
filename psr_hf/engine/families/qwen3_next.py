"""Qwen3-Next's engine layers (``Qwen3NextForCausalLM``): Qwen3.5/3.6-MoE's hybrid decoder
(:mod:`.qwen3_5_moe`: Gated DeltaNet and gated full-attention layers in ``config.layer_types``' pattern,
zero-centred RMSNorms, the gated shared expert, the same state layout and batched prefill) with the Gated
DeltaNet's input projections fused per key head (``in_proj_qkvz``, ``in_proj_ba``), and dense MLP layers where
``mlp_only_layers`` or ``decoder_sparse_step`` put them (the base class runs a layer without MoE as a dense MLP).
"""

from __future__ import annotations

from . import register_layers
from .qwen3_5_moe import Qwen35MoeLayers


@register_layers("qwen3_next")
class Qwen3NextLayers(Qwen35MoeLayers):
    """Qwen3-Next: :class:`Qwen35MoeLayers` with the fused Gated DeltaNet projections."""

    listing_order = 4
    fused_projections = True
    projection_names = ("in_proj_qkvz", "in_proj_ba")
    fp8_projection_names = ("in_proj_qkvz", "out_proj")
