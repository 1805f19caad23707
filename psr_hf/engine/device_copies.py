"""Expert copies issued by the GPU: one Triton kernel that reads a layer's copy list (written by
:mod:`psr_hf.engine.device_decisions`) and copies each listed expert's weights from pinned host memory (read
through its unified address) into its slot, so that a copy needs no host call and can sit inside the token's CUDA
graph. The demand copies of a layer run on many programs before its experts; the prefetches of the next layer on
a few programs of a side branch, beside the compute (docs/engine.md, "Routing on the device").
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .device_decisions import interpreting, triton_module

#: int32 words each program moves per step (16 KiB)
BLOCK = 4096


def kernel(interpret: bool) -> Any:
    """The copy kernel of :mod:`psr_hf.engine.copy_kernel` for one mode."""
    return triton_module("copy_kernel.py", interpret).copy_experts_kernel


def words(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([E or C, ...], contiguous, a multiple of 4 bytes per row) as int32 words ``[rows, n]``."""
    if not t.is_contiguous():
        raise ValueError("expert copies need contiguous expert tensors")
    flat = t.reshape(t.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 4:
        raise ValueError("an expert's bytes must be a multiple of 4")
    return flat.view(torch.int32)


class LayerCopies:
    """The copy launches of one MoE layer: ``host`` (pinned ``[E, ...]`` tensors per weight) into ``slots``
    (device ``[C, ...]`` tensors, the same names in the same order). The kernel moves two tensors per launch, so a
    layer of more tensors (an FP8 expert's weights and their block scales) takes a launch per pair."""

    def __init__(self, host: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]):
        if not host or len(host) != len(slots):
            raise ValueError(f"expert copies need one slot tensor per host tensor (got {len(host)} host, "
                             f"{len(slots)} slot tensors)")
        src = [words(t) for t in host]
        dst = [words(t) for t in slots]
        for s, d in zip(src, dst):
            if s.shape[1] != d.shape[1]:
                raise ValueError("a host expert and its slot differ in size")
        if len(src) % 2:  # the last launch's second tensor moves nothing
            src.append(src[-1][:, :0])
            dst.append(dst[-1][:, :0])
        self.pairs = [(src[i], dst[i], src[i + 1], dst[i + 1]) for i in range(0, len(src), 2)]

    def launch(self, copies: torch.Tensor, layer: int, count_column: int, programs: int, *, block: int = BLOCK,
               warps: int = 8) -> None:
        """Copy the pairs of ``copies[layer]`` (int32 ``[L, CW]``) counted at ``count_column`` (pairs follow it)
        with ``programs`` programs of ``warps`` warps, each moving ``block`` words (a power of two) per step: the
        bytes a program has in flight over the link. Capturable: the count and the pairs are read on the device."""
        if block < 1 or block & (block - 1):
            raise ValueError(f"block={block} must be a power of two (int32 words per program and step)")
        launch = kernel(interpreting())
        for src_a, dst_a, src_b, dst_b in self.pairs:
            launch[(programs,)](
                copies, layer * copies.shape[1] + count_column, src_a, dst_a, src_b, dst_b, src_a.shape[1],
                src_b.shape[1], PROGRAMS=programs, BLOCK=block, num_warps=warps)
