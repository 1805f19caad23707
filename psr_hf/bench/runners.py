"""The runners of the latency rows, one per kind of :class:`~psr_hf.bench.rows.Row`: each holds the model or the
copies its rows run on and decodes a row's windows with :mod:`psr_hf.bench.decode`.

- :class:`ResidentRunner` (``resident``): the unpatched model as it is;
- :class:`AccelerateRunner` (``accelerate``): the dispatched copy of :mod:`psr_hf.bench.accelerate_baseline`;
- :class:`TransformersRunner` (``offload``): ONE patched copy of the model for every routed row, patched with the
  first configuration and switched with ``Controller.reconfigure`` (offloading a 13 GB model takes seconds);
- :class:`EngineRunner` (``engine_resident``, ``engine``): psr_hf's batch-1 decoder on a copy with every expert
  cached (also the copies-skipped rows' copy) and on one offloaded copy per capacity, each decoder built once.

A runner notes each row's capacity and memory the first time the row runs; ``close`` drops its copies.
"""

from __future__ import annotations

import abc
import copy
import gc
from collections.abc import Sequence
from typing import Any

import torch

from ..hf.controller import Controller
from ..hf.patching import controller, patch, unpatch
from ..policy.config import RoutingConfig
from .accelerate_baseline import accelerate_copy
from .common import describe_model
from .decode import WindowRun, decode_engine_window, decode_window
from .rows import ENGINE_RESIDENT, Row


def offload_config(device: torch.device | str, *, max_in_flight: int = 2, copy_delay_ms: float = 0.0) -> Any:
    """A :class:`psr_hf.OffloadConfig` for ``device`` (pinned host memory only on CUDA)."""
    from ..offload.config import OffloadConfig

    device = torch.device(device)
    return OffloadConfig(device=str(device), max_in_flight=max_in_flight, copy_delay_ms=copy_delay_ms,
                         pin_memory=device.type == "cuda")


def release(device: torch.device) -> None:
    """Free the memory of dropped model copies now: a patched copy, its hooks and its decoders refer to each other,
    so only the cycle collector frees them, and until it runs a real-size copy stays on the GPU beside the next
    one (a sweep's next residency makes new copies)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _predictor_for(routing: RoutingConfig, predictor: Any) -> Any:
    """The predictor a row's patch needs: the bench's for ``prefetch="predictor"`` rows, none otherwise."""
    if routing.prefetch != "predictor":
        return None
    if predictor is None:
        raise ValueError("rows with prefetch='predictor' (specprefetch_m*) need a predictor: --predictor FILE "
                         "(psr-hf train-predictor)")
    return predictor


def weight_sharing_copy(source: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``source`` whose parameters and buffers are new tensors on the SAME storage: a copy costs no
    weight memory (a real-size model and its copy do not fit one GPU), and patching or offloading the copy, which
    rebinds its tensors (``param.data = ...``) but never writes into them, leaves ``source`` as it was."""
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.data, requires_grad=p.requires_grad)
                            for p in source.parameters()}
    memo.update({id(b): b.detach() for b in source.buffers()})
    return copy.deepcopy(source, memo)


def drop_offloaded_copy(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Unpatch a :func:`weight_sharing_copy` that is thrown away: its offloaded experts are pointed at the source's
    tensors first, so that restoring them does not make a second device copy of every expert."""
    ctl = controller(model)
    if ctl.expert_store.offloaded:
        ctl.offload.placement.point_at(model, source)
    unpatch(model)


class _SharedCopy:
    """One patched copy of the model that several routed rows run on: patched with the first configuration,
    switched with ``Controller.reconfigure`` afterwards."""

    def __init__(self, source: torch.nn.Module, device: torch.device, calibration: Any, offload: Any,
                 predictor: Any = None):
        self.source, self.device, self.calibration, self.offload = source, device, calibration, offload
        self.predictor = predictor
        self.model: torch.nn.Module | None = None
        self.current: RoutingConfig | None = None

    def activate(self, routing: RoutingConfig) -> torch.nn.Module:
        predictor = _predictor_for(routing, self.predictor)
        if self.model is None:
            model = weight_sharing_copy(self.source)
            patch(model, routing, calibration=self.calibration, offload=self.offload, predictor=predictor)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.model = model
        elif routing != self.current:
            if self.offload is None:  # logical cache only: a fresh patch costs nothing
                unpatch(self.model)
                patch(self.model, routing, calibration=self.calibration, predictor=predictor)
            else:
                controller(self.model).reconfigure(routing, calibration=self.calibration, predictor=predictor)
        self.current = routing
        return self.model

    def close(self) -> None:
        if self.model is not None:
            drop_offloaded_copy(self.model, self.source)
            self.model = None
            release(self.device)


def engine_kernels(decoder: Any) -> dict[str, Any]:
    """What an engine decoder runs besides its fixed kernels, for a record: the attention blocks compiled or not,
    the families' kernel options as built (None where the family has no such option), and the experts' format
    (``fp8``: an offload store holding an FP8 checkpoint's experts; ``model``: the model's own weights, which on a
    model loaded from an FP8 checkpoint are its dequantized ones, as in the rows that are not offloaded)."""
    layers = decoder.layers
    store = getattr(decoder.controller, "expert_store", None)
    return {"compiled": bool(getattr(decoder, "compiled", False)),
            "expert_format": getattr(store, "weight_format", "model"),
            "attention_kernels": getattr(layers, "attention_kernels", None),
            "gated_delta_kernel": getattr(layers, "gated_delta_kernel", None),
            "dense_fp8": getattr(layers, "dense_fp8", None)}


class Runner(abc.ABC):
    """Decodes the windows of the rows of its kinds; ``capacity``, ``memory``, ``decided_on`` and ``kernels`` (name
    -> value) note each row's cache slots per layer, offload memory and, for engine rows, where its decode steps are
    routed ("device" or "host") and which optional kernels its decoder runs, when it first runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.capacity: dict[str, int] = {}
        self.memory: dict[str, Any] = {}
        self.decided_on: dict[str, str] = {}
        self.kernels: dict[str, dict[str, Any]] = {}

    @abc.abstractmethod
    def run(self, row: Row, windows: Sequence[torch.Tensor]) -> list[WindowRun]:
        """One decode of each of ``windows`` under ``row``."""

    def close(self) -> None:
        """Drop the runner's model copies (the caller then calls :func:`release`)."""

    def _note(self, row: Row, ctl: Controller) -> None:
        self.capacity.setdefault(row.name, int(ctl.capacity))
        if row.name not in self.memory:
            self.memory[row.name] = ctl.memory().to_dict() if ctl.expert_store.offloaded else None


class ResidentRunner(Runner):
    """The unpatched model with every expert on its device."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        super().__init__(device)
        self.model = model

    def run(self, row: Row, windows: Sequence[torch.Tensor]) -> list[WindowRun]:
        return [decode_window(self.model, ids, device=self.device) for ids in windows]


class AccelerateRunner(ResidentRunner):
    """A copy of the model dispatched by accelerate with its experts on the CPU."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        super().__init__(accelerate_copy(model, device), device)

    def close(self) -> None:
        self.model = None


class TransformersRunner(Runner):
    """The routed rows through the transformers forward, on one patched (offloaded) copy."""

    def __init__(self, model: torch.nn.Module, device: torch.device, calibration: Any, offload: Any,
                 predictor: Any = None):
        super().__init__(device)
        self.shared = _SharedCopy(model, device, calibration, offload, predictor)

    def run(self, row: Row, windows: Sequence[torch.Tensor]) -> list[WindowRun]:
        target = self.shared.activate(row.routing)
        self._note(row, controller(target))
        return [decode_window(target, ids, device=self.device) for ids in windows]

    def close(self) -> None:
        self.shared.close()


class EngineRunner(Runner):
    """The engine rows: ``engine_resident`` and the copies-skipped rows on a copy patched with every expert cached
    (no offload), the offloaded engine rows on one offloaded copy per capacity (no resize between its rows), each
    decoded by a :class:`~psr_hf.engine.graphs.GraphDecoder` (CUDA graphs on CUDA) built on first use and rebuilt
    when the offload's slot buffers were reallocated or the prefetch ranking changed."""

    def __init__(self, source: torch.nn.Module, device: torch.device, calibration: Any, offload: Any, max_len: int,
                 graphs: bool, predictor: Any = None, device_routing: bool | None = None, count_late: bool = False):
        super().__init__(device)
        self.count_late = count_late
        self.source, self.calibration, self.offload, self.predictor = source, calibration, offload, predictor
        self.max_len, self.graphs, self.device_routing = max_len, graphs, device_routing
        self.shared: dict[float | None, _SharedCopy] = {}
        self.resident: torch.nn.Module | None = None
        self.decoders: dict[str, Any] = {}  # "resident" / "shared<residency>" -> decoder

    def _decoder(self, key: str, model: torch.nn.Module) -> Any:
        from ..engine.token_graph import graph_decoder

        decoder = self.decoders.get(key)
        if decoder is not None and decoder.offloaded and decoder._addresses() != decoder._slot_addresses:
            decoder = None  # the slot buffers were reallocated (capacity change): its graphs point at the old ones
        if decoder is not None and not decoder.layers.ranks_like(controller(model)):
            decoder = None  # its router stacks hold another prefetch ranking (a specprefetch row, a distance)
        if decoder is None:
            self.decoders.pop(key, None)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            decoder = graph_decoder(model, self.max_len, graphs=self.graphs, device_routing=self.device_routing,
                                    count_late=self.count_late)
            self.decoders[key] = decoder
        return decoder

    def _activate(self, row: Row) -> Any:
        if row.kind == ENGINE_RESIDENT or row.copies_skipped:
            num_experts = describe_model(self.source)["num_experts"]
            routing = row.routing if row.copies_skipped else RoutingConfig(policy="exact", capacity=num_experts)
            predictor = _predictor_for(routing, self.predictor)
            if self.resident is None:
                model = weight_sharing_copy(self.source)
                patch(model, routing, calibration=self.calibration, predictor=predictor)
                self.resident = model
            elif controller(self.resident).config != routing:
                # copies skipped: the row's routing on the all-resident copy (nothing is offloaded, so the
                # decoder's buffers stay valid); engine_resident: every expert cached again
                controller(self.resident).reconfigure(routing, calibration=self.calibration, predictor=predictor)
            return self._decoder("resident", self.resident)
        if row.residency not in self.shared:
            self.shared[row.residency] = _SharedCopy(self.source, self.device, self.calibration, self.offload,
                                                     self.predictor)
        return self._decoder(f"shared{row.residency}", self.shared[row.residency].activate(row.routing))

    def run(self, row: Row, windows: Sequence[torch.Tensor]) -> list[WindowRun]:
        from ..engine.token_graph import TokenGraphDecoder

        decoder = self._activate(row)
        ctl = decoder.controller
        self._note(row, ctl)
        self.decided_on.setdefault(row.name, "device" if isinstance(decoder, TokenGraphDecoder) else "host")
        self.kernels.setdefault(row.name, engine_kernels(decoder))
        return [decode_engine_window(decoder, ids, device=self.device) for ids in windows]

    def close(self) -> None:
        self.decoders.clear()
        for shared in self.shared.values():
            shared.close()
        self.shared.clear()
        if self.resident is not None:
            unpatch(self.resident)
            self.resident = None
