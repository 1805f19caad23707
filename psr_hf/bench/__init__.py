"""Benchmarks: commands that time the library and return JSON-ready records (the CLI prints them).

- :mod:`.policy`: the policy kernels' per-call cost and replay throughput (``psr-hf bench-policy``);
- :mod:`.patch`: the patching overhead of ``generate()`` (``psr-hf bench-patch``);
- :mod:`.offload`: offload latency, teacher-forced decode of text windows (``psr-hf bench``);
- :mod:`.plot`: the figure of an offload latency record (``psr-hf bench --plot``, ``psr-hf bench-plot``);
- :mod:`.common`: what they share (interleaved rounds and their summaries, the quiet patching log, device
  synchronisation, the machine description and versions); the intervals come from :mod:`psr_hf.eval.stats`;
- :mod:`.workloads`: the models they build or load and the text windows they decode.

Every module's public names are public to the package: a benchmark imports another module's names, never its
private ones. This room may import every library room and :mod:`psr_hf.eval`; nothing below it imports it.
"""
