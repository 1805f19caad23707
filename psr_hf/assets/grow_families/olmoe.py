"""OLMoE's grow mapping (``OlmoeForCausalLM``) and its preset :data:`OLMOE_1B_7B`.

OLMoE's ``q_norm`` / ``k_norm`` span all heads, so the head dimension times the heads is the hidden size and the
norms grow with the heads (each gets its input scale from its own ratio, the key norm's counting the repeated
key/value heads). Grouped-query attention: each small key/value head is repeated ``g / g'`` times (the small
model's query heads per key/value head over the grown model's). The attention scale ``1/sqrt(head_dim)`` shrinks
by ``sqrt(f)`` (``f = d'/d``): the queries get ``sqrt(f)`` through ``q_norm``'s weight; with ``clip_qkv``, q, k
and v each get ``f^(1/4)``, ``o_proj`` the inverse and the clip bound the same factor, so the clamps stay exact.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from . import register_grow
from .base import QWEN_FIELDS, Dims, Filler, GrowFamily, GrowTarget, head_positions, rope_map

# the target fields OLMoE does not have (DeepSeek-V3's)
_NOT_OLMOE = ("dense_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


@register_grow("olmoe")
class OlmoeGrow(GrowFamily, model_name="OLMoE-1B-7B", rotary="head_dim", listing_order=1):
    """OLMoE: q/k-normed grouped-query attention with rotate-half RoPE over the whole head dimension; listed
    first (the paper's first model)."""

    def check_target(self, target: GrowTarget, fail: Callable[[str], None]) -> None:
        extra = [f for f in _NOT_OLMOE if getattr(target, f) is not None]
        if extra:
            fail(f"{', '.join(extra)} are DeepSeek-V3 fields; leave them None for an OLMoE target")
        qwen = [f for f in QWEN_FIELDS if getattr(target, f) is not None]
        if qwen:
            fail(f"{', '.join(qwen)} are Qwen3.5/3.6-MoE fields; leave them None for an OLMoE target")
        if target.head_dim is None:
            fail("head_dim is required for an OLMoE target")
        if target.head_dim * target.num_attention_heads != target.hidden_size:
            fail(f"head_dim={target.head_dim} x num_attention_heads={target.num_attention_heads} must equal "
                 f"hidden_size={target.hidden_size} (OLMoE's q_norm spans the hidden size)")
        if target.head_dim % 2:
            fail(f"head_dim={target.head_dim} must be even (rotary pairs)")

    def dims(self, config: Any) -> Dims:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Dims(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                    config.intermediate_size, head_dim=head_dim)

    def check_model(self, small: Dims) -> None:
        if small.head_dim * small.heads != small.hidden:
            raise ValueError(f"the model's head_dim {small.head_dim} x {small.heads} heads != hidden_size "
                             f"{small.hidden} (OLMoE's q_norm spans the hidden size)")

    def attention(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims, config: Any) -> None:
        import torch

        clip = getattr(config, "clip_qkv", None) is not None
        f = b.head_dim // s.head_dim
        inner = rope_map(s.head_dim, b.head_dim, interleaved=False)
        q_pos = head_positions(s.heads, s.head_dim, b.head_dim, inner)
        # key/value heads: big kv head j holds small kv head j // d (d = repetitions), for j < K_small * d
        d = (s.heads // s.kv_heads) // (b.heads // b.kv_heads)
        kv_src = torch.repeat_interleave(torch.arange(s.kv_heads), d)
        kv_from = (kv_src.view(-1, 1) * s.head_dim + torch.arange(s.head_dim).view(1, -1)).reshape(-1)
        kv_to = head_positions(s.kv_heads * d, s.head_dim, b.head_dim, inner)
        # the attention scale 1/sqrt(head_dim) shrinks by sqrt(f): queries get sqrt(f); with clip_qkv, q, k and v
        # each get f^(1/4) (and o_proj the inverse) so that the clamps, scaled by the same factor, stay exact
        q_scale, kv_scale = (f ** 0.25, f ** 0.25) if clip else (math.sqrt(f), 1.0)
        n_small, n_big = s.heads * s.head_dim, b.heads * b.head_dim
        c_q = fill.norm(big.q_norm, small.q_norm, q_pos, n_big / n_small, q_scale)
        c_k = fill.norm(big.k_norm, small.k_norm, (kv_from, kv_to),
                        (b.kv_heads * b.head_dim) / (d * s.kv_heads * s.head_dim), kv_scale)
        fill.linear(big.q_proj, small.q_proj, q_pos, None, c_q)
        fill.linear(big.k_proj, small.k_proj, (kv_from, kv_to), None, c_k)
        fill.linear(big.v_proj, small.v_proj, (kv_from, kv_to), None, kv_scale)
        fill.linear(big.o_proj, small.o_proj, None, q_pos, col_scale=1.0 / kv_scale)

    def update_config(self, data: dict[str, Any], s: Dims, b: Dims) -> None:
        data["intermediate_size"] = b.expert
        if "head_dim" in data:
            data["head_dim"] = b.head_dim
        if data.get("clip_qkv") is not None:  # scaled with q, k and v
            data["clip_qkv"] = data["clip_qkv"] * (b.head_dim // s.head_dim) ** 0.25


#: allenai/OLMoE-1B-7B's dimensions
OLMOE_1B_7B = OlmoeGrow.preset = GrowTarget(
    name="olmoe-1b-7b", family="olmoe", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
    head_dim=128, expert_intermediate_size=1024,
)
