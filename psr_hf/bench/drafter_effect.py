"""The drafter's effect on routing (the paper's Section 7, last paragraph; docs/speculative.md, "The drafter in the
routing"): with block-level selection the experts a committed token executes depend on the other drafts of its
block. For every verification block of a speculative generation in the harness, the block is verified a second
time from the same KV cache and pool with the rejected positions carrying the true continuation (the tokens the
generation went on to commit) instead of the drafts, the weights kept; the share of committed token-layers
whose executed set differs between the two is the measure (the paper: 36% with AcceptMoE's position weights).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..hf.speculative import (BlockRouting, Drafter, accepted_count, crop, forward_logits, moe_routers,
                              own_routing, prefill_prompt, speculative_generate)
from ..policy.blocks import BlockConfig, BlockPool


@dataclass(frozen=True)
class DrafterEffect:
    """Blocks compared (those with a rejected draft and a long enough true continuation), their committed
    token-layers, and how many of those executed another expert set under the true continuation."""

    blocks: int
    committed_token_layers: int
    changed: int

    @property
    def share(self) -> float:
        return self.changed / max(self.committed_token_layers, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "committed_token_layers": self.committed_token_layers,
                "changed": self.changed, "share": self.share}


@torch.no_grad()
def drafter_effect(target: torch.nn.Module, drafter: torch.nn.Module, prompts: Sequence[Sequence[int]],
                   config: BlockConfig, *, draft_tokens: int = 16, max_new_tokens: int = 64,
                   calibration: Any = None) -> DrafterEffect:
    """:class:`DrafterEffect` over greedy speculative generations of ``prompts`` (the same arguments as
    :func:`~psr_hf.hf.speculative.speculative_generate`)."""
    from transformers import DynamicCache

    totals = np.zeros(3, dtype=np.int64)
    for prompt in prompts:
        prompt = [int(t) for t in prompt]
        final = prompt + speculative_generate(target, drafter, prompt, config, max_new_tokens=max_new_tokens,
                                              draft_tokens=draft_tokens, calibration=calibration).tokens
        _, layers = moe_routers(target)
        counts = None if calibration is None else calibration.expert_counts
        pool = BlockPool(config, len(layers), int(layers[0].router.weight.shape[0]), counts)
        routing, drafting, cache = BlockRouting(target, pool), Drafter(drafter), DynamicCache()
        committed = list(prompt)
        with own_routing(target), own_routing(drafter), routing.installed():
            prefill_prompt(target, routing, prompt, cache)
            while len(committed) < len(final):
                drafts, confidences = drafting.draft(committed, int(draft_tokens))
                pool.begin_block(confidences)
                before, start = (copy.deepcopy(pool), copy.deepcopy(cache)), len(committed) - 1
                with routing.block():
                    logits = forward_logits(target, [committed[-1]] + drafts, cache)
                real = [c.selected for c in routing.choices]
                verified = torch.argmax(logits, dim=-1).tolist()
                a = accepted_count(drafts, verified)
                true = final[start:start + draft_tokens + 1]
                if a < draft_tokens and len(true) == draft_tokens + 1:
                    routing.pool, other_cache = before
                    with routing.block():
                        forward_logits(target, true, other_cache)
                    other = [c.selected for c in routing.choices]
                    routing.pool = pool
                    totals += (1, (a + 1) * len(real),
                               sum(int(np.any(r[:a + 1] != o[:a + 1], axis=1).sum()) for r, o in zip(real, other)))
                pool.end_block(a)
                crop(cache, start + a + 1)
                committed += drafts[:a] + [verified[a]]
                if committed[:len(final)] != final[:len(committed)]:
                    raise RuntimeError("psr_hf drafter_effect: the second generation left the first one's tokens")
    return DrafterEffect(int(totals[0]), int(totals[1]), int(totals[2]))
