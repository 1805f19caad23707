"""The margin head a controller's routers use (``patch(..., gate=...)``), set up for one routing config."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..gates.margin_head import MarginHead
    from ..policy.calibration import Calibration
    from ..policy.config import RoutingConfig


def gate_for(gate: MarginHead | str | Path | None, config: RoutingConfig, calibration: Calibration, shape: dict,
             device: torch.device) -> tuple[MarginHead | None, torch.Tensor | None]:
    """The margin head the routers use and its unit ``lam * delta[l]`` beside it (``ValueError`` where the config
    or calibration cannot carry per-token margins), or (None, None).

    The head is the given one where it already lives on the routers' ``device`` (so training it trains what
    routes), else a copy there (margins computed where the router inputs are, with no transfer per layer): the
    caller's head is never moved. Routers on the meta device hold no values yet, so the head stays where its
    weights are and its margins are moved to the scores."""
    if gate is None:
        return None, None
    from ..gates.margin_head import MarginHead
    from ..policy.margins import margin_scale

    head = MarginHead.coerce(gate)
    head.check(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"], model_type=shape["model_type"])
    if not config.takes_gate:
        raise ValueError(f"gate=: a margin head sets the bonus of a biased policy with a fixed bonus scale; got "
                         f"policy={config.policy!r}, delta_mode={config.delta_mode!r}: use policy='cache_prior' "
                         "(with eviction='lru': the change-based gate) or 'psr', delta_mode='fixed'")
    unit = margin_scale(np.ones(shape["num_layers"]), float(config.lam), calibration.delta)  # lam * delta
    if device.type != "meta" and head.weight.device != device:
        head = copy.deepcopy(head).to(device)
    return head, torch.as_tensor(unit, dtype=torch.float32, device=head.weight.device)
