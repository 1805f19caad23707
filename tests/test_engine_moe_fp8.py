"""The engine's batch-1 MoE over FP8 expert slots (``psr_hf/engine/moe_fp8.py``).

Test weights are quantized by ``psr-hf quantize``'s block math (:mod:`psr_hf.assets.fp8_blocks`), one matrix per
expert and projection as a checkpoint holds them (gate, up and down of each expert apart, one scale per 128 x 128
block, partial blocks at the edges), and each block is scaled by its own power of two first, so that a scale read
from the wrong block changes the output by a factor, never by noise. The torch reference is held bitwise to
:func:`~psr_hf.engine.moe.moe_slots_reference` on weights dequantized by that module, per matrix, independently of
the engine's fused layout (so the fused scale layout is checked, not assumed). The Triton kernels are
checked against the reference in triton's interpreter on the CPU and, in copies marked ``cuda``, on a GPU.

Tolerances (``|a - b| <= atol + rtol * |b|`` elementwise, ``atol`` scaled by ``max|b|``, as in
tests/test_engine_moe.py), for Triton against the reference:

- float32 out against the reference in float32 (x float32, or bf16 x upcast, which is exact): both multiply the
  same FP8 values by the same float32 scales (one float32 product per weight, as the reference's dequantization)
  and the same x, so only the float32 summation order over H and I, the routing weight's place (the kernels fold
  it into ``h``) and the kernels' fused multiply-adds differ: a few float32 roundings (2^-24 = 6e-8) per term,
  growing like the square root of the ~H terms summed. rtol 1e-5, atol 5e-6 (the bf16/float32 kernels' figures);
  largest |a - b| / max|b| measured 4.7e-7 on these cases in the interpreter, 8.2e-7 and 6.8e-7 at the real sizes
  (H=2048, I=1024 and 512, K=8) in a one-off interpreter run;
- bf16 out against the reference in bf16, which rounds the dequantized weights, ``gate_up @ x``, ``h`` and
  ``down @ h`` to bf16 as transformers' experts do while the kernels keep float32 to the end: rtol 2e-2, atol
  1e-2 (the bf16 kernels' figures; bf16 keeps 8 bits, 2^-9 = 2e-3 per rounding, a few roundings deep); largest
  |a - b| / max|b| measured 1.2e-2 (on an element large enough for the rtol term), 5.5e-3 at the real sizes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test_engine_moe import _close, needs_triton

from psr_hf.assets.fp8_blocks import dequantize_blocks, quantize_blocks
from psr_hf.engine import moe
from psr_hf.engine.moe import moe_slots_reference, new_workspace
from psr_hf.engine.moe_fp8 import (
    check_blocks,
    check_fp8_shapes,
    fp8_triton_blocks,
    moe_slots_fp8,
    moe_slots_fp8_reference,
    moe_slots_fp8_triton,
    scale_shapes,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = torch.float8_e4m3fn
BLOCK = 128


# ---------------------------------------------------------------------------------------------- test weights
def _matrix(E, R, S, g, device):
    """Random ``[E, R, S]`` of variance 1/S, each 128 x 128 block times its own power of two (1/8 to 8)."""
    w = torch.randn(E, R, S, generator=g) / S**0.5
    factors = 2.0 ** torch.randint(-3, 4, (E, -(-R // BLOCK), -(-S // BLOCK)), generator=g).float()
    w = w * factors.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :R, :S]
    return w.to(device)


def _fp8_slots(H, I, C, device="cpu", seed=0):
    """Slot buffers in the engine's fused layout, and the same weights dequantized per matrix (float32)."""
    g = torch.Generator().manual_seed(seed)
    (gq, gs), (uq, us), (dq, ds) = (quantize_blocks(_matrix(C, *size, g, device)) for size in ((I, H), (I, H), (H, I)))
    return SimpleNamespace(
        gate_up=torch.cat((gq, uq), 1), gate_up_scale=torch.cat((gs, us), 1), down=dq, down_scale=ds,
        gate_up_deq=torch.cat((dequantize_blocks(gq, gs), dequantize_blocks(uq, us)), 1),
        down_deq=dequantize_blocks(dq, ds))


def _inputs(H, C, K, dtype=torch.float32, device="cpu", seed=0, slots=None):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(H, generator=g).to(dtype).to(device)
    slots = torch.randperm(C, generator=g)[:K] if slots is None else torch.as_tensor(slots)
    return x, slots.to(torch.int64).to(device), torch.rand(len(slots), generator=g).to(device)


def _args(w):
    return w.gate_up, w.gate_up_scale, w.down, w.down_scale


# ---------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("H, I, C, K, slots", [
    (256, 192, 6, 2, [4, 1]),  # a partial block row of I in gate, in up and in down's columns
    (200, 64, 5, 3, None),  # a partial block column of H, I under one block
    (64, 32, 4, 4, [2, 0, 3, 1]),  # K = C, shuffled
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_is_bitwise_the_bf16_reference_on_dequantized_weights(H, I, C, K, slots, dtype, index_dtype,
                                                                         with_residual):
    w = _fp8_slots(H, I, C, seed=H + I)
    x, slots, weights = _inputs(H, C, K, dtype, slots=slots)
    slots = slots.to(index_dtype)
    residual = torch.randn(H).to(dtype) if with_residual else None
    out = torch.full((H,), float("nan"), dtype=dtype)
    assert check_fp8_shapes(x, slots, weights, *_args(w), out, residual) == moe.MoeShape(H, I, C, K)
    assert moe_slots_fp8_reference(x, slots, weights, *_args(w), out, residual) is out
    want = moe_slots_reference(x, slots, weights, w.gate_up_deq.to(dtype), w.down_deq.to(dtype),
                               torch.empty(H, dtype=dtype), residual)
    assert torch.equal(out, want)


def test_reference_misses_when_up_reads_gates_scales():
    """The fixture's block factors make the fused scale layout observable: with I = 192 (two block rows per
    matrix), reading up's rows by ``r // 128`` of the fused matrix (no gap after gate's partial block row) gives
    another output."""
    H, I, C = 256, 192, 3
    w = _fp8_slots(H, I, C, seed=5)
    x, slots, weights = _inputs(H, C, 2)
    got = moe_slots_fp8_reference(x, slots, weights, *_args(w), torch.empty(H))
    naive = w.gate_up_scale[:, [0, 1, 2]].repeat_interleave(BLOCK, 1)[:, :2 * I].repeat_interleave(BLOCK, 2)
    wrong = moe_slots_reference(x, slots, weights, w.gate_up.float() * naive[:, :, :H], w.down_deq, torch.empty(H))
    assert (got - wrong).abs().max() > 0.1 * got.abs().max()


# ---------------------------------------------------------------------------------------------- checks
def _good():
    w = _fp8_slots(256, 192, 6, seed=2)
    x, slots, weights = _inputs(256, 6, 2)
    return dict(x=x, slots=slots, weights=weights, gate_up=w.gate_up, gate_up_scale=w.gate_up_scale, down=w.down,
                down_scale=w.down_scale, out=torch.empty(256))


@pytest.mark.parametrize("change, message", [
    (dict(gate_up=torch.zeros(6, 384, 256, dtype=torch.bfloat16)),
     r"gate_up has dtype torch.bfloat16; expected torch.float8_e4m3fn"),
    (dict(down=torch.zeros(6, 256, 192, dtype=torch.float8_e5m2)), "down has dtype torch.float8_e5m2"),
    (dict(down=torch.zeros(6, 192, 256, dtype=FP8)), r"expected \[C, H, I\] = \(6, 256, 192\)"),
    (dict(gate_up=torch.zeros(384, 256, dtype=FP8)), r"gate_up must be a 3D tensor \[C, \.\.\.\]; got \(384, 256\)"),
    (dict(gate_up_scale=torch.ones(6, 3, 2)),  # ceil(2I/128) rows: gate's partial block row not kept apart
     r"gate_up_scale must be a float32 \[C, 2 \* ceil\(I/128\), ceil\(H/128\)\] \(gate's block rows, then up's\) = "
     r"\(6, 4, 2\) tensor .*got \(6, 3, 2\) torch.float32"),
    (dict(gate_up_scale=torch.ones(6, 4, 2, dtype=torch.bfloat16)), r"got \(6, 4, 2\) torch.bfloat16"),
    (dict(down_scale=torch.ones(6, 2, 1)), r"down_scale must be a float32 \[C, ceil\(H/128\), ceil\(I/128\)\] = "
                                           r"\(6, 2, 2\)"),
    (dict(down_scale=None), r"down_scale must be .* got NoneType"),
    (dict(down_scale=torch.ones(6, 2, 2, device="meta")), "down_scale is on meta but the weights on cpu"),
    (dict(slots=torch.zeros(2)), "slots has dtype torch.float32; expected int32 or int64"),
    (dict(x=torch.empty(128)), r"x \(128,\) must be \[H\] = \[256\]"),
    (dict(x=torch.empty(256, dtype=torch.float64)), "x has dtype torch.float64; expected one of"),
    (dict(workspace=torch.empty(2, 192, dtype=torch.bfloat16)), r"workspace must be a contiguous float32 \[K, I\]"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_bad_fp8_buffers_are_clear_value_errors(change, message):
    with pytest.raises(ValueError, match=message):
        check_fp8_shapes(**{**_good(), **change})


def test_scale_shapes_keep_gate_and_up_block_rows_apart():
    assert scale_shapes(2048, 1024) == ((16, 16), (16, 8))
    assert scale_shapes(2048, 1408) == ((22, 16), (16, 11))
    assert scale_shapes(256, 192) == ((4, 2), (2, 2))  # not ceil(384/128) = 3


@pytest.mark.parametrize("change, message", [
    (dict(BLOCK_H1=256), "BLOCK_H1=256; every size must be a power of two and BLOCK_I1, BLOCK_H1, BLOCK_O2 must "
                         "divide 128"),
    (dict(BLOCK_I2=96), "BLOCK_I2=96"),
    (dict(extra=1), r"expected the keys \['BLOCK_H1', 'BLOCK_I1', 'BLOCK_I2', 'BLOCK_O2', 'num_warps'\]"),
])
def test_bad_tile_sizes_are_clear_value_errors(change, message):
    blocks = {**fp8_triton_blocks(2048, 1024), **change}
    with pytest.raises(ValueError, match=message):
        check_blocks(blocks)
    assert check_blocks(fp8_triton_blocks(2048, 512)) == dict(BLOCK_I1=16, BLOCK_H1=128, BLOCK_O2=4, BLOCK_I2=512,
                                                              num_warps=4)


# ---------------------------------------------------------------------------------------------- dispatcher
def test_dispatcher_uses_the_reference_off_cuda(monkeypatch, caplog):
    monkeypatch.setattr(moe, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="psr_hf.engine.moe")
    w = _fp8_slots(64, 32, 4, seed=3)
    x, slots, weights = _inputs(64, 4, 2, torch.bfloat16)
    want = moe_slots_fp8_reference(x, slots, weights, *_args(w), torch.empty(64))
    assert torch.equal(moe_slots_fp8(x, slots, weights, *_args(w), torch.empty(64)), want)
    assert torch.equal(moe_slots_fp8(x, slots, weights, *_args(w), torch.empty(64), backend="torch"), want)
    said = [r.getMessage() for r in caplog.records if r.name == "psr_hf.engine.moe"]
    assert said == ["psr_hf engine MoE: torch reference on cpu (the Triton kernels run on CUDA)"]


def test_the_module_imports_without_triton():
    code = ("import sys; import psr_hf.engine.moe_fp8 as m; assert 'triton' not in sys.modules, 'triton imported'; "
            "m.moe_slots_fp8")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


# ---------------------------------------------------------------------------------------------- triton
SMALL_TILES = dict(BLOCK_I1=8, BLOCK_H1=64, BLOCK_O2=4, BLOCK_I2=64, num_warps=4)
# (H, I, C, K, slots, blocks): a partial block row of I (gate's and up's); a partial block column of H, a masked
# column step in kernel 1 and I under one block; K = 1; small tiles: two column steps per scale block in kernel 1
# (the last masked), kernel 2's column steps crossing block boundaries and partial blocks in both; K = C shuffled
TRITON_CASES = [
    (256, 192, 6, 2, [4, 1], None),
    (200, 64, 5, 3, None, None),
    (96, 160, 4, 1, [3], None),
    (160, 160, 4, 2, [0, 3], SMALL_TILES),
    (64, 32, 4, 4, [2, 0, 3, 1], None),
]
TRITON_IDS = ["partial_i", "partial_h", "k1", "small_tiles", "k_eq_c"]


def _triton_matches_reference(device, H, I, C, K, slots, blocks, dtype):
    w = _fp8_slots(H, I, C, device=device, seed=H + I)
    x, slots, weights = _inputs(H, C, K, dtype, device, slots=slots)
    run = lambda *a, **kw: moe_slots_fp8_triton(*a, **kw, blocks=blocks)  # noqa: E731
    ref32 = moe_slots_fp8_reference(x.float(), slots, weights, *_args(w), torch.empty(H, device=device))
    out, work = torch.full((H,), float("nan"), device=device), new_workspace(K, I, device)
    check_fp8_shapes(x, slots.to(torch.int32), weights, *_args(w), out, workspace=work)
    assert run(x, slots.to(torch.int32), weights, *_args(w), out, workspace=work) is out
    _close(out, ref32, rtol=1e-5, atol=5e-6)
    if dtype == torch.bfloat16:
        out16 = run(x, slots, weights, *_args(w), torch.empty(H, dtype=dtype, device=device))
        ref16 = moe_slots_fp8_reference(x, slots, weights, *_args(w), torch.empty(H, dtype=dtype, device=device))
        _close(out16, ref16, rtol=2e-2, atol=1e-2)
    residual = torch.randn(H, device=device)  # accumulated in place
    acc = residual.clone()
    run(x, slots, weights, *_args(w), acc, residual=acc, workspace=work)
    _close(acc, ref32 + residual, rtol=1e-5, atol=5e-6)
    slots.copy_(slots.flip(0))  # new slot ids and weights in the same device buffers are read again
    weights.copy_(weights.flip(0) * -0.5)
    run(x, slots, weights, *_args(w), out, workspace=work)
    _close(out, ref32 * -0.5, rtol=1e-5, atol=5e-6)


def _strided_inputs_match(device):
    """Non-contiguous x, slots, weights, scales and out (strides are kernel arguments)."""
    w = _fp8_slots(128, 64, 5, device=device, seed=9)
    x, slots, weights = _inputs(128, 5, 3, device=device)
    spread = lambda t: torch.stack((t, torch.zeros_like(t)), -1)[..., 0]  # noqa: E731
    big = torch.zeros(128, 3, device=device)
    moe_slots_fp8_triton(spread(x), spread(slots), spread(weights), w.gate_up, spread(w.gate_up_scale), w.down,
                         spread(w.down_scale), big[:, 1])
    want = moe_slots_fp8_reference(x, slots, weights, *_args(w), torch.empty(128, device=device))
    _close(big[:, 1], want, rtol=1e-5, atol=5e-6)
    assert big[:, 0].eq(0).all() and big[:, 2].eq(0).all()


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, I, C, K, slots, blocks", TRITON_CASES, ids=TRITON_IDS)
def test_triton_interpreted_matches_the_reference(H, I, C, K, slots, blocks, dtype):
    _triton_matches_reference("cpu", H, I, C, K, slots, blocks, dtype)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_triton_interpreted_takes_strided_inputs():
    _strided_inputs_match("cpu")


@needs_triton
@pytest.mark.usefixtures("compiled")
def test_triton_refuses_cpu_tensors_outside_the_interpreter():
    w = _fp8_slots(64, 32, 4)
    x, slots, weights = _inputs(64, 4, 2)
    with pytest.raises(ValueError, match="the Triton kernels need CUDA tensors"):
        moe_slots_fp8_triton(x, slots, weights, *_args(w), torch.empty(64))


# the same tests compiled for the GPU (marked cuda: run on the lent GPU)
@pytest.mark.usefixtures("compiled")
@needs_triton
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, I, C, K, slots, blocks", TRITON_CASES, ids=TRITON_IDS)
def test_triton_on_cuda_matches_the_reference(H, I, C, K, slots, blocks, dtype):
    _triton_matches_reference("cuda", H, I, C, K, slots, blocks, dtype)


@pytest.mark.usefixtures("compiled")
@needs_triton
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_triton_on_cuda_takes_strided_inputs():
    _strided_inputs_match("cuda")


@pytest.mark.usefixtures("compiled")
@needs_triton
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("H, I, C, K", [(2048, 1024, 64, 8), (2048, 512, 128, 8)], ids=["olmoe", "qwen36"])
def test_triton_on_cuda_at_real_sizes_in_a_cuda_graph(H, I, C, K):
    """OLMoE-1B-7B and Qwen3.6-35B-A3B sizes, bf16 x, captured in one CUDA graph with the reference (which is
    so shown capturable): new slot ids and weights written into the captured buffers are read by the replay."""
    device = "cuda"
    w = _fp8_slots(H, I, C, device=device, seed=7)
    x, slots, weights = _inputs(H, C, K, torch.bfloat16, device)
    slots = slots.to(torch.int32)
    out, out32, ref = (torch.empty(H, dtype=torch.bfloat16, device=device), torch.empty(H, device=device),
                       torch.empty(H, dtype=torch.bfloat16, device=device))
    work = new_workspace(K, I, device)
    check_fp8_shapes(x, slots, weights, *_args(w), out, workspace=work)
    calls = lambda: (moe_slots_fp8_triton(x, slots, weights, *_args(w), out, workspace=work),  # noqa: E731
                     moe_slots_fp8_triton(x, slots, weights, *_args(w), out32, workspace=work),
                     moe_slots_fp8_reference(x, slots, weights, *_args(w), ref))
    calls()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        slots.copy_(torch.randperm(C, generator=g)[:K].to(torch.int32))
        weights.copy_(torch.rand(K, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        want = moe_slots_fp8_reference(x.float(), slots, weights, *_args(w), torch.empty(H, device=device))
        _close(out32, want, rtol=1e-5, atol=5e-6)
        _close(out, want, rtol=2e-2, atol=1e-2)
        _close(ref, want, rtol=2e-2, atol=1e-2)
