"""The Triton source of :mod:`psr_hf.engine.device_copies`' kernel, in a module of its own so that it is loaded
once per mode (compiled, or ``TRITON_INTERPRET=1``); see :mod:`psr_hf.engine.decide_kernel`."""

import triton
import triton.language as tl


@triton.jit
def copy_experts_kernel(copies_ptr, count_at, src_a, dst_a, src_b, dst_b, n_a, n_b, done_ptr, arrivals_ptr, step_ptr,
                        layer, total, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, SIGNAL: tl.constexpr):
    # the list at copies_ptr + count_at: n, then (expert, slot) x n; each pair moves n_a words of weight a and
    # n_b of weight b. Work items (pair, block) are dealt to the programs in turn. SIGNAL: the last of the ``total``
    # programs of the layer's launches to finish writes the step's number into done_ptr[layer]
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
    if SIGNAL:
        arrived = tl.atomic_add(arrivals_ptr + layer, 1, sem="acq_rel")
        if arrived == total - 1:
            tl.atomic_xchg(arrivals_ptr + layer, 0)
            tl.atomic_xchg(done_ptr + layer, tl.load(step_ptr), sem="release")


@triton.jit
def late_prefetch_kernel(done_ptr, step_ptr, copies_ptr, count_at, late_ptr, layer):
    # where the layer is about to wait for its prefetch copies: when they have not all finished in this step, the
    # layer's prefetches (n at copies_ptr + count_at) count as late, and the layer as one that waited
    late = tl.where(tl.atomic_add(done_ptr + layer, 0, sem="acquire") == tl.load(step_ptr), 0,
                    tl.load(copies_ptr + count_at).to(tl.int64))
    tl.store(late_ptr + 2 * layer, tl.load(late_ptr + 2 * layer) + late)
    tl.store(late_ptr + 2 * layer + 1, tl.load(late_ptr + 2 * layer + 1) + (late > 0).to(tl.int64))
