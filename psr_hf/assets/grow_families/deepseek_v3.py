"""DeepSeek-V3's grow mapping (``DeepseekV3ForCausalLM``, Moonlight) and its preset :data:`MOONLIGHT_16B_A3B`.

Multi-head latent attention: the nope, rope and v dimensions keep their positions within each head and the latent
ranks (``kv_lora_rank``, ``q_lora_rank``) their positions in the latent; the rope part follows the rotary map (the
interleaved layout where ``rope_interleave``). ``kv_a_layernorm`` and ``q_a_layernorm`` get their input scales from
their own ratios and epsilons (transformers fixes theirs at 1e-6, not the config's). The attention scale
``qk_head_dim^-0.5`` (times YaRN's ``mscale``, which does not depend on the dimensions) shrinks by
``sqrt(qk'/qk)``: the queries get it in their projection. A model without a query LoRA cannot gain one exactly
(the norm inside it is not linear), nor the other way round; ``e_score_correction_bias`` is copied by ``grow``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from . import register_grow
from .base import QWEN_FIELDS, Dims, Filler, GrowFamily, GrowTarget, head_positions, rope_map

# the target fields of multi-head latent attention that a DeepSeek-V3 target must have
_MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@register_grow("deepseek_v3")
class DeepseekV3Grow(GrowFamily, model_name="Moonlight-16B-A3B", rotary="rope", listing_order=2):
    """DeepSeek-V3: multi-head latent attention, dense first layers and shared experts; listed second (the
    paper's second model)."""

    def check_target(self, target: GrowTarget, fail: Callable[[str], None]) -> None:
        missing = [f for f in ("dense_intermediate_size", *_MLA) if getattr(target, f) is None]
        if missing:
            fail(f"{', '.join(missing)} required for a DeepSeek-V3 target")
        qwen = [f for f in QWEN_FIELDS if getattr(target, f) is not None]
        if qwen:
            fail(f"{', '.join(qwen)} are Qwen3.5/3.6-MoE fields; leave them None for a DeepSeek-V3 target")
        if target.head_dim is not None:
            fail("head_dim is OLMoE's; a DeepSeek-V3 target has qk_nope_head_dim, qk_rope_head_dim and "
                 "v_head_dim instead (leave head_dim None)")
        if target.num_key_value_heads != target.num_attention_heads:
            fail(f"num_key_value_heads={target.num_key_value_heads} must equal num_attention_heads="
                 f"{target.num_attention_heads} (multi-head latent attention expands keys per query head)")
        if target.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim={target.qk_rope_head_dim} must be even (rotary pairs)")

    def dims(self, config: Any) -> Dims:
        return Dims(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                    config.moe_intermediate_size, dense=config.intermediate_size, kv_lora=config.kv_lora_rank,
                    q_lora=config.q_lora_rank, nope=config.qk_nope_head_dim, rope=config.qk_rope_head_dim,
                    v=config.v_head_dim)

    def check_model(self, small: Dims) -> None:
        if small.kv_heads != small.heads:
            raise ValueError(f"the model has num_key_value_heads={small.kv_heads} != num_attention_heads="
                             f"{small.heads}, which DeepSeek-V3's attention does not support")

    def attention(self, fill: Filler, big: Any, small: Any, s: Dims, b: Dims, config: Any) -> None:
        import torch

        rope = rope_map(s.rope, b.rope, bool(getattr(config, "rope_interleave", False)))
        qk_small, qk_big = s.nope + s.rope, b.nope + b.rope
        # query rows per head: nope dims keep their place, rope dims follow the rotary map; the attention scale
        # qk_head_dim^-0.5 (times YaRN's mscale^2, which does not depend on the dims) shrinks by sqrt(qk_big/qk_small)
        q_rows = torch.cat((torch.arange(s.nope), b.nope + rope))
        q_rows = head_positions(s.heads, qk_small, qk_big, q_rows)
        q_scale = math.sqrt(qk_big / qk_small)
        if s.q_lora is None:
            fill.linear(big.q_proj, small.q_proj, q_rows, None, q_scale)
        else:
            c = fill.norm(big.q_a_layernorm, small.q_a_layernorm, None, b.q_lora / s.q_lora)
            fill.linear(big.q_a_proj, small.q_a_proj, None, None, c)
            fill.linear(big.q_b_proj, small.q_b_proj, q_rows, None, q_scale)
        # the latent: kv_lora_rank dims (through kv_a_layernorm), then the shared rotary key
        c_kv = fill.norm(big.kv_a_layernorm, small.kv_a_layernorm, None, b.kv_lora / s.kv_lora)
        kv_a_rows = torch.cat((torch.arange(s.kv_lora), b.kv_lora + rope))
        kv_a_scale = torch.cat((torch.full((s.kv_lora,), c_kv), torch.ones(s.rope)))
        fill.linear(big.kv_a_proj_with_mqa, small.kv_a_proj_with_mqa, kv_a_rows, None, kv_a_scale)
        kv_b_rows = head_positions(s.heads, s.nope + s.v, b.nope + b.v,
                                   torch.cat((torch.arange(s.nope), b.nope + torch.arange(s.v))))
        fill.linear(big.kv_b_proj, small.kv_b_proj, kv_b_rows, None)
        fill.linear(big.o_proj, small.o_proj, None, head_positions(s.heads, s.v, b.v))

    def update_config(self, data: dict[str, Any], s: Dims, b: Dims) -> None:
        data.update(moe_intermediate_size=b.expert, intermediate_size=b.dense, kv_lora_rank=b.kv_lora,
                    q_lora_rank=b.q_lora, qk_nope_head_dim=b.nope, qk_rope_head_dim=b.rope, v_head_dim=b.v,
                    head_dim=b.rope, qk_head_dim=b.nope + b.rope)  # the derived fields too: from_dict keeps them


#: moonshotai/Moonlight-16B-A3B's dimensions (no query LoRA)
MOONLIGHT_16B_A3B = DeepseekV3Grow.preset = GrowTarget(
    name="moonlight-16b-a3b", family="deepseek_v3", hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=16, expert_intermediate_size=1408, dense_intermediate_size=11264, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
