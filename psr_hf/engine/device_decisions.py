"""The logical cache's batch-1 decode step as one GPU kernel, so that the engine's token graph routes without a
host round trip (docs/engine.md, "Routing on the device").

:func:`decide_layer` runs, for MoE layer ``m`` of one decode position, what the engine's host path asks the numba
kernels of :mod:`psr_hf.policy._kernels` for: ``select(m)`` (part 2: the selection, demand insertions and
statistics, ALGORITHM.md steps 3-7) and then ``prefetch(m + 1)`` (part 1 of the next layer from its pre-gate,
step 2). It reads the joint scores the attention graph wrote (``z | g_next``) and the state arrays kept on the
device in the numba kernels' own layout (``[L, 6, E]`` float64 planes and ``[L, 8]`` counters), so that handing the
state over in either direction is a copy. The arithmetic is the numba kernels' in the same order (float64,
fused multiply-adds off), so every decision and every state value is bitwise theirs; the tests check that in
Triton's interpreter on the CPU, for every policy.

Offloaded, it also keeps each layer's slot maps (expert -> slot, slot -> expert) and writes the copies its
insertions need (``(expert, slot)`` lists per layer: the demand copies of ``m`` and the prefetch copies of
``m + 1``), which :mod:`psr_hf.engine.device_copies` carries out inside the same graph. Nothing is read back per
layer: the plans and scores of every position go to a device record that the host reads once per sequence
(:class:`~psr_hf.engine.device_routing.DeviceRouting`).
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch

# the numba kernels' state layout (psr_hf.policy._kernels): planes and counters fields
S_FAST, S_SLOW, LAST_USE, RESIDENT, PROTECTED, INSERTED = range(6)
N_PLANES = 6
R_RANGE_SUM, R_RANGE_COUNT, R_STEP, R_PENDING, R_STEPS, R_PREFETCH, R_DEMAND, R_REPLACED = range(8)
R_SIZE = 8

#: error codes the kernel leaves in its error word (the first one found wins); the host raises on them
ERR_NONE, ERR_SCORES, ERR_TOKEN, ERR_NO_SLOT = 0, 1, 2, 3


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``: CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: whether the engine's own kernels chain as programmatic dependent launches where the GPU has them
#: (:func:`pdl_supported`): off until the token graph's cuda tests have run with it on a GPU
#: (``benchmarks/engine/gpu_pdl_tests.sh`` runs them with it on, in a copy of the package)
PDL_BY_DEFAULT = False


def pdl_supported(device: torch.device) -> bool:
    """Whether a kernel on ``device`` may be launched as a programmatic dependent launch (PDL): compiled (not in
    the interpreter, which runs one kernel at a time) on a GPU of compute capability 9.0 or later (Hopper), whose
    ``griddepcontrol`` instructions the kernels' PDL branches use."""
    return device.type == "cuda" and not interpreting() and _capability(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def triton_module(filename: str, interpret: bool) -> Any:
    """The Triton source ``filename`` of this package loaded as a module of its own for one mode:
    ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, and the interpreter resolves the helpers a kernel
    calls in its module's globals, so a kernel and its helpers must be decorated together in the same mode."""
    stem = filename.rsplit(".", 1)[0]
    name = f"psr_hf.engine._{stem}_" + ("interpreted" if interpret else "compiled")
    return load_triton_file(os.path.join(os.path.dirname(__file__), filename), name, interpret)


def load_triton_file(path: str, name: str, interpret: bool) -> Any:
    """The Python file ``path`` executed as module ``name`` with its ``triton.jit`` kernels decorated for one mode
    (:func:`triton_module` for this package's files; a benchmark reads another build's kernel file with it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


def shared_helpers(available: bool) -> Any:
    """The helpers the kernel files share (``triton_helpers.py``) in the current mode, for a kernel file whose
    ``import triton`` succeeded (``available``); else plain stand-ins (``jit`` returns the function), so that the
    file's torch references still load."""
    if available:
        return triton_module("triton_helpers.py", interpreting())
    return types.SimpleNamespace(jit=lambda fn: fn, reduce_sum=None, reduce_max=None, rounded=None)


def kernel(interpret: bool) -> Any:
    """The decision kernel of :mod:`psr_hf.engine.decide_kernel` for one mode."""
    return triton_module("decide_kernel.py", interpret).decide_kernel


def copy_list_width(top_k: int, budget: int) -> int:
    """Columns of a layer's copy list (int32): ``n_demand | (expert, slot) x K | n_prefetch | (expert, slot) x
    budget``."""
    return 2 + 2 * int(top_k) + 2 * int(budget)


def decide_layer(layer: int, tensors: Any, settings: dict[str, Any]) -> None:
    """Launch the kernel for MoE layer ``layer`` (one program). ``tensors``: a
    :class:`~psr_hf.engine.device_routing.DeviceState` (its device arrays, in the numba layout); ``settings``:
    its :meth:`~psr_hf.engine.device_routing.DeviceState.kernel_settings` (vocabulary, warps, constexprs; the
    policy's floats are ``tensors.params``, float64 in device memory). Capturable: every input is read from
    device memory."""
    t = tensors
    launch = kernel(interpreting())
    launch[(1,)](
        layer, t.scores, t.token, t.position, t.state, t.counters, t.saved, t.delta, t.seen, t.indptr, t.prior_experts,
        t.prior_values, t.fallback, t.ids, t.slot_ids, t.slot_of, t.expert_of, t.copies, t.plans, t.pplans, t.record,
        t.record_plans, t.error, settings["vocab"], t.params,
        **settings["constexprs"], num_warps=settings["num_warps"],
        **({} if interpreting() else {"enable_fp_fusion": False}),
    )
