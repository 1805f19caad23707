"""The torch glue: patch()/unpatch()/patched()/controller(), the per-row Controller and calibration collection."""

from .controller import Controller, Recorder, RoutingStats
from .patching import controller, patch, patched, unpatch

__all__ = ["Controller", "Recorder", "RoutingStats", "controller", "patch", "patched", "unpatch"]
