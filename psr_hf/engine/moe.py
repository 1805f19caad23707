"""The batch-1 MoE over expert slots: one token, its K selected experts read from a layer's slot buffers.

``out = sum_k weights[k] * down[s_k] @ (silu(gate[s_k] @ x) * (up[s_k] @ x))`` with ``s_k = slots[k]``
(``+ residual`` when one is given). The slot buffers are the experts module's own fused weights (transformers
5.x: ``gate_up_proj [E, 2I, H]``, gate rows then up rows; ``down_proj [E, H, I]``) with the experts dimension cut
to the ``C`` slots the offload allocates, so the engine reads the offload's slots in place; for a resident model
the parameters themselves are the slots (slot = expert id). One signature ``(x, slots, weights, gate_up, down,
out, residual=None, workspace=None)`` for :func:`moe_slots_reference` (pure torch, capturable: the reference and
the CPU path), :func:`moe_slots_triton` (two Triton kernels that read every selected expert weight once) and
:func:`moe_slots` (Triton for CUDA tensors when triton imports, the reference otherwise). Nothing is checked per
call: :func:`check_shapes` and :func:`check_experts_module` run once, when the engine is built. ``triton`` is
imported lazily. Page: docs/engine.md, "Inside the engine".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: ``hidden_act`` values whose function is SiLU (``ACT2FN["silu"]`` and ``ACT2FN["swish"]`` in transformers)
SUPPORTED_ACTIVATIONS = ("silu", "swish")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("auto", "triton", "torch")


# ---------------------------------------------------------------------------------------------- checks (once)
@dataclass(frozen=True)
class MoeShape:
    """The sizes one layer's MoE call runs with: hidden ``H``, expert intermediate ``I``, slots ``C``, top ``K``."""

    hidden: int
    intermediate: int
    capacity: int
    top_k: int


def check_activation(config_or_name: Any) -> str:
    """The activation name of a model config (its ``hidden_act``) or of a string; ``ValueError`` unless it is SiLU
    (the only activation the slot MoE computes)."""
    name = config_or_name if isinstance(config_or_name, str) else getattr(config_or_name, "hidden_act", None)
    if not isinstance(name, str) or name.lower() not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"psr_hf engine MoE: hidden_act={name!r} is not supported; the slot MoE computes "
            f"silu(gate) * up (hidden_act one of {', '.join(SUPPORTED_ACTIVATIONS)})"
        )
    return name.lower()


def check_experts_module(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers 5.x experts module whose weights the slot MoE can read: ``(gate_up_proj, down_proj)``.

    ``ValueError`` when the module's layout is not the one described in this module's docstring (transposed or
    interleaved gate/up, biases, no gate, a post-expert norm) or its config's ``hidden_act`` is not SiLU."""
    name = type(module).__name__
    flags = dict(is_transposed=False, is_concatenated=True, has_gate=True, has_bias=False,
                 has_post_expert_norm=False)
    wrong = {flag: getattr(module, flag) for flag, want in flags.items()
             if hasattr(module, flag) and bool(getattr(module, flag)) != want}
    if wrong:
        raise ValueError(
            f"psr_hf engine MoE: {name} has {', '.join(f'{k}={v}' for k, v in wrong.items())}; the slot MoE reads "
            "gate_up_proj [E, 2I, H] (gate rows then up rows, no bias) and down_proj [E, H, I] "
            f"({', '.join(f'{k}={v}' for k, v in flags.items())})"
        )
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ValueError(
            f"psr_hf engine MoE: {name} has no stacked gate_up_proj / down_proj tensors (found "
            f"{type(gate_up).__name__}, {type(down).__name__}); this transformers version or architecture is not "
            "supported by the slot MoE"
        )
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"psr_hf engine MoE: {name} has no config to read hidden_act from")
    check_activation(config)
    _check_weights(gate_up, down)
    return gate_up, down


def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_weights(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int, int]:
    for what, t in (("gate_up", gate_up), ("down", down)):
        if not isinstance(t, torch.Tensor) or t.ndim != 3:
            raise ValueError(f"psr_hf engine MoE: {what} must be a 3D tensor [C, ...]; got {_shape(t)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"psr_hf engine MoE: {what} has dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
    C, two_i, H = gate_up.shape
    if two_i % 2 or two_i == 0:
        raise ValueError(f"psr_hf engine MoE: gate_up {_shape(gate_up)} must be [C, 2I, H] (an even, nonzero 2I)")
    I = two_i // 2
    if tuple(down.shape) != (C, H, I):
        raise ValueError(
            f"psr_hf engine MoE: down {_shape(down)} does not match gate_up {_shape(gate_up)}: expected "
            f"[C, H, I] = {(C, H, I)} (transformers' non-transposed layout)"
        )
    if down.dtype != gate_up.dtype:
        raise ValueError(f"psr_hf engine MoE: gate_up is {gate_up.dtype} but down is {down.dtype}; expected one dtype")
    if gate_up.device != down.device:
        raise ValueError(f"psr_hf engine MoE: gate_up is on {gate_up.device} but down on {down.device}")
    return C, H, I


def check_shapes(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None, hidden_act: Any = "silu") -> MoeShape:
    """Check the buffers of one layer's MoE call (host side, once, when the engine is built; the per-step
    functions check nothing). ``hidden_act``: the name or the model config. ``ValueError`` naming the argument,
    its shape/dtype/device and what was expected."""
    check_activation(hidden_act)
    C, H, I = _check_weights(gate_up, down)
    device = gate_up.device
    for what, t in (("x", x), ("slots", slots), ("weights", weights), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.ndim != 1:
            raise ValueError(f"psr_hf engine MoE: {what} must be a 1D tensor; got {_shape(t)}")
    if x.shape[0] != H:
        raise ValueError(f"psr_hf engine MoE: x {_shape(x)} must be [H] = [{H}] (gate_up is {_shape(gate_up)})")
    if out.shape[0] != H:
        raise ValueError(f"psr_hf engine MoE: out {_shape(out)} must be [H] = [{H}]")
    K = slots.shape[0]
    if K < 1:
        raise ValueError("psr_hf engine MoE: slots is empty; expected [K] slot ids, K >= 1")
    if weights.shape[0] != K:
        raise ValueError(f"psr_hf engine MoE: weights {_shape(weights)} must be [K] = [{K}] like slots")
    if slots.dtype not in INDEX_DTYPES:
        raise ValueError(f"psr_hf engine MoE: slots has dtype {slots.dtype}; expected int32 or int64 slot ids")
    for what, t in (("x", x), ("weights", weights), ("out", out)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"psr_hf engine MoE: {what} has dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
    if residual is not None and (not isinstance(residual, torch.Tensor) or tuple(residual.shape) != (H,)
                                 or residual.dtype not in FLOAT_DTYPES):
        got = f"{_shape(residual)} {residual.dtype}" if isinstance(residual, torch.Tensor) else _shape(residual)
        raise ValueError(f"psr_hf engine MoE: residual must be a float [H] = [{H}] tensor; got {got}")
    if workspace is not None:
        if (not isinstance(workspace, torch.Tensor) or tuple(workspace.shape) != (K, I)
                or workspace.dtype != torch.float32 or not workspace.is_contiguous()):
            raise ValueError(f"psr_hf engine MoE: workspace must be a contiguous float32 [K, I] = [{K}, {I}] tensor "
                             f"(new_workspace()); got {_shape(workspace)}")
    named = [("x", x), ("slots", slots), ("weights", weights), ("out", out), ("residual", residual),
             ("workspace", workspace)]
    elsewhere = [f"{what} on {t.device}" for what, t in named if t is not None and t.device != device]
    if elsewhere:
        raise ValueError(f"psr_hf engine MoE: every tensor must be on the weights' device {device}; "
                         f"{', '.join(elsewhere)}")
    return MoeShape(hidden=H, intermediate=I, capacity=C, top_k=K)


def new_workspace(top_k: int, intermediate: int, device: torch.device | str) -> torch.Tensor:
    """The Triton path's scratch ``h`` ``[K, I]`` float32 (allocate once per engine, pass as ``workspace=``)."""
    return torch.empty((top_k, intermediate), dtype=torch.float32, device=device)


class SoftmaxRouting(NamedTuple):
    """A softmax router's weights, computed by the slot MoE itself instead of beforehand (on the Triton path, the
    two launches of the compiled weights fewer per layer): ``logits [E]`` the router's unmodified logits, ``ids
    [K]`` the selected experts' ids (not their slots), ``normalize`` whether the weights are renormalised over
    the K."""

    logits: torch.Tensor
    ids: torch.Tensor
    normalize: bool


def softmax_weights(softmax: SoftmaxRouting, out: torch.Tensor) -> torch.Tensor:
    """``out [K]``: softmax over the logits in float32, gathered at the ids, renormalised when asked, in ``out``'s
    dtype (transformers' softmax routers' steps; the Triton kernel computes the same in its own summation order)."""
    probs = torch.softmax(softmax.logits.float(), dim=-1).gather(0, softmax.ids)
    if softmax.normalize:
        probs = probs / probs.sum()
    return out.copy_(probs)


# ---------------------------------------------------------------------------------------------- reference
def moe_slots_reference(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                        workspace: torch.Tensor | None = None, *,
                        softmax: SoftmaxRouting | None = None) -> torch.Tensor:
    """Pure torch: ``index_select`` the K slots, batched matmuls in the weights' dtype (as transformers'
    experts run), SiLU, the product and the weighted sum over ``k`` in float32. No host syncs, fixed shapes
    (CUDA-graph capturable). Writes ``out`` (``residual + moe`` when ``residual`` is given; ``residual`` may be
    ``out`` itself) and returns it. ``workspace`` is accepted for the common signature and not used; ``softmax``:
    the weights computed first from a softmax router's logits (:func:`softmax_weights`) into ``weights``."""
    del workspace
    if softmax is not None:
        softmax_weights(softmax, weights)
    dtype = gate_up.dtype
    I = gate_up.shape[1] // 2
    gu = torch.matmul(gate_up.index_select(0, slots), x.to(dtype))  # [K, 2I]
    gate, up = gu[:, :I].float(), gu[:, I:].float()
    h = (F.silu(gate) * up).to(dtype)  # [K, I], rounded to the weights' dtype like transformers' experts
    y = torch.matmul(down.index_select(0, slots), h.unsqueeze(-1)).squeeze(-1)  # [K, H]
    moe = torch.matmul(weights.float(), y.float())  # [H] float32, a fixed-order reduction over k
    if residual is not None:
        moe = moe + residual.float()
    return out.copy_(moe)


# ---------------------------------------------------------------------------------------------- triton
@functools.lru_cache(maxsize=None)
def triton_available() -> tuple[bool, str]:
    """``(True, "triton X.Y")`` when triton imports, else ``(False, why)`` (cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, f"triton {getattr(triton, '__version__', '?')}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two jitted kernels, built on first use. ``triton.jit`` decides at decoration time whether a kernel
    runs in the interpreter (``TRITON_INTERPRET=1``), so the kernels are built once per mode.

    The kernels call only triton's builtins (``tl.full``, ``tl.exp``, ``tl.reduce`` with the standard library's
    sum combine function, which the interpreter recognises by identity), not the ``@jit`` functions of
    ``triton.language.standard`` (``tl.zeros``, ``tl.sum``, ``tl.sigmoid``): those are compiled-only objects when
    triton was imported without ``TRITON_INTERPRET=1``, so the interpreter could not call them, and a test
    session that switches the interpreter on after importing triton would fail. They name nothing from this
    function's scope but ``tl`` (the interpreter runs a kernel's rewritten source in the module's globals, to
    which it adds its own ``tl``, so closure variables are not visible there)."""
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda: the programmatic dependent launch's waits)

    @triton.jit
    def gate_up_kernel(x_ptr, slots_ptr, weights_ptr, gu_ptr, h_ptr, logits_ptr, ids_ptr, H, I, E, K, stride_x,
                       stride_s, stride_w, stride_l, stride_i, stride_ge, stride_gr, stride_gc,
                       BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr, SOFTMAX: tl.constexpr,
                       NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (k, block of I): h[k, rows] = weights[k] * silu(gate_rows . x) * (up_rows . x), float32;
        # SOFTMAX: weights[k] from a softmax router's logits first (written into weights by the programs (k, 0))
        if PDL:  # a programmatic dependent launch: the next kernel may start; wait for the one before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        k = tl.program_id(0)
        if SOFTMAX:
            # softmax over the E logits in float32, gathered at the K selected experts' ids, renormalised over them
            # when NORMALIZE, rounded to the weights' dtype (softmax_execution_weights' steps)
            e = tl.arange(0, BLOCK_E)
            every = tl.load(logits_ptr + e * stride_l, mask=e < E, other=float("-inf")).to(tl.float32)
            top = tl.reduce(every, 0, tl.standard._elementwise_max)
            total = tl.reduce(tl.exp(every - top), 0, tl.standard._sum_combine)
            j = tl.arange(0, BLOCK_K)
            ids = tl.load(ids_ptr + j * stride_i, mask=j < K, other=0).to(tl.int64)
            chosen = tl.load(logits_ptr + ids * stride_l, mask=j < K, other=float("-inf")).to(tl.float32)
            probs = tl.exp(chosen - top) / total
            if NORMALIZE:
                probs = probs / tl.reduce(probs, 0, tl.standard._sum_combine)
            rounded = probs.to(weights_ptr.dtype.element_ty)
            w = tl.reduce(tl.where(j == k, rounded.to(tl.float32), 0.0), 0, tl.standard._sum_combine)
            if tl.program_id(1) == 0:
                tl.store(weights_ptr + k * stride_w, w.to(weights_ptr.dtype.element_ty))
        else:
            w = tl.load(weights_ptr + k * stride_w).to(tl.float32)
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        row_ok = rows < I
        slot = tl.load(slots_ptr + k * stride_s).to(tl.int64)
        gate_rows = gu_ptr + slot * stride_ge + rows.to(tl.int64)[:, None] * stride_gr
        up_rows = gate_rows + I * stride_gr
        acc_g = tl.full((BLOCK_I, BLOCK_H), 0.0, tl.float32)
        acc_u = tl.full((BLOCK_I, BLOCK_H), 0.0, tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            xv = tl.load(x_ptr + cols * stride_x, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            # the experts' weights are read once per token: first out of L2, so that they do not evict the
            # small state the step's other kernels read again (decision state, activations, norms)
            g = tl.load(gate_rows + cols[None, :] * stride_gc, mask=ok, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            u = tl.load(up_rows + cols[None, :] * stride_gc, mask=ok, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            acc_g += g * xv
            acc_u += u * xv
        gate = tl.reduce(acc_g, 1, tl.standard._sum_combine)
        up = tl.reduce(acc_u, 1, tl.standard._sum_combine)
        h = gate / (1.0 + tl.exp(-gate)) * up * w  # silu(gate) * up * weight
        tl.store(h_ptr + k * I + rows, h, mask=row_ok)

    @triton.jit
    def down_kernel(h_ptr, slots_ptr, dn_ptr, out_ptr, res_ptr, H, I, K, stride_s, stride_de, stride_dr, stride_dc,
                    stride_o, stride_r, HAS_RESIDUAL: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
                    UNROLL: tl.constexpr, PDL: tl.constexpr):
        # program (block of H): out[rows] = (residual[rows] +) sum_k down[s_k, rows, :] . h[k, :], float32;
        # UNROLL: the loop over k unrolled by that factor, so that several experts' loads can be in flight
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
        row_ok = rows < H
        acc = tl.full((BLOCK_O, BLOCK_I), 0.0, tl.float32)
        for k in tl.range(0, K, loop_unroll_factor=UNROLL):
            slot = tl.load(slots_ptr + k * stride_s).to(tl.int64)
            base = dn_ptr + slot * stride_de + rows.to(tl.int64)[:, None] * stride_dr
            for start in range(0, I, BLOCK_I):
                cols = start + tl.arange(0, BLOCK_I)
                col_ok = cols < I
                hv = tl.load(h_ptr + k * I + cols, mask=col_ok, other=0.0)
                d = tl.load(base + cols[None, :] * stride_dc, mask=row_ok[:, None] & col_ok[None, :],
                            other=0.0, eviction_policy="evict_first").to(tl.float32)
                acc += d * hv[None, :]
        y = tl.reduce(acc, 1, tl.standard._sum_combine)
        if HAS_RESIDUAL:
            y += tl.load(res_ptr + rows * stride_r, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows * stride_o, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    return gate_up_kernel, down_kernel


def _cdiv(n: int, block: int) -> int:
    return -(-int(n) // int(block))


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


#: the keys of a tile configuration (:func:`triton_blocks`): kernel 1's rows of gate and of up per program, its
#: columns per loop step, its warps and software-pipelining stages; kernel 2's output rows per program, its columns
#: per loop step, warps, stages and the unroll factor of its loop over the K experts (1: not unrolled); and PDL, 1 for
#: programmatic dependent launches of both (Hopper and later; the same as 0 in triton's interpreter)
BLOCK_KEYS = ("BLOCK_I1", "BLOCK_H1", "WARPS1", "STAGES1", "BLOCK_O2", "BLOCK_I2", "WARPS2", "STAGES2", "UNROLL2",
              "PDL")


@functools.lru_cache(maxsize=None)
def triton_blocks(hidden: int, intermediate: int) -> dict[str, int]:
    """Tile sizes, fixed (no autotuning: a tile decides the float32 sums' order, so a choice made by timing at run
    time would make outputs depend on timing), chosen for H=2048 with I=1024 (OLMoE-1B-7B) or I=1408 (Moonlight),
    K 6-8, bf16 weights, so that both kernels have 500+ programs (about 4 per SM of an H100/H200, all resident at
    once) and each program keeps 8-16 KiB of weight loads in flight per step:

    - kernel 1 (gate/up): ``BLOCK_I1`` = 16 rows of gate and of up per program times ``BLOCK_H1`` = 256 columns
      per step (grid K x I/16: 512 programs for OLMoE, 528 for Moonlight; 8 KiB of bf16 per matrix per step);
    - kernel 2 (down): ``BLOCK_O2`` = 4 output rows per program times ``BLOCK_I2`` = 1024 columns per step
      (grid H/4 = 512 programs; 8 KiB of bf16 per step; I=1408 takes two steps, the second 3/8 used).

    Warps 4, stages 3 (triton's default for CUDA) for both, kernel 2's loop over k not unrolled.
    ``benchmarks/engine/moe_tiles_bench.py`` times other tiles. Smaller dimensions (tiny test models) get the next
    power of two above them."""
    H, I = int(hidden), int(intermediate)
    return dict(BLOCK_I1=min(16, _pow2(I)), BLOCK_H1=min(256, _pow2(H)), WARPS1=4, STAGES1=3,
                BLOCK_O2=min(4, _pow2(H)), BLOCK_I2=min(1024, _pow2(I)), WARPS2=4, STAGES2=3, UNROLL2=1, PDL=0)


def shape_key(hidden: int, intermediate: int, top_k: int) -> str:
    """The shape's key in the tuned tiles' table (:mod:`psr_hf.engine.tuned_tiles`)."""
    return f"H{int(hidden)}_I{int(intermediate)}_K{int(top_k)}"


@functools.lru_cache(maxsize=None)
def chosen_blocks(hidden: int, intermediate: int, top_k: int, device: torch.device) -> dict[str, int]:
    """The tiles :func:`moe_slots_triton` runs with: those measured best for this GPU model and shape where the
    shipped table has them (:mod:`psr_hf.engine.tuned_tiles`), else :func:`triton_blocks`', launched as
    programmatic dependent launches (the second kernel starts while the first finishes) where the GPU has them and
    ``device_decisions.PDL_BY_DEFAULT`` is on."""
    from .device_decisions import PDL_BY_DEFAULT, pdl_supported
    from .tuned_tiles import lookup

    pdl = PDL_BY_DEFAULT and pdl_supported(torch.device(device))
    default = {**triton_blocks(hidden, intermediate), "PDL": int(pdl)}
    tuned = lookup("slot_moe", torch.device(device), shape_key(hidden, intermediate, top_k))
    return check_blocks({**default, **tuned}) if tuned else default


def check_blocks(blocks: dict[str, int]) -> dict[str, int]:
    """``blocks`` when its keys are :data:`BLOCK_KEYS` and every value is a power of two (stages: any count from
    1); ``ValueError`` otherwise."""
    if set(blocks) != set(BLOCK_KEYS):
        raise ValueError(f"psr_hf engine MoE: blocks {sorted(blocks)}; expected the keys {list(BLOCK_KEYS)}")
    bad = [f"{key}={value}" for key, value in blocks.items()
           if not isinstance(value, int) or (key == "PDL" and value not in (0, 1))
           or (key != "PDL" and (value < 1 or (not key.startswith("STAGES") and value & (value - 1))))]
    if bad:
        raise ValueError(f"psr_hf engine MoE: blocks {', '.join(bad)}; block sizes, warps and the unroll factor must be "
                         "powers of two, stages at least 1, PDL 0 or 1")
    return blocks


def triton_prologue(what: str, fallback: str, x: torch.Tensor, slots: torch.Tensor, gate_up: torch.Tensor,
                    out: torch.Tensor, residual: torch.Tensor | None, workspace: torch.Tensor | None
                    ) -> tuple[bool, int, int, int, torch.Tensor, torch.Tensor, contextlib.AbstractContextManager]:
    """What both slot MoEs' Triton launches check and set up: ``(interpret, H, I, K, h, res, guard)``, where ``h``
    is the ``[K, I]`` float32 scratch (``workspace`` or a new one), ``res`` the residual or ``out`` (not read
    without one) and ``guard`` makes the tensors' CUDA device current (triton launches on the current one).
    ``ImportError`` without triton, ``ValueError`` for CPU tensors outside the interpreter, naming ``fallback``."""
    ok, why = triton_available()
    if not ok:
        raise ImportError(f"{what}: {why}; install triton or use {fallback}")
    interpret = _interpreting()
    if not (x.is_cuda or interpret):
        raise ValueError(f"{what}: the Triton kernels need CUDA tensors (got {x.device}; on the CPU they run only in "
                         f"triton's interpreter, TRITON_INTERPRET=1); use {fallback}")
    _, two_i, H = gate_up.shape
    I, K = two_i // 2, slots.shape[0]
    h = workspace if workspace is not None else new_workspace(K, I, x.device)
    res = residual if residual is not None else out
    guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    return interpret, H, I, K, h, res, guard


def _pdl(blocks: dict[str, int], device: torch.device) -> dict[str, Any]:
    """The kernels' PDL constexpr and launch option (off where PDL is not supported: the interpreter, which runs
    one kernel at a time, and GPUs before Hopper)."""
    from .device_decisions import pdl_supported

    pdl = bool(blocks["PDL"]) and pdl_supported(device)
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


def launch_gate_up(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   h: torch.Tensor, blocks: dict[str, int], interpret: bool,
                   softmax: SoftmaxRouting | None = None) -> None:
    """Kernel 1 alone: ``h[k] = weights[k] * silu(gate) * up`` (``h`` the float32 ``[K, I]`` workspace), with the
    tiles ``blocks`` (:data:`BLOCK_KEYS`); on the current device; with ``softmax``, the weights computed first from
    the router's logits and written into ``weights``. :func:`moe_slots_triton` launches it, and benchmarks time it
    by itself."""
    _, two_i, H = gate_up.shape
    I, K = two_i // 2, slots.shape[0]
    gate_up_kernel, _ = _kernels(interpret)
    logits, ids = (softmax.logits, softmax.ids) if softmax is not None else (weights, slots)  # unread without
    E = logits.shape[0]
    gate_up_kernel[(K, _cdiv(I, blocks["BLOCK_I1"]))](
        x, slots, weights, gate_up, h, logits, ids, H, I, E, K, x.stride(0), slots.stride(0), weights.stride(0),
        logits.stride(0), ids.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        BLOCK_I=blocks["BLOCK_I1"], BLOCK_H=blocks["BLOCK_H1"], **_pdl(blocks, x.device),
        SOFTMAX=softmax is not None, NORMALIZE=softmax is not None and softmax.normalize,
        BLOCK_E=_pow2(E), BLOCK_K=_pow2(K),
        num_warps=blocks["WARPS1"], num_stages=blocks["STAGES1"], enable_fp_fusion=True)


def launch_down(h: torch.Tensor, slots: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None, blocks: dict[str, int], interpret: bool) -> None:
    """Kernel 2 alone: ``out = (residual +) sum_k down[s_k] @ h[k]``, with the tiles ``blocks``; on the current
    device (see :func:`launch_gate_up`)."""
    _, H, I = down.shape
    K = slots.shape[0]
    res = residual if residual is not None else out
    _, down_kernel = _kernels(interpret)
    down_kernel[(_cdiv(H, blocks["BLOCK_O2"]),)](
        h, slots, down, out, res, H, I, K, slots.stride(0), down.stride(0), down.stride(1), down.stride(2),
        out.stride(0), res.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_O=blocks["BLOCK_O2"], BLOCK_I=blocks["BLOCK_I2"],
        UNROLL=blocks["UNROLL2"], **_pdl(blocks, h.device), num_warps=blocks["WARPS2"], num_stages=blocks["STAGES2"],
        enable_fp_fusion=True)


def moe_slots_triton(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None, *, blocks: dict[str, int] | None = None,
                     softmax: SoftmaxRouting | None = None) -> torch.Tensor:
    """Two Triton kernels: kernel 1 the gate and up rows of a block of ``I`` per selected expert, ``h[k] =
    weights[k] * silu(gate) * up``; kernel 2 a block of ``H`` outputs, summed over ``k`` and ``I``. Float32
    accumulation throughout, every selected weight read once; the slot ids and routing weights are read from
    device memory, so it is capturable (the first call JIT-compiles: call it once before capture). CUDA tensors,
    or CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter, for tests). ``workspace``: the float32 ``[K, I]``
    scratch (:func:`new_workspace`; allocated per call when None); ``blocks``: tiles other than
    :func:`chosen_blocks`' (:func:`check_blocks`; for benchmarks); ``softmax``: kernel 1 computes the weights from a
    softmax router's logits (:class:`SoftmaxRouting`) and writes them into ``weights``. Writes and returns ``out``.
    ``ImportError`` when triton is not installed."""
    interpret, H, I, K, h, _, guard = triton_prologue("psr_hf engine MoE", "moe_slots_reference", x, slots,
                                                         gate_up, out, residual, workspace)
    b = check_blocks(blocks) if blocks is not None else chosen_blocks(H, I, K, x.device)
    with guard:
        launch_gate_up(x, slots, weights, gate_up, h, b, interpret, softmax)
        launch_down(h, slots, down, out, residual, b, interpret)
    return out


# ---------------------------------------------------------------------------------------------- dispatcher
_LOGGED: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


def choose_backend(device: torch.device | str, backend: str = "auto") -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (the engine may call this once at build and then
    call the chosen function directly). ``backend="auto"``: Triton on CUDA when triton imports, else the torch
    reference, the reason logged once; ``"triton"`` / ``"torch"`` force one (``ValueError`` for ``"triton"``
    without triton)."""
    if backend not in BACKENDS:
        raise ValueError(f"psr_hf engine MoE: backend={backend!r}; expected one of {BACKENDS}")
    ok, why = triton_available()
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not ok:
            raise ValueError(f"psr_hf engine MoE: backend='triton' but {why}")
        return "triton"
    if torch.device(device).type != "cuda":
        _log_once(logging.INFO, f"psr_hf engine MoE: torch reference on {torch.device(device).type} "
                                "(the Triton kernels run on CUDA)")
        return "torch"
    if not ok:
        _log_once(logging.WARNING, f"psr_hf engine MoE: torch reference on CUDA because {why} (slower: it copies "
                                   "the selected experts' weights every step)")
        return "torch"
    _log_once(logging.INFO, f"psr_hf engine MoE: Triton slot kernels ({why})")
    return "triton"


_FUNCTIONS = {"torch": moe_slots_reference, "triton": moe_slots_triton}


def moe_slots(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
              workspace: torch.Tensor | None = None, backend: str = "auto",
              softmax: SoftmaxRouting | None = None) -> torch.Tensor:
    """The batch-1 slot MoE by :func:`choose_backend`; writes and returns ``out`` (and, with ``softmax``, the
    weights into ``weights``)."""
    return _FUNCTIONS[choose_backend(x.device, backend)](x, slots, weights, gate_up, down, out, residual, workspace,
                                                         softmax=softmax)
