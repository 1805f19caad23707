"""Several batch-1 linear projections of the same input as one Triton launch (a fused GEMV), so that the decode
step streams their weights once at close to the memory's bandwidth.

Why: a batch-1 decode step multiplies one row ``x [1, H]`` by weights ``[N, H]``. Each attention layer does it
three times on the same normed input (q_proj, k_proj, v_proj), and cuBLAS picks for ``M = 1`` a kernel that reads
an 8 MB bf16 weight (OLMoE's ``[2048, 2048]``) at about 1.4 TB/s on an H100, 5.9 us each, where the HBM bound is
about 2.5 us. The projections cannot be concatenated into one ``[Nq + Nk + Nv, H]`` weight: the engine computes
over the model's own parameters and must not copy them. So :func:`linear_many` takes up to four separate weights
and launches one kernel whose programs split the concatenation of all their output rows: program ``p`` finds the
weight its rows belong to by comparing ``p`` with the cumulative row-block counts (constexprs) and reads that
weight's pointer, row stride and length. Each program computes ``BLOCK_N`` rows, loading ``[BLOCK_N, BLOCK_H]``
weight tiles (vectorised along the unit-stride H) and the matching chunk of ``x``, accumulating their products in
float32 and reducing along H once at the end; the sum (plus the bias, in float32) is rounded once to ``x``'s dtype,
to nearest even, as cuBLAS does for bfloat16 with float32 accumulation. Triton's interpreter truncates a float32
to bfloat16 cast, so ``triton_helpers.rounded`` rounds bfloat16 on the bits (as :mod:`psr_hf.engine.gated_delta_kernel`
does).

Rows per program: the weights are the bandwidth, and a launch with fewer programs than a few per SM leaves it
unused. By default ``BLOCK_N`` is the largest of 16, 8, 4 giving at least :data:`PROGRAMS_PER_SM` programs per SM
(OLMoE's q/k/v, 6144 rows: 16, 384 programs on an H100's 132 SMs; one ``[2048, 2048]`` weight: 4, 512 programs).
``split_h > 1`` also splits H over that many programs per row block, whose partial sums meet in a float32
workspace by ``tl.atomic_add`` before one cast per output (more launches, and the float32 sums' order varies from
run to run): an option for weights of few rows (a router's ``[128, H]``), for the benchmark
(``benchmarks/engine/gemv_bench.py``) to compare; the defaults were chosen by that reasoning, not yet measured.

:func:`linear_many_reference` is the same in torch (``F.linear`` per weight). The kernel runs as the custom op
``torch.ops.psr_hf.linear_many`` (registered when this module is imported as ``psr_hf.engine.gemv_kernel``), so
that compiled code (``fullgraph=True``) calls it as one opaque op, not a graph break. Like the other kernels of
the engine it uses only triton's builtins and ``tl.reduce`` with the standard library's combine function, and is
loaded once per mode (:func:`~psr_hf.engine.device_decisions.triton_module`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .device_decisions import interpreting, pdl_supported, shared_helpers, triton_module

try:  # optional (the dev extra, the GPU machine): the reference needs only torch
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda: the programmatic dependent launch's waits)
except ImportError:
    triton = tl = None

#: the most weights one launch takes (one pointer argument each)
MAX_WEIGHTS = 4
#: warps per program unless told
DEFAULT_WARPS = 4
#: the largest H chunk a program loads per loop step unless told
DEFAULT_BLOCK_H = 512
#: the rows per program the default chooses from, largest first
BLOCK_N_CHOICES = (16, 8, 4)
#: the default ``BLOCK_N`` is the largest choice giving at least this many programs per SM
PROGRAMS_PER_SM = 2
#: the elements of one program's float32 accumulator tile ``[BLOCK_N, BLOCK_H]`` at most, for the defaults
MAX_TILE = 8192
#: SMs assumed where the device has none to ask (the CPU in the interpreter): an H100's
DEFAULT_SMS = 132
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
#: rows and columns of one scale block of an FP8 weight (``weight_block_size: [128, 128]``)
SCALE_BLOCK = 128


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_blocks(rows: Sequence[int], hidden: int, device: torch.device) -> tuple[int, int]:
    """``(block_n, block_h)`` that :func:`linear_many` uses unless told, for weights of ``rows`` rows each over
    ``hidden`` columns on ``device``: ``block_n`` the largest of :data:`BLOCK_N_CHOICES` giving at least
    :data:`PROGRAMS_PER_SM` programs per SM (else the smallest), ``block_h`` :data:`DEFAULT_BLOCK_H` or less where
    H is smaller (a power of two) or the accumulator tile would pass :data:`MAX_TILE`."""
    target = PROGRAMS_PER_SM * _sm_count(device)
    block_n = BLOCK_N_CHOICES[-1]
    for choice in BLOCK_N_CHOICES:
        if sum(_cdiv(n, choice) for n in rows) >= target:
            block_n = choice
            break
    block_h = max(16, min(DEFAULT_BLOCK_H, _pow2(hidden), MAX_TILE // block_n))
    return block_n, block_h


def shape_key(rows: Sequence[int], hidden: int) -> str:
    """The shape's key in the tuned tiles' table (:mod:`psr_hf.engine.tuned_tiles`)."""
    return f"H{int(hidden)}_rows{'-'.join(str(int(r)) for r in rows)}"


@functools.lru_cache(maxsize=None)
def tuned_config(rows: tuple[int, ...], hidden: int, device: torch.device) -> dict[str, int]:
    """``block_n``, ``block_h``, ``num_warps``, ``num_stages`` measured best for this GPU model and shape where the
    shipped table has them (:mod:`psr_hf.engine.tuned_tiles`), else {} (:func:`default_blocks`)."""
    from .tuned_tiles import lookup

    return lookup("linear_many", torch.device(device), shape_key(rows, hidden)) or {}


def linear_many_reference(x: torch.Tensor, weights: Sequence[torch.Tensor],
                          biases: Sequence[torch.Tensor | None] | None = None,
                          scales: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, W_i, b_i)`` per weight, each ``[1, N_i]`` (the kernel's reference, and what the engine calls
    without it). With ``scales`` (block-wise FP8 weights): each weight dequantized in float32, the product and the
    bias in float32, rounded once to x's dtype, as the kernel computes it."""
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    x = x.reshape(1, -1)
    biases = tuple(biases) if biases is not None else (None,) * len(weights)
    if scales is None:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    from ..assets.fp8_blocks import dequantize_blocks

    scales = (scales,) if isinstance(scales, torch.Tensor) else tuple(scales)
    return tuple(F.linear(x.float(), dequantize_blocks(w, sc, (SCALE_BLOCK, SCALE_BLOCK)),
                          None if b is None else b.float()).to(x.dtype)
                 for w, b, sc in zip(weights, biases, scales))


def unsupported(device: torch.device) -> str | None:
    """Why :func:`linear_many` cannot run on ``device`` now (None: it can): triton does not import, or the device is
    not CUDA (CPU tensors run in triton's interpreter only, ``TRITON_INTERPRET=1``)."""
    if triton is None:
        return "linear_many needs triton, which does not import (the dev extra, or the GPU machine's)"
    if device.type != ("cpu" if interpreting() else "cuda"):
        return (f"tensors on {device}: the kernel takes CUDA tensors, or CPU tensors in triton's interpreter "
                f"(TRITON_INTERPRET=1)")
    return None


def _checked(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None,
             outs: Sequence[torch.Tensor] | None, scales: Sequence[torch.Tensor] | None = None
             ) -> tuple[int, tuple, tuple, tuple | None, tuple | None]:
    """H, the weights, the biases (None where none), the outputs and the FP8 weights' scales as tuples, or
    ``ValueError`` naming what is wrong and what to pass instead."""
    if not isinstance(x, torch.Tensor) or not (x.dim() == 1 or (x.dim() == 2 and x.shape[0] == 1)):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x {shape}: one row [H] or [1, H] expected (a batch-1 decode step); for several rows "
                         f"call F.linear (linear_many_reference)")
    H = x.shape[-1]
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    weights = tuple(weights)
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{len(weights)} weights: one launch takes 1 to {MAX_WEIGHTS}; split them over several "
                         f"calls")
    if x.dtype not in DTYPES:
        raise ValueError(f"x is {x.dtype}: the kernel takes {', '.join(map(str, DTYPES))}")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"weights[{i}] {shape}: a matrix [N, H] expected (an nn.Linear's weight)")
        if w.shape[1] != H:
            raise ValueError(f"weights[{i}] {tuple(w.shape)} does not match x's H = {H}: expected [N, {H}]")
        if scales is not None:
            if w.dtype != FP8_DTYPE:
                raise ValueError(f"weights[{i}] is {w.dtype} but scales were given: with scales every weight is "
                                 f"{FP8_DTYPE} (block-wise FP8); call without scales for weights in x's dtype")
        elif w.dtype != x.dtype:
            raise ValueError(f"weights[{i}] is {w.dtype} and x is {x.dtype}: cast x to the weights' dtype"
                             + ("; FP8 weights need their block scales (scales=)" if w.dtype == FP8_DTYPE else ""))
        if w.device != x.device:
            raise ValueError(f"weights[{i}] is on {w.device} and x on {x.device}: move x to the weights' device")
        if w.stride(1) != 1 and w.shape[1] > 1:
            raise ValueError(f"weights[{i}] has stride {w.stride()} over H: a unit stride along H is expected "
                             f"(row-major; a transposed view is not taken: pass the weight itself or .contiguous())")
    if biases is None:
        biases = (None,) * len(weights)
    biases = tuple(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{len(biases)} biases for {len(weights)} weights: one per weight expected (None where none)")
    for i, (b, w) in enumerate(zip(biases, weights)):
        if b is None:
            continue
        if b.dim() != 1 or b.shape[0] != w.shape[0]:
            raise ValueError(f"biases[{i}] {tuple(b.shape)}: expected ({w.shape[0]},), one per row of weights[{i}]")
        if b.dtype != x.dtype or b.device != x.device:
            raise ValueError(f"biases[{i}] is {b.dtype} on {b.device}: expected {x.dtype} on {x.device}, as x")
    if outs is not None:
        outs = tuple(outs)
        if len(outs) != len(weights):
            raise ValueError(f"{len(outs)} outs for {len(weights)} weights: one per weight expected")
        for i, (o, w) in enumerate(zip(outs, weights)):
            if tuple(o.shape) not in ((1, w.shape[0]), (w.shape[0],)):
                raise ValueError(f"outs[{i}] {tuple(o.shape)}: expected (1, {w.shape[0]}) or ({w.shape[0]},)")
            if o.dtype != x.dtype or o.device != x.device:
                raise ValueError(f"outs[{i}] is {o.dtype} on {o.device}: expected {x.dtype} on {x.device}, as x")
    if scales is not None:
        scales = (scales,) if isinstance(scales, torch.Tensor) else tuple(scales)
        if len(scales) != len(weights):
            raise ValueError(f"{len(scales)} scales for {len(weights)} weights: one per weight expected")
        for i, (sc, w) in enumerate(zip(scales, weights)):
            want = (_cdiv(w.shape[0], SCALE_BLOCK), _cdiv(H, SCALE_BLOCK))
            got = tuple(sc.shape) if isinstance(sc, torch.Tensor) else type(sc).__name__
            if not isinstance(sc, torch.Tensor) or tuple(sc.shape) != want or sc.dtype != torch.float32:
                raise ValueError(f"scales[{i}] {got}: a float32 [ceil(N/{SCALE_BLOCK}), ceil(H/{SCALE_BLOCK})] = "
                                 f"{want} tensor expected (the checkpoint's weight_scale_inv of a "
                                 f"{SCALE_BLOCK}x{SCALE_BLOCK} block-wise FP8 weight)")
            if sc.device != x.device:
                raise ValueError(f"scales[{i}] is on {sc.device} and x on {x.device}: move it to x's device")
    return H, weights, biases, outs, scales


def linear_many(x: torch.Tensor, weights: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None = None,
                biases: Sequence[torch.Tensor | None] | None = None, *, block_n: int | None = None,
                block_h: int | None = None, num_warps: int | None = None,
                split_h: int = 1, num_stages: int | None = None, pdl: bool = False,
                scales: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """``x @ W_i^T (+ b_i)`` for each of 1 to 4 ``weights`` ``[N_i, H]`` in one kernel launch (two more with
    ``split_h > 1``), each ``[1, N_i]`` in ``x``'s dtype (written into ``outs[i]``, ``[1, N_i]`` or ``[N_i]``, and
    returned, where given). ``x``: ``[H]`` or ``[1, H]``; the weights: any row stride, a unit stride along H (an
    ``nn.Linear``'s weight, or a row slice of a larger one); ``biases``: None, or one per weight, None or
    ``[N_i]``. Float32 accumulation, one rounding at the end. CUDA tensors, or CPU tensors in Triton's interpreter
    (``TRITON_INTERPRET=1``); capturable in a CUDA graph (the first call of a shape compiles: make it before
    capture).

    Tuning: ``block_n`` rows and ``block_h`` columns per program and loop step (powers of two; by default the
    shipped table's for this GPU model and shape, :func:`tuned_config`, else :func:`default_blocks`),
    ``num_warps`` per program (default :data:`DEFAULT_WARPS`), ``split_h`` programs per row block along H, whose
    float32 partial sums are added atomically into a workspace and then cast (default 1: one launch, one program
    per row block), ``num_stages`` the software pipeline's stages of the loop over H
    (default: triton's). ``pdl``: a programmatic dependent launch (Hopper and later): the kernel may start while
    the one before it on the stream runs, loads its first weight tile, then waits for that kernel's writes; it
    lets the next kernel start the same way. Where PDL is not supported (:func:`pdl_supported`: triton's
    interpreter, GPUs before Hopper) it is the same as ``pdl=False``.

    ``scales``: block-wise FP8 weights (a fine-grained FP8 checkpoint's ``float8_e4m3fn`` weights, every one of
    the launch) with one float32 ``weight_scale_inv`` ``[ceil(N_i/128), ceil(H/128)]`` each; each weight element
    is multiplied by its block's scale in float32, then by x, so the result is :func:`linear_many_reference` on
    the float32 dequantized weights up to the order of the sum. ``block_n`` must divide 128 (the tuned table,
    measured for weights in x's dtype, is not used)."""
    H, weights, biases, outs, scales = _checked(x, weights, biases, outs, scales)
    why = unsupported(x.device)
    if why is not None:
        raise ValueError(f"{why}; linear_many_reference is the same in torch")
    rows = [w.shape[0] for w in weights]
    fp8 = scales is not None
    if not fp8 and block_n is None and block_h is None and num_warps is None and num_stages is None and split_h == 1:
        tuned = tuned_config(tuple(rows), H, x.device)  # the table's tiles for this GPU model and shape, if any
        block_n, block_h = tuned.get("block_n"), tuned.get("block_h")
        num_warps, num_stages = tuned.get("num_warps"), tuned.get("num_stages")
    auto_n, auto_h = default_blocks(rows, H, x.device)
    block_n = auto_n if block_n is None else int(block_n)
    block_h = auto_h if block_h is None else int(block_h)
    num_warps = DEFAULT_WARPS if num_warps is None else int(num_warps)
    split_h = int(split_h)
    for name, value in (("block_n", block_n), ("block_h", block_h), ("num_warps", num_warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} = {value}: a power of two expected")
    if fp8 and SCALE_BLOCK % block_n:
        raise ValueError(f"block_n = {block_n} with FP8 weights: it must divide the scale block, {SCALE_BLOCK}")
    if split_h < 1:
        raise ValueError(f"split_h = {split_h}: 1 (no split) or more programs per row block expected")
    if num_stages is not None and int(num_stages) < 1:
        raise ValueError(f"num_stages = {num_stages}: at least 1 expected (or None: triton's default)")
    launch = {} if num_stages is None else {"num_stages": int(num_stages)}
    pdl = bool(pdl) and pdl_supported(x.device)
    if pdl:
        launch["launch_pdl"] = True
    if outs is None:
        outs = tuple(x.new_empty(1, n) for n in rows)
    n = len(weights)
    ends, total = [], 0
    for r in rows:
        total += _cdiv(r, block_n)
        ends.append(total)
    ends += [total] * (MAX_WEIGHTS - n)
    pad = MAX_WEIGHTS - n
    ws = list(weights) + [weights[0]] * pad
    bs = [b if b is not None else weights[0] for b in biases] + [weights[0]] * pad
    if split_h > 1:
        work = torch.zeros(sum(rows), dtype=torch.float32, device=x.device)
        targets = list(work.split(rows)) + [work] * pad
    else:
        targets = list(outs) + [outs[0]] * pad
    sc = list(scales) + [scales[0]] * pad if fp8 else [x] * MAX_WEIGHTS  # x: a pointer never read
    sizes = rows + [0] * pad
    chunk = _cdiv(_cdiv(H, split_h), block_h) * block_h  # H columns per split, whole loop steps
    kernel = triton_module("gemv_kernel.py", interpreting()).linear_many_kernel
    guard = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
    if total:
        with guard:  # triton launches on the current device
            kernel[(total, split_h)](
                x, *ws, *bs, *targets, *sc, *sizes, *(w.stride(0) for w in ws), *(b.stride(0) for b in bs),
                *(t.stride(-1) for t in targets), *(c.stride(0) for c in sc), *(c.stride(-1) for c in sc),
                x.stride(-1), H, chunk,
                NUM=n, END0=ends[0], END1=ends[1], END2=ends[2],
                HAS_B0=biases[0] is not None, HAS_B1=n > 1 and biases[1] is not None,
                HAS_B2=n > 2 and biases[2] is not None, HAS_B3=n > 3 and biases[3] is not None,
                SPLIT=split_h > 1, EVEN_H=H % block_h == 0, BLOCK_N=block_n, BLOCK_H=block_h, PDL=pdl, FP8=fp8,
                SB=SCALE_BLOCK,
                num_warps=num_warps, **launch)
    if split_h > 1:
        for out, part in zip(outs, work.split(rows)):
            out.copy_(part.view(out.shape))
    return tuple(outs)


# ------------------------------------------------------------------------------------------ the custom op
# The kernel as a custom op: torch.compile (fullgraph) cannot trace into a Triton launch behind a Python wrapper; as
# an op returning new tensors, inductor calls it on the model's own weights (no copies) and a CUDA graph captures its
# launch. Its first call for a shape compiles the kernel: make it before any capture. A custom op's signature is
# fixed: a list of weights and a list of biases of the same length (None where none; an empty list: no biases), the
# default blocks and warps, and ``pdl``; ``psr_hf::linear_many_fp8`` takes block-wise FP8 weights with their scales
# list. Registered once, by the package's module only: triton_module loads this file
# again as a module of its own per mode.
if __name__ == "psr_hf.engine.gemv_kernel":
    @torch.library.custom_op("psr_hf::linear_many", mutates_args=())
    def _linear_many_op(x: torch.Tensor, weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                        pdl: bool = False) -> list[torch.Tensor]:
        return list(linear_many(x, weights, biases=biases or None, pdl=pdl))

    @_linear_many_op.register_fake
    def _(x: torch.Tensor, weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
          pdl: bool = False) -> list[torch.Tensor]:
        return [x.new_empty(1, w.shape[0]) for w in weights]  # [1, N_i], new tensors as the kernel returns

    @torch.library.custom_op("psr_hf::linear_many_fp8", mutates_args=())
    def _linear_many_fp8_op(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
                            biases: list[Optional[torch.Tensor]], pdl: bool = False) -> list[torch.Tensor]:
        return list(linear_many(x, weights, biases=biases or None, scales=scales, pdl=pdl))

    @_linear_many_fp8_op.register_fake
    def _(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
          biases: list[Optional[torch.Tensor]], pdl: bool = False) -> list[torch.Tensor]:
        return [x.new_empty(1, w.shape[0]) for w in weights]


# ------------------------------------------------------------------------------------------ the Triton source
_helpers = shared_helpers(triton is not None)  # psr_hf/engine/triton_helpers.py, in this file's mode
_jit, _sum, _rounded = _helpers.jit, _helpers.reduce_sum, _helpers.rounded


@_jit
def _tile(tiles, h, stop, row_ok, cols, EVEN_H: tl.constexpr):
    # the weight tile at column h as float32 (zeros past the rows, past H, or at h >= stop); read once per token,
    # so first out of L2 (the slot MoE's weights likewise)
    if EVEN_H:
        return tl.load(tiles + h, mask=row_ok[:, None] & (cols * 0 + h < stop)[None, :], other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
    else:
        return tl.load(tiles + h, mask=row_ok[:, None] & (h + cols < stop)[None, :], other=0.0,
                       eviction_policy="evict_first").to(tl.float32)


@_jit
def _rows(x_ptr, stride_x, w_ptr, stride_w, b_ptr, stride_b, y_ptr, stride_y, s_ptr, stride_sr, stride_sc, N, H,
          chunk, block, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_H: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr):
    # rows block * BLOCK_N ... of one weight (over H columns chunk * split ... when split). Each step loads the next
    # step's weight tile before it multiplies, so that a tile is always in flight; with PDL the first tile is
    # loaded before the wait for the kernels this one follows (the weights are not theirs to write). FP8 weights
    # are multiplied by their block's scale in float32 before x, as the dequantized weight would be (BLOCK_N
    # divides SB, so a program's rows share one block row of scales and a column step needs one scale per column)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_H)
    if SPLIT:
        start = tl.program_id(1) * chunk
        stop = tl.minimum(start + chunk, H)
    else:
        start = 0
        stop = H
    tiles = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    acc = tl.full([BLOCK_N, BLOCK_H], 0.0, tl.float32)
    w = _tile(tiles, start, stop, row_ok, cols, EVEN_H)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for h in range(start, stop, BLOCK_H):
        if EVEN_H:
            xs = tl.load(x_ptr + (h + cols) * stride_x).to(tl.float32)
        else:
            xs = tl.load(x_ptr + (h + cols) * stride_x, mask=h + cols < H, other=0.0).to(tl.float32)
        following = _tile(tiles, h + BLOCK_H, stop, row_ok, cols, EVEN_H)
        if FP8:
            sc = tl.load(s_ptr + (block * BLOCK_N // SB) * stride_sr + ((h + cols) // SB) * stride_sc,
                         mask=h + cols < stop, other=0.0)
            acc += (w * sc[None, :]) * xs[None, :]
        else:
            acc += w * xs[None, :]
        w = following
    y = _sum(acc, 1)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows * stride_b, mask=row_ok, other=0.0).to(tl.float32)
        if SPLIT:
            y += tl.where(tl.program_id(1) == 0, bias, 0.0)
        else:
            y += bias
    if SPLIT:
        tl.atomic_add(y_ptr + rows * stride_y, y, mask=row_ok)
    else:
        out_dtype = y_ptr.dtype.element_ty
        tl.store(y_ptr + rows * stride_y, _rounded(y, out_dtype).to(out_dtype), mask=row_ok)


@_jit
def linear_many_kernel(x_ptr, w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, s0, s1, s2, s3, n0, n1, n2, n3, sw0, sw1,
                       sw2, sw3, sb0, sb1, sb2, sb3, sy0, sy1, sy2, sy3, ssr0, ssr1, ssr2, ssr3, ssc0, ssc1, ssc2,
                       ssc3, stride_x, H, chunk, NUM: tl.constexpr, END0: tl.constexpr, END1: tl.constexpr,
                       END2: tl.constexpr, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
                       HAS_B3: tl.constexpr, SPLIT: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_H: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr):
    # program p: row block p of the concatenated outputs; weight i holds blocks END(i-1) .. END(i) - 1
    p = tl.program_id(0)
    if PDL:  # the kernel launched after this one may start as this one's programs are all running
        tl.extra.cuda.gdc_launch_dependents()
    if p < END0:
        _rows(x_ptr, stride_x, w0, sw0, b0, sb0, y0, sy0, s0, ssr0, ssc0, n0, H, chunk, p, HAS_B0, SPLIT, EVEN_H,
              BLOCK_N, BLOCK_H, PDL, FP8, SB)
    else:
        if NUM > 1:
            if p < END1:
                _rows(x_ptr, stride_x, w1, sw1, b1, sb1, y1, sy1, s1, ssr1, ssc1, n1, H, chunk, p - END0, HAS_B1,
                      SPLIT, EVEN_H, BLOCK_N, BLOCK_H, PDL, FP8, SB)
            else:
                if NUM > 2:
                    if p < END2:
                        _rows(x_ptr, stride_x, w2, sw2, b2, sb2, y2, sy2, s2, ssr2, ssc2, n2, H, chunk, p - END1,
                              HAS_B2, SPLIT, EVEN_H, BLOCK_N, BLOCK_H, PDL, FP8, SB)
                    else:
                        if NUM > 3:
                            _rows(x_ptr, stride_x, w3, sw3, b3, sb3, y3, sy3, s3, ssr3, ssc3, n3, H, chunk,
                                  p - END2, HAS_B3, SPLIT, EVEN_H, BLOCK_N, BLOCK_H, PDL, FP8, SB)
