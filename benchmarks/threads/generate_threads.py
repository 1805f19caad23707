"""The shipped tiny-moe generating 32 greedy tokens for two prompts with 1 and 2 torch threads, 4 interleaved
rounds (seconds per generate). Run on a 2-core machine while another job keeps it busy:
    .venv/bin/python benchmarks/threads/generate_threads.py
Record of the run behind psr_hf/_threads.py's figures: benchmarks/threads/record.txt."""
import time, torch, psr_hf
from psr_hf.assets import load_shipped
model, tok, cal = load_shipped("tiny-moe")
psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5), calibration=cal)
ids = tok(["def add(a, b):\n    return", "class Stack:\n    def push(self, x):"], return_tensors="pt", padding=True)
res = {1: [], 2: []}
for r in range(4):
    for t in (1, 2) if r % 2 == 0 else (2, 1):
        torch.set_num_threads(t)
        s = time.perf_counter()
        with torch.no_grad():
            model.generate(**ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
        res[t].append(time.perf_counter() - s)
print({t: [round(x, 2) for x in v] for t, v in res.items()}, "cores", __import__("os").cpu_count())
