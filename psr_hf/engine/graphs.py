"""The engine's batch-1 decoder replayed as CUDA graphs: :class:`GraphDecoder`, the same decode step as the eager
:class:`~psr_hf.engine.decoder.Decoder` (the same functions of :mod:`psr_hf.engine.layers` and
:mod:`psr_hf.engine.moe` in the same order on the same static buffers, routed by the same controller calls).

Per MoE layer ``m``: graph A_m (the dense layers before it, its attention block, router logits and scores, and
their copy into a pinned host buffer), then on the host the decode handle's ``select``, the launch of graph B_m (the
execution weights, the slot MoE, the shared experts and the residual) and only then its ``prefetch(m + 1)``
and the expert store's ``decode_done(m)``; graph C runs the final norm and the lm_head. B_m and A_{m+1} are
captured as one graph (``merge=True``), launched through raw runtime calls where cuda-python imports, on the
caller's current stream in capture order. ``graphs=False`` runs the same bodies eagerly (the CPU tests compare it
with ``Decoder``). The schedule, what capture touches, and why nothing the warm-up writes is read:
docs/engine.md, "Inside the engine".
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence, Union

import numpy as np
import torch

from psr_hf.hf.patching import controller as _controller
from .decoder import DecoderBase, moe_layers_of
from .families import build_layers
from .layers import DecodeLayers
from psr_hf.offload import cuda_runtime
from psr_hf.offload.cuda_runtime import HostEvent, Runtime, raw_current_stream
from .moe import check_experts_module, choose_backend, new_workspace, triton_available
from .slot_moe import SlotMoe, slot_moe
from .step_inputs import StepInputs
from .grad_off import grad_off

logger = logging.getLogger(__name__)

#: one token id: an int, or a one-element tensor, array, list or tuple
OneToken = Union[int, torch.Tensor, np.ndarray, Sequence[int]]


class GraphDecoder(DecoderBase):
    """Batch-1 decoder of a model patched by :func:`psr_hf.patch` (resident or offloaded) replayed as CUDA graphs
    (``graphs=True``, CUDA only) or run eagerly with the same buffers and order (``graphs=False``). Same public
    methods as :class:`~psr_hf.engine.decoder.Decoder`: :meth:`step`, :meth:`prefill`, :meth:`generate_greedy`,
    :meth:`reset`. ``warmup``: eager runs of every graph body on the capture stream before capture.
    ``compile``: the attention blocks through ``torch.compile`` (:meth:`DecodeLayers.compile_blocks`: the
    norms, RoPE and softmax fused into a few kernels, compiled once on the first warm-up, before capture), and a
    softmax router's execution weights (:meth:`DecodeLayers.compile_routing`); None
    (default): on CUDA when triton imports. ``merge``: B_m and A_{m+1} captured as one graph (one launch per MoE
    layer; False: one graph per body, the same kernels in the same order). ``absorb_mla``, ``gated_delta_kernel``,
    ``attention_kernels``, ``dense_fp8``: the families' own options, as :class:`~psr_hf.engine.decoder.Decoder` takes them (the
    Triton kernels compile in the warm-up, before capture)."""

    def __init__(self, model: torch.nn.Module, max_len: int, *, graphs: bool = True, absorb_mla: bool = True,
                 backend: str = "auto", warmup: int = 2, compile: bool | None = None, merge: bool = True,
                 gated_delta_kernel: bool | None = None, attention_kernels: bool | None = None,
                 dense_fp8: bool | None = None):
        self.model = model
        self.controller = ctl = _controller(model)
        self.decode_handle = ctl.decode_handle()
        L = build_layers(model, max_len, absorb_mla=absorb_mla, gated_delta_kernel=gated_delta_kernel,
                         attention_kernels=attention_kernels, dense_fp8=dense_fp8)
        self.layers: DecodeLayers = L
        self.device = L.device
        self.graphs = bool(graphs)
        self.cuda = self.device.type == "cuda"
        if self.graphs and not self.cuda:
            raise ValueError(f"GraphDecoder(graphs=True) needs a model on a CUDA device, this one is on {self.device}; "
                             "use graphs=False (the same step, eager) or the eager Decoder")
        if not any(L.is_moe(d) for d in range(L.num_layers)):
            raise ValueError("GraphDecoder needs a model with MoE layers")
        self.moe_layers = moe_layers_of(L, ctl)
        self.backend = choose_backend(self.device, backend)
        if compile is None:  # auto: on CUDA when inductor can generate code (triton)
            compile = self.cuda and triton_available()[0]
        if compile:
            L.compile_blocks()
            L.compile_routing()
        self.compiled = bool(compile)
        b = L.buffers
        K = L.top_k
        # offloaded: graph B maps the expert ids to slots (else slot = expert id, and it reads the ids themselves)
        self.offloaded = ctl.expert_store.offloaded
        # the slot buffers each graph B reads (bound at capture) and the kernel that reads them, per MoE layer
        self._slot_moes: list[SlotMoe] = []
        for m, d in enumerate(self.moe_layers):
            check_experts_module(ctl.layers[m].block.experts)  # the layout the slot MoE reads
            moe = slot_moe(ctl.expert_store, m, self.device)
            moe.check(b.normed[0], b.expert_ids[0], b.expert_weights[0], b.hidden[0], b.hidden[0], L.config)
            self._slot_moes.append(moe)
        self._slot_addresses = self._addresses()
        self._slot_store = (ctl.expert_store, ctl.expert_store.slot_generation)  # checked when either changes
        # workspaces of the Triton path ([K, I] float32, one per intermediate size)
        self._workspaces: dict[int, torch.Tensor] = {}
        if self.backend == "triton":
            for moe in self._slot_moes:
                if moe.intermediate not in self._workspaces:
                    self._workspaces[moe.intermediate] = new_workspace(K, moe.intermediate, self.device)
        # host <-> device round trips: pinned host buffers on CUDA (fixed addresses, captured), CPU tensors else
        pin = self.cuda
        self._widths = [L.router_width(d) for d in self.moe_layers]
        self._scores_f32 = b.router_scores  # float32: graph A's scores, which the host or the device decides on
        self._host_scores = [torch.zeros(1, w, dtype=torch.float32, pin_memory=pin) for w in self._widths]
        self._host_ids = [torch.zeros(1, K, dtype=torch.int64, pin_memory=pin) for _ in self.moe_layers]
        self._host_slots = [torch.zeros(K, dtype=torch.int64, pin_memory=pin) for _ in self.moe_layers]
        self._slot_ids = torch.zeros(K, dtype=torch.int64, device=self.device)  # offloaded: graph B's slots
        # numpy views of the pinned buffers (a Tensor.numpy() costs microseconds per call)
        self._host_scores_np = [t.numpy() for t in self._host_scores]
        self._host_ids_np = [t.numpy()[0] for t in self._host_ids]
        self._host_slots_np = [t.numpy() for t in self._host_slots]
        # the host's wait for graph A: a raw event when cuda-python imports (0.5 us to record, against 5.2)
        self._runtime = Runtime(self.device) if self.cuda and cuda_runtime.available()[0] else None
        # the step's token and position, written by one raw copy from a ring of pinned rows (a torch fill_ costs a
        # launch of 13-16 us on the host path before graph A_0)
        b = self.layers.buffers
        self._inputs = StepInputs(b.token.view(-1), b.position.view(-1), self._runtime) if self._runtime else None
        self._event = HostEvent(self.device, self._runtime) if self.cuda else None
        # the graph bodies: A_0, B_0, A_1, B_1, ..., C
        self._bodies: dict[str, Callable[[], None]] = {}
        previous = -1
        for m, d in enumerate(self.moe_layers):
            self._bodies[f"A{m}"] = self._body_a(m, range(previous + 1, d), d)
            self._bodies[f"B{m}"] = self._body_b(m, d)
            previous = d
        self._bodies["C"] = self._body_c(range(previous + 1, L.num_layers))
        # what is replayed: unit 0 is A_0; unit m + 1 is B_m then A_{m+1} (C after the last B), nothing on the host
        # between the two, so one graph each (``merged``); split (one graph per body) where A's D2H copy of the
        # scores could not be captured
        self._merge = self.merged = bool(merge)
        self._d2h_outside: set[int] = set()  # MoE layers whose scores are copied to the host after the replay
        self._units: list[Callable[[int], None]] = self._eager_units()
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.pool = None
        if self.graphs:
            self._capture(max(int(warmup), 1))
        self.position = 0  # the next position to decode (a new sequence)
        #: seconds the host has spent blocked on graph A's events (waiting for the GPU) since construction: a
        #: step's wall time minus the growth of this (and minus any synchronisation after the step) is the host's
        #: own time: policy, scheduler, graph launches (``psr-hf bench --engine``'s host us per MoE layer)
        self.blocked_s = 0.0

    # ------------------------------------------------------------------ graph bodies
    def _dense(self, d: int) -> None:
        L, b = self.layers, self.layers.buffers
        L.attention_block(d, b.hidden, b.position, b.hidden, b.normed)
        L.dense_mlp(d, b.normed, b.mlp_out)
        b.hidden.add_(b.mlp_out)

    def _body_a(self, m: int, dense: range, d: int, d2h: bool = True, scores: bool = True) -> Callable[[], None]:
        L, b = self.layers, self.layers.buffers
        width = self._widths[m]
        logits = b.router_logits[:, :width]
        scores_f32, host = self._scores_f32[:, :width], self._host_scores[m]
        first = m == 0

        def body() -> None:
            if first:
                L.embed(b.token, b.hidden)
            for i in dense:
                self._dense(i)
            L.attention_block(d, b.hidden, b.position, b.hidden, b.normed)
            L.router_logits(d, b.normed, logits)
            if scores:  # (else the device's decision kernel reads the logits themselves)
                L.router_scores(d, logits, scores_f32)  # float32, as Decoder's scores.float()
            if d2h:
                host.copy_(scores_f32, non_blocking=True)  # D2H into the pinned buffer (captured)

        return body

    def _body_b(self, m: int, d: int, from_host: bool = True) -> Callable[[], None]:
        L, b = self.layers, self.layers.buffers
        width = self._widths[m]
        logits = b.router_logits[:, :width]
        moe = self._slot_moes[m]
        shared = L.has_shared_experts(d)
        out, residual = (b.mlp_out, None) if shared else (b.hidden, b.hidden)
        host_ids, host_slots = self._host_ids[m], self._host_slots[m]
        slots = self._slot_ids if self.offloaded else b.expert_ids[0]
        workspace = self._workspaces.get(moe.intermediate)
        backend = self.backend

        def body() -> None:
            if from_host:  # else the device decided them into the same buffers (psr_hf.engine.token_graph)
                b.expert_ids.copy_(host_ids, non_blocking=True)  # H2D from the pinned buffer (captured)
                if self.offloaded:
                    self._slot_ids.copy_(host_slots, non_blocking=True)
            L.routed_experts(d, moe, slots, logits, out, residual, workspace=workspace, backend=backend)
            if shared:
                L.shared_expert(d, b.normed, b.shared_out)
                b.mlp_out.add_(b.shared_out)
                b.hidden.add_(b.mlp_out)

        return body

    def _body_c(self, dense: range) -> Callable[[], None]:
        L, b = self.layers, self.layers.buffers

        def body() -> None:
            for i in dense:
                self._dense(i)
            L.final(b.hidden, b.logits)

        return body

    # ------------------------------------------------------------------ capture
    def _addresses(self) -> list[tuple[int, ...]]:
        """The addresses of the slot buffers the controller's expert store holds now (the graphs read those of
        construction)."""
        store = self.controller.expert_store
        return [slot_moe(store, m, self.device).addresses() for m in range(len(self.moe_layers))]

    def _dummy_inputs(self) -> None:
        """Valid dummy inputs for warm-up and capture: token 0, position 0, expert ids 0..K-1, slots 0..K-1 mod C."""
        b, K = self.layers.buffers, self.layers.top_k
        b.token.fill_(0)
        b.position.fill_(0)
        for m in range(len(self.moe_layers)):
            self._host_ids[m].copy_(torch.arange(K, dtype=torch.int64).view(1, K))
            capacity = self._slot_moes[m].capacity
            self._host_slots[m].copy_(torch.arange(K, dtype=torch.int64) % capacity)

    def _unit_bodies(self, unit: int) -> list[str]:
        """The bodies of replay unit ``unit``: ``["A0"]``, then ``["B{m}", "A{m+1}"]`` (``["B{M-1}", "C"]``)."""
        if unit == 0:
            return ["A0"]
        m = unit - 1
        return [f"B{m}", f"A{m + 1}" if m + 1 < len(self.moe_layers) else "C"]

    def _eager_units(self) -> list[Callable[[int], None]]:
        """The replay units run eagerly: each takes the current stream's raw handle (unused here)."""
        def unit(names: list[str]) -> Callable[[int], None]:
            bodies = [self._bodies[name] for name in names]

            def run(stream: int = 0) -> None:
                for body in bodies:
                    body()

            return run

        return [unit(self._unit_bodies(u)) for u in range(len(self.moe_layers) + 1)]

    def _capture_graph(self, body: Callable[[], None], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            body()
        return graph

    @torch.no_grad()
    def _capture(self, warmup: int) -> None:
        device = self.device
        self.controller.expert_store.synchronize()  # no copy into the slots runs while the warm-up reads them
        torch.cuda.synchronize(device)
        self._dummy_inputs()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # at least one eager run of every body: the Triton kernels they launch (the slot MoE's, the Gated DeltaNet
            # step's) and the compiled attention blocks compile here, never inside a capture
            for _ in range(warmup):
                for unit in self._units:
                    unit(0)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.pool = torch.cuda.graph_pool_handle()
        if not self._merge:
            self._capture_split(stream)
        else:
            self._capture_merged(stream)
        torch.cuda.synchronize(device)
        logger.debug("GraphDecoder: captured %d graphs (%d MoE layers)", len(self._graphs), len(self.moe_layers))

    def _capture_merged(self, stream: torch.cuda.Stream) -> None:
        """One graph per replay unit (B_m with A_{m+1}); one per body if that fails."""
        try:
            graphs = [self._capture_graph(unit, stream) for unit in self._units]
            self._units = [self._launcher(graph) for graph in graphs]
            self._graphs = {"+".join(self._unit_bodies(u)): graph for u, graph in enumerate(graphs)}
        except RuntimeError as error:
            logger.warning("GraphDecoder: capturing B_m and A_{m+1} as one graph failed (%s); one graph per body",
                           error)
            torch.cuda.synchronize(self.device)
            self.pool = torch.cuda.graph_pool_handle()
            self._capture_split(stream)

    def _launcher(self, graph: torch.cuda.CUDAGraph) -> Callable[[int], None]:
        """A replay of ``graph`` on the given raw stream: ``cudaGraphLaunch`` through cuda-python where it imports
        (the graphs hold no random numbers, so torch's per-replay RNG bookkeeping is not needed), else
        ``graph.replay()`` on the current stream."""
        runtime = self._runtime
        if runtime is None or not hasattr(graph, "raw_cuda_graph_exec"):
            replay = graph.replay
            return lambda stream=0: replay()
        graph_exec = runtime.graph_exec(graph.raw_cuda_graph_exec())
        launch = runtime.launch
        return lambda stream: launch(graph_exec, stream)

    def _capture_split(self, stream: torch.cuda.Stream) -> None:
        """One graph per body; graph A without its D2H copy where that cannot be captured (the host enqueues the
        copy after the replay)."""
        self.merged = False
        graphs: dict[str, torch.cuda.CUDAGraph] = {}
        for name, body in self._bodies.items():
            try:
                graphs[name] = self._capture_graph(body, stream)
            except RuntimeError as error:
                if not name.startswith("A"):
                    raise
                m = int(name[1:])
                logger.warning("GraphDecoder: graph %s could not capture the D2H copy of the scores (%s); it is "
                               "issued after the replay instead", name, error)
                torch.cuda.synchronize(self.device)
                prev = -1 if m == 0 else self.moe_layers[m - 1]
                graphs[name] = self._capture_graph(
                    self._body_a(m, range(prev + 1, self.moe_layers[m]), self.moe_layers[m], d2h=False), stream)
                self._d2h_outside.add(m)
        self._graphs = graphs

        def unit(names: list[str]) -> Callable[[int], None]:
            replays = [graphs[name].replay for name in names]
            last = names[-1]
            outside = int(last[1:]) if last.startswith("A") and int(last[1:]) in self._d2h_outside else None

            def run(stream: int = 0) -> None:
                for replay in replays:
                    replay()
                if outside is not None:
                    width = self._widths[outside]
                    self._host_scores[outside].copy_(self._scores_f32[:, :width], non_blocking=True)

            return run

        self._units = [unit(self._unit_bodies(u)) for u in range(len(self.moe_layers) + 1)]

    # ------------------------------------------------------------------ sequences
    def reset(self) -> None:
        """Start a new sequence: the next step decodes position 0 (which starts the controller's new sequence)."""
        self.position = 0

    def _check_slot_buffers(self) -> None:
        if not self.offloaded:
            return
        store = self.controller.expert_store
        if self._slot_store == (store, store.slot_generation):  # the buffers were not allocated again
            return
        if self._addresses() != self._slot_addresses:
            raise RuntimeError("GraphDecoder: the offload's slot buffers were reallocated (the expert weights "
                               "changed dtype or device); build a new GraphDecoder")
        self._slot_store = (store, store.slot_generation)  # allocated again at the same addresses

    def check_sequence_start(self) -> None:
        self._check_slot_buffers()
        super().check_sequence_start()

    # ------------------------------------------------------------------ one step
    @grad_off
    def step(self, token: OneToken) -> torch.Tensor:
        """Decode ``token`` at the next position; returns the static ``[1, V]`` logits buffer (rewritten by the
        next step)."""
        token = self._one_token(token)
        L, b, handle = self.layers, self.layers.buffers, self.decode_handle
        position = self.position
        L.check_position(position)
        if position > 0:
            return self._continue(token, lambda: token, None)[0]
        self._write_inputs(token, position)  # before graph A_0; device memory the graphs read
        with handle.step(token, position):
            self.check_sequence_start()
            L.sync_routers(handle)
            stream = raw_current_stream(self.device) if self._runtime is not None else 0
            self._units[0](stream)
            self._record(stream)
            for m in range(len(self.moe_layers)):
                self._moe_layer(m, stream)
        self.position = position + 1
        return b.logits

    @grad_off
    def step_chosen(self, read_token: Callable[[], int | None],
                    overlap: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, int | None]:
        """Decode the token the device just wrote into the token buffer (the engine's token choice,
        :mod:`psr_hf.engine.token_selection`), continuing a sequence: graph A_0 is launched before the host reads
        the token (``read_token()``), so the host's launch overlaps with the GPU's choice instead of waiting for
        it. ``read_token`` returns the token, or None to stop the sequence there (nothing is stepped: the
        launched graph only wrote the KV row of a position the next step writes again). ``overlap``: host work
        run while the GPU computes the step (after the first MoE layer's replay is launched), such as the next
        choice's random draw. Returns ``(logits buffer or None, token)``."""
        if self.position == 0:
            raise ValueError("step_chosen continues a sequence; its first token is a prefill or step(token)")
        self.layers.check_position(self.position)
        return self._continue(None, read_token, overlap)

    def _continue(self, token: int | None, read_token: Callable[[], int | None],
                  overlap: Callable[[], None] | None) -> tuple[torch.Tensor | None, int | None]:
        """A step after the first of a sequence: graph A_0 reads only its inputs and the first router, so it is
        launched before everything else the host checks (that overlaps with it)."""
        L, b, handle = self.layers, self.layers.buffers, self.decode_handle
        position = self.position
        L.sync_routers(handle, moe_layers=(0,))
        self._write_inputs(token, position)  # token None: the choice wrote it
        stream = raw_current_stream(self.device) if self._runtime is not None else 0
        self._units[0](stream)
        self._record(stream)
        self._check_slot_buffers()  # before the first graph B, which reads the slots
        L.check_prefetch_source(self.controller)
        L.sync_routers(handle, moe_layers=range(1, len(self.moe_layers)))
        token = read_token()
        if token is None:
            return None, None
        with handle.step(int(token), position):
            for m in range(len(self.moe_layers)):
                self._moe_layer(m, stream)
                if m == 0 and overlap is not None:
                    overlap()
        self.position = position + 1
        return b.logits, int(token)

    def _write_inputs(self, token: int | None, position: int) -> None:
        """The step's token (None: the one already in the buffer) and position into the static buffers."""
        b = self.layers.buffers
        if self._runtime is None:
            if token is not None:
                b.token.fill_(token)
            b.position.fill_(position)
            return
        self._inputs.write(token, position, raw_current_stream(self.device))

    @staticmethod
    def _one_token(token: OneToken) -> int:
        if isinstance(token, (torch.Tensor, np.ndarray)):
            n = token.size if isinstance(token, np.ndarray) else token.numel()
            if n != 1:
                raise ValueError(f"the engine decodes batch 1, one token per step; got {n} token ids")
            return int(token.reshape(-1)[0])
        if isinstance(token, (list, tuple)):
            if len(token) != 1:
                raise ValueError(f"the engine decodes batch 1, one token per step; got {len(token)} token ids")
            return int(token[0])
        return int(token)

    def _record(self, stream: int) -> None:
        """Mark the end of the replay just enqueued on the current stream (``stream``: its raw handle)."""
        if self._event is not None:
            self._event.record(stream)

    def _wait(self) -> None:
        """The host waits for the latest :meth:`_record` (graph A's scores are in the pinned buffer)."""
        if self._event is None:
            return
        begin = time.perf_counter()
        self._event.synchronize()
        self.blocked_s += time.perf_counter() - begin

    def _moe_layer(self, m: int, stream: int) -> None:
        """Layer ``m``: wait for graph A_m's scores, make the selection, replay B_m (with A_{m+1} or C), and only
        then do the host work the replay does not need (the next layer's part 1 and the prefetch copies), so that
        it overlaps with the GPU."""
        handle, E = self.decode_handle, self.layers.num_experts
        self._wait()
        marks = self.marks
        if marks is not None:  # the prediction for layer m + D is available from here on
            marks.append(("pred", m, self._mark()))
        host = self._host_scores_np[m][0].copy()  # [width] (a copy: the buffer is rewritten next step)
        pregate = host[E:] if host.shape[0] > E and handle.needs_pregate else None
        selection = handle.select(m, host[:E], pregate)
        # graph B_m of the previous step (the last reader of this buffer) is complete: graph A_m came after it
        self._host_ids_np[m][:] = selection.experts
        store = self.controller.expert_store
        if self.offloaded:  # resident, graph B reads the expert ids as slots
            # on CUDA the current stream waits for the copies
            self._host_slots_np[m][:] = store.decode_slots(m, selection.experts)
        if marks is not None:  # layer m's experts start here (on CUDA: when the stream reaches graph B_m)
            marks.append(("exec", m, self._mark()))
        self._units[m + 1](stream)  # B_m, then A_{m+1} (or C)
        if m + 1 < len(self.moe_layers):
            self._record(stream)
        if pregate is not None:
            # part 1 of MoE layer m + D (prefetch_distance): the logical decisions in the same order as before the
            # replay (select m, prefetch m + D, select m + 1), its copies queued and issued below while the GPU
            # computes
            handle.prefetch(m + self.layers.distance)
        store.decode_done(m)  # after graph B_m is enqueued: its event follows the slot reads

    # ------------------------------------------------------------------ measuring
    #: None, or a list that every step appends ``(kind, moe_layer, mark)`` to: ``("pred", m, ...)`` when layer m's
    #: scores and the next layer's prefetch ranking reach the host (after graph A_m), ``("exec", m, ...)`` where
    #: layer m's expert computation begins (before graph B_m). ``mark``: a timing CUDA event recorded on the
    #: current stream (CUDA), or ``time.perf_counter()`` seconds (CPU). :func:`psr_hf.prefetch.window` reads them.
    marks: list | None = None

    def _mark(self) -> torch.cuda.Event | float:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @torch.no_grad()
    def time_steps(self, tokens: Sequence[int]) -> float:
        """Mean wall milliseconds per :meth:`step` over ``tokens`` (continuing the current sequence)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for token in tokens:
            self.step(token)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) * 1e3 / max(len(tokens), 1)
