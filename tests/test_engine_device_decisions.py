"""The device decision kernel (psr_hf.engine.device_decisions) against the numba kernels, decision for decision and
state value for state value (bitwise), for every policy of the table, run in Triton's interpreter on the CPU (and
compiled on a GPU, marked cuda). The engine's host path calls the numba kernels in this order per token: for each
MoE layer m, ``select(m)`` (mode "select" when the policy reads a pre-gate, else "both"), then ``prefetch(m + D)``
from the pre-gate of m + D (D the prefetch distance, 1 by default) computed on m's input; the device kernel does
both in one launch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from module_files import ROOT, load_module

from psr_hf.engine.moe import triton_available
from psr_hf.policy import Calibration, LogicalCache, RoutingConfig

TRITON_OK, TRITON_WHY = triton_available()
pytestmark = pytest.mark.skipif(not TRITON_OK, reason=f"{TRITON_WHY}: `make` installs triton where it has wheels")

L, E, K, V = 4, 16, 4, 32

CONFIGS = {
    "exact": RoutingConfig(policy="exact", capacity=8),
    "exact_budget1": RoutingConfig(policy="exact", capacity=8, budget=1, window=4),
    "cache_prior": RoutingConfig(policy="cache_prior", capacity=8, lam=0.3),
    "cache_prior_top_j_running": RoutingConfig(policy="cache_prior", capacity=8, lam=0.5, top_j=2,
                                               delta_mode="running"),
    "psr_score": RoutingConfig(policy="psr", capacity=8, lam=0.3, budget=1),
    "psr_lru_budget2": RoutingConfig(policy="psr", capacity=6, lam=0.2, budget=2, window=6, eviction="lru"),
    "psr_running": RoutingConfig(policy="psr", capacity=8, lam=0.4, budget=1, delta_mode="running", top_j=1),
    "spec": RoutingConfig(policy="spec", capacity=8),
    "psr_distance2": RoutingConfig(policy="psr", capacity=6, lam=0.3, budget=2, window=5, prefetch_distance=2),
}


def _calibration(rng: np.random.Generator, with_prior: bool) -> Calibration:
    prior = None
    counts = None
    if with_prior:
        prior = (rng.random((V, L, E)) < 0.3) * rng.random((V, L, E))
        counts = rng.integers(0, 3, size=V)  # some tokens unseen: the fallback prior
    return Calibration.from_arrays(delta=rng.random(L) + 0.5, expert_counts=rng.integers(0, 50, size=(L, E)),
                                   token_prior=prior, token_counts=counts)


def _scores(rng: np.random.Generator, ties: bool) -> np.ndarray:
    if ties:  # few distinct values: ties everywhere, at every boundary
        return rng.integers(0, 4, size=2 * E).astype(np.float32) * np.float32(0.25)
    z = rng.standard_normal(2 * E).astype(np.float32)
    z[rng.integers(0, 2 * E, size=3)] = -np.inf  # group-limited routing masks experts
    return z


def _host_token(cache: LogicalCache, token: int, z: np.ndarray, saved: dict) -> tuple[list, list]:
    """One token through the numba kernels as the engine's host path calls them; the plans per layer (``z[m, E:]``:
    the pre-gate of layer ``m + D``, D the prefetch distance)."""
    io = cache.io
    io.tokens[:, 0] = token
    needs, D = cache.config.needs_pregate, cache.distance
    plans, pplans = [], []
    for m in range(L):
        zm, gm = z[m, :E], z[m, E:]
        mode = "select" if needs and (m >= D or m + D < L) else "both"
        io.scores[:, 0] = zm
        if cache.config.executes_pregate and m:
            io.pregate[:, 0] = saved[m]
        plans.append(cache.step_io(m, mode).plan[0, 0].copy())
        if needs and m + D < L:
            saved[m + D] = gm.copy()
            io.pregate[:, 0] = gm
            pplans.append(cache.step_io(m + D, "prefetch").plan[0, 0].copy())
        else:
            pplans.append(None)
    return plans, pplans


def _check_slots(dev, host: LogicalCache, m: int, plan: np.ndarray, pplan: np.ndarray | None) -> None:
    """Offloaded: the slot maps mirror the logical cache, each insertion's copy names its expert and the slot the
    maps give it, and the selection's slots are its experts' slots."""
    slot_of = dev.slot_of.cpu().numpy()
    expert_of = dev.expert_of.cpu().numpy()
    copies = dev.copies.cpu().numpy()
    layout = host.plan_layout.columns
    for layer in range(L):
        held = np.flatnonzero(slot_of[layer] >= 0)
        assert sorted(expert_of[layer][expert_of[layer] >= 0].tolist()) == held.tolist()
        assert (expert_of[layer, slot_of[layer, held]] == held).all()
    D = host.distance
    n = int(plan[layout.n_demand])
    assert copies[m, 0] == n
    demand = plan[layout.demand : layout.demand + n]
    assert copies[m, 1 : 1 + 2 * n : 2].tolist() == demand.tolist()
    assert copies[m, 2 : 2 + 2 * n : 2].tolist() == slot_of[m, demand].tolist()
    assert dev.slot_ids.cpu().numpy().tolist() == slot_of[m, plan[:K]].tolist()
    if pplan is not None:
        n = int(pplan[layout.n_prefetch])
        start = 2 + 2 * K
        assert copies[m + D, start - 1] == n
        inserted = pplan[layout.prefetch : layout.prefetch + n]
        assert copies[m + D, start : start + 2 * n : 2].tolist() == inserted.tolist()
        assert copies[m + D, start + 1 : start + 1 + 2 * n : 2].tolist() == slot_of[m + D, inserted].tolist()


def _device_run(name: str, seed: int, ties: bool, with_prior: bool, tokens: int, device: str,
                offloaded: bool = False, logits_dtype: torch.dtype | None = None) -> None:
    """``logits_dtype``: the kernel reads the scores in that dtype (a softmax router's bf16 logits, which it
    widens itself), the host decides on the same values widened to float32."""
    from psr_hf.engine.device_state import DeviceState

    rng = np.random.default_rng(seed)
    config = CONFIGS[name]
    calibration = _calibration(rng, with_prior)
    kwargs = dict(num_layers=L, num_experts=E, top_k=K, calibration=calibration, vocab_size=V)
    host = LogicalCache(config, **kwargs)
    mirror = LogicalCache(config, **kwargs)  # uploaded once, then advanced only by the device
    logits = None if logits_dtype is None else torch.zeros(2 * E, dtype=logits_dtype, device=device)
    dev = DeviceState(mirror, device, max_positions=tokens, offloaded=offloaded, scores=logits)
    slots = np.full((L, E), -1)
    for layer in range(L):  # the warm set in ascending order in slots 0.. C - 1
        held = np.flatnonzero(mirror.state[layer, 0, 3])
        slots[layer, held] = np.arange(held.size)
    dev.upload(slots=slots if offloaded else None)
    saved: dict = {}
    for t in range(tokens):
        token = int(rng.integers(0, V))
        z = np.stack([_scores(rng, ties) for _ in range(L)])  # [L, 2E]: z | layer m + D's pre-gate
        if logits_dtype is not None:
            z = torch.from_numpy(z).to(logits_dtype).float().numpy()
        plans, pplans = _host_token(host, token, z, saved)
        dev.token.fill_(token)
        dev.position.fill_(t)
        for m in range(L):
            dev.scores.copy_(torch.from_numpy(z[m]))  # exact: z holds values of the scores' dtype
            dev.decide(m)
            assert dev.plans[m].cpu().numpy().tolist() == plans[m].tolist(), (t, m, "select plan")
            if pplans[m] is not None:
                D = host.distance
                assert dev.pplans[m + D].cpu().numpy().tolist() == pplans[m].tolist(), (t, m, "prefetch plan")
            assert dev.ids.cpu().numpy().tolist() == plans[m][:K].tolist()
            if offloaded:
                _check_slots(dev, host, m, plans[m], pplans[m])
        assert int(dev.error.item()) == 0
        dev.download()
        np.testing.assert_array_equal(mirror.state.view(np.uint64), host.state.view(np.uint64))
        np.testing.assert_array_equal(mirror.counters.view(np.uint64), host.counters.view(np.uint64))
    assert dev.record[:tokens].shape == (tokens, L, E)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("with_prior", [False, True], ids=["no_prior", "token_prior"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_device_decisions_equal_the_numba_kernels_bitwise(name, ties, with_prior):
    _device_run(name, seed=hash((name, ties, with_prior)) % 2**32, ties=ties, with_prior=with_prior, tokens=6,
                device="cpu")


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", ["exact", "cache_prior", "psr_running"])
def test_device_decisions_on_bf16_logits_equal_the_numba_kernels_on_them_widened(name):
    _device_run(name, seed=5, ties=True, with_prior=True, tokens=4, device="cpu", offloaded=True,
                logits_dtype=torch.bfloat16)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", ["exact_budget1", "cache_prior", "psr_lru_budget2", "psr_score", "spec"])
def test_offloaded_slot_maps_follow_the_decisions_and_name_every_copy(name):
    _device_run(name, seed=11, ties=False, with_prior=True, tokens=5, device="cpu", offloaded=True)


@pytest.mark.usefixtures("interpreter")
def test_the_kernel_reads_every_float_from_a_float64_tensor(monkeypatch):
    """Compiled, Triton types a Python float argument as a float32 scalar (the interpreter keeps float64, so the
    bitwise tests above cannot see it): every argument of the real launch is a tensor, an int or a constexpr, and
    the policy's floats are DeviceState.params, float64."""
    import psr_hf.engine.device_decisions as D
    from psr_hf.engine.device_state import DeviceState

    real = D.kernel
    seen: list[tuple] = []

    class Recording:
        def __init__(self, launch):
            self.launch = launch

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append((args, kwargs))
                return self.launch[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(D, "kernel", lambda interpret: Recording(real(interpret)))
    config = RoutingConfig(policy="psr", capacity=8, lam=0.3, budget=1, decay_fast=0.7, decay_slow=0.95)
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=K,
                         calibration=_calibration(np.random.default_rng(0), False), vocab_size=V)
    dev = DeviceState(cache, "cpu", max_positions=1)
    dev.upload()
    dev.decide(0)
    (args, kwargs), = seen
    assert not [a for a in args if isinstance(a, float)], "a float passed by value is float32 when compiled"
    assert not [v for k, v in kwargs.items() if isinstance(v, float)]
    assert dev.params.dtype == torch.float64
    assert dev.params.tolist() == [0.3, 0.7, 0.95, cache.kernel_settings().flush]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_device_decisions_compiled_on_the_gpu_equal_the_numba_kernels_bitwise(name, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for ties in (False, True):
        _device_run(name, seed=7, ties=ties, with_prior=True, tokens=24, device="cuda", offloaded=ties)
    _device_run(name, seed=8, ties=True, with_prior=True, tokens=12, device="cuda", offloaded=True,
                logits_dtype=torch.bfloat16)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("programs, block", [(1, 4096), (3, 4096), (2, 8)])  # block 8: several steps per tensor
def test_the_copy_kernel_moves_exactly_the_listed_experts_into_their_slots(programs, block):
    from psr_hf.engine.device_copies import LayerCopies

    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(6, 5, 4, generator=gen), torch.randn(6, 3, 8, generator=gen).to(torch.bfloat16)]
    slots = [torch.zeros(3, 5, 4), torch.zeros(3, 3, 8, dtype=torch.bfloat16)]
    copies = torch.full((2, 7), -1, dtype=torch.int32)
    copies[1, 2:7] = torch.tensor([2, 4, 0, 1, 2], dtype=torch.int32)  # two pairs: expert 4 -> slot 0, 1 -> 2
    LayerCopies(host, slots).launch(copies, layer=1, count_column=2, programs=programs, block=block)
    for h, s in zip(host, slots):
        assert torch.equal(s[0], h[4]) and torch.equal(s[2], h[1])
        assert s[1].eq(0).all()  # an unlisted slot is untouched
    copies[1, 2] = 0
    LayerCopies(host, slots).launch(copies, layer=1, count_column=2, programs=programs, block=block)  # none listed
    assert slots[0][1].eq(0).all()
    with pytest.raises(ValueError, match="power of two"):
        LayerCopies(host, slots).launch(copies, layer=1, count_column=2, programs=programs, block=6)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("count", [3, 4])
def test_the_copy_kernel_moves_every_tensor_of_an_expert_when_it_has_more_than_two(count):
    from psr_hf.engine.device_copies import LayerCopies

    gen = torch.Generator().manual_seed(1)
    shapes = [(5, 8), (2, 2), (8, 4), (1, 2)][:count]
    host = [torch.randn(6, *shape, generator=gen).to(torch.float8_e4m3fn if i % 2 == 0 else torch.float32)
            for i, shape in enumerate(shapes)]
    slots = [torch.zeros(3, *t.shape[1:], dtype=t.dtype) for t in host]
    copies = torch.full((1, 5), -1, dtype=torch.int32)
    copies[0] = torch.tensor([2, 5, 1, 0, 2], dtype=torch.int32)  # expert 5 -> slot 1, expert 0 -> slot 2
    LayerCopies(host, slots).launch(copies, layer=0, count_column=0, programs=2)
    for h, s in zip(host, slots):
        assert torch.equal(s[1].view(torch.uint8), h[5].view(torch.uint8))
        assert torch.equal(s[2].view(torch.uint8), h[0].view(torch.uint8))
        assert s[0].view(torch.uint8).eq(0).all()


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("count", [2, 3])  # one launch per layer, and two (an expert of three tensors)
def test_copies_mark_their_layer_done_and_a_layer_waiting_before_that_counts_its_prefetches_late(count):
    from psr_hf.engine.device_copies import LateCounter, LayerCopies

    gen = torch.Generator().manual_seed(2)
    host = [torch.randn(6, 4, 8, generator=gen) for _ in range(count)]
    slots = [torch.zeros(3, 4, 8) for _ in range(count)]
    copies = torch.zeros((3, 5), dtype=torch.int32)
    copies[1] = torch.tensor([2, 5, 1, 0, 2], dtype=torch.int32)  # layer 1: two prefetches, counted at column 0
    step = torch.tensor([7], dtype=torch.int64)
    counter = LateCounter(3, step)
    counter.check(copies, 1, 0)  # layer 1 waits before its copies ran in step 7: two late, one layer waited
    LayerCopies(host, slots).launch(copies, layer=1, count_column=0, programs=3, signal=counter)
    assert counter.done.tolist() == [-1, 7, -1] and counter.arrivals.eq(0).all()  # the last program marked it
    assert torch.equal(slots[0][1], host[0][5]) and torch.equal(slots[-1][2], host[-1][0])
    counter.check(copies, 1, 0)  # after them: in time
    step += 1
    counter.check(copies, 1, 0)  # the next step, its copies not yet run: late again
    counter.check(copies, 2, 0)  # a layer without prefetches is never late
    assert counter.counts() == {"late": 4, "layers_waited": 2, "per_layer": [[0, 0], [4, 2], [0, 0]]}
    counter.restart()
    assert counter.done.tolist() == [-1, -1, -1]


def _trace(rng: np.random.Generator, tokens: int, ties: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    joint = np.stack([np.stack([_scores(rng, ties) for _ in range(L)]) for _ in range(tokens)])  # [T, L, 2E]
    pregate = joint[:, :, E:].copy()
    pregate[:, 0] = 0.0  # layer 0 has no pre-gate
    return joint[:, :, :E].copy(), pregate, rng.integers(0, V, size=tokens)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_replay_on_device_equals_replay(name, ties):
    from psr_hf.engine.device_replay import replay_on_device
    from psr_hf.policy import replay

    rng = np.random.default_rng(hash((name, ties, "replay")) % 2**32)
    calibration = _calibration(rng, with_prior=True)
    z, g, tokens = _trace(rng, 7, ties)
    want = replay(CONFIGS[name], z, g, tokens, calibration, top_k=K)
    got = replay_on_device(CONFIGS[name], scores=z, pregate=g, tokens=tokens, top_k=K, calibration=calibration,
                           device="cpu")
    for field in ("selected", "prefetch_copies", "demand_copies", "replaced"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert want.prefetch_copies.sum() + want.demand_copies.sum() > 0  # the trace exercises the cache


@pytest.mark.usefixtures("interpreter")
def test_replay_on_device_reproduces_a_recording_of_a_patched_model():
    import psr_hf
    from psr_hf.engine.device_replay import replay_on_device
    from psr_hf.testing import tiny_model

    model = tiny_model("olmoe", dtype=torch.float32)
    config = RoutingConfig(policy="psr", residency=0.5, lam=0.3, budget=1)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    with psr_hf.patched(model, config):
        with psr_hf.controller(model).record() as recorder:
            model(ids)
    recording = recorder.recordings[0]
    got = replay_on_device(config, recording, device="cpu")
    np.testing.assert_array_equal(got.selected, recording.selected)


def test_replay_on_device_names_what_is_missing():
    from psr_hf.engine.device_replay import replay_on_device

    with pytest.raises(ValueError, match="Recording, or scores"):
        replay_on_device(CONFIGS["psr_score"], scores=np.zeros((2, L, E), np.float32), device="cpu")
    with pytest.raises(ValueError, match="tokens must have shape"):
        replay_on_device(CONFIGS["psr_score"], scores=np.zeros((2, L, E), np.float32), tokens=[1], top_k=K,
                         device="cpu")


def _bench(name: str):
    """A benchmark script of benchmarks/engine as a module (the interpreter fixture restores TRITON_INTERPRET,
    which the scripts set on the CPU)."""
    return load_module(name, ROOT / "benchmarks" / "engine" / f"{name}.py")


@pytest.mark.usefixtures("interpreter")
def test_the_decision_kernel_bench_runs_every_variant_on_the_cpu(tmp_path):
    bench = _bench("decide_kernel_bench")
    out = tmp_path / "decide.json"
    record = bench.main(["--device", "cpu", "--layers", "2", "--experts", "16", "--top-k", "4", "--vocab", "32",
                         "--warps", "4", "--json", str(out)])
    assert [r["variant"] for r in record["rows"]] == list(bench.VARIANTS)
    assert json.loads(out.read_text())["rows"][0]["warps"] == 4


@pytest.mark.usefixtures("interpreter")
def test_the_decision_kernel_bench_runs_with_l2_cold(tmp_path):
    bench = _bench("decide_kernel_bench")
    common = ["--device", "cpu", "--layers", "2", "--experts", "16", "--top-k", "4", "--vocab", "32", "--warps", "4",
              "--variants", "psr_offloaded_prior"]
    record = bench.main(common + ["--cold"])
    assert record["l2_cold"] is True and record["rows"][0]["variant"] == "psr_offloaded_prior"
    assert bench.main(common)["l2_cold"] is False


@pytest.mark.usefixtures("interpreter")
def test_the_copy_kernel_bench_moves_the_listed_experts_by_both_paths_on_the_cpu(tmp_path):
    bench = _bench("copy_kernel_bench")
    out = tmp_path / "copies.json"
    record = bench.main(["--device", "cpu", "--hidden", "16", "--intermediate", "8", "--experts", "2",
                         "--programs", "1", "3", "--blocks", "64", "--warps", "4", "--repeats", "1",
                         "--json", str(out)])  # each timed path checks that the slots hold the listed experts
    assert [(r["copy"], r.get("programs")) for r in record["rows"]] == [("dma", None), ("kernel", 1), ("kernel", 3)]
    assert json.loads(out.read_text())["bytes_per_expert"] == (2 * 8 * 16 + 16 * 8) * 2


def test_the_compiled_kernel_issues_every_global_load_before_its_first_barrier():
    """In a decode step each of the kernel's loads misses L2; issued before the first barrier they overlap (one
    wave), where loads behind a barrier would each wait for a miss of their own (the build before: 12 waves for
    psr offloaded with the token prior). Compiled for sm_90 here, without a GPU, and read as SASS."""
    sass = _bench("decide_kernel_sass")
    assert sass.unavailable() is None  # triton's wheel (which this file needs) bundles the compiler and cuobjdump
    kernel = ROOT / "psr_hf" / "engine" / "decide_kernel.py"
    row = sass.read_cubin(sass.compile_kernel(kernel, "psr_offloaded_prior"))
    assert row["global_loads"] > 50 and row["barriers"] > 50
    assert row["load_waves"] == 1 and row["loads_before_first_barrier"] == row["global_loads"]
    assert row["stack_bytes"] == 0  # no spills
