"""psr_hf.engine.token_graph.TokenGraphDecoder: decode steps as one CUDA graph per token with the routing decided on
the GPU. Against the host-routed GraphDecoder on the same patched model: the same greedy tokens, bitwise the same
logits, the same routing statistics (copies, replaced slots, displaced mass) and copy counts, resident and offloaded,
for every policy; the state handed back to the controller continues on the host path as if the host had decided.
CPU: the decoder refuses what it cannot route on the device, with the reason."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.engine.graphs import GraphDecoder
from psr_hf.testing import tiny_model

NEW = 8
MAX_LEN = 40
POLICIES = {
    "exact": dict(policy="exact", residency=0.5),
    "exact_budget1": dict(policy="exact", residency=0.5, budget=1),
    "cache_prior": dict(policy="cache_prior", lam=0.3, residency=0.5),
    "psr": dict(policy="psr", lam=0.3, budget=1, residency=0.5),
    "psr_lru": dict(policy="psr", lam=0.2, budget=2, residency=0.5, eviction="lru"),
    "spec": dict(policy="spec", residency=0.5),
    "psr_distance2": dict(policy="psr", lam=0.3, budget=2, residency=0.5, prefetch_distance=2),
}
STAT_FIELDS = ("tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token",
               "displaced_mass")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@contextlib.contextmanager
def _psr_offloaded(seed: int):
    """The tiny OLMoE in float32 on the GPU, patched with PSR over a CUDA offload, and a 6-token prompt."""
    model = tiny_model("olmoe", dtype=torch.float32).to("cuda")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(seed))
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cuda")):
        yield model, ids


def _greedy(model, decoder, ids):
    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()
    sequence, logits = decoder.generate_greedy(ids, NEW, return_logits=True)
    return sequence, logits, ctl.stats()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_token_graph_decides_as_the_host_bitwise(name, policy, offloaded):
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = tiny_model(name, dtype=torch.float32).to("cuda")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    with psr_hf.patched(model, RoutingConfig(**POLICIES[policy]), offload=offload):
        host = _greedy(model, GraphDecoder(model, MAX_LEN), ids)
        device_decoder = TokenGraphDecoder(model, MAX_LEN)
        device = _greedy(model, device_decoder, ids)
        assert psr_hf.controller(model).decode_handle().lent is None  # stats() took the state back
        torch.testing.assert_close(device[0], host[0], rtol=0, atol=0)
        torch.testing.assert_close(device[1], host[1], rtol=0, atol=0)
        for field in STAT_FIELDS:
            np.testing.assert_array_equal(getattr(device[2], field), getattr(host[2], field), err_msg=field)
        if offloaded:
            assert device[2].offload.demand == host[2].offload.demand
            assert device[2].offload.prefetch == host[2].offload.prefetch
        again = _greedy(model, device_decoder, ids)  # a second sequence: the slots handed back are consistent
        torch.testing.assert_close(again[1], host[1], rtol=0, atol=0)


@pytest.mark.cuda
@needs_cuda
def test_a_device_routed_sequence_continues_on_the_host_path_as_if_the_host_had_decided():
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = tiny_model("olmoe", dtype=torch.float32).to("cuda")
    ids = [5, 9, 13, 17, 21, 25]
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cuda")):
        host = GraphDecoder(model, MAX_LEN)
        ctl = psr_hf.controller(model)
        ctl.reset()
        host.prefill(ids, batched=False)
        want = [host.step(t).clone() for t in (3, 4, 5, 6)]
        device = TokenGraphDecoder(model, MAX_LEN)
        ctl.reset()
        device.prefill(ids, batched=False)
        got = [device.step(3).clone(), device.step(4).clone()]
        ctl.stats()  # takes the state back mid-sequence
        with ctl.record():  # while a recording runs, the decoder routes on the host
            got += [device.step(5).clone(), device.step(6).clone()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_token_graph_refuses_a_cpu_model_and_a_gate_with_the_reason():
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = tiny_model("olmoe", dtype=torch.float32)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        with pytest.raises(ValueError, match="CUDA"):
            TokenGraphDecoder(model, MAX_LEN, graphs=False)


def test_device_routing_names_what_keeps_the_decisions_on_the_host():
    from psr_hf.engine.token_graph import device_routing_unsupported

    model = tiny_model("olmoe", dtype=torch.float32)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        assert device_routing_unsupported(psr_hf.controller(model)) is None
    for option, reason in (("copy_delay_ms", "copy_delay_ms"), ("check_slots", "check_slots")):
        offload = psr_hf.OffloadConfig(device="cpu", **{option: 1.0 if option == "copy_delay_ms" else True})
        with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=offload):
            assert reason in device_routing_unsupported(psr_hf.controller(model))


def test_graph_decoder_routes_on_the_host_without_cuda_graphs_and_says_why_when_asked_for_the_device():
    from psr_hf.engine.token_graph import graph_decoder

    model = tiny_model("olmoe", dtype=torch.float32)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        decoder = graph_decoder(model, MAX_LEN, graphs=False)
        assert type(decoder) is GraphDecoder
        with pytest.raises(ValueError, match="CUDA graphs"):
            graph_decoder(model, MAX_LEN, graphs=False, device_routing=True)


@pytest.mark.cuda
@needs_cuda
def test_graph_decoder_routes_on_the_device_and_follows_a_reconfigure():
    from psr_hf.engine.token_graph import TokenGraphDecoder, graph_decoder

    model = tiny_model("olmoe", dtype=torch.float32).to("cuda")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cuda")):
        ctl = psr_hf.controller(model)
        decoder = graph_decoder(model, MAX_LEN)
        assert isinstance(decoder, TokenGraphDecoder)
        _greedy(model, decoder, ids)
        ctl.reconfigure(RoutingConfig(**POLICIES["cache_prior"]))  # a new cache: the decoder binds to it
        device = _greedy(model, decoder, ids)
        host = _greedy(model, graph_decoder(model, MAX_LEN, device_routing=False), ids)
        torch.testing.assert_close(device[1], host[1], rtol=0, atol=0)
        for field in STAT_FIELDS:
            np.testing.assert_array_equal(getattr(device[2], field), getattr(host[2], field), err_msg=field)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]),
                        offload=psr_hf.OffloadConfig(device="cuda", copy_delay_ms=1.0)):
        assert type(graph_decoder(model, MAX_LEN)) is GraphDecoder
        with pytest.raises(ValueError, match="copy_delay_ms"):
            graph_decoder(model, MAX_LEN, device_routing=True)


@pytest.mark.cuda
@needs_cuda
def test_reset_after_a_reconfigure_captures_the_token_graph_before_the_sequence_not_inside_a_step():
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = tiny_model("olmoe", dtype=torch.float32).to("cuda")
    tokens = [5, 9, 13, 17, 21, 25]
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cuda")):
        ctl = psr_hf.controller(model)
        decoder = TokenGraphDecoder(model, MAX_LEN)
        decoder.reset()
        for token in tokens:
            decoder.step(token)
        ctl.reconfigure(RoutingConfig(**POLICIES["cache_prior"]))
        before = decoder._token_graph
        decoder.reset()  # the bench's window start, outside its timed steps
        assert decoder.dstate.cache is ctl.cache and decoder._token_graph is not before
        captured = decoder._token_graph
        for token in tokens:
            logits = decoder.step(token).clone()
        assert decoder._token_graph is captured  # no capture inside the steps
        assert ctl.decode_handle().lent is decoder
        fresh = TokenGraphDecoder(model, MAX_LEN)
        fresh.reset()
        for token in tokens:
            expected = fresh.step(token).clone()
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.cuda
@needs_cuda
def test_attach_generates_the_same_tokens_routed_on_the_device_as_on_the_host():
    from psr_hf.engine import attach, attached, detach
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = tiny_model("olmoe", dtype=torch.float32).to("cuda")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(4)).to("cuda")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=psr_hf.OffloadConfig(device="cuda")):
        outputs = {}
        for device_routing in (False, None):
            attach(model, max_len=MAX_LEN, device_routing=device_routing)
            assert isinstance(attached(model).decoder, TokenGraphDecoder) is (device_routing is None)
            psr_hf.controller(model).reset_stats()
            outputs[device_routing] = (model.generate(ids, max_new_tokens=NEW, do_sample=False),
                                       psr_hf.controller(model).stats())
            detach(model)
    torch.testing.assert_close(outputs[None][0], outputs[False][0], rtol=0, atol=0)
    for field in STAT_FIELDS:
        np.testing.assert_array_equal(getattr(outputs[None][1], field), getattr(outputs[False][1], field))


class _RouterFlipper:
    """A streamer that negates every router's weight in place when it is handed the ``at``-th new token."""

    def __init__(self, routers, at: int):
        self.routers, self.at, self.seen = routers, at, -1  # the first put is the prompt

    def put(self, value):
        self.seen += 1
        if self.seen == self.at:
            with torch.no_grad():
                for router in self.routers:
                    router.weight.mul_(-1)

    def end(self):
        pass


@pytest.mark.cuda
@needs_cuda
def test_a_router_changed_by_a_streamer_routes_from_the_same_step_on_the_device_as_on_the_host():
    from psr_hf.engine import attach, detach

    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(5)).to("cuda")
    outputs = {}
    for device_routing, flip in ((False, True), (None, True), (False, False)):
        model = tiny_model("olmoe", dtype=torch.float32).to("cuda")  # the same seeded weights each time
        with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
            attach(model, max_len=MAX_LEN, device_routing=device_routing)
            routers = [layer.router for layer in psr_hf.controller(model).layers]
            streamer = _RouterFlipper(routers, at=3) if flip else None
            outputs[device_routing, flip] = model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                                           streamer=streamer)
            detach(model)
    torch.testing.assert_close(outputs[None, True], outputs[False, True], rtol=0, atol=0)
    assert not torch.equal(outputs[False, True], outputs[False, False])  # the flip changed the tokens


@pytest.mark.cuda
@needs_cuda
def test_counting_late_prefetches_changes_no_output_and_counts_at_most_every_prefetch():
    from psr_hf.engine.token_graph import TokenGraphDecoder

    with _psr_offloaded(seed=7) as (model, ids):
        plain = _greedy(model, TokenGraphDecoder(model, MAX_LEN, prefetch_programs=1), ids)
        decoder = TokenGraphDecoder(model, MAX_LEN, prefetch_programs=1, count_late=True)
        counted = _greedy(model, decoder, ids)
        late = decoder.late_prefetches()
        with pytest.raises(ValueError, match="count_late=True"):
            TokenGraphDecoder(model, MAX_LEN).late_prefetches()
    torch.testing.assert_close(counted[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(counted[1], plain[1], rtol=0, atol=0)
    assert counted[2].offload.prefetch == plain[2].offload.prefetch > 0
    assert 0 <= late["late"] <= counted[2].offload.prefetch
    assert late["layers_waited"] <= late["late"]
    assert len(late["per_layer"]) == len(decoder.moe_layers)


@pytest.mark.cuda
@needs_cuda
def test_the_bench_counts_the_late_prefetches_of_its_device_routed_engine_rows(tmp_path):
    import json

    from psr_hf.cli import main
    from psr_hf.testing import save_tiny

    save_tiny("olmoe", tmp_path / "model", dtype=torch.bfloat16)
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tmp_path / "model"), "--device", "cuda", "--rounds", "3", "--windows", "1",
                 "--tokens", "8", "--no-accelerate", "--engine", "--configs", "psr_lam0.3_n1", "--hf-configs", "",
                 "--capacities", "0.5", "--count-late", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    offloaded = [r for r in record["results"] if r["kind"] == "engine" and r["copies"]["source"] == "offload scheduler"]
    assert len(offloaded) == 1 and offloaded[0]["decided_on"] == "device"
    copies = offloaded[0]["copies"]
    assert record["settings"]["count_late"] is True and "counted on the GPU" in copies["prefetch_timing"]
    assert 0 <= copies["prefetch_late_per_token"] <= copies["prefetch_per_token"]
    assert 0 <= copies["layers_waited_per_token"] <= copies["prefetch_late_per_token"]


@pytest.mark.cuda
@needs_cuda
def test_copy_timing_changes_no_token_graph_output():
    """One program per layer's copies (slow, late prefetches) or every SM: the same tokens, logits and copies."""
    from psr_hf.engine.token_graph import TokenGraphDecoder

    with _psr_offloaded(seed=6) as (model, ids):
        runs = [_greedy(model, TokenGraphDecoder(model, MAX_LEN, prefetch_programs=p, demand_programs=d), ids)
                for p, d in ((1, 1), (8, None), (32, 4))]
    for run in runs[1:]:
        torch.testing.assert_close(run[0], runs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(run[1], runs[0][1], rtol=0, atol=0)
        assert run[2].offload.prefetch == runs[0][2].offload.prefetch


@pytest.mark.cuda
@needs_cuda
def test_step_inputs_keep_every_steps_token_while_the_host_runs_ahead_of_the_gpu():
    from psr_hf.engine.step_inputs import StepInputs
    from psr_hf.offload.cuda_runtime import Runtime, raw_current_stream

    device = torch.device("cuda", torch.cuda.current_device())
    pair = torch.zeros(2, dtype=torch.int64, device=device)
    inputs = StepInputs(pair[0:1], pair[1:2], Runtime(device), rows=4)
    seen = torch.zeros(40, 2, dtype=torch.int64, device="cuda")
    for i in range(40):  # the GPU is held back by a sleep per step, so the host is far ahead
        torch.cuda._sleep(200_000)
        inputs.write(1000 + i, i, raw_current_stream(device))
        seen[i].copy_(pair)
    expected = torch.tensor([[1000 + i, i] for i in range(40)], dtype=torch.int64)
    torch.testing.assert_close(seen.cpu(), expected, rtol=0, atol=0)


def _read_every_row(device: str, steps: int, rows: int, interpret: bool, delay: bool = False) -> list:
    """``steps`` reads of a :class:`GraphStepInputs` of ``rows`` rows, each after its write (a ``None`` token every
    third step, which keeps the token the buffer holds), the buffers seen after each read."""
    from psr_hf.engine.step_inputs import GraphStepInputs

    pair = torch.zeros(2, dtype=torch.int64, device=device)
    inputs = GraphStepInputs(pair[0:1], pair[1:2], rows=rows)
    inputs.restart()
    seen = torch.zeros(steps + 1, 2, dtype=torch.int64, device=device)
    inputs.keep()  # changes nothing
    pair.fill_(7)
    inputs.read(interpret)
    seen[steps].copy_(pair)
    for i in range(steps):
        if delay:  # the GPU is held back, so the host is far ahead of it
            torch.cuda._sleep(200_000)
        inputs.write(None if i % 3 == 2 else 1000 + i, i)
        inputs.read(interpret)
        seen[i].copy_(pair)
    return seen.cpu().tolist()


def _expected_rows(steps: int) -> list:
    rows, token = [], None
    for i in range(steps):
        token = token if i % 3 == 2 else 1000 + i
        rows.append([token, i])
    return rows + [[7, 7]]


def test_graph_step_inputs_read_each_steps_row_and_keep_what_a_row_says_to_keep(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _read_every_row("cpu", 11, rows=4, interpret=True) == _expected_rows(11)


@pytest.mark.cuda
@needs_cuda
def test_graph_step_inputs_keep_every_steps_token_while_the_host_runs_ahead_of_the_gpu():
    assert _read_every_row("cuda", 40, rows=4, interpret=False, delay=True) == _expected_rows(40)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_a_prompt_stepped_token_by_token_on_the_device_equals_the_host_path(offloaded):
    from psr_hf.engine.token_graph import TokenGraphDecoder

    model = tiny_model("olmoe", dtype=torch.float32).to("cuda")
    ids = [5, 9, 13, 17, 21, 25, 29, 33]
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), offload=offload):
        ctl = psr_hf.controller(model)
        results = []
        for decoder in (GraphDecoder(model, MAX_LEN), TokenGraphDecoder(model, MAX_LEN)):
            ctl.reset()
            ctl.reset_stats()
            decoder.reset()
            steps = [decoder.step(t).clone() for t in ids]  # no host read between steps: the host runs ahead
            results.append((torch.stack(steps).cpu(), ctl.stats()))
    (host, host_stats), (device, device_stats) = results
    torch.testing.assert_close(device, host, rtol=0, atol=0)
    for field in STAT_FIELDS:
        np.testing.assert_array_equal(getattr(device_stats, field), getattr(host_stats, field), err_msg=field)
