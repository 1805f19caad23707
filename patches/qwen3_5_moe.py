"""Qwen3.5 / Qwen3.6 MoE (35B-A3B): the text model (``Qwen3_5MoeForCausalLM``) and the composite
``Qwen3_5MoeForConditionalGeneration``. Softmax router renormalised over the selected experts; the shared expert
and its sigmoid gate run unchanged."""

from __future__ import annotations

from . import register_patch
from .base import ArchitecturePatch


@register_patch("qwen3_5_moe", "qwen3_5_moe_text")
class Qwen35MoePatch(ArchitecturePatch):
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    default_window = 4
    normalize = True  # Qwen3_5MoeTopKRouter always renormalises the gathered probabilities
