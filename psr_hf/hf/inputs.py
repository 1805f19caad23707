"""What a call of a patched model was given: token ids, real positions, the KV cache and its length, and
``generate()``'s stop tokens and prompt length, read from transformers' arguments (docs/transformers.md).

:class:`ForwardPass` is what the controller keeps of the forward pass it has open.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import numpy as np
import torch

from .masks import valid_positions

CACHE_KWARGS = ("past_key_values", "cache")  # transformers 5.17 / 5.23+ names of the KV cache argument


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of ``model.forward``'s KV cache argument: ``cache`` from transformers 5.23 (``past_key_values``
    is deprecated there), ``past_key_values`` before (5.17 knows only that)."""
    return _forward_cache_keyword(type(model))


@functools.lru_cache(maxsize=None)
def _forward_cache_keyword(model_class: type) -> str:
    # a signature per model class, not per forward: decode loops ask once a token
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a model output carries (None without one): its ``cache`` field where the output class has one
    (transformers 5.23+, where reading ``past_key_values`` logs a deprecation warning), else ``past_key_values``."""
    if "cache" in getattr(output, "__dataclass_fields__", ()):
        return output.cache
    return getattr(output, "past_key_values", None)


class ForwardPass:
    """What the opening of the current forward pass learned about it."""

    __slots__ = ("rows", "positions", "tokens", "valid", "owner", "thread", "past")

    def __init__(self, rows: int, positions: int, tokens: np.ndarray, valid: np.ndarray | None, owner: Any,
                 past: int = 0):
        self.rows = rows  # B
        self.positions = positions  # S
        self.past = past  # cached positions before this forward
        self.tokens = tokens  # [B, S] int64
        self.valid = valid  # [B, S] uint8, or None when every position is real
        self.owner = owner  # the module whose forward opened this forward pass (None: a decode handle's step)
        self.thread = threading.get_ident()  # the thread that runs it


def kv_cache(kwargs: dict) -> Any:
    """The KV cache a forward was given (either argument name), or None."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


def past_length(kwargs: dict) -> int:
    """Cached positions before a forward's input: its KV cache's length (0 without one)."""
    cache = kv_cache(kwargs)
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    raise ValueError(
        f"psr_hf: unsupported KV cache type {type(cache).__name__} (no get_seq_length()); use a transformers Cache"
    )


def read_tokens(args: tuple, kwargs: dict, needs_ids: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """``(tokens [B, S] int64, mask)`` of a forward's input: ``mask`` is the 2D attention mask's columns of these
    positions when it came with the ids in one transfer, else None. A forward given only ``inputs_embeds`` has
    zero token ids (``ValueError`` where ``needs_ids``: score eviction reads the calibrated token prior)."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    mask = kwargs.get("attention_mask")
    if ids is not None:
        B, S = int(ids.shape[0]), int(ids.shape[1])
        if (isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[0] == B and mask.shape[1] >= S
                and mask.device == ids.device):
            # token ids and the mask of these positions in one transfer (one synchronisation)
            both = torch.cat((ids.detach().long(), mask[:, -S:].detach().long()), dim=1).cpu().numpy()
            return np.ascontiguousarray(both[:, :S]), both[:, S:]
        return ids.detach().to("cpu", torch.int64).numpy(), None
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        raise ValueError("psr_hf: the forward got neither input_ids nor inputs_embeds")
    if needs_ids:
        raise ValueError(
            "psr_hf: score eviction with a calibrated token prior needs the input token ids, but the model "
            "was called with inputs_embeds only; pass input_ids (or patch with eviction='lru')"
        )
    return np.zeros((int(embeds.shape[0]), int(embeds.shape[1])), dtype=np.int64), None


def real_positions(kwargs: dict, mask_host: np.ndarray | None, B: int, S: int, past: int,
                   right_padded: np.ndarray | None) -> np.ndarray | None:
    """``[B, S]`` uint8 real positions of a forward (None: every one), from its mask (``mask_host``: the one
    :func:`read_tokens` read), or without a mask from the ``right_padded`` real lengths of the rows."""
    mask = kwargs.get("attention_mask")
    if mask_host is not None:
        valid = None if mask_host.all() else (mask_host != 0).astype(np.uint8)
    else:
        valid = valid_positions(mask, B, S, past, kwargs.get("cache_position"))
    if mask is None and right_padded is not None:
        valid = valid_from_lengths(right_padded, B, S, past)
    return valid


def valid_from_lengths(lengths: np.ndarray, B: int, S: int, past: int) -> np.ndarray | None:
    """``[B, S]`` uint8: the positions before each row's real length ``lengths`` ``[B]`` (None: all)."""
    if lengths.shape != (B,):
        raise ValueError(f"psr_hf: right_padded() got {lengths.shape[0]} lengths for a batch of {B} rows")
    valid = past + np.arange(S)[None, :] < lengths[:, None]  # [B, S]
    return None if valid.all() else valid.astype(np.uint8)


def stop_token_ids(model: torch.nn.Module, kwargs: dict) -> np.ndarray:
    """The end-of-sequence ids a ``generate()`` call stops at: its ``eos_token_id``, or its generation config's."""
    eos = kwargs.get("eos_token_id")
    if eos is None:
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return np.asarray([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), dtype=np.int64)


def generation_setting(model: torch.nn.Module, kwargs: dict, name: str) -> Any:
    """A ``generate()`` call's setting ``name``: its keyword, else its generation config's, else the model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, name, None)


ASSISTED_DECODING = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def refuse_assisted_decoding(model: torch.nn.Module, kwargs: dict) -> None:
    """Assisted decoding (an assistant model, prompt lookup, early exit) verifies drafted tokens and then crops the
    KV cache to the accepted ones, but a cache-aware policy's routing state has already taken the rejected ones
    in, and has no way back: ``ValueError`` before anything runs."""
    used = [name for name in ASSISTED_DECODING if generation_setting(model, kwargs, name) is not None]
    if used:
        raise ValueError(
            f"psr_hf: assisted decoding ({', '.join(used)}) is not supported under a cache-aware policy: the target "
            "verifies drafted tokens and keeps only the accepted ones, but the routing state has taken the rejected "
            "ones in, so tokens and statistics would differ from plain decoding. Decode without an assistant, use "
            "policy='exact' (tokens as unpatched), or psr_hf.speculative_generate (block-level expert selection, "
            "docs/speculative.md)"
        )


def prompt_length(args: tuple, kwargs: dict) -> int:
    """The length of a ``generate()`` call's input (ids or embeddings; the cached part included)."""
    prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if prompt is None:
        prompt = kwargs.get("inputs_embeds")
    return int(prompt.shape[1]) if isinstance(prompt, torch.Tensor) and prompt.ndim >= 2 else 0


def refuse_right_padding(mask: Any) -> None:
    """generate() continues every row from the batch's last position: a row whose attention mask has a 0 after
    its last 1 (padding on the right while other rows are longer) would continue from padding, a garbage
    continuation that a comparison of policies would charge to the routing: ``ValueError``."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[1] == 0:
        return
    real = mask.detach() != 0
    padded = (~real[:, -1] & real.any(dim=1)).to("cpu")  # [B]: a real token before, padding at the end
    if bool(padded.any()):
        rows = np.flatnonzero(padded.numpy()).tolist()
        raise ValueError(
            f"psr_hf: generate() got a right-padded batch (row{'s' if len(rows) > 1 else ''} "
            f"{', '.join(map(str, rows[:8]))}{', ...' if len(rows) > 8 else ''} of the attention_mask end in "
            "padding after real tokens): generation continues every row from the last position, so right "
            "padding gives garbage continuations (transformers only warns), which a comparison of policies "
            'would charge to the routing. Pad on the left: tokenizer.padding_side = "left"'
        )
