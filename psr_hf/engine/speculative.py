"""Speculative decoding in the engine with block-level expert selection (docs/speculative.md, "In the engine"):
the drafter decodes greedily in its own :class:`~psr_hf.engine.graphs.GraphDecoder` (exact routing, resident);
the target verifies the ``k + 1`` positions layer by layer in CUDA graphs over the engine's layers: graph A_m
(attention over the static KV cache, the router's scores to pinned host memory), the block selection on the host
(:class:`psr_hf.policy.blocks.BlockPool`, the harness's), the copies of the missing experts from pinned host memory
on a copy stream that the layer waits on, graph B_m (the experts of every position from the slot buffers through
transformers' grouped experts function). The experts are selected from the layer's own router outputs, known only
after its attention, so copies are not prefetched: they are exposed, as in the paper. OLMoE-family targets.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..offload.links import new_link
from ..offload.store import SlotExperts
from ..hf.speculative import accepted_count, commit
from ..policy.blocks import BlockConfig, BlockPool
from .attention import apply_rope, cos_sin, rms_norm
from .families import build_layers
from .moe import check_experts_module

if TYPE_CHECKING:
    from ..policy.calibration import Calibration
    from .graphs import GraphDecoder

logger = logging.getLogger(__name__)


def block_attention(s: Any, a: dict, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """OLMoE attention of ``S`` consecutive positions ``x [S, H]`` at ``positions [S]``, writing their KV rows into
    ``keys``/``values [T, nKV, D]`` and attending causally to every row up to each position."""
    S = x.shape[0]
    nH, nKV, D = s.num_heads, s.num_kv_heads, s.head_dim
    q = rms_norm(F.linear(x, *a["q_proj"]), *a["q_norm"])
    k = rms_norm(F.linear(x, *a["k_proj"]), *a["k_norm"])
    v = F.linear(x, *a["v_proj"])
    if s.clip_qkv is not None:
        q, k, v = (t.clamp(min=-s.clip_qkv, max=s.clip_qkv) for t in (q, k, v))
    cos, sin = cos_sin(positions[:, None], a["inv_freq"], s.rope_scaling, q.dtype, False)  # [S, D]
    q = apply_rope(q.view(S, nH, D), cos[:, None], sin[:, None], False)
    k = apply_rope(k.view(S, nKV, D), cos[:, None], sin[:, None], False)
    keys.index_copy_(0, positions, k)
    values.index_copy_(0, positions, v.view(S, nKV, D))
    G = nH // nKV
    q = q.view(S, nKV, G, D).permute(1, 2, 0, 3)  # [nKV, G, S, D]
    scores = torch.matmul(q, keys.permute(1, 2, 0)[:, None]) * s.scaling  # [nKV, G, S, T]
    scores = scores.masked_fill(slots[None, :] > positions[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.permute(1, 0, 2)[:, None])  # [nKV, G, S, D]
    return F.linear(out.permute(2, 0, 1, 3).reshape(S, nH * D), *a["o_proj"])


class ExpertSlots:
    """The speculative engine's :class:`~psr_hf.offload.store.ExpertStore`. Per MoE layer: the experts in pinned
    host memory (the store), ``slots`` device slots, which expert each holds logically (``slot_of``) and
    physically (``content``), and the copies into free slots on the offload's copy link
    (:func:`~psr_hf.offload.links.new_link`: raw runtime calls on CUDA where cuda-python imports, a copy thread on
    the CPU), which the layer's next computation waits for (``copy=False``: the same bookkeeping, no copy). The
    block selection decides what is loaded (:meth:`load`, :meth:`keep`)."""

    offloaded = True
    weight_format = "model"
    slot_generation = 0  # the slot buffers are allocated once, here

    def __init__(self, experts_modules: list[torch.nn.Module], slots: int, device: torch.device, copy: bool = True):
        self.device, self.copy = torch.device(device), bool(copy)
        self.capacity = int(slots)
        device = self.device
        self.cuda = device.type == "cuda"
        self.store: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.buffers: list[dict[str, torch.Tensor]] = []
        for module in experts_modules:
            gate_up, down = check_experts_module(module)
            pin = self.cuda
            self.store.append(tuple(t.detach().to("cpu").contiguous().pin_memory() if pin else
                                    t.detach().to("cpu").contiguous() for t in (gate_up, down)))
            self.buffers.append({"gate_up_proj": torch.zeros((slots,) + gate_up.shape[1:], dtype=gate_up.dtype,
                                                             device=device),
                                 "down_proj": torch.zeros((slots,) + down.shape[1:], dtype=down.dtype, device=device)})
        self.num_experts = self.store[0][0].shape[0]
        self._modules = [SlotExperts(module, buffers, self.capacity)
                         for module, buffers in zip(experts_modules, self.buffers)]
        self.slot_of = np.full((len(self.store), self.num_experts), -1, dtype=np.int64)
        self.content = np.full((len(self.store), int(slots)), -1, dtype=np.int64)  # -1: no expert's weights
        self.link = new_link(device, 0.0)
        self._dst, self._src = self.link.prepare(
            [[[b["gate_up_proj"][s], b["down_proj"][s]] for s in range(self.capacity)] for b in self.buffers],
            [[[gate_up[e], down[e]] for e in range(self.num_experts)] for gate_up, down in self.store])
        self._issued = 0  # the link's next copy number
        weakref.finalize(self, self.link.close)
        self.copies = 0  # logical loads
        self.transfers = 0  # copies performed

    # ------------------------------------------------------------------ what a layer's computation reads
    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        gate_up, down = self.store[layer]
        return {"gate_up_proj": gate_up, "down_proj": down}

    def slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return self.buffers[layer]

    def experts_module(self, layer: int) -> SlotExperts:
        return self._modules[layer]

    def decode_slots(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The slot of each of ``experts`` (loaded by :meth:`load`, which made the computation wait for them)."""
        return self.slot_of[layer][experts]

    def decode_done(self, layer: int) -> None:
        self.link.read_done(layer)  # the next copy into this layer's slots waits for the computation issued

    # ------------------------------------------------------------------ what the block selection loads
    def reset(self) -> None:
        self.slot_of[:] = -1

    def load(self, layer: int, experts: np.ndarray, reuse: bool = False) -> None:
        """Copy ``experts`` of ``layer`` into free slots (the layer's next compute waits for them). ``reuse``: an
        expert whose weights a free slot still holds takes that slot without a copy; only the untimed setup of a
        generation (warm pool, prompt block) reuses, so every load of a timed decode step is a copy."""
        if experts.size == 0:
            return
        held, content = self.slot_of[layer], self.content[layer]
        in_use = np.zeros(content.size, dtype=bool)
        in_use[held[held >= 0]] = True
        free = np.flatnonzero(~in_use)
        if free.size < experts.size:
            raise RuntimeError(f"psr_hf speculative engine: layer {layer} needs {experts.size} free slots, has "
                               f"{free.size}")
        missing = experts
        if reuse:
            holder = np.full(self.num_experts, -1, dtype=np.int64)
            kept = free[content[free] >= 0]
            holder[content[kept]] = kept
            hits = holder[experts] >= 0
            held[experts[hits]] = holder[experts[hits]]
            missing = experts[~hits]
            free = np.setdiff1d(free, holder[experts[hits]], assume_unique=True)
        free = free[:missing.size]
        held[missing] = free
        self.copies += int(experts.size)
        if not self.copy or missing.size == 0:
            return
        content[free] = missing
        self.transfers += int(missing.size)
        for e, slot in zip(missing.tolist(), free.tolist()):
            self.link.copy(self._issued, layer, slot, e, self._dst[layer][slot], self._src[layer][e])
            self._issued += 1
        self.link.wait(self._issued - 1)

    def keep(self, layer: int, members: np.ndarray) -> None:
        """After a block: only the pool's experts keep their slots (the others' slots are free)."""
        self.slot_of[layer][~members] = -1


@dataclass
class SpeculativeRun:
    """One prompt's speculative generation in the engine: the new ``tokens``, per verification its ``accepted``
    drafts and ``copies``, and the seconds spent drafting and verifying (host wall time, the GPU's included)."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0


class SpeculativeEngine:
    """Greedy speculative decoding of ``target`` (an OLMoE-family causal LM on one device) with ``drafter``
    (a causal LM with the same vocabulary that the engine decodes: it is patched with exact routing if it is not
    patched) and block-level selection by ``config``; ``slots``: device slots per layer (default: every expert,
    the pool plus the largest possible union of a block); ``copies=False``: the copies skipped (compute-only
    time; the outputs are not meaningful); ``graphs``: the verification in CUDA graphs (CUDA only). ``ValueError``
    where ``config.top_k`` is not the target's top-K."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module | GraphDecoder, config: BlockConfig, *,
                 draft_tokens: int = 16, max_len: int = 2048, calibration: Calibration | None = None,
                 slots: int | None = None, copies: bool = True, graphs: bool = True,
                 experts: ExpertSlots | None = None):
        from .. import RoutingConfig, patch
        from ..hf.installation import CONTROLLER_ATTRIBUTE
        from ..hf.speculative import moe_routers
        from .graphs import GraphDecoder

        if int(draft_tokens) < 1:
            raise ValueError(f"draft_tokens must be >= 1; got {draft_tokens}")
        if getattr(target, CONTROLLER_ATTRIBUTE, None) is not None:
            raise ValueError("SpeculativeEngine routes the target itself: pass an unpatched target model")
        self.family, moe = moe_routers(target, config)
        self.layers = L = build_layers(target, max_len)
        if L.model_type != "olmoe":
            raise ValueError(f"SpeculativeEngine supports OLMoE-family targets; got {L.model_type}")
        self.device = L.device
        self.cuda = self.device.type == "cuda"
        self.graphs = bool(graphs) and self.cuda
        self.config, self.k, self.S = config, int(draft_tokens), int(draft_tokens) + 1
        self.routers = [m.router for m in moe]
        E = L.num_experts
        config.check_experts(E)
        self.expert_counts = None if calibration is None else calibration.expert_counts
        # several engines of one target (modes, k) may share one store and its slots: each generate() starts afresh
        self.experts = experts if experts is not None else ExpertSlots(
            [m.block.experts for m in moe], E if slots is None else int(slots), self.device)
        self.copies = bool(copies)
        if self.experts.capacity < min(E, config.pool + self.S * L.top_k):
            logger.warning("SpeculativeEngine: %d slots per layer may be fewer than a block's union needs",
                           self.experts.capacity)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        # transformers' grouped experts function: sorted by slot, one grouped matmul, capturable (histc offsets)
        self._grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
        if isinstance(drafter, GraphDecoder):  # shared by several engines
            self.drafter = drafter
        else:
            if getattr(drafter, CONTROLLER_ATTRIBUTE, None) is None:
                patch(drafter, RoutingConfig(policy="exact", residency=1.0))
            self.drafter = GraphDecoder(drafter, max_len, graphs=self.graphs)
        if self.drafter.layers.embed_weight.shape[0] != L.embed_weight.shape[0]:
            raise ValueError("the drafter's vocabulary differs from the target's: a drafter must share its tokenizer")
        self._drafted: list[int] = []  # the tokens in the drafter's KV cache
        self._buffers(self.S)
        self._graph_units: list[Callable[[], None]] | None = None
        if self.graphs:
            self._capture()

    # ------------------------------------------------------------------ the verification's buffers and bodies
    def _buffers(self, S: int) -> None:
        L, E, K = self.layers, self.layers.num_experts, self.layers.top_k
        dev, pin = self.device, self.cuda
        self.tokens = torch.zeros(S, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(S, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(S, L.hidden_size, dtype=L.dtype, device=dev)
        self.normed = torch.zeros_like(self.hidden)
        self.logits = [torch.zeros(S, E, dtype=L.dtype, device=dev) for _ in self.routers]
        self.host_scores = [torch.zeros(S, E, dtype=torch.float32, pin_memory=pin) for _ in self.routers]
        self.host_ids = [torch.zeros(S, K, dtype=torch.int64, pin_memory=pin) for _ in self.routers]
        self.host_slots = [torch.zeros(S, K, dtype=torch.int64, pin_memory=pin) for _ in self.routers]
        self.ids = torch.zeros(S, K, dtype=torch.int64, device=dev)
        self.slot_ids = torch.zeros(S, K, dtype=torch.int64, device=dev)
        self.host_inputs = torch.zeros(2, S, dtype=torch.int64, pin_memory=pin)
        self.out_logits = torch.zeros(S, L.lm_head_weight.shape[0], dtype=L.dtype, device=dev)
        self.host_argmax = torch.zeros(S, dtype=torch.int64, pin_memory=pin)

    def _body_a(self, m: int) -> None:
        L = self.layers
        if m == 0:
            self.tokens.copy_(self.host_inputs[0], non_blocking=True)
            self.positions.copy_(self.host_inputs[1], non_blocking=True)
            torch.index_select(L.embed_weight, 0, self.tokens, out=self.hidden)
        (w_in, eps_in), (w_post, eps_post) = L._norms[m]
        _, static, tensors = L._layer_attention(m)
        keys, values, slots = L._cache(m)[:3]  # (the decode kernel's locks are not used here)
        self.hidden.add_(block_attention(static, tensors, L.norm_fn(self.hidden, w_in, eps_in), self.positions, keys,
                                         values, slots))
        self.normed.copy_(L.norm_fn(self.hidden, w_post, eps_post))
        self.logits[m].copy_(F.linear(self.normed, self.routers[m].weight))
        self.host_scores[m].copy_(self.family.selection_scores(self.routers[m], self.logits[m]).float(),
                                  non_blocking=True)

    def _body_b(self, m: int) -> None:
        self.ids.copy_(self.host_ids[m], non_blocking=True)
        self.slot_ids.copy_(self.host_slots[m], non_blocking=True)
        weights = self.family.execution_weights(self.routers[m], self.logits[m], self.ids)
        self.hidden.add_(self._grouped(self.experts.experts_module(m), self.normed, self.slot_ids, weights))

    def _body_c(self) -> None:
        L = self.layers
        x = L.norm_fn(self.hidden, L.final_norm_weight, L.final_norm_eps)
        self.out_logits.copy_(F.linear(x, L.lm_head_weight, L.lm_head_bias))
        self.host_argmax.copy_(torch.argmax(self.out_logits, dim=-1), non_blocking=True)

    def _units(self) -> list[Callable[[], None]]:
        n = len(self.routers)
        return [lambda m=m: self._body_a(m) for m in range(n)] + [lambda m=m: self._body_b(m) for m in range(n)] + [
            self._body_c]

    @torch.no_grad()
    def _capture(self) -> None:
        units = self._units()
        self.host_inputs[1].copy_(torch.arange(self.S))
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                for unit in units:
                    unit()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for unit in units:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                unit()
            graphs.append(graph)
        torch.cuda.synchronize(self.device)
        self._graphs = graphs
        self._graph_units = [g.replay for g in graphs]
        self.layers.kv.reset()

    # ------------------------------------------------------------------ one block through the target
    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def _verify(self, pool: BlockPool, tokens: Sequence[int], start: int, graphs: bool,
                reuse: bool = False) -> tuple[np.ndarray, int]:
        """Run ``tokens`` at positions ``start ..`` as the open block of ``pool``; the target's argmax per position
        and the block's copies (``reuse``: see :meth:`ExpertSlots.load`)."""
        S, n = len(tokens), len(self.routers)
        self.host_inputs[0, :S] = torch.tensor(tokens, dtype=torch.int64)
        self.host_inputs[1, :S] = torch.arange(start, start + S, dtype=torch.int64)
        units = self._graph_units if graphs else self._units()
        copies = 0
        for m in range(n):
            units[m]()
            self._sync()
            choice = pool.select(m, self.host_scores[m].numpy()[:S])
            self.experts.load(m, choice.copies, reuse=reuse)
            copies += int(choice.copies.size)
            self.host_ids[m].numpy()[:S] = choice.selected
            self.host_slots[m].numpy()[:S] = self.experts.decode_slots(m, choice.selected)
            units[n + m]()
            self.experts.decode_done(m)
            self.experts.keep(m, pool._members[m])
        units[2 * n]()
        self._sync()
        return self.host_argmax.numpy()[:S].copy(), copies

    def _prompt(self, pool: BlockPool, prompt: list[int]) -> None:
        """The prompt less its last token as one exact block, eagerly in buffers of its length."""
        body = prompt[:-1]
        if not body:
            return
        saved = self._saved_buffers()
        self._buffers(len(body))
        try:
            pool.begin_prompt(len(body))
            self._verify(pool, body, 0, graphs=False, reuse=True)
            pool.end_block(None)
        finally:
            self._restore_buffers(saved)

    def _saved_buffers(self) -> dict:
        names = ("tokens", "positions", "hidden", "normed", "logits", "host_scores", "host_ids", "host_slots", "ids",
                 "slot_ids", "host_inputs", "out_logits", "host_argmax")
        return {name: getattr(self, name) for name in names}

    def _restore_buffers(self, saved: dict) -> None:
        for name, value in saved.items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ drafting
    def _draft(self, committed: list[int]) -> tuple[list[int], list[float]]:
        d = self.drafter
        common = 0
        for a, b in zip(self._drafted, committed):
            if a != b:
                break
            common += 1
        common = min(common, len(committed) - 1)
        pending = committed[common:]
        if common == 0:
            d.reset()
            self._drafted = []
            if len(pending) > 1:
                d.prefill(pending[:-1])
                self._drafted = pending[:-1]
                pending = pending[-1:]
        else:
            d.position = common
            self._drafted = self._drafted[:common]
        for token in pending[:-1]:
            d.step(token)
            self._drafted.append(token)
        token = pending[-1]
        drafts, confidences = [], []
        for _ in range(self.k):
            logits = d.step(token)
            self._drafted.append(token)
            best = torch.softmax(logits[0].float(), dim=-1).max(dim=-1)
            pair = torch.stack((best.values, best.indices.float())).cpu()
            token = int(pair[1])
            drafts.append(token)
            confidences.append(float(pair[0]))
        return drafts, confidences

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, eos_token_id: int | Sequence[int] | None = None,
                 stop: Callable[[list[int]], bool] | None = None,
                 forced: SpeculativeRun | None = None) -> SpeculativeRun:
        """Greedy speculative decoding of one prompt (as :func:`psr_hf.hf.speculative.speculative_generate`).
        ``forced``: a run of the same prompt to follow: its committed tokens and accepted counts replace the
        target's (the drafts are the same, as the drafter sees the same tokens), so a run with the copies skipped
        times the verifications of the run it follows (its own argmax is not meaningful without the copies)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("SpeculativeEngine.generate needs a prompt of at least one token")
        if len(prompt) + int(max_new_tokens) + self.S > self.layers.max_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones (plus a block of "
                             f"{self.S}) exceed the engine's max_len {self.layers.max_len}; build it with a larger "
                             "max_len")
        if forced is not None and (any(a > self.k for a in forced.accepted) or len(forced.accepted) == 0):
            raise ValueError(f"forced: a run with k = {self.k} follows a run of the same k (accepted counts "
                             f"{forced.accepted[:8]}...)")
        eos = set() if eos_token_id is None else {int(eos_token_id)} if isinstance(eos_token_id, int) else {
            int(t) for t in eos_token_id}
        pool = BlockPool(self.config, len(self.routers), self.layers.num_experts, self.expert_counts)
        self.experts.reset()
        self.experts.copy = self.copies
        self._drafted = []  # the drafter may have decoded for another engine since
        for m in range(len(self.routers)):
            self.experts.keep(m, pool._members[m])
            self.experts.load(m, np.flatnonzero(pool._members[m]), reuse=True)
        self._sync()
        self._prompt(pool, prompt)
        run = SpeculativeRun(tokens=[])
        committed = list(prompt)
        while len(run.tokens) < max_new_tokens:
            begin = time.perf_counter()
            drafts, confidences = self._draft(committed)
            middle = time.perf_counter()
            pool.begin_block(confidences)
            start = len(committed) - 1
            verified, copies = self._verify(pool, [committed[-1]] + drafts, start, graphs=self.graphs)
            if forced is None:
                a = accepted_count(drafts, [int(t) for t in verified])
                block = drafts[:a] + [int(verified[a])]
            else:
                i = len(run.accepted)
                if i >= len(forced.accepted):
                    raise ValueError("forced: the run to follow ended before this one; give a run of the same "
                                     "prompt, max_new_tokens and stops")
                a = forced.accepted[i]
                block = forced.tokens[len(run.tokens):len(run.tokens) + a + 1]
            pool.end_block(a)
            run.draft_s += middle - begin
            run.verify_s += time.perf_counter() - middle
            run.accepted.append(a)
            run.copies.append(copies)
            if commit(block, run.tokens, committed, eos, max_new_tokens, stop):
                return run
        return run
