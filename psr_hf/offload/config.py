"""OffloadConfig: where the experts run and how their copies are scheduled (torch-free, like RoutingConfig)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

# Upper bounds of the numbers that size queues or waits: more prefetch copies in flight than a model has expert
# slots never happens (every layer's slots together hold far fewer), and a copy delay is a diagnostic.
MAX_IN_FLIGHT = 65536
MAX_COPY_DELAY_MS = 60_000.0
#: how a CUDA device's copies and events are issued: raw runtime calls through cuda-python when it imports
#: ("auto"), always ("cuda-python": an error without it), or torch's own calls ("torch", the reference)
COPY_APIS = ("auto", "cuda-python", "torch")
#: what the host store and the copies hold: FP8 with block scales where the model was loaded from a fine-grained
#: FP8 checkpoint ("auto"), FP8 required ("fp8"), or the model's own weights as loaded ("model")
EXPERT_FORMATS = ("auto", "fp8", "model")


@dataclass(frozen=True)
class OffloadConfig:
    """Offload the routed experts of a patched model: ``psr_hf.patch(model, config, calibration, offload=...)``.

    Every non-expert weight moves to ``device``; the routed experts of each MoE layer move into one contiguous
    host buffer per layer (pinned, so copies are asynchronous); each layer gets ``C`` expert slots on ``device``
    (``C`` = the routing config's capacity). Copies follow the logical cache's decisions and never feed back into
    them (``docs/ALGORITHM.md``, "Physical scheduling"), so nothing here changes which experts run.

    Args:
        device: where the model computes: ``"cuda"``, ``"cuda:N"``, or ``"cpu"`` (the same slot cache and
            scheduler with slots in ordinary memory and a copy thread; for tests and machines without a GPU).
        max_in_flight: prefetch copies in flight at once (1 to 65536); further prefetches wait in a queue and are
            issued at later layer boundaries. Demand copies are always issued at once.
        pin_memory: pin the host store (CUDA only; pageable memory makes every copy synchronous and slower).
        copy_delay_ms: an artificial delay before every copy (0 to 60000 ms; diagnostic: shows that timing changes
            latency, never outputs). On CUDA the copy stream sleeps for about this long.
        check_slots: after waiting for its slots, every layer checks that each slot it executes holds the expert
            the host store has (slow; for tests and debugging).
        copy_api: how copies and their events are issued on CUDA: ``"auto"`` (raw ``cudaMemcpyAsync`` and events
            through cuda-python when it is installed, the ``cuda`` extra; torch's calls otherwise), ``"cuda-python"``
            (required), or ``"torch"``. Only the host's cost per copy differs (about 3 against 20-30 us); the
            copies, their order and what each layer waits for are the same.
        expert_format: what the host store holds (docs/offloading.md, "FP8 experts"): ``"auto"`` (the experts
            of the fine-grained FP8 checkpoint the model was loaded from, e4m3 with their block scales, read from
            its files, where its config says ``quant_method: fp8``; the model's own weights otherwise), ``"fp8"``
            (an FP8 checkpoint required: ``ValueError`` without one) or ``"model"`` (the model's own weights as
            loaded, bf16 after transformers dequantized an FP8 checkpoint). FP8 halves the host store and every
            copy.
        checkpoint: the folder of that FP8 checkpoint (default: the folder, or cached hub model, the model was
            loaded from).
    """

    device: str = "cuda"
    max_in_flight: int = 2
    pin_memory: bool = True
    copy_delay_ms: float = 0.0
    check_slots: bool = False
    copy_api: str = "auto"
    expert_format: str = "auto"
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        device = self.device
        if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or (
                device.startswith("cuda:") and device[5:].isdigit())):
            raise ValueError(f"device={device!r} must be 'cuda', 'cuda:N' or 'cpu'")
        if (not isinstance(self.max_in_flight, int) or isinstance(self.max_in_flight, bool)
                or not 1 <= self.max_in_flight <= MAX_IN_FLIGHT):
            raise ValueError(
                f"max_in_flight={self.max_in_flight!r} must be an int >= 1 and <= {MAX_IN_FLIGHT} (prefetch copies "
                "in flight)"
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory={self.pin_memory!r} must be True or False")
        delay = self.copy_delay_ms
        if (isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay)
                or not 0 <= delay <= MAX_COPY_DELAY_MS):
            raise ValueError(f"copy_delay_ms={delay!r} must be a finite number >= 0 and <= {MAX_COPY_DELAY_MS:g} "
                             "(milliseconds before each copy; a diagnostic)")
        if not isinstance(self.check_slots, bool):
            raise ValueError(f"check_slots={self.check_slots!r} must be True or False")
        if self.copy_api not in COPY_APIS:
            raise ValueError(f"copy_api={self.copy_api!r} must be one of {', '.join(map(repr, COPY_APIS))}")
        if self.copy_api != "auto" and self.device == "cpu":
            raise ValueError(f"copy_api={self.copy_api!r} chooses how CUDA copies are issued; device='cpu' copies "
                             "with a thread: leave copy_api='auto'")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format={self.expert_format!r} must be one of "
                             f"{', '.join(map(repr, EXPERT_FORMATS))}")
        if self.checkpoint is not None and (not isinstance(self.checkpoint, str) or not self.checkpoint):
            raise ValueError(f"checkpoint={self.checkpoint!r} must be None or the path of an FP8 checkpoint folder")
        if self.checkpoint is not None and self.expert_format == "model":
            raise ValueError(f"checkpoint={self.checkpoint!r} names the FP8 checkpoint the experts are read from; "
                             "expert_format='model' reads none: use expert_format='auto' or 'fp8', or drop checkpoint")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "OffloadConfig":
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"unknown OffloadConfig field(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
        return cls(**dict(values))

    @classmethod
    def coerce(cls, value: Any) -> "OffloadConfig":
        """An OffloadConfig from itself, a dict of its fields, or a device string (``"cuda:0"``, ``"cpu"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(device=value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(
            "offload must be a psr_hf.OffloadConfig (e.g. OffloadConfig(device='cuda:0')), a dict of its fields or a "
            f"device string; got {type(value).__name__}"
        )
