"""``--model psr_hf`` with trained gates (``gate=FILE``, ``distilled=FOLDER``; psr_hf/eval/lm_model.py) on the
shipped olmoe-routing, float32 on the CPU, with real artefacts: a perturbed margin head saved as safetensors and a
folder from ``distill_routing`` (2 steps), once without and once with its own ``gate.safetensors``.

Per request the harness must give what lm-eval's own ``hf`` model gives on a model patched by hand
(``psr_hf.patch(model, config, gate=head)``, after ``load_distilled`` for a folder): the same loglikelihoods,
greedy texts and routing statistics; a perturbed head must route differently from ungated Cache-Prior. The args
that cannot work (a missing file, a gate with the engine, speculative decoding or a policy without margins, two
gates) fail with a ValueError naming them, before anything loads where the args alone decide.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import psr_hf
from psr_hf.assets import load_shipped
from psr_hf.gates import MarginHead
from psr_hf.training.gate import GATE_FILE, distill_routing, load_distilled
from psr_hf.testing import save_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

MODEL = "olmoe-routing"
CONFIG = psr_hf.RoutingConfig(policy="cache_prior", lam=0.3, eviction="lru", residency=0.375)
ROUTING_ARGS = "policy=cache_prior,lam=0.3,eviction=lru,residency=0.375"
# batch 1: lm-eval's hf model passes padded loglikelihood batches to the patched model as they are
COMMON = dict(pretrained=MODEL, device="cpu", dtype="float32", batch_size=1, policy="cache_prior", lam=0.3,
              eviction="lru", residency=0.375)
PAIRS = [("The committee met on Tuesday to discuss the budget, and", " after a long debate it decided"),
         ("It was a truth universally acknowledged that", " a single man in possession of a good fortune")]
PROMPTS = ["The river ran past the old mill, and", "Anne had always thought"]
TEXTS = ["def merge(left, right):\n    result = []\n    while left and right:\n        result.append(left.pop(0))",
         "import heapq\n\nheap = []\nfor value in values:\n    heapq.heappush(heap, value)\nprint(heap[0])"]


def _requests() -> tuple[list, list]:
    from lm_eval.api.instance import Instance

    return ([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)],
            [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}), i)
             for i, p in enumerate(PROMPTS)])


def _run(lm) -> tuple[list, list]:
    loglikelihoods, generations = _requests()
    return (lm.loglikelihood(loglikelihoods, disable_tqdm=True),
            lm.generate_until(generations, disable_tqdm=True))


def _psrlm(**args):
    from psr_hf.eval.lm_model import PSRLM

    lm = PSRLM(**COMMON, **args)
    return lm, _run(lm), lm.routing_stats()


def _by_hand(model, tokenizer, calibration, gate):
    """lm-eval's own hf model on ``model`` patched by hand: its results and routing statistics."""
    from lm_eval.models.huggingface import HFLM

    psr_hf.patch(model, CONFIG, calibration=calibration, gate=gate)
    results = _run(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu"))
    return results, psr_hf.controller(model).stats().total


def _perturbed_head(calibration, hidden_size: int, seed: int) -> MarginHead:
    head = MarginHead.uniform(CONFIG.lam * calibration.delta, hidden_size, metadata={"model_type": "olmoe"})
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return head


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    """Paths of a saved perturbed margin head, a distilled folder without a gate and a copy with one."""
    root = tmp_path_factory.mktemp("gates")
    model, tokenizer, calibration = load_shipped(MODEL)
    hidden = int(model.config.hidden_size)
    head = _perturbed_head(calibration, hidden, seed=0).save(root / "head.safetensors")
    windows = [torch.tensor(tokenizer(text)["input_ids"][:32]) for text in TEXTS]
    plain = distill_routing(model, windows, CONFIG, root / "distilled", calibration=calibration, steps=2, lr=1e-2,
                            router_lr=1e-2, warmup=1).path
    gated = root / "distilled_gated"
    shutil.copytree(plain, gated)
    _perturbed_head(calibration, hidden, seed=1).save(gated / GATE_FILE)
    return {"head": str(head), "plain": str(plain), "gated": str(gated)}


@pytest.fixture(scope="module")
def ungated():
    """Ungated Cache-Prior through the harness: its results and statistics."""
    _, results, stats = _psrlm()
    assert stats["gate"] is None and stats["distilled"] is None
    return results, stats["stats"]


@pytest.fixture(scope="module")
def weightless(tmp_path_factory):
    """A tiny OLMoE directory without weights: an error raised on it was raised before anything loaded."""
    path = save_tiny("olmoe", tmp_path_factory.mktemp("weightless") / "olmoe")
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    return path


# ---------------------------------------------------------------------------------------------- the results
def test_gate_file_gives_the_results_of_the_model_patched_by_hand(artefacts, ungated):
    lm, results, stats = _psrlm(gate=artefacts["head"])
    assert stats["gate"] == artefacts["head"] and stats["distilled"] is None
    assert psr_hf.controller(lm.model).gate is not None
    model, tokenizer, calibration = load_shipped(MODEL)
    reference, reference_stats = _by_hand(model, tokenizer, calibration, MarginHead.load(artefacts["head"]))
    assert results == reference
    assert stats["stats"] == reference_stats
    assert all(results[1]) and stats["stats"]["tokens"] > 0
    # the perturbed head's margins route otherwise than Cache-Prior's one margin per layer
    assert stats["stats"] != ungated[1]


@pytest.mark.parametrize("folder", ["plain", "gated"])
def test_a_distilled_folder_gives_the_results_of_load_distilled_and_patch_by_hand(artefacts, ungated, folder):
    lm, results, stats = _psrlm(distilled=artefacts[folder])
    model, tokenizer, calibration = load_shipped(MODEL)
    model, head = load_distilled(model, artefacts[folder])
    assert (head is None) == (folder == "plain")
    reference, reference_stats = _by_hand(model, tokenizer, calibration, head)
    assert results == reference and stats["stats"] == reference_stats
    assert stats["distilled"] == artefacts[folder]
    assert stats["gate"] == (None if head is None else f"{artefacts[folder]}/{GATE_FILE}")
    assert (psr_hf.controller(lm.model).gate is None) == (head is None)
    # the trained routers and merged adapters are what ran: the loglikelihoods moved off the untrained model's
    assert [ll for ll, _ in results[0]] != [ll for ll, _ in ungated[0][0]]
    assert not any("lora_" in name for name, _ in lm.model.named_parameters())  # merged, no peft wrappers left


def test_the_model_load_distilled_returns_is_the_one_patched_and_evaluated(artefacts, monkeypatch):
    """peft's merge_and_unload may return another module than it was given: the harness must run that one."""
    import copy

    import psr_hf.training.gate as train

    returned = []

    def load_a_copy(model, path):
        model, head = load_distilled(model, path)
        returned.append(copy.deepcopy(model))
        return returned[-1], head

    monkeypatch.setattr(train, "load_distilled", load_a_copy)
    lm, _, stats = _psrlm(distilled=artefacts["plain"])
    assert lm.model is returned[0] and psr_hf.controller(lm.model) is not None
    assert stats["stats"]["tokens"] > 0


def test_the_engine_serves_a_distilled_folder_without_a_gate(artefacts):
    lm, (_, generations), stats = _psrlm(distilled=artefacts["plain"], engine=True)
    assert stats["engine"]["generate_calls"] == len(PROMPTS) and stats["engine"]["generation_fallbacks"] == 0
    _, (_, expected), _ = _psrlm(distilled=artefacts["plain"])
    assert generations == expected


# ---------------------------------------------------------------------------------------------- refused args
@pytest.mark.parametrize("args, message", [
    ("gate=/no/such.safetensors", r"gate='/no/such.safetensors': no such file; save a psr_hf.gates.MarginHead"),
    ("distilled=/no/such", r"distilled='/no/such': no such folder; train one with psr-hf train-gate"),
    ("gate={head},engine=true", r"engine=true and gate=.*head.safetensors exclude each other: the engine's decode "
                                r"steps do not run gates"),
    ("distilled={gated},engine=true", r"engine=true and distilled=.*distilled_gated \(it holds a gate, "
                                      r".*gate.safetensors\) exclude each other"),
    ("gate={head},speculative=exact,drafter=tiny-moe", r"speculative= and gate=.*exclude each other"),
    ("gate={head},distilled={gated}", r"gate=.*head.safetensors and distilled=.*distilled_gated both give a gate"),
    ("distilled={plain},peft=adapter", r"distilled= and peft='adapter' exclude each other"),
    ("gate={calibration}", r"is not a psr_hf margin head"),
])
def test_gate_args_that_cannot_work_fail_before_loading(artefacts, weightless, args, message):
    from psr_hf.assets import OLMOE_ROUTING
    from psr_hf.eval.lm_model import PSRLM

    paths = {**artefacts, "calibration": OLMOE_ROUTING / "calibration.safetensors"}
    with pytest.raises(ValueError, match=message):
        PSRLM.create_from_arg_string(f"pretrained={weightless},{ROUTING_ARGS},{args.format(**paths)}",
                                     {"device": "cpu"})


def test_a_gate_with_a_policy_without_margins_fails_with_patchs_message(artefacts):
    from psr_hf.eval.lm_model import PSRLM

    with pytest.raises(ValueError, match=r"gate=: a margin head sets the bonus of a biased policy with a fixed "
                                         r"bonus scale; got policy='exact'"):
        PSRLM.create_from_arg_string(f"pretrained={MODEL},dtype=float32,policy=exact,residency=0.375,"
                                     f"gate={artefacts['head']}", {"device": "cpu"})
