"""Benchmarks: commands that time the library and return JSON-ready records (the CLI prints them).

- :mod:`.policy` (``psr-hf bench-policy``), :mod:`.patch` (``psr-hf bench-patch``): the policy kernels' cost, the
  patching overhead of ``generate()``;
- the offload latency benchmark (``psr-hf bench``): :mod:`.offload` (the command and its record), :mod:`.rows`
  (the typed rows and their grid), :mod:`.timing` (the interleaved rounds), :mod:`.runners` and
  :mod:`.accelerate_baseline` (the models the rows run on), :mod:`.decode` (the decode loops), :mod:`.summary` (a
  row's record), :mod:`.goals` (ratios and goals), :mod:`.report` (its text), :mod:`.plot` (its figure);
- :mod:`.sweep` (``psr-hf sweep``) and :mod:`.frontier` (its Pareto front, Figure 1, Table 2, orderings);
- :mod:`.generate_latency` (``psr-hf bench-generate``): time to first token and decode of ``generate()``;
- free generation (``psr-hf bench-free-generation``, Table 6): :mod:`.free_generation`, :mod:`.free_generation_timing`,
  :mod:`.free_generation_stats`, :mod:`.free_generation_report`, over the prompt sets of :mod:`.prompt_sets`;
- :mod:`.common` (what they share) and :mod:`.workloads` (the seeded prompts of the ``generate()`` benchmarks;
  the models and text windows come from :mod:`psr_hf.assets.loading` and :mod:`psr_hf.assets.texts`).

A module imports another's public names, never its private ones. This room may import every library room and
:mod:`psr_hf.eval`; nothing below it imports it.
"""
