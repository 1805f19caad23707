"""Block-wise e4m3 weights, the fine-grained FP8 format of DeepSeek-V3's and Qwen3.6's releases: a weight
``[..., out, in]`` is float8_e4m3fn with one float32 ``scale_inv`` per ``block`` (128x128) tile, the tile's
dequantization multiplier (``w ~ fp8.float() * scale_inv`` over the tile; edge tiles may be partial).

The one copy of this arithmetic: ``psr-hf quantize`` writes checkpoints with it and reads them back
(:mod:`.quantize`), and the offload's FP8 store dequantizes its slots with it (``psr_hf.offload.fp8_experts``).
Quantization is the releases' arithmetic (``scale_inv = amax / 448``, ``w / scale_inv`` rounded to e4m3).
Dequantization is the float32 product, then one cast, as transformers' loader computes it, so a weight dequantized
here equals, bit for bit, the one transformers loads from the same tensors where the tiles are whole; partial edge
tiles are dequantized by their position (tile ``i`` covers rows ``bm * i`` to ``bm * i + bm - 1``), as the
releases' own kernels do.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = (128, 128)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block={block!r} must be two positive ints (rows, columns), e.g. (128, 128)")
    return int(block[0]), int(block[1])


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The ``scale_inv`` shape of a weight of ``shape`` ``[..., out, in]``: ``[..., ceil(out/bm), ceil(in/bn)]``."""
    bm, bn = _check_block(block)
    if len(shape) < 2:
        raise ValueError(f"a block-quantized weight has at least 2 dimensions [..., out, in]; got shape {tuple(shape)}")
    return (*shape[:-2], -(-shape[-2] // bm), -(-shape[-1] // bn))


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` ``[..., out, in]`` zero-padded to whole tiles, as ``[..., ob, bm, ib, bn]``."""
    bm, bn = block
    rows, cols = w.shape[-2:]
    ob, ib = -(-rows // bm), -(-cols // bn)
    padded = torch.nn.functional.pad(w, (0, ib * bn - cols, 0, ob * bm - rows))
    return padded.reshape(*w.shape[:-2], ob, bm, ib, bn)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale_inv)`` of ``w`` ``[..., out, in]`` (any float dtype): float8_e4m3fn of ``w``'s shape, and
    float32 ``[..., ceil(out/bm), ceil(in/bn)]``, ``amax / 448`` per tile (1 for an all-zero tile). A tile of
    e4m3 values times one power of two comes back exactly."""
    block = _check_block(block)
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_blocks needs a float weight to quantize; got {w.dtype}")
    scale_shape(w.shape, block)
    rows, cols = w.shape[-2:]
    tiles = _tiles(w.to(torch.float32), block)  # [..., ob, bm, ib, bn]
    scale_inv = tiles.abs().amax(dim=(-3, -1)) / FP8_MAX  # [..., ob, ib]
    scale_inv = torch.where(scale_inv > 0, scale_inv, 1.0)
    scaled = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    fp8 = scaled.to(FP8_DTYPE).reshape(*tiles.shape[:-4], tiles.shape[-4] * block[0], tiles.shape[-2] * block[1])
    return fp8[..., :rows, :cols].contiguous(), scale_inv


def dequantize_blocks(fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8`` ``[..., out, in]`` times its tiles' ``scale_inv`` ``[..., ceil(out/bm), ceil(in/bn)]``, computed in
    float32 and cast once to ``dtype``. ``out``: a tensor of ``fp8``'s shape and ``dtype`` to write into (a
    view of a larger buffer, say); returned."""
    block = _check_block(block)
    if fp8.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_blocks reads float8_e4m3fn weights; got {fp8.dtype}")
    expected = scale_shape(fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"a weight of shape {tuple(fp8.shape)} in {block[0]}x{block[1]} tiles needs scales of shape "
                         f"{expected}, not {tuple(scale_inv.shape)}: the checkpoint's weight_block_size is not the "
                         "block size its scales were written with")
    rows, cols = fp8.shape[-2:]
    tiles = _tiles(fp8.to(torch.float32), block)  # [..., ob, bm, ib, bn]
    product = tiles * scale_inv.to(torch.float32)[..., :, None, :, None]
    full = product.reshape(*tiles.shape[:-4], tiles.shape[-4] * block[0], tiles.shape[-2] * block[1])
    result = full[..., :rows, :cols]
    if out is None:
        return result.to(dtype)
    if tuple(out.shape) != tuple(fp8.shape) or out.dtype != dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; expected {tuple(fp8.shape)} {dtype}")
    return out.copy_(result)
