"""OLMoE (``OlmoeForCausalLM``): softmax router over 64 experts, top-8, ``norm_topk_prob`` from the config."""

from __future__ import annotations

from . import register_patch
from .base import ArchitecturePatch


@register_patch("olmoe")
class OlmoePatch(ArchitecturePatch):
    default_window = 8  # the paper's pre-gate window for OLMoE
    # OLMoE-1B-7B's routing (softmax, no renormalisation over the top-K) at hidden size 64
    tiny = dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
    )
