"""``model.generate()`` through the engine: :func:`attach` / :func:`detach` (page: docs/engine.md, "Behind
generate()").

:func:`attach` wraps the forward of a model patched by :func:`psr_hf.patch` (an instance attribute over the
controller's own forward wrapper). ``generate()`` is unchanged: its logits processors, sampling, stopping criteria
and outputs are its own; only the forward calls it makes are served by the engine's batch-1 decoder
(:class:`~psr_hf.engine.decoder.Decoder`, or :class:`~psr_hf.engine.graphs.GraphDecoder` replayed as CUDA graphs):
a one-row prefill from an empty cache and its continuations, asking for the last position's logits only. Every
other call runs the model's own (patched) forward, the reason logged once; a call that carries the engine's
:class:`EngineCache` but cannot be served re-synchronises on that forward from the whole sequence.
:func:`psr_hf.unpatch` removes the wrapper with the rest of the patch; :func:`detach` first is the clean order.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import numpy as np
import torch

from psr_hf.hf.installation import CONTROLLER_ATTRIBUTE as _PATCH_ATTR
from .decoding_loop import cache_field, cache_is_empty, wrap_generate
from .prefill import ENGINE_ATTRIBUTE
from .token_selection import ChoiceOutput
from .grad_off import grad_off

logger = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 4096
# arguments the engine understands (``tokenizer``: transformers' loop hands generate()'s on to the forward, which
# ignores it); any other one with a value other than None / False is a reason to fall back
_KNOWN = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "cache_position", "use_cache",
          "logits_to_keep", "return_dict", "tokenizer"}


def _carries_nothing(value: Any) -> bool:
    """An argument the engine may ignore: None, False, or a mapping of nothing (transformers passes a text-only
    call of an image-text model ``mm_encoder_outputs={}``)."""
    if value is None or value is False:
        return True
    return isinstance(value, dict) and all(v is None for v in value.values())


def _output_class() -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast




def _engine_cache_class() -> type:
    from transformers import DynamicCache

    class EngineCache(DynamicCache):
        """The cache ``generate()`` carries between the engine's calls: no tensors (the KV cache is the engine's
        static one); ``get_seq_length()`` is the engine's sequence length. Stale once the engine starts another
        sequence."""

        def __init__(self, owner: "_Attachment"):
            super().__init__()
            self._psr_owner = owner
            self._psr_length = 0
            self._psr_stale = False

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return self._psr_length

    return EngineCache


_CACHE_CLASS: type | None = None


def EngineCache(owner: "_Attachment") -> Any:  # noqa: N802 (a class built lazily: transformers loads on first use)
    global _CACHE_CLASS
    if _CACHE_CLASS is None:
        _CACHE_CLASS = _engine_cache_class()
    return _CACHE_CLASS(owner)


class _Attachment:
    """The engine attached to a model: its decoder, the wrapper, the engine's current sequence.

    Per call, the wrapper serves a **prefill** (one row of ``input_ids``, no cache or an empty one, mask all ones,
    positions ``0..S-1``, the last logits only, nothing else asked for, ``S <= max_len``: ``decoder.prefill``,
    returning the ``[1, 1, V]`` logits and an :class:`EngineCache`) and a **continuation** (the current
    EngineCache, whose tokens continue the engine's sequence within ``max_len``: ``decoder.step`` per token).
    Everything else (batches, beams, padding, more logits, attentions or hidden states, a longer sequence, a cache
    the engine did not make) runs the original forward; a call carrying the engine's cache that cannot be served
    re-synchronises there from an empty cache; a stale EngineCache raises ``RuntimeError``."""

    def __init__(self, model: torch.nn.Module, decoder: Any, max_len: int):
        self.model = model
        self.decoder = decoder
        self.max_len = max_len
        self.controller = getattr(model, _PATCH_ATTR)
        self.had_forward = "forward" in vars(model)
        self.previous_forward = vars(model).get("forward")
        self.original = model.forward  # the controller's wrapper (bound callable)
        self.cache: Any = None  # the EngineCache of the sequence the engine holds
        self.tokens: list[int] = []  # that sequence's tokens
        self.logged: set[tuple[str, str]] = set()
        self.served = 0  # forward calls served by the engine (for tests and benchmarks)
        self.fallbacks = 0
        self.loop_calls = 0  # generate() calls decoded by the engine's loop (psr_hf.engine.decoding_loop)
        self.choice_graphs: dict = {}  # that loop's token choices as CUDA graphs (psr_hf.engine.token_selection)
        self._choice_out: Any = None
        self.wrapper = self._make_wrapper()
        self.had_generate = "generate" in vars(model)
        self.previous_generate = vars(model).get("generate")
        self.generate_wrapper: Any = None

    # ------------------------------------------------------------------ bookkeeping
    def _log(self, reason: str) -> None:
        self.fallbacks += 1
        self.log_once("this forward runs on the HF path", reason)

    def log_once(self, what: str, reason: str) -> None:
        """Log ``what`` runs on the transformers side and why, once per reason."""
        if (what, reason) not in self.logged:
            self.logged.add((what, reason))
            logger.info("psr_hf.engine: %s: %s (logged once)", what, reason)

    def _drop_sequence(self) -> None:
        if self.cache is not None:
            self.cache._psr_stale = True
        self.cache = None
        self.tokens = []

    # ------------------------------------------------------------------ the wrapper
    def _make_wrapper(self) -> Any:
        original = self.original

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.forward(args, kwargs)

        # generate() reads the forward's signature every step; unwrapping the chain of wrappers each time costs
        # tens of microseconds, a signature of its own stops the unwrapping here
        forward.__signature__ = inspect.signature(original)
        return forward

    def check_patched(self) -> None:
        if getattr(self.model, _PATCH_ATTR, None) is not self.controller:
            raise RuntimeError("psr_hf.engine: the model was unpatched (or patched again) while the engine was "
                               "attached; call psr_hf.engine.detach(model) before psr_hf.unpatch(model)")

    def forward(self, args: tuple, kwargs: dict) -> Any:
        self.check_patched()
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                return self._fallback("positional arguments", args, kwargs)
            kwargs = dict(kwargs, input_ids=args[0])
            args = ()
        name = "cache" if "cache" in kwargs else ("past_key_values" if "past_key_values" in kwargs else None)
        cache = kwargs.get(name) if name else None
        ours = _CACHE_CLASS is not None and isinstance(cache, _CACHE_CLASS)
        if ours and (cache._psr_owner is not self or cache._psr_stale or cache is not self.cache):
            raise RuntimeError("psr_hf.engine: this cache belongs to a sequence the engine no longer holds (a later "
                               "generate() or forward started another one); start again from the prompt")
        ids = kwargs.get("input_ids")
        if ids is not None and (ids.ndim != 2 or ids.shape[0] != 1):
            reason = "several rows (batch > 1, beam search)" if ids.ndim == 2 else "input_ids not 2D"
        elif cache is not None and not ours and not cache_is_empty(cache):
            reason = "the call continues a transformers cache the engine did not make"
        else:
            reason = self.refusal(kwargs)
        if reason is None and ids is not None and ids.ndim == 2 and ids.shape[0] == 1:
            S = int(ids.shape[1])
            reason = self.position_refusal(kwargs, 0 if not ours else len(self.tokens), S)
            if reason is None and ours:
                if len(self.tokens) + S > self.max_len:
                    reason = f"the sequence would exceed the engine's max_len={self.max_len}"
                else:
                    return self._serve(kwargs, ids, name, continuation=True)
            elif reason is None:
                if S > self.max_len:
                    reason = f"the prompt is longer than the engine's max_len={self.max_len}"
                elif S == 0:
                    reason = "no input tokens"
                else:
                    return self._serve(kwargs, ids, name, continuation=False)
        if ours and reason is not None and reason.startswith(("position_ids", "cache_position", "the attention mask's")):
            # the positions do not continue the engine's sequence: e.g. a cache returned by one generate() passed to
            # another, which replays the sequence from the start; re-synchronising would count it twice
            raise RuntimeError(f"psr_hf.engine: {reason}; the cache generate() returns with the engine attached "
                               "cannot be passed to another generate() or forward: start again from the whole "
                               "sequence without a cache")
        if ours:
            return self._resync(reason, kwargs, name)
        return self._fallback(reason, args, kwargs)

    def refusal(self, kwargs: dict) -> str | None:
        """Why a forward call's arguments cannot be served whatever its shape (None: they can); the engine's
        decoding loop asks the same of the arguments generate() prepared."""
        if kwargs.get("input_ids") is None:
            return "inputs_embeds instead of input_ids"
        for key, value in kwargs.items():
            if key in _KNOWN or _carries_nothing(value):
                continue
            return f"argument {key!r}"
        if kwargs.get("use_cache") is False:
            return "use_cache=False"
        config = self.model.config
        if getattr(config, "output_attentions", False) or getattr(config, "output_hidden_states", False):
            return "the config asks for attentions or hidden states"
        mask = kwargs.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            return "a non-tensor attention mask"
        if mask is not None and (mask.ndim != 2 or not bool((mask != 0).all())):
            return "an attention mask with padding (or not 2D)"
        return None

    def position_refusal(self, kwargs: dict, start: int, S: int) -> str | None:
        """The positions of the call's ``S`` tokens must be ``start .. start + S - 1``; one logits row asked for."""
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, torch.Tensor):
            return "logits_to_keep as a tensor"
        if not (keep == 1 or S == 1):
            return "logits of more positions than the last one"
        expected = np.arange(start, start + S)
        for key in ("position_ids", "cache_position"):
            value = kwargs.get(key)
            if value is None:
                continue
            # one read of the values (a transfer on CUDA) compared on the host with start .. start + S - 1; every
            # stream of multi-stream positions (Qwen3.5's text, temporal, height and width rows) the same
            host = value.detach().reshape(-1).cpu().numpy()
            if host.size == 0 or host.size % S or not (host.reshape(-1, S) == expected).all():
                return f"{key} do not continue the engine's sequence"
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape[-1] != start + S:
            return "the attention mask's length is not the engine's sequence length"
        return None

    # ------------------------------------------------------------------ serving
    @grad_off
    def _serve(self, kwargs: dict, ids: torch.Tensor, name: str | None, continuation: bool) -> Any:
        tokens = [int(t) for t in ids[0].tolist()]
        if continuation:
            logits = None
            for token in tokens:
                logits = self.advance(token)
            self.served += 1 - len(tokens)  # one forward call served
        else:
            logits = self.start(tokens)
        out = _output_class()(logits=logits.detach().clone().reshape(1, 1, -1),
                              **{cache_field(_output_class()): self.cache})
        if kwargs.get("return_dict") is False:
            return out.to_tuple()
        return out

    def start(self, tokens: list[int]) -> torch.Tensor:
        """A new sequence from its prompt ``tokens``: the engine's prefill (one forward served); returns the
        decoder's ``[1, V]`` logits buffer."""
        self.check_patched()
        self._drop_sequence()
        self.tokens = list(tokens)  # before the prefill: an error there drops the sequence cleanly
        try:
            logits = self.decoder.prefill(tokens)
        except BaseException:
            self._drop_sequence()
            raise
        self.cache = EngineCache(self)
        self.cache._psr_length = len(self.tokens)
        self.served += 1
        return logits

    def advance(self, token: int) -> torch.Tensor:
        """The next token of the engine's sequence (one forward served); returns the ``[1, V]`` logits buffer."""
        logits = self.decoder.step(token)
        self.tokens.append(token)
        self.cache._psr_length = len(self.tokens)
        self.served += 1
        return logits

    def choice_out(self, device: torch.device) -> Any:
        """The token choice's output on ``device`` (:class:`~psr_hf.engine.token_selection.ChoiceOutput`, one per
        engine: the graphs write it)."""
        if self._choice_out is None or self._choice_out.device != device:
            self._choice_out = ChoiceOutput(device)
            self.choice_graphs.clear()
        return self._choice_out

    def advance_chosen(self, read_token: Any, overlap: Any = None) -> torch.Tensor | None:
        """The next token of the engine's sequence as the device chose it (``GraphDecoder.step_chosen``): the
        logits buffer, or None where ``read_token`` stopped the sequence (nothing served)."""
        logits, token = self.decoder.step_chosen(read_token, overlap)
        if logits is None:
            return None
        self.tokens.append(token)
        self.cache._psr_length = len(self.tokens)
        self.served += 1
        return logits

    def current(self, model: torch.nn.Module) -> bool:
        """Whether this attachment still serves ``model`` (not detached, not unpatched meanwhile)."""
        return vars(model).get(ENGINE_ATTRIBUTE) is self and vars(model).get("forward") is self.wrapper

    def _fallback(self, reason: str, args: tuple, kwargs: dict) -> Any:
        self._log(reason)
        self._drop_sequence()  # the HF path runs through the controller: the engine's sequence is over
        return self.original(*args, **kwargs)

    def _resync(self, reason: str, kwargs: dict, name: str) -> Any:
        """The call carries the engine's cache but cannot be served: the model's own forward runs the whole sequence
        from an empty cache, returning the logits of the call's positions and a real cache."""
        self._log(f"{reason} (re-synchronised on the HF path)")
        ids = kwargs["input_ids"]
        prefix = torch.tensor([self.tokens], dtype=ids.dtype, device=ids.device)
        full = torch.cat([prefix, ids], dim=1)
        S = int(ids.shape[1])
        call = {k: v for k, v in kwargs.items() if k not in ("position_ids", "cache_position", name)}
        call["input_ids"] = full
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, torch.Tensor):
            raise RuntimeError("psr_hf.engine: cannot re-synchronise a call with logits_to_keep as a tensor")
        if "logits_to_keep" in kwargs or keep == 0:
            call["logits_to_keep"] = S if keep == 0 else min(int(keep), S)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape[-1] != full.shape[1]:
            call.pop("attention_mask")
        call["use_cache"] = True
        self._drop_sequence()
        self.controller.discard_sequence()  # counted and recorded again by the run from the start
        return self.original(**call)


# ---------------------------------------------------------------------------------------------- public API
def attach(model: torch.nn.Module, *, max_len: int | None = None, graphs: bool | None = None,
           **decoder_kwargs: Any) -> torch.nn.Module:
    """Serve ``model.generate()`` at batch 1 by the engine; returns the same model.

    ``model`` must be patched by :func:`psr_hf.patch` (resident or offloaded). ``max_len``: the engine's static KV
    cache (positions per sequence), default the config's ``max_position_embeddings`` capped at 4096; a generate()
    that goes past it continues on the HF path. ``graphs``: replay CUDA graphs (default: on CUDA; eager on the
    CPU). Further keyword arguments go to the decoder (``backend``, ``absorb_mla``, ``gated_delta_kernel``,
    ``attention_kernels``, and with graphs ``device_routing``: :func:`~psr_hf.engine.token_graph.graph_decoder`).
    Undo with :func:`detach`.
    """
    if getattr(model, _PATCH_ATTR, None) is None:
        raise ValueError("psr_hf.engine.attach needs a model patched by psr_hf.patch(model, config) first")
    if attached(model) is not None:
        raise ValueError("the engine is already attached to this model; psr_hf.engine.detach(model) first")
    detach(model)  # the state left by an attach whose wrapper psr_hf.unpatch removed
    if max_len is None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        max_len = min(int(getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_LEN), DEFAULT_MAX_LEN)
    device = next(model.parameters()).device
    if graphs is None:
        graphs = device.type == "cuda"
    if graphs:
        from .token_graph import graph_decoder

        decoder = graph_decoder(model, int(max_len), graphs=True, **decoder_kwargs)
    else:
        from .decoder import Decoder

        decoder = Decoder(model, int(max_len), **decoder_kwargs)
    _engine_cache_class_ready()
    state = _Attachment(model, decoder, int(max_len))
    object.__setattr__(model, "forward", state.wrapper)
    object.__setattr__(model, ENGINE_ATTRIBUTE, state)
    state.generate_wrapper = wrap_generate(model, state)
    if state.generate_wrapper is not None:
        object.__setattr__(model, "generate", state.generate_wrapper)
    logger.info("psr_hf.engine: attached to %s (max_len %d, %s)", type(model).__name__, max_len,
                "CUDA graphs" if graphs else "eager")
    return model


def _engine_cache_class_ready() -> None:
    global _CACHE_CLASS
    if _CACHE_CLASS is None:
        _CACHE_CLASS = _engine_cache_class()


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`attach`: the model's forward is the one it had before (the patched one), the engine's buffers are
    released. Idempotent; also after :func:`psr_hf.unpatch` (which already removed the wrapper)."""
    state = vars(model).get(ENGINE_ATTRIBUTE)
    if state is None:
        return model
    if vars(model).get("forward") is state.wrapper:
        if state.had_forward:
            object.__setattr__(model, "forward", state.previous_forward)
        else:
            object.__delattr__(model, "forward")
    _remove_generate(model, state)
    state._drop_sequence()
    object.__delattr__(model, ENGINE_ATTRIBUTE)
    return model


def _remove_generate(model: torch.nn.Module, state: _Attachment) -> None:
    if state.generate_wrapper is not None and vars(model).get("generate") is state.generate_wrapper:
        if state.had_generate:  # the patch's wrapper
            object.__setattr__(model, "generate", state.previous_generate)
        else:
            object.__delattr__(model, "generate")


def attached(model: torch.nn.Module) -> Any:
    """The engine attached to ``model`` (``decoder``, ``served``, ``fallbacks``, ``max_len``), or None."""
    state = vars(model).get(ENGINE_ATTRIBUTE)
    if state is not None and vars(model).get("forward") is not state.wrapper:
        return None  # unpatched meanwhile: the wrapper is gone
    return state
