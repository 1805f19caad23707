"""calibrate(): the bonus scale, warm set and token prior of a model, from its own routers on held-out text."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from .._progress import tqdm

from ..policy.calibration import Calibration, CalibrationBuilder

logger = logging.getLogger(__name__)


def _windows(data: Any, tokenizer: Any, max_length: int) -> list[np.ndarray]:
    """Token windows of at most ``max_length`` ids from texts or token sequences (each document chunked)."""
    if isinstance(data, (str, bytes)):
        data = [data]
    if isinstance(data, torch.Tensor):
        data = [row for row in (data if data.ndim == 2 else data.reshape(1, -1))]
    if isinstance(data, np.ndarray):
        data = list(data if data.ndim == 2 else data.reshape(1, -1))
    windows = []
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("calibrate got text but no tokenizer; pass tokenizer= (or token id batches)")
            # verbose=False: the text is cut into windows of max_length below, so the tokenizer's warning that it
            # is longer than the model's maximum length does not apply
            ids = np.asarray(tokenizer(item, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)
        else:
            ids = item.detach().cpu().numpy() if isinstance(item, torch.Tensor) else np.asarray(item)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"token sequences must be 1D integer ids, got shape {ids.shape} dtype {ids.dtype}")
            ids = ids.astype(np.int64)
        for start in range(0, ids.size, max_length):
            window = ids[start : start + max_length]
            if window.size:
                windows.append(window)
    if not windows:
        raise ValueError("calibrate got no tokens")
    return windows


@torch.no_grad()
def calibrate(
    model: torch.nn.Module,
    data: str | Sequence[str] | Sequence[Sequence[int]] | torch.Tensor | Iterable[Any],
    *,
    tokenizer: Any = None,
    max_length: int = 512,
    batch_size: int = 8,
    max_tokens: int | None = None,
    progress: bool = True,
) -> "Calibration":
    """Calibrate ``model``'s routing policy from held-out text, with the router's own top-K (exact routing).

    Args:
        model: a transformers MoE model of a supported family; patched or not (a patched model is run with its
            own routers for the calibration, its routing state untouched).
        data: texts (with ``tokenizer``), token id sequences, or a ``[N, S]`` tensor of ids. Each document is cut
            into windows of ``max_length`` tokens; every window is a new sequence.
        tokenizer: turns texts into ids (no special tokens are added).
        max_length: tokens per window.
        batch_size: windows per forward pass (right-padded with a mask).
        max_tokens: stop after this many tokens (None: use everything).
        progress: show a tqdm progress bar.

    Returns a :class:`Calibration` with ``delta`` (mean score range per layer), ``expert_counts`` (warm set) and
    the token prior, ready for :func:`psr_hf.patch` or ``.save(path)``.
    """
    from .installation import CONTROLLER_ATTRIBUTE
    from .patching import family_of

    if max_length < 1 or batch_size < 1:
        raise ValueError(f"max_length={max_length} and batch_size={batch_size} must be >= 1")
    ctl = getattr(model, CONTROLLER_ATTRIBUTE, None)
    family = ctl.family if ctl is not None else family_of(model)
    layers = family.moe_layers()
    routers = [layer.router for layer in layers]
    L, E, K = len(layers), int(routers[0].weight.shape[0]), int(routers[0].top_k)
    vocab = int(family.config.vocab_size)
    windows = _windows(data, tokenizer, max_length)
    if max_tokens is not None:
        kept, total = [], 0
        for window in windows:
            if total >= max_tokens:
                break
            kept.append(window[: max_tokens - total])
            total += kept[-1].size
        windows = kept
    for window in windows:
        if window.min() < 0 or window.max() >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}) (the model's vocabulary); got [{window.min()}, "
                             f"{window.max()}]: was the text tokenized with this model's tokenizer?")
    builder = CalibrationBuilder(L, E, vocab, K)
    captured: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def capture(module: torch.nn.Module, args: tuple, output: Any) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output
        return capture

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    device = next(model.parameters()).device
    pad = int(getattr(family.config, "pad_token_id", None) or 0)
    n_tokens = sum(w.size for w in windows)
    bar = tqdm(total=n_tokens, unit="tok", desc="calibrating", disable=not progress)
    context = ctl.bypassed() if ctl is not None else contextlib.nullcontext()
    try:
        with context:
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size]
                S = max(w.size for w in batch)
                ids = np.full((len(batch), S), pad, dtype=np.int64)
                mask = np.zeros((len(batch), S), dtype=np.int64)
                for row, window in enumerate(batch):
                    ids[row, : window.size] = window
                    mask[row, : window.size] = 1
                captured.clear()
                model(input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device),
                      use_cache=False)
                if len(captured) != L:
                    raise RuntimeError(f"only {len(captured)} of {L} MoE routers ran in the forward pass")
                selected, ranges = [], []
                for index, router in enumerate(routers):
                    z = family.selection_scores(router, captured[index]).float()  # [N, E]
                    selected.append(torch.topk(z, K, dim=-1).indices)
                    finite = torch.isfinite(z)
                    high = torch.where(finite, z, torch.full_like(z, -torch.inf)).amax(dim=-1)
                    low = torch.where(finite, z, torch.full_like(z, torch.inf)).amin(dim=-1)
                    ranges.append(high - low)
                real = torch.from_numpy(mask.reshape(-1) != 0).to(device)
                sel = torch.stack(selected, dim=1)[real].cpu().numpy()  # [n, L, K]
                rng = torch.stack(ranges, dim=1)[real].cpu().numpy()  # [n, L]
                builder.add(ids.reshape(-1)[mask.reshape(-1) != 0], sel, rng)
                bar.update(int(mask.sum()))
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    calibration = builder.build(metadata={
        "model_type": str(getattr(model.config, "model_type", "")),
        "tokens": str(n_tokens),
        "max_length": str(max_length),
    })
    logger.info("calibrated %d MoE layers x %d experts on %d tokens", L, E, n_tokens)
    return calibration

