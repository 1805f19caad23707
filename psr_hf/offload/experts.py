"""The offloaded experts of one patched model: placement, slot buffers, scheduler and the registered experts function;
the :class:`~psr_hf.offload.store.PatchedExpertStore` of a model patched with ``offload=``.

The controller tells :class:`OffloadedExperts` what the logical cache decided (:meth:`OffloadedExperts.route` after
a layer's selection, :meth:`OffloadedExperts.prefetch` after the next layer's part 1); the model's experts modules,
switched to the ``"psr_offload"`` implementation of transformers' ``ExpertsInterface``, call
:meth:`OffloadedExperts.run`, which waits for the slots the layer executes, maps expert ids to slots on the device,
and runs the model's own experts implementation (``grouped_mm`` by default) on the slot buffers (docs/offloading.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Union

import numpy as np
import torch
from torch import nn

from .config import OffloadConfig
from .links import new_link
from .placement import OffloadMemory, Placement, place
from .scheduler import SlotScheduler
from .store import OffloadStats, SlotExperts

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..patches.base import MoELayer
    from ..policy.cache import StepPlan

logger = logging.getLogger(__name__)

IMPLEMENTATION = "psr_offload"
_ATTR = "_psr_offload"

#: an experts implementation of transformers: (module, hidden [T, H], top_k_index [T, K], top_k_weights [T, K])
ExpertsFunction = Callable[..., torch.Tensor]
#: what a layer's next run() does: True (a decode selection whose copies were issued), a block's (chosen [N, K],
#: the row's logical cache or None), or None (ask the device which experts run)
Pending = Union[bool, tuple[np.ndarray, Union[np.ndarray, None]], None]


def _offload_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"psr_offload"`` experts implementation (registered in transformers' ``ExpertsInterface``)."""
    binding = self.__dict__.get(_ATTR)
    if binding is None:
        raise RuntimeError(
            f"{type(self).__name__} runs with experts_implementation='psr_offload' but is not offloaded by psr_hf; "
            "patch the model with psr_hf.patch(..., offload=OffloadConfig(...)) or set another experts implementation"
        )
    experts, layer = binding
    return experts.run(layer, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION) is not _offload_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _offload_forward)


def _inner_function(module: nn.Module) -> ExpertsFunction:
    """The experts implementation ``module`` runs now (the stock function that will run on the slot buffers)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = getattr(module.config, "_experts_implementation", None)
    if name == IMPLEMENTATION:
        raise ValueError(f"{type(module).__name__} already runs the psr_offload experts implementation")
    if name not in (None, "eager") and name in ALL_EXPERTS_FUNCTIONS:
        return ALL_EXPERTS_FUNCTIONS[name]
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)  # the class's own (eager) forward under transformers' wrapper


def _slot_by_slot(inner: ExpertsFunction, proxy: SlotExperts, hidden: torch.Tensor, slots: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """The experts of several positions on the CPU with more than one thread, where torch's grouped kernels
    give results that depend on where each group starts (so on which slot holds which expert): each slot's
    pairs in a call of their own (one group, at the start), the weighted outputs of each position's K pairs
    summed in their order, as the experts implementations do. Deterministic across calls and slot layouts."""
    T, K = slots.shape
    pairs = None
    for slot in torch.unique(slots).tolist():
        t, k = (slots == slot).nonzero(as_tuple=True)
        out = inner(proxy, hidden[t], slots[t, k].reshape(-1, 1), weights[t, k].reshape(-1, 1))  # [n, H]
        if pairs is None:
            pairs = out.new_zeros((T, K, out.shape[-1]))
        pairs[t, k] = out
    return pairs.sum(dim=1)


def _set_implementation(config: PretrainedConfig, value: str | None) -> None:
    # transformers 5.23+ keeps it behind a property whose setter recurses into sub-configs; set this config only
    if isinstance(getattr(type(config), "_experts_implementation", None), property):
        config._experts_implementation_internal = value
    else:
        config._experts_implementation = value


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"offload device={name!r} but torch sees no CUDA device; use OffloadConfig(device='cpu')")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"offload device={name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


class OffloadedExperts:
    """Everything physical of one offloaded model; created by :func:`psr_hf.patch`, removed by :meth:`close`. The
    :class:`~psr_hf.offload.store.PatchedExpertStore` whose slots follow the logical cache."""

    offloaded = True
    weight_format = "model"

    def __init__(self, model: nn.Module, layers: list[MoELayer], num_experts: int, capacity: int,
                 config: OffloadConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.num_layers, self.num_experts = len(layers), num_experts
        self.modules = [layer.block.experts for layer in layers]
        self._router = layers[0].router  # where the model computes now (check_device)
        for layer, module in zip(layers, self.modules):
            if not hasattr(module, "config") or not hasattr(type(module), "forward"):
                raise ValueError(
                    f"MoE layer {layer.index}: {type(module).__name__} is not a transformers experts module with "
                    "an experts implementation (use_experts_implementation); psr_hf cannot offload it"
                )
        self._inner = [_inner_function(m) for m in self.modules]
        self.placement = self._place(model, capacity)
        self._remember_weights()
        self._configs: list[tuple[PretrainedConfig, str | None]] = []
        try:
            self._allocate(capacity)
            _register()
            for index, module in enumerate(self.modules):
                module.__dict__[_ATTR] = (self, index)
            for cfg in {id(m.config): m.config for m in self.modules}.values():
                self._configs.append((cfg, getattr(cfg, "_experts_implementation", None)))
                _set_implementation(cfg, IMPLEMENTATION)
        except BaseException:
            self.close()
            raise
        logger.info("psr_hf offload: %s", self.memory())

    # ------------------------------------------------------------------ buffers
    def _place(self, model: nn.Module, capacity: int) -> Placement:
        """The host store and the non-expert weights on the device: the model's own expert weights, in a store."""
        return place(model, self.modules, self.num_experts, capacity, self.device, self.config.pin_memory)

    def _allocate(self, capacity: int) -> None:
        self.slot_generation = getattr(self, "slot_generation", 0) + 1
        self.capacity = C = int(capacity)
        store = self.placement.store
        self.slots = [{name: torch.empty((C, *t.shape[1:]), dtype=t.dtype, device=self.device)
                       for name, t in layer.items()} for layer in store]
        dst = [[[t[s] for t in layer.values()] for s in range(C)] for layer in self.slots]
        src = [[[t[e] for t in layer.values()] for e in range(self.num_experts)] for layer in store]
        self.link = new_link(self.device, self.config.copy_delay_ms, self.config.copy_api)
        dst, src = self.link.prepare(dst, src)  # the raw link copies between addresses, fixed for these buffers
        self.scheduler = SlotScheduler(self.num_layers, self.num_experts, C, self.link, self.config.max_in_flight,
                                       self.placement.bytes_per_expert, src, dst)
        self._proxies = [SlotExperts(m, w, C) for m, w in zip(self.modules, self.slots)]
        E, L = self.num_experts, self.num_layers
        if self.device.type == "cuda":
            self._map_device = [torch.zeros(E, dtype=torch.int64, device=self.device) for _ in range(L)]
            self._map_host = [[torch.zeros(E, dtype=torch.int64, pin_memory=True) for _ in range(2)] for _ in range(L)]
            self._map_turn = [0] * L
        self._pending: list[Pending] = [None] * L

    def resize(self, capacity: int) -> None:
        """New slot buffers for ``capacity`` slots per layer (empty; the next sequence copies its warm set), where
        the layers have another number of slots."""
        if int(capacity) == self.capacity:
            return
        self.link.close()
        self._allocate(capacity)

    def memory(self) -> OffloadMemory:
        p = self.placement
        full = self.num_layers * self.num_experts * p.bytes_per_expert
        return OffloadMemory(
            device=str(self.device), num_layers=self.num_layers, num_experts=self.num_experts, capacity=self.capacity,
            bytes_per_expert=p.bytes_per_expert, expert_bytes_full=full,
            expert_bytes_device=self.num_layers * self.capacity * p.bytes_per_expert,
            host_store_bytes=sum(b.numel() for b in p.buffers), non_expert_bytes_device=p.non_expert_bytes,
            pinned=p.pinned,
        )

    def close(self) -> None:
        """Restore the model (weights on their original devices, original experts implementation)."""
        link = getattr(self, "link", None)
        if link is not None:
            link.close()
        for cfg, previous in self._configs:
            _set_implementation(cfg, previous)
        self._configs = []
        for module in self.modules:
            module.__dict__.pop(_ATTR, None)
        self.placement.restore()
        self.slots = []
        self._proxies = []

    # ------------------------------------------------------------------ what a layer's computation reads
    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Every expert of ``layer`` in the host store: ``[E, ...]`` per weight name."""
        return self.placement.store[layer]

    def slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s slot buffers on the device: ``[C, ...]`` per weight name (reallocated by :meth:`resize` and
        by a dtype change)."""
        return self.slots[layer]

    def experts_module(self, layer: int) -> SlotExperts:
        return self._proxies[layer]

    def check_device(self) -> None:
        """``ValueError`` where the model (its first router) moved away from the offload device."""
        device = self._router.weight.device
        if device != self.device:
            raise ValueError(
                f"psr_hf offload: the model's weights are on {device}, but it was offloaded to compute on "
                f"{self.device} (the model was moved after patching); psr_hf.unpatch(model), move it, and "
                f"patch it again with OffloadConfig(device=...)"
            )

    def synchronize(self) -> None:
        """Wait for every copy in flight and every computation enqueued."""
        self.link.synchronize()

    def unsupported_on_device(self) -> str | None:
        """Why the engine's token graph cannot make these copies on the GPU (None: it can)."""
        if self.config.copy_delay_ms > 0:
            return "copy_delay_ms delays the copies the host issues"
        if self.config.check_slots:
            return "check_slots checks the slots on the host"
        return None

    # ------------------------------------------------------------------ weights changed after offloading
    def _remember_weights(self) -> None:
        # per expert weight: (layer, the module's parameter dict, name, parameter, data address, version counter)
        self._seen = [(layer, module._parameters, name, param, param.data_ptr(), param._version)
                      for layer, (module, params) in enumerate(zip(self.modules, self.placement.expert_params))
                      for name, param, _ in params]

    def sync_weights(self, resident: Callable[[int], np.ndarray]) -> bool:
        """Called at the start of every forward pass: make the slots hold the model's current expert weights.

        An in-place change of an expert weight (``param.copy_``, ``load_state_dict``, in-place arithmetic under
        ``no_grad``; seen by its version counter) changes the host store, which the parameter points into: the
        layer's slots are copied again. New parameters or new data (``load_state_dict(assign=True)``,
        ``model.to(dtype)``, ``.half()``, ``.to(device)``) are copied into the host store (a new one in the new
        dtype, with new slots) and pointed at it again; the slots are filled with ``resident(layer)`` ([E] bool or
        expert ids: the logical cache). Cost when nothing changed: one identity, address and version comparison
        per expert weight (a few microseconds per forward). Returns whether anything changed. Edits that bypass
        the version counter (through ``param.data`` or another alias of the storage) are not seen:
        :meth:`refresh` copies every slot again."""
        changed, rebound = set(), []
        for layer, params, name, param, address, version in self._seen:
            current = params.get(name)
            if current is not param or current.data_ptr() != address:
                if layer not in rebound:
                    rebound.append(layer)
            elif current._version != version:
                changed.add(layer)
        if not changed and not rebound:
            return False
        retyped = False
        for layer in rebound:
            retyped |= self.placement.rebind(layer, self.modules[layer])
        sizes = {sum(t[0].numel() * t.element_size() for t in views.values()) for views in self.placement.store}
        if len(sizes) != 1:
            raise ValueError(
                f"psr_hf offload: the MoE layers' experts now differ in size ({sorted(sizes)} bytes; the dtype of "
                "some layers changed after offloading); convert the whole model, or unpatch, convert, patch again"
            )
        self.placement.bytes_per_expert = sizes.pop()
        self._remember_weights()
        if retyped:  # new slot buffers in the new dtype, filled with the logical cache
            counters = self.scheduler.counters
            self.link.close()
            self._allocate(self.capacity)
            self.scheduler.counters = counters
            self.scheduler.new_sequence([np.flatnonzero(resident(layer)) for layer in range(self.num_layers)])
        else:
            for layer in sorted(changed | set(rebound)):
                self.scheduler.refresh(layer)
        logger.info("psr_hf offload: expert weights changed after offloading (layers %s); slots %s",
                    sorted(changed | set(rebound)), "reallocated" if retyped else "copied again")
        return True

    def refresh(self) -> None:
        """Copy every slot of every layer again from the host store (after edits :meth:`sync_weights` cannot see)."""
        for layer in range(self.num_layers):
            self.scheduler.refresh(layer)

    def abort(self) -> None:
        """A forward pass stopped part-way (any exception, ``KeyboardInterrupt`` included): forget the layers'
        pending selections and make the slots consistent (:meth:`SlotScheduler.recover`)."""
        self._pending = [None] * self.num_layers
        self.scheduler.recover()

    # ------------------------------------------------------------------ decisions (from the controller)
    def new_sequence(self, warm: list[np.ndarray]) -> None:
        self._pending = [None] * self.num_layers
        self.scheduler.new_sequence(warm)

    def route(self, layer: int, plan: StepPlan, chosen: np.ndarray, mirror: bool, resident: np.ndarray | None) -> None:
        """A layer's selection is known: ``chosen`` [N, K] host experts per flattened position (what the layer
        executes). ``mirror``: one row, one real position (the slots follow ``plan`` exactly); else a block, run
        in groups of at most C experts, after which the slots move toward ``resident`` ([E] bool, the row's logical cache; None with
        several rows)."""
        if mirror:
            self.scheduler.decode_select(layer, plan, chosen[0].copy(), resident)
            self._pending[layer] = True
        else:
            self._pending[layer] = (chosen.copy(), resident)

    def prefetch(self, layer: int, plan: StepPlan, resident: np.ndarray) -> None:
        """Part 1 of ``layer`` ran (one row, one position): queue its prefetch copies."""
        self.scheduler.decode_prefetch(layer, plan, resident)

    # ------------------------------------------------------------------ slots filled by the device
    def lend_slots(self) -> np.ndarray:
        """For the engine's token graph, which copies experts itself: every queued copy issued and complete;
        returns the ``[L, E]`` slot of each expert (-1: none). :meth:`return_slots` hands the slots back."""
        self._pending = [None] * self.num_layers
        return self.scheduler.drain()

    def return_slots(self, expert_slot: np.ndarray, demand: int, prefetch: int) -> None:
        """The slots hold ``expert_slot`` (``[L, E]``) after ``demand`` and ``prefetch`` copies made on the device."""
        self.scheduler.adopt(expert_slot, demand, prefetch)

    # ------------------------------------------------------------------ execution by an external decoder
    def decode_slots(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """For a decoder that computes the MoE itself (``psr_hf.engine``): the decode selection of ``layer`` made by
        the controller is consumed (as :meth:`run` does), its copies waited for, and the slot of each of
        ``experts`` returned (int64, the shape of ``experts``: ``[K]`` for one position). Call :meth:`decode_done`
        once the computation reading the slots has been issued."""
        self._pending[layer] = None  # consumed: a later run() of the layer asks the device instead
        sched = self.scheduler
        sched.wait(layer)
        slot_map = sched.layers[layer].expert_slot
        slots = slot_map[experts]  # a new int64 array
        if min(slots.ravel().tolist()) < 0:
            raise RuntimeError(f"psr_hf offload: layer {layer} executes experts {experts.tolist()} but the slots hold "
                               f"{slot_map.tolist()} (-1: none)")
        if self.config.check_slots:
            self._check(layer, torch.from_numpy(np.ascontiguousarray(experts)))
        return slots

    def decode_done(self, layer: int) -> None:
        """The computation reading ``layer``'s slots is issued: they may be overwritten after it; the queued
        prefetches are issued."""
        self.link.read_done(layer)
        self.scheduler.pump()

    # ------------------------------------------------------------------ execution (from the experts modules)
    def run(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        pending, self._pending[layer] = self._pending[layer], None
        sched = self.scheduler
        if pending is True:  # decoding: the copies were issued when the layer's selection was made
            sched.wait(layer)
            out = self._compute(layer, hidden, top_k_index, top_k_weights, upload_async=True)
            sched.pump()
            return out
        if pending is None:  # the router ran without the controller (calibration of a patched model): ask the device
            chosen, target = top_k_index.detach().to("cpu").numpy().astype(np.int64), None
        else:
            chosen, target = pending
        groups = sched.groups(layer, np.unique(chosen))
        out = None
        for group in groups:
            sched.load(layer, group, target)
            sched.wait(layer)
            if len(groups) == 1:
                out = self._compute(layer, hidden, top_k_index, top_k_weights, upload_async=False)
            else:  # this group's (position, k) pairs with their weights, the others with weight 0
                part = self._compute(layer, hidden, top_k_index, top_k_weights, upload_async=False, group=group)
                out = part if out is None else out + part
        if target is not None:
            sched.reconcile(layer, target)
        sched.pump()
        return out

    def _compute(self, layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                 upload_async: bool, group: np.ndarray | None = None) -> torch.Tensor:
        """The model's experts implementation on the slot buffers. ``group``: only the pairs whose expert is in it
        count (the others run on a slot of the group with weight 0, which adds exact zeros)."""
        st = self.scheduler.layers[layer]
        slot_map = st.expert_slot if group is None else st.expert_slot.copy()
        if self.config.check_slots:
            self._check(layer, index if group is None else torch.from_numpy(group))
        if group is not None:
            outside = np.ones(self.num_experts, dtype=bool)
            outside[group] = False
            slot_map[outside] = self.capacity + slot_map[group[0]]  # >= C: outside the group
        if self.device.type == "cuda":
            if upload_async:  # decoding: the layer's persistent device map, uploaded when the slots changed
                device_map = self._map_device[layer]
                if st.dirty:
                    # two pinned buffers per layer, used in turn: one is rewritten only after the other's upload,
                    # and every decode step synchronises with the device in between
                    turn = self._map_turn[layer] = 1 - self._map_turn[layer]
                    staging = self._map_host[layer][turn]
                    staging.numpy()[:] = slot_map
                    device_map.copy_(staging, non_blocking=True)
                    st.dirty = False
            else:  # a block: the map changes between groups, so copy it synchronously (the persistent one stays)
                device_map = torch.from_numpy(np.ascontiguousarray(slot_map)).to(self.device)
            slots = device_map[index]
        else:
            slots = torch.from_numpy(slot_map)[index]  # the gather copies: the map may change afterwards
        if group is not None:
            inside = slots < self.capacity
            weights = weights * inside.to(weights.dtype)
            slots = torch.where(inside, slots, slots - self.capacity)
        out = self._execute(layer, hidden, slots, weights)
        self.link.read_done(layer)
        return out

    def _execute(self, layer: int, hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The model's experts implementation over ``layer``'s slots: ``slots`` ``[T, K]`` (on the device) with
        their ``weights``, the slots' copies waited for."""
        if self.device.type == "cpu" and hidden.shape[0] > 1 and torch.get_num_threads() > 1:
            return _slot_by_slot(self._inner[layer], self._proxies[layer], hidden, slots, weights)
        return self._inner[layer](self._proxies[layer], hidden, slots, weights)

    def _check(self, layer: int, index: torch.Tensor) -> None:
        """check_slots: every expert the layer executes is in a slot whose buffers equal the host store's."""
        self.link.synchronize()
        st = self.scheduler.layers[layer]
        for e in np.unique(index.detach().to("cpu").numpy()):
            slot = int(st.expert_slot[e])
            if slot < 0:
                raise RuntimeError(f"psr_hf offload: layer {layer} executes expert {e}, which is in no slot")
            for name, buf in self.slots[layer].items():
                if not torch.equal(buf[slot].cpu(), self.placement.store[layer][name][e]):
                    raise RuntimeError(f"psr_hf offload: layer {layer} slot {slot} does not hold expert {e} ({name})")

    # ------------------------------------------------------------------ statistics
    def stats(self, tokens: int) -> OffloadStats:
        """The physical copies since :meth:`reset_stats`, over ``tokens`` real tokens (for the per-token figures)."""
        c = self.scheduler.stats()
        return OffloadStats(
            tokens=int(tokens), demand=c.demand, prefetch=c.prefetch, prefetch_in_time=c.prefetch_in_time,
            prefetch_late=c.prefetch_late, prefetch_unused=c.prefetch_unused, dropped=c.dropped, warm=c.warm,
            bytes=c.bytes, wait_ms=c.wait_s * 1e3,
        )

    def reset_stats(self) -> None:
        self.scheduler.reset_counters()
