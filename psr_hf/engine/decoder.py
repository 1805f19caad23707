"""The engine's eager batch-1 decoder: the building blocks of :mod:`psr_hf.engine.layers` and
:mod:`psr_hf.engine.moe` chained per token, routed by the patched model's own
:class:`~psr_hf.hf.controller.Controller`; and :class:`DecoderBase`, what both decoders build on their step.

Per step, for each MoE layer: the router logits and the family's scores, moved to the host in one transfer, then
the ``select`` of the controller's decode handle (part 2 of the policy, recording, statistics, the offload's demand
copies) and ``prefetch`` of the next MoE layer (part 1, issued before this layer's experts run), the execution
weights from the unmodified logits and the MoE over expert slots into the residual. Every routing decision is the
controller's. This eager version is the reference of the CUDA-graph decoder (:mod:`psr_hf.engine.graphs`); the
places the graph version changes are marked ``GRAPH:``. Page: docs/engine.md.
"""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING, Callable, Sequence, Union

import numpy as np
import torch

from psr_hf.hf.patching import controller as _controller
from .families import build_layers
from .layers import DecodeLayers
from .prefill import prefill_block
from .moe import check_experts_module
from .slot_moe import slot_moe
from .grad_off import grad_off

if TYPE_CHECKING:
    from psr_hf.hf.controller import Controller
    from psr_hf.hf.decode_handle import DecodeHandle
    from psr_hf.offload.store import PatchedExpertStore

logger = logging.getLogger(__name__)

#: token ids of one row: a list, a ``[S]`` or ``[1, S]`` tensor or array
TokenIds = Union[Sequence[int], np.ndarray, torch.Tensor]


def _token_list(input_ids: TokenIds) -> list[int]:
    """``input_ids`` as a list of ints: a list, a ``[S]`` or ``[1, S]`` tensor or array."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().to("cpu")
        if input_ids.ndim == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"the engine decodes batch 1; got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    ids = np.asarray(input_ids)
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"the engine decodes batch 1; got input_ids of shape {ids.shape}")
        ids = ids[0]
    return [int(t) for t in ids.reshape(-1).tolist()]



def moe_layers_of(L: DecodeLayers, ctl: Controller) -> list[int]:
    """The decoder indices of ``L``'s MoE layers, checked against the controller that routes them (the same layers
    in the same order, the same experts and top-k); ``ValueError`` otherwise."""
    moe_layers = [d for d in range(L.num_layers) if L.is_moe(d)]
    if len(moe_layers) != ctl.num_layers or [L.moe_index(d) for d in moe_layers] != list(range(ctl.num_layers)):
        raise ValueError(f"the engine finds {len(moe_layers)} MoE layers, the controller routes "
                         f"{ctl.num_layers}: they must be the same layers in the same order")
    if L.num_experts != ctl.num_experts or L.top_k != ctl.top_k:
        raise ValueError(f"the engine's (experts, top_k) = ({L.num_experts}, {L.top_k}) differ from the "
                         f"controller's ({ctl.num_experts}, {ctl.top_k})")
    return moe_layers


class DecoderBase(abc.ABC):
    """What both decoders (:class:`Decoder`, :class:`~psr_hf.engine.graphs.GraphDecoder`) do with their
    ``step(token)`` and ``reset()``: a prompt, and greedy decoding of a new sequence."""

    model: torch.nn.Module
    layers: DecodeLayers
    controller: Controller
    decode_handle: DecodeHandle  # the controller's: its steps route this decoder's

    @abc.abstractmethod
    def reset(self) -> None:
        """Start a new sequence at the next step."""

    @abc.abstractmethod
    def step(self, token: int) -> torch.Tensor:
        """One token at the next position; returns the ``[1, V]`` logits buffer."""

    # ------------------------------------------------------------------ sequences of steps
    position: int

    def check_sequence_start(self) -> None:
        """What a new sequence checks before its first position: the prefetch ranking the router stacks were built
        for, and that the model tensors the engine reads have not moved (``RuntimeError`` otherwise); then the
        layers' recurrent state, where the family has one, is cleared (:meth:`DecodeLayers.begin_sequence`)."""
        self.layers.check_prefetch_source(self.controller)
        self.layers.check_references(self.controller.expert_store.offloaded)
        self.layers.begin_sequence()

    @grad_off
    def step_chosen(self, read_token: Callable[[], int | None],
                    overlap: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, int | None]:
        """Decode the token the device just chose into the token buffer (:mod:`psr_hf.engine.token_selection`),
        continuing a sequence: ``read_token()`` gives it, or None to stop there (nothing is stepped). ``overlap``:
        host work for while the step computes (run here before the step). Returns ``(logits buffer or None,
        token)``. The CUDA-graph decoder launches its first graph before reading."""
        if self.position == 0:
            raise ValueError("step_chosen continues a sequence; its first token is a prefill or step(token)")
        token = read_token()
        if token is None:
            return None, None
        if overlap is not None:
            overlap()
        return self.step(int(token)), int(token)

    @torch.no_grad()
    def prefill(self, input_ids: TokenIds, *, batched: bool | None = None) -> torch.Tensor:
        """Start a new sequence with the prompt ``input_ids`` (a list, ``[S]`` or ``[1, S]``) and return the last
        position's ``[1, V]`` logits buffer. ``batched`` (default: for more than one token, where the family writes
        the KV rows of a block: ``layers.batched_prefill``) runs the prompt as one
        block through the patched model's forward, filling the engine's KV cache on the way
        (:mod:`psr_hf.engine.prefill`): the same routing decisions as ``batched=False``, which runs :meth:`step`
        token by token."""
        ids = _token_list(input_ids)
        if not ids:
            raise ValueError("prefill needs at least one token")
        if batched is None:
            batched = len(ids) > 1 and self.layers.batched_prefill
        elif batched and not self.layers.batched_prefill:
            raise ValueError(f"prefill(batched=True): the {self.layers.model_type} engine layers define neither "
                             "_prompt_kv nor _transformers_kv (the KV rows of a prompt block); use batched=False")
        self.reset()
        if not batched:
            logits = None
            for token in ids:
                logits = self.step(token)
            return logits
        self.layers.check_position(len(ids) - 1)
        self.check_sequence_start()
        prefill_block(self.layers, self.model, ids, self.layers.buffers.logits)
        self.position = len(ids)
        return self.layers.buffers.logits

    @torch.no_grad()
    def generate_greedy(self, input_ids: TokenIds, max_new_tokens: int, *,
                        eos_token_id: int | Sequence[int] | None = None, return_logits: bool = False,
                        batched: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding of a new sequence, as ``model.generate(input_ids, do_sample=False,
        max_new_tokens=...)`` for one row without logits processors: returns the ``[1, S + n]`` int64 sequence
        (prompt and the ``n <= max_new_tokens`` new tokens; it stops after an end-of-sequence token, which is not
        fed back, nor is the last token). ``eos_token_id``: default the model's generation config's.
        ``return_logits``: also the ``[n, V]`` float32 logits of every new token. ``batched``: the prompt's
        prefill (:meth:`prefill`)."""
        ids = _token_list(input_ids)
        if eos_token_id is None:
            config = getattr(self.model, "generation_config", None)
            eos_token_id = getattr(config, "eos_token_id", None)
        stop = set() if eos_token_id is None else ({int(eos_token_id)} if isinstance(eos_token_id, int)
                                                   else {int(t) for t in eos_token_id})
        new: list[int] = []
        scores: list[torch.Tensor] = []
        if max_new_tokens > 0:
            logits = self.prefill(ids, batched=batched)
            while True:
                if return_logits:
                    scores.append(logits[0].float().cpu().clone())
                token = int(torch.argmax(logits[0]))
                new.append(token)
                if token in stop or len(new) == max_new_tokens:
                    break
                logits = self.step(token)
        sequence = torch.tensor([ids + new], dtype=torch.int64)
        if return_logits:
            V = self.layers.buffers.logits.shape[-1]
            return sequence, (torch.stack(scores) if scores else torch.zeros(0, V))
        return sequence


class Decoder(DecoderBase):
    """Batch-1 eager decoder of a model patched by :func:`psr_hf.patch` (resident, or offloaded with
    ``offload=OffloadConfig(...)``), with a static KV cache of ``max_len`` positions.

    ``step(token)`` decodes the next position and returns the ``[1, V]`` logits buffer (rewritten by the next
    step); :meth:`prefill` runs a prompt through the same step (a new sequence); :meth:`generate_greedy`
    prefills and decodes greedily; :meth:`reset` starts a new sequence. The routing state, statistics and
    recording are the controller's (``psr_hf.controller(model)``): the decoder is one more caller of it.
    ``backend``: the slot MoE's (:func:`psr_hf.engine.moe.choose_backend`); ``absorb_mla``: DeepSeek-V3
    attention; ``gated_delta_kernel``: the Gated DeltaNet step of Qwen3.5/3.6-MoE and Qwen3-Next as one Triton kernel
    (None: on CUDA where it runs; :class:`~psr_hf.engine.families.qwen3_5_moe.Qwen35MoeLayers`);
    ``attention_kernels``: every family's attention over the filled slots (and OLMoE's and Qwen's q/k/v) as Triton
    kernels (None: on CUDA where they run; :class:`~psr_hf.engine.families.olmoe.OlmoeLayers`); ``dense_fp8``:
    the dense projections in block-wise FP8 from the checkpoint the offload's FP8 experts come from (None:
    where it can; :mod:`psr_hf.engine.dense_fp8`), all the families' own options
    (:func:`psr_hf.engine.families.build_layers`).
    """

    def __init__(self, model: torch.nn.Module, max_len: int, *, absorb_mla: bool = True, backend: str = "auto",
                 gated_delta_kernel: bool | None = None, attention_kernels: bool | None = None,
                 dense_fp8: bool | None = None):
        self.model = model
        self.controller = _controller(model)
        self.decode_handle = self.controller.decode_handle()
        self.layers: DecodeLayers = build_layers(model, max_len, absorb_mla=absorb_mla,
                                                 gated_delta_kernel=gated_delta_kernel,
                                                 attention_kernels=attention_kernels, dense_fp8=dense_fp8)
        self.backend = backend
        L = self.layers
        ctl = self.controller
        self.moe_layers = moe_layers_of(L, ctl)  # decoder indices of the MoE layers
        b = L.buffers
        for m, d in enumerate(self.moe_layers):
            check_experts_module(ctl.layers[m].block.experts)  # the layout the slot MoE reads
            slot_moe(ctl.expert_store, m, L.device).check(b.normed[0], b.expert_ids[0], b.expert_weights[0],
                                                          b.hidden[0], b.hidden[0], self.layers.config)
        self.position = 0  # the next position to decode

    # ------------------------------------------------------------------ sequences
    def reset(self) -> None:
        """Start a new sequence: the next step decodes position 0 (which starts the controller's new sequence)."""
        self.position = 0

    # ------------------------------------------------------------------ one step
    @grad_off
    def step(self, token: int) -> torch.Tensor:
        """Decode ``token`` at the next position; returns the static ``[1, V]`` logits buffer."""
        L, b, handle = self.layers, self.layers.buffers, self.decode_handle
        position = self.position
        L.check_position(position)
        if position == 0:
            self.check_sequence_start()
        else:
            L.check_prefetch_source(self.controller)
        L.sync_routers(handle)
        token = int(token)
        b.token.fill_(token)  # GRAPH: written by the host into the static buffers before graph A of layer 0
        b.position.fill_(position)
        with handle.step(token, position):  # opens the one-token forward (a new sequence at position 0)
            L.embed(b.token, b.hidden)
            for d in range(L.num_layers):
                L.attention_block(d, b.hidden, b.position, b.hidden, b.normed)  # GRAPH: graph A
                if L.is_moe(d):
                    self._moe_layer(d)
                else:
                    L.dense_mlp(d, b.normed, b.mlp_out)
                    b.hidden.add_(b.mlp_out)
            L.final(b.hidden, b.logits)
        self.position = position + 1
        return b.logits

    def _moe_layer(self, d: int) -> None:
        L, b, handle = self.layers, self.layers.buffers, self.decode_handle
        m = L.moe_index(d)
        E = L.num_experts
        width = L.router_width(d)
        logits, scores = b.router_logits[:, :width], b.router_scores[:, :width]
        L.router_logits(d, b.normed, logits)  # GRAPH: graph A, with the scores
        L.router_scores(d, logits, scores)
        # the one device-to-host transfer of the layer (it synchronises). GRAPH: graph A copies the scores into a
        # pinned host buffer and records an event; the host waits on that event only
        host = scores.float().cpu().numpy().copy()  # [1, width]: z | the next MoE layer's pre-gate (a copy: on
        # the CPU, .cpu() of a float32 tensor is the static buffer itself)
        pregate = host[0, E:] if width > E and handle.needs_pregate else None
        selection = handle.select(m, host[0, :E], pregate)
        if pregate is not None:
            handle.prefetch(m + L.distance)  # part 1 of a later MoE layer: its copies run while this layer computes
        # the selected experts to the device (from the controller's staging buffer, pinned on CUDA)
        b.expert_ids.copy_(selection.tensor, non_blocking=True)
        shared = L.has_shared_experts(d)
        out, residual = (b.mlp_out, None) if shared else (b.hidden, b.hidden)
        # the copies of the layer's selection (issued by select) are waited for and its experts mapped to their
        # slots (resident: slot = expert id). GRAPH: offloaded, the layer's persistent device slot map, uploaded
        # from a pinned buffer when it changed (OffloadedExperts._compute), gathered by the selected expert ids
        # inside graph B; resident, graph B reads the expert ids themselves
        store = self.controller.expert_store
        slots = torch.from_numpy(store.decode_slots(m, selection.experts)).to(L.device)
        # weighed by the execution weights of the unmodified logits. GRAPH: graph B
        L.routed_experts(d, slot_moe(store, m, L.device), slots, logits, out, residual, backend=self.backend)
        store.decode_done(m)  # the slots may be overwritten after this; GRAPH: after graph B's replay is enqueued
        if shared:  # transformers: routed + shared, then the residual
            L.shared_expert(d, b.normed, b.shared_out)
            b.mlp_out.add_(b.shared_out)
            b.hidden.add_(b.mlp_out)

