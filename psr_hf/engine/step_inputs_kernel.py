"""The Triton source of :class:`psr_hf.engine.step_inputs.GraphStepInputs`' kernel, in a module of its own so
that it is loaded once per mode (compiled, or ``TRITON_INTERPRET=1``); see :mod:`psr_hf.engine.decide_kernel`."""

import triton
import triton.language as tl


@triton.jit
def read_step_inputs_kernel(ring_ptr, counter_ptr, done_ptr, token_ptr, position_ptr, ROWS: tl.constexpr):
    # the step's row of the pinned ring (host memory, read through its unified address, never cached): token, then
    # position, each written to its device buffer unless negative (keep the buffer's value); the step counter
    # advances on the device and is published to the host (done_ptr, pinned) so that the host reuses a row only
    # after the step that read it
    step = tl.load(counter_ptr)
    row = step % ROWS
    token = tl.load(ring_ptr + 2 * row, volatile=True)
    position = tl.load(ring_ptr + 2 * row + 1, volatile=True)
    if token >= 0:
        tl.store(token_ptr, token)
    if position >= 0:
        tl.store(position_ptr, position)
    tl.store(counter_ptr, step + 1)
    tl.store(done_ptr, step + 1)
