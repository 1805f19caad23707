"""Where every weight of an offloaded model lives, and how to put it back.

:func:`place` moves every non-expert parameter and buffer to the compute device and the routed experts of each MoE
layer into one contiguous host buffer per layer (the *host store*, pinned for asynchronous copies); the experts'
``nn.Parameter`` objects stay in the model and point into the store, so ``state_dict()`` still works and host
memory holds each expert once. :meth:`Placement.restore` undoes it: every tensor goes back to the device it came
from, with the same values.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

_GiB = 1024.0**3
_ALIGN = 256  # bytes; each tensor of an expert starts at an aligned offset of the layer's host buffer
# weights an experts module may hold, all with the experts as their first dimension (transformers 5.x names)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj_bias")


class OffloadMemoryError(MemoryError):
    """The offloaded model does not fit, or the host store could not be allocated; the message has the numbers."""


@dataclass(frozen=True)
class OffloadMemory:
    """Memory of an offloaded model, in bytes (``controller(model).memory()``).

    ``expert_bytes_full``: every routed expert of every MoE layer; ``expert_bytes_device``: the expert slots on the
    device (``capacity / num_experts`` of the full amount); ``host_store_bytes``: the host store (``pinned`` or
    not); ``non_expert_bytes_device``: every other weight and buffer, on the device.
    """

    device: str
    num_layers: int
    num_experts: int
    capacity: int
    bytes_per_expert: int
    expert_bytes_full: int
    expert_bytes_device: int
    host_store_bytes: int
    non_expert_bytes_device: int
    pinned: bool

    @property
    def device_fraction(self) -> float:
        """Expert memory on the device as a fraction of all experts (``capacity / num_experts``)."""
        return self.expert_bytes_device / self.expert_bytes_full if self.expert_bytes_full else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device_fraction": self.device_fraction}

    def __repr__(self) -> str:
        return (f"OffloadMemory(device={self.device!r}, capacity={self.capacity}/{self.num_experts} x "
                f"{self.num_layers} layers, expert GiB {self.expert_bytes_device / _GiB:.3f} of "
                f"{self.expert_bytes_full / _GiB:.3f}, other GiB {self.non_expert_bytes_device / _GiB:.3f}, "
                f"host GiB {self.host_store_bytes / _GiB:.3f}, pinned={self.pinned})")

    def __str__(self) -> str:
        return (f"experts on {self.device}: {self.expert_bytes_device / _GiB:.2f} GiB of {self.expert_bytes_full / _GiB:.2f}"
                f" GiB ({self.capacity}/{self.num_experts} slots x {self.num_layers} layers); other weights "
                f"{self.non_expert_bytes_device / _GiB:.2f} GiB; host store {self.host_store_bytes / _GiB:.2f} GiB"
                f"{' pinned' if self.pinned else ''}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expert_weights(experts: nn.Module, num_experts: int, layer: int) -> list[tuple[str, nn.Parameter]]:
    """The routed-expert weights of one experts module, checked: ``[(name, parameter)]`` in a fixed order."""
    params = dict(experts.named_parameters(recurse=False))
    found = [(name, params[name]) for name in EXPERT_WEIGHTS if name in params]
    other = sorted(set(dict(experts.named_parameters()).keys()) - {name for name, _ in found})
    if not found or other:
        raise ValueError(
            f"MoE layer {layer}: {type(experts).__name__} holds weights psr_hf cannot offload "
            f"(expected 3D stacked expert weights named {', '.join(EXPERT_WEIGHTS[:3])}; found "
            f"{sorted(params)}{', and ' + str(other) if other else ''}); this architecture or transformers version "
            "is not supported by the offload"
        )
    for name, p in found:
        if p.shape[0] != num_experts:
            raise ValueError(f"MoE layer {layer}: {name} has shape {tuple(p.shape)}; expected {num_experts} experts first")
        if p.device.type == "meta":
            raise ValueError(
                f"MoE layer {layer}: {name} is on the meta device (not loaded); load the model's weights "
                "(from_pretrained without device_map='meta' or disk offload) before offloading it"
            )
    return found


class Placement:
    """The moved tensors of one offloaded model: host store views per layer, and what to restore."""

    def __init__(self) -> None:
        self.store: list[dict[str, torch.Tensor]] = []  # per layer: name -> [E, ...] view into the layer's buffer
        self.buffers: list[torch.Tensor] = []  # per layer: the contiguous host buffer (uint8)
        self.expert_params: list[list[tuple[str, nn.Parameter, torch.device]]] = []  # per layer: original devices
        self.moved_params: list[tuple[nn.Parameter, torch.device]] = []
        self.moved_buffers: list[tuple[nn.Module, str, torch.device]] = []
        self.bytes_per_expert = 0
        self.non_expert_bytes = 0
        self.pinned = False

    def rebind(self, layer: int, module: nn.Module) -> bool:
        """The expert weights of ``layer`` (``module``) no longer point into the host store: new parameters
        (``load_state_dict(assign=True)``), new data (``model.to(dtype)``, ``.half()``, ``.to(device)``,
        ``param.data = ...``). Copy their values into the store, in a new buffer when the dtype changed, and point
        them at it again; they keep their original devices for :meth:`restore`. Returns whether the dtype changed
        (the slots must be reallocated). ``ValueError`` when a weight was removed or reshaped."""
        devices = {name: device for name, _, device in self.expert_params[layer]}
        current = []
        for name in devices:
            t = module._parameters.get(name)
            view = self.store[layer][name]
            if t is None or t.shape != view.shape or t.device.type == "meta":
                raise ValueError(
                    f"MoE layer {layer}: the expert weight {name} was removed, reshaped or moved to the meta device "
                    f"after offloading (now {None if t is None else (tuple(t.shape), str(t.device))}, offloaded "
                    f"{tuple(view.shape)}); psr_hf.unpatch(model), change the model, then patch it again"
                )
            current.append((name, t))
        retyped = any(t.dtype != self.store[layer][name].dtype for name, t in current)
        if retyped:
            buffer, views = _host_buffer(layer, current, self.pinned, len(self.store))
            self.buffers[layer], self.store[layer] = buffer, views
        else:
            for name, t in current:
                view = self.store[layer][name]
                if t.data_ptr() != view.data_ptr():
                    view.copy_(t.data)
        for name, t in current:
            t.data = self.store[layer][name]
        self.expert_params[layer] = [(name, t, devices[name]) for name, t in current]
        return retyped

    def point_at(self, model: nn.Module, source: nn.Module) -> None:
        """Point ``model``'s offloaded expert parameters at ``source``'s tensors of the same names (a copy of
        ``source`` that is thrown away), so that :meth:`restore` gives them back without a copy of every expert."""
        originals = dict(source.named_parameters(remove_duplicate=False))
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        for layer in self.expert_params:
            for _, param, _ in layer:
                param.data = originals[names[id(param)]].data

    def restore(self) -> None:
        """Put every tensor back on its original device (values unchanged) and release the host store."""
        for layer, layer_params in enumerate(self.expert_params):
            for name, param, device in layer_params:
                if param.data_ptr() != self.store[layer][name].data_ptr():
                    data = param.data.to(device)  # pointed elsewhere already (a bench copy given its source's)
                elif device.type == "cpu":  # a fresh pageable copy: the pinned store is released below
                    data = torch.empty(param.shape, dtype=param.dtype)
                    data.copy_(param.data)
                else:
                    data = param.data.to(device)
                param.data = data
        for param, device in self.moved_params:
            param.data = param.data.to(device)
        for module, name, device in self.moved_buffers:
            module._buffers[name] = module._buffers[name].to(device)
        self.expert_params.clear()
        self.moved_params.clear()
        self.moved_buffers.clear()
        self.store.clear()
        self.buffers.clear()


def place(model: nn.Module, experts_modules: list[nn.Module], num_experts: int, capacity: int,
          device: torch.device, pin: bool) -> Placement:
    """Move ``model``'s non-expert weights to ``device`` and the experts of ``experts_modules`` (one per MoE layer)
    into a host store; checks first that the non-expert weights and ``capacity`` slots per layer fit on the device.
    Raises :class:`OffloadMemoryError` with the numbers when they do not, or when the host store cannot be allocated."""
    weights = [expert_weights(m, num_experts, i) for i, m in enumerate(experts_modules)]
    per_expert = [sum(_nbytes(p[0]) for _, p in layer) for layer in weights]
    if len(set(per_expert)) != 1:
        raise ValueError(f"MoE layers differ in expert size ({sorted(set(per_expert))} bytes); psr_hf needs one shape")
    placement = Placement()
    placement.bytes_per_expert = per_expert[0]
    L = len(weights)
    params, buffers = non_expert_tensors(model, weights)
    placement.non_expert_bytes = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for _, _, b in buffers)
    _check_device_fit(device, params, buffers, weights, L * capacity * per_expert[0], placement.non_expert_bytes)

    try:
        # experts first: on a model that sits on the device, this frees device memory before anything else moves there
        placement.pinned = pin and device.type == "cuda"
        for layer, layer_weights in enumerate(weights):
            buffer, views = _host_buffer(layer, layer_weights, placement.pinned, L)
            restore = [(name, p, p.device) for name, p in layer_weights]
            for name, p in layer_weights:
                p.data = views[name]
            placement.buffers.append(buffer)
            placement.store.append(views)
            placement.expert_params.append(restore)
        move_non_experts(placement, params, buffers, device)
    except BaseException:
        placement.restore()
        raise
    return placement


def non_expert_tensors(model: nn.Module, weights: list[list[tuple[str, nn.Parameter]]]) -> tuple[list, list]:
    """``(parameters, [(module, name, buffer)])`` of ``model`` other than the expert ``weights`` (per layer)."""
    expert_ids = {id(p) for layer in weights for _, p in layer}
    params = [p for p in model.parameters() if id(p) not in expert_ids]  # parameters() yields tied weights once
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    return params, buffers


def move_non_experts(placement: Placement, params: list, buffers: list, device: torch.device) -> None:
    """Move ``params`` and ``buffers`` (:func:`non_expert_tensors`) to ``device``, remembered for restore."""
    for p in params:
        if p.device != device:
            placement.moved_params.append((p, p.device))
            p.data = p.data.to(device)
    for module, name, b in buffers:
        if b.device != device:
            placement.moved_buffers.append((module, name, b.device))
            module._buffers[name] = b.to(device)


def _host_buffer(layer: int, layer_weights: list, pinned: bool, num_layers: int) -> tuple[torch.Tensor, dict]:
    """One layer's host store: a contiguous uint8 buffer (pinned or not) holding a copy of each ``(name, tensor)``
    at an aligned offset, and the views ``{name: tensor}`` into it."""
    buffer, views = host_store(layer, [(name, p.shape, p.dtype) for name, p in layer_weights], pinned, num_layers)
    for name, p in layer_weights:
        views[name].copy_(p.data)
    return buffer, views


def host_store(layer: int, specs: list[tuple[str, tuple[int, ...], torch.dtype]], pinned: bool,
               num_layers: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One layer's empty host store: a contiguous uint8 buffer (pinned or not) and a view ``{name: tensor}`` of
    each ``(name, shape, dtype)`` of ``specs`` at an aligned offset; :class:`OffloadMemoryError` where it cannot
    be allocated."""
    offsets, total = [], 0
    for _, shape, dtype in specs:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    try:
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    except RuntimeError as error:
        L = num_layers
        raise OffloadMemoryError(
            f"psr_hf offload: could not allocate the {'pinned ' if pinned else ''}host store of MoE "
            f"layer {layer} ({total / _GiB:.2f} GiB; {L * total / _GiB:.2f} GiB for all {L} layers): {error}. "
            "Free host memory, raise the locked-memory limit, or pass OffloadConfig(pin_memory=False) "
            "(slower, synchronous copies)"
        ) from error
    views = {}
    for (name, shape, dtype), offset in zip(specs, offsets):
        views[name] = buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
    return buffer, views


def _check_fit(device: torch.device, arriving: int, slot_bytes: int, leaving: int, non_expert: int, *, free: int,
               total: int) -> None:
    """Raise :class:`OffloadMemoryError` unless ``arriving`` non-expert bytes and ``slot_bytes`` of slots fit in
    ``free`` bytes of ``device`` plus the ``leaving`` expert bytes that move off it."""
    need = arriving + slot_bytes
    if need > free + leaving:
        raise OffloadMemoryError(
            f"psr_hf offload: the model does not fit on {device}: it needs {need / _GiB:.2f} GiB more there "
            f"(non-expert weights {arriving / _GiB:.2f} GiB of {non_expert / _GiB:.2f} GiB still to move, expert "
            f"slots {slot_bytes / _GiB:.2f} GiB) but {free / _GiB:.2f} GiB of {total / _GiB:.2f} GiB are free"
            f"{f' (+{leaving / _GiB:.2f} GiB of experts leaving)' if leaving else ''}. Lower the residency or "
            "capacity, free device memory, or use a larger device"
        )


def _check_device_fit(device: torch.device, params: list, buffers: list, weights: list, slot_bytes: int,
                      non_expert: int) -> None:
    """Where ``device`` is CUDA: :func:`_check_fit` for the non-expert ``params``/``buffers`` arriving, ``slot_bytes``
    of slots and the expert ``weights`` (per layer, ``[(name, parameter)]``) leaving it."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    arriving = sum(_nbytes(p) for p in params if p.device != device)
    arriving += sum(_nbytes(b) for _, _, b in buffers if b.device != device)
    leaving = sum(_nbytes(p) for layer in weights for _, p in layer if p.device == device)
    _check_fit(device, arriving, slot_bytes, leaving, non_expert, free=free, total=total)
