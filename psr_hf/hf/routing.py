"""Per-layer routing of a patched model: a MoE layer's scores to the logical cache, its selection back as the
router's outputs (ARCHITECTURE.md, "The one decision path").

A router forward computes this layer's selection scores and the next layer's pre-gate (one matmul where the
policy reads a pre-gate), moves them to the host in **one** transfer and asks the
:class:`~psr_hf.policy.LogicalCache` for the selection. Where the selection equals the router's own top-K its own
outputs are returned untouched (exact routing is bitwise the unpatched model); elsewhere the selected experts,
weighed from the unmodified scores. The batch-1 decode path of a decode handle's
:meth:`~.decode_handle.DecodeHandle.select` and :meth:`~.decode_handle.DecodeHandle.prefetch` runs the same
helpers. Nothing here decides which expert runs: the kernels do.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from numpy.typing import ArrayLike

from ..policy.cache import StepPlan
from .inputs import ForwardPass
from .prefetch_sources import PregateRanking, PrefetchRanking
from .router_choice import follow_router_choice

if TYPE_CHECKING:
    from ..gates.margin_head import MarginHead
    from ..gates.relaxation import GateRelaxation
    from ..offload.store import PatchedExpertStore
    from ..patches.base import ArchitecturePatch, MoELayer
    from ..policy.cache import LogicalCache
    from ..policy.config import RoutingConfig
    from .recording import Recorder


@dataclass(frozen=True)
class Selection:
    """What :meth:`DecodeHandle.select <.decode_handle.DecodeHandle.select>` decided for one MoE layer of a batch-1
    decode step.

    ``experts``: the ``K`` executed expert ids (host int64, the logical cache's order); ``tensor``: the same
    memory as a ``[1, K]`` int64 tensor (the host staging buffer, pinned and reused for a CUDA device: copy it to
    the device before the next ``select`` of a layer on that device); ``own``: whether the
    selection is the router's own top-K (nothing replaced, no tie across its top-K boundary): then the HF path
    returns the router's own outputs."""

    experts: np.ndarray
    tensor: torch.Tensor
    own: bool


class LayerRouting:
    """The routing state of one patched model's MoE layers, owned by its :class:`Controller`: the host pre-gate
    of each layer in the open forward pass, the stacked router weights, the selection staging buffers, the
    decisions a gradient-checkpointing backward pass replays and the displaced-mass sums. The controller sets
    ``cache``, ``source``, ``store`` and ``recorder`` and passes the open forward pass (``fwd``) to each call."""

    def __init__(self, model: torch.nn.Module, family: ArchitecturePatch, layers: list[MoELayer], num_experts: int,
                 top_k: int):
        self.model, self.family, self.layers = model, family, layers
        self.num_layers, self.num_experts, self.top_k = len(layers), num_experts, top_k
        self.cache: LogicalCache | None = None
        self.source: PrefetchRanking = PregateRanking()  # the prefetch source (RoutingConfig.prefetch)
        self.store: PatchedExpertStore | None = None  # where the experts live (the controller's expert store)
        self.recorder: Recorder | None = None  # the running recording, if any
        self.gate: MarginHead | None = None  # a margin head: each token's scores scaled by gate_unit[l] / its margin
        self.gate_unit: torch.Tensor | None = None  # [L] float32: lam * delta[l]
        self.relaxation: GateRelaxation | None = None  # while a gate trains (psr_hf.training.gate)
        self.needs_pregate = self.executes_pregate = False
        self.distance = 1  # RoutingConfig.prefetch_distance: layer l's pre-gate is router l on layer l - D's input
        self.follows_router = False  # exact routing: the router's own picks decide ties (router_choice)
        self.pregate: list[np.ndarray | None] = [None] * self.num_layers  # host pre-gate of each layer, this forward
        # layer -> (positions, count, chosen [N, K], flags [N]) of the last forward pass that ran with grad in training
        # mode: a backward pass that recomputes layers (gradient checkpointing) routes them as that pass did
        self.decisions: dict[int, tuple[int, int, torch.Tensor, np.ndarray]] = {}
        # while a checkpointed layer is recomputed: the decisions its own forward recorded (.checkpointing)
        self._replaying: dict | None = None
        self._stacked: dict[int, tuple] = {}  # layer -> (weights' identity, [2E, H])
        self._pinned: dict[torch.device, torch.Tensor] = {}  # host staging buffers for selections, per device
        self._staging_views: dict[tuple, tuple[np.ndarray, torch.Tensor]] = {}
        self._flags = np.zeros(1, dtype=np.uint8)
        self.devices = [layer.router.weight.device for layer in layers]
        # the family's router bias per layer on the host (displaced mass), read at every sequence start: a model built
        # on the meta device has none until its weights load, and training or load_state_dict may change it
        self._mass_bias: list[np.ndarray] = [np.zeros(0)] * self.num_layers
        self.displaced = np.zeros((self.num_layers, 1))  # [L, R] displaced-mass sums

    # ------------------------------------------------------------------ state the controller changes
    def configure(self, config: RoutingConfig, cache: LogicalCache, source: PrefetchRanking) -> None:
        """Route with ``config`` through ``cache``, ranking prefetches with ``source``: one fresh row."""
        self._stacked.clear()
        self.source, self.cache = source, cache
        self.needs_pregate = config.needs_pregate
        self.executes_pregate = config.executes_pregate
        self.distance = config.prefetch_distance
        self.follows_router = config.follows_router
        self.displaced = np.zeros((self.num_layers, 1))
        source.start(1, cache.calibration)

    def new_sequence(self, rows: int) -> None:
        """A new sequence of ``rows`` rows: the weights, their devices and biases are read again (the model may
        have moved or changed between sequences)."""
        self._stacked.clear()
        self.refresh_devices()
        biases = [self.family.mass_bias(layer.router) for layer in self.layers]
        self._mass_bias = [np.zeros(0) if b is None else b for b in biases]
        self.displaced = np.zeros((self.num_layers, rows))
        self.source.start(rows, self.cache.calibration)

    def refresh_devices(self) -> None:
        """The routers' devices, for which the selections are staged (the offload may have moved them)."""
        self.devices = [layer.router.weight.device for layer in self.layers]

    def begin_forward(self) -> None:
        self.pregate = [None] * self.num_layers
        self.decisions = {}
        if self.relaxation is not None:
            self.relaxation.begin_forward()

    def abort_forward(self) -> None:
        self.pregate = [None] * self.num_layers

    def reorder(self, index: np.ndarray) -> None:
        self.displaced = self.displaced[:, index]
        self.source.reorder(index)

    def ranks_ahead(self, layer: int) -> bool:
        """Whether ``layer``'s router input ranks the prefetches of a later layer (``layer + distance``): then its
        router forward computes that layer's pre-gate in the same matmul (:meth:`route_joint`)."""
        return self.needs_pregate and layer + self.distance < self.num_layers

    def resident(self, layer: int) -> np.ndarray:
        """[E] bool: row 0's logical cache at ``layer``."""
        return self.cache.resident_mask(layer) != 0

    # ------------------------------------------------------------------ the router forwards
    def route_own(self, fwd: ForwardPass, layer: int, router: torch.nn.Module, own: tuple,
                  hidden: torch.Tensor | None = None) -> tuple:
        """Layers that need no pre-gate of the next layer: the router runs first, its logits give the scores
        (``hidden``: the router's input, read by a gate)."""
        with torch.no_grad():  # the host's copy only: nothing of it is saved for a backward pass
            scores = self.family.selection_scores(router, own[0].detach())  # [N, E]
            z = self._gated(layer, hidden, scores)
            host = _host(self._with_host_extras(z, own, scores if self.gate is not None else None))  # one transfer
        z_host, mass_scores = self._split_host(host, fwd, extras_from=self.num_experts)
        if fwd.positions == 1:
            # part 1 of this layer already ran in the previous layer's call when the policy inserts
            plan = self._decode_select(layer, z_host[:, 0],
                                       "select" if self.needs_pregate and layer >= self.distance else "both")
        else:
            if layer >= self.distance:
                self.pregate[layer] = self.source.block_pregate(layer, self.pregate[layer], z_host, fwd.valid)
            self._snapshot(fwd, layer)
            plan = self.cache.step(layer, z_host, self.pregate[layer], fwd.tokens, fwd.valid)
        self.source.remember(layer, z_host, fwd.valid)
        return self._execute(fwd, layer, router, plan, z_host, own[0], own, None, hidden, mass_scores)

    def route_joint(self, fwd: ForwardPass, layer: int, router: torch.nn.Module, hidden: torch.Tensor,
                    run_own: Callable[[], tuple]) -> tuple:
        """This layer's scores and the pre-gate of layer ``layer + distance`` from one matmul, moved to the host in
        one transfer; the model's own router runs afterwards, and only where the selection is the router's own
        top-K."""
        B, S, E = fwd.rows, fwd.positions, self.num_experts
        ahead = layer + self.distance
        own = run_own() if self.follows_router else None  # exact routing reads the router's own picks
        with torch.no_grad():  # the host's copy and the untrained path's logits: nothing saved for a backward pass
            raw, both = self.joint_scores(layer, hidden)
            ungated = None
            if self.gate is not None:
                ungated = both[:, :E]
                both = torch.cat((self._gated(layer, hidden, both[:, :E]), both[:, E:].float()), dim=1)
            host = _host(self._with_host_extras(both, own, ungated))  # [N, 2E (+K | +E)]: z | next pre-gate | extras
        logits = _Lazy(raw, E)  # this layer's logits, sliced only if the selection needs them
        # C-contiguous parts: the policy kernels are compiled for C-contiguous arrays only (one specialisation)
        g_next = np.ascontiguousarray(host[:, E:2 * E]).reshape(B, S, E)
        z_host, mass_scores = self._split_host(host, fwd, extras_from=2 * E)
        if S == 1:
            # decoding: part 2 of this layer, then part 1 of the layer ``distance`` ahead (its prefetches are known
            # while this layer computes), on the cache's own buffers
            g_next = self.source.next_pregate(ahead, g_next)
            plan = self._decode_select(layer, z_host[:, 0], "select")
            result = self._execute(fwd, layer, router, plan, z_host, logits, own, run_own, None, mass_scores)
            self._decode_prefetch(fwd, ahead, g_next[:, 0])
        else:
            # a block of positions: parts 1 and 2 of this layer for each position in order
            if layer >= self.distance:
                self.pregate[layer] = self.source.block_pregate(layer, self.pregate[layer], z_host, fwd.valid)
            self._snapshot(fwd, layer)
            plan = self.cache.step(layer, z_host, self.pregate[layer], fwd.tokens, fwd.valid)
            result = self._execute(fwd, layer, router, plan, z_host, logits, own, run_own, hidden, mass_scores)
        self.source.remember(layer, z_host, fwd.valid)
        self.pregate[ahead] = g_next
        return result

    def _with_host_extras(self, scores: torch.Tensor, own: tuple | None, ungated: torch.Tensor | None) -> torch.Tensor:
        """``scores`` with what the host needs besides, as columns of the same transfer: under exact routing the
        router's own picks ``[N, K]`` (:mod:`.router_choice`), under a gate the ungated selection scores ``[N, E]``
        (the displaced mass is the router's own, whatever margins decided)."""
        extras = []
        if self.follows_router:
            extras.append(own[2].detach().to(torch.float32))  # expert ids < 2**24: exact in float32
        if ungated is not None:
            extras.append(ungated.float())
        return torch.cat([scores.float()] + extras, dim=1) if extras else scores

    def _split_host(self, host: np.ndarray, fwd: ForwardPass, extras_from: int) -> tuple[np.ndarray, np.ndarray | None]:
        """This layer's selection scores ``[B, S, E]`` (C-contiguous: the kernels are compiled for that layout
        only) from a transfer laid out by :meth:`_with_host_extras`, and the scores its displaced mass is computed
        from (None: the same)."""
        E, shape = self.num_experts, (fwd.rows, fwd.positions, self.num_experts)
        z = host[:, :E] if host.shape[1] > E else host
        column = extras_from
        if self.follows_router:
            picks = host[:, column:column + self.top_k].astype(np.int64)
            z = follow_router_choice(np.ascontiguousarray(z), picks)
            column += self.top_k
        mass_scores = None
        if self.gate is not None:
            mass_scores = np.ascontiguousarray(host[:, column:column + E]).reshape(shape)
        return np.ascontiguousarray(z).reshape(shape), mass_scores

    def _snapshot(self, fwd: ForwardPass, layer: int) -> None:
        """While a gate trains: the layer's logical cache of every row before the kernels route the block."""
        if self.relaxation is not None:
            self.relaxation.snapshot(layer, [self.cache.resident_mask(layer, row) != 0 for row in range(fwd.rows)])

    def _gated(self, layer: int, hidden: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor:
        """``z [N, E]``, with a gate: each token's scores times ``lam * delta[l] / margin`` (float32; the
        policy's decisions on them are the gate's, psr_hf.policy.margins)."""
        if self.gate is None:
            return z
        if hidden is None:
            raise RuntimeError(f"psr_hf: MoE layer {layer}'s router input is needed by the gate but was not given")
        margins = self.gate(layer, hidden.detach().reshape(-1, hidden.shape[-1]))
        return z.float() * (self.gate_unit[layer] / margins).to(z.device)[:, None]

    @contextlib.contextmanager
    def checkpointed(self, record: dict, replay: bool) -> Iterator[None]:
        """One call of a checkpointed layer (:mod:`.checkpointing`): its forward records its decisions into
        ``record``; with ``replay`` (the recomputation in the backward pass) they are what :meth:`recompute` reads."""
        if replay:
            previous, self._replaying = self._replaying, record
            try:
                yield
            finally:
                self._replaying = previous
        else:
            previous, self.decisions = self.decisions, record
            try:
                yield
            finally:
                self.decisions = previous

    def replayable(self, layer: int) -> bool:
        """Whether a recomputation of ``layer`` now has the decisions of its forward pass."""
        return layer in (self.decisions if self._replaying is None else self._replaying)

    def recompute(self, layer: int, router: torch.nn.Module, own: tuple) -> tuple:
        """A layer recomputed in the backward pass (gradient checkpointing): the selection the forward pass made,
        with weights from the recomputed logits, so the gradients are those of the routed forward. The decisions
        are those of the checkpointed call being recomputed, else (a checkpoint psr_hf did not wrap) the last
        forward pass's."""
        N, count, chosen, flags = (self.decisions if self._replaying is None else self._replaying)[layer]
        if self.relaxation is not None:
            raise RuntimeError("psr_hf: a gate trains without gradient checkpointing (its relaxation reads the cache "
                               "of the forward pass); call model.gradient_checkpointing_disable()")
        if self.store.offloaded:
            raise RuntimeError(
                "psr_hf: gradient checkpointing recomputes layers in the backward pass, whose expert slots have "
                "changed since the forward pass; train without offload (psr_hf.patch(..., offload=None))"
            )
        if own[0].shape[0] != N:
            raise RuntimeError(
                f"psr_hf: MoE layer {layer} was recomputed in the backward pass with {own[0].shape[0]} positions, but "
                f"the forward pass routed {N}; run the backward of the last forward pass"
            )
        if count == 0:
            return own
        return self._assemble(router, own[0], own, count, N, chosen, flags)

    # ------------------------------------------------------------------ the batch-1 decode path
    def select(self, fwd: ForwardPass, layer: int, scores: ArrayLike, pregate: ArrayLike | None) -> Selection:
        """:meth:`DecodeHandle.select <.decode_handle.DecodeHandle.select>` in the open step ``fwd``."""
        if self.gate is not None:
            raise RuntimeError("psr_hf: a model routed with a gate (a margin head) decodes through its own forward "
                               "pass (generate(), lm-eval); the engine's decode steps do not run gates")
        E = self.num_experts
        z = np.ascontiguousarray(np.asarray(scores, dtype=np.float32).reshape(1, 1, E))
        mode = "select" if self.needs_pregate and (layer >= self.distance or self.ranks_ahead(layer)) else "both"
        plan = self._decode_select(layer, z[:, 0], mode)
        count, tensor, _, chosen = self._decide(fwd, layer, plan, z)
        if self.ranks_ahead(layer):
            # a copy: the caller's buffer is rewritten by the next layer before this pre-gate is read
            given = None if pregate is None else np.array(pregate, dtype=np.float32, order="C").reshape(1, 1, E)
            g_next = self.source.next_pregate(layer + self.distance, given)
            if g_next is not None:
                self.pregate[layer + self.distance] = g_next
        self.source.remember(layer, z, fwd.valid)
        return Selection(experts=chosen[0], tensor=tensor, own=count == 0)

    def prefetch(self, fwd: ForwardPass, layer: int) -> bool:
        """:meth:`DecodeHandle.prefetch <.decode_handle.DecodeHandle.prefetch>` in the open step ``fwd``."""
        if not self.needs_pregate:
            return False
        g = self.pregate[layer] if self.distance <= layer < self.num_layers else None
        if g is None:
            raise RuntimeError(f"psr_hf: prefetch({layer}) before select({layer - self.distance}) gave its pre-gate")
        self._decode_prefetch(fwd, layer, g[:, 0])
        return True

    def absorb_record(self, scores: np.ndarray, plans: np.ndarray) -> None:
        """Statistics of decode positions another implementation of the step decided (the engine's device kernel,
        which kept the cache's state and counters itself): ``scores`` ``[T, L, E]`` float32 and the select plans
        ``[T, L, W]`` of row 0, in order; their displaced mass is added as :meth:`_decide` adds it."""
        K = self.top_k
        chosen = np.empty((1, K), dtype=np.int64)
        flags = np.empty(1, dtype=np.uint8)
        layout = self.cache.plan_layout
        for t in range(scores.shape[0]):
            for layer in range(self.num_layers):
                plan = StepPlan(plans[t, layer].reshape(1, 1, -1), layout)
                self.cache.finish_layer(plan, scores[t, layer].reshape(1, 1, -1), None, self.store.offloaded,
                                        self.family.router_mass, self._mass_bias[layer], self.displaced[layer],
                                        chosen, flags)

    # ------------------------------------------------------------------ router weights
    def joint_scores(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [N, 2E], scores [N, 2E])`` of MoE layer ``layer`` (one that :meth:`ranks_ahead`) on its router
        input ``hidden``: this layer's logits and selection scores, then the pre-gate of layer ``layer + distance``
        from the same matmul: that layer's router's scores on this input, or with
        ``RoutingConfig(prefetch="predictor")`` the predictor's priorities ``softmax(B A x)`` in float32
        (docs/ALGORITHM.md, "Prefetch ranking source")."""
        raw, both = self.family.joint_scores(self.layers[layer].router, self.layers[layer + self.distance].router,
                                             hidden, self.stacked_weight(layer))
        return raw, self.source.priorities(raw, both, self.num_experts)

    def prefetch_weight(self, layer: int) -> torch.Tensor:
        """``[E, H]``: what ranks the prefetches of layer ``layer + distance`` from layer ``layer``'s router input:
        that layer's router weight, or the predictor's ``B A`` (float32) with ``prefetch="predictor"``."""
        return self.source.ranking_weight(layer, self.layers[layer + self.distance].router)

    def stacked_weight(self, layer: int) -> torch.Tensor:
        """``[2E, H]`` this router's weight over :meth:`prefetch_weight` (one matmul gives z and the next
        pre-gate), in the family's router dtype; rebuilt when a weight is replaced or changed in place, and at every
        new sequence (device moves)."""
        a = self.layers[layer].router.weight
        b = self.source.weight_owner(self.layers[layer + self.distance].router)
        cached = self._stacked.get(layer)
        key = (a._version, a.data_ptr(), a.dtype, a.device) + (
            (b._version, b.data_ptr()) if isinstance(b, torch.Tensor) else (id(b),))
        if cached is None or cached[0] is not a or cached[1] is not b or cached[2] != key:
            following = self.prefetch_weight(layer).detach().to(device=a.device, dtype=a.dtype)
            stacked = self.family.stacked_router_weight(a.detach(), following)
            cached = self._stacked[layer] = (a, b, key, stacked)
        return cached[3]

    # ------------------------------------------------------------------ a layer's plan to the router's outputs
    def _execute(self, fwd: ForwardPass, layer: int, router: torch.nn.Module, plan: StepPlan, z_host: np.ndarray,
                 logits: torch.Tensor | _Lazy, own: tuple | None, run_own: Callable[[], tuple] | None,
                 hidden: torch.Tensor | None = None, mass_scores: np.ndarray | None = None) -> tuple:
        """The router's triple for the selection in ``plan``: the router's own outputs (``own``, or computed by
        ``run_own``) where the selection is its own top-K, the selected experts with weights from the unmodified
        scores elsewhere. Where the router's K-th and (K+1)-th scores tie, its own top-K is torch's arbitrary
        pick; the policy's (ties to the lower index) runs instead, so the executed experts are always the
        logical cache's (exact routing moved its scores so that the policy's pick is the router's:
        :mod:`.router_choice`). ``mass_scores``: the router's own scores where ``z_host`` are a gate's."""
        count, chosen_dev_view, flags, _ = self._decide(fwd, layer, plan, z_host, mass_scores)
        device = self.devices[layer]
        N = fwd.rows * fwd.positions
        training = self.model.training
        if training:
            # the weights' gradients flow through the router's own logits (the joint matmul's are detached), and a
            # recomputation in the backward pass computes the same ones, also after a forward without grad
            # (reentrant checkpointing); in eval mode the joint matmul's: outputs never depend on the grad mode
            own = own if own is not None else run_own()
            logits = own[0]
        if count == 0:
            result = own if own is not None else run_own()  # the router's own choice: its own outputs, bitwise
            chosen_dev = None
        else:
            chosen_dev = chosen_dev_view.to(device, non_blocking=True) if device.type == "cuda" else chosen_dev_view
            if count < N and own is None:
                own = run_own()
            result = self._assemble(router, logits, own, count, N, chosen_dev, flags)
        if training:
            kept = None if chosen_dev is None else chosen_dev.clone()
            self.decisions[layer] = (N, count, kept, flags[:N].copy())
            if self.relaxation is not None:
                result = self.relaxation.outputs(self.family, layer, router, result, plan, self.gate, hidden)
        return result

    def _assemble(self, router: torch.nn.Module, logits: torch.Tensor | _Lazy, own: tuple | None, count: int, N: int,
                  chosen: torch.Tensor, flags: np.ndarray) -> tuple:
        """The router's triple when ``count`` of the ``N`` positions (``flags``) run ``chosen`` instead of the
        router's own top-K: their weights from the unmodified scores, the router's own outputs elsewhere."""
        if isinstance(logits, _Lazy):
            logits = logits.value()
        if count == N:
            return logits, self.family.execution_weights(router, logits, chosen), chosen
        _, weights, indices = own
        mask = torch.from_numpy(flags[:N].astype(bool)).to(chosen.device)[:, None]
        new_weights = self.family.execution_weights(router, logits, chosen).to(weights.dtype)
        return logits, torch.where(mask, new_weights, weights), torch.where(mask, chosen, indices)

    def _decode_select(self, layer: int, z: np.ndarray, mode: str) -> StepPlan:
        """One position per row (decoding): part 2 of ``layer`` (``mode`` "select"), or parts 1 and 2 ("both"),
        on the cache's own buffers for the scores ``z`` [B, E]; spec executes the pre-gate that the previous layer
        stored for this one."""
        io = self.cache.io
        io.scores[:, 0] = z
        if self.executes_pregate and layer:
            io.pregate[:, 0] = self.pregate[layer][:, 0]
        return self.cache.step_io(layer, mode)

    def _decode_prefetch(self, fwd: ForwardPass, layer: int, g: np.ndarray) -> None:
        """One position per row (decoding): part 1 of ``layer`` from its pre-gate ``g`` [B, E] (the previous
        layer's input through this layer's router), and the offload's prefetch copies of its insertions."""
        self.cache.io.pregate[:, 0] = g
        plan = self.cache.step_io(layer, "prefetch")
        if self.store.offloaded and _mirrors(fwd):  # resident experts: nothing to copy, no host time spent
            self.store.prefetch(layer, plan, self.cache.resident_mask(layer))

    def _decide(self, fwd: ForwardPass, layer: int, plan: StepPlan, z_host: np.ndarray,
                mass_scores: np.ndarray | None = None) -> tuple[int, torch.Tensor, np.ndarray, np.ndarray]:
        """What every caller does with a layer's plan: record it, count its statistics
        (:meth:`LogicalCache.finish_layer`; the router's own top-K and the displaced mass from ``mass_scores``, the
        ungated scores of a gated layer, else ``z_host``), write the selected experts into the host staging buffer
        and tell the expert store. Returns the number of positions whose selection is not the router's own top-K, the
        staging tensor ``[N, K]`` (host; pinned for a CUDA device), the per-position flags (1: not the router's
        own) and the staging buffer as an array."""
        N = fwd.rows * fwd.positions
        if self.recorder is not None:
            self.recorder.add_layer(layer, z_host, self.pregate[layer], plan.selected)
        chosen, chosen_dev_view = self._staging(N, self.devices[layer])
        flags = self._flags if N == 1 else np.empty(N, dtype=np.uint8)
        own_scores = z_host if mass_scores is None else mass_scores
        store = self.store
        # an offloaded layer loads exactly the plan's experts, padded positions' included
        count = self.cache.finish_layer(plan, own_scores, fwd.valid, store.offloaded, self.family.router_mass,
                                        self._mass_bias[layer], self.displaced[layer], chosen, flags)
        if store.offloaded:  # the slots follow the plan (resident experts: nothing moves, no host time spent)
            mirror = _mirrors(fwd)
            resident = None if fwd.rows != 1 else self.cache.resident_mask(layer) if mirror else self.resident(layer)
            store.route(layer, plan, chosen, mirror, resident)
        return count, chosen_dev_view, flags, chosen

    def _staging(self, rows: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
        """A host ``[rows, K]`` int64 buffer for the selection and a tensor over the same memory. For a CUDA
        device it is pinned and reused (one per device), so the copy to the device is asynchronous: the buffer is
        rewritten only after the next device-to-host transfer from that device, which waits for this copy."""
        key = (device, rows)
        view = self._staging_views.get(key)
        if view is None:
            size = rows * self.top_k
            if device.type == "cuda":
                pinned = self._pinned.get(device)
                if pinned is None or pinned.numel() < size:
                    pinned = self._pinned[device] = torch.empty(max(size, 4096), dtype=torch.int64, pin_memory=True)
                    self._staging_views = {k: v for k, v in self._staging_views.items() if k[0] != device}
                tensor = pinned[:size].view(rows, self.top_k)
                view = self._staging_views[key] = (tensor.numpy(), tensor)
            else:  # the tensor is used as it is by the layer, so never reused
                tensor = torch.empty((rows, self.top_k), dtype=torch.int64)
                view = (tensor.numpy(), tensor)
        return view


def _mirrors(fwd: ForwardPass) -> bool:
    """One row and one real position: an offloaded store's slots follow this step's plan exactly."""
    return fwd.rows == 1 and fwd.positions == 1 and (fwd.valid is None or bool(fwd.valid[0, 0]))


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where gradient checkpointing recomputes layers)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() >= 0


class _Lazy:
    """The first ``E`` columns of a ``[N, 2E]`` tensor, sliced on first use (a torch call costs microseconds)."""

    __slots__ = ("raw", "E")

    def __init__(self, raw: torch.Tensor, E: int):
        self.raw, self.E = raw, E

    def value(self) -> torch.Tensor:
        return self.raw[:, : self.E]


def _host(t: torch.Tensor) -> np.ndarray:
    """A device tensor as a float32 host array (one device-to-host copy, which synchronises). bfloat16 widens
    on the host by a bit shift (exact, and cheaper than a torch conversion)."""
    h = t.cpu()
    if h.dtype == torch.float32:
        return h.numpy()
    if h.dtype == torch.bfloat16:
        return (h.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    return h.float().numpy()
