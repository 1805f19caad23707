"""One MoE layer's slot computation as the decoders call it, whatever the expert store holds: the model's own
weights (:func:`~psr_hf.engine.moe.moe_slots`) or FP8 experts with their block scales
(:func:`~psr_hf.engine.moe_fp8.moe_slots_fp8`, which dequantizes inside the kernel). The store says which by its
``weight_format`` (:class:`~psr_hf.offload.store.ExpertStore`), once, when a decoder is built; the decoders then call
:class:`SlotMoe` without asking again, so CUDA graphs capture the one kernel the layer needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from .moe import SoftmaxRouting, check_shapes, choose_backend, moe_slots, softmax_weights
from .moe_fp8 import check_fp8_shapes, moe_slots_fp8

if TYPE_CHECKING:
    from ..offload.store import ExpertStore, Fp8ExpertStore


@dataclass(frozen=True)
class SlotMoe:
    """The slot buffers of one MoE layer (the store's fixed buffers, read in place) and how to compute on them:
    ``gate_up [C, 2I, H]`` and ``down [C, H, I]`` in the model's dtype, or float8_e4m3fn with ``gate_up_scale``
    and ``down_scale`` (float32 block scales) for FP8 experts."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.gate_up_scale is not None

    @property
    def capacity(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate_up.shape[1] // 2

    def addresses(self) -> tuple[int, ...]:
        """The buffers' device addresses (a captured graph reads these; a reallocation changes them)."""
        return tuple(t.data_ptr() for t in (self.gate_up, self.down, self.gate_up_scale, self.down_scale)
                     if t is not None)

    def check(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
              residual: torch.Tensor | None, hidden_act: Any) -> None:
        """``ValueError`` where the layer's buffers do not fit the call (once, when the decoder is built)."""
        if self.fp8:
            check_fp8_shapes(x, slots, weights, self.gate_up, self.gate_up_scale, self.down, self.down_scale, out,
                             residual, hidden_act=hidden_act)
        else:
            check_shapes(x, slots, weights, self.gate_up, self.down, out, residual, hidden_act=hidden_act)

    def weighs_in_kernel(self, device: torch.device, backend: str = "auto") -> bool:
        """Whether a call with ``softmax=`` computes the weights inside its first kernel (the Triton path of the
        model's own weights) rather than in torch before it."""
        return not self.fp8 and choose_backend(device, backend) == "triton"

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                 residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                 backend: str = "auto", softmax: SoftmaxRouting | None = None) -> torch.Tensor:
        """``out`` (``residual +``) the layer's routed experts on ``slots``, weighed by ``weights``; with
        ``softmax``, the weights are computed from a softmax router's logits first and written into ``weights``."""
        if self.fp8:
            if softmax is not None:
                softmax_weights(softmax, weights)
            return moe_slots_fp8(x, slots, weights, self.gate_up, self.gate_up_scale, self.down, self.down_scale,
                                 out, residual, workspace=workspace, backend=backend)
        return moe_slots(x, slots, weights, self.gate_up, self.down, out, residual, workspace=workspace,
                         backend=backend, softmax=softmax)


def filled_slots(store: ExpertStore, layer: int) -> dict[str, torch.Tensor]:
    """The slot buffers ``store``'s copies fill for MoE layer ``layer`` (what the engine computes on): the FP8
    weights and their scales of an FP8 store, else its slot weights."""
    if store.weight_format == "fp8":
        return cast("Fp8ExpertStore", store).fp8_slot_weights(layer)
    return store.slot_weights(layer)


def slot_moe(store: ExpertStore, layer: int, device: torch.device) -> SlotMoe:
    """MoE layer ``layer``'s slot computation over ``store``'s buffers (the model's own fused weights where the
    store is resident), checked to be on the engine's ``device``."""
    w = filled_slots(store, layer)
    if store.weight_format == "fp8":
        moe = SlotMoe(w["gate_up_proj"], w["down_proj"], w["gate_up_proj_scale_inv"], w["down_proj_scale_inv"])
    else:
        moe = SlotMoe(w["gate_up_proj"], w["down_proj"])
    if moe.gate_up.device != device:
        raise ValueError(f"MoE layer {layer}: the experts are on {moe.gate_up.device}, the model on {device}")
    return moe
