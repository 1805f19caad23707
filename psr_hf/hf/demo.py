"""The demo behind ``psr-hf demo`` / ``make demo``: generate under exact and cache-aware routing, count copies.

The model is a seeded random tiny OLMoE with OLMoE-1B-7B's routing shape (64 experts, top-8, softmax,
``norm_topk_prob=False``) over a byte vocabulary, built offline from a config; it is calibrated on text from the
Python standard library. With random weights the continuations are noise; what the demo shows is the routing:
copies per token, replaced router slots and how far the output moves from exact routing.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..policy.config import RoutingConfig
from .calibrate import calibrate
from .patching import controller, patch, unpatch
from .tiny import tiny_model

PROMPTS = (
    "The experts of a mixture-of-experts layer",
    "It is a truth universally acknowledged, that",
    "def fibonacci(n):\n    ",
)

DEMO_SHAPE = dict(
    vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    pad_token_id=0, eos_token_id=None, bos_token_id=None,
)

UNPRINTABLE = [i for i in range(256) if not (32 <= i < 127 or i == 10)]

DEMO_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("exact + LRU", dict(policy="exact", eviction="lru")),
    ("cache_prior lam 0.2", dict(policy="cache_prior", lam=0.2)),
    ("psr lam 0.2 n=1", dict(policy="psr", lam=0.2, budget=1)),
)


@dataclass
class DemoRun:
    name: str
    residency: float
    capacity: int
    texts: list[str]
    tokens: np.ndarray  # [P, new_tokens] generated ids
    stats: dict[str, float] = field(default_factory=dict)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Any) -> str:
    raw = bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() or c in "\n" else "\N{REPLACEMENT CHARACTER}" for c in raw)


def calibration_text() -> str:
    """Held-out text for the demo's calibration: sources of a few standard-library modules (always offline)."""
    return "\n".join(inspect.getsource(module) for module in (textwrap, json.decoder, json.encoder))


def build_demo_model(seed: int = 0) -> torch.nn.Module:
    return tiny_model("olmoe", seed=seed, **DEMO_SHAPE)


def left_padded(prompts: tuple[str, ...] | list[str], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[P, S]`` of byte-encoded prompts, left-padded."""
    encoded = [encode(p) for p in prompts]
    S = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), S), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), S), dtype=torch.long)
    for row, e in enumerate(encoded):
        ids[row, S - len(e):] = torch.tensor(e)
        mask[row, S - len(e):] = 1
    return ids, mask


@torch.no_grad()
def run_demo(*, new_tokens: int = 32, residencies: tuple[float, ...] = (0.5, 0.25), seed: int = 0,
             prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """Generate from ``prompts`` (one left-padded batch) under each demo configuration and residency."""
    model = build_demo_model(seed)
    calibration = calibrate(model, [encode(calibration_text())], max_length=256, batch_size=8, progress=False)
    ids, mask = left_padded(prompts)
    runs: list[DemoRun] = []
    for residency in residencies:
        for name, fields in DEMO_CONFIGS:
            config = RoutingConfig(residency=residency, **fields)
            patch(model, config, calibration=calibration)
            try:
                # printable ASCII only, so the (random) continuations can be shown; routing is unaffected
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     suppress_tokens=UNPRINTABLE)
                stats = controller(model).stats().total
                capacity = controller(model).capacity
            finally:
                unpatch(model)
            generated = out[:, ids.shape[1]:].numpy()
            runs.append(DemoRun(name, residency, capacity, [decode(g) for g in generated], generated, stats))
    exact = {run.residency: run.tokens for run in runs if run.name.startswith("exact")}
    for run in runs:
        run.stats["same_tokens_as_exact"] = float(np.mean(run.tokens == exact[run.residency]))
    return {
        "model": "tiny OLMoE, random weights (seeded), 4 MoE layers x 64 experts, top-8, byte vocabulary",
        "prompts": list(prompts),
        "new_tokens": new_tokens,
        "calibration_tokens": int(calibration.expert_counts[0].sum() // 8),
        "runs": runs,
    }
