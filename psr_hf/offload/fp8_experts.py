"""The offload store of a model loaded from a fine-grained FP8 checkpoint: :class:`Fp8OffloadedExperts`, and
:func:`offloaded_experts`, which chooses it or the model's own weights once, at ``patch()``.

The host store of each MoE layer holds the checkpoint's experts as shipped, e4m3 weights with their float32 block
scales, read from its files (:mod:`.fp8_checkpoint`); the slots hold the same, and the scheduler copies every
tensor of an expert, so a copy moves FP8 bytes and the scales travel with their expert. The computation here is
the reference form, which runs wherever torch does (the CPU tests, a GPU until the fused dequantizing kernel
exists): the slots a call executes are dequantized into one scratch in transformers' fused layout
(``gate_up_proj`` ``[C, 2I, H]``, gate before up; ``down_proj`` ``[C, H, I]``), in the model's dtype, and the
model's own experts function runs on it. Its output is bitwise the model's computation on the dequantized weights
with the same slots, and, as on the bf16 path, copy timing never changes it.

The model's bf16 expert parameters would hold every expert a second time, so while offloaded each is replaced in
its module by a placeholder of its shape and dtype on the meta device (anything that reads it fails loudly
instead of reading stale values), and the original ``nn.Parameter`` holds no memory; :meth:`close` gives the
originals back, dequantized from the store, on their devices.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from ..assets.fp8_blocks import FP8_DTYPE, dequantize_blocks
from .config import OffloadConfig
from .experts import OffloadedExperts
from .fp8_checkpoint import Fp8Checkpoint, fp8_checkpoint_for, fused_parts, fused_shapes
from .placement import (Placement, _check_device_fit, expert_weights, host_store, move_non_experts,
                        non_expert_tensors)
from .store import SlotExperts

if TYPE_CHECKING:
    from ..patches.base import MoELayer

logger = logging.getLogger(__name__)

_MiB = 2.0**20
_FALLBACK = "or offload the model's own weights with OffloadConfig(expert_format='model')"


def offloaded_experts(model: nn.Module, layers: list[MoELayer], num_experts: int, capacity: int,
                      config: OffloadConfig) -> OffloadedExperts:
    """The offload store of ``model`` (what :func:`psr_hf.patch` attaches): FP8 where ``config.expert_format`` and
    the checkpoint call for it (:func:`~.fp8_checkpoint.fp8_checkpoint_for`), else the model's own weights."""
    checkpoint = fp8_checkpoint_for(model, config)
    if checkpoint is None:
        return OffloadedExperts(model, layers, num_experts, capacity, config)
    name = _module_names(model, [layers[0].block.experts])[0]
    prefix = checkpoint.experts_prefix(name)
    if prefix is None or not checkpoint.is_quantized(prefix):
        why = (f"stores no per-expert tensors {name}.<e>.gate_proj.weight (or a name ending the same)"
               if prefix is None else "keeps the routed experts unquantized (modules_to_not_convert)")
        if config.expert_format == "fp8":
            raise ValueError(f"OffloadConfig(expert_format='fp8'): the FP8 checkpoint {checkpoint.folder} {why}; "
                             f"{_FALLBACK}")
        # a layout psr_hf does not read is worth a warning; experts the checkpoint left in bf16 are not
        level = logging.WARNING if prefix is None else logging.INFO
        logger.log(level, "psr_hf offload: the FP8 checkpoint %s %s; offloading the model's own weights",
                   checkpoint.folder, why)
        return OffloadedExperts(model, layers, num_experts, capacity, config)
    return Fp8OffloadedExperts(model, layers, num_experts, capacity, config, checkpoint)


def _module_names(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    return [names[id(m)] for m in modules]


def dequantize_experts(store: dict[str, torch.Tensor], experts: list[int], block: tuple[int, int],
                       gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Write experts ``experts`` of ``store`` (FP8 ``gate_up_proj`` ``[N, 2I, H]`` and ``down_proj`` ``[N, H, I]``
    with their ``..._scale_inv``, :func:`~.fp8_checkpoint.fused_shapes`) at the same indices of ``gate_up`` and
    ``down`` (same shapes), dequantized to their dtype; gate and up each with their own block scales."""
    outputs = {"gate_up_proj": gate_up, "down_proj": down}
    parts = fused_parts(down.shape[-1], block).values()
    for e in experts:
        for name, rows, scale_rows in parts:
            dequantize_blocks(store[name][e, rows], store[f"{name}_scale_inv"][e, scale_rows], block,
                              outputs[name].dtype, out=outputs[name][e, rows])


class Fp8Placement(Placement):
    """The moved tensors of an FP8-offloaded model: the FP8 host store per layer (transformers' fused layout,
    :func:`~.fp8_checkpoint.fused_shapes`), the non-expert weights on the device, and each layer's expert
    parameters, replaced in their modules by meta ``placeholders``."""

    def __init__(self, block: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.block, self.dtype = block, dtype
        # per layer: (module, name, the placeholder in the module) beside expert_params' (name, original, device)
        self.placeholders: list[list[tuple[nn.Module, str, nn.Parameter]]] = []

    def point_at(self, model: nn.Module, source: nn.Module) -> None:
        """As :meth:`Placement.point_at`: the original parameters, pointed at ``source``'s tensors, go back into
        their modules now, so that :meth:`restore` dequantizes nothing."""
        originals = dict(source.named_parameters(remove_duplicate=False))
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        for params, held in zip(self.expert_params, self.placeholders):
            for (_, original, _), (module, name, placeholder) in zip(params, held):
                original.data = originals[names[id(placeholder)]].data
                module._parameters[name] = original

    def restore(self) -> None:
        """Give every layer's original expert parameters back, dequantized from the store on their devices (where
        the module still holds the placeholder; a parameter the user put there stays), then the rest as
        :meth:`Placement.restore` does."""
        for layer, (params, held) in enumerate(zip(self.expert_params, self.placeholders)):
            values = {name: torch.empty(placeholder.shape, dtype=placeholder.dtype) for _, name, placeholder in held}
            dequantize_experts(self.store[layer], list(range(values["down_proj"].shape[0])), self.block,
                               values["gate_up_proj"], values["down_proj"])
            for (name, original, device), (module, _, placeholder) in zip(params, held):
                if module._parameters.get(name) is placeholder:
                    original.data = values[name] if device.type == "cpu" else values[name].to(device)
                    module._parameters[name] = original
        self.expert_params.clear()
        self.placeholders.clear()
        super().restore()


def _layout(layer: int, module: nn.Module, weights: list[tuple[str, nn.Parameter]]) -> tuple[int, int]:
    """``(I, H)`` of the module's fused weights; ``ValueError`` for a layout the FP8 store does not read (biases,
    no gate, transposed)."""
    found = dict(weights)
    gate_up, down = found.get("gate_up_proj"), found.get("down_proj")
    layout_ok = (set(found) == {"gate_up_proj", "down_proj"} and not getattr(module, "has_bias", False)
                 and getattr(module, "has_gate", True) and getattr(module, "is_concatenated", True)
                 and not getattr(module, "is_transposed", False))
    if not layout_ok or gate_up.ndim != 3 or gate_up.shape[1] % 2 or tuple(down.shape) != (
            gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        raise ValueError(
            f"MoE layer {layer}: {type(module).__name__} holds "
            f"{', '.join(f'{n} {tuple(p.shape)}' for n, p in weights)}; "
            "the FP8 offload reads gated experts fused as gate_up_proj [E, 2I, H] and down_proj [E, H, I], "
            f"without biases; {_FALLBACK}")
    return gate_up.shape[1] // 2, gate_up.shape[2]


def _refuse_fp8_modules(layer: int, module: nn.Module) -> None:
    if any(p.dtype == FP8_DTYPE for p in module.parameters(recurse=False)):
        raise ValueError(
            f"MoE layer {layer}: transformers loaded the experts as FP8 modules ({type(module).__name__}, on a GPU); "
            "the FP8 offload reads the FP8 experts from the checkpoint itself and needs the dequantized modules: "
            "load the model with quantization_config=transformers.FineGrainedFP8Config(dequantize=True)")


def _check_matches(layer: int, weights: dict[str, nn.Parameter], views: dict[str, torch.Tensor],
                   block: tuple[int, int], expert: int, source: str) -> bool:
    """``ValueError`` unless expert ``expert`` of the model's weights equals the checkpoint's, dequantized, in each
    projection of whole tiles (where transformers' loader dequantizes as here). Returns whether a projection
    has partial tiles (not compared: transformers scales those by the grid's size, not by tile position)."""
    partial = False
    for proj, (name, rows, scale_rows) in fused_parts(views["down_proj"].shape[-1], block).items():
        own = weights[name][expert, rows].detach()
        if any(size % b for size, b in zip(own.shape, block)):
            partial = True
            continue
        stored = dequantize_blocks(views[name][expert, rows], views[f"{name}_scale_inv"][expert, scale_rows],
                                   block, own.dtype)
        if not torch.equal(stored, own.to("cpu")):
            raise ValueError(
                f"MoE layer {layer}: expert {expert}'s {proj} in the model differs from the FP8 checkpoint {source} "
                "dequantized (the model was changed after loading, or loaded from elsewhere); load the model from "
                f"that checkpoint unchanged, pass OffloadConfig(checkpoint='<its folder>'), {_FALLBACK}")
    return partial


def place_fp8(model: nn.Module, modules: list[nn.Module], num_experts: int, capacity: int, device: torch.device,
              pin: bool, checkpoint: Fp8Checkpoint) -> Fp8Placement:
    """:func:`~.placement.place` for FP8 experts: each layer's host store read from ``checkpoint`` (its experts
    checked against the model's on one expert), the layer's expert parameters replaced by meta placeholders, then
    the non-expert weights moved to ``device``; the device fit checked first (FP8 slots and the dequantized
    scratch). All or nothing: on any error the model is given back."""
    for layer, module in enumerate(modules):
        _refuse_fp8_modules(layer, module)
    weights = [expert_weights(m, num_experts, i) for i, m in enumerate(modules)]
    layouts = {_layout(i, m, w) for i, (m, w) in enumerate(zip(modules, weights))}
    dtypes = {p.dtype for layer in weights for _, p in layer}
    if len(layouts) != 1 or len(dtypes) != 1:
        raise ValueError(f"the MoE layers' experts differ in shape or dtype ({sorted(map(str, dtypes))}); the FP8 "
                         "offload needs one")
    shapes, dtype = fused_shapes(*layouts.pop(), checkpoint.block), dtypes.pop()
    prefixes = [checkpoint.experts_prefix(name) for name in _module_names(model, modules)]
    if None in prefixes:
        raise ValueError(f"MoE layer {prefixes.index(None)}: the FP8 checkpoint {checkpoint.folder} stores no "
                         f"per-expert tensors for it; {_FALLBACK}")
    placement = Fp8Placement(checkpoint.block, dtype)
    placement.bytes_per_expert = sum(math.prod(shape) * d.itemsize for shape, d in shapes.values())
    params, buffers = non_expert_tensors(model, weights)
    placement.non_expert_bytes = sum(p.numel() * p.element_size() for p in params) + sum(
        b.numel() * b.element_size() for _, _, b in buffers)
    scratch = capacity * sum(p[0].numel() for _, p in weights[0]) * dtype.itemsize
    L = len(modules)
    _check_device_fit(device, params, buffers, weights, L * capacity * placement.bytes_per_expert + scratch,
                      placement.non_expert_bytes)
    placement.pinned = pin and device.type == "cuda"
    partial = False
    try:
        for layer, (module, prefix) in enumerate(zip(modules, prefixes)):
            specs = [(name, (num_experts, *shape), d) for name, (shape, d) in shapes.items()]
            buffer, views = host_store(layer, specs, placement.pinned, L)
            placement.buffers.append(buffer)
            placement.store.append(views)
            checkpoint.read_experts(prefix, views)
            partial |= _check_matches(layer, dict(weights[layer]), views, checkpoint.block, layer % num_experts,
                                      str(checkpoint.folder))
            _hold(placement, module, weights[layer])
        move_non_experts(placement, params, buffers, device)
    except BaseException:
        placement.restore()
        raise
    if partial:
        logger.warning(
            "psr_hf offload: the experts' projections have partial %dx%d tiles; transformers' loader dequantizes "
            "those by the size of the scale grid, psr_hf (as the FP8 kernels) by tile position, so the FP8 store "
            "computes the checkpoint's values, which differ from the weights transformers loaded there",
            *checkpoint.block)
    return placement


def _hold(placement: Fp8Placement, module: nn.Module, weights: list[tuple[str, nn.Parameter]]) -> None:
    """Replace ``module``'s expert parameters by meta placeholders; the originals keep no memory until restored."""
    params, held = [], []
    for name, param in weights:
        placeholder = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                   requires_grad=param.requires_grad)
        module._parameters[name] = placeholder
        params.append((name, param, param.device))
        held.append((module, name, placeholder))
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    placement.expert_params.append(params)
    placement.placeholders.append(held)


class Fp8OffloadedExperts(OffloadedExperts):
    """:class:`~.experts.OffloadedExperts` whose host store and slots hold the FP8 experts of ``checkpoint``
    (:meth:`expert_weights` and :meth:`fp8_slot_weights`: e4m3 ``gate_up_proj`` and ``down_proj`` with their
    float32 ``..._scale_inv``, as transformers' FP8 experts modules name them) and whose layers compute on their
    slots dequantized into one scratch in the module's own dtype (:meth:`slot_weights`: ``gate_up_proj``,
    ``down_proj``), shared by the layers, which run in turn. The engine computes on the FP8 slots themselves
    (``weight_format``; :mod:`psr_hf.engine.slot_moe`)."""

    weight_format = "fp8"

    def __init__(self, model: nn.Module, layers: list[MoELayer], num_experts: int, capacity: int,
                 config: OffloadConfig, checkpoint: Fp8Checkpoint):
        self.checkpoint = checkpoint
        super().__init__(model, layers, num_experts, capacity, config)
        p = self.placement
        logger.info(
            "psr_hf offload: FP8 experts (e4m3, %dx%d tiles, float32 scales) read from %s: %.2f MiB per expert "
            "copy against %.2f MiB in %s; computed in %s on the executed slots, dequantized; the model's expert "
            "parameters are meta placeholders until unpatch", *p.block, checkpoint.folder,
            p.bytes_per_expert / _MiB, sum(t[0].numel() for t in self._scratch.values()) * p.dtype.itemsize / _MiB,
            p.dtype, p.dtype)

    def _place(self, model: nn.Module, capacity: int) -> Fp8Placement:
        return place_fp8(model, self.modules, self.num_experts, capacity, self.device, self.config.pin_memory,
                         self.checkpoint)

    def _allocate(self, capacity: int) -> None:
        super()._allocate(capacity)
        p, C = self.placement, self.capacity
        self._scratch = {name: torch.zeros((C, *p.store[0][name].shape[1:]), dtype=p.dtype, device=self.device)
                         for name in ("gate_up_proj", "down_proj")}
        self._proxies = [SlotExperts(m, self._scratch, C) for m in self.modules]

    def _dequantize(self, layer: int, slots: list[int]) -> None:
        """Slots ``slots`` of ``layer`` (their copies waited for) into the scratch, in the model's dtype."""
        dequantize_experts(self.slots[layer], slots, self.placement.block, self._scratch["gate_up_proj"],
                           self._scratch["down_proj"])

    def _execute(self, layer: int, hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self._dequantize(layer, torch.unique(slots).tolist())  # the slots this call reads
        return super()._execute(layer, hidden, slots, weights)

    def slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """What transformers' experts function reads (:meth:`experts_module`): the scratch ``gate_up_proj``
        ``[C, 2I, H]`` and ``down_proj`` ``[C, H, I]`` in the model's dtype, holding the slots of the latest
        transformers-path call dequantized. A decoder reads :meth:`fp8_slot_weights` instead."""
        return self._scratch

    def fp8_slot_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s FP8 slots as the copies fill them (what a fused dequantizing kernel reads): float8_e4m3fn
        ``gate_up_proj`` ``[C, 2I, H]`` (gate rows, then up rows) and ``down_proj`` ``[C, H, I]``, with float32
        ``gate_up_proj_scale_inv`` ``[C, 2 ceil(I/128), ceil(H/128)]`` (gate's block rows, then up's) and
        ``down_proj_scale_inv`` ``[C, ceil(H/128), ceil(I/128)]``."""
        return self.slots[layer]

    def _remember_weights(self) -> None:
        self._seen = [(module._parameters, name, placeholder, placeholder.dtype, placeholder._version)
                      for layer in self.placement.placeholders for module, name, placeholder in layer]

    def sync_weights(self, resident: Callable[[int], np.ndarray]) -> bool:
        """The experts compute from the checkpoint's FP8 tensors: ``ValueError`` where an expert parameter was
        replaced, converted or written since offloading (its placeholder's identity, dtype or version), which
        this store cannot follow; nothing changed otherwise (returns False)."""
        for params, name, placeholder, dtype, version in self._seen:
            if params.get(name) is not placeholder or placeholder.dtype != dtype or placeholder._version != version:
                raise ValueError(
                    f"psr_hf offload: an expert weight ({name}) was replaced, converted or written after offloading; "
                    f"the FP8 store computes from the checkpoint {self.checkpoint.folder} and cannot follow it. "
                    "psr_hf.unpatch(model), change the model, and patch it again (OffloadConfig(expert_format="
                    "'model') offloads the changed weights)")
        return False

    def close(self) -> None:
        super().close()
        self._scratch = {}
