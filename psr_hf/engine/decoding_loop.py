"""``generate()``'s decoding loop on the engine: what :func:`psr_hf.engine.attach` puts behind ``model.generate``
(page: docs/engine.md, "Behind generate()").

Why a loop of its own: transformers' per-token loop (input preparation, keyword updates, stopping criteria and
logits processors as device kernels, the output bookkeeping) costs about as much host time as half an engine step
on the lent H200. transformers' ``generate(custom_generate=callable)`` keeps every preparation step of its own (the
generation config, the logits processors and stopping criteria it builds, the special tokens, the lengths) and
hands the decoding loop to the callable: :class:`EngineDecodingLoop` is that callable. It runs transformers' own
processors and criteria on every token, in transformers' order with the same tensors (so one seed draws the same
tokens), and skips only what a one-row sequence on the engine does not need: the model-input preparation (the
engine holds the sequence), the cache bookkeeping, the processor list's signature lookup per processor and token,
the minimum-length processors' mask rebuilt per token, and the criteria whose answer the host already knows (the
maximum length, an end-of-sequence token).

Greedy and sampling at one row run here; anything else (beams, assisted decoding, attentions or hidden states,
a sequence past the engine's ``max_len``, a cache passed in, padding) runs transformers' own loop, whose forward
calls the engine still serves where it can (:mod:`psr_hf.engine.generate`), the reason logged once.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable

import torch

from .token_selection import TokenSelection, prepared_processors

logger = logging.getLogger("psr_hf.engine.generate")

#: generate() arguments whose presence means transformers' own decoding: they select another mode or loop, or
#: (``tokenizer``, for stop strings and token healing) transformers does not hand them to a custom decoding loop
_OWN_LOOP_ARGUMENTS = ("custom_generate", "assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit",
                       "synced_gpus", "tokenizer")
_OWN_LOOP = "generate() decodes in transformers' own loop"


def _modes() -> tuple[Any, Any]:
    from transformers.generation.utils import GenerationMode

    return GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE


def predicted_mode(model: torch.nn.Module, kwargs: dict) -> Any:
    """The generation mode transformers will choose for a ``generate(**kwargs)`` call on ``model`` (its config, or
    the one passed, updated with the call's arguments)."""
    base = kwargs.get("generation_config") or model.generation_config
    config = copy.deepcopy(base)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config.get_generation_mode(kwargs.get("assistant_model"))


def _output_class() -> Any:
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput


@functools.lru_cache(maxsize=None)
def cache_field(output_class: type) -> str:
    """The cache's name in a transformers output class: ``cache`` (recent transformers) or ``past_key_values``."""
    fields = {f.name for f in dataclasses.fields(output_class)}
    return "cache" if "cache" in fields else "past_key_values"


class EngineDecodingLoop:
    """The decoding loop transformers' ``generate()`` calls (``custom_generate``), bound to one attached engine
    (``state``, a :class:`~psr_hf.engine.generate._Attachment`) and the call's ``streamer``."""

    def __init__(self, state: Any, streamer: Any = None):
        self.state = state
        self.streamer = streamer

    # the parameters are transformers' decoding-method parameters (GenerationMixin._sample's), by name
    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                 generation_config: Any, synced_gpus: bool = False, streamer: Any = None, **model_kwargs: Any) -> Any:
        streamer = streamer if streamer is not None else self.streamer
        mode = generation_config.get_generation_mode(None)
        reason = self._refuse(model, input_ids, generation_config, mode, synced_gpus, model_kwargs)
        if reason is not None:
            self.state.log_once(_OWN_LOOP, reason)
            return self._transformers_loop(model, mode, input_ids, logits_processor, stopping_criteria,
                                           generation_config, synced_gpus, streamer, model_kwargs)
        with torch.no_grad():
            return self._decode(input_ids, logits_processor, stopping_criteria, generation_config, streamer)

    # ------------------------------------------------------------------ what runs elsewhere
    def _refuse(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any, mode: Any, synced_gpus: bool,
                model_kwargs: dict) -> str | None:
        """Why this call runs transformers' loop (None: it runs here)."""
        if mode not in _modes():
            return f"generation mode {mode.name.lower()}"
        if synced_gpus:
            return "synced_gpus"
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            return "several rows (batch > 1, several return sequences)"
        S = int(input_ids.shape[1])
        if S == 0:
            return "no input tokens"
        if config.output_attentions or config.output_hidden_states:
            return "attentions or hidden states asked for"
        if config.max_length is None or config.max_length > self.state.max_len:
            return f"the sequence may exceed the engine's max_len={self.state.max_len}"
        # what a forward call of the prompt with these arguments would need of the engine (only the last
        # position's logits are read, whatever logits_to_keep says)
        call = {k: v for k, v in model_kwargs.items() if k not in ("cache", "past_key_values")}
        call.update(input_ids=input_ids, logits_to_keep=1)
        reason = self.state.refusal(call) or self.state.position_refusal(call, 0, S)
        if reason is not None:
            return reason
        for key in ("cache", "past_key_values"):
            cache = model_kwargs.get(key)
            if cache is not None and not cache_is_empty(cache):
                return "a cache passed in"
        return None

    @staticmethod
    def _transformers_loop(model: torch.nn.Module, mode: Any, input_ids: torch.Tensor, logits_processor: Any,
                           stopping_criteria: Any, generation_config: Any, synced_gpus: bool, streamer: Any,
                           model_kwargs: dict) -> Any:
        from transformers.generation.utils import GENERATION_MODES_MAPPING

        name = GENERATION_MODES_MAPPING.get(mode, "")
        method = getattr(type(model), name, None) if name.startswith("_") else None
        if method is None:
            raise RuntimeError(f"psr_hf.engine: generate() in mode {mode.name.lower()} reached the engine's decoding "
                               "loop; call psr_hf.engine.detach(model) for this generate()")
        return method(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                      generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer,
                      **model_kwargs)

    # ------------------------------------------------------------------ the loop
    def _decode(self, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any, config: Any,
                streamer: Any) -> Any:
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        state = self.state
        max_length = int(config.max_length)
        eos: set[int] = set()
        others = []
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = min(max_length, int(criterion.max_length))
            elif type(criterion) is EosTokenCriteria:
                eos.update(int(t) for t in criterion.eos_token_id.reshape(-1).tolist())
            else:
                others.append(criterion)
        return_dict = bool(config.return_dict_in_generate)
        scores = () if return_dict and config.output_scores else None
        raw_logits = () if return_dict and config.output_logits else None
        tokens = [int(t) for t in input_ids[0].tolist()]
        S = len(tokens)
        # the sequence so far: written per token where a processor or criterion reads it, else at the end
        sequence = torch.empty((1, max(max_length, S + 1)), dtype=input_ids.dtype, device=input_ids.device)
        sequence[:, :S] = input_ids
        logits = state.start(tokens)
        graphed = bool(getattr(state.decoder, "graphs", False))
        selection = TokenSelection(logits, prepared_processors(logits_processor, int(logits.shape[-1]),
                                                               logits.device),
                                   bool(config.do_sample), keep_scores=scores is not None,
                                   keep_logits=raw_logits is not None,
                                   graphs=state.choice_graphs if graphed else None,
                                   out=state.choice_out(logits.device),
                                   token=state.decoder.layers.buffers.token)
        per_token = selection.reads_sequence or bool(others)
        new: list[int] = []
        length = S

        def accept(token: int) -> bool:
            """Take the chosen token; whether the sequence goes on."""
            nonlocal length
            new.append(token)
            if per_token:
                sequence[0, length] = token
            length += 1
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            return not (length >= max_length or token in eos or any(
                _done(criterion(sequence[:, :length], scores)) for criterion in others))

        def read_accepted() -> int | None:
            token = selection.read()
            return token if accept(token) else None

        while True:
            if selection.launch(sequence[:, :length]):
                # the device chose the token into the decoder's token buffer: the next step is launched before
                # the host reads it (and stops there if the token ends the sequence)
                if length + 1 >= max_length:
                    accept(selection.read())
                    break
                logits = state.advance_chosen(read_accepted, selection.draw_ahead if selection.do_sample else None)
                if logits is None:
                    break
                if logits is not selection.logits:
                    raise RuntimeError("psr_hf.engine: the decoder returned another logits buffer than its prefill")
                continue
            token, next_scores, next_logits = selection.choose(sequence[:, :length])
            if scores is not None:
                scores += (next_scores,)
            if raw_logits is not None:
                raw_logits += (next_logits,)
            if not accept(token):
                break
            logits = state.advance(token)
            if logits is not selection.logits:
                raise RuntimeError("psr_hf.engine: the decoder returned another logits buffer than its prefill")
        if not per_token:
            sequence[0, S:length] = torch.tensor(new, dtype=sequence.dtype).to(sequence.device)
        if streamer is not None:
            streamer.end()
        state.loop_calls += 1
        out = sequence[:, :length]
        if not return_dict:
            return out
        return _output_class()(sequences=out, scores=scores, logits=raw_logits, attentions=None, hidden_states=None,
                               **{cache_field(_output_class()): state.cache})


def _done(answer: Any) -> bool:
    """A stopping criterion's answer for the one row: a bool tensor, or a bool (transformers' list ORs either)."""
    return bool(answer.any()) if isinstance(answer, torch.Tensor) else bool(answer)


def cache_is_empty(cache: Any) -> bool:
    """Whether a transformers cache holds no positions (False where it cannot say)."""
    try:
        return int(cache.get_seq_length()) == 0
    except Exception:
        return False


def wrap_generate(model: torch.nn.Module, state: Any) -> Callable | None:
    """``model.generate`` with the engine's decoding loop where it applies (:class:`EngineDecodingLoop`), the
    ``generate`` it wraps (the patch's) otherwise. None where that is not transformers' own ``generate`` (a model
    class's or a repository's), whose decoding the engine leaves alone (it still serves the forward calls)."""
    from transformers import GenerationMixin

    original = model.generate
    if inspect.unwrap(original) is not inspect.unwrap(GenerationMixin.generate):
        logger.info("psr_hf.engine: %s has a generate() of its own; it keeps its decoding loop (the engine serves "
                    "its forward calls)", type(model).__name__)
        return None

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if state.current(model):
            reason = next((f"argument {k!r}" for k in _OWN_LOOP_ARGUMENTS if kwargs.get(k) is not None), None)
            mode = predicted_mode(model, kwargs) if reason is None else None
            if reason is None and mode not in _modes():
                reason = f"generation mode {mode.name.lower()}"
            if reason is None:
                kwargs["custom_generate"] = EngineDecodingLoop(state, kwargs.get("streamer"))
            else:
                state.log_once(_OWN_LOOP, reason)
        return original(*args, **kwargs)

    return generate
