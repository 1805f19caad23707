"""The engine's batched prefill: a prompt runs as one block through the patched model's own forward (the same
decision path as every other caller: per MoE layer the controller steps the logical cache through the prompt's
positions in order, then the experts run every position; offloaded, the block loads its experts as the
transformers offload path does, at most ``C`` at a time), and the engine's static KV cache is filled from each
layer's attention input on the way (:meth:`~psr_hf.engine.layers.DecodeLayers.write_prompt_kv`), so that the
engine's steps continue the sequence at the next position (or, where the engine's cache holds what transformers
caches, copied from transformers' cache after the forward). Page: docs/engine.md, "Batched prefill".

Why the model's own forward: its batched attention and grouped experts are what a block of positions needs, and
the decisions are the controller's in either case (ALGORITHM.md, "Batches, padding, prompts": a layer's state
depends only on that layer's earlier steps, so stepping a layer through the block equals stepping the block
through the layers). Where the engine's cache differs from transformers' (DeepSeek-V3's absorbed latent
attention), the engine's KV rows are computed by the engine's own functions from the layer inputs the forward
produced; where it holds the same tensors (OLMoE), copying them costs two kernels per layer instead of the
twenty-odd that computing them again launches, which on the lent H200's host is a few milliseconds of a prompt.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: the model's instance attribute holding the engine attached by :func:`psr_hf.engine.attach` (its ``_Attachment``)
ENGINE_ATTRIBUTE = "_psr_hf_engine"


def patched_forward(model: torch.nn.Module) -> Callable:
    """The patched model's forward beneath the engine: the controller's wrapper, also while the engine is attached
    (whose wrapper would send a prefill back to the engine)."""
    state = vars(model).get(ENGINE_ATTRIBUTE)
    if state is not None and vars(model).get("forward") is state.wrapper:
        return state.original
    return model.forward


def _layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or hidden.shape[0] != 1:
        raise RuntimeError("psr_hf.engine prefill: an attention layer was called without a [1, S, H] hidden_states "
                           "(this transformers version's decoder layer differs from the engine's expectation)")
    return hidden


@torch.no_grad()
def prefill_block(layers: Any, model: torch.nn.Module, tokens: list[int], out_logits: torch.Tensor) -> None:
    """Run ``tokens`` (a new sequence from position 0) through ``model``'s patched forward as one block, writing
    every layer's KV rows ``0 .. S-1`` into ``layers``' static cache and the last position's logits into
    ``out_logits [1, V]``. The caller checked that ``S <= max_len``.

    Where the engine's cache holds what transformers' attention caches (``layers.kv_from_transformers``), the
    forward fills a transformers cache whose tensors are copied over (two copies per layer: keys and values, or a
    Gated DeltaNet layer's convolution and recurrent states); otherwise a pre-hook
    on each attention layer computes the rows from the layer's input (``layers.write_prompt_kv``)."""
    ids = torch.tensor([tokens], dtype=torch.int64, device=layers.device)
    forward = patched_forward(model)
    if layers.kv_from_transformers:
        from transformers import DynamicCache

        from psr_hf.hf.inputs import cache_keyword

        cache = DynamicCache(config=model.config)  # the config's layer types: a hybrid model's linear layers
        output = forward(input_ids=ids, use_cache=True, logits_to_keep=1, return_dict=True,
                         **{cache_keyword(model): cache})
        if len(cache.layers) != layers.num_layers:
            raise RuntimeError(f"psr_hf.engine prefill: transformers' cache holds {len(cache.layers)} layers, the "
                               f"engine {layers.num_layers}")
        for index, layer in enumerate(cache.layers):
            layers.write_transformers_layer(index, layer, 0)
    else:
        output = _forward_writing_kv(layers, forward, ids)
    logits = output.logits
    if logits.shape[1] != 1:  # a family whose forward ignores logits_to_keep
        logits = logits[:, -1:]
    out_logits.copy_(logits[:, -1])


def _forward_writing_kv(layers: Any, forward: Callable, ids: torch.Tensor) -> Any:
    hooks = []

    def writer(index: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            layers.write_prompt_kv(index, _layer_input(args, kwargs)[0], 0)

        return hook

    for index, layer in enumerate(layers.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(writer(index), with_kwargs=True))
    try:
        return forward(input_ids=ids, use_cache=False, logits_to_keep=1, return_dict=True)
    finally:
        for hook in hooks:
            hook.remove()
