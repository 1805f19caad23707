"""Patch a model of every supported family, generate under exact and cache-aware routing, replay the recording.

Runs offline on CPU in seconds with tiny random models; with a real checkpoint, replace ``tiny_model(family)``
by ``AutoModelForCausalLM.from_pretrained(path)`` and the random prompts by tokenized text.

    python examples/patch_and_generate.py
"""

from __future__ import annotations

import numpy as np
import torch

import psr_hf
from psr_hf.testing import FAMILIES, tiny_model


def main() -> None:
    prompts = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0  # the second prompt is shorter: left padding
    for family in FAMILIES:
        model = tiny_model(family)
        # held-out "text" for the calibration: here random ids, in practice your own documents
        calibration = psr_hf.calibrate(model, [torch.randint(3, 256, (2000,))], max_length=256, progress=False)
        with torch.no_grad():
            exact = model.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
        config = psr_hf.RoutingConfig(policy="psr", residency=0.5)
        with psr_hf.patched(model, config, calibration=calibration):
            ctl = psr_hf.controller(model)
            with torch.no_grad(), ctl.record() as rec:
                out = model.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
            stats = ctl.stats().total
        replayed = all(np.array_equal(psr_hf.replay(config, r, calibration=calibration).selected, r.selected)
                       for r in rec.recordings)
        same = (out[:, prompts.shape[1]:] == exact[:, prompts.shape[1]:]).float().mean().item()
        print(f"{family:<18} window {ctl.default_window}  C={ctl.capacity}/{ctl.num_experts}  "
              f"copies/token {stats['copies_per_token']:.2f} (demand {stats['demand_per_token']:.2f})  "
              f"replaced/token {stats['replaced_per_token']:.2f}  tokens = exact {same:.0%}  replay ok {replayed}")


if __name__ == "__main__":
    main()
