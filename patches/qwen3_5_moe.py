"""Qwen3.5 / Qwen3.6 MoE (35B-A3B): the text model (``Qwen3_5MoeForCausalLM``) and the composite
``Qwen3_5MoeForConditionalGeneration``. Softmax router renormalised over the selected experts; the shared expert
and its sigmoid gate run unchanged."""

from __future__ import annotations

from typing import Any

from torch import nn

from . import register_patch
from .base import TINY_SPECIAL_TOKENS, ArchitecturePatch

COMPOSITE = "qwen3_5_moe"  # the image-text model; "qwen3_5_moe_text" is its language model alone


@register_patch("qwen3_5_moe", "qwen3_5_moe_text")
class Qwen35MoePatch(ArchitecturePatch):
    default_window = 4
    normalize = True  # Qwen3_5MoeTopKRouter always renormalises the gathered probabilities
    # the text model's fields (hybrid attention, gated shared expert); the composite model nests them
    tiny = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=16, num_experts_per_tok=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
    )

    @classmethod
    def tiny_config(cls, model_type: str, **overrides: Any) -> Any:
        """The text config for ``"qwen3_5_moe_text"``; for ``"qwen3_5_moe"`` the composite config with a one-block
        vision tower, ``overrides`` replacing fields of its text config."""
        if model_type != COMPOSITE:
            return super().tiny_config(model_type, **overrides)
        from transformers import Qwen3_5MoeConfig

        return Qwen3_5MoeConfig(
            text_config={**TINY_SPECIAL_TOKENS, **cls.tiny, **overrides},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
            tie_word_embeddings=False, **TINY_SPECIAL_TOKENS,
        )

    @classmethod
    def build_tiny(cls, config: Any) -> nn.Module:
        """The composite image-text class for the composite config, the causal LM for the text config."""
        if config.model_type != COMPOSITE:
            return super().build_tiny(config)
        from transformers import Qwen3_5MoeForConditionalGeneration

        return Qwen3_5MoeForConditionalGeneration(config)
