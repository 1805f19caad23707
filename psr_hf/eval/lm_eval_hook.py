"""Registration of the lm-eval model ``psr_hf``, and why it needs a start-up hook (docs/lm-eval.md).

lm-eval 0.4.13 has no plugin discovery for models: its registry (``lm_eval.api.registry``) can hold an
``importlib.metadata.EntryPoint`` as a lazy placeholder, but nothing in lm-eval calls ``entry_points()``; the
models it knows are the ``MODEL_MAPPING`` of ``lm_eval/models/__init__.py`` and the classes of modules someone
imported (``@register_model``), and ``--include_path`` adds tasks only. So for ``lm-eval --model psr_hf`` (or
``python -m lm_eval``, or ``lm_eval.simple_evaluate(model="psr_hf")``) to work, code of psr_hf must run in
lm-eval's process before the name is looked up, without the user importing anything; Python runs a package's code
in every process only through a ``.pth`` file in site-packages.

So setup.py ships ``psr_hf_lm_eval.pth``, which imports ``startup/_psr_hf_lm_eval.py`` (one import finder and
nothing else); at the first import of ``lm_eval.models`` it calls :func:`register`. ``@register_model("psr_hf")``
on the class replaces the placeholder when the model loads (and registers it where no hook ran, e.g. ``python
-S``). If lm-eval gains entry-point discovery, an entry point replaces all of this.
"""

from __future__ import annotations

MODEL = "psr_hf"
TARGET = "psr_hf.eval.lm_model:PSRLM"


def register() -> None:
    """Register ``psr_hf`` in lm-eval's model registry as a lazy placeholder for :data:`TARGET` (idempotent)."""
    # lm-eval's own models first: get_model() imports lm_eval.models only while the registry is empty
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=TARGET)
