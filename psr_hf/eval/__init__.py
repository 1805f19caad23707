"""Evaluation: the lm-eval model class and its registration, statistics, and diagnostics of routing configurations.

Importing ``psr_hf.eval`` is cheap: it imports neither torch nor lm_eval. Import the submodules for what they
hold, e.g. ``from psr_hf.eval.compare import compare_runs`` (paired comparison of ``--log_samples`` outputs,
the ``psr-hf compare`` command; :mod:`psr_hf.eval.implementations` pairs the engine's runs with the harness's) or ``from psr_hf.eval.stats import mean_interval`` (the confidence intervals
that the evaluation and the benchmarks share).
"""
