"""The Gated DeltaNet step kernel (psr_hf.engine.gated_delta_kernel) against the engine's PyTorch step
(``_gated_delta_net`` of the qwen3_5_moe family) over several tokens: the normed, gated output and both updated
states, in Triton's interpreter on the CPU (and compiled on a GPU, marked cuda). Its torch reference equals the
family's step bitwise; the kernel equals it within float32 rounding, and in bfloat16 within the rounding of the
same casts."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from psr_hf.engine.families.qwen3_5_moe import _gated_delta_net, _linear_inputs, _LinearStatic
from psr_hf.engine.gated_delta_kernel import MAX_STATE_TILE, gated_delta_step, gated_delta_step_reference
from psr_hf.engine.moe import triton_available

TRITON_OK, TRITON_WHY = triton_available()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"{TRITON_WHY}: `make` installs triton where it has wheels")

HIDDEN = 32
TOKENS = 4
# (k_heads, v_heads, k_dim, v_dim, kernel): v_heads == k_heads, v_heads = 2 * k_heads, Dk != Dv and not powers of 2
SHAPES = {"shared_2x": (2, 4, 16, 8, 4), "one_to_one": (2, 2, 8, 16, 4), "odd_sizes": (1, 2, 12, 20, 3)}
QWEN36 = (16, 32, 128, 128, 4)


def _layer(shape: tuple, dtype: torch.dtype, bias: bool, device: str, seed: int,
           param_dtype: torch.dtype | None = None) -> tuple[_LinearStatic, dict, torch.Tensor, torch.Tensor]:
    """A random Gated DeltaNet layer in the family's weight dict (identity ``out_proj``, so that the family's step
    returns the normed, gated output itself) and a nonzero starting window and state."""
    k_heads, v_heads, k_dim, v_dim, kernel = shape
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    g = torch.Generator().manual_seed(seed)

    def rand(*size: int, scale: float = 1.0, like: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=like)

    per_head = param_dtype or dtype
    a = {"in_proj_qkv": (rand(conv_dim, HIDDEN, scale=0.3), None),
         "in_proj_z": (rand(v_heads * v_dim, HIDDEN, scale=0.3), None),
         "in_proj_b": (rand(v_heads, HIDDEN, scale=0.3), None), "in_proj_a": (rand(v_heads, HIDDEN, scale=0.3), None),
         "out_proj": (torch.eye(v_heads * v_dim, device=device, dtype=dtype), None),
         "conv_weight": rand(conv_dim, 1, kernel, scale=0.5)[:, 0],  # conv1d.weight[:, 0], as the family keeps it
         "conv_bias": rand(conv_dim, scale=0.2) if bias else None,
         "A_log": rand(v_heads, scale=0.5, like=per_head), "dt_bias": rand(v_heads, like=per_head),
         "norm": (1.0 + rand(v_dim, scale=0.1, like=per_head), 1e-6)}
    conv = rand(conv_dim, kernel)
    recurrent = rand(v_heads, k_dim, v_dim, scale=0.1, like=torch.float32)
    return _LinearStatic(k_heads, v_heads, k_dim, v_dim, False), a, conv, recurrent


def _weights(a: dict) -> tuple:
    return (a["conv_weight"], a["conv_bias"], a["A_log"], a["dt_bias"], *a["norm"])


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal within float32 rounding (the RMSNorm scales a small output's error up), or for a ``dtype`` of bfloat16
    within two steps of its rounding: a last-bit difference before a cast may move it by one step, and the float32
    state follows the moved value."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -8)


def _compare(shape: tuple, dtype: torch.dtype, bias: bool, device: str, seed: int = 0,
             param_dtype: torch.dtype | None = None, tokens: int = TOKENS) -> dict[str, float]:
    """Run the family's step, the reference and the kernel on the same tokens from the same states; check them and
    return the kernel's largest differences."""
    s, a, conv, recurrent = _layer(shape, dtype, bias, device, seed, param_dtype)
    states = {name: (conv.clone(), recurrent.clone()) for name in ("family", "reference", "kernel")}
    g = torch.Generator().manual_seed(seed + 1)
    worst = {"out": 0.0, "conv": 0.0, "recurrent": 0.0}
    for position in range(tokens):
        x = torch.randn(1, HIDDEN, generator=g).to(device=device, dtype=dtype)
        family = _gated_delta_net(s, a, x, torch.tensor(position, device=device), *states["family"])
        inputs = _linear_inputs(s, a, x)
        reference = gated_delta_step_reference(*inputs, *states["reference"], *_weights(a))
        kernel = gated_delta_step(*inputs, *states["kernel"], *_weights(a))
        assert torch.equal(reference, family)
        assert torch.equal(states["reference"][0], states["family"][0])
        assert torch.equal(states["reference"][1], states["family"][1])
        assert kernel.shape == family.shape and kernel.dtype == family.dtype
        _close(kernel, family, dtype)
        _close(states["kernel"][0], states["family"][0], dtype)
        _close(states["kernel"][1], states["family"][1], dtype)
        for name, got, want in (("out", kernel, family), ("conv", states["kernel"][0], states["family"][0]),
                                ("recurrent", states["kernel"][1], states["family"][1])):
            worst[name] = max(worst[name], (got.float() - want.float()).abs().max().item())
    return worst


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_interpreted_kernel_equals_the_torch_step_over_tokens(shape, dtype, bias):
    _compare(shape, dtype, bias, "cpu")


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_interpreted_kernel_rounds_where_float32_parameters_meet_a_bf16_input():
    # A_log, dt_bias and the norm's weight kept in float32 beside a bf16 model: the norm's product stays float32
    _compare(SHAPES["shared_2x"], torch.bfloat16, True, "cpu", param_dtype=torch.float32)


def _inputs(shape: tuple, dtype: torch.dtype = torch.float32) -> list:
    s, a, conv, recurrent = _layer(shape, dtype, False, "cpu", 0)
    return [*_linear_inputs(s, a, torch.randn(1, HIDDEN, dtype=dtype)), conv, recurrent, *_weights(a)]


def _with(args: list, index: int, value) -> list:
    return [value if i == index else t for i, t in enumerate(args)]


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_shapes_the_kernel_does_not_take_are_refused_with_the_reason():
    args = _inputs(SHAPES["shared_2x"])
    mixed, z, b, g_in, conv, recurrent = args[:6]
    with pytest.raises(ValueError, match="batch 1"):
        gated_delta_step(*_with(args, 0, mixed[None].expand(2, -1)))
    with pytest.raises(ValueError, match="not a multiple of"):  # 3 value heads over 2 key heads
        k_heads, k_dim, v_dim = 2, 16, 8
        conv_dim = 2 * k_heads * k_dim + 3 * v_dim
        bad = [torch.zeros(conv_dim), torch.zeros(3, v_dim), torch.zeros(3), torch.zeros(3),
               torch.zeros(conv_dim, 4), torch.zeros(3, k_dim, v_dim), torch.zeros(conv_dim, 4), None,
               torch.zeros(3), torch.zeros(3), torch.zeros(v_dim), 1e-6]
        gated_delta_step(*bad)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_step(*_with(args, 5, recurrent.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="one dtype"):
        gated_delta_step(*_with(args, 1, z.double()))
    with pytest.raises(ValueError, match="contiguous"):
        gated_delta_step(*_with(args, 4, conv.t().contiguous().t()))
    with pytest.raises(ValueError, match="conv_weight"):
        gated_delta_step(*_with(args, 6, args[6][:, :3]))
    with pytest.raises(ValueError, match="dt_bias"):
        gated_delta_step(*_with(args, 9, args[9][:3]))
    big = _inputs((1, 1, 256, 128, 4))  # a 256 x 128 state slice does not fit one program's registers
    assert 256 * 128 > MAX_STATE_TILE
    with pytest.raises(ValueError, match="registers"):
        gated_delta_step(*big)
    gated_delta_step(*args)  # the unchanged arguments run


@needs_triton
def test_cpu_tensors_outside_the_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="interpreter"):
        gated_delta_step(*_inputs(SHAPES["shared_2x"]))


def test_the_module_loads_without_triton_and_its_reference_runs(monkeypatch):
    import importlib.util

    import psr_hf.engine.gated_delta_kernel as installed

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    spec = importlib.util.spec_from_file_location("psr_hf.engine._gated_delta_kernel_no_triton", installed.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton is None
    args = _inputs(SHAPES["shared_2x"])
    want = installed.gated_delta_step_reference(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args])
    assert torch.equal(module.gated_delta_step_reference(*args), want)
    with pytest.raises(ValueError, match="needs triton"):
        module.gated_delta_step(*args)


@needs_triton
@pytest.mark.usefixtures("interpreter")
def test_the_benchmark_runs_on_the_cpu_and_writes_its_record(tmp_path):
    from module_files import ROOT, load_module

    bench = load_module("gated_delta_bench", ROOT / "benchmarks" / "qwen36" / "gated_delta_bench.py")
    path = tmp_path / "record.json"
    record = bench.main(["--device", "cpu", "--rounds", "2", "--layers", "1", "--k-heads", "2", "--v-heads", "4",
                         "--k-dim", "16", "--v-dim", "8", "--num-warps", "4", "--hbm-gbps", "100", "--json", str(path)])
    assert json.loads(path.read_text())["shape"] == {"k_heads": 2, "v_heads": 4, "k_dim": 16, "v_dim": 8, "kernel": 4}
    assert set(record["us_per_layer"]) == {"torch", "kernel", "kernel_w4"}
    assert all(row["median"] > 0 and len(row["rounds"]) == 2 for row in record["us_per_layer"].values())
    assert max(max(d.values()) for d in record["max_abs_diff_vs_torch"].values()) < 1e-2


# the same comparisons compiled for the GPU (marked cuda: run on the lent GPU)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [*SHAPES.values(), QWEN36], ids=[*SHAPES, "qwen36"])
def test_compiled_kernel_equals_the_torch_step_on_the_gpu(shape, dtype, bias, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _compare(shape, dtype, bias, "cuda", tokens=8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_compiled_kernel_replays_in_a_cuda_graph(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    s, a, conv, recurrent = _layer(QWEN36, torch.bfloat16, False, "cuda", 5)
    inputs = [t.clone() for t in _linear_inputs(s, a, torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16))]
    conv_r, recurrent_r = conv.clone(), recurrent.clone()
    gated_delta_step(*inputs, conv.clone(), recurrent.clone(), *_weights(a))  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_step(*inputs, conv, recurrent, *_weights(a))
    for _ in range(3):
        graph.replay()
        want = gated_delta_step_reference(*inputs, conv_r, recurrent_r, *_weights(a))
        torch.cuda.synchronize()
        _close(out, want, torch.bfloat16)
        _close(conv, conv_r, torch.bfloat16)
        _close(recurrent, recurrent_r, torch.bfloat16)
