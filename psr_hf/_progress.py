"""Progress bars: tqdm's notebook widget where Jupyter can draw it (ipywidgets installed), its text bar
everywhere else. Importing this module also loads ``tqdm.auto`` once without its "IProgress not found" warning,
which a notebook without ipywidgets would otherwise show when transformers or huggingface_hub import it."""

from __future__ import annotations

import importlib.util
import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    import tqdm.auto  # noqa: F401  (cached: later imports of it do not warn)

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    from tqdm.std import tqdm

__all__ = ["tqdm"]
