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
               warps: int = 8, signal: LateCounter | None = None) -> None:
        """Copy the pairs of ``copies[layer]`` (int32 ``[L, CW]``) counted at ``count_column`` (pairs follow it)
        with ``programs`` programs of ``warps`` warps, each moving ``block`` words (a power of two) per step: the
        bytes a program has in flight over the link. Capturable: the count and the pairs are read on the device.
        ``signal``: the last program to finish marks the layer's copies done in this step (:class:`LateCounter`)."""
        if block < 1 or block & (block - 1):
            raise ValueError(f"block={block} must be a power of two (int32 words per program and step)")
        launch = kernel(interpreting())
        marks = (signal.done, signal.arrivals, signal.step) if signal is not None else (copies, copies, copies)
        for src_a, dst_a, src_b, dst_b in self.pairs:
            launch[(programs,)](
                copies, layer * copies.shape[1] + count_column, src_a, dst_a, src_b, dst_b, src_a.shape[1],
                src_b.shape[1], *marks, layer, programs * len(self.pairs), PROGRAMS=programs, BLOCK=block,
                SIGNAL=signal is not None, num_warps=warps)


class LateCounter:
    """Which prefetches a layer still waited for, counted on the device (a diagnostic of the token graph): the
    prefetch copies of a layer mark it done with the step's number (``LayerCopies.launch(..., signal=)``), and where
    the layer is about to wait for them :meth:`check` counts its prefetches as late unless that mark is there.
    ``step``: the device's count of the token graph's steps (``GraphStepInputs.steps``)."""

    def __init__(self, num_layers: int, step: torch.Tensor):
        device = step.device
        self.step = step
        self.done = torch.full((num_layers,), -1, dtype=torch.int64, device=device)  # the step each layer's landed
        self.arrivals = torch.zeros(num_layers, dtype=torch.int32, device=device)  # programs finished this launch
        self.late = torch.zeros(num_layers, 2, dtype=torch.int64, device=device)  # late prefetches, layers waited

    def restart(self) -> None:
        """No layer's copies are marked done (the step count starts again)."""
        self.done.fill_(-1)
        self.arrivals.zero_()

    def check(self, copies: torch.Tensor, layer: int, count_column: int) -> None:
        """Count ``layer``'s prefetches (their number at ``copies[layer, count_column]``) as late unless its copies
        have marked it done in this step (capturable; enqueue it where the layer waits for them)."""
        late = triton_module("copy_kernel.py", interpreting()).late_prefetch_kernel
        late[(1,)](self.done, self.step, copies, layer * copies.shape[1] + count_column, self.late, layer, num_warps=1)

    def counts(self) -> dict[str, Any]:
        """``{"late": prefetches, "layers_waited": layer visits, "per_layer": [[late, waited], ...]}`` since the
        counter was built (reads the device)."""
        per_layer = self.late.cpu().tolist()
        return {"late": sum(r[0] for r in per_layer), "layers_waited": sum(r[1] for r in per_layer),
                "per_layer": per_layer}
