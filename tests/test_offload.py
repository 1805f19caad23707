"""The offload on the CPU path: slots that follow the logical cache, copies that never change outputs.

The CPU path runs the same scheduler and slot map as CUDA, with slot buffers in ordinary memory and one copy thread
as the ordered copy stream (``OffloadConfig(device="cpu")``); ``check_slots=True`` makes every layer verify that
each slot it executes holds the expert the host store has.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.testing import FAMILIES, tiny_model
from psr_hf.offload.experts import _set_implementation
from psr_hf.offload.placement import OffloadMemoryError, _check_fit
from psr_hf.offload.links import ThreadLink
from psr_hf.offload.scheduler import ISSUED, PREFETCH, SlotScheduler
from psr_hf.policy import LogicalCache
from psr_hf.policy.traces import synthetic_trace

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

PAD = 0
POLICIES = {
    "exact_lru": RoutingConfig(policy="exact", eviction="lru", budget=0, residency=0.5),
    "exact_a_pf": RoutingConfig(policy="exact", eviction="score", budget=1, residency=0.5),
    "cp": RoutingConfig(policy="cache_prior", lam=0.2, residency=0.5),
    "psr": RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
    "psr_n2_res25": RoutingConfig(policy="psr", lam=0.3, budget=2, residency=0.25),
    "spec": RoutingConfig(policy="spec", residency=0.5),
}


def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, new=8, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, output_logits=True,
                              return_dict_in_generate=True, **kwargs)


def _run(model, config, offload, ids, new=8, **kwargs):
    """Greedy generation and a prompt forward of a freshly patched model: (tokens, step logits, prompt logits,
    logical stats); the model is unpatched afterwards."""
    psr_hf.patch(model, config, offload=offload)
    try:
        out = _generate(model, ids, new, **kwargs)
        with torch.no_grad():
            prompt = model(ids).logits
        stats = psr_hf.controller(model).stats()
    finally:
        psr_hf.unpatch(model)
    return out.sequences, torch.stack(out.logits), prompt, stats


# ---------------------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_outputs_equal_the_patched_model(family):
    model = tiny_model(family)
    config = POLICIES["psr"]
    offload = OffloadConfig(device="cpu", check_slots=True)
    # a one-token prompt, then decoding (one row, one position): every layer runs once on its slots, and the
    # logits are bitwise the non-offloaded model's
    one = _ids(1, 1, 1)
    tokens, steps, _, stats = _run(model, config, None, one, new=12)
    off_tokens, off_steps, _, off_stats = _run(model, config, offload, one, new=12)
    assert torch.equal(off_tokens, tokens) and torch.equal(off_steps, steps)
    assert off_stats.total == stats.total  # the same decisions, copy for logical copy
    # a 6-token prompt's experts exceed the 8 slots of a layer: the layer runs its experts in groups of 8 and adds
    # the groups' outputs, equal to rounding (the sum over an expert's top-K is split), and the same tokens
    ids = _ids(2, 1, 6)
    tokens, steps, prompt, _ = _run(model, config, None, ids)
    off_tokens, off_steps, off_prompt, _ = _run(model, config, offload, ids)
    assert torch.equal(off_tokens, tokens)
    torch.testing.assert_close(off_prompt, prompt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off_steps, steps, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_executes_the_right_experts_from_its_slots(name):
    """check_slots: each executed expert sits in a slot holding exactly its weights (random prompts, a batch of
    two left-padded rows, then one row decoding); outputs equal the non-offloaded model's."""
    model = tiny_model("olmoe")
    config = POLICIES[name]
    ids = _ids(2, 2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = PAD
    offload = OffloadConfig(device="cpu", check_slots=True, max_in_flight=1, copy_delay_ms=0.2)
    ref = _run(model, config, None, ids, attention_mask=mask)
    got = _run(model, config, offload, ids, attention_mask=mask)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    one = _ids(3, 1, 5)
    assert torch.equal(_run(model, config, offload, one, new=10)[0], _run(model, config, None, one, new=10)[0])


def test_a_block_that_fits_in_the_slots_is_bitwise_the_patched_model():
    model = tiny_model("olmoe")
    config = RoutingConfig(policy="psr", residency=1.0)  # 16 slots of 16 experts: one group
    ids = _ids(4, 2, 9)
    ref = _run(model, config, None, ids, new=4)
    got = _run(model, config, OffloadConfig(device="cpu"), ids, new=4)
    assert torch.equal(got[2], ref[2]) and torch.equal(got[1], ref[1])


def test_copy_timing_never_changes_tokens_or_decisions():
    model = tiny_model("qwen3_5_moe_text")
    config = POLICIES["psr_n2_res25"]
    ids = _ids(5, 1, 4)
    runs = [_run(model, config, OffloadConfig(device="cpu", max_in_flight=m, copy_delay_ms=d), ids, new=12)
            for m, d in ((1, 0.0), (2, 1.0), (4, 0.0), (1, 3.0))]
    for tokens, steps, _, stats in runs[1:]:
        assert torch.equal(tokens, runs[0][0])
        assert torch.equal(steps, runs[0][1])
        assert stats.total == runs[0][3].total


# ---------------------------------------------------------------------------------------------- statistics
def test_copy_statistics_account_for_every_copy():
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload=OffloadConfig(device="cpu", max_in_flight=1, copy_delay_ms=0.5))
    try:
        ctl = psr_hf.controller(model)
        with torch.no_grad():
            model.generate(_ids(6, 1, 1), max_new_tokens=1, do_sample=False, pad_token_id=PAD)
            ctl.reset_stats()
            model.generate(_ids(7, 1, 1), max_new_tokens=24, do_sample=False, pad_token_id=PAD)
        s = ctl.stats()
        off = s.offload
        per_expert = ctl.memory().bytes_per_expert
    finally:
        psr_hf.unpatch(model)
    assert off.tokens == s.total["tokens"] == 24  # the prompt token and 23 decode steps
    issued_prefetch = off.prefetch - off.dropped
    assert off.bytes == (off.demand + issued_prefetch + off.warm) * per_expert
    # every issued prefetch is used in time, used late, evicted unused, or still in its slot unused
    assert off.prefetch_in_time + off.prefetch_late + off.prefetch_unused <= issued_prefetch
    assert off.prefetch > 0 and off.demand > 0 and off.warm > 0  # a one-token prompt: one block, then decode
    assert off.wait_ms >= 0
    d = off.to_dict()
    assert d["copies_per_token"] == pytest.approx((off.demand + issued_prefetch) / 24)


def test_memory_reports_the_slot_fraction_and_unpatch_restores_every_tensor():
    model = tiny_model("deepseek_v3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    devices = {k: v.device for k, v in model.state_dict().items()}
    implementation = model.config._experts_implementation
    psr_hf.patch(model, RoutingConfig(policy="exact", residency=0.25), offload="cpu")
    mem = psr_hf.controller(model).memory()
    experts = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Experts"]
    assert mem.capacity == 4 and mem.num_experts == 16 and mem.num_layers == len(experts) == 3
    assert mem.device_fraction == pytest.approx(0.25)
    assert mem.expert_bytes_full == sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for m in experts)
    assert mem.host_store_bytes >= mem.expert_bytes_full
    assert model.config._experts_implementation == "psr_offload"
    psr_hf.unpatch(model)
    after = model.state_dict()
    assert model.config._experts_implementation == implementation
    assert all(not hasattr(m, "_psr_offload") for m in experts)
    assert set(after) == set(before)
    for k in before:
        assert after[k].device == devices[k] and torch.equal(after[k], before[k]), k


def test_reconfigure_changes_policy_and_slots_without_reoffloading():
    model = tiny_model("qwen3_next")
    ids = _ids(8, 1, 3)
    target = RoutingConfig(policy="cache_prior", lam=0.3, residency=0.25)
    ref = _run(model, target, OffloadConfig(device="cpu"), ids)
    psr_hf.patch(model, POLICIES["exact_lru"], offload=OffloadConfig(device="cpu"))
    try:
        ctl = psr_hf.controller(model)
        store = ctl.offload.placement.buffers[0]
        _generate(model, ids)
        ctl.reconfigure(target)
        assert ctl.memory().capacity == 4 and ctl.offload.placement.buffers[0] is store
        out = _generate(model, ids)
    finally:
        psr_hf.unpatch(model)
    assert torch.equal(out.sequences, ref[0])


def test_calibrating_an_offloaded_model_equals_calibrating_it_resident():
    model = tiny_model("olmoe")
    texts = [_ids(9, 1, 12)[0].tolist(), _ids(10, 1, 9)[0].tolist()]
    ref = psr_hf.calibrate(model, texts)
    psr_hf.patch(model, POLICIES["psr"], offload=OffloadConfig(device="cpu", check_slots=True))
    try:
        got = psr_hf.calibrate(model, texts)
    finally:
        psr_hf.unpatch(model)
    assert np.array_equal(got.expert_counts, ref.expert_counts)
    np.testing.assert_allclose(got.delta, ref.delta, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- the scheduler alone
class ManualLink:
    """An ordered copy stream whose copies complete only when the test says so (``release``); copies are real."""

    def __init__(self):
        self.issued, self.completed = [], 0
        self.wait_s = 0.0

    def copy(self, seq, layer, slot, expert, dst, src):
        assert seq == len(self.issued)
        self.issued.append((seq, dst, src))

    def done(self, seq):
        return seq < self.completed

    def complete(self):
        return self.completed - 1

    def release(self, count=None):
        stop = len(self.issued) if count is None else min(self.completed + count, len(self.issued))
        for job, dst, src in self.issued[self.completed : stop]:
            for d, s in zip(dst, src):
                d.copy_(s)
        self.completed = stop

    def wait(self, seq):
        self.release(seq + 1 - self.completed)

    def read_done(self, layer):
        pass

    def synchronize(self):
        self.release()

    def close(self):
        self.release()

    def check(self):  # its copies never fail
        pass

    def take_failures(self):
        return []


def _scheduler(link, layers=1, experts=6, capacity=3, max_in_flight=1):
    src = [[[torch.full((2,), float(10 * layer + e))] for e in range(experts)] for layer in range(layers)]
    slots = [torch.zeros(capacity, 2) for _ in range(layers)]
    dst = [[[slots[layer][s]] for s in range(capacity)] for layer in range(layers)]
    return SlotScheduler(layers, experts, capacity, link, max_in_flight, 8, src, dst), slots


def _two_prefetches():
    """Warm set 0, 1, 2 in place; prefetches of 3 (over 0) and 4 (over 1) queued, then one boundary: 3 is issued,
    4 waits behind it (max_in_flight=1)."""
    link = ManualLink()
    sched, slots = _scheduler(link)
    sched.new_sequence([np.array([0, 1, 2])])
    link.release()
    resident = np.zeros(6, dtype=bool)
    sched.insert(0, 3, 0, PREFETCH, resident)
    sched.insert(0, 4, 1, PREFETCH, resident)
    sched.pump()
    return link, sched, slots, resident


def test_a_queued_prefetch_whose_slot_is_reassigned_is_dropped():
    link, sched, slots, resident = _two_prefetches()
    states = sched.layers[0].job_state  # slot 0: the prefetch of 3, slot 1: of 4
    assert states[0] == ISSUED and states[1] != ISSUED
    sched.pump()  # the first is still in flight: nothing more is issued
    assert states[1] != ISSUED
    queued = len(link.issued)
    sched.insert(0, 5, 4, PREFETCH, resident)  # 4 evicted again before its copy was issued: 5 takes slot 1
    assert sched.counters.dropped == 1 and sched.layers[0].slot_expert[1] == 5 and len(link.issued) == queued
    link.release()
    sched.pump()
    sched.pump()
    link.release()
    assert [int(sched.layers[0].slot_expert[s]) for s in range(3)] == [3, 5, 2]
    assert all(torch.equal(slots[0][s], torch.full((2,), float(e))) for s, e in enumerate((3, 5, 2)))
    assert len(link.issued) == 3 + 2  # warm set + the two prefetches that were not dropped


def test_a_prefetch_needed_before_it_was_issued_is_issued_at_once_and_counted_late():
    link, sched, _, _ = _two_prefetches()  # 3 issued, 4 queued
    link.release()
    sched.load(0, np.array([3, 4]), None)  # the layer executes both: 3 arrived, 4 is issued now
    assert sched.counters.prefetch_in_time == 1 and sched.counters.prefetch_late == 1
    assert sched.layers[0].job_state[1] == ISSUED
    sched.wait(0)
    assert link.completed == len(link.issued)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_decoding_slots_mirror_the_logical_cache_on_random_traces(policy):
    """One row decoding: after every step each layer's slots hold exactly the row's logical cache."""
    config = POLICIES[policy]
    L, E, K, T = 4, 16, 4, 60
    trace = synthetic_trace(T, L, E, seed=3)
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, rows=1)
    link = ThreadLink(delay_ms=0.0)
    src = [[[torch.full((1,), float(e))] for e in range(E)] for _ in range(L)]
    slots = [torch.full((cache.capacity, 1), -1.0) for _ in range(L)]
    dst = [[[slots[layer][s]] for s in range(cache.capacity)] for layer in range(L)]
    sched = SlotScheduler(L, E, cache.capacity, link, 2, 4, src, dst)
    sched.new_sequence([cache.resident(layer) for layer in range(L)])
    inserts = config.needs_pregate
    try:
        for t in range(T):
            z, g, tok = trace.scores[t][:, None, None, :], trace.pregate[t][:, None, None, :], trace.tokens[t : t + 1, None]
            for layer in range(L):
                if inserts and layer:
                    pg = g[layer] if config.executes_pregate else None
                    plan = cache.select(layer, z[layer], tok, pregate=pg)
                else:
                    plan = cache.step(layer, z[layer], g[layer] if layer else None, tok)
                resident = cache.state[layer, 0, 3] != 0
                chosen = plan.selected[0, 0].copy()
                sched.decode_select(layer, plan, chosen, resident)
                sched.wait(layer)
                link.synchronize()
                held = sched.layers[layer].slot_expert
                assert set(held.tolist()) == set(cache.resident(layer).tolist())
                assert all(slots[layer][sched.layers[layer].expert_slot[e], 0] == e for e in chosen)
                sched.pump()
                if inserts and layer + 1 < L:
                    plan = cache.prefetch(layer + 1, g[layer + 1], tok)
                    sched.decode_prefetch(layer + 1, plan, cache.state[layer + 1, 0, 3] != 0)
                    assert set(sched.layers[layer + 1].slot_expert.tolist()) == set(cache.resident(layer + 1).tolist())
        stats = sched.stats()
        logical = cache.stats()
        assert stats.demand == logical.demand.sum()
        assert stats.prefetch == logical.prefetch.sum()
    finally:
        link.close()


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, message", [
    (dict(device="gpu"), "device='gpu' must be 'cuda', 'cuda:N' or 'cpu'"),
    (dict(max_in_flight=0), "max_in_flight=0 must be an int >= 1"),
    (dict(copy_delay_ms=-1.0), "copy_delay_ms=-1.0 must be a finite number >= 0"),
    (dict(pin_memory="yes"), "pin_memory='yes' must be True or False"),
    (dict(copy_api="cupy"), "copy_api='cupy' must be one of 'auto', 'cuda-python', 'torch'"),
    (dict(device="cpu", copy_api="cuda-python"), "device='cpu' copies with a thread: leave copy_api='auto'"),
])
def test_bad_offload_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OffloadConfig(**kwargs)


def test_absurd_offload_numbers_are_refused():
    with pytest.raises(ValueError, match=r"max_in_flight=1000000000 must be an int >= 1 and <= 65536"):
        OffloadConfig(device="cpu", max_in_flight=10**9)
    with pytest.raises(ValueError, match=r"copy_delay_ms=1000000000.0 must be a finite number >= 0 and <= 60000"):
        OffloadConfig(device="cpu", copy_delay_ms=1e9)


def test_bad_offload_arguments_fail_before_anything_moves():
    model = tiny_model("olmoe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown OffloadConfig field"):
        psr_hf.patch(model, POLICIES["psr"], offload={"device": "cpu", "slots": 3})
    with pytest.raises(ValueError, match="offload must be a psr_hf.OffloadConfig"):
        psr_hf.patch(model, POLICIES["psr"], offload=3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            psr_hf.patch(model, POLICIES["psr"], offload="cuda:0")
    assert getattr(model, "_psr_hf_controller", None) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.config._experts_implementation != "psr_offload"


def test_a_model_that_does_not_fit_gets_the_numbers():
    gib = 1024**3
    with pytest.raises(OffloadMemoryError, match=r"needs 3\.00 GiB more there .* expert slots 2\.00 GiB\) but 1\.50 GiB"):
        _check_fit(torch.device("cuda", 0), gib, 2 * gib, 0, 5 * gib, free=int(1.5 * gib), total=8 * gib)


def test_the_experts_implementation_refuses_an_experts_module_that_is_not_offloaded():
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload="cpu")
    other = tiny_model("olmoe")
    _set_implementation(other.config, "psr_offload")
    try:
        with pytest.raises(RuntimeError, match="is not offloaded by psr_hf"):
            other(_ids(1, 1, 3))
    finally:
        psr_hf.unpatch(model)


def test_reconfigure_from_a_policy_without_prefetch_to_one_with_it():
    """The pre-gate is computed per call, so a model patched with exact+LRU can switch to psr or spec."""
    model = tiny_model("olmoe")
    ids = _ids(11, 1, 4)
    expected = {name: _run(model, POLICIES[name], "cpu", ids)[0] for name in ("psr", "spec")}
    psr_hf.patch(model, POLICIES["exact_lru"], offload="cpu")
    try:
        ctl = psr_hf.controller(model)
        for name in ("psr", "spec"):
            ctl.reconfigure(POLICIES[name])
            assert torch.equal(_generate(model, ids).sequences, expected[name])
            off = ctl.stats().offload
            assert off.prefetch_in_time + off.prefetch_late + off.prefetch_unused <= off.prefetch - off.dropped
    finally:
        psr_hf.unpatch(model)


def test_a_long_prompt_copies_each_expert_at_most_once_per_layer():
    """A block whose experts exceed the slots runs them in groups of C: no expert is copied twice for one block
    (chunks of positions would reload the same experts again and again)."""
    model = tiny_model("olmoe")
    config = RoutingConfig(policy="exact", residency=0.25)  # 4 slots, top-4 of 16 experts
    ids = _ids(12, 1, 64)
    ref = _run(model, config, None, ids, new=1)
    psr_hf.patch(model, config, offload=OffloadConfig(device="cpu", check_slots=True))
    try:
        with torch.no_grad():
            logits = model(ids).logits
        off = psr_hf.controller(model).stats().offload
        L, E = psr_hf.controller(model).num_layers, psr_hf.controller(model).num_experts
    finally:
        psr_hf.unpatch(model)
    torch.testing.assert_close(logits, ref[2], rtol=1e-5, atol=1e-5)
    assert off.demand <= L * E and off.demand + off.warm > L * 4  # each expert at most once, and more than the slots


def test_beam_search_and_several_return_sequences_offloaded_equal_the_patched_model():
    """Beam search reorders the rows (one logical cache per beam, one set of slots per layer)."""
    model = tiny_model("olmoe")
    config = POLICIES["psr"]
    ids = _ids(13, 1, 5)
    kwargs = dict(num_beams=3, num_return_sequences=2, new=6)
    ref = _run(model, config, None, ids, **kwargs)
    got = _run(model, config, OffloadConfig(device="cpu", check_slots=True, max_in_flight=1), ids, **kwargs)
    assert torch.equal(got[0], ref[0])
    assert got[3].total == pytest.approx(ref[3].total, rel=1e-6)
