"""The engine's dense projections in block-wise FP8, read from the fine-grained FP8 checkpoint whose experts the
offload store holds, so that a decode step reads half the bytes of the dequantized weights for them too.

Why from the checkpoint's files: transformers dequantizes an FP8 checkpoint when it loads it on a CPU, and on a GPU
its FP8 layers fetch their kernel from the hub at run time, so the model an offline user patches holds bf16 dense
weights; the FP8 bytes exist only on disk (as for the experts, :mod:`psr_hf.offload.fp8_checkpoint`). The engine
reads each projection's e4m3 weight and float32 block scales into tensors of its own on the model's device and
computes them with the fused GEMV's FP8 form (:func:`~psr_hf.engine.gemv_kernel.linear_many` with ``scales``):
each weight element times its block's scale in float32, then times x, one rounding at the end. The model's own
weights stay where they are, for the transformers path and the engine's batched prefill.

The rule, a family's ``dense_fp8`` option (:func:`choose_checkpoint`): None (default), FP8 where the offload store
holds the checkpoint's FP8 experts and the attention kernels run; True, the same or ``ValueError`` saying why not;
False, the model's own weights.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..assets.fp8_blocks import dequantize_blocks
from .gemv_kernel import SCALE_BLOCK

if TYPE_CHECKING:
    from ..offload.fp8_checkpoint import Fp8Checkpoint

logger = logging.getLogger(__name__)


def check_option(option: object) -> None:
    """``ValueError`` unless ``dense_fp8`` is None, True or False."""
    if option not in (None, True, False):
        raise ValueError(f"dense_fp8 must be None (FP8 where the offload holds an FP8 checkpoint's experts and the "
                         f"attention kernels run), True or False, got {option!r}")


def _store_checkpoint(model: nn.Module) -> tuple[Fp8Checkpoint | None, str | None]:
    """The FP8 checkpoint whose experts ``model``'s offload store holds, else None and why not."""
    from ..hf.patching import CONTROLLER_ATTRIBUTE

    store = getattr(getattr(model, CONTROLLER_ATTRIBUTE, None), "expert_store", None)  # None: not patched
    checkpoint = getattr(store, "checkpoint", None) if getattr(store, "weight_format", None) == "fp8" else None
    if checkpoint is None:
        return None, ("the model's experts are not offloaded from a fine-grained FP8 checkpoint (patch it with "
                      "offload=OffloadConfig(...) after loading it from one, e.g. written by psr-hf quantize)")
    if tuple(checkpoint.block) != (SCALE_BLOCK, SCALE_BLOCK):
        return None, (f"the checkpoint's weight_block_size is {list(checkpoint.block)}; the FP8 GEMV reads "
                      f"{SCALE_BLOCK}x{SCALE_BLOCK} blocks")
    return checkpoint, None


def choose_checkpoint(option: bool | None, model: nn.Module, kernels: bool) -> Fp8Checkpoint | None:
    """The checkpoint the dense projections are read from, or None for the model's own weights (the rule of the
    module's docstring; ``kernels``: whether the family's attention kernels run)."""
    check_option(option)
    if option is False:
        return None
    checkpoint, why = _store_checkpoint(model)
    if why is None and not kernels:
        why = "the attention kernels do not run (the FP8 projections are a Triton kernel: attention_kernels)"
    if why is not None:
        if option is True:
            raise ValueError(f"dense_fp8=True: {why}; pass dense_fp8=None (FP8 where it can) or False (the model's "
                             "own weights)")
        if checkpoint is not None:
            logger.info("psr_hf engine: dense projections in the model's own weights: %s", why)
        return None
    return checkpoint


def read_projections(checkpoint: Fp8Checkpoint, model: nn.Module, linears: dict[str, nn.Module]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (e4m3 weight, float32 scales)}`` on each linear's device for ``linears`` (``{name: nn.Linear}`` of
    ``model``), read from ``checkpoint``. ``ValueError`` naming the layer where the checkpoint has no FP8 weight
    for it, or where the model's weight is not the checkpoint's dequantized (within one rounding of its dtype:
    a model edited since it was loaded, or loaded from another checkpoint)."""
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    out = {}
    for name, linear in linears.items():
        module_name = names.get(id(linear))
        key = None if module_name is None else checkpoint.linear_key(module_name)
        if key is None:
            raise ValueError(f"the FP8 checkpoint {checkpoint.folder} has no FP8 weight with scales for "
                             f"{module_name or name}; pass dense_fp8=False (the model's own weights)")
        weight = linear.weight
        fp8, scale = checkpoint.read_linear(key, tuple(weight.shape))
        fp8, scale = fp8.to(weight.device), scale.to(weight.device)
        dequantized = dequantize_blocks(fp8, scale, checkpoint.block, weight.dtype)
        if not torch.allclose(dequantized.float(), weight.detach().float(), rtol=2 ** -7, atol=1e-6):
            raise ValueError(f"{module_name}'s weight differs from the FP8 checkpoint {checkpoint.folder}'s "
                             f"{key}, dequantized: the model is not that checkpoint as loaded; pass "
                             "dense_fp8=False (the model's own weights)")
        out[name] = (fp8, scale)
    return out
