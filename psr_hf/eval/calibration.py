"""The calibration a measurement routes a model with (excess NLL, the benchmarks, the sweep): a file, the one saved
beside the model, or :func:`psr_hf.calibrate` on standard-library text the measured windows never read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..assets.texts import CALIBRATION_MODULES, module_sources


def model_calibration(model: Any, tokenizer: Any, *, tokens: int, calibration: str | Path | None = None,
                      beside: str | Path | None = None, beside_name: str | None = None,
                      progress: Callable[[str], None] | None = None, bar: bool = False) -> tuple[Any, dict[str, Any]]:
    """``(calibration, how)``: the file ``calibration`` when given, else the one saved ``beside`` the model (named
    ``beside_name`` in records), else :func:`psr_hf.calibrate` on ``tokens`` tokens of :data:`CALIBRATION_MODULES`
    (never the windows' text). ``how`` is the record's description: ``{"file": ...}`` or
    ``{"modules", "tokens", "how"}``; ``bar`` shows calibrate's progress bar."""
    from ..policy.calibration import Calibration

    if calibration is not None:
        return Calibration.load(calibration), {"file": str(calibration)}
    if beside is not None:
        return Calibration.load(beside), {"file": beside_name or str(beside)}
    from ..hf.calibrate import calibrate

    if progress is not None:
        progress(f"calibrating on {tokens} tokens of {', '.join(CALIBRATION_MODULES)}")
    calib = calibrate(model, [text for _, text in module_sources(CALIBRATION_MODULES)], tokenizer=tokenizer,
                      max_length=512, batch_size=4, max_tokens=tokens, progress=bar)
    return calib, {"modules": list(CALIBRATION_MODULES), "tokens": tokens,
                   "how": "psr_hf.calibrate (exact routing), windows of 512 tokens"}
