"""The controller's host path alone, as the engine drives it per decode step through the controller's decode handle
(begin_step, select + prefetch per MoE layer, end_step), on the tiny OLMoE with random scores: host us per MoE
layer, no GPU and no model compute. A build older than the decode handle is driven through the controller itself.
Run one build against another by PYTHONPATH (benchmarks/engine/gpu_house_round2.sh, STAGE=ab):
``python benchmarks/engine/controller_host_path.py psr``."""
import sys, time
import numpy as np
import torch
import psr_hf
from psr_hf.testing import tiny_model
torch.set_num_threads(1)
model = tiny_model("olmoe")
kw = {"lam": 0.3, "budget": 1} if sys.argv[1] == "psr" else {}
psr_hf.patch(model, psr_hf.RoutingConfig(policy=sys.argv[1], residency=0.5, **kw))
ctl = psr_hf.controller(model)
steps = ctl.decode_handle() if hasattr(ctl, "decode_handle") else ctl
E = model.config.num_experts
L = len(ctl.layers)
rng = np.random.default_rng(0)
N = 2000
scores = rng.standard_normal((N, L, E)).astype(np.float32)
def run():
    for t in range(N):
        steps.begin_step(3 + t % 50, t)
        for m in range(L):
            pre = scores[t, m + 1] if (m + 1 < L and steps.needs_pregate) else None
            steps.select(m, scores[t, m], pre)
            if pre is not None:
                steps.prefetch(m + 1)
        steps.end_step()
run()
times = []
for _ in range(5):
    s = time.perf_counter(); run(); times.append((time.perf_counter() - s) / N / L * 1e6)
print(sys.argv[1], "host us per MoE layer: min %.2f median %.2f" % (min(times), sorted(times)[2]))
