"""Batch-1 decode attention over a static KV cache as two Triton kernels that read the position from device memory:
inside the engine's CUDA graphs the number of filled slots is not a host value, so the torch path (six kernels)
scores every one of the cache's ``T`` slots each step and masks those past the position; these kernels read the
keys and values up to the position only.

:func:`decode_attention` launches them, :func:`decode_attention_reference` is the torch path op for op (the
OLMoE family's attention after the cache write). Both take one token's queries ``q [nH, D]``, the cache ``keys
[T, nKV, D]`` and ``values [T, nKV, Dv]`` (any strides: DeepSeek's absorbed MLA reads its values as a prefix view
of its keys), the position as a 0-d int64 tensor (slots ``0 .. position`` are attended) and the softmax scale, and
return ``[nH, Dv]`` in q's dtype. Query head ``h`` reads key-value head ``h // (nH / nKV)`` (grouped queries).

Flash-decoding: the first kernel's grid is ``(nKV, splits)``, fixed whatever the position (so that a graph
captures it once); each program takes the ``G = nH / nKV`` query heads of one key-value head over one chunk of the
slots, keeping the running maximum, sum and weighted values in float32, and writes them to a float32 workspace;
the second kernel (one program per query head) combines the chunks. The chunk is sized on the device from the
position (the attended slots shared evenly by the splits, in whole blocks), so that at any position the slots
spread over as many programs as their blocks allow, and the programs past them load nothing and write nothing.
:func:`plan` chooses the splits (about :data:`TARGET_PROGRAMS` programs) and the block of slots a step loads. A
key-value head serving several query heads scores them with ``tl.dot`` (its rows padded to 16); serving one (OLMoE),
with elementwise products and sums, which pad nothing.

Numerics: the scores are float32 (q . k accumulated in float32, times the scale), as is the softmax; the
probabilities are rounded to the values' dtype before they weight the values, as the torch path rounds them to
q's dtype, so that the kernel differs from it by rounding of that dtype only (the torch path also rounds the scores
to q's dtype, the kernel does not). Triton's interpreter truncates float32 to bfloat16 casts and multiplies
bfloat16 tiles in ``tl.dot`` as their bits, so ``triton_helpers.rounded`` rounds on the bits and the
interpreter's products are taken in float32 (exact for bfloat16 inputs). Like
:mod:`psr_hf.engine.gated_delta_kernel` it uses only triton's builtins, ``tl.dot`` and ``tl.reduce`` with the
standard library's combine functions, and is loaded once per mode
(:func:`~psr_hf.engine.device_decisions.triton_module`). The kernels also run as the custom op
``torch.ops.psr_hf.decode_attention`` (registered below), so that compiled code calls them without a graph break.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from .attention import masked_attention
from .device_decisions import PDL_BY_DEFAULT, interpreting, pdl_supported, shared_helpers, triton_module

try:  # optional (the dev extra, the GPU machine): the reference needs only torch
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda: the programmatic dependent launch's trigger)
except ImportError:
    triton = tl = None

#: programs the first kernel aims for at the cache's full length: an H100 has 132 SMs, two programs per SM
TARGET_PROGRAMS = 256
#: the largest ``[G, D]`` query tile (padded to powers of two) one program holds in registers
MAX_QUERY_TILE = 16 * 1024
#: the elements of one ``[block, D]`` key tile the default block keeps to
KEY_TILE = 64 * 128


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                               scaling: float) -> torch.Tensor:
    """The attention in torch, op for op as the OLMoE family's decode step computes it over the whole cache (the
    kernels' reference): ``[nH, Dv]`` in q's dtype."""
    return masked_attention(q, keys, values, position, torch.arange(keys.shape[0], device=keys.device), scaling)


def check_inputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
    """``ValueError`` naming the argument that does not fit the attention's shapes, dtypes or device."""
    if q.dim() != 2 or keys.dim() != 3 or values.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}: expected one "
                         f"token's queries [nH, D] and the cache's [T, nKV, D] and [T, nKV, Dv]")
    nH, D = q.shape
    T, nKV = keys.shape[0], keys.shape[1]
    if tuple(values.shape[:2]) != (T, nKV):
        raise ValueError(f"values {tuple(values.shape)} and keys {tuple(keys.shape)}: the same [T, nKV] expected")
    if keys.shape[2] != D:
        raise ValueError(f"keys {tuple(keys.shape)} and q {tuple(q.shape)}: the keys' head size must be q's ({D})")
    if T < 1 or nKV < 1 or values.shape[2] < 1:
        raise ValueError(f"keys {tuple(keys.shape)}, values {tuple(values.shape)}: an empty cache")
    if nH % nKV:
        raise ValueError(f"{nH} query heads are not a multiple of {nKV} key-value heads (grouped queries: each "
                         f"key-value head serves nH / nKV query heads)")
    if q.dtype != keys.dtype or q.dtype != values.dtype:
        raise ValueError(f"q {q.dtype}, keys {keys.dtype}, values {values.dtype}: one dtype expected (cast q to the "
                         f"cache's)")
    if not isinstance(position, torch.Tensor) or position.dim() != 0 or position.dtype != torch.int64:
        what = f"a {position.dtype} tensor of shape {tuple(position.shape)}" if isinstance(position, torch.Tensor) \
            else type(position).__name__
        raise ValueError(f"position is {what}: a 0-d int64 tensor on the device is expected (the kernel reads it "
                         f"there; torch.tensor(p, device=q.device))")
    devices = {q.device, keys.device, values.device, position.device}
    if len(devices) != 1:
        raise ValueError(f"q, keys, values and position are on several devices: {sorted(map(str, devices))}; move "
                         f"them to q's")


def plan(T: int, num_kv_heads: int, k_dim: int, *, splits: int | None = None,
         block_t: int | None = None) -> tuple[int, int]:
    """``(splits, block_t)`` for a cache of ``T`` slots: ``block_t`` slots per load, a power of two of at most
    :data:`KEY_TILE` elements per key tile (64 at D = 128) and at least 16 (``tl.dot``'s smallest side); and
    ``splits`` chunks per key-value head, about :data:`TARGET_PROGRAMS` programs in all, no more than the cache's
    blocks. Either can be given (tests, tuning)."""
    if block_t is None:
        block_t = max(16, min(64, KEY_TILE // max(16, _pow2(k_dim))))
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t {block_t}: a power of two of at least 16 is expected (tl.dot's smallest side)")
    if splits is None:
        splits = max(1, min(_cdiv(TARGET_PROGRAMS, num_kv_heads), _cdiv(T, block_t)))
    if splits < 1:
        raise ValueError(f"splits {splits}: at least 1 is expected")
    return int(splits), int(block_t)


def new_workspace(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, splits: int | None = None,
                  block_t: int | None = None) -> torch.Tensor:
    """The float32 workspace of :func:`decode_attention` for these shapes, ``[nH, splits, Dv + 2]`` (each chunk's
    weighted values, maximum and sum per query head), to allocate once and pass to every call (``workspace=``)."""
    splits, _ = plan(keys.shape[0], keys.shape[1], keys.shape[2], splits=splits, block_t=block_t)
    return torch.empty(q.shape[0], splits, values.shape[-1] + 2, dtype=torch.float32, device=q.device)


#: compiled, float32 heads over this size are refused: their program's tiles pass a GPU block's shared memory
#: (257 KB at DeepSeek's absorbed 576 against an H100's 227; 146 KB at 256:
#: benchmarks/engine/decode_attention_shared_memory.py), and that shape failed its test on an H100
MAX_FLOAT32_HEAD = 256


def unsupported(device: torch.device, num_heads: int, num_kv_heads: int, k_dim: int,
                dtype: torch.dtype | None = None) -> str | None:
    """Why :func:`decode_attention` cannot run on ``device`` now with these heads (None: it can): triton does not
    import, the device is not CUDA (CPU tensors run in triton's interpreter only, ``TRITON_INTERPRET=1``), a
    key-value head's queries do not fit one program's registers, or (compiled) float32 heads over
    :data:`MAX_FLOAT32_HEAD`, whose tiles pass a block's shared memory."""
    if triton is None:
        return "decode_attention needs triton, which does not import (the dev extra, or the GPU machine's)"
    if device.type != ("cpu" if interpreting() else "cuda"):
        return (f"tensors on {device}: the kernel takes CUDA tensors, or CPU tensors in triton's interpreter "
                f"(TRITON_INTERPRET=1)")
    group = num_heads // max(num_kv_heads, 1)
    tile = max(16, _pow2(group)) * max(16, _pow2(k_dim))
    if tile > MAX_QUERY_TILE:
        return (f"{group} query heads of size {k_dim} per key-value head (a [{max(16, _pow2(group))}, "
                f"{max(16, _pow2(k_dim))}] tile) are more than the {MAX_QUERY_TILE} elements one program holds")
    if device.type == "cuda" and dtype == torch.float32 and _pow2(k_dim) > MAX_FLOAT32_HEAD:
        return (f"float32 heads of size {k_dim} (over {MAX_FLOAT32_HEAD}): the compiled kernel's tiles need more "
                f"shared memory than a GPU block has; use bfloat16 or the torch attention")
    return None


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                     scaling: float, *, out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                     splits: int | None = None, block_t: int | None = None,
                     num_warps: int | None = None, locks: torch.Tensor | None = None) -> torch.Tensor:
    """One token's attention over the cache's slots ``0 .. position`` (see the module docstring for the
    arguments) as two kernel launches whose grids do not depend on the position, which is read on the device:
    capturable in a CUDA graph (the first call compiles: make it before capture). CUDA tensors, or CPU tensors in
    Triton's interpreter (``TRITON_INTERPRET=1``). Returns ``out`` (``[nH, Dv]``, q's dtype, any strides) or a new
    tensor. ``workspace``: from :func:`new_workspace` (with the same ``splits`` and ``block_t``), else allocated
    here; ``splits``, ``block_t``: :func:`plan`'s; ``num_warps``: per program of the first kernel, default 4 (8
    for a head size over 256). ``locks``: :func:`new_locks`' zeroed counters, one per key-value head: then one
    launch, whose last program per key-value head combines the chunks (the counters are zero again when it
    returns; calls that share them must not run at the same time), and which, with ``PDL_BY_DEFAULT`` on a GPU
    that has them (:func:`pdl_supported`), lets a programmatic dependent launch after it (the output projection's
    GEMV) start as soon as all its programs run."""
    check_inputs(q, keys, values, position)
    nH, D = q.shape
    T, nKV, Dv = values.shape
    why = unsupported(q.device, nH, nKV, D, q.dtype)
    if why is not None:
        raise ValueError(f"{why}; decode_attention_reference is the same attention in torch")
    splits, block_t = plan(T, nKV, D, splits=splits, block_t=block_t)
    if out is None:
        out = torch.empty(nH, Dv, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (nH, Dv) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device}: expected ({nH}, {Dv}) {q.dtype} on "
                         f"{q.device}")
    if workspace is None:
        workspace = torch.empty(nH, splits, Dv + 2, dtype=torch.float32, device=q.device)
    elif (tuple(workspace.shape) != (nH, splits, Dv + 2) or workspace.dtype != torch.float32
          or workspace.device != q.device or not workspace.is_contiguous()):
        raise ValueError(f"workspace {tuple(workspace.shape)} {workspace.dtype} on {workspace.device}: expected a "
                         f"contiguous float32 ({nH}, {splits}, {Dv + 2}) on {q.device} (new_workspace with the same "
                         f"splits and block_t)")
    if locks is not None and (tuple(locks.shape) != (nKV,) or locks.dtype != torch.int32
                              or locks.device != q.device or not locks.is_contiguous()):
        raise ValueError(f"locks {tuple(locks.shape)} {locks.dtype} on {locks.device}: expected contiguous zeroed "
                         f"int32 ({nKV},) on {q.device} (new_locks)")
    group = nH // nKV
    block_d, block_dv = max(16, _pow2(D)), max(16, _pow2(Dv))
    combine = dict(BLOCK_ALL=_pow2(splits), BLOCK_S=min(_pow2(splits), max(1, 4096 // block_dv)))
    dot = group > 1  # one query head per key-value head: elementwise products, no padding to tl.dot's 16 rows
    block_g = max(16, _pow2(group)) if dot else 1
    if num_warps is None:
        num_warps = 4 if block_d <= 256 else 8
    # offsets in int32 unless a cache is too large for them
    reach = max((T - 1) * abs(t.stride(0)) + (nKV - 1) * abs(t.stride(1)) + (t.shape[2] - 1) * abs(t.stride(2))
                for t in (keys, values))
    interpret = interpreting()
    kernels = triton_module("decode_attention_kernel.py", interpret)
    guard = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with guard:  # triton launches on the current device
        kernels.decode_split_kernel[(nKV, splits)](
            q, keys, values, position, workspace, T, float(scaling), q.stride(0), q.stride(1), keys.stride(0),
            keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2), out, out.stride(0),
            out.stride(1), locks if locks is not None else position,
            G=group, D=D, DV=Dv, SPLITS=splits, BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_D=block_d,
            BLOCK_DV=block_dv, DOT=dot, DOT_F32=q.dtype == torch.float32 or (interpret and q.dtype == torch.bfloat16),
            WIDE=reach >= 2 ** 31, FUSED=locks is not None,
            TRIGGER=locks is not None and PDL_BY_DEFAULT and pdl_supported(q.device), **combine,
            num_warps=num_warps)
        if locks is None:
            kernels.decode_combine_kernel[(nH,)](
                workspace, position, out, T, out.stride(0), out.stride(1), DV=Dv, SPLITS=splits, BLOCK_T=block_t,
                BLOCK_DV=block_dv, **combine, num_warps=4)
    return out


def new_locks(keys: torch.Tensor) -> torch.Tensor:
    """Zeroed int32 counters, one per key-value head of the cache ``keys [T, nKV, D]``, for :func:`decode_attention`
    in one launch (``locks=``); one set per attention that may run at the same time as another."""
    return torch.zeros(keys.shape[1], dtype=torch.int32, device=keys.device)


def attended_bytes(num_kv_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype, position: int) -> int:
    """Bytes of keys and values a call must read at ``position`` (slots ``0 .. position``)."""
    item = torch.empty(0, dtype=dtype).element_size()
    return (int(position) + 1) * num_kv_heads * (k_dim + v_dim) * item


# The kernels as a custom op: torch.compile (the engine's compiled attention blocks, fullgraph) cannot trace into a
# Triton launch behind a Python wrapper; as an op, inductor calls it and the CUDA graph captures its two launches.
# Its first call compiles the kernels: make it before any capture. Registered by the package's import of this file
# only, not by triton_module's copies of it (which run the file again and would register the name twice).
if __name__ == "psr_hf.engine.decode_attention_kernel":
    # ``locks`` is declared unmutated: the kernel counts on it and leaves it zero again, as it found it
    @torch.library.custom_op("psr_hf::decode_attention", mutates_args=())
    def _decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                             scaling: float, locks: Optional[torch.Tensor] = None) -> torch.Tensor:
        return decode_attention(q, keys, values, position, scaling, locks=locks)

    @_decode_attention_op.register_fake
    def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *args: Any) -> torch.Tensor:
        return q.new_empty(q.shape[0], values.shape[-1])  # [nH, Dv], a new tensor as the kernels return


# ------------------------------------------------------------------------------------------ the Triton source
_helpers = shared_helpers(triton is not None)  # psr_hf/engine/triton_helpers.py, in this file's mode
_jit, _sum, _max, _rounded = _helpers.jit, _helpers.reduce_sum, _helpers.reduce_max, _helpers.rounded


@_jit
def _dot(a, b, F32: tl.constexpr):
    # [M, K] @ [K, N] accumulated in float32; F32: multiplied as float32 (a float32 cache, not TF32; or bfloat16
    # tiles in Triton's interpreter, which would multiply their bits: their products are exact in float32)
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@_jit
def _span(pos_ptr, T, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr):
    # the attended slots (0 .. position, within the cache) and the chunk each split takes: the slots shared evenly,
    # in whole blocks, so that any position keeps every split busy
    pos = tl.load(pos_ptr)
    n = (tl.minimum(tl.maximum(pos, -1), T - 1) + 1).to(tl.int32)
    per = (n + SPLITS - 1) // SPLITS
    chunk = tl.maximum((per + BLOCK_T - 1) // BLOCK_T, 1) * BLOCK_T
    return n, chunk


@_jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, ws_ptr, T, scaling, stride_qh, stride_qd, stride_kt,
                        stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, out_ptr, stride_oh, stride_od, locks_ptr,
                        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        DOT: tl.constexpr, DOT_F32: tl.constexpr, WIDE: tl.constexpr, FUSED: tl.constexpr,
                        TRIGGER: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_S: tl.constexpr):
    if TRIGGER:  # a programmatic dependent launch after this one may start (it waits for this one's writes)
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0)  # the key-value head
    split = tl.program_id(1)
    n, chunk = _span(pos_ptr, T, SPLITS, BLOCK_T)
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    lanes = tl.arange(0, BLOCK_T)
    g_ok = g < G
    d_ok = d < D
    dv_ok = dv < DV
    heads = h * G + g
    q = tl.load(q_ptr + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)  # [BLOCK_G, BLOCK_D]; rows past G are zeros (tl.dot's padding)
    if not DOT:
        q_row = _sum(q.to(tl.float32), 0)  # the one query head, [BLOCK_D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_DV], 0.0, tl.float32)
    for t0 in range(start, end, BLOCK_T):  # every block holds an attended slot: the running maximum stays finite
        slots = t0 + lanes
        ok = slots < end
        if WIDE:
            slots = slots.to(tl.int64)
        k = tl.load(k_ptr + slots[:, None] * stride_kt + h * stride_kh + d[None, :] * stride_kd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_D]
        if DOT:
            scores = _dot(q, tl.trans(k), DOT_F32)
        else:
            scores = _sum(k.to(tl.float32) * q_row[None, :], 1)[None, :]
        scores = tl.where(ok[None, :], scores * scaling, float("-inf"))  # [BLOCK_G, BLOCK_T]
        m_new = tl.maximum(m, _max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + _sum(p, 1)
        v = tl.load(v_ptr + slots[:, None] * stride_vt + h * stride_vh + dv[None, :] * stride_vd,
                    mask=ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_DV]
        p = _rounded(p, v.dtype)  # as the torch path rounds its probabilities
        if DOT:
            weighted = _dot(p.to(v.dtype), v, DOT_F32)
        else:
            weighted = _sum(_sum(p, 0)[:, None] * v.to(tl.float32), 0)[None, :]
        acc = acc * alpha[:, None] + weighted
        m = m_new
    written = g_ok & (g * 0 + start < end)  # a split past the position writes nothing
    row = ws_ptr + (heads * SPLITS + split) * (DV + 2)  # [BLOCK_G] rows of the workspace
    tl.store(row[:, None] + dv[None, :], acc, mask=written[:, None] & dv_ok[None, :])
    tl.store(row + DV, m, mask=written)
    tl.store(row + DV + 1, l, mask=written)
    if FUSED:  # the last program of this key-value head to finish combines its query heads' chunks
        tl.debug_barrier()  # every thread's workspace stores come before the count
        arrived = tl.atomic_add(locks_ptr + h, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            tl.debug_barrier()
            for gi in range(G):
                _combine_head(ws_ptr, h * G + gi, n, chunk, out_ptr, stride_oh, stride_od, DV, SPLITS, BLOCK_ALL,
                              BLOCK_S, BLOCK_DV, True)
            tl.atomic_xchg(locks_ptr + h, 0)  # zero again for the next call


@_jit
def _combine_head(ws_ptr, head, n, chunk, out_ptr, stride_oh, stride_od, DV: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_ALL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, FRESH: tl.constexpr):
    # one query head's output from its chunks' weighted values, maxima and sums; FRESH: other programs of this
    # kernel wrote them, so the loads skip the SM's L1 (".cg")
    active = (n + chunk - 1) // chunk  # the splits that held slots (the others wrote nothing)
    row = ws_ptr + head * SPLITS * (DV + 2)
    s = tl.arange(0, BLOCK_ALL)
    if FRESH:
        m = tl.load(row + s * (DV + 2) + DV, mask=s < active, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(row + s * (DV + 2) + DV + 1, mask=s < active, other=0.0, cache_modifier=".cg")
    else:
        m = tl.load(row + s * (DV + 2) + DV, mask=s < active, other=float("-inf"))
        sums = tl.load(row + s * (DV + 2) + DV + 1, mask=s < active, other=0.0)
    top = _max(m, 0)
    total = _sum(sums * tl.exp(m - top), 0)
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    acc = tl.full([BLOCK_DV], 0.0, tl.float32)
    for s0 in range(0, active, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        ok = ss < active
        where = row + ss[:, None] * (DV + 2) + dv[None, :]
        if FRESH:
            maxima = tl.load(row + ss * (DV + 2) + DV, mask=ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(where, mask=ok[:, None] & dv_ok[None, :], other=0.0, cache_modifier=".cg")
        else:
            maxima = tl.load(row + ss * (DV + 2) + DV, mask=ok, other=float("-inf"))
            part = tl.load(where, mask=ok[:, None] & dv_ok[None, :], other=0.0)
        acc += _sum(part * tl.exp(maxima - top)[:, None], 0)
    tl.store(out_ptr + head * stride_oh + dv * stride_od, _rounded(acc / total, out_ptr.dtype.element_ty), mask=dv_ok)


@_jit
def decode_combine_kernel(ws_ptr, pos_ptr, out_ptr, T, stride_oh, stride_od, DV: tl.constexpr, SPLITS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_DV: tl.constexpr):
    n, chunk = _span(pos_ptr, T, SPLITS, BLOCK_T)
    _combine_head(ws_ptr, tl.program_id(0), n, chunk, out_ptr, stride_oh, stride_od, DV, SPLITS, BLOCK_ALL, BLOCK_S,
                  BLOCK_DV, False)
