"""Registration of the lm-eval model ``psr_hf`` without an entry point, at no cost to other Python processes.

lm-eval 0.4.13 finds models only in its own registry (no entry-point discovery), so ``lm-eval --model psr_hf``
(or ``python -m lm_eval``, or ``lm_eval.simple_evaluate(model="psr_hf")``) works only if something registers the
name first. psr_hf ships ``psr_hf_lm_eval.pth`` at the top of site-packages (setup.py writes it into the wheel
and into the editable wheel); it imports the top-level module ``_psr_hf_lm_eval`` (startup/), which imports
nothing and puts one meta path finder in front of ``sys.meta_path``. That is all that happens at interpreter
start: about 0.2 ms (README, "Evaluating with lm-evaluation-harness"; benchmarks/startup/startup_hook.py).

When ``lm_eval.models`` is first imported (lm-eval imports it to fill its registry with its own models), the
finder takes itself out of ``sys.meta_path`` and calls :func:`find_spec_and_register`: the normal finders locate
the module, and its loader is wrapped so that, once the module has run, :func:`register` adds ``psr_hf`` as a lazy
placeholder, the way lm-eval lists its own models: ``psr_hf.eval.lm_model:PSRLM`` is imported (with torch) only
when ``--model psr_hf`` is asked for. ``@register_model("psr_hf")`` on the class turns the placeholder into the
class (and registers it where no hook ran, e.g. ``python -S``).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

MODEL = "psr_hf"
TARGET = "psr_hf.eval.lm_model:PSRLM"


def register() -> None:
    """Register ``psr_hf`` in lm-eval's model registry as a lazy placeholder (idempotent)."""
    # lm-eval's own models first: get_model() imports lm_eval.models only while the registry is empty
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=TARGET)


class _RegisteringLoader:
    """Runs the real loader of ``lm_eval.models``, then :func:`register`; anything else goes to the real loader."""

    def __init__(self, loader: Any):
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # the module keeps the real loader (importlib.reload, resources)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            register()
        except Exception as exc:  # never break lm-eval itself; --model psr_hf then reports the name unknown
            warnings.warn(f"psr_hf could not register its lm-eval model: {exc!r}", RuntimeWarning, stacklevel=2)


def find_spec_and_register(name: str, path: Any = None, target: Any = None) -> Any:
    """The spec that the other meta path finders give for ``name`` (``lm_eval.models``), with a loader that
    registers ``psr_hf`` after the module has run; None if no finder knows the module."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path, target) if find_spec is not None else None
        if spec is not None:
            break
    else:
        return None
    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
        spec.loader = _RegisteringLoader(spec.loader)
    return spec
