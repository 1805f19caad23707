"""Imported at interpreter start by psr_hf_lm_eval.pth: waits for lm-eval's model registry, then registers
``--model psr_hf`` (psr_hf/eval/lm_eval_hook.py says how and why). Every Python process runs this module, so it
stays tiny and imports nothing."""

import sys


class _Finder:
    """A meta path finder that answers only for ``lm_eval.models``, once."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        if _Finder in sys.meta_path:
            sys.meta_path.remove(_Finder)
        try:
            from psr_hf.eval.lm_eval_hook import find_spec_and_register
        except Exception as exc:  # psr_hf unusable: lm-eval must still import (without --model psr_hf)
            import warnings

            warnings.warn(f"psr_hf could not register its lm-eval model: {exc!r}", RuntimeWarning, stacklevel=2)
            return None
        return find_spec_and_register(name, path, target)


sys.meta_path.insert(0, _Finder)
