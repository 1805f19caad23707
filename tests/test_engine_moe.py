"""The engine's batch-1 MoE over expert slots (``psr_hf/engine/moe.py``).

The torch reference is checked against a naive per-expert loop and against the transformers experts module itself
(the tiny OLMoE and DeepSeek-V3 layers: the slot layout is the module's own), and on the offload engine's slot
buffers in place. The Triton kernels are checked against the reference in triton's interpreter on the CPU
(``TRITON_INTERPRET=1``; skipped when triton is not installed) and, in copies marked ``cuda``, on a GPU.

Tolerances (``|a - b| <= atol + rtol * |b|`` elementwise, ``atol`` scaled by ``max|b|``), with the largest error
measured on this machine (max |a - b| / max |b|; the Triton figures from its interpreter, up to the real sizes
H=2048, I=1024, K=8 and I=1408, K=6 in a one-off run):

- float32, reference vs the float64 loop and vs transformers, Triton vs the reference: rtol 1e-5, atol 5e-6
  (measured 3e-7, 2.3e-7 and 1e-6);
- Triton on bf16 weights (float32 accumulation, float32 out) vs the reference on the same values upcast to
  float32, where only the summation order differs: rtol 1e-4, atol 1e-5 (measured 1e-6);
- bf16 out, Triton vs the reference in bf16 (the reference rounds ``gate_up @ x``, ``h`` and ``down @ h`` to bf16
  as transformers does, both round ``out``), the reference in bf16 vs transformers in bf16 (which also rounds each
  expert's weighted output) and Triton bf16 vs the float32 truth: rtol 2e-2, atol 1e-2 (measured 5e-3, 9e-3 and
  5e-3).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.engine import moe
from psr_hf.engine.moe import (
    SoftmaxRouting,
    check_activation,
    check_experts_module,
    check_shapes,
    choose_backend,
    moe_slots,
    moe_slots_reference,
    moe_slots_triton,
    new_workspace,
    softmax_weights,
    triton_available,
)
from psr_hf.patches import get_patch
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HAS_TRITON, TRITON_WHY = triton_available()
needs_triton = pytest.mark.skipif(
    not HAS_TRITON,
    reason=f"{TRITON_WHY}: the Triton kernel tests need `pip install triton` (on CPU they run in its interpreter)",
)


def compiled_on_cuda(test):
    """The marks of a test of the compiled kernels: run on the lent GPU (marked cuda), skipped without one or
    without triton."""
    for mark in (pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"), pytest.mark.cuda,
                 needs_triton, pytest.mark.usefixtures("compiled")):
        test = mark(test)
    return test


def _close(actual, expected, rtol, atol):
    """assert_close with ``atol`` relative to the expected output's largest magnitude."""
    expected = expected.float()
    scale = max(expected.abs().max().item(), 1e-30)
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=atol * scale)


def _data(H, I, C, K, dtype=torch.float32, device="cpu", seed=0, slots=None):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(C, 2 * I, H, generator=g) / H**0.5).to(dtype).to(device)
    down = (torch.randn(C, H, I, generator=g) / I**0.5).to(dtype).to(device)
    x = torch.randn(H, generator=g).to(dtype).to(device)
    if slots is None:
        slots = torch.randperm(C, generator=g)[:K]  # distinct, in no particular order
    slots = torch.as_tensor(slots, dtype=torch.int64).to(device)
    weights = torch.rand(len(slots), generator=g).to(device)
    return x, slots, weights, gate_up, down


def _loop(x, slots, weights, gate_up, down, residual=None):
    """The definition, one expert at a time, in float64."""
    I = gate_up.shape[1] // 2
    out = torch.zeros(gate_up.shape[2], dtype=torch.float64)
    for k, s in enumerate(slots.tolist()):
        w = gate_up[s].double()
        h = F.silu(w[:I] @ x.double()) * (w[I:] @ x.double())
        out += float(weights[k]) * (down[s].double() @ h)
    return out if residual is None else out + residual.double()


# ---------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("H, I, C, K, slots", [
    (64, 32, 16, 4, None),  # tiny model sizes
    (48, 20, 9, 1, [7]),  # K = 1
    (48, 20, 9, 9, [3, 8, 0, 5, 1, 7, 2, 6, 4]),  # K = C: every slot, shuffled
    (40, 24, 12, 5, [11, 2, 9, 0, 6]),  # non-contiguous, descending and ascending runs
])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_equals_a_per_expert_loop(H, I, C, K, slots, index_dtype, with_residual):
    x, slots, weights, gate_up, down = _data(H, I, C, K, slots=slots)
    slots = slots.to(index_dtype)
    residual = torch.randn(H) if with_residual else None
    out = torch.full((H,), float("nan"))
    assert check_shapes(x, slots, weights, gate_up, down, out, residual) == moe.MoeShape(H, I, C, K)
    got = moe_slots_reference(x, slots, weights, gate_up, down, out, residual)
    assert got is out
    _close(out, _loop(x, slots, weights, gate_up, down, residual), rtol=1e-5, atol=5e-6)


def test_reference_accumulates_into_the_residual_in_place_and_sums_duplicate_slots():
    """``residual=out`` adds the MoE to ``out``; a slot named twice counts twice (the engine's selections are
    duplicate-free, the computation does not rely on it)."""
    x, _, _, gate_up, down = _data(32, 16, 6, 3)
    slots, weights = torch.tensor([4, 1, 4]), torch.tensor([0.5, 0.25, 0.125])
    out = torch.randn(32)
    before = out.clone()
    moe_slots_reference(x, slots, weights, gate_up, down, out, residual=out)
    _close(out, _loop(x, slots, weights, gate_up, down, before), rtol=1e-5, atol=5e-6)
    merged = _loop(x, torch.tensor([4, 1]), torch.tensor([0.625, 0.25]), gate_up, down, before)
    _close(out, merged, rtol=1e-5, atol=5e-6)


def test_reference_in_bf16_stays_close_to_the_float64_definition():
    x, slots, weights, gate_up, down = _data(256, 128, 16, 8, dtype=torch.bfloat16)
    out = torch.empty(256, dtype=torch.bfloat16)
    moe_slots_reference(x, slots, weights, gate_up, down, out)
    _close(out, _loop(x, slots, weights, gate_up, down), rtol=2e-2, atol=1e-2)


def _experts(family, dtype=torch.float32, **overrides):
    model = tiny_model(family, dtype=dtype, **overrides)
    return model, get_patch(family)(model).moe_layers()[0].block.experts


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_transformers_experts_module(family, dtype):
    """Same token, same selection, same weights: the HF experts module (the model's own implementation) and the
    reference on the module's ``gate_up_proj`` / ``down_proj`` as slot buffers (resident model: C = E)."""
    model, experts = _experts(family, dtype)
    gate_up, down = check_experts_module(experts)
    E, K, H = experts.num_experts, model.config.num_experts_per_tok, model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    for trial in range(4):
        x = torch.randn(H, generator=g).to(dtype)
        chosen = torch.randperm(E, generator=g)[:K]
        weights = torch.rand(K, generator=g) * (2.5 if family == "deepseek_v3" else 1.0)
        with torch.no_grad():
            want = experts(x[None], chosen[None], weights.to(dtype)[None])[0]
        out = torch.empty(H, dtype=dtype)
        check_shapes(x, chosen, weights, gate_up, down, out, hidden_act=model.config)
        with torch.no_grad():
            moe_slots_reference(x, chosen, weights.to(dtype), gate_up, down, out)
        if dtype == torch.float32:
            _close(out, want, rtol=1e-5, atol=5e-6)
        else:  # transformers rounds each expert's output to bf16 before its weighted sum; the reference does not
            _close(out, want, rtol=2e-2, atol=1e-2)


def test_reference_reads_the_offload_engines_slots_in_place(quiet_psr_hf):
    """The offload engine's slot buffers (``OffloadedExperts.slots[layer]``) are the layout: the reference on the
    slots holding the selection equals the reference on the host store (the parameters) by expert id, bitwise."""
    model = tiny_model("olmoe")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    psr_hf.patch(model, RoutingConfig(policy="exact", eviction="lru", budget=0, residency=0.5),
                 offload=OffloadConfig(device="cpu"))
    try:
        with torch.no_grad():
            model(ids)
        engine = psr_hf.controller(model).offload
        engine.link.synchronize()
        H = model.config.hidden_size
        for layer in range(engine.num_layers):
            mapping = engine.scheduler.layers[layer].expert_slot  # expert -> slot (-1: not on the device)
            held = torch.from_numpy(mapping).ge(0).nonzero().flatten()
            chosen = held[torch.randperm(len(held), generator=torch.Generator().manual_seed(layer))][:4]
            slots = torch.from_numpy(mapping)[chosen]
            weights = torch.rand(len(chosen), generator=torch.Generator().manual_seed(layer))
            x = torch.randn(H, generator=torch.Generator().manual_seed(layer))
            buffers, store = engine.slots[layer], engine.placement.store[layer]
            out = torch.empty(H)
            check_shapes(x, slots, weights, buffers["gate_up_proj"], buffers["down_proj"], out)
            from_slots = moe_slots_reference(x, slots, weights, buffers["gate_up_proj"], buffers["down_proj"], out)
            from_store = moe_slots_reference(x, chosen, weights, store["gate_up_proj"], store["down_proj"],
                                             torch.empty(H))
            assert torch.equal(from_slots, from_store)
            expert = engine.modules[layer]
            assert buffers["gate_up_proj"].shape[1:] == expert.gate_up_proj.shape[1:]
            assert buffers["down_proj"].shape[1:] == expert.down_proj.shape[1:]
    finally:
        psr_hf.unpatch(model)


# ---------------------------------------------------------------------------------------------- checks
def _good():
    x, slots, weights, gate_up, down = _data(16, 8, 6, 3)
    return dict(x=x, slots=slots, weights=weights, gate_up=gate_up, down=down, out=torch.empty(16))


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.empty(15)), r"x \(15,\) must be \[H\] = \[16\]"),
    (dict(x=torch.empty(1, 16)), r"x must be a 1D tensor; got \(1, 16\)"),
    (dict(x=torch.empty(16, dtype=torch.int64)), "x has dtype torch.int64"),
    (dict(out=torch.empty(8)), r"out \(8,\) must be \[H\] = \[16\]"),
    (dict(slots=torch.zeros(3)), "slots has dtype torch.float32; expected int32 or int64"),
    (dict(slots=torch.zeros(0, dtype=torch.int64), weights=torch.zeros(0)), "slots is empty"),
    (dict(weights=torch.zeros(4)), r"weights \(4,\) must be \[K\] = \[3\]"),
    (dict(gate_up=torch.empty(6, 15, 16)), r"gate_up \(6, 15, 16\) must be \[C, 2I, H\]"),
    (dict(gate_up=torch.empty(16, 6)), r"gate_up must be a 3D tensor \[C, \.\.\.\]; got \(16, 6\)"),
    (dict(down=torch.empty(6, 8, 16)), r"expected \[C, H, I\] = \(6, 16, 8\)"),  # transposed down
    (dict(down=torch.empty(6, 16, 8, dtype=torch.bfloat16)), "gate_up is torch.float32 but down is torch.bfloat16"),
    (dict(gate_up=torch.empty(6, 16, 16, dtype=torch.int8), down=torch.empty(6, 16, 8, dtype=torch.int8)),
     "gate_up has dtype torch.int8"),
    (dict(residual=torch.empty(12)), r"residual must be a float \[H\] = \[16\] tensor; got \(12,\)"),
    (dict(workspace=torch.empty(3, 8, dtype=torch.bfloat16)), r"workspace must be a contiguous float32 \[K, I\]"),
    (dict(x=torch.empty(16, device="meta")), "every tensor must be on the weights' device cpu; x on meta"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_bad_shapes_and_dtypes_are_clear_value_errors(change, message):
    kwargs = {**_good(), **change}
    with pytest.raises(ValueError, match=message):
        check_shapes(**kwargs)


def test_good_buffers_pass_with_a_workspace_and_a_config():
    kwargs = _good()
    shape = check_shapes(**kwargs, residual=torch.empty(16, dtype=torch.bfloat16), workspace=new_workspace(3, 8, "cpu"),
                         hidden_act=SimpleNamespace(hidden_act="silu"))
    assert (shape.hidden, shape.intermediate, shape.capacity, shape.top_k) == (16, 8, 6, 3)
    assert check_activation("swish") == "swish"


def test_experts_modules_with_another_layout_or_activation_are_refused():
    _, experts = _experts("olmoe")
    check_experts_module(experts)
    fake = SimpleNamespace(gate_up_proj=experts.gate_up_proj, down_proj=experts.down_proj,
                           config=SimpleNamespace(hidden_act="silu"), is_transposed=True, has_bias=False)
    with pytest.raises(ValueError, match="has is_transposed=True; the slot MoE reads gate_up_proj"):
        check_experts_module(fake)
    fake.is_transposed, fake.config.hidden_act = False, "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="hidden_act='gelu_pytorch_tanh' is not supported"):
        check_experts_module(fake)
    fake.config.hidden_act, fake.down_proj = "silu", None
    with pytest.raises(ValueError, match="no stacked gate_up_proj / down_proj"):
        check_experts_module(fake)
    with pytest.raises(ValueError, match="hidden_act='relu' is not supported"):
        check_experts_module(_experts("olmoe", hidden_act="relu")[1])


# ---------------------------------------------------------------------------------------------- dispatcher
def test_dispatcher_uses_the_reference_off_cuda_and_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(moe, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="psr_hf.engine.moe")
    x, slots, weights, gate_up, down = _data(32, 16, 8, 4)
    want = moe_slots_reference(x, slots, weights, gate_up, down, torch.empty(32))
    for _ in range(3):
        assert torch.equal(moe_slots(x, slots, weights, gate_up, down, torch.empty(32)), want)
    said = [r.getMessage() for r in caplog.records if r.name == "psr_hf.engine.moe"]
    assert said == ["psr_hf engine MoE: torch reference on cpu (the Triton kernels run on CUDA)"]


def test_backend_choice_on_cuda_with_and_without_triton(monkeypatch, caplog):
    monkeypatch.setattr(moe, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="psr_hf.engine.moe")
    monkeypatch.setattr(moe, "triton_available", lambda: (False, "triton is not importable (ImportError: x)"))
    assert choose_backend("cuda") == "torch"
    assert choose_backend("cuda:0") == "torch"
    assert choose_backend("cpu", "torch") == "torch"
    with pytest.raises(ValueError, match="backend='triton' but triton is not importable"):
        choose_backend("cuda", "triton")
    with pytest.raises(ValueError, match="backend='cutlass'; expected one of"):
        choose_backend("cuda", "cutlass")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "torch reference on CUDA because triton is not importable" in warned[0].getMessage()
    monkeypatch.setattr(moe, "triton_available", lambda: (True, "triton 9.9"))
    assert choose_backend("cuda") == "triton"
    assert choose_backend("cpu") == "torch"
    assert choose_backend("cpu", "triton") == "triton"


def test_the_module_imports_without_triton():
    code = ("import sys; import psr_hf.engine.moe as m; assert 'triton' not in sys.modules, 'triton imported'; "
            "m.moe_slots")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


# ---------------------------------------------------------------------------------------------- triton
# (H, I, C, K, slots): tiny model sizes; masked tails in both kernels (H=266: two 256-column steps in kernel 1 and
# a 2-row last output block in kernel 2; I=136: a half 16-row block in kernel 1, a partial column step in kernel 2);
# I=1100: two 1024-column steps in kernel 2; K=1; K=C in shuffled order
TRITON_CASES = [
    (64, 32, 16, 4, None),
    (266, 136, 10, 3, [9, 0, 4]),
    (20, 1100, 4, 2, [2, 0]),
    (48, 16, 5, 1, [3]),
    (64, 48, 6, 6, [5, 3, 1, 0, 4, 2]),
]
TRITON_IDS = ["tiny", "tails", "long_i", "k1", "k_eq_c"]


def _triton_matches_reference(device, H, I, C, K, slots, weight_dtype):
    x, slots, weights, gate_up, down = _data(H, I, C, K, dtype=weight_dtype, device=device, seed=H + I, slots=slots)
    ref32 = moe_slots_reference(x.float(), slots, weights, gate_up.float(), down.float(),
                                torch.empty(H, device=device))
    out = torch.full((H,), float("nan"), device=device)
    work = new_workspace(len(slots), I, device)
    check_shapes(x, slots.to(torch.int32), weights, gate_up, down, out, workspace=work)
    assert moe_slots_triton(x, slots.to(torch.int32), weights, gate_up, down, out, workspace=work) is out
    if weight_dtype == torch.float32:
        _close(out, ref32, rtol=1e-5, atol=5e-6)
    else:
        _close(out, ref32, rtol=1e-4, atol=1e-5)  # same bf16 values, float32 arithmetic in both
        out16 = moe_slots_triton(x, slots, weights, gate_up, down, torch.empty(H, dtype=weight_dtype, device=device))
        ref16 = moe_slots_reference(x, slots, weights, gate_up, down, torch.empty(H, dtype=weight_dtype, device=device))
        _close(out16, ref16, rtol=2e-2, atol=1e-2)
    # a residual, accumulated in place; slots and weights changed in their device buffers are read again
    residual = torch.randn(H, device=device)
    acc = residual.clone()
    moe_slots_triton(x, slots, weights, gate_up, down, acc, residual=acc, workspace=work)
    _close(acc, ref32 + residual, rtol=1e-4, atol=1e-5)
    slots.copy_(slots.flip(0))  # the same (slot, weight) pairs in the opposite order, weights scaled
    weights.copy_(weights.flip(0) * -0.5)
    moe_slots_triton(x, slots, weights, gate_up, down, out, workspace=work)
    _close(out, ref32 * -0.5, rtol=1e-4, atol=1e-5)


def _strided_inputs_match(device):
    """Non-contiguous x, slots, weights and out (strides are kernel arguments)."""
    x, slots, weights, gate_up, down = _data(64, 32, 12, 4, device=device)
    xs = torch.stack((x, torch.zeros_like(x)), 1)[:, 0]
    ss = torch.stack((slots, torch.zeros_like(slots)), 1)[:, 0]
    ws = torch.stack((weights, torch.zeros_like(weights)), 1)[:, 0]
    big = torch.zeros(64, 3, device=device)
    moe_slots_triton(xs, ss, ws, gate_up, down, big[:, 1])
    want = moe_slots_reference(x, slots, weights, gate_up, down, torch.empty(64, device=device))
    _close(big[:, 1], want, rtol=1e-5, atol=5e-6)
    assert big[:, 0].eq(0).all() and big[:, 2].eq(0).all()


def _softmax_weights_in_the_kernel(device, E, K, normalize, dtype):
    """The slot MoE given a softmax router's logits computes the weights in its first kernel: into the weights
    buffer (softmax_weights' values within a few float32 ulps, or one bf16 rounding step) and the output the
    reference gives with them."""
    H, I = 64, 32
    x, slots, _, gate_up, down = _data(H, I, E, K, dtype=dtype, device=device, seed=E + K)
    g = torch.Generator().manual_seed(E * K)
    logits = (3 * torch.randn(E, generator=g)).to(dtype).to(device)
    ids = slots.clone()  # resident: the slot of an expert is its id
    routing = SoftmaxRouting(logits, ids, normalize)
    want_weights = softmax_weights(routing, torch.empty(K, dtype=dtype, device=device))
    probs = torch.softmax(logits.double(), dim=-1)[ids]
    truth = probs / probs.sum() if normalize else probs
    _close(want_weights, truth, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    weights = torch.full((K,), float("nan"), dtype=dtype, device=device)
    out = torch.empty(H, dtype=torch.float32, device=device)
    moe_slots_triton(x, slots, weights, gate_up, down, out, softmax=routing)
    if dtype == torch.float32:  # a few ulps: the summation order, and the compiled exp's own rounding
        _close(weights, want_weights, rtol=1e-5, atol=0)
    else:  # the same float32 values but for the summation order, then one rounding: equal or one step apart
        assert ((weights.float() - want_weights.float()).abs() <= want_weights.float().abs() / 128).all()
    want = moe_slots_reference(x.float(), slots, weights, gate_up.float(), down.float(), torch.empty(H, device=device))
    _close(out, want, rtol=1e-4, atol=1e-5)
    ref_weights = torch.full((K,), float("nan"), dtype=dtype, device=device)
    moe_slots_reference(x, slots, ref_weights, gate_up, down, torch.empty(H, dtype=dtype, device=device),
                        softmax=routing)  # the reference computes them first, as softmax_weights does
    assert torch.equal(ref_weights, want_weights)


SOFTMAX_CASES = [(16, 4, False, torch.float32), (64, 8, False, torch.bfloat16), (60, 8, True, torch.bfloat16),
                 (9, 9, True, torch.float32)]


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("E, K, normalize, dtype", SOFTMAX_CASES)
def test_triton_interpreted_computes_a_softmax_routers_weights_itself(E, K, normalize, dtype):
    _softmax_weights_in_the_kernel("cpu", E, K, normalize, dtype)


@compiled_on_cuda
@pytest.mark.parametrize("E, K, normalize, dtype", SOFTMAX_CASES)
def test_triton_on_cuda_computes_a_softmax_routers_weights_itself(E, K, normalize, dtype):
    _softmax_weights_in_the_kernel("cuda", E, K, normalize, dtype)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, I, C, K, slots", TRITON_CASES, ids=TRITON_IDS)
def test_triton_interpreted_matches_the_reference(H, I, C, K, slots, weight_dtype):
    _triton_matches_reference("cpu", H, I, C, K, slots, weight_dtype)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_triton_interpreted_takes_strided_inputs():
    _strided_inputs_match("cpu")


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_triton_interpreted_equals_the_transformers_experts_module(family):
    model, experts = _experts(family)
    E, K, H = experts.num_experts, model.config.num_experts_per_tok, model.config.hidden_size
    x, chosen, weights = torch.randn(H), torch.randperm(E)[:K], torch.rand(K)
    with torch.no_grad():
        want = experts(x[None], chosen[None], weights[None])[0]
        got = moe_slots_triton(x, chosen, weights, experts.gate_up_proj, experts.down_proj, torch.empty(H))
    _close(got, want, rtol=1e-5, atol=5e-6)


def _tiles_agree(device):
    """Other tiles give the same MoE up to the float32 sums' order; pipeline stages, kernel 2's unroll of its loop
    over k and programmatic dependent launches keep that order, so they give the same bits (warps change how a
    tile's sum is split over threads)."""
    H, I, C, K = 64, 48, 6, 3
    x, slots, weights, gate_up, down = _data(H, I, C, K, device=device, slots=[4, 1, 2])
    default = moe.triton_blocks(H, I)
    want = moe_slots_triton(x, slots, weights, gate_up, down, torch.empty(H, device=device))
    same_order = {**default, "STAGES1": 1, "STAGES2": 2, "UNROLL2": 4, "PDL": 1}
    got = moe_slots_triton(x, slots, weights, gate_up, down, torch.empty(H, device=device), blocks=same_order)
    assert torch.equal(got, want)
    other = {**default, "BLOCK_I1": 8, "BLOCK_H1": 32, "WARPS1": 8, "BLOCK_O2": 16, "BLOCK_I2": 32, "WARPS2": 2,
             "UNROLL2": 2}
    got = moe_slots_triton(x, slots, weights, gate_up, down, torch.empty(H, device=device), blocks=other)
    _close(got, want, rtol=1e-5, atol=5e-6)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_triton_interpreted_tiles_change_only_the_sums_order():
    _tiles_agree("cpu")


@pytest.mark.parametrize("change, message", [
    ({"BLOCK_O2": 3}, "BLOCK_O2=3"),
    ({"UNROLL2": 0}, "UNROLL2=0"),
    ({"STAGES1": 0}, "STAGES1=0"),
    ({"num_warps": 4}, "expected the keys"),
])
def test_bad_tiles_are_clear_value_errors(change, message):
    blocks = {**moe.triton_blocks(2048, 1024), **change}
    with pytest.raises(ValueError, match=message):
        moe.check_blocks(blocks)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_tiles_benchmark_runs_on_the_cpu_and_keeps_a_failing_tile(tmp_path):
    from module_files import ROOT, load_module

    bench = load_module("moe_tiles_bench", ROOT / "benchmarks" / "engine" / "moe_tiles_bench.py")
    path = tmp_path / "tiles.json"
    bench.main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--rounds", "2", "--replays", "1",
                "--tiles1", "8,64,4,1", "16,32,8,3", "--tiles2", "4,64,4,1,1", "3,64,4,1,1", "--json", str(path)])
    record = json.loads(path.read_text())
    assert [row["tile"]["BLOCK_O2"] for row in record["down"]][-1] == 3  # the failing tile, last
    assert "powers of two" in record["down"][-1]["error"]
    for row in record["gate_up"] + record["down"][:1]:
        assert row["median"] > 0 and row["difference"] < 1e-5
    assert moe.check_blocks(record["chosen"]) == record["chosen"]
    assert record["chosen"]["BLOCK_H1"] in (64, 32)
    assert set(record["both"]) == {"default", "chosen", "chosen_pdl"} and record["both"]["chosen_pdl"]["blocks"]["PDL"]
    assert len(record["both"]["chosen"]["over_default"]["rounds"]) == 2


@needs_triton
@pytest.mark.usefixtures("compiled")
def test_triton_refuses_cpu_tensors_outside_the_interpreter():
    x, slots, weights, gate_up, down = _data(16, 8, 4, 2)
    with pytest.raises(ValueError, match="the Triton kernels need CUDA tensors"):
        moe_slots_triton(x, slots, weights, gate_up, down, torch.empty(16))


# the same tests compiled for the GPU (marked cuda: run on the lent GPU)
@compiled_on_cuda
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H, I, C, K, slots", TRITON_CASES, ids=TRITON_IDS)
def test_triton_on_cuda_matches_the_reference(H, I, C, K, slots, weight_dtype):
    _triton_matches_reference("cuda", H, I, C, K, slots, weight_dtype)


@compiled_on_cuda
def test_triton_on_cuda_takes_strided_inputs():
    _strided_inputs_match("cuda")


@compiled_on_cuda
def test_triton_on_cuda_tiles_change_only_the_sums_order():
    _tiles_agree("cuda")


@compiled_on_cuda
@pytest.mark.parametrize("H, I, E, K", [(2048, 1024, 64, 8), (2048, 1408, 64, 6)], ids=["olmoe", "moonlight"])
def test_triton_on_cuda_at_real_sizes_in_a_cuda_graph(H, I, E, K):
    """OLMoE-1B-7B and Moonlight sizes in bf16, captured in a CUDA graph with the reference: new slot ids and
    weights written into the captured device buffers are read by the replay (no host sync, no recapture)."""
    device = "cuda"
    x, slots, weights, gate_up, down = _data(H, I, E, K, dtype=torch.bfloat16, device=device, seed=7)
    slots = slots.to(torch.int32)
    out, ref, work = (torch.empty(H, dtype=torch.bfloat16, device=device),
                      torch.empty(H, dtype=torch.bfloat16, device=device), new_workspace(K, I, device))
    check_shapes(x, slots, weights, gate_up, down, out, workspace=work)
    moe_slots_triton(x, slots, weights, gate_up, down, out, workspace=work)  # compile before capture
    moe_slots_reference(x, slots, weights, gate_up, down, ref)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_slots_triton(x, slots, weights, gate_up, down, out, workspace=work)
        moe_slots_reference(x, slots, weights, gate_up, down, ref)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        slots.copy_(torch.randperm(E, generator=g)[:K].to(torch.int32))
        weights.copy_(torch.rand(K, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        want = moe_slots_reference(x.float(), slots, weights, gate_up.float(), down.float(),
                                   torch.empty(H, device=device))
        _close(out, want, rtol=2e-2, atol=1e-2)
        _close(out, ref, rtol=2e-2, atol=1e-2)
