"""Speculative decoding in transformers with block-level expert selection (docs/speculative.md): a drafter proposes
``k`` greedy tokens, the target verifies the ``k + 1`` positions in one forward pass whose MoE routers route every
position within the block's eligible set (:class:`psr_hf.policy.blocks.BlockPool`, the selection the engine makes
too), and greedy acceptance commits ``tau = a + 1`` tokens. Routing is logical: nothing is offloaded here, the
copies are the host loads the block selection implies (the engine performs them, :mod:`psr_hf.engine.speculative`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..patches import get_patch
from ..policy import MASS_SOFTMAX
from ..policy.blocks import BlockConfig, BlockPool, BlockRecord
from .installation import CONTROLLER_ATTRIBUTE

if TYPE_CHECKING:
    from ..patches.base import ArchitecturePatch, MoELayer

logger = logging.getLogger(__name__)

DEFAULT_DRAFT_TOKENS = 16


@dataclass
class SpeculativeResult:
    """One speculative generation: the new ``tokens``, per verification block its ``accepted`` drafts and its
    ``copies`` (host loads over every layer), the prompt's copies, and (``record=True``) the blocks as
    :class:`~psr_hf.policy.blocks.BlockRecord` (the prompt first) with the executed sets per block and layer."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    prompt_copies: int = 0
    records: list[BlockRecord] | None = None
    executed: list[list[np.ndarray]] | None = None

    @property
    def verifications(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Committed tokens per verification."""
        return float(np.mean(np.asarray(self.accepted) + 1)) if self.accepted else float("nan")

    @property
    def copies_per_token(self) -> float:
        return sum(self.copies) / max(len(self.tokens), 1)


def moe_routers(model: torch.nn.Module, block: BlockConfig | None = None) -> tuple[ArchitecturePatch, list[MoELayer]]:
    """The family patch of ``model`` and its MoE layers; ``ValueError`` where block selection does not apply, or
    where ``block``'s ``top_k`` is not the routers'."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    family = get_patch(config.model_type)(model)
    if family.router_mass != MASS_SOFTMAX:
        raise ValueError(f"block-level selection is defined for softmax routers; {config.model_type} routes with "
                         "another scoring (docs/speculative.md)")
    layers = family.moe_layers()
    if block is not None:
        for layer in layers:
            block.check_top_k(layer.router.top_k)
    return family, layers


@contextlib.contextmanager
def own_routing(*models: torch.nn.Module) -> Iterator[None]:
    """The patched ones of ``models`` run their own routers in this thread (their controllers bypassed, their
    state left alone) and hold their controllers' locks, so another thread's call of such a model waits for the
    block and then routes and counts as usual. The locks are taken in one order (by controller identity), so two
    threads that swap target and drafter cannot deadlock. Nothing for an unpatched model."""
    controllers = {}
    for model in models:
        ctl = getattr(model, CONTROLLER_ATTRIBUTE, None)
        if ctl is None:
            continue
        if ctl.expert_store.offloaded:
            raise ValueError("speculative decoding in the harness routes logically; patch the target without "
                             "offload (the engine, psr_hf.engine.SpeculativeEngine, performs the copies)")
        controllers[id(ctl)] = ctl
    with contextlib.ExitStack() as stack:
        for key in sorted(controllers):
            stack.enter_context(controllers[key]._lock)
            stack.enter_context(controllers[key].bypassed())
        yield


class BlockRouting:
    """The target's routers replaced by the block selection of ``pool`` while :meth:`installed` is open, in the
    thread that opened it (other threads' router calls pass through untouched): each router call (one forward of
    ``S`` positions, batch 1) routes layer by layer through :meth:`BlockPool.select`, with weights from the
    unmodified scores. ``ValueError`` where the pool's ``top_k`` is not the routers'."""

    def __init__(self, model: torch.nn.Module, pool: BlockPool):
        self.family, self.layers = moe_routers(model, pool.config)
        self.pool = pool
        self.choices: list | None = None  # the open block's LayerChoice per layer
        self.scores: list | None = None

    def _hook(self, index: int, thread: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            if threading.get_ident() != thread:
                return None  # another thread's call of the model: its own routing
            if self.choices is None:
                raise RuntimeError(f"psr_hf speculative: MoE layer {index} ran outside a block")
            logits = output[0]
            z = self.family.selection_scores(module, logits.detach()).float().cpu().numpy()
            choice = self.pool.select(index, z)
            self.choices.append(choice)
            self.scores.append(z)
            chosen = torch.from_numpy(choice.selected).to(logits.device)
            weights = self.family.execution_weights(module, logits, chosen)
            return (logits, weights.to(output[1].dtype), chosen)

        return hook

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        thread = threading.get_ident()
        handles = [layer.router.register_forward_hook(self._hook(layer.index, thread)) for layer in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """One forward pass as one block: the layer choices and scores gathered in order. An exception inside
        (``KeyboardInterrupt``, out of memory) propagates as itself; only a forward that ended normally is checked."""
        self.choices, self.scores = [], []
        try:
            yield
        except BaseException:
            self.choices = self.scores = None
            raise
        if len(self.choices) != len(self.layers):
            self.choices = self.scores = None
            raise RuntimeError("psr_hf speculative: the forward pass did not route every MoE layer once")


def crop(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of a transformers cache (a negative ``crop`` removes positions in every
    transformers version this package supports)."""
    remove = cache.get_seq_length() - int(length)
    if remove > 0:
        cache.crop(-remove)


def forward_logits(model: torch.nn.Module, ids: list[int], cache: Any) -> torch.Tensor:
    """Logits ``[S, V]`` of ``ids`` continuing ``cache``."""
    from .inputs import cache_keyword

    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, **{cache_keyword(model): cache})
    return out.logits[0].float()


class Drafter:
    """Greedy drafts from a causal LM with its own KV cache, rolled back to the committed tokens each block."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()
        self.fed: list[int] = []  # tokens in the cache

    def draft(self, committed: list[int], k: int) -> tuple[list[int], list[float]]:
        common = 0
        for a, b in zip(self.fed, committed):
            if a != b:
                break
            common += 1
        common = min(common, len(committed) - 1)  # the last committed token is fed to get the first draft
        if common < len(self.fed):
            crop(self.cache, common)
            self.fed = self.fed[:common]
        pending = committed[common:]
        drafts, confidences = [], []
        for i in range(k):
            logits = forward_logits(self.model, pending, self.cache)[-1]
            self.fed += pending
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
            drafts.append(token)
            confidences.append(float(probs[token]))
            pending = [token]
        return drafts, confidences


def accepted_count(drafts: Sequence[int], verified: Sequence[int]) -> int:
    """Greedy acceptance: the longest prefix of ``drafts`` equal to the target's argmax ``verified[:-1]``."""
    a = 0
    while a < len(drafts) and drafts[a] == verified[a]:
        a += 1
    return a


@torch.no_grad()
def speculative_generate(target: torch.nn.Module, drafter: torch.nn.Module, input_ids: Any, config: BlockConfig, *,
                         max_new_tokens: int, draft_tokens: int = DEFAULT_DRAFT_TOKENS, calibration: Any = None,
                         eos_token_id: int | Sequence[int] | None = None,
                         stop: Callable[[list[int]], bool] | None = None, record: bool = False) -> SpeculativeResult:
    """Greedy speculative decoding of one prompt (``input_ids``: a list or ``[1, S]`` tensor) with block-level
    expert selection in the target (``config``: the mode, the pool of ``P`` experts per layer, the threshold;
    ``calibration``: its ``expert_counts`` give the warm pool). ``drafter`` shares the target's tokenizer. Stops
    after ``max_new_tokens``, an end-of-sequence token (kept), or when ``stop(new_tokens)`` is true after a
    block. Works on an unpatched target or one patched by :func:`psr_hf.patch` (its own routing is bypassed in this
    thread and its lock held for the call: another thread's ``generate()`` of it waits, then routes as usual).
    ``ValueError`` where ``config.top_k`` is not the target's top-K. An exception inside (``KeyboardInterrupt``
    included) propagates as itself and leaves the models usable."""
    from transformers import DynamicCache

    prompt = [int(t) for t in (input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else input_ids)]
    if not prompt:
        raise ValueError("speculative_generate needs a prompt of at least one token")
    if int(draft_tokens) < 1:
        raise ValueError(f"draft_tokens must be >= 1; got {draft_tokens}")
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if target.config.get_text_config().vocab_size != drafter.config.get_text_config().vocab_size:
        raise ValueError("the drafter's vocabulary differs from the target's: a drafter must share its tokenizer")
    eos = set() if eos_token_id is None else {int(eos_token_id)} if isinstance(eos_token_id, int) else {
        int(t) for t in eos_token_id}
    family, layers = moe_routers(target)
    counts = None if calibration is None else calibration.expert_counts
    pool = BlockPool(config, len(layers), int(layers[0].router.weight.shape[0]), counts)
    routing = BlockRouting(target, pool)
    drafter_model = Drafter(drafter)
    result = SpeculativeResult(tokens=[], records=[] if record else None, executed=[] if record else None)
    cache = DynamicCache()
    committed = list(prompt)
    with own_routing(target, drafter), routing.installed():
        if prefill_prompt(target, routing, prompt, cache):
            result.prompt_copies = sum(c.copies.size for c in routing.choices)
            _keep(result, routing, None, None)
        while len(result.tokens) < max_new_tokens:
            drafts, confidences = drafter_model.draft(committed, int(draft_tokens))
            pool.begin_block(confidences)
            past = len(committed) - 1
            with routing.block():
                logits = forward_logits(target, [committed[-1]] + drafts, cache)
            verified = torch.argmax(logits, dim=-1).tolist()
            a = accepted_count(drafts, verified)
            pool.end_block(a)
            crop(cache, past + a + 1)
            result.accepted.append(a)
            result.copies.append(sum(c.copies.size for c in routing.choices))
            _keep(result, routing, confidences, a)
            if commit(drafts[:a] + [verified[a]], result.tokens, committed, eos, max_new_tokens, stop):
                return result
    return result


def prefill_prompt(target: torch.nn.Module, routing: BlockRouting, prompt: list[int], cache: Any) -> bool:
    """The prompt less its last token as one exact block into ``cache`` (docs/speculative.md, "A sequence");
    False for a one-token prompt, which has none."""
    if len(prompt) < 2:
        return False
    routing.pool.begin_prompt(len(prompt) - 1)
    with routing.block():
        forward_logits(target, prompt[:-1], cache)
    routing.pool.end_block(None)
    return True


def commit(new: list[int], tokens: list[int], committed: list[int], eos: set[int], max_new_tokens: int,
           stop: Callable[[list[int]], bool] | None) -> bool:
    """Append a block's committed tokens to the generated ``tokens`` and the sequence; whether generation ends
    (an end-of-sequence token, kept; ``max_new_tokens``; ``stop(tokens)`` after the block)."""
    for token in new:
        tokens.append(token)
        committed.append(token)
        if token in eos or len(tokens) >= max_new_tokens:
            return True
    return stop is not None and stop(tokens)


def _keep(result: SpeculativeResult, routing: BlockRouting, confidences: list[float] | None, a: int | None) -> None:
    if result.records is None:
        return
    result.records.append(BlockRecord(scores=np.stack(routing.scores),
                                      confidences=None if confidences is None else np.asarray(confidences), accepted=a))
    result.executed.append([c.selected for c in routing.choices])
