"""Imported at interpreter start by psr_hf_lm_eval.pth: registers ``--model psr_hf`` once lm-eval has loaded its
model registry (psr_hf/eval/lm_eval_hook.py says why this hook exists). Every Python process runs this module, so
it imports nothing and only puts one finder in front of ``sys.meta_path``."""

import sys


class _Finder:
    """Answers the first lookup of ``lm_eval.models`` only: takes itself out of ``sys.meta_path``, lets the other
    finders locate the module and makes its loader register psr_hf right after the module has run."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        sys.meta_path.remove(cls)
        from importlib.util import find_spec

        spec = find_spec(name)  # the normal finders, this one being gone
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _register()

            spec.loader.exec_module = exec_module  # this spec's loader only: a reload finds a fresh one
        return spec


def _register():
    try:
        from psr_hf.eval.lm_eval_hook import register

        register()
    except Exception as exc:  # never break lm-eval itself; --model psr_hf then reports the name unknown
        import warnings

        warnings.warn(f"psr_hf could not register its lm-eval model: {exc!r}", RuntimeWarning, stacklevel=2)


sys.meta_path.insert(0, _Finder)
