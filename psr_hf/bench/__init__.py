"""Benchmarks: commands that time the library and return JSON-ready records (the CLI prints them).

- :mod:`.policy`: the policy kernels' per-call cost and replay throughput (``psr-hf bench-policy``);
- :mod:`.patch`: the patching overhead of ``generate()`` (``psr-hf bench-patch``);
- :mod:`.offload`: offload latency, teacher-forced decode of text windows (``psr-hf bench``);
- :mod:`.common`: what they share (interleaved rounds, machine description, device synchronisation).

This room may import every library room and :mod:`psr_hf.eval`; nothing below it imports it.
"""
