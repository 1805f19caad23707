"""The *selfgen* diagnostic's text (the paper's Section 6.1, "Diagnostic"): windows sampled from the exact-routing
model at temperature 1. Because the text comes from the exact model, a configuration's excess NLL on it
(:func:`psr_hf.eval.divergence.divergence`) estimates its KL divergence from exact routing; ``sg%`` is the excess
perplexity ``100 * (exp(excess) - 1)`` (:func:`~psr_hf.eval.divergence.excess_ppl_percent`).

Sampling is plain ancestral sampling (no top-k, no top-p) with a seeded CPU generator per window: the logits of
each step are moved to the CPU in float64, divided by the temperature and sampled with ``torch.multinomial``. The
same seed on the same model and device gives the same windows; records store the token ids, so a diagnostic is
reproduced from its record, never by sampling again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from .._progress import tqdm

logger = logging.getLogger(__name__)


def start_tokens(model: torch.nn.Module, fallback: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The prompt of each sampled window: the model's beginning-of-sequence token (else its end-of-sequence token,
    which the shipped models put between documents), one per fallback window; where the model has neither, the
    first token of each ``fallback`` window (held-out text)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    token = getattr(config, "bos_token_id", None)
    if token is None:
        token = getattr(config, "eos_token_id", None)
    if isinstance(token, (list, tuple)):
        token = token[0] if token else None
    if token is not None:
        return [torch.tensor([int(token)]) for _ in fallback]
    return [torch.as_tensor(w).reshape(-1)[:1].clone() for w in fallback]


@torch.no_grad()
def sample_windows(model: torch.nn.Module, prompts: Sequence[torch.Tensor], *, tokens: int, seed: int = 0,
                   temperature: float = 1.0, progress: bool = False) -> list[torch.Tensor]:
    """``[1, len(prompt) + tokens]`` token ids per prompt: the prompt, then ``tokens`` tokens sampled from
    ``model`` (unpatched: exact routing) at ``temperature``; window ``i`` uses a CPU generator seeded with
    ``seed + i``. The model's KV cache carries the context (one forward per sampled token)."""
    if getattr(model, "_psr_hf_controller", None) is not None:
        raise ValueError("sample_windows needs the unpatched model: the selfgen text comes from exact routing")
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: sample at least one token per window")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (1.0 is the diagnostic's)")
    if not prompts:
        raise ValueError("no prompts: give one prompt (token ids) per window")
    from transformers import DynamicCache

    from ..hf.inputs import cache_keyword

    keyword = cache_keyword(model)
    device = next(model.parameters()).device
    model.eval()
    out = []
    bar = tqdm(total=len(prompts) * tokens, unit="tok", desc="selfgen sampling", disable=not progress)
    try:
        for i, prompt in enumerate(prompts):
            ids = torch.as_tensor(prompt).reshape(1, -1).to(device)
            if ids.shape[1] < 1:
                raise ValueError(f"prompt {i} is empty")
            generator = torch.Generator().manual_seed(seed + i)
            cache = {keyword: DynamicCache(config=model.config)}  # filled in place, one forward per token
            result = model(input_ids=ids, use_cache=True, **cache)
            sampled = []
            for _ in range(tokens):
                logits = result.logits[0, -1].detach().to("cpu", torch.float64) / temperature
                token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
                sampled.append(int(token))
                result = model(input_ids=token.reshape(1, 1).to(device), use_cache=True, **cache)
                bar.update(1)
            out.append(torch.cat([ids.cpu(), torch.tensor([sampled])], dim=1))
    finally:
        bar.close()
    logger.info("selfgen: %d windows of %d sampled tokens (seed %d, temperature %g)", len(out), tokens, seed,
                temperature)
    return out


def describe(windows: Sequence[torch.Tensor], *, prompts: Sequence[torch.Tensor], seed: int, temperature: float,
             tokens: int) -> dict[str, Any]:
    """The record of sampled windows: the token ids and how they were drawn."""
    return {"seed": seed, "temperature": temperature, "tokens": tokens,
            "prompt_tokens": [int(torch.as_tensor(p).numel()) for p in prompts],
            "ids": [w.reshape(-1).tolist() for w in windows],
            "how": "ancestral sampling from the unpatched (exact-routing) model, float64 softmax of the last logits "
                   "on the CPU, torch.multinomial with a CPU generator seeded seed + window index"}
