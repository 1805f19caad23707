"""The slot scheduler's compiled bookkeeping (``psr_hf.offload.slot_book``) makes exactly the decisions of the
Python scheduler it replaced (``tests/scheduler_reference.py``): driven in lockstep over one modelled ordered copy
stream, both issue the same copies in the same order, wait for the same ones, keep the same slot maps and count
the same statistics, on the decode path of every policy, on random sequences of every other call, with the
rings growing, and after a copy that fails to issue."""

from __future__ import annotations

import numpy as np
import pytest

import scheduler_reference as ref
from psr_hf import RoutingConfig
from psr_hf.offload.scheduler import DEMAND, PREFETCH, SlotScheduler
from psr_hf.policy import LogicalCache
from psr_hf.policy.traces import synthetic_trace

POLICIES = {
    "exact_lru": RoutingConfig(policy="exact", eviction="lru", budget=0, residency=0.5),
    "exact_a_pf": RoutingConfig(policy="exact", eviction="score", budget=1, residency=0.5),
    "spec": RoutingConfig(policy="spec", residency=0.5),
    "cache_prior": RoutingConfig(policy="cache_prior", lam=0.3, residency=0.5),
    "psr_n1": RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
    "psr_n4_25": RoutingConfig(policy="psr", lam=0.2, budget=4, residency=0.25),
}


class _Stream:
    """One ordered copy stream shared by both schedulers' links: the first ``completed`` copies are complete."""

    def __init__(self):
        self.completed = 0


class _Link:
    """A link that records what it is asked; ``old``: the reference's API (a copy object), else issue numbers."""

    def __init__(self, stream: _Stream, old: bool, fail_at: int = -1):
        self.stream, self.old, self.fail_at = stream, old, fail_at
        self.issued: list[tuple[int, int, int]] = []
        self.waits: list[int] = []
        self.wait_s = 0.0

    def copy(self, *args):
        if self.old:
            job = args[0]
            name, seq = (job.layer, job.slot, job.expert), len(self.issued)
        else:
            seq, layer, slot, expert = args[:4]
            name = (layer, slot, expert)
        if len(self.issued) == self.fail_at:
            self.fail_at = -1
            raise OSError("modelled copy failure")
        if self.old:
            args[0].event = seq
        self.issued.append(name)

    def _seq(self, job) -> int:
        return job.event if self.old else job

    def done(self, job) -> bool:
        return self._seq(job) < self.stream.completed

    def complete(self) -> int:
        return min(self.stream.completed, len(self.issued)) - 1

    def wait(self, job):
        self.waits.append(self._seq(job))

    def read_done(self, layer):
        pass

    def synchronize(self):
        self.stream.completed = max(self.stream.completed, len(self.issued))

    def check(self):
        pass

    def take_failures(self):
        return []

    def close(self):
        pass


def _pair(L, E, C, max_in_flight, fail_at=-1):
    stream = _Stream()
    links = _Link(stream, old=True, fail_at=fail_at), _Link(stream, old=False, fail_at=fail_at)
    src = [[[None] for _ in range(E)] for _ in range(L)]
    dst = [[[None] for _ in range(C)] for _ in range(L)]
    old = ref.SlotScheduler(L, E, C, links[0], max_in_flight, 4, src, dst)
    new = SlotScheduler(L, E, C, links[1], max_in_flight, 4, src, dst)
    return stream, old, new


def _same(old, new, where=""):
    lo, ln = old.link, new.link
    assert ln.issued == lo.issued, where
    assert ln.waits == lo.waits, where
    assert new.counters == old.counters, where
    for layer, (a, b) in enumerate(zip(old.layers, new.layers)):
        assert b.slot_expert.tolist() == a.slot_expert.tolist(), (where, layer)
        assert b.expert_slot.tolist() == a.expert_slot.tolist(), (where, layer)
        assert b.last_use.tolist() == a.last_use.tolist(), (where, layer)
        kinds = [-1 if job is None else job.kind for job in a.jobs]
        assert b.job_kind.tolist() == kinds, (where, layer)
        states = [b.job_state[s] for s in range(len(kinds)) if kinds[s] >= 0]
        assert states == [job.state for job in a.jobs if job is not None], (where, layer)


def _release(stream, rng, issued):
    stream.completed = min(issued, stream.completed + int(rng.integers(0, 4)))


@pytest.mark.parametrize("max_in_flight", [1, 2, 4])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_decode_path_makes_the_reference_decisions(policy, max_in_flight):
    config = POLICIES[policy]
    L, E, K, T = 4, 16, 4, 40
    trace = synthetic_trace(T, L, E, seed=5)
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, rows=1)
    stream, old, new = _pair(L, E, cache.capacity, max_in_flight)
    rng = np.random.default_rng(max_in_flight)
    warm = [cache.resident(layer) for layer in range(L)]
    old.new_sequence(warm)
    new.new_sequence(warm)
    _same(old, new, "warm")
    inserts = config.needs_pregate
    for t in range(T):
        z, g, tok = trace.scores[t][:, None, None, :], trace.pregate[t][:, None, None, :], trace.tokens[t : t + 1, None]
        for layer in range(L):
            if inserts and layer:
                plan = cache.select(layer, z[layer], tok, pregate=g[layer] if config.executes_pregate else None)
            else:
                plan = cache.step(layer, z[layer], g[layer] if layer else None, tok)
            resident = cache.state[layer, 0, 3]  # the float view the engine passes
            chosen = plan.selected[0, 0].copy()
            old.decode_select(layer, plan, chosen, resident)
            new.decode_select(layer, plan, chosen, resident)
            old.wait(layer)
            new.wait(layer)
            _same(old, new, f"select t={t} layer={layer}")
            _release(stream, rng, len(old.link.issued))
            if inserts and layer + 1 < L:
                plan = cache.prefetch(layer + 1, g[layer + 1], tok)
                old.decode_prefetch(layer + 1, plan, cache.state[layer + 1, 0, 3])
                new.decode_prefetch(layer + 1, plan, cache.state[layer + 1, 0, 3])
            old.pump()
            new.pump()
            _same(old, new, f"pump t={t} layer={layer}")
        if t == T // 2:
            assert new.stats() == old.stats()
            old.reset_counters()
            new.reset_counters()
    assert new.stats() == old.stats()
    assert old.link.issued  # the trace copied something


@pytest.mark.parametrize("seed", range(6))
def test_random_calls_make_the_reference_decisions(seed):
    rng = np.random.default_rng(seed)
    L, E, C = 2, 10, int(rng.integers(2, 6))
    stream, old, new = _pair(L, E, C, int(rng.integers(1, 4)))

    def both(name, *args):
        results = []
        for sched in (old, new):
            try:
                results.append(getattr(sched, name)(*args))
            except RuntimeError as error:
                results.append(type(error))
        assert results[0] == results[1], name
        _same(old, new, name)

    both("new_sequence", [rng.permutation(E)[: rng.integers(0, C + 1)] for _ in range(L)])
    for step in range(300):
        layer = int(rng.integers(L))
        op = rng.integers(10)
        resident = (rng.random(E) < C / E).astype(bool)
        if op <= 2:
            both("insert", layer, int(rng.integers(E)), int(rng.integers(-1, E)), int(rng.choice([DEMAND, PREFETCH])),
                 resident if rng.random() < 0.7 else None)
        elif op == 3:
            group = rng.permutation(E)[: rng.integers(1, C + 1)]
            both("load", layer, group, resident if rng.random() < 0.5 else None)
            both("wait", layer)
        elif op == 4:
            both("reconcile", layer, resident)
        elif op == 5:
            both("pump")
        elif op == 6:
            both("wait", layer)
        elif op == 7 and rng.random() < 0.2:
            both("refresh", layer)
        elif op == 8 and rng.random() < 0.2:
            both("reset_counters")
        elif op == 9 and rng.random() < 0.1:
            if rng.random() < 0.5:
                both("recover")
            else:
                both("new_sequence", [rng.permutation(E)[: rng.integers(0, C + 1)] for _ in range(L)])
        _release(stream, rng, len(old.link.issued))
    both("stats")


def test_the_rings_wrap_grow_and_keep_their_order():
    """Prefetches queued and used late behind copies that never complete: the queue ring is compacted, the ring of copies in flight grows, and what is issued, then and once the copies complete, is
    what the reference issues."""
    L, E, C = 3, 40, 8
    stream, old, new = _pair(L, E, C, 1)
    rng = np.random.default_rng(0)
    resident = np.zeros(E, dtype=bool)
    flying = new._flying.shape[0]
    for _ in range(1500):
        layer, expert, evicted = int(rng.integers(L)), int(rng.integers(E)), int(rng.integers(-1, E))
        for sched in (old, new):
            sched.insert(layer, expert, evicted, PREFETCH, resident)
        if rng.random() < 0.5:
            group = np.flatnonzero(new.layers[layer].expert_slot >= 0)[:C]
            for sched in (old, new):
                sched.load(layer, group, None)
                sched.wait(layer)
        if rng.random() < 0.3:
            old.pump()
            new.pump()
    assert new.counters.prefetch > 2 * new._queue.shape[0]  # more queued than the ring holds: compacted
    assert new._flying.shape[0] > flying
    _same(old, new, "queued")
    for _ in range(100):
        stream.completed = len(old.link.issued)
        old.pump()
        new.pump()
    _same(old, new, "drained")


def test_a_copy_that_fails_to_issue_leaves_what_the_reference_leaves():
    L, E, C = 2, 8, 3
    stream, old, new = _pair(L, E, C, 2, fail_at=3)
    warm = [np.array([0, 1, 2]), np.array([3])]
    for sched in (old, new):
        with pytest.raises(RuntimeError, match="could not be issued"):
            sched.new_sequence(warm)
    _same(old, new, "failed")
    old.recover()
    new.recover()
    _same(old, new, "recovered")
    old.new_sequence(warm)
    new.new_sequence(warm)
    _same(old, new, "again")
