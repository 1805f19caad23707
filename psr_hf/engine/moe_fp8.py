"""The batch-1 MoE over expert slots that hold FP8 weights with block scales (the fine-grained FP8 checkpoints).

The same computation as :mod:`psr_hf.engine.moe` on dequantized weights. Each expert matrix is float8_e4m3fn
with one float32 ``scale_inv`` per 128 x 128 block (``w ~ fp8.float() * scale[row // 128, col // 128]``), in the
engine's fused slot layout:

- ``gate_up [C, 2I, H]`` float8_e4m3fn, gate rows then up rows, and ``gate_up_scale [C, 2 * ceil(I/128),
  ceil(H/128)]`` float32: gate and up are quantized as separate ``[I, H]`` matrices in a checkpoint, so the fused
  scale holds gate's block rows then up's, and row ``r`` of ``gate_up`` has block row ``r // 128`` when ``r < I``
  and ``ceil(I/128) + (r - I) // 128`` otherwise (the same as ``r // 128`` when ``I`` is a multiple of 128);
- ``down [C, H, I]`` float8_e4m3fn and ``down_scale [C, ceil(H/128), ceil(I/128)]`` float32.

One signature ``(x, slots, weights, gate_up, gate_up_scale, down, down_scale, out, residual=None,
workspace=None)`` for :func:`moe_slots_fp8_reference` (pure torch, capturable: dequantizes the K selected
slots and runs :func:`~psr_hf.engine.moe.moe_slots_reference` on them), :func:`moe_slots_fp8_triton` (two Triton
kernels that read each selected weight byte once, half the bytes of bf16) and :func:`moe_slots_fp8` (Triton for
CUDA tensors when triton imports, the reference otherwise, by :func:`~psr_hf.engine.moe.choose_backend`).
:func:`check_fp8_shapes` runs once, when the engine is built; the per-step functions check nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .moe import (
    FLOAT_DTYPES,
    MoeShape,
    _cdiv,
    _pow2,
    _shape,
    check_shapes,
    choose_backend,
    moe_slots_reference,
    triton_prologue,
)

#: the weight dtype of the FP8 checkpoints (``e4m3``; the ``e5m2`` variant is not a checkpoint format)
FP8_DTYPE = torch.float8_e4m3fn
#: rows and columns of one scale block (``weight_block_size: [128, 128]`` in the checkpoints' config)
SCALE_BLOCK = 128


# ---------------------------------------------------------------------------------------------- checks (once)
def scale_shapes(hidden: int, intermediate: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The per-slot shapes of ``(gate_up_scale, down_scale)`` for hidden ``H`` and intermediate ``I``:
    ``(2 * ceil(I/128), ceil(H/128))`` (gate's block rows, then up's) and ``(ceil(H/128), ceil(I/128))``."""
    h_blocks, i_blocks = _cdiv(hidden, SCALE_BLOCK), _cdiv(intermediate, SCALE_BLOCK)
    return (2 * i_blocks, h_blocks), (h_blocks, i_blocks)


def _check_fp8_weight(what: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != 3:
        raise ValueError(f"psr_hf engine FP8 MoE: {what} must be a 3D tensor [C, ...]; got {_shape(t)}")
    if t.dtype != FP8_DTYPE:
        raise ValueError(f"psr_hf engine FP8 MoE: {what} has dtype {t.dtype}; expected {FP8_DTYPE} (the block-wise "
                         "FP8 checkpoints' weights; bf16/float32 slots go through psr_hf.engine.moe)")


def _check_scale(what: str, scale: Any, want: tuple[int, ...], device: torch.device, layout: str) -> None:
    got = f"{_shape(scale)} {scale.dtype}" if isinstance(scale, torch.Tensor) else _shape(scale)
    if (not isinstance(scale, torch.Tensor) or tuple(scale.shape) != want or scale.dtype != torch.float32):
        raise ValueError(f"psr_hf engine FP8 MoE: {what} must be a float32 {layout} = {want} tensor (one scale_inv "
                         f"per {SCALE_BLOCK}x{SCALE_BLOCK} block); got {got}")
    if scale.device != device:
        raise ValueError(f"psr_hf engine FP8 MoE: {what} is on {scale.device} but the weights on {device}")


def check_fp8_shapes(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                     gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, out: torch.Tensor,
                     residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                     hidden_act: Any = "silu") -> MoeShape:
    """Check the buffers of one layer's FP8 MoE call (host side, once, when the engine is built). Everything
    but the weights' dtype and the scales is :func:`~psr_hf.engine.moe.check_shapes`'s rule. ``ValueError``
    naming the argument, what it is and what was expected."""
    _check_fp8_weight("gate_up", gate_up)
    _check_fp8_weight("down", down)
    # check_shapes reads only the weights' shapes, dtypes and devices: storage-free stand-ins of x's dtype carry them
    like = x.dtype if isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES else torch.float32
    stand_in = lambda t: torch.empty((), dtype=like, device=t.device).expand(t.shape)  # noqa: E731
    shape = check_shapes(x, slots, weights, stand_in(gate_up), stand_in(down), out, residual, workspace, hidden_act)
    gate_up_blocks, down_blocks = scale_shapes(shape.hidden, shape.intermediate)
    C = shape.capacity
    _check_scale("gate_up_scale", gate_up_scale, (C, *gate_up_blocks), gate_up.device,
                 "[C, 2 * ceil(I/128), ceil(H/128)] (gate's block rows, then up's)")
    _check_scale("down_scale", down_scale, (C, *down_blocks), gate_up.device, "[C, ceil(H/128), ceil(I/128)]")
    return shape


# ---------------------------------------------------------------------------------------------- reference
def _expand_blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[K, ceil(rows/128), ceil(cols/128)]`` block scales as ``[K, rows, cols]`` float32, one per element
    (views and one copy: no host sync)."""
    K, rb, cb = scale.shape
    full = scale[:, :, None, :, None].expand(K, rb, SCALE_BLOCK, cb, SCALE_BLOCK)
    return full.reshape(K, rb * SCALE_BLOCK, cb * SCALE_BLOCK)[:, :rows, :cols]


def dequantize_slots(slots: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                     down_scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The K slots' weights dequantized, ``(gate_up [K, 2I, H], down [K, H, I])`` in ``dtype``: ``fp8.float() *
    scale`` in float32, then rounded to ``dtype`` once. Capturable (fixed shapes, no host sync)."""
    _, two_i, H = gate_up.shape
    I = two_i // 2
    i_blocks = _cdiv(I, SCALE_BLOCK)
    gu_scale = gate_up_scale.index_select(0, slots)  # [K, 2 * ceil(I/128), ceil(H/128)]
    gu_scale = torch.cat((_expand_blocks(gu_scale[:, :i_blocks], I, H),  # gate's block rows
                          _expand_blocks(gu_scale[:, i_blocks:], I, H)), 1)  # up's
    gu = (gate_up.index_select(0, slots).float() * gu_scale).to(dtype)
    dn = (down.index_select(0, slots).float() * _expand_blocks(down_scale.index_select(0, slots), H, I)).to(dtype)
    return gu, dn


def moe_slots_fp8_reference(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                            gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                            out: torch.Tensor, residual: torch.Tensor | None = None,
                            workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: the K selected slots dequantized to ``x``'s dtype (:func:`dequantize_slots`), then exactly
    :func:`~psr_hf.engine.moe.moe_slots_reference` on them, so the result is bitwise that of the bf16/float32
    reference on the dequantized weights. No host syncs, fixed shapes (CUDA-graph capturable). Writes ``out``
    (``residual + moe`` when ``residual`` is given) and returns it; ``workspace`` is accepted and not used."""
    gu, dn = dequantize_slots(slots, gate_up, gate_up_scale, down, down_scale, x.dtype)
    picked = torch.arange(slots.shape[0], device=slots.device)  # the K dequantized slots, in the selection's order
    return moe_slots_reference(x, picked, weights, gu, dn, out, residual, workspace)


# ---------------------------------------------------------------------------------------------- triton
@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two jitted kernels, built once per interpreter mode (``triton.jit`` decides at decoration time whether
    a kernel runs in the interpreter). They follow :mod:`psr_hf.engine.moe`'s kernels' rules: triton's builtins
    only, nothing from their scope but ``tl``. Each weight tile lies inside one scale block (kernel 1's rows and
    columns and kernel 2's rows divide ``SB``), so kernel 1 loads one scale per matrix and column step and kernel
    2 one scale per column (a gather of ``ceil(I/128)`` values, shared by the program's rows)."""
    del interpret  # the cache key: the mode triton reads from the environment when the kernels are decorated
    return _gate_up_kernel(), _down_kernel()


def _gate_up_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_kernel(x_ptr, slots_ptr, weights_ptr, gu_ptr, gs_ptr, h_ptr, H, I, I_BLOCKS, stride_x, stride_s,
                       stride_w, stride_ge, stride_gr, stride_gc, stride_se, stride_sr, stride_sc,
                       SB: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
        # program (k, block of I): h[k, rows] = weights[k] * silu(gate_rows . x) * (up_rows . x), float32
        k = tl.program_id(0)
        row0 = tl.program_id(1) * BLOCK_I
        rows = row0 + tl.arange(0, BLOCK_I)
        row_ok = rows < I
        slot = tl.load(slots_ptr + k * stride_s).to(tl.int64)
        gate_rows = gu_ptr + slot * stride_ge + rows.to(tl.int64)[:, None] * stride_gr
        up_rows = gate_rows + I * stride_gr
        gate_scales = gs_ptr + slot * stride_se + (row0 // SB) * stride_sr
        up_scales = gate_scales + I_BLOCKS * stride_sr  # up's block rows follow gate's
        acc_g = tl.full((BLOCK_I, BLOCK_H), 0.0, tl.float32)
        acc_u = tl.full((BLOCK_I, BLOCK_H), 0.0, tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            xv = tl.load(x_ptr + cols * stride_x, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            sg = tl.load(gate_scales + (start // SB) * stride_sc)
            su = tl.load(up_scales + (start // SB) * stride_sc)
            g = tl.load(gate_rows + cols[None, :] * stride_gc, mask=ok, other=0.0).to(tl.float32) * sg
            u = tl.load(up_rows + cols[None, :] * stride_gc, mask=ok, other=0.0).to(tl.float32) * su
            acc_g += g * xv
            acc_u += u * xv
        gate = tl.reduce(acc_g, 1, tl.standard._sum_combine)
        up = tl.reduce(acc_u, 1, tl.standard._sum_combine)
        w = tl.load(weights_ptr + k * stride_w).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up * w  # silu(gate) * up * weight
        tl.store(h_ptr + k * I + rows, h, mask=row_ok)

    return gate_up_kernel


def _down_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def down_kernel(h_ptr, slots_ptr, dn_ptr, ds_ptr, out_ptr, res_ptr, H, I, K, stride_s, stride_de, stride_dr,
                    stride_dc, stride_se, stride_sr, stride_sc, stride_o, stride_r, HAS_RESIDUAL: tl.constexpr,
                    SB: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
        # program (block of H): out[rows] = (residual[rows] +) sum_k (down[s_k, rows, :] * scale) . h[k, :], float32
        row0 = tl.program_id(0) * BLOCK_O
        rows = row0 + tl.arange(0, BLOCK_O)
        row_ok = rows < H
        acc = tl.full((BLOCK_O, BLOCK_I), 0.0, tl.float32)
        for k in range(0, K):
            slot = tl.load(slots_ptr + k * stride_s).to(tl.int64)
            base = dn_ptr + slot * stride_de + rows.to(tl.int64)[:, None] * stride_dr
            scales = ds_ptr + slot * stride_se + (row0 // SB) * stride_sr
            for start in range(0, I, BLOCK_I):
                cols = start + tl.arange(0, BLOCK_I)
                col_ok = cols < I
                hv = tl.load(h_ptr + k * I + cols, mask=col_ok, other=0.0)
                s = tl.load(scales + (cols // SB) * stride_sc, mask=col_ok, other=0.0)
                d = tl.load(base + cols[None, :] * stride_dc, mask=row_ok[:, None] & col_ok[None, :],
                            other=0.0).to(tl.float32) * s[None, :]
                acc += d * hv[None, :]
        y = tl.reduce(acc, 1, tl.standard._sum_combine)
        if HAS_RESIDUAL:
            y += tl.load(res_ptr + rows * stride_r, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows * stride_o, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    return down_kernel


#: the tile sizes that must divide a scale block, so that each tile lies inside one
BLOCKS_INSIDE_A_SCALE = ("BLOCK_I1", "BLOCK_H1", "BLOCK_O2")


@functools.lru_cache(maxsize=None)
def fp8_triton_blocks(hidden: int, intermediate: int) -> dict[str, int]:
    """Block sizes, fixed (not yet measured on a GPU), for H=2048 with I=1024 (OLMoE-1B-7B) or I=512 (Qwen3.6),
    K=8. The bf16 kernels' grids (:func:`~psr_hf.engine.moe.triton_blocks`) with kernel 1's column step cut to
    one scale block:

    - kernel 1: ``BLOCK_I1`` = 16 rows of gate and of up per program times ``BLOCK_H1`` = 128 columns per step
      (grid K x I/16: 512 programs for OLMoE, 256 for Qwen3.6; 2 KiB of FP8 per matrix per step, 16 bytes per
      thread of 4 warps: one 128-bit load);
    - kernel 2: ``BLOCK_O2`` = 4 output rows per program times ``BLOCK_I2`` = 1024 columns per step (grid H/4 =
      512 programs; 4 KiB of FP8 per step).

    Smaller dimensions (tiny test models) get the next power of two above them."""
    H, I = int(hidden), int(intermediate)
    return dict(BLOCK_I1=min(16, _pow2(I)), BLOCK_H1=min(SCALE_BLOCK, _pow2(H)), BLOCK_O2=min(4, _pow2(H)),
                BLOCK_I2=min(1024, _pow2(I)), num_warps=4)


def check_blocks(blocks: dict[str, int]) -> dict[str, int]:
    """``blocks`` (keys of :func:`fp8_triton_blocks`) when every size is a power of two and the tiles that must
    lie inside one scale block divide 128; ``ValueError`` otherwise."""
    want = set(fp8_triton_blocks(SCALE_BLOCK, SCALE_BLOCK))
    if set(blocks) != want:
        raise ValueError(f"psr_hf engine FP8 MoE: blocks {sorted(blocks)}; expected the keys {sorted(want)}")
    bad = [f"{key}={value}" for key, value in blocks.items()
           if not isinstance(value, int) or value < 1 or value & (value - 1)
           or (key in BLOCKS_INSIDE_A_SCALE and SCALE_BLOCK % value)]
    if bad:
        raise ValueError(f"psr_hf engine FP8 MoE: blocks {', '.join(bad)}; every size must be a power of two and "
                         f"{', '.join(BLOCKS_INSIDE_A_SCALE)} must divide {SCALE_BLOCK} (one scale per tile)")
    return blocks


def moe_slots_fp8_triton(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                         out: torch.Tensor, residual: torch.Tensor | None = None,
                         workspace: torch.Tensor | None = None, *, blocks: dict[str, int] | None = None
                         ) -> torch.Tensor:
    """Two Triton kernels, as :func:`~psr_hf.engine.moe.moe_slots_triton`'s, that load FP8 weights, convert them
    to float32 in registers and multiply them by their block's scale: every selected weight byte is read once.
    Float32 accumulation; capturable (the first call JIT-compiles: call it once before capture). CUDA tensors, or
    CPU tensors under ``TRITON_INTERPRET=1``. ``workspace``: the float32 ``[K, I]`` scratch
    (:func:`~psr_hf.engine.moe.new_workspace`; allocated per call when None); ``blocks``: tile sizes other than
    :func:`fp8_triton_blocks`' (:func:`check_blocks`; for benchmarks). Writes and returns ``out``."""
    interpret, H, I, K, h, res, guard = triton_prologue("psr_hf engine FP8 MoE", "moe_slots_fp8_reference", x,
                                                         slots, gate_up, out, residual, workspace)
    gate_up_kernel, down_kernel = _kernels(interpret)
    b = check_blocks(blocks) if blocks is not None else fp8_triton_blocks(H, I)
    with guard:
        gate_up_kernel[(K, _cdiv(I, b["BLOCK_I1"]))](
            x, slots, weights, gate_up, gate_up_scale, h, H, I, _cdiv(I, SCALE_BLOCK), x.stride(0), slots.stride(0),
            weights.stride(0), *gate_up.stride(), *gate_up_scale.stride(),
            SB=SCALE_BLOCK, BLOCK_I=b["BLOCK_I1"], BLOCK_H=b["BLOCK_H1"], num_warps=b["num_warps"],
            enable_fp_fusion=True)
        down_kernel[(_cdiv(H, b["BLOCK_O2"]),)](
            h, slots, down, down_scale, out, res, H, I, K, slots.stride(0), *down.stride(), *down_scale.stride(),
            out.stride(0), res.stride(0), HAS_RESIDUAL=residual is not None, SB=SCALE_BLOCK,
            BLOCK_O=b["BLOCK_O2"], BLOCK_I=b["BLOCK_I2"], num_warps=b["num_warps"], enable_fp_fusion=True)
    return out


# ---------------------------------------------------------------------------------------------- dispatcher
_FUNCTIONS = {"torch": moe_slots_fp8_reference, "triton": moe_slots_fp8_triton}


def moe_slots_fp8(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, out: torch.Tensor,
                  residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """The batch-1 FP8 slot MoE by :func:`~psr_hf.engine.moe.choose_backend`; writes and returns ``out``."""
    return _FUNCTIONS[choose_backend(x.device, backend)](x, slots, weights, gate_up, gate_up_scale, down,
                                                         down_scale, out, residual, workspace)
