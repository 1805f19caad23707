"""Evaluation: the lm-eval model class, paired statistics of lm-eval runs, diagnostics and benchmarks.

Importing ``psr_hf.eval`` is cheap: it imports neither torch nor lm_eval. Import the submodules for what they
hold, e.g. ``from psr_hf.eval.compare import compare_runs`` (paired comparison of ``--log_samples`` outputs,
the ``psr-hf compare`` command).
"""
