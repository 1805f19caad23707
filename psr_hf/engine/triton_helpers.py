"""The Triton helpers the engine's kernel files share (:mod:`~psr_hf.engine.gemv_kernel`,
:mod:`~psr_hf.engine.decode_attention_kernel`, :mod:`~psr_hf.engine.gated_delta_kernel`). ``triton.jit`` decides at
decoration whether a function runs in the interpreter, so each kernel file loads this one in its own mode
(:func:`~psr_hf.engine.device_decisions.triton_module`), never by a plain import.
"""

from __future__ import annotations

from typing import Any

try:  # optional (the dev extra, the GPU machine)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def jit(fn: Any) -> Any:
    """``triton.jit``, or ``fn`` itself where triton does not import (the torch references still load)."""
    return triton.jit(fn) if triton is not None else fn


@jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@jit
def rounded(x, dtype: tl.constexpr):
    # float32 x rounded to dtype (to nearest even, as torch casts), returned as float32; Triton's interpreter
    # truncates a float32 to bfloat16 cast, so bfloat16 is rounded on the bits
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)
