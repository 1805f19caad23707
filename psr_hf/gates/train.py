"""The former import path of :mod:`psr_hf.training.gate` (distilled routing and gate training), which moved above
``hf`` because it patches the model. ``psr_hf.gates.train`` *is* that module (the same object), so code that imports
it or sets its names keeps working; importing it warns (``DeprecationWarning``). It counts in the training room
(rank 4), not in ``gates``, and nothing in psr_hf imports it (``tests/test_architecture.py``); new code imports
:mod:`psr_hf.training.gate`.
"""

from __future__ import annotations

import sys
import warnings

from ..training import gate

warnings.warn("psr_hf.gates.train moved to psr_hf.training.gate; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = gate
