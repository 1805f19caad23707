"""The logical cache's state kept on the device for :mod:`psr_hf.engine.device_decisions`: :class:`DeviceState`.

The arrays are the numba kernels' own (``[L, 6, E]`` float64 planes, ``[L, 8]`` float64 counters of one row), so
that :meth:`DeviceState.upload` and :meth:`DeviceState.download` hand the state between a
:class:`~psr_hf.policy.LogicalCache` and the device with one copy each way. Besides them: the calibration the
decisions read (bonus scale, token prior in its CSR form, fallback prior), the pre-gate each layer stored for the
next, the slot maps of an offloaded model, the per-layer outputs (selection, slots, copy lists, plans) and a
record of every position's scores for the host's statistics.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import device_decisions as D


class DeviceState:
    """Device arrays of one row's logical cache for ``cache`` (a :class:`~psr_hf.policy.LogicalCache` whose
    kernels' config the decisions follow), on ``device``. ``scores``, ``token``, ``position``: the buffers the
    decision kernel reads (``[>= E]`` joint scores ``z | g_next``, float32, or a softmax router's logits in their
    own dtype, which the kernel widens to float32 as it loads them; int64 token and position; default: own
    buffers, filled by the caller). ``offloaded``: keep slot maps of ``capacity`` slots and write copy lists.
    ``max_positions``: positions the score record holds (0: no record). ``num_warps``: the decision kernel's warps
    (8: faster than 4 for every variant timed, on an H100 psr 5.71 against 6.11 us per layer and Cache-Prior 3.97
    against 4.35, on an H200 psr offloaded with the token prior 9.93 against 12.39:
    benchmarks/engine/h{100,200}/kernels*/decide_kernel.txt; compiled, fewer instructions and barriers than at 4,
    benchmarks/engine/decide_kernel_sass.py)."""

    def __init__(self, cache: Any, device: torch.device | str, *, scores: torch.Tensor | None = None,
                 token: torch.Tensor | None = None, position: torch.Tensor | None = None, offloaded: bool = False,
                 max_positions: int = 0, num_warps: int = 8):
        device = torch.device(device)
        self.device = device
        self.cache = cache
        L, E, K = cache.num_layers, cache.num_experts, cache.top_k
        C, budget, window = cache.capacity, cache.budget, min(cache.window, cache.num_experts)
        self.num_layers, self.num_experts, self.top_k, self.capacity = L, E, K, C
        self.offloaded = bool(offloaded)
        ks = cache.kernel_settings()
        if ks.STATE_PLANES != D.N_PLANES or ks.COUNTERS != D.R_SIZE:
            raise RuntimeError("the device kernel's state layout differs from the numba kernels'")

        f64, f32, i64, i32 = torch.float64, torch.float32, torch.int64, torch.int32
        new = lambda shape, dtype, fill=0: torch.full(shape, fill, dtype=dtype, device=device)  # noqa: E731
        self.state = new((L, D.N_PLANES, E), f64)
        self.counters = new((L, D.R_SIZE), f64)
        self.saved = new((L, E), f32)
        self.delta = torch.tensor(ks.delta, dtype=f64, device=device)
        # lam, decay_fast, decay_slow, flush: read by the kernel from memory, in float64 as numba computes them
        self.params = torch.tensor([ks.lam, ks.decay_fast, ks.decay_slow, ks.flush], dtype=f64, device=device)
        self.fallback = torch.tensor(ks.fallback_prior, dtype=f64, device=device)
        vocab = ks.vocab_size
        seen = ks.token_seen if vocab else np.zeros(1, dtype=np.int64)
        self.seen = torch.tensor(seen, dtype=i64, device=device)
        indptr, experts, values = ks.prior_indptr, ks.prior_experts, ks.prior_values
        self.indptr = torch.tensor(indptr if indptr.size else np.zeros(1, np.int64), dtype=i64, device=device)
        self.prior_experts = torch.tensor(experts.astype(np.int32) if experts.size else np.zeros(1, np.int32),
                                          dtype=i32, device=device)
        self.prior_values = torch.tensor(values if values.size else np.zeros(1, np.float32), dtype=f32, device=device)
        self.scores = scores if scores is not None else new((2 * E,), f32)
        self.token = token if token is not None else new((1,), i64)
        self.position = position if position is not None else new((1,), i64)
        self.ids = new((K,), i64)
        self.slot_ids = new((K,), i64)
        self.slot_of = new((L, E), i32, -1)
        self.expert_of = new((L, C), i32, -1)
        self.copy_width = D.copy_list_width(K, budget)
        self.copies = new((L, self.copy_width), i32)
        W = cache.plan_layout.width
        self.plan_width = W
        self.plans = new((L, W), i64, -1)
        self.pplans = new((L, W), i64, -1)
        self.max_positions = int(max_positions)
        self.record = new((max(self.max_positions, 1), L, E), f32)  # [T, L, E] every position's scores z
        self.record_plans = new((max(self.max_positions, 1), L, W), i64, -1)  # [T, L, W] and its plans
        self.error = new((1,), i32)
        self._settings = {
            "vocab": vocab, "num_warps": int(num_warps),
            "constexprs": dict(
                E=E, BE=D._pow2(E), L=L, K=K, C=C, BC=D._pow2(C), BUDGET=budget, BP=D._pow2(max(budget, 1)),
                WINDOW=window, TOP_J=ks.top_j, W=W, BW=D._pow2(W), CW=self.copy_width,
                BCW=D._pow2(self.copy_width), RUNNING=ks.running, INSERTS=ks.inserts,
                DISTANCE=ks.distance, BIASED=ks.biased,
                EXEC_PREGATE=ks.executes_pregate, LRU=ks.lru, HAS_PRIOR=vocab > 0,
                OFFLOADED=self.offloaded, RECORD=self.max_positions > 0, BIG=1 << 30,
            ),
        }

    def kernel_settings(self) -> dict[str, Any]:
        return self._settings

    def decide(self, layer: int) -> None:
        """Layer ``layer``'s decisions (part 2 of it, part 1 of layer ``layer + distance``):
        :func:`device_decisions.decide_layer`."""
        D.decide_layer(layer, self, self._settings)

    # ------------------------------------------------------------------ hand-over
    def upload(self, row: int = 0, slots: np.ndarray | None = None) -> None:
        """The cache's state and counters of ``row`` to the device (``slots``: ``[L, E]`` int slot of each expert,
        -1 for none, of an offloaded model); the error word cleared."""
        cache = self.cache
        self.state.copy_(torch.from_numpy(np.ascontiguousarray(cache.state[:, row])))
        self.counters.copy_(torch.from_numpy(np.ascontiguousarray(cache.counters[:, row])))
        self.error.zero_()
        self.copies.zero_()
        if slots is not None:
            slot_of = np.asarray(slots, dtype=np.int32)
            expert_of = np.full((self.num_layers, self.capacity), -1, dtype=np.int32)
            for layer in range(self.num_layers):
                held = np.flatnonzero(slot_of[layer] >= 0)
                expert_of[layer, slot_of[layer, held]] = held
            self.slot_of.copy_(torch.from_numpy(slot_of))
            self.expert_of.copy_(torch.from_numpy(expert_of))

    def download(self, row: int = 0) -> None:
        """The device's state and counters into the cache's ``row`` (waits for the device)."""
        cache = self.cache
        cache.state[:, row] = self.state.cpu().numpy()
        cache.counters[:, row] = self.counters.cpu().numpy()

    def check(self) -> None:
        """``RuntimeError`` if a decision found bad input (the state was left as it was from that layer on)."""
        code = int(self.error.item())
        if code == D.ERR_SCORES:
            raise RuntimeError("psr_hf device routing: a router produced NaN or +inf scores, or fewer finite scores "
                               "than top_k; the sequence's routing stopped there")
        if code == D.ERR_TOKEN:
            raise RuntimeError("psr_hf device routing: a token id outside the calibration's vocabulary")
        if code == D.ERR_NO_SLOT:
            raise RuntimeError("psr_hf device routing: no free slot for an insertion")
