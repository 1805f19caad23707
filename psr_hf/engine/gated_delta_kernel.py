"""A Gated DeltaNet layer's one-token step after its input projections (Qwen3.5/3.6-MoE, Qwen3-Next) as one Triton
kernel: the ~30 small torch ops of the step are ~30 launches per layer inside the decode graph, which cost more
than the memory the step reads.

:func:`gated_delta_step` launches the kernel (the engine's hybrid families run it on CUDA: their
``gated_delta_kernel`` option, :mod:`psr_hf.engine.families.qwen3_5_moe`), :func:`gated_delta_step_reference` is the
same step in torch (their PyTorch path, op for op). Both take the projections' outputs (the convolution's input
``mixed`` ``[conv_dim]``: q of every key head, then k, then v of every value head; the output gate ``z [Hv, Dv]``;
``b`` and ``g_in`` ``[Hv]``), update the convolution window ``conv [conv_dim, kernel]`` (newest input last) and the
float32 recurrent state ``[Hv, Dk, Dv]`` in place, and return the gated RMSNorm of the output ``[1, Hv * Dv]`` in
``mixed``'s dtype, ready for the output projection.

The kernel runs one program per key head: the short convolution (and window update) of its q and k channels and
of the v channels of the ``Hv / Hk`` value heads that share it, so that no two programs touch the same window; then,
per value head, the delta rule on its ``[Dk, Dv]`` state slice held in registers, the output and the gated RMSNorm.
It rounds where the torch step casts (to the convolution weight's dtype, to the window's, to ``mixed``'s, to the
promoted dtype of the norm's product), to nearest even as torch does; Triton's interpreter truncates a float32 to
bfloat16 cast, so ``triton_helpers.rounded`` rounds bfloat16 on the bits. Like
:mod:`psr_hf.engine.decide_kernel` it uses only triton's builtins and ``tl.reduce`` with the standard library's
combine function, and is loaded once per mode (:func:`~psr_hf.engine.device_decisions.triton_module`).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .device_decisions import interpreting, shared_helpers, triton_module

try:  # optional (the dev extra, the GPU machine): the reference needs only torch
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

#: the largest ``[Dk, Dv]`` state slice (padded to powers of two) one program holds in registers
MAX_STATE_TILE = 128 * 128
#: warps per program unless told (:func:`gated_delta_step`): 4 was faster than 8 at 128 x 128 on an H100
DEFAULT_WARPS = 4


class Shape(NamedTuple):
    """A Gated DeltaNet layer's heads and sizes (Qwen3.6-35B-A3B: 16 key heads, 32 value heads, 128, 128, 4)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int


def step_shape(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, g_in: torch.Tensor, conv: torch.Tensor,
               recurrent: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor) -> Shape:
    """The step's head counts and sizes read from its tensors, or ``ValueError`` saying which tensor disagrees."""
    if mixed.dim() != 1:
        raise ValueError(f"mixed {tuple(mixed.shape)}: one token's convolution input [conv_dim] is expected (the "
                         f"step decodes batch 1)")
    if z.dim() != 2 or recurrent.dim() != 3 or conv.dim() != 2:
        raise ValueError(f"z {tuple(z.shape)}, recurrent {tuple(recurrent.shape)}, conv {tuple(conv.shape)}: expected "
                         f"[Hv, Dv], [Hv, Dk, Dv] and [conv_dim, kernel]")
    v_heads, v_dim = z.shape
    k_dim = recurrent.shape[1]
    if recurrent.shape[0] != v_heads or recurrent.shape[2] != v_dim:
        raise ValueError(f"recurrent {tuple(recurrent.shape)} does not match z {tuple(z.shape)} ([Hv, Dk, Dv])")
    conv_dim, kernel = conv.shape
    key_channels = conv_dim - v_heads * v_dim
    if mixed.shape[0] != conv_dim or key_channels <= 0 or key_channels % (2 * k_dim):
        raise ValueError(f"mixed [{mixed.shape[0]}] and conv [{conv_dim}, {kernel}]: expected conv_dim = "
                         f"2 * k_heads * {k_dim} + {v_heads} * {v_dim} channels in both")
    k_heads = key_channels // (2 * k_dim)
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads are not a multiple of {k_heads} key heads")
    if tuple(conv_weight.shape) != (conv_dim, kernel):
        raise ValueError(f"conv_weight {tuple(conv_weight.shape)}: expected ({conv_dim}, {kernel})")
    if conv_bias is not None and tuple(conv_bias.shape) != (conv_dim,):
        raise ValueError(f"conv_bias {tuple(conv_bias.shape)}: expected ({conv_dim},)")
    for name, t in (("b", b), ("g_in", g_in), ("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (v_heads,):
            raise ValueError(f"{name} {tuple(t.shape)}: expected one value per value head ({v_heads},)")
    if tuple(norm_weight.shape) != (v_dim,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)}: expected ({v_dim},)")
    if recurrent.dtype != torch.float32:
        raise ValueError(f"the recurrent state is kept in float32, got {recurrent.dtype}")
    if z.dtype != mixed.dtype:
        raise ValueError(f"z ({z.dtype}) and mixed ({mixed.dtype}) come from the same input: one dtype expected")
    return Shape(k_heads, v_heads, k_dim, v_dim, kernel)


def gated_delta_step_reference(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, g_in: torch.Tensor,
                               conv: torch.Tensor, recurrent: torch.Tensor, conv_weight: torch.Tensor,
                               conv_bias: torch.Tensor | None, A_log: torch.Tensor, dt_bias: torch.Tensor,
                               norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The step in torch, op for op as the engine's PyTorch path runs it (the kernel's reference)."""
    s = step_shape(mixed, z, b, g_in, conv, recurrent, conv_weight, conv_bias, A_log, dt_bias, norm_weight)
    dtype = mixed.dtype
    conv.copy_(torch.cat((conv[:, 1:], mixed[:, None].to(conv.dtype)), dim=1))
    mixed = (conv.to(torch.float32) * conv_weight.to(torch.float32)).sum(dim=-1)
    if conv_bias is not None:
        mixed = mixed + conv_bias.to(torch.float32)
    mixed = F.silu(mixed.to(conv_weight.dtype)).to(dtype)
    key_dim = s.k_heads * s.k_dim
    q, k, v = torch.split(mixed, (key_dim, key_dim, s.v_heads * s.v_dim))
    repeat = s.v_heads // s.k_heads
    q = q.view(s.k_heads, s.k_dim).repeat_interleave(repeat, dim=0).to(torch.float32)
    k = k.view(s.k_heads, s.k_dim).repeat_interleave(repeat, dim=0).to(torch.float32)
    v = v.view(s.v_heads, s.v_dim).to(torch.float32)
    beta = torch.sigmoid(b).to(torch.float32)
    g = -A_log.to(torch.float32).exp() * F.softplus(g_in.to(torch.float32) + dt_bias)
    q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6) / (s.k_dim ** 0.5)
    k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    state = recurrent * g.exp()[:, None, None]  # [Hv, Dk, Dv]
    memory = (state * k[:, :, None]).sum(dim=-2)  # [Hv, Dv]
    delta = (v - memory) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    recurrent.copy_(state)
    out = (state * q[:, :, None]).sum(dim=-2).to(dtype)  # [Hv, Dv]
    h = out.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps)
    h = (norm_weight * h.to(dtype)) * F.silu(z.to(torch.float32))
    return h.to(dtype).reshape(1, s.v_heads * s.v_dim)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def unsupported(device: torch.device, k_dim: int, v_dim: int, dtype: torch.dtype,
                norm_dtype: torch.dtype) -> str | None:
    """Why :func:`gated_delta_step` cannot run, on ``device`` now, a layer whose heads' state is ``[k_dim, v_dim]``,
    whose projections' outputs are ``dtype`` and whose gated norm's weight is ``norm_dtype`` (None: it can): triton
    does not import, the device is not CUDA (CPU tensors run in triton's interpreter only, ``TRITON_INTERPRET=1``),
    the state tile does not fit one program's registers, or the norm's product has neither dtype."""
    if triton is None:
        return "gated_delta_step needs triton, which does not import (the dev extra, or the GPU machine's)"
    if device.type != ("cpu" if interpreting() else "cuda"):
        return (f"tensors on {device}: the kernel takes CUDA tensors, or CPU tensors in triton's interpreter "
                f"(TRITON_INTERPRET=1)")
    block_dk, block_dv = _pow2(k_dim), _pow2(v_dim)
    if block_dk * block_dv > MAX_STATE_TILE:
        return (f"a head's state [{k_dim}, {v_dim}] (padded to [{block_dk}, {block_dv}]) is larger than the "
                f"{MAX_STATE_TILE} elements one program holds in registers")
    if torch.promote_types(norm_dtype, dtype) not in (norm_dtype, dtype):
        return f"norm_weight {norm_dtype} times a {dtype} output: a product dtype of neither"
    return None


def gated_delta_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, g_in: torch.Tensor, conv: torch.Tensor,
                     recurrent: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, *,
                     num_warps: int | None = None) -> torch.Tensor:
    """The step as one kernel launch (see the module docstring for the arguments); capturable in a CUDA graph
    (the first call compiles: make it before capture). CUDA tensors, or CPU tensors in Triton's interpreter
    (``TRITON_INTERPRET=1``); :func:`unsupported` says beforehand whether a layer can run here. Returns a new
    ``[1, Hv * Dv]`` tensor. ``num_warps``: per program, default 4 for every state tile it takes (up to
    :data:`MAX_STATE_TILE`): at Qwen3.6's 128 x 128 heads 4 warps took 12.9 us per layer on an H100 against 15.9
    with 8 (``benchmarks/qwen36/h100/gated_delta.txt``)."""
    s = step_shape(mixed, z, b, g_in, conv, recurrent, conv_weight, conv_bias, A_log, dt_bias, norm_weight)
    tensors = [mixed, z, b, g_in, conv, recurrent, conv_weight, A_log, dt_bias, norm_weight]
    tensors += [conv_bias] if conv_bias is not None else []
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"the step's tensors are on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    why = unsupported(device, s.k_dim, s.v_dim, mixed.dtype, norm_weight.dtype)
    if why is not None:
        raise ValueError(f"{why}; gated_delta_step_reference is the same step in torch")
    if not (conv.is_contiguous() and recurrent.is_contiguous()):
        raise ValueError("conv and recurrent are updated in place and must be contiguous")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    interpret = interpreting()
    block_dk, block_dv = _pow2(s.k_dim), _pow2(s.v_dim)
    dtype = mixed.dtype
    norm_dtype = torch.promote_types(norm_weight.dtype, dtype)
    act = torch.empty(mixed.shape[0], dtype=dtype, device=device)  # the convolution's activated output
    out = torch.empty(1, s.v_heads * s.v_dim, dtype=dtype, device=device)
    if num_warps is None:
        num_warps = DEFAULT_WARPS
    bias = conv_bias if conv_bias is not None else conv_weight
    kernel = triton_module("gated_delta_kernel.py", interpret).gated_delta_kernel
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:  # triton launches on the current device
        kernel[(s.k_heads,)](
            mixed, z, b, g_in, conv, recurrent, conv_weight, bias, A_log, dt_bias, norm_weight, act, out,
            mixed.stride(0), z.stride(0), z.stride(1), b.stride(0), g_in.stride(0), conv_weight.stride(0),
            conv_weight.stride(1), bias.stride(0), float(norm_eps), float(s.k_dim ** 0.5),
            KEY_DIM=s.k_heads * s.k_dim, DK=s.k_dim, DV=s.v_dim, REPEAT=s.v_heads // s.k_heads, KERNEL=s.kernel,
            HAS_BIAS=conv_bias is not None, PRODUCT_IN_NORM_DTYPE=norm_dtype != dtype, BLOCK_DK=block_dk,
            BLOCK_DV=block_dv, BLOCK_C=max(block_dk, block_dv), BLOCK_K=_pow2(s.kernel), num_warps=num_warps)
    return out


def step_bytes(shape: Shape, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one step moves at least: the float32 state read and written, and everything (the state, the window read
    and written, the convolution weights, the inputs, the output and the per-head parameters) in ``dtype``."""
    item = torch.empty(0, dtype=dtype).element_size()
    conv_dim = 2 * shape.k_heads * shape.k_dim + shape.v_heads * shape.v_dim
    state = 2 * 4 * shape.v_heads * shape.k_dim * shape.v_dim
    small = item * (2 * conv_dim * shape.kernel + conv_dim * shape.kernel + conv_dim  # window, weights, mixed
                    + 2 * shape.v_heads * shape.v_dim + 4 * shape.v_heads + shape.v_dim)  # z, out, b/g/A/dt, norm
    return {"state": state, "total": state + small}


# ------------------------------------------------------------------------------------------ the Triton source
_helpers = shared_helpers(triton is not None)  # psr_hf/engine/triton_helpers.py, in this file's mode
_jit, _sum, _rounded = _helpers.jit, _helpers.reduce_sum, _helpers.rounded


@_jit
def _log1p(u):
    # log(1 + u) accurate for small u (Goldberg): the rounding error of 1 + u cancels
    one = 1.0 + u
    return tl.where(one == 1.0, u, tl.log(one) * u / (one - 1.0))


@_jit
def gated_delta_kernel(mixed_ptr, z_ptr, b_ptr, g_ptr, conv_ptr, state_ptr, conv_w_ptr, conv_b_ptr, a_log_ptr,
                       dt_bias_ptr, norm_w_ptr, act_ptr, out_ptr, stride_mixed, stride_zh, stride_zd, stride_b,
                       stride_g, stride_wc, stride_wk, stride_cb, norm_eps, q_scale, KEY_DIM: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, REPEAT: tl.constexpr, KERNEL: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PRODUCT_IN_NORM_DTYPE: tl.constexpr, BLOCK_DK: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    h = tl.program_id(0)  # the key head
    x_dtype = out_ptr.dtype.element_ty
    w_dtype = conv_w_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_K)
    # the short convolution, segment by segment: q and k of this key head, v of each value head sharing it
    for segment in tl.static_range(2 + REPEAT):
        if segment < 2:
            first = segment * KEY_DIM + h * DK
            ok = lanes < DK
        else:
            first = 2 * KEY_DIM + (h * REPEAT + segment - 2) * DV
            ok = lanes < DV
        channels = first + lanes
        rows = conv_ptr + channels[:, None] * KERNEL + taps[None, :]
        older = tl.load(rows + 1, mask=ok[:, None] & (taps[None, :] < KERNEL - 1), other=0.0).to(tl.float32)
        newest = _rounded(tl.load(mixed_ptr + channels * stride_mixed, mask=ok, other=0.0).to(tl.float32),
                          conv_ptr.dtype.element_ty)
        window = tl.where(taps[None, :] == KERNEL - 1, newest[:, None], older)
        tl.debug_barrier()  # every lane has read the old window before any lane overwrites it
        tl.store(rows, window, mask=ok[:, None] & (taps[None, :] < KERNEL))
        weight = tl.load(conv_w_ptr + channels[:, None] * stride_wc + taps[None, :] * stride_wk,
                         mask=ok[:, None] & (taps[None, :] < KERNEL), other=0.0).to(tl.float32)
        acc = _sum(window * weight, 1)
        if HAS_BIAS:
            acc += tl.load(conv_b_ptr + channels * stride_cb, mask=ok, other=0.0).to(tl.float32)
        y = _rounded(acc, w_dtype)
        y = _rounded(_rounded(y / (1.0 + tl.exp(-y)), w_dtype), x_dtype)
        tl.store(act_ptr + channels, y, mask=ok)
    tl.debug_barrier()  # the activated q, k, v are visible to every lane

    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    dk_ok = dk < DK
    dv_ok = dv < DV
    q = tl.load(act_ptr + h * DK + dk, mask=dk_ok, other=0.0).to(tl.float32)
    k = tl.load(act_ptr + KEY_DIM + h * DK + dk, mask=dk_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(_sum(q * q, 0) + 1e-6) / q_scale
    k = k * tl.rsqrt(_sum(k * k, 0) + 1e-6)
    tile_ok = dk_ok[:, None] & dv_ok[None, :]
    for r in range(REPEAT):
        head = h * REPEAT + r
        v = tl.load(act_ptr + 2 * KEY_DIM + head * DV + dv, mask=dv_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + head * stride_b).to(tl.float32)
        beta = _rounded(1.0 / (1.0 + tl.exp(-b)), b_ptr.dtype.element_ty)
        x = tl.load(g_ptr + head * stride_g).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, _log1p(tl.exp(x)))  # torch's softplus (threshold 20)
        decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus)
        cells = state_ptr + head * DK * DV + dk[:, None] * DV + dv[None, :]
        state = tl.load(cells, mask=tile_ok, other=0.0) * decay
        memory = _sum(state * k[:, None], 0)
        delta = (v - memory) * beta
        state = state + k[:, None] * delta[None, :]
        tl.store(cells, state, mask=tile_ok)
        o = _rounded(_sum(state * q[:, None], 0), x_dtype)
        o = _rounded(o * tl.rsqrt(_sum(o * o, 0) / DV + norm_eps), x_dtype)
        product = tl.load(norm_w_ptr + dv, mask=dv_ok, other=0.0).to(tl.float32) * o
        if PRODUCT_IN_NORM_DTYPE:
            product = _rounded(product, norm_w_ptr.dtype.element_ty)
        else:
            product = _rounded(product, x_dtype)
        gate = tl.load(z_ptr + head * stride_zh + dv * stride_zd, mask=dv_ok, other=0.0).to(tl.float32)
        gate = gate / (1.0 + tl.exp(-gate))
        tl.store(out_ptr + head * DV + dv, _rounded(product * gate, x_dtype), mask=dv_ok)
