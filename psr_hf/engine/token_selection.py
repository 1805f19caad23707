"""The next token from the engine's logits, as transformers' decoding loop chooses it: its logits processors on a
float32 copy, then the argmax or a multinomial draw (page: docs/engine.md, "Behind generate()").

Why a module of its own: on the lent H200 the host spends 15-30 us on each CUDA call, and transformers' choice of a
token is a dozen of them, with two synchronisations inside ``torch.multinomial`` (its checks of the
probabilities). :class:`TokenSelection` makes the same choice with fewer: ``torch.multinomial``'s own algorithm
for one sample (an exponential draw, a division, the argmax: the same random numbers, so one seed draws the same
tokens) with its check read together with the token; and on CUDA, where every processor is a function of the
scores alone, the whole choice as one CUDA graph (torch's graph-safe random state: a replay draws what the eager
calls would). The minimum-length processors become a mask built once (:class:`MinimumLength`), and the
processor list's per-call signature lookup is done once.

Where the device time goes (``benchmarks/engine/token_choice_kernels.py``, its record in
``benchmarks/engine/h200/engine_for_users/``): the random draw stays outside the graph (an eager ``exponential_``
into a static buffer, the same numbers as in the graph or in ``torch.multinomial``), because torch's replay of a graph
holding random numbers first sets the generator's seed and offset on the device: two more launches on the host
path between one step and the next. The token lands in pinned host memory with an event after the choice
(:class:`ChoiceOutput`), so the host reads it as soon as the choice is done, while the next step's first graph
already runs, without a synchronising copy.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Callable

import torch

from ..offload.cuda_runtime import HostEvent

logger = logging.getLogger("psr_hf.engine.generate")

_INVALID = "probability tensor contains either `inf`, `nan` or element < 0"
_MAX_GRAPHS = 16  # the choices kept as graphs per engine (a configuration of the processors and its state each)


class MinimumLength:
    """transformers' ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor`` with its end-of-sequence
    mask built once: ``-inf`` at those ids while the sequence is shorter than ``length`` (the same values as
    transformers' ``torch.where``), the scores unchanged after."""

    def __init__(self, length: int, eos: torch.Tensor, vocab: int, device: torch.device):
        self.length = length
        self.eos_ids = tuple(int(t) for t in eos.reshape(-1).tolist())
        self.mask = torch.isin(torch.arange(vocab, device=device), eos.to(device))

    def active(self, length: int) -> bool:
        return length < self.length

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.mask, -math.inf)


def _scores_only() -> tuple[type, ...]:
    """transformers' warpers whose result depends on the scores alone (no sequence, no host state): what a graph
    of the choice may hold."""
    from transformers.generation import logits_process as lp

    names = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
             "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper")
    return tuple(getattr(lp, name) for name in names if hasattr(lp, name))


def prepared_processors(logits_processor: Any, vocab: int, device: torch.device) -> list[Callable]:
    """transformers' ``LogitsProcessorList`` as calls without its per-call signature lookup (a processor that
    wants more arguments stays in a list of its own, which raises as transformers' loop does); the minimum-length
    processors as :class:`MinimumLength`."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    steps: list[Callable] = []
    for processor in logits_processor or ():
        if type(processor) is MinLengthLogitsProcessor:
            steps.append(MinimumLength(processor.min_length, processor.eos_token_id, vocab, device))
        elif type(processor) is MinNewTokensLengthLogitsProcessor:
            steps.append(MinimumLength(processor.prompt_length_to_skip + processor.min_new_tokens,
                                       processor.eos_token_id, vocab, device))
        elif len(inspect.signature(processor.__call__).parameters) > 2:
            steps.append(LogitsProcessorList([processor]))
        else:
            steps.append(processor)
    return steps


def _graph_key(processors: list[Callable], do_sample: bool) -> tuple | None:
    """What a graph of the choice depends on, by value (the processors of each generate() call are new objects):
    None where a processor is not a function of the scores alone or holds something else than numbers."""
    pure = _scores_only()
    key: list[Any] = [do_sample]
    for p in processors:
        if isinstance(p, MinimumLength):
            key.append(("minimum", p.eos_ids))
        elif type(p) in pure and all(type(v) in (int, float, bool) for v in vars(p).values()):
            key.append((type(p).__qualname__, tuple(sorted(vars(p).items()))))
        else:
            return None
    return tuple(key)


class ChoiceOutput:
    """Where a choice lands: ``values`` ``[2]`` float64 on the logits' device (the token id, the sampling check),
    and on CUDA its pinned host copy, written by the choice itself (captured into its graph) and marked by an
    event (:meth:`mark`), which :meth:`read` waits for: the host reads the token when the choice is done, not
    after the work launched behind it, and without a synchronising copy. One per attached engine."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.values = torch.zeros(2, dtype=torch.float64, device=self.device)
        cuda = self.values.is_cuda
        self.host = torch.zeros(2, dtype=torch.float64, pin_memory=True) if cuda else self.values
        self._host_np = self.host.numpy()
        self._event = HostEvent(self.device)
        self._noise: torch.Tensor | None = None

    def noise(self, shape: torch.Size) -> torch.Tensor:
        """The float32 buffer of a sample's random draw (one per engine, so that every kept graph reads it)."""
        if self._noise is None or self._noise.shape != shape:
            self._noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self._noise

    def publish(self) -> None:
        """The host copy of ``values`` (part of the choice: inside its graph where it is one)."""
        if self.host is not self.values:
            self.host.copy_(self.values, non_blocking=True)

    def mark(self) -> None:
        """Mark the end of the choice just enqueued on the current stream."""
        self._event.record()

    def read(self) -> tuple[float, float]:
        """``(token id, check value)`` of the choice before the latest :meth:`mark` (waiting for it)."""
        self._event.synchronize()
        return float(self._host_np[0]), float(self._host_np[1])


class TokenSelection:
    """The choice of each next token of one ``generate()`` call from the engine's static ``logits`` buffer
    ``[1, V]``: ``processors`` (:func:`prepared_processors`), sampling or greedy; ``keep`` the processed scores
    and the float32 logits of every token (``output_scores`` / ``output_logits``). ``graphs``: a dict that keeps
    the choice's CUDA graphs across calls (the attached engine's), or None for none; a graph is built where every
    processor is a function of the scores and nothing is kept, from the second token of a call on (a call of one
    token chooses it eagerly). ``out``: the engine's :class:`ChoiceOutput`. ``token``: the decoder's token buffer,
    which :meth:`launch` writes too."""

    def __init__(self, logits: torch.Tensor, processors: list[Callable], do_sample: bool, *, keep_scores: bool,
                 keep_logits: bool, graphs: dict | None, out: ChoiceOutput, token: torch.Tensor | None = None):
        self.logits = logits
        self.processors = processors
        self.do_sample = do_sample
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        self.minimum = [p for p in processors if isinstance(p, MinimumLength)]
        self.reads_sequence = any(not isinstance(p, MinimumLength) for p in processors)
        key = _graph_key(processors, do_sample)
        self.graphs = graphs if graphs is not None and logits.is_cuda and not keep_scores and not keep_logits else None
        self._key = key if self.graphs is not None else None
        self._chosen = False  # a token of this call was chosen (the first one eagerly: a graph only after)
        self._replays: dict[tuple[bool, ...], Any] = {}  # this call's graphs by the minimum lengths' state
        self._out = out
        self._token = token  # the decoder's token buffer, which a launched choice also writes (step_chosen)
        # the draw of a sample: torch.multinomial's exponential numbers for [1, V] float32 probabilities, drawn
        # eagerly into the engine's buffer before each choice (a graph reads it)
        self._noise = out.noise(logits.shape) if do_sample else None
        self._drawn = False  # the noise holds the next choice's draw (draw_ahead)
        #: whether :meth:`launch` chooses (a token buffer to write, no scores or logits to keep)
        self.launches = token is not None and not keep_scores and not keep_logits

    # ------------------------------------------------------------------ one token
    def choose(self, sequence: torch.Tensor) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The next token after ``sequence [1, L]`` (its values are read only by processors that read them):
        ``(token, processed scores or None, float32 logits or None)``."""
        self._draw()
        next_logits, next_scores = self._compute(sequence, None)
        self._out.mark()
        self._chosen = True
        return self.read(), next_scores if self.keep_scores else None, next_logits if self.keep_logits else None

    def launch(self, sequence: torch.Tensor) -> bool:
        """Choose the token after ``sequence`` on the device without reading it: it lies in the output and the
        decoder's token buffer, :meth:`read` reads it (the choice's graph is replayed from a call's second token
        on, where there is one). False where this selection does not launch (:attr:`launches`): :meth:`choose`."""
        if not self.launches:
            return False
        if self._key is None or not self._chosen:
            self._draw()
            self._compute(sequence, None)
            self._chosen = True
        else:
            length = int(sequence.shape[-1])
            active = tuple(m.active(length) for m in self.minimum) if self.minimum else ()
            graph = self._replays.get(active)
            if graph is None:
                graph = self._replays[active] = self._graph(sequence, active)
            self._draw()  # after a capture, whose warm-up reads the buffer
            graph.replay()
        self._out.mark()
        return True

    def draw_ahead(self) -> None:
        """Draw the next choice's random numbers now (the decoder calls it while the GPU computes the step, off
        the host's path between steps). The same numbers as a draw at the choice: nothing else draws from the
        generator in between, and transformers' stopping criteria and streamer for the previous token have run."""
        if self._noise is not None and not self._drawn:
            self._noise.exponential_(1)
            self._drawn = True

    def _draw(self) -> None:
        """The choice's draw (drawn ahead, or now)."""
        if self._noise is not None and not self._drawn:
            self._noise.exponential_(1)
        self._drawn = False

    def _compute(self, sequence: torch.Tensor, active: tuple[bool, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The choice from the drawn noise into the output: (float32 logits, processed scores). ``active``: the
        minimum-length processors' state, fixed for a graph (None: from ``sequence``'s length)."""
        plain = not self.do_sample and not self.processors and not self.keep_scores and not self.keep_logits
        if plain:  # the argmax of the logits is the argmax of their float32 copy
            self._write(torch.argmax(self.logits, dim=-1), None)
            return self.logits, self.logits
        next_logits = self.logits.to(copy=True, dtype=torch.float32)
        scores = next_logits
        which = iter(active) if active is not None else None
        for processor in self.processors:
            if isinstance(processor, MinimumLength):
                on = next(which) if which is not None else processor.active(int(sequence.shape[-1]))
                scores = processor.apply(scores) if on else scores
            else:
                scores = processor(sequence, scores)
        if self.do_sample:
            # torch.multinomial(probs, 1): argmax(probs / q), q ~ Exp(1); its check of the probabilities is the
            # maximum of probs / q (NaN where any probability is: the softmax makes them NaN together)
            probs = torch.nn.functional.softmax(scores, dim=-1)
            value, index = torch.max(probs / self._noise, dim=-1)
            self._write(index, value)
        else:
            self._write(torch.argmax(scores, dim=-1), None)
        return next_logits, scores

    def _write(self, index: torch.Tensor, value: torch.Tensor | None) -> None:
        """The chosen ``index [1]`` (and the check ``value [1]``) into the output and the token buffer."""
        values = self._out.values
        values[0] = index[0]
        if value is not None:
            values[1] = value[0]
        if self._token is not None:
            self._token.copy_(index.reshape(self._token.shape))
        self._out.publish()

    def read(self) -> int:
        token, check = self._out.read()  # the one read of the token (the next step feeds it from the host)
        if self.do_sample and not check >= 0:  # NaN fails (an infinite maximum is a zero draw of q: valid)
            raise RuntimeError(f"{_INVALID} (the engine's logits or the processors' scores are not finite)")
        return int(token)

    # ------------------------------------------------------------------ graphs
    def _graph(self, sequence: torch.Tensor, active: tuple[bool, ...]) -> Any:
        """The kept graph of this configuration and state (captured if there is none)."""
        key = (self._key, active)
        entry = self.graphs.get(key)
        if entry is None or any(kept is not now for kept, now in zip(entry[2:], self._graph_inputs())):
            if len(self.graphs) >= _MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            # the graph reads the capturing call's processors' tensors (the end-of-sequence mask, the same values
            # for every call of this key): kept with it
            entry = self.graphs[key] = (self._capture(sequence, active), self.processors, *self._graph_inputs())
        return entry[0]

    def _graph_inputs(self) -> tuple:
        """The buffers a graph reads and writes, by identity."""
        return self.logits, self._out, self._token, self._noise

    def _capture(self, sequence: torch.Tensor, active: tuple[bool, ...]) -> Any:
        """The choice as a CUDA graph for one state of the minimum-length processors (warmed up on a side stream
        first, as torch asks; no random numbers inside: the noise is drawn before each replay)."""
        device = self.logits.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._compute(sequence, active)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            self._compute(sequence, active)
        torch.cuda.synchronize(device)
        logger.debug("psr_hf.engine: the token choice captured as a CUDA graph (%d processors)",
                     len(self.processors))
        return graph
