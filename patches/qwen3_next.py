"""Qwen3-Next (``Qwen3NextForCausalLM``): softmax router, ``norm_topk_prob`` from the config; layers listed in
``mlp_only_layers`` or off the ``decoder_sparse_step`` grid are dense and skipped; shared expert untouched."""

from __future__ import annotations

from . import register_patch
from .base import ArchitecturePatch


@register_patch("qwen3_next")
class Qwen3NextPatch(ArchitecturePatch):
    default_window = 4
    # hybrid attention (linear attention, full attention every second layer), a shared expert, and a dense
    # layer listed in mlp_only_layers between MoE layers
    tiny = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, full_attention_interval=2,
    )
