"""The Triton source of :mod:`psr_hf.engine.device_copies`' kernel, in a module of its own so that it is loaded
once per mode (compiled, or ``TRITON_INTERPRET=1``); see :mod:`psr_hf.engine.decide_kernel`."""

import triton
import triton.language as tl


@triton.jit
def copy_experts_kernel(copies_ptr, count_at, src_a, dst_a, src_b, dst_b, n_a, n_b, PROGRAMS: tl.constexpr,
                        BLOCK: tl.constexpr):
    # the list at copies_ptr + count_at: n, then (expert, slot) x n; each pair moves n_a words of weight a and
    # n_b of weight b. Work items (pair, block) are dealt to the programs in turn.
    n = tl.load(copies_ptr + count_at)
    blocks_a = (n_a + BLOCK - 1) // BLOCK
    blocks_b = (n_b + BLOCK - 1) // BLOCK
    per_pair = blocks_a + blocks_b
    offs = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), n * per_pair, PROGRAMS):
        pair = item // per_pair
        block = item - pair * per_pair
        expert = tl.load(copies_ptr + count_at + 1 + 2 * pair).to(tl.int64)
        slot = tl.load(copies_ptr + count_at + 2 + 2 * pair).to(tl.int64)
        if block < blocks_a:
            words = block * BLOCK + offs
            ok = words < n_a
            v = tl.load(src_a + expert * n_a + words, mask=ok)
            tl.store(dst_a + slot * n_a + words, v, mask=ok)
        else:
            words = (block - blocks_a) * BLOCK + offs
            ok = words < n_b
            v = tl.load(src_b + expert * n_b + words, mask=ok)
            tl.store(dst_b + slot * n_b + words, v, mask=ok)
