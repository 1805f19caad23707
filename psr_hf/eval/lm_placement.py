"""Where the evaluated model's experts live, chosen once from the ``offload=`` model arg (docs/lm-eval.md).

:class:`ResidentPlacement` leaves lm-eval's ``HFLM`` to load and place the model as it always does;
:class:`OffloadedPlacement` loads it on the host and lets :func:`psr_hf.patch` move everything but the experts to the
offload device, where HFLM's inputs then go. :class:`~psr_hf.eval.lm_model.PSRLM` asks its placement at each of
those steps instead of testing whether an offload was given.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..offload.config import OffloadConfig

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from ..hf.controller import Controller

logger = logging.getLogger("lm_eval.models.psr_hf")


class ExpertPlacement(Protocol):
    """What :class:`~psr_hf.eval.lm_model.PSRLM` asks of where the experts live, in the order it asks."""

    def load_device(self, device: str | None) -> str | None:
        """The device a model built in memory (a grown model) goes to, given HFLM's ``device`` arg."""

    def hflm_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """HFLM's args for loading the model; ``ValueError`` for one this placement cannot serve."""

    def accelerate_args(self) -> dict[str, Any] | None:
        """HFLM's ``device_map`` and ``max_memory`` for the load, or None for HFLM's own."""

    def offload_for(self, accelerator: Accelerator | None) -> OffloadConfig | None:
        """The offload :func:`psr_hf.patch` gets in this process (``accelerator``: HFLM's, None without one)."""

    def after_patch(self, ctl: Controller, device: torch.device) -> torch.device:
        """Once the model is patched: log what the placement holds, and return the device HFLM sends its inputs
        to (given HFLM's ``device``)."""

    def results(self, ctl: Controller) -> dict[str, Any]:
        """This placement's entries of the results' ``config.psr_hf``."""


class ResidentPlacement:
    """Every expert stays where HFLM puts the model."""

    def load_device(self, device: str | None) -> str | None:
        return device

    def hflm_args(self, args: dict[str, Any]) -> dict[str, Any]:
        return args

    def accelerate_args(self) -> dict[str, Any] | None:
        return None

    def offload_for(self, accelerator: Accelerator | None) -> OffloadConfig | None:
        return None

    def after_patch(self, ctl: Controller, device: torch.device) -> torch.device:
        return device

    def results(self, ctl: Controller) -> dict[str, Any]:
        return {}


@dataclasses.dataclass(frozen=True)
class OffloadedPlacement:
    """The experts in host memory (``config``), every other weight on ``config.device``: the model loads on the
    host, and :func:`psr_hf.patch` moves it."""

    config: OffloadConfig

    def load_device(self, device: str | None) -> str | None:
        return self.config.device

    def hflm_args(self, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("parallelize"):
            raise ValueError("psr_hf model args offload= and parallelize=True exclude each other: the offload "
                             "puts every non-expert weight on one device and the experts in host memory")
        return {**args, "device": "cpu"}  # load on the host; the offload moves everything but the experts

    def accelerate_args(self) -> dict[str, Any] | None:
        return {"device_map": {"": "cpu"}, "max_memory": None}  # on the host, data parallel included

    def offload_for(self, accelerator: Accelerator | None) -> OffloadConfig | None:
        if accelerator is None:
            return self.config
        # data parallel (accelerate launch): every process offloads to its own device
        return dataclasses.replace(self.config, device=str(accelerator.device))

    def after_patch(self, ctl: Controller, device: torch.device) -> torch.device:
        logger.info("psr_hf: %s", ctl.memory())
        return ctl.offload.device

    def results(self, ctl: Controller) -> dict[str, Any]:
        return {"offload": ctl.stats().offload.to_dict(), "memory": ctl.memory().to_dict()}


def expert_placement(offload: str | bool | None = None, max_in_flight: int | None = None) -> ExpertPlacement:
    """The placement of the model args ``offload=DEVICE`` (``cuda``, ``cuda:N``, ``cpu``; True means ``cuda``) and
    ``max_in_flight=N``: resident without ``offload`` (None or False). Raises ``ValueError`` naming the field."""
    if offload is None or offload is False:
        if max_in_flight is not None:
            raise ValueError("psr_hf model arg max_in_flight is used only with offload= (e.g. offload=cuda:0)")
        return ResidentPlacement()
    device = "cuda" if offload is True else offload
    if not isinstance(device, str):
        raise ValueError(f"psr_hf model arg offload={offload!r} must be a device: cuda, cuda:N or cpu")
    extra: Mapping[str, int] = {} if max_in_flight is None else {"max_in_flight": max_in_flight}
    return OffloadedPlacement(OffloadConfig(device=device.strip(), **extra))
