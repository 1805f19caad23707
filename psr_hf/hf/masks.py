"""Which positions of a forward pass are real tokens, from whatever attention mask transformers hands the model.

The routing state must never see padding, so the controller reads each position's validity from the mask. Users
pass a 2D mask ``[batch, past + length]`` (1: token, 0: padding); transformers itself may pass a prepared one: a
4D mask ``[batch or 1, heads or 1, length, keys]`` (a static cache, compiled generation, custom masks of packed
sequences), or a dict of them per layer type (hybrid models: ``{"full_attention": 4D, "linear_attention": 2D}``).
A 4D mask says position ``i`` is a token when its query attends its own key (a padded query attends nothing, or,
where a backend unmasks fully masked rows, also keys after its own, which no real causal query does). Boolean and
integer masks mark attended keys with nonzero values; floating masks are additive (attended: not a large negative
value), as the attention computes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _unsupported(mask: Any, B: int, S: int) -> ValueError:
    shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    return ValueError(
        f"psr_hf needs an attention_mask that marks padding: 2D [batch, past + length] = [{B}, >= {S}], 4D "
        f"[{B} or 1, heads or 1, {S}, keys] or a dict of them per layer type; got {shape}. Pass the tokenizer's "
        "attention_mask (or none when nothing is padded)"
    )


def _pick(masks: dict, B: int, S: int) -> Any:
    """From a dict per layer type: a 2D mask if one is there (it says the most directly), else a 4D one."""
    tensors = [m for m in masks.values() if isinstance(m, torch.Tensor)]
    for ndim in (2, 4):
        for m in tensors:
            if m.ndim == ndim:
                return m
    if all(m is None for m in masks.values()):
        return None
    raise _unsupported(next(m for m in masks.values() if m is not None), B, S)


def _attended(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > torch.finfo(mask.dtype).min / 2
    return mask != 0


def _from_4d(mask: torch.Tensor, B: int, S: int, keys: torch.Tensor) -> np.ndarray:
    """``[B, S]`` bool: query ``i`` attends its own key ``keys[i]`` and no key after it."""
    if mask.shape[0] not in (1, B) or mask.shape[2] != S:
        raise _unsupported(mask, B, S)
    K = mask.shape[3]
    if int(keys.max()) >= K:
        raise ValueError(f"psr_hf: a 4D attention_mask of {K} keys for positions up to {int(keys.max())}; the mask "
                         "must cover every cached and new position")
    attended = _attended(mask[:, 0].detach()).to("cpu")  # [B or 1, S, K]: the first head (heads share padding)
    own = attended.gather(2, keys.view(1, S, 1).expand(attended.shape[0], S, 1))[..., 0]  # [B or 1, S]
    later = torch.arange(K).view(1, 1, K) > keys.view(1, S, 1)
    beyond = (attended & later).any(dim=2)  # [B or 1, S]: attends a key after its own (an unmasked padded row)
    valid = (own & ~beyond).expand(B, S)
    return valid.numpy()


def valid_positions(mask: Any, B: int, S: int, past: int, positions: Any = None) -> np.ndarray | None:
    """``[B, S]`` uint8 (1: a real token) for a forward pass of ``S`` positions after ``past`` cached ones, or None
    when every position is real. ``positions``: the positions' indices among the keys (transformers'
    ``cache_position``), default ``past, ..., past + S - 1``. A clear ``ValueError`` for a mask it cannot read."""
    if isinstance(mask, dict):
        mask = _pick(mask, B, S)
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise _unsupported(mask, B, S)
    if mask.ndim == 2:
        if mask.shape[0] != B or mask.shape[1] < S:
            raise _unsupported(mask, B, S)
        valid = mask[:, -S:].detach().to("cpu").numpy() != 0
    elif mask.ndim == 4:
        keys = (torch.as_tensor(positions).detach().to("cpu", torch.int64).reshape(-1)[-S:] if positions is not None
                else torch.arange(past, past + S))
        if keys.numel() != S:
            keys = torch.arange(past, past + S)
        valid = _from_4d(mask, B, S, keys)
    else:
        raise _unsupported(mask, B, S)
    return None if valid.all() else valid.astype(np.uint8)
