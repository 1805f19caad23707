"""The fused batch-1 GEMV (psr_hf.engine.gemv_kernel.linear_many: several weights, one launch) against F.linear per
weight, in Triton's interpreter on the CPU (and compiled on a GPU, marked cuda): 1, 3 and 4 weights of unequal
rows (not multiples of the row block, over an H not a multiple of the column block), float32 within float32
rounding and bfloat16 within one rounding step of the float32 product, biases, ``[H]`` and ``[1, H]`` inputs, a
weight that is a row slice of a larger tensor, the H split, the custom op, and the inputs it refuses; and block-wise
FP8 weights with their scales (a fine-grained FP8 checkpoint's), against the float32 product on the dequantized
weights."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from psr_hf.assets.fp8_blocks import dequantize_blocks, quantize_blocks
from psr_hf.engine.gemv_kernel import DEFAULT_SMS, PROGRAMS_PER_SM, default_blocks, linear_many, linear_many_reference
from psr_hf.engine.moe import triton_available

TRITON_OK, TRITON_WHY = triton_available()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"{TRITON_WHY}: `make` installs triton where it has wheels")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

H = 200  # not a multiple of any column block
ROWS = (48, 40, 17, 33)  # 17 and 33: not multiples of any row block; the last weight is a row slice
OLMOE_QKV = (2048, 2048, 2048)


def _problem(count: int, dtype: torch.dtype, bias: bool, device: str = "cpu", hidden: int = H,
             rows: tuple = ROWS, seed: int = 0) -> tuple[torch.Tensor, tuple, tuple | None]:
    """x [hidden] and ``count`` weights scaled so that every output is about unit scale; the last of 3 or 4 weights
    is rows 5 .. of a larger tensor (its row stride is the larger tensor's)."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(n, hidden, generator=g) / hidden ** 0.5).to(device=device, dtype=dtype)
               for n in rows[:count]]
    if count >= 3:
        parent = (torch.randn(rows[count - 1] + 9, hidden + 24, generator=g) / hidden ** 0.5).to(device, dtype)
        weights[-1] = parent[5:5 + rows[count - 1], :hidden]  # row stride hidden + 24
    weights = tuple(weights)
    biases = tuple(None if i == 1 else torch.randn(n, generator=g).to(device=device, dtype=dtype)
                   for i, n in enumerate(rows[:count])) if bias else None  # the second weight has none
    x = torch.randn(hidden, generator=g).to(device=device, dtype=dtype)
    return x, weights, biases


def _check(got: tuple, x: torch.Tensor, weights: tuple, biases: tuple | None) -> None:
    """Each output is [1, N_i] in x's dtype and equals the float32 product within float32 rounding (float32) or
    within one rounding step of it (bfloat16: one ulp, 2 ** -7 relative, or 1e-2 near zero)."""
    exact = linear_many_reference(x.float(), [w.float() for w in weights],
                                  None if biases is None else [b if b is None else b.float() for b in biases])
    assert len(got) == len(weights)
    for y, want, w in zip(got, exact, weights):
        assert y.shape == (1, w.shape[0]) and y.dtype == x.dtype and y.device == x.device
        if x.dtype == torch.float32:
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(y.float(), want.to(x.dtype).float(), rtol=2 ** -7, atol=1e-2)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("count", [1, 3, 4])
def test_interpreted_kernel_equals_f_linear_per_weight(count, dtype, bias):
    x, weights, biases = _problem(count, dtype, bias)
    if count >= 3:
        assert weights[-1].stride(0) > H  # a row slice of a larger tensor
    for row in (x, x[None]):  # [H] and [1, H]
        _check(linear_many(row, weights, biases=biases, block_n=16, block_h=64), x, weights, biases)
    _check(linear_many(x, weights, biases=biases), x, weights, biases)  # the default blocks


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("blocks", [dict(block_n=32, block_h=256), dict(block_n=8, block_h=16, num_warps=8),
                                    dict(block_n=16, block_h=64, split_h=3), dict(block_n=16, block_h=32, split_h=8)],
                         ids=["one_step", "many_steps", "split3", "split_past_h"])
def test_every_block_configuration_and_the_h_split_compute_the_same(blocks, dtype):
    x, weights, biases = _problem(3, dtype, True)
    _check(linear_many(x, weights, biases=biases, **blocks), x, weights, biases)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_an_h_of_whole_column_blocks_and_a_row_without_a_bias_list():
    x, weights, _ = _problem(2, torch.float32, False, hidden=128, rows=(16, 24))
    _check(linear_many(x[None], weights, block_n=8, block_h=64), x, weights, None)
    _check(linear_many(x, weights[0]), x, weights[:1], None)  # one tensor for one weight


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("split_h", [1, 2])
def test_outs_are_written_in_place_and_returned(split_h):
    x, weights, biases = _problem(3, torch.bfloat16, True)
    outs = (torch.full((1, ROWS[0]), 7.0, dtype=x.dtype), torch.full((ROWS[1],), 7.0, dtype=x.dtype),
            torch.full((1, ROWS[2]), 7.0, dtype=x.dtype))
    got = linear_many(x, weights, outs, biases, block_n=16, block_h=64, split_h=split_h)
    assert all(g is o for g, o in zip(got, outs))
    _check((outs[0], outs[1][None], outs[2]), x, weights, biases)


FP8_ROWS = (200, 40, 17, 130)  # over one 128-row scale block, within one, and one row past a block
FP8_H = 300  # three column blocks, the last partial


def _fp8_problem(count: int, dtype: torch.dtype, bias: bool, device: str = "cpu", hidden: int = FP8_H,
                 rows: tuple = FP8_ROWS, seed: int = 1) -> tuple[torch.Tensor, tuple, tuple, tuple | None]:
    """x, ``count`` block-wise FP8 weights (quantized from unit-scale outputs' weights, every block with its own
    scale), their scales and biases (the second weight has none). The last of 3 or 4 weights is block row 1 on of
    a larger quantized tensor, its scales a view of that tensor's (row and column strides of the larger ones)."""
    x, weights, biases = _problem(count, torch.float32, bias, hidden=hidden, rows=rows, seed=seed)
    quantized = [quantize_blocks(w * (1 + torch.arange(w.shape[1]) / hidden)) for w in weights]
    if count >= 3:
        n = rows[count - 1]
        parent = torch.randn(n + 128, hidden + 24, generator=torch.Generator().manual_seed(seed)) / hidden ** 0.5
        fp8, scale = quantize_blocks(parent)
        quantized[-1] = (fp8[128:, :hidden], scale[1:, :-(-hidden // 128)])
    fp8 = tuple(q.to(device) if device != "cpu" else q for q, _ in quantized)
    scales = tuple(sc.to(device) if device != "cpu" else sc for _, sc in quantized)
    biases = None if biases is None else tuple(None if b is None else b.to(device, dtype) for b in biases)
    return x.to(device, dtype), fp8, scales, biases


def _check_fp8(got: tuple, x: torch.Tensor, fp8: tuple, scales: tuple, biases: tuple | None) -> None:
    """Each output is [1, N_i] in x's dtype and equals the float32 product on the float32 dequantized weights
    (independently dequantized by ``fp8_blocks``) within float32 rounding, or within one rounding of it."""
    deq = [dequantize_blocks(w.cpu(), sc.cpu()) for w, sc in zip(fp8, scales)]
    exact = linear_many_reference(x.cpu().float(), deq,
                                  None if biases is None else [b if b is None else b.cpu().float() for b in biases])
    assert len(got) == len(fp8)
    for y, want, w in zip(got, exact, fp8):
        assert y.shape == (1, w.shape[0]) and y.dtype == x.dtype and y.device == x.device
        if x.dtype == torch.float32:
            torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(y.cpu().float(), want.to(x.dtype).float(), rtol=2 ** -7, atol=1e-2)


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [dict(count=1, bias=False), dict(count=3, bias=True),
                                  dict(count=4, bias=True, block_n=8, block_h=64, split_h=3)],
                         ids=["one", "three_biases", "four_split"])
def test_fp8_weights_with_block_scales_equal_the_dequantized_product(case, dtype):
    case = dict(case)
    x, fp8, scales, biases = _fp8_problem(case.pop("count"), dtype, case.pop("bias"))
    if len(fp8) >= 3:
        assert fp8[-1].stride(0) > FP8_H  # a row slice of a larger tensor
    _check_fp8(linear_many(x, fp8, biases=biases, scales=scales, **case), x, fp8, scales, biases)
    _check_fp8(linear_many(x[None], fp8, biases=biases, scales=scales), x, fp8, scales, biases)  # default blocks
    reference = linear_many_reference(x, fp8, biases, scales=scales)
    _check_fp8(reference, x, fp8, scales, biases)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_fp8_scales_are_read_per_block_not_per_weight():
    """Scaling one scale block changes only the outputs of that block's rows, by the contribution of its columns."""
    x, fp8, scales, _ = _fp8_problem(1, torch.float32, False)
    before = linear_many(x, fp8, scales=scales, block_n=16, block_h=64)[0]
    bumped = scales[0].clone()
    bumped[1, 2] *= 2  # rows 128..199, columns 256..299
    after = linear_many(x, fp8, scales=(bumped,), block_n=16, block_h=64)[0]
    changed = (after != before)[0]
    assert not changed[:128].any() and changed[128:].all()
    part = dequantize_blocks(fp8[0], scales[0])[128:, 256:] @ x[256:]
    torch.testing.assert_close(after[0, 128:] - before[0, 128:], part, rtol=1e-4, atol=1e-5)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_fp8_custom_op_runs_the_kernel_and_compiles_without_a_graph_break():
    x, fp8, scales, biases = _fp8_problem(3, torch.bfloat16, True)
    _check_fp8(torch.ops.psr_hf.linear_many_fp8(x, list(fp8), list(scales), list(biases)), x, fp8, scales, biases)

    def block(x: torch.Tensor) -> list:
        return [y * 2 for y in torch.ops.psr_hf.linear_many_fp8(x, list(fp8), list(scales), [])]

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x), linear_many_reference(x, fp8, scales=scales)):
        torch.testing.assert_close(got, 2 * want, rtol=0, atol=0)
    x, fp8, scales, biases = _fp8_problem(2, torch.float32, True, hidden=64, rows=(24, 8))
    # the schema check multiplies every input, which torch does not do for float8 on the CPU: the fake and the
    # autograd registration are checked
    torch.library.opcheck(torch.ops.psr_hf.linear_many_fp8.default, (x[None], list(fp8), list(scales), list(biases)),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_fp8_inputs_the_kernel_does_not_take_are_refused_with_the_fix():
    x, fp8, scales, _ = _fp8_problem(2, torch.bfloat16, False)
    plain = tuple(w.to(torch.bfloat16) for w in fp8)
    cases = [
        ((x, fp8), {}, "need their block scales"),
        ((x, plain), {"scales": scales}, "every weight is torch.float8_e4m3fn"),
        ((x, fp8), {"scales": scales[:1]}, "1 scales for 2 weights"),
        ((x, fp8), {"scales": (scales[0], scales[1].t())}, r"scales\[1\] \(3, 1\)"),
        ((x, fp8), {"scales": (scales[0], scales[1].double())}, r"scales\[1\].*float32"),
        ((x, fp8), {"scales": scales, "block_n": 256}, "divide the scale block"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            linear_many(*args, **kwargs)
    linear_many(x, fp8, scales=scales)  # the unchanged arguments run


def test_the_default_blocks_give_a_few_programs_per_sm():
    cpu = torch.device("cpu")  # DEFAULT_SMS: an H100's 132
    assert default_blocks(OLMOE_QKV, 2048, cpu) == (16, 512)  # 384 programs
    assert default_blocks((2048,), 2048, cpu) == (4, 512)  # one weight of 2048 rows: 512 programs
    for rows in (OLMOE_QKV, (2048,), (50304,)):
        block_n, _ = default_blocks(rows, 2048, cpu)
        assert sum(-(-n // block_n) for n in rows) >= PROGRAMS_PER_SM * DEFAULT_SMS
    assert default_blocks((128,), 2048, cpu) == (4, 512)  # too few rows for the target: the smallest block
    assert default_blocks((48, 40), 200, cpu)[1] == 256  # H 200: no column block past its power of two


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_custom_op_runs_the_kernel_and_compiles_without_a_graph_break():
    x, weights, biases = _problem(3, torch.float32, True)
    _check(torch.ops.psr_hf.linear_many(x, list(weights), list(biases)), x, weights, biases)
    _check(torch.ops.psr_hf.linear_many(x[None], list(weights), []), x, weights, None)  # []: no biases

    def block(x: torch.Tensor) -> list:
        return [y * 2 for y in torch.ops.psr_hf.linear_many(x, list(weights), list(biases))]

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # the op's fake gives the shapes
    want = linear_many_reference(x, weights, biases)
    for got, w in zip(compiled(x), want):
        torch.testing.assert_close(got, 2 * w, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_custom_op_passes_torch_opcheck():
    x, weights, biases = _problem(2, torch.float32, True, hidden=64, rows=(24, 8))
    torch.library.opcheck(torch.ops.psr_hf.linear_many.default, (x[None], list(weights), list(biases)))


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_inputs_the_kernel_does_not_take_are_refused_with_the_reason():
    x, weights, biases = _problem(3, torch.float32, True)
    cases = [
        ((x[None].expand(2, -1), weights), {}, "one row"),
        ((x[:-1], weights), {}, "does not match x's H"),
        ((x, weights + weights[:2]), {}, "1 to 4"),
        ((x, ()), {}, "1 to 4"),
        ((x.to(torch.bfloat16), weights), {}, "cast x"),
        ((x.to(torch.int32), weights), {}, "the kernel takes"),
        ((x, (weights[0], weights[1].t().contiguous().t(), weights[2])), {}, "unit stride"),
        ((x, (weights[0][:, None],)), {}, r"matrix \[N, H\]"),
        ((x, weights), {"biases": biases[:2]}, "one per weight"),
        ((x, weights), {"biases": (biases[0], None, biases[0])}, r"biases\[2\]"),
        ((x, weights), {"biases": (biases[0].double(), None, None)}, r"biases\[0\] is torch.float64"),
        ((x, weights, (torch.empty(1, 48),)), {}, "one per weight"),
        ((x, weights, (torch.empty(1, 48), torch.empty(2, 40), torch.empty(17))), {}, r"outs\[1\]"),
        ((x, weights, (torch.empty(1, 48), torch.empty(40), torch.empty(17).double())), {}, r"outs\[2\]"),
        ((x, weights), {"block_n": 12}, "block_n = 12: a power of two"),
        ((x, weights), {"num_warps": 3}, "num_warps"),
        ((x, weights), {"split_h": 0}, "split_h"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            linear_many(*args, **kwargs)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="move x"):
            linear_many(x, (weights[0].cuda(),))
    linear_many(x, weights, biases=biases)  # the unchanged arguments run


@needs_triton
def test_cpu_tensors_outside_the_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weights, _ = _problem(1, torch.float32, False)
    with pytest.raises(ValueError, match="interpreter"):
        linear_many(x, weights)


def test_the_module_loads_without_triton_and_its_reference_runs(monkeypatch):
    import importlib.util

    import psr_hf.engine.gemv_kernel as installed

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    spec = importlib.util.spec_from_file_location("psr_hf.engine._gemv_kernel_no_triton", installed.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers no second custom op: only the package's module does
    assert module.triton is None
    x, weights, biases = _problem(3, torch.float32, True)
    for got, want in zip(module.linear_many_reference(x, weights, biases),
                         installed.linear_many_reference(x, weights, biases)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="needs triton"):
        module.linear_many(x, weights)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_benchmark_runs_on_the_cpu_and_reports_a_failing_configuration(tmp_path):
    from module_files import ROOT, load_module

    bench = load_module("gemv_bench", ROOT / "benchmarks" / "engine" / "gemv_bench.py")
    path = tmp_path / "record.json"
    bench.main(["--device", "cpu", "--hidden", "64", "--shapes", "router", "--configs", "64x64x4x1", "64x64x4x2",
                "64x32x4x1x2x1", "12x64x4x1", "--rounds", "1", "--json", str(path)])
    rows = {row["config"]: row for row in json.loads(path.read_text())["shapes"]["router"]["rows_timed"]}
    assert set(rows) == {"cublas", "64x64x4x1", "64x64x4x2", "64x32x4x1x2x1", "12x64x4x1"}
    assert "power of two" in rows["12x64x4x1"]["error"]
    for name in ("cublas", "64x64x4x1", "64x64x4x2", "64x32x4x1x2x1"):
        assert rows[name]["us_median"] > 0 and rows[name]["vs_cublas"] < 1e-2 and rows[name]["vs_fp32"] < 1e-2


# compiled for the GPU (marked cuda: run on the lent GPU)
@pytest.mark.cuda
@needs_gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("blocks", [{}, dict(block_n=32, block_h=256), dict(block_n=8, block_h=512, split_h=4)],
                         ids=["default", "32x256", "split4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernel_equals_f_linear_on_the_gpu(dtype, blocks):
    for count, bias in ((3, False), (4, True)):  # the small shapes, a slice and biases included
        x, weights, biases = _problem(count, dtype, bias, "cuda")
        _check(linear_many(x, weights, biases=biases, **blocks), x, weights, biases)
    x, weights, _ = _problem(3, dtype, False, "cuda", hidden=2048, rows=OLMOE_QKV)  # OLMoE's q/k/v
    _check(linear_many(x[None], weights, **blocks), x, weights, None)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_fp8_kernel_equals_the_dequantized_product_on_the_gpu_and_in_a_graph(dtype):
    for count, bias, blocks in ((3, True, {}), (4, False, dict(block_n=8, block_h=256, split_h=2))):
        x, fp8, scales, biases = _fp8_problem(count, dtype, bias, "cuda")
        _check_fp8(linear_many(x, fp8, biases=biases, scales=scales, **blocks), x, fp8, scales, biases)
    x, fp8, scales, _ = _fp8_problem(3, dtype, False, "cuda", hidden=2048, rows=OLMOE_QKV)  # OLMoE's q/k/v
    outs = tuple(torch.empty(1, w.shape[0], device="cuda", dtype=dtype) for w in fp8)
    linear_many(x, fp8, outs, scales=scales)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_many(x, fp8, outs, scales=scales)
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g).to(device="cuda", dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        _check_fp8(outs, x, fp8, scales, None)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("split_h", [1, 2])
def test_compiled_kernel_replays_in_a_cuda_graph_after_x_changes_in_place(split_h):
    x, weights, biases = _problem(3, torch.bfloat16, True, "cuda", hidden=2048, rows=OLMOE_QKV)
    outs = tuple(torch.empty(1, w.shape[0], device="cuda", dtype=x.dtype) for w in weights)
    linear_many(x, weights, outs, biases, split_h=split_h)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_many(x, weights, outs, biases, split_h=split_h)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=g).to(device="cuda", dtype=x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        _check(outs, x, weights, biases)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("block_h", [512, 2048])
def test_programmatic_dependent_launches_in_a_graph_read_what_the_kernels_before_them_wrote(block_h):
    """A chain captured in one graph: a copy writes x, then three dependent launches each read the one before's
    output; every replay with a new x gives the non-PDL launches' bits."""
    g = torch.Generator().manual_seed(5)
    H = 2048
    weights = [(torch.randn(H, H, generator=g) / H ** 0.5).to(device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    source = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(source)
    outs = [torch.empty(1, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def chain(pdl: bool) -> None:
        x.copy_(source)
        previous = x
        for w, out in zip(weights, outs):
            linear_many(previous, [w], [out], block_n=4, block_h=block_h, pdl=pdl)
            previous = out

    source.normal_()
    chain(True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(True)
    for _ in range(3):
        source.copy_(torch.randn(1, H, generator=g).to(device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        chain(False)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, outs))
