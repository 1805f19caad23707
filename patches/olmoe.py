"""OLMoE (``OlmoeForCausalLM``): softmax router over 64 experts, top-8, ``norm_topk_prob`` from the config."""

from __future__ import annotations

from . import register_patch
from .base import ArchitecturePatch


@register_patch("olmoe")
class OlmoePatch(ArchitecturePatch):
    model_types = ("olmoe",)
    default_window = 8  # the paper's pre-gate window for OLMoE
