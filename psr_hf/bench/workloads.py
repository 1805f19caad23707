"""Workloads of the benchmarks: the models they load (:mod:`psr_hf.assets.loading`), the text they decode
(:mod:`psr_hf.assets.texts`), the calibration they route with (:mod:`psr_hf.eval.calibration`), named here for the
benchmarks, and the seeded random prompts of the ``generate()`` benchmarks (:func:`prompt_ids`)."""

from __future__ import annotations

import torch

from ..assets.loading import (BUILT_MODELS, GROWN, GROWN_OLMOE, OLMOE_1B_7B, RANDOM_OLMOE, TINY, TINY_MOE,
                              TINY_SHAPE, build_random_model, byte_tokenizer, load_model, olmoe_1b_7b_config,
                              router_weight_std)
from ..assets.texts import CALIBRATION_MODULES, WINDOW_MODULES, default_texts, module_sources, text_windows
from ..eval.calibration import model_calibration

__all__ = [
    "BUILT_MODELS", "CALIBRATION_MODULES", "GROWN", "GROWN_OLMOE", "OLMOE_1B_7B", "RANDOM_OLMOE", "TINY", "TINY_MOE",
    "TINY_SHAPE", "WINDOW_MODULES", "build_random_model", "byte_tokenizer", "default_texts", "load_model",
    "model_calibration", "module_sources", "olmoe_1b_7b_config", "prompt_ids", "router_weight_std", "text_windows",
]


def prompt_ids(vocab_size: int, prompt_tokens: int, seed: int) -> torch.Tensor:
    """``[1, prompt_tokens]`` token ids drawn uniformly from ``[0, vocab_size)`` by a CPU generator seeded ``seed``."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens} must be >= 1")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, prompt_tokens), generator=generator)
