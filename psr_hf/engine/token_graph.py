"""The engine's decode step as one CUDA graph per token, routed on the GPU: :class:`TokenGraphDecoder`.

A :class:`~psr_hf.engine.graphs.GraphDecoder` whose decode steps after a sequence's first host-routed step (a
prompt's prefill, or ``step`` at position 0) run without any host work between layers. Per MoE layer ``m`` the
token graph holds graph A_m's body (attention, router scores and the pre-gate of layer ``m + D``, D the
``prefetch_distance``), the decision kernel (:mod:`psr_hf.engine.device_decisions`: ``select(m)`` then
``prefetch(m + D)``, bitwise the numba kernels'), and, offloaded, the demand copies of ``m`` on many programs and
the prefetch copies of ``m + D`` on a few programs of a side branch that only layer ``m + D`` waits for
(:mod:`psr_hf.engine.device_copies`), then graph B_m's body.

The routing state is lent through the controller's decode handle (:meth:`DecodeHandle.lend_state
<psr_hf.hf.decode_handle.DecodeHandle.lend_state>`) after the host step and copied back when anything asks the
controller for it (statistics, a new sequence, a forward pass of the model): the state,
counters, displaced mass and copy counts are then those of the host path, and the offload's slot book takes the
slot maps over. Page: docs/engine.md, "Routing on the device".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from psr_hf.hf.patching import controller as _controller
from psr_hf.hf.prefetch_sources import PregateRanking
from psr_hf.offload.cuda_runtime import raw_current_stream
from . import device_decisions as D
from .device_copies import LateCounter, LayerCopies
from .device_state import DeviceState
from .graphs import GraphDecoder
from .moe import triton_available
from .slot_moe import filled_slots
from .step_inputs import GraphStepInputs

if TYPE_CHECKING:
    from psr_hf.hf.controller import Controller

logger = logging.getLogger(__name__)


def device_routing_unsupported(controller: Controller) -> str | None:
    """Why the routing of ``controller`` cannot be decided on the device (None: it can)."""
    routing = controller.routing
    if routing.gate is not None:
        return "a gate (margin head) routes through the model's forward"
    if type(routing.source).next_pregate is not PregateRanking.next_pregate:
        return f"the prefetch source {type(routing.source).__name__} ranks on the host"
    if controller.cache.rows != 1:
        return "the engine decodes one row"
    return controller.expert_store.unsupported_on_device()


def graph_decoder(model: torch.nn.Module, max_len: int, *, graphs: bool = True, device_routing: bool | None = None,
                  count_late: bool = False, **kwargs: Any) -> GraphDecoder:
    """The engine's decoder for ``model``: a :class:`TokenGraphDecoder` (decode steps routed on the device, one
    CUDA graph per token) where the routing allows it, else a :class:`GraphDecoder` (routed on the host per
    layer). ``device_routing``: None (default) where possible, True requires it (``ValueError`` saying why
    not), False never. ``count_late``: a :class:`TokenGraphDecoder` of an offloaded model counts its late prefetches
    (the host path observes them itself). Other arguments: :class:`GraphDecoder`'s."""
    if device_routing is False or (device_routing is None and not graphs):
        return GraphDecoder(model, max_len, graphs=graphs, **kwargs)
    why = None if graphs else "it needs CUDA graphs (graphs=True on a CUDA device)"
    if why is None:
        why = device_routing_unsupported(_controller(model))
    if why is None and not triton_available()[0]:
        why = f"triton does not import ({triton_available()[1]})"
    if why is None:
        return TokenGraphDecoder(model, max_len, graphs=graphs, count_late=count_late, **kwargs)
    if device_routing:
        raise ValueError(f"psr_hf engine: device routing is not available: {why}; pass device_routing=None or False")
    logger.info("psr_hf engine: routing on the host per layer: %s", why)
    return GraphDecoder(model, max_len, graphs=graphs, **kwargs)


class TokenGraphDecoder(GraphDecoder):
    """:class:`GraphDecoder` with device routing for decode steps (CUDA, ``graphs=True``). ``prefetch_programs``:
    the programs of a layer's prefetch copies, beside the compute; ``demand_programs``: of its demand copies
    (default: the device's SM count); ``decide_warps``: the decision kernel's warps; ``count_late``: count the
    prefetches each layer still waits for (:meth:`late_prefetches`). Other arguments: :class:`GraphDecoder`'s."""

    def __init__(self, model: torch.nn.Module, max_len: int, *, prefetch_programs: int = 8,
                 demand_programs: int | None = None, decide_warps: int = 8, count_late: bool = False,
                 **kwargs: Any):
        super().__init__(model, max_len, **kwargs)
        if not self.graphs:
            raise ValueError("TokenGraphDecoder needs graphs=True (a CUDA device)")
        ctl = self.controller
        why = device_routing_unsupported(ctl)
        if why is not None:
            raise ValueError(f"psr_hf engine: device routing is not available here: {why}; use GraphDecoder")
        self.prefetch_programs = int(prefetch_programs)
        self.demand_programs = int(demand_programs or torch.cuda.get_device_properties(self.device).multi_processor_count)
        self._max_len = int(max_len)
        self.count_late = bool(count_late)
        self.decide_warps = int(decide_warps)
        self._lent_from = 0  # the first position decided on the device in the lent stretch
        self._decided_to = 0  # the position after the last one decided on the device
        self._bind()

    def _bind(self) -> None:
        """Device state and copy kernels for the controller's current cache, and the token graph captured on
        them (again after a ``reconfigure()`` made a new cache)."""
        ctl, b = self.controller, self.layers.buffers
        self._token_graph = None
        # softmax routers: the decision kernel widens the logits to float32 itself (one kernel less per layer)
        self._reads_logits = all(self.layers.scores_are_logits(d) for d in self.moe_layers)
        scores = b.router_logits[0] if self._reads_logits else self._scores_f32[0]
        self.dstate = DeviceState(ctl.cache, self.device, scores=scores, token=b.token.view(-1),
                                  position=b.position.view(-1), offloaded=self.offloaded,
                                  max_positions=self._max_len, num_warps=self.decide_warps)
        self.dstate.ids = b.expert_ids[0]
        self.dstate.slot_ids = self._slot_ids if self.offloaded else b.expert_ids[0]
        self._copies: list[LayerCopies] = []
        if self.offloaded:  # the device copies experts into the slots itself
            store = ctl.expert_store
            for m in range(len(self.moe_layers)):
                host, slots = store.expert_weights(m), filled_slots(store, m)
                self._copies.append(LayerCopies([host[name] for name in slots], list(slots.values())))
        self._counters_at_lend = np.zeros((len(self.moe_layers), 8))
        self._step_inputs = GraphStepInputs(b.token, b.position)
        # the diagnostic of late prefetches, offloaded only (late_prefetches)
        self._late = (LateCounter(len(self.moe_layers), self._step_inputs.steps)
                      if self.count_late and self.offloaded else None)
        self._capture_token()
        if self._late is not None:  # the capture's warm-up ran the checks for real
            self._late.late.zero_()

    def late_prefetches(self) -> dict[str, Any]:
        """With ``count_late=True`` on an offloaded model: the prefetches still being copied where their layer was
        about to wait for them, counted on the device over the device-decided steps since the token graph was last
        captured (``late``), the layer visits that waited (``layers_waited``), and both per MoE layer
        (``per_layer``). A diagnostic: the check is one more small kernel per layer with prefetches; it changes no
        output. Reads the device."""
        if self._late is None:
            raise ValueError("late_prefetches needs TokenGraphDecoder(..., count_late=True) on an offloaded model "
                             "(a resident one copies nothing)")
        return self._late.counts()

    # ------------------------------------------------------------------ the token graph
    def _token_body(self, side: torch.cuda.Stream) -> None:
        L = self.layers
        main = torch.cuda.current_stream(self.device)
        previous = -1
        waits: dict[int, torch.cuda.Event] = {}
        state = self.dstate
        ahead = state.kernel_settings()["constexprs"]["DISTANCE"]  # layer m decides the prefetches of m + ahead
        inserts = state.kernel_settings()["constexprs"]["INSERTS"]
        self._step_inputs.read(D.interpreting())  # first: a step enqueues nothing but the launch
        for m, d in enumerate(self.moe_layers):
            self._body_a(m, range(previous + 1, d), d, d2h=False, scores=not self._reads_logits)()
            state.decide(m)
            if self.offloaded:
                decided = torch.cuda.Event()
                decided.record(main)
                if m in waits:  # this layer's prefetches (issued at m - ahead) land before its demand copies
                    if self._late is not None:
                        self._late.check(state.copies, m, 1 + 2 * L.top_k)
                    main.wait_event(waits.pop(m))
                self._copies[m].launch(state.copies, m, 0, self.demand_programs)
                if m + ahead < len(self.moe_layers) and inserts:
                    side.wait_event(decided)
                    with torch.cuda.stream(side):
                        self._copies[m + ahead].launch(state.copies, m + ahead, 1 + 2 * L.top_k,
                                                       self.prefetch_programs, signal=self._late)
                        landed = torch.cuda.Event()
                        landed.record(side)
                    waits[m + ahead] = landed
            self._body_b(m, d, from_host=False)()
            previous = d
        self._body_c(range(previous + 1, L.num_layers))()
        for event in waits.values():  # every prefetch issued on the side stream joins the token here
            main.wait_event(event)

    @torch.no_grad()
    def _capture_token(self) -> None:
        """Warm up (the Triton kernels compile) and capture the token graph. The warm-up decides and copies for
        real, on the host state and slots as they are: the slots stay consistent (each copy moves the expert the
        device maps name) and are handed back to the slot book; the routing state is uploaded again when lent."""
        device = self.device
        ctl = self.controller
        self.decode_handle.reclaim()
        self._upload(ctl.expert_store.lend_slots())
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        side = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        self._step_inputs.keep()  # the warm-up reads the token and position the buffers hold
        with torch.cuda.stream(stream):
            self._token_body(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream, capture_error_mode="thread_local"):
            self._token_body(side)
        torch.cuda.synchronize(device)
        self._token_graph = graph
        self._launch_token = self._launcher(graph)
        if self.offloaded:  # the warm-up's copies moved experts the device maps name
            ctl.expert_store.return_slots(self.dstate.slot_of.cpu().numpy().astype(np.int64), 0, 0)

    # ------------------------------------------------------------------ lending
    def _upload(self, slots: np.ndarray | None) -> None:
        """Row 0's state (and, offloaded, the slots made to hold exactly the logical cache) to the device."""
        ctl = self.controller
        if slots is not None:
            slots = self._reconcile(slots)
        self.dstate.upload(0, slots)

    def _reconcile(self, slots: np.ndarray) -> np.ndarray:
        """The slot map made to hold exactly each layer's logical cache: a resident expert without a slot is
        copied into a slot whose expert is not resident (on the current stream, before the next graph)."""
        cache, store = self.controller.cache, self.controller.expert_store
        slots = slots.copy()
        for m in range(len(self.moe_layers)):
            resident = cache.resident(m, 0)
            missing = [e for e in resident.tolist() if slots[m, e] < 0]
            if not missing:
                continue
            keep = np.zeros(slots.shape[1], dtype=bool)
            keep[resident] = True
            spare = [int(slots[m, e]) for e in np.flatnonzero((slots[m] >= 0) & ~keep)]
            used = set(slots[m][slots[m] >= 0].tolist())
            spare += [s for s in range(store.capacity) if s not in used]
            for e in missing:
                slot = spare.pop(0)
                holder = np.flatnonzero(slots[m] == slot)
                slots[m, holder] = -1
                host_weights = store.expert_weights(m)
                for name, slot_weight in filled_slots(store, m).items():
                    slot_weight[slot].copy_(host_weights[name][e], non_blocking=True)
                slots[m, e] = slot
            for e in np.flatnonzero((slots[m] >= 0) & ~keep):  # anything else is not mapped
                slots[m, e] = -1
        return slots

    def _lend(self) -> None:
        ctl = self.controller
        self._upload(ctl.expert_store.lend_slots())
        self._lent_from = self._decided_to = self.position
        self._step_inputs.restart()
        if self._late is not None:
            self._late.restart()
        self._counters_at_lend = ctl.cache.counters[:, 0].copy()
        self.decode_handle.lend_state(self)

    def return_state(self) -> None:
        """The controller takes its state back: state, counters, displaced mass, slot maps and copy counts."""
        torch.cuda.synchronize(self.device)
        state = self.dstate
        controller = self.controller
        try:
            state.check()
        finally:
            cache = controller.cache
            state.download(0)
            first, last = self._lent_from, self._decided_to
            if last > first:
                controller.routing.absorb_record(state.record[first:last].cpu().numpy(),
                                                 state.record_plans[first:last].cpu().numpy())
            self.decode_handle.continue_sequence(last)
            if self.offloaded:  # the device's copies: its slot maps and copy counts
                delta = cache.counters[:, 0] - self._counters_at_lend
                controller.expert_store.return_slots(state.slot_of.cpu().numpy().astype(np.int64),
                                                int(delta[:, D.R_DEMAND].sum()), int(delta[:, D.R_PREFETCH].sum()))

    # ------------------------------------------------------------------ steps
    def reset(self) -> None:
        """Start a new sequence; after a ``Controller.reconfigure()`` (a new logical cache) the token graph is
        captured again here, before the sequence, instead of inside its first device-decided step."""
        super().reset()
        ctl = self.controller
        if (self.decode_handle.lent is None and self.dstate.cache is not ctl.cache
                and device_routing_unsupported(ctl) is None and self.layers.ranks_like(ctl)):
            self._bind()  # (stacks built for another ranking: the next step refuses, saying so)

    def _device_step_ready(self) -> bool:
        ctl, lent = self.controller, self.decode_handle.lent
        if lent is self:
            return True
        if lent is not None or ctl.forward_pass is not None or ctl.recording:
            return False
        if device_routing_unsupported(ctl) is not None:  # reconfigured since: the host path decides
            return False
        if self.dstate.cache is not ctl.cache:  # reconfigured since: a new cache
            self._bind()
        self._lend()
        return True

    def _continue(self, token: int | None, read_token: Callable[[], int | None],
                  overlap: Callable[[], None] | None) -> tuple[torch.Tensor | None, int | None]:
        with self.decode_handle.holding():  # no other thread takes the state back while the step is launched
            if not self._device_step_ready():
                return super()._continue(token, read_token, overlap)
            return self._device_step(token, read_token, overlap)

    def _device_step(self, token: int | None, read_token: Callable[[], int | None],
                     overlap: Callable[[], None] | None) -> tuple[torch.Tensor | None, int | None]:
        # what does not depend on the token is checked first, while the GPU may still be choosing it (as the host
        # path does: a change that a streamer or stopping criterion makes while the token is read applies from the
        # next step on, on both paths)
        self._check_slot_buffers()
        self.layers.check_prefetch_source(self.controller)
        self.layers.sync_routers(self.decode_handle)
        if token is None:
            token = read_token()  # the whole step changes the routing state: launched only for a real token
            if token is None:
                return None, None
            write = None
        else:
            write = int(token)
        position = self.position
        self._step_inputs.write(write, position)  # read by the token graph's first kernel
        self._launch_token(raw_current_stream(self.device))
        if overlap is not None:
            overlap()
        self.position = self._decided_to = position + 1
        return self.layers.buffers.logits, int(token)

