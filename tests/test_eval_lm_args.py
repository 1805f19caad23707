"""The model args of ``--model psr_hf`` (psr_hf/eval/lm_args.py) and the choices ``PSRLM`` makes from them once.

:meth:`ModelArgs.parse` on the shipped ``tiny-moe`` (resolved, never loaded): every bad value raises one
``ValueError`` naming the arg and the fix, good values become one frozen ``ModelArgs``, with the routing fields
taken out of HFLM's args and the experts' placement chosen. Then ``PSRLM`` on ``tiny-moe``: each setting picks its
generation strategy and placement (psr_hf/eval/lm_generation.py, psr_hf/eval/lm_placement.py).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from psr_hf import RoutingConfig
from psr_hf.assets import TINY_MOE

# the eval extra; the lent GPU's image has no lm-eval
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

from psr_hf.eval.lm_args import ModelArgs  # noqa: E402
from psr_hf.eval.lm_placement import OffloadedPlacement, ResidentPlacement  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CALIBRATION = str(TINY_MOE / "calibration.safetensors")


def _parse(pretrained="tiny-moe", **model_args) -> ModelArgs:
    return ModelArgs.parse(pretrained, {"residency": 0.5, **model_args})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A file of no kind psr_hf reads, a distilled folder without a gate and one with a gate file."""
    root = tmp_path_factory.mktemp("lm_args")
    plain, gated = root / "distilled", root / "distilled_gated"
    plain.mkdir()
    gated.mkdir()
    from psr_hf.training.gate import GATE_FILE

    (gated / GATE_FILE).write_bytes(b"")
    (root / "file.bin").write_bytes(b"")
    return {"file": str(root / "file.bin"), "plain": str(plain), "gated": str(gated)}


# ---------------------------------------------------------------------------------------------- bad values
BAD = [
    # names
    (dict(polcy="psr"), r"unknown psr_hf model arg\(s\) polcy; allowed: routing: policy"),
    (dict(trust_remote_code=True), r"trust_remote_code=True: psr_hf patches transformers' native model classes"),
    # routing
    (dict(policy="fast"), r"policy='fast' is not supported; allowed: exact, cache_prior, psr, spec"),
    (dict(budget="abc"), r"budget='abc' must be an int >= 0"),
    (dict(residency=2), r"residency=2 must be a number in \(0, 1\]"),
    (dict(config="/no/such.yaml"), r"config='/no/such.yaml': no such file"),
    # files
    (dict(calibration="/no/such.safetensors"), r"calibration='/no/such.safetensors': no such file; make one with "
                                                r"psr-hf calibrate"),
    (dict(policy="exact", budget=2, prefetch="predictor", predictor="/no/such.safetensors"),
     r"predictor='/no/such.safetensors': no such file; train one with psr-hf train-predictor"),
    (dict(policy="exact", budget=2, predictor=CALIBRATION), r"predictor= and prefetch=predictor go together"),
    (dict(policy="exact", budget=2, prefetch="predictor"), r"predictor= and prefetch=predictor go together"),
    (dict(policy="exact", budget=2, prefetch="predictor", predictor=CALIBRATION), r"is not a psr_hf predictor"),
    # offload
    (dict(offload="gpu"), r"device='gpu' must be 'cuda', 'cuda:N' or 'cpu'"),
    (dict(offload=3), r"offload=3 must be a device: cuda, cuda:N or cpu"),
    (dict(max_in_flight=2), r"max_in_flight is used only with offload="),
    (dict(offload="cpu", max_in_flight=0), r"max_in_flight=0 must be an int >= 1"),
    (dict(offload="cpu", parallelize=True), r"offload= and parallelize=True exclude each other"),
    # engine
    (dict(engine="yes"), r"engine='yes' must be true or false"),
    (dict(engine_max_len=256), r"engine_max_len is used only with engine=true"),
    (dict(engine=True, engine_max_len=0), r"engine_max_len=0 must be a positive int"),
    (dict(engine=True, engine_max_len=True), r"engine_max_len=True must be a positive int"),
    *[(dict(engine=True, **{name: value}), rf"engine=true and {name}={value!r} exclude each other")
      for name, value in (("parallelize", True), ("tp_plan", "auto"), ("peft", "adapter"), ("autogptq", True),
                          ("gptqmodel", True), ("mixed_precision_dtype", "bfloat16"))],
    # speculative decoding
    (dict(drafter="tiny-moe", pool=24), r"drafter, pool are used only with speculative="),
    (dict(block_threshold=0.1), r"block_threshold are used only with speculative="),
    (dict(speculative="greedy", drafter="tiny-moe"), r"speculative='greedy' must be one of exact, position, "
                                                     r"confidence"),
    (dict(speculative="confidence"), r"speculative=confidence needs drafter=MODEL"),
    (dict(speculative="exact", drafter="tiny-moe", engine=True), r"speculative= and engine=true exclude each other"),
    (dict(speculative="exact", drafter="tiny-moe", offload="cpu"), r"speculative= and offload= exclude each other"),
    (dict(speculative="exact", drafter="tiny-moe", draft_tokens=0), r"draft_tokens=0 must be a positive int"),
    (dict(speculative="exact", drafter="tiny-moe", pool=True), r"pool=True must be a positive int"),
    (dict(speculative="exact", drafter="tiny-moe", block_threshold=-1), r"block_threshold=-1 must be a finite "
                                                                        r"number >= 0"),
    (dict(speculative="exact", drafter="tiny-moe", block_threshold=math.inf), r"block_threshold=inf must be a "
                                                                              r"finite number"),
    (dict(speculative="exact", drafter="tiny_moe"), r"drafter='tiny_moe': no model 'tiny_moe'.*did you mean "
                                                    r"tiny-moe\?"),
    # gates
    (dict(gate="/no/such.safetensors"), r"gate='/no/such.safetensors': no such file; save a psr_hf.gates.MarginHead"),
    (dict(distilled="/no/such"), r"distilled='/no/such': no such folder; train one with psr-hf train-gate"),
    (dict(gate="{file}", engine=True), r"engine=true and gate=.*file.bin exclude each other: the engine's decode "
                                       r"steps do not run gates"),
    (dict(distilled="{gated}", engine=True), r"engine=true and distilled=.*distilled_gated \(it holds a gate, "
                                             r".*gate.safetensors\) exclude each other"),
    (dict(gate="{file}", speculative="exact", drafter="tiny-moe"), r"speculative= and gate=.*exclude each other"),
    (dict(gate="{file}", distilled="{gated}"), r"gate=.*file.bin and distilled=.*distilled_gated both give a gate"),
    (dict(distilled="{plain}", peft="adapter"), r"distilled= and peft='adapter' exclude each other"),
    (dict(gate=CALIBRATION), r"is not a psr_hf margin head"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[",".join(f"{k}={v}" for k, v in a.items()) for a, _ in BAD])
def test_each_bad_model_arg_raises_one_value_error_naming_it(files, args, message):
    args = {name: value.format(**files) if isinstance(value, str) else value for name, value in args.items()}
    with pytest.raises(ValueError, match=message):
        _parse(**args)


@pytest.mark.parametrize("pretrained, args, message", [
    ("tiny_moe", {}, r"no model 'tiny_moe'.*did you mean tiny-moe\?"),
    ("grown-olmoe-routing", dict(tokenizer="tiny-moe"), r"pretrained=grown-olmoe-routing \(built in memory, with "
                                                        r"its own tokenizer on one device\) takes neither"),
    ("grown-olmoe-routing", dict(parallelize=True), r"takes neither tokenizer= nor parallelize=True"),
    ("grown-olmoe-routing", dict(dtype="int8"), r"dtype of pretrained=grown-olmoe-routing: give float32, bfloat16"),
    ("grown-olmoe-routing", dict(calibration="/no/such.safetensors"), r"calibration='/no/such.safetensors': no "
                                                                      r"such file"),
])
def test_a_bad_pretrained_raises_before_anything_loads(pretrained, args, message):
    with pytest.raises(ValueError, match=message):
        _parse(pretrained, **args)


# ---------------------------------------------------------------------------------------------- good values
def test_good_model_args_become_one_frozen_model_args():
    args = _parse(policy="psr", lam=0.3, budget=1, batch_size=4, device="cpu")
    assert args.routing == RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)
    assert args.pretrained == str(TINY_MOE) and args.grown is None
    assert args.calibration == CALIBRATION  # saved beside the model
    assert dict(args.hflm) == {"batch_size": 4, "device": "cpu"}  # the routing fields are psr_hf's
    assert isinstance(args.experts, ResidentPlacement)
    assert not args.engine and args.engine_max_len is None and args.speculative is None
    assert (args.predictor, args.predictor_path, args.gate.path, args.gate.distilled) == (None, None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.engine = True


def test_offload_chooses_the_offloaded_placement_and_loads_on_the_host():
    args = _parse(offload="cpu", max_in_flight=1, device="cuda")
    assert isinstance(args.experts, OffloadedPlacement)
    assert (args.experts.config.device, args.experts.config.max_in_flight) == ("cpu", 1)
    assert args.hflm["device"] == "cpu"
    assert args.experts.accelerate_args() == {"device_map": {"": "cpu"}, "max_memory": None}
    assert _parse(offload=True).experts.config.device == "cuda"  # offload=true
    for off in (None, False):
        assert _parse(offload=off).experts.accelerate_args() is None


def test_the_engine_and_speculative_args_are_checked_and_kept():
    engine = _parse(engine=True, engine_max_len=64)
    assert engine.engine and engine.engine_max_len == 64 and engine.speculative is None
    spec = _parse(speculative="position", drafter="tiny-moe", draft_tokens=4, block_threshold=0)
    assert not spec.engine
    assert (spec.speculative.mode, spec.speculative.drafter.name, spec.speculative.draft_tokens,
            spec.speculative.pool, spec.speculative.threshold) == ("position", "tiny-moe", 4, None, 0.0)


def test_a_grown_model_name_is_built_on_the_offload_device_in_its_dtype():
    args = _parse("grown-olmoe-routing", offload="cpu", dtype="float32", device="cuda")
    assert args.grown is not None and args.grown.name == "grown-olmoe-routing"
    assert (args.grown.device, args.grown.dtype) == (torch.device("cpu"), torch.float32)
    assert "dtype" not in args.hflm and args.hflm["device"] == "cpu"
    resident = _parse("grown-olmoe-routing", device="cpu")
    assert (resident.grown.device, resident.grown.dtype) == (torch.device("cpu"), torch.float32)  # auto on the CPU


# ---------------------------------------------------------------------------------------------- chosen once
@pytest.mark.parametrize("args, generation, placement", [
    ("", "HarnessGeneration", ResidentPlacement),
    ("offload=cpu", "HarnessGeneration", OffloadedPlacement),
    ("engine=true", "EngineGeneration", ResidentPlacement),
    ("engine=true,offload=cpu", "EngineGeneration", OffloadedPlacement),
    ("speculative=exact,drafter=tiny-moe,draft_tokens=4", "SpeculativeGeneration", ResidentPlacement),
])
def test_each_setting_chooses_its_generation_strategy_and_placement(args, generation, placement):
    import psr_hf
    from psr_hf.eval.lm_model import PSRLM

    base = "pretrained=tiny-moe,dtype=float32,policy=exact,residency=0.5"
    lm = PSRLM.create_from_arg_string(f"{base},{args}" if args else base, {"device": "cpu", "batch_size": 2})
    assert type(lm.generation).__name__ == generation and isinstance(lm.experts, placement)
    stats = lm.routing_stats()
    assert (lm.engine is not None) == (generation == "EngineGeneration") == (stats["engine"] is not None)
    assert (lm.block_config is not None) == (generation == "SpeculativeGeneration") == \
        (stats["speculative"] is not None)
    assert (lm.drafter is not None) == (lm.draft_tokens == 4) == (generation == "SpeculativeGeneration")
    offloaded = psr_hf.controller(lm.model).offload is not None
    assert offloaded == (placement is OffloadedPlacement) == ("offload" in stats and "memory" in stats)
