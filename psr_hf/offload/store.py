"""Where a model's routed experts live, behind one interface chosen once (as vLLM's fused MoE layer hands its
compute to a method object picked when the layer is built), so that the transformers path, the engine and the
speculative engine ask the store instead of branching on where the experts are.

:class:`ExpertStore` is what every placement provides to a layer's computation: per MoE layer ``capacity`` slots
of expert weights and the slot of each expert it executes. :class:`PatchedExpertStore` adds what a patched model's
:class:`~psr_hf.hf.controller.Controller` tells its store: the logical cache's decisions, sequence starts, stopped
forward passes, changed weights, statistics (:class:`OffloadStats`). Implementations: :class:`ResidentExperts`
here (the model's own weights, slot = expert id, nothing moves), :class:`~psr_hf.offload.experts.OffloadedExperts`
(a host store and device slots that follow the logical cache) and the speculative engine's
:class:`~psr_hf.engine.speculative.ExpertSlots` (a host store and slots that follow the block selection).
:func:`psr_hf.patch` chooses the controller's store: resident unless ``offload=`` is given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from .placement import EXPERT_WEIGHTS, OffloadMemory

if TYPE_CHECKING:
    from ..policy.cache import StepPlan


@dataclass(frozen=True)
class OffloadStats:
    """Physical copies of an offloaded model since :meth:`Controller.reset_stats` (per token: divided by the real
    tokens the model processed in that time).

    ``demand``: copies a layer needed at once (it waits for all of it); ``prefetch``: prefetch insertions, of which
    ``prefetch_in_time`` had arrived when their expert first executed, ``prefetch_late`` were still in flight or
    queued then (the layer waits for the rest), ``prefetch_unused`` were copied but evicted before any use, and
    ``dropped`` were reassigned before they were issued (no copy); ``warm``: warm-set copies at sequence starts
    (part of prompt processing); ``bytes``: bytes copied; ``wait_ms``: time the computation waited for copies
    (device time on CUDA, measured with events; wall time on the CPU path).
    """

    tokens: int
    demand: int
    prefetch: int
    prefetch_in_time: int
    prefetch_late: int
    prefetch_unused: int
    dropped: int
    warm: int
    bytes: int
    wait_ms: float

    def per_token(self, name: str) -> float:
        return float(getattr(self, name)) / max(self.tokens, 1)

    def __repr__(self) -> str:
        return (f"OffloadStats(tokens={self.tokens}, demand/tok={self.per_token('demand'):.2f}, "
                f"prefetch/tok={self.per_token('prefetch'):.2f} (in time {self.prefetch_in_time}, late "
                f"{self.prefetch_late}, unused {self.prefetch_unused}), dropped={self.dropped}, warm={self.warm}, "
                f"MiB={self.bytes / 2**20:.1f}, wait_ms={self.wait_ms:.1f})")

    def to_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = asdict(self)
        for name in ("demand", "prefetch", "prefetch_in_time", "prefetch_late", "prefetch_unused", "dropped",
                     "bytes", "wait_ms"):
            out[f"{name}_per_token"] = self.per_token(name)
        out["copies_per_token"] = (self.demand + self.prefetch - self.dropped) / max(self.tokens, 1)
        out["warm_copies"] = self.warm
        return out


class SlotExperts:
    """An experts module as transformers' experts functions see it: the slot buffers ``weights`` as its weights,
    ``capacity`` experts; every other attribute (config, activation, flags) is ``module``'s."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], capacity: int):
        self.__dict__.update(weights)
        self.num_experts = capacity
        self._module = module

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


@runtime_checkable
class ExpertStore(Protocol):
    """The experts of every MoE layer as its computation reads them: ``capacity`` slots of expert weights per
    layer, and the slot each executed expert is in.

    An implementation provides, per layer ``layer`` (the MoE layers in order from 0):

    - ``offloaded``: True where a slot may hold any expert and copies fill the slots (the computation reads the
      slots through :meth:`decode_slots`); False where every expert has a slot of its own (slot = expert id) and
      nothing is copied;
    - ``capacity``: slots per layer (the number of experts where ``offloaded`` is False);
    - ``weight_format``: ``"model"`` where the slots hold the experts module's own weights, ``"fp8"`` where they
      hold FP8 experts with block scales (:class:`Fp8ExpertStore`), which the engine computes on with its FP8
      kernel (:mod:`psr_hf.engine.slot_moe`);
    - :meth:`expert_weights` and :meth:`slot_weights`: every expert where the store keeps it, and the slots the
      computation reads, by the experts module's weight names (``gate_up_proj``, ``down_proj``, ...) in the
      module's layout;
    - :meth:`experts_module`: the layer's experts module over the slots, for transformers' experts functions;
    - :meth:`decode_slots` and :meth:`decode_done`: the slots of the experts a computation reads, once their
      copies are waited for, and the moment that computation is issued (the slots may be overwritten after it);
    - ``slot_generation``: a number that changes whenever the slot buffers are allocated again, so that a decoder
      whose graphs read their addresses checks them only then (once per step is one comparison).
    """

    offloaded: bool
    capacity: int
    weight_format: str
    slot_generation: int

    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Every expert of ``layer`` where the store keeps it: ``[E, ...]`` per weight name."""

    def slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """The slots ``layer``'s computation reads: ``[C, ...]`` per weight name (fixed buffers of the store)."""

    def experts_module(self, layer: int) -> nn.Module | SlotExperts:
        """``layer``'s experts module as transformers' experts functions see it: the slots as its weights."""

    def decode_slots(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The slot of each of ``experts`` (int64, any shape) of ``layer``, after their copies are waited for on
        the computation's stream; call :meth:`decode_done` once the computation reading them is issued."""

    def decode_done(self, layer: int) -> None:
        """The computation reading ``layer``'s slots is issued: a later copy into them waits for it."""


@runtime_checkable
@runtime_checkable
class Fp8ExpertStore(ExpertStore, Protocol):
    """A store whose slots hold FP8 experts (``weight_format == "fp8"``,
    :class:`~psr_hf.offload.fp8_experts.Fp8OffloadedExperts`)."""

    def fp8_slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s FP8 slots as the copies fill them: float8_e4m3fn ``gate_up_proj`` ``[C, 2I, H]`` and
        ``down_proj`` ``[C, H, I]`` with float32 ``gate_up_proj_scale_inv`` and ``down_proj_scale_inv`` (one per
        128 x 128 block; gate's block rows, then up's)."""


class PatchedExpertStore(ExpertStore, Protocol):
    """The expert store of a model patched by :func:`psr_hf.patch`, which its controller holds (never None) and
    tells what happens: the slots follow the logical cache (:meth:`route`, :meth:`prefetch`, :meth:`new_sequence`),
    and they stay consistent with the model's weights (:meth:`check_device`, :meth:`sync_weights`,
    :meth:`refresh`) and after a forward pass that stopped part-way (:meth:`abort`). Where nothing moves (the
    resident store) every such call does nothing, so callers make it without asking; the decode path asks
    ``offloaded`` only to skip computing what :meth:`route` and :meth:`prefetch` would be given (host time per
    layer). A further layout (FP8 expert weights, other placements) is one more implementation of these members;
    no caller changes."""

    def check_device(self) -> None:
        """``ValueError`` where the model moved away from where the store computes."""

    def sync_weights(self, resident: Callable[[int], np.ndarray]) -> bool:
        """At the start of every forward pass: make the slots hold the model's current expert weights (``resident``
        (layer): the logical cache, for slots reallocated). Returns whether anything changed."""

    def refresh(self) -> None:
        """Copy every slot again (after weight edits that :meth:`sync_weights` cannot see); ``ValueError`` where the
        experts compute from the model's own weights (nothing to copy)."""

    def new_sequence(self, warm: list[np.ndarray]) -> None:
        """A new sequence: each layer's slots take its warm set ``warm[layer]`` (expert ids)."""

    def route(self, layer: int, plan: StepPlan, chosen: np.ndarray, mirror: bool, resident: np.ndarray | None) -> None:
        """``layer``'s selection ``chosen`` ``[N, K]`` is known (``plan``: the logical cache's step); ``mirror``: one
        row, one real position, whose slots follow ``plan`` exactly; ``resident``: the row's logical cache ([E],
        nonzero: cached; None with several rows)."""

    def prefetch(self, layer: int, plan: StepPlan, resident: np.ndarray) -> None:
        """Part 1 of ``layer`` ran for one row and one position: its prefetch insertions in ``plan``."""

    def abort(self) -> None:
        """A forward pass stopped part-way: forget its pending selections and make the slots consistent."""

    def resize(self, capacity: int) -> None:
        """``capacity`` slots per layer from the next sequence on (nothing where the store has them)."""

    def synchronize(self) -> None:
        """Wait for every copy into the slots in flight (nothing writes them until the next copy is issued)."""

    def unsupported_on_device(self) -> str | None:
        """Why the GPU cannot make this store's copies itself (the engine's token graph); None where it can."""

    def lend_slots(self) -> np.ndarray | None:
        """For a device that copies experts itself: every queued copy issued and complete; the ``[L, E]`` slot of
        each expert (-1: none), or None where nothing is copied. :meth:`return_slots` hands them back."""

    def return_slots(self, expert_slot: np.ndarray, demand: int, prefetch: int) -> None:
        """The slots hold ``expert_slot`` ``[L, E]`` after ``demand`` and ``prefetch`` copies made by the device."""

    def stats(self, tokens: int) -> OffloadStats | None:
        """The physical copies since :meth:`reset_stats` over ``tokens`` real tokens; None where nothing is copied."""

    def reset_stats(self) -> None:
        """Start a new statistics interval."""

    def memory(self) -> OffloadMemory:
        """Where the experts' bytes are; ``ValueError`` where the experts are the model's own weights."""

    def close(self) -> None:
        """Give the model's weights back as they were (the store is not used afterwards)."""


class ResidentExperts:
    """The model's own expert weights as the slots (slot = expert id): the store of a patched model that is not
    offloaded. Nothing is copied, so every notification does nothing. ``modules``: the experts module of each MoE
    layer; their weights are read at each call, so a replaced parameter is the one read."""

    offloaded = False
    weight_format = "model"
    slot_generation = 0  # the model's own weights: a decoder reads them where they are (not offloaded)

    def __init__(self, modules: list[nn.Module], num_experts: int):
        self.modules = modules
        self.capacity = int(num_experts)

    # ------------------------------------------------------------------ what a layer's computation reads
    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        module = self.modules[layer]
        weights = {name: getattr(module, name, None) for name in EXPERT_WEIGHTS}
        return {name: w for name, w in weights.items() if isinstance(w, torch.Tensor)}

    def slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return self.expert_weights(layer)

    def experts_module(self, layer: int) -> nn.Module:
        return self.modules[layer]

    def decode_slots(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return np.array(experts, dtype=np.int64)  # a new array, as the offloaded store's

    def decode_done(self, layer: int) -> None:
        pass

    # ------------------------------------------------------------------ what the controller tells it
    def check_device(self) -> None:
        pass  # the experts compute wherever the model put them

    def sync_weights(self, resident: Callable[[int], np.ndarray]) -> bool:
        return False  # the computation reads the model's weights themselves

    def refresh(self) -> None:
        raise ValueError("this model is not offloaded: its experts compute from the model's own weights")

    def new_sequence(self, warm: list[np.ndarray]) -> None:
        pass

    def route(self, layer: int, plan: StepPlan, chosen: np.ndarray, mirror: bool, resident: np.ndarray | None) -> None:
        pass

    def prefetch(self, layer: int, plan: StepPlan, resident: np.ndarray) -> None:
        pass

    def abort(self) -> None:
        pass

    def resize(self, capacity: int) -> None:
        pass  # every expert keeps its slot whatever the logical cache's capacity

    def synchronize(self) -> None:
        pass

    def unsupported_on_device(self) -> str | None:
        return None

    def lend_slots(self) -> np.ndarray | None:
        return None

    def return_slots(self, expert_slot: np.ndarray, demand: int, prefetch: int) -> None:
        pass

    def stats(self, tokens: int) -> OffloadStats | None:
        return None

    def reset_stats(self) -> None:
        pass

    def memory(self) -> OffloadMemory:
        raise ValueError("this model is not offloaded: patch it with offload=psr_hf.OffloadConfig(...)")

    def close(self) -> None:
        pass
