"""The torch glue: patch()/unpatch()/patched()/controller(), the per-row Controller and calibration collection."""

from .controller import Controller
from .patching import controller, patch, patched, unpatch
from .recording import Recorder
from .statistics import RoutingStats

__all__ = ["Controller", "Recorder", "RoutingStats", "controller", "patch", "patched", "unpatch"]
