"""Qwen3-Next's grow mapping (``Qwen3NextForCausalLM``) and its preset :data:`QWEN3_NEXT_80B_A3B`.

Qwen3.5/3.6-MoE's mapping (:mod:`.qwen3_5_moe`: the head dimensions kept, the residual stream scaled, grouped heads
repeated, gated attention, zero-centred norms, the gated shared expert) with the Gated DeltaNet's input
projections fused per key head, as transformers lays them out: ``in_proj_qkvz`` holds, for each key head, its
query and key rows, then the values of its value heads, then their output gates; ``in_proj_ba`` holds, for each
key head, its value heads' ``b`` rows, then their ``a`` rows. Where the target groups fewer value heads per key
head, each big key head takes its small key head's query and key and its share of that head's value heads, so
that small value head ``v`` is still big value head ``v``. Dense MLP layers (``mlp_only_layers``,
``decoder_sparse_step``) keep their intermediate size. The preset's dimensions are transformers'
``Qwen3NextConfig`` defaults, which are Qwen3-Next-80B-A3B's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import register_grow
from .base import Dims, Filler, GrowTarget
from .qwen3_5_moe import Qwen35MoeGrow

if TYPE_CHECKING:
    import torch


@register_grow("qwen3_next")
class Qwen3NextGrow(Qwen35MoeGrow, model_name="Qwen3-Next-80B-A3B", rotary="head_dim", listing_order=4):
    """Qwen3-Next: Qwen3.5/3.6-MoE's mapping with the fused Gated DeltaNet projections."""

    target_label, heads_label = "Qwen3-Next", "Qwen3-Next"

    def _input_projections(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims, keys: torch.Tensor,
                           qkv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The fused ``in_proj_qkvz`` and ``in_proj_ba``, key head by key head (their rows do not follow the
        convolution's channels ``qkv``, which the caller maps)."""
        import torch

        Dk, Dv = s.linear_k_dim, s.linear_v_dim
        rs, rb = s.linear_v_heads // s.linear_k_heads, b.linear_v_heads // b.linear_k_heads
        qkvz_from, qkvz_to, ba_from, ba_to = [], [], [], []
        for j_big, j in enumerate(keys.tolist()):
            part = j_big % (rs // rb)  # which rb of small key head j's rs value heads this big key head takes
            src, dst = j * (2 * Dk + 2 * rs * Dv), j_big * (2 * Dk + 2 * rb * Dv)  # the key heads' row blocks
            share = part * rb * Dv + torch.arange(rb * Dv)
            qkvz_from += [src + torch.arange(2 * Dk), src + 2 * Dk + share, src + 2 * Dk + rs * Dv + share]
            qkvz_to += [dst + torch.arange(2 * Dk), dst + 2 * Dk + torch.arange(rb * Dv),
                        dst + 2 * Dk + rb * Dv + torch.arange(rb * Dv)]
            heads = part * rb + torch.arange(rb)
            ba_from += [j * 2 * rs + heads, j * 2 * rs + rs + heads]
            ba_to += [j_big * 2 * rb + torch.arange(rb), j_big * 2 * rb + rb + torch.arange(rb)]
        fill.linear(big.in_proj_qkvz, small.in_proj_qkvz, (torch.cat(qkvz_from), torch.cat(qkvz_to)), None)
        fill.linear(big.in_proj_ba, small.in_proj_ba, (torch.cat(ba_from), torch.cat(ba_to)), None)


#: Qwen3-Next-80B-A3B's dimensions: transformers' ``Qwen3NextConfig`` defaults (48 layers, 512 experts of 512,
#: top-10, three Gated DeltaNet layers to one gated attention layer; layers, experts and vocabulary are the grown
#: model's own, as for every family)
QWEN3_NEXT_80B_A3B = Qwen3NextGrow.preset = GrowTarget(
    name="qwen3-next-80b-a3b", family="qwen3_next", hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, expert_intermediate_size=512, shared_expert_intermediate_size=512,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
)
