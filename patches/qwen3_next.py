"""Qwen3-Next (``Qwen3NextForCausalLM``): softmax router, ``norm_topk_prob`` from the config; layers listed in
``mlp_only_layers`` or off the ``decoder_sparse_step`` grid are dense and skipped; shared expert untouched."""

from __future__ import annotations

from . import register_patch
from .base import ArchitecturePatch


@register_patch("qwen3_next")
class Qwen3NextPatch(ArchitecturePatch):
    model_types = ("qwen3_next",)
    default_window = 4
