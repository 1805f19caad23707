"""The engine's batched prefill (psr_hf/engine/prefill.py) against its token-by-token prefill (CPU, float32).

The prompt runs as one block through the patched model's forward; per MoE layer the controller steps the logical
cache through the positions in order, so every policy must make the token-by-token prefill's decisions at every
prompt position and layer (resident and offloaded to CPU slots), count the same copies, leave the same routing state
(the decode after it selects the same experts and generates the same tokens), and write the engine's KV cache with
what its own steps write (within float noise: a block matmul against one-row matmuls). Next-token logits agree
within 1e-4 of the largest |logit|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.engine import Decoder, GraphDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

MAX_LEN = 48
NEW = 5
LOGITS_TOL = 1e-4
CONFIGS = {
    "exact_lru": dict(policy="exact", eviction="lru", residency=0.5),
    "exact_prefetch": dict(policy="exact", budget=2, residency=0.5),
    "cache_prior": dict(policy="cache_prior", lam=0.3, eviction="lru", residency=0.5),
    "cache_prior_running_topj": dict(policy="cache_prior", lam=0.3, top_j=1, delta_mode="running", residency=0.5),
    "psr": dict(policy="psr", lam=0.3, budget=1, residency=0.5),
    "psr_low_residency": dict(policy="psr", lam=0.2, budget=2, residency=0.25),
    "spec": dict(policy="spec", residency=0.5),
    "psr_distance2": dict(policy="psr", lam=0.3, budget=2, residency=0.5, prefetch_distance=2),
}


def _long_prompt(case, name):
    model, ids, calibration, _ = case(name)
    if ids.shape[1] < 12:  # the random models' 8-id prompt, grown so the cache fills and evicts within it
        ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    return model, ids, calibration


def _run(model, ids, decoder_class, batched):
    """Greedy decode after a prefill: (sequences, per-token logits [n, V], recording, stats, KV rows per layer)."""
    ctl = psr_hf.controller(model)
    decoder = decoder_class(model, MAX_LEN) if decoder_class is Decoder else decoder_class(model, MAX_LEN,
                                                                                             graphs=False)
    S = ids.shape[1]
    with ctl.record() as recorder:
        first = decoder.prefill(ids, batched=batched).float().clone()
        kv = [k[:S].clone() for k in decoder.layers.kv.keys if k is not None]
        kv += [t.clone() for t in getattr(decoder.layers.kv, "conv", []) + getattr(decoder.layers.kv, "recurrent", [])
               if t is not None]  # a hybrid model's Gated DeltaNet states after the prompt
        sequences, logits = decoder.generate_greedy(ids, NEW, return_logits=True, batched=batched)
    return first, sequences, logits, recorder.recordings, ctl.stats(), kv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text", "qwen3_next", "shipped"])
def test_batched_prefill_makes_the_token_by_token_decisions(engine_case, name, config, offloaded):
    model, ids, calibration = _long_prompt(engine_case, name)
    offload = psr_hf.OffloadConfig(device="cpu", check_slots=True) if offloaded else None
    results = {}
    with psr_hf.patched(model, RoutingConfig(**CONFIGS[config]), calibration=calibration, offload=offload):
        for batched in (False, True):
            results[batched] = _run(model, ids, Decoder, batched)
    (f0, seq0, log0, rec0, st0, kv0), (f1, seq1, log1, rec1, st1, kv1) = results[False], results[True]
    assert _rel(f1, f0) < LOGITS_TOL  # the prompt's next-token logits
    for a, b in zip(kv1, kv0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # two sequences each (the prefill alone, then the generation): the same decisions at every token and layer
    assert len(rec0) == len(rec1) == 2
    for a, b in zip(rec1, rec0):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.selected, b.selected)
    torch.testing.assert_close(seq1, seq0, rtol=0, atol=0)
    assert _rel(log1, log0) < LOGITS_TOL
    for field in ("tokens", "prefetch_per_token", "demand_per_token", "replaced_per_token"):
        np.testing.assert_array_equal(getattr(st1, field), getattr(st0, field), err_msg=field)


@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_graph_decoder_batched_prefill_equals_its_token_by_token_prefill(engine_case, name):
    model, ids, calibration = _long_prompt(engine_case, name)
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["psr"]), calibration=calibration):
        by_token = _run(model, ids, GraphDecoder, False)
        batched = _run(model, ids, GraphDecoder, True)
    assert _rel(batched[0], by_token[0]) < LOGITS_TOL
    torch.testing.assert_close(batched[1], by_token[1], rtol=0, atol=0)
    for a, b in zip(batched[3], by_token[3]):
        np.testing.assert_array_equal(a.selected, b.selected)


def test_a_prompt_longer_than_the_cache_is_refused_before_anything_runs(engine_case):
    model, _, _ = _long_prompt(engine_case, "olmoe")
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["psr"])):
        decoder = Decoder(model, 8)
        tokens_before = psr_hf.controller(model).stats().total["tokens"]
        with pytest.raises(ValueError, match="max_len 8"):
            decoder.prefill(list(range(3, 12)))
        assert psr_hf.controller(model).stats().total["tokens"] == tokens_before
        decoder.prefill(list(range(3, 11)))  # exactly max_len positions fit
        assert decoder.position == 8


def test_the_engine_continues_a_batched_prompt_where_the_patched_forward_left_it(engine_case):
    """After the block the engine's steps continue the controller's sequence (no new sequence, one recording)."""
    model, ids, calibration = _long_prompt(engine_case, "shipped")
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["psr"]), calibration=calibration):
        ctl = psr_hf.controller(model)
        decoder = Decoder(model, MAX_LEN)
        before = ctl.stats().total["sequences"]
        decoder.prefill(ids)
        for token in (5, 6, 7):
            decoder.step(token)
        assert ctl.stats().total["sequences"] == before + 1
        assert ctl.stats().tokens[-1] == ids.shape[1] + 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "qwen3_5_moe_text"])
def test_cuda_graphs_batched_prefill_makes_the_token_by_token_decisions(name, offloaded):
    """float32 on the GPU, CUDA graphs replayed after the block: the same decisions and tokens."""
    from psr_hf.testing import tiny_model

    model = tiny_model(name).to("cuda")
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    results = {}
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["psr"]), offload=offload):
        decoder = GraphDecoder(model, MAX_LEN, graphs=True)
        ctl = psr_hf.controller(model)
        for batched in (False, True):
            with ctl.record() as recorder:
                sequences, logits = decoder.generate_greedy(ids, NEW, return_logits=True, batched=batched)
            results[batched] = (sequences, logits, recorder.recordings)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    assert _rel(results[True][1], results[False][1]) < LOGITS_TOL
    np.testing.assert_array_equal(results[True][2][0].selected, results[False][2][0].selected)


@pytest.mark.parametrize("config", ["exact_lru", "psr"])
def test_kv_rows_from_transformers_cache_equal_the_engines_own(engine_case, config, monkeypatch):
    """OLMoE's batched prefill copies the KV rows transformers' attention cached; computed by the engine from each
    layer's input instead (the path of a family whose cache differs from transformers'), they are the same rows,
    and the prefill makes the same decisions."""
    from psr_hf.engine.families.olmoe import OlmoeLayers
    from psr_hf.engine.layers import DecodeLayers

    model, ids, calibration = _long_prompt(engine_case, "shipped")
    results = {}
    with psr_hf.patched(model, RoutingConfig(**CONFIGS[config]), calibration=calibration):
        assert Decoder(model, MAX_LEN).layers.kv_from_transformers
        results["transformers"] = _run(model, ids, Decoder, True)
        monkeypatch.setattr(OlmoeLayers, "_transformers_kv", DecodeLayers._transformers_kv)
        assert not Decoder(model, MAX_LEN).layers.kv_from_transformers
        results["engine"] = _run(model, ids, Decoder, True)
    ours, theirs = results["engine"], results["transformers"]
    for a, b in zip(ours[5], theirs[5]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert _rel(ours[0], theirs[0]) < LOGITS_TOL
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
    for a, b in zip(ours[3], theirs[3]):
        np.testing.assert_array_equal(a.selected, b.selected)


def test_the_kv_row_sources_a_family_lacks_say_so(engine_case, monkeypatch):
    """Writing a block's KV rows from a source the family does not define raises, naming what is missing:
    DeepSeek-V3's absorbed cache is not transformers' layout; a family without ``_prompt_kv`` has no batched
    prefill."""
    from psr_hf.engine.families.olmoe import OlmoeLayers
    from psr_hf.engine.layers import DecodeLayers

    model, ids, _ = _long_prompt(engine_case, "deepseek_v3")
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["exact_lru"])):
        layers = Decoder(model, MAX_LEN).layers
        assert not layers.kv_from_transformers and layers.batched_prefill
        rows = torch.zeros(1, 2, ids.shape[1], 4)
        with pytest.raises(NotImplementedError, match="deepseek_v3 engine's KV cache is not transformers' layout"):
            layers.write_transformers_kv(0, rows, rows, 0)
    model, ids, _ = _long_prompt(engine_case, "olmoe")
    monkeypatch.setattr(OlmoeLayers, "_prompt_kv", DecodeLayers._prompt_kv)
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["exact_lru"])):
        layers = Decoder(model, MAX_LEN).layers
        with pytest.raises(NotImplementedError, match="olmoe engine layers define no _prompt_kv"):
            layers.write_prompt_kv(0, torch.zeros(ids.shape[1], layers.hidden_size), 0)


def test_a_family_without_prompt_kv_prefills_token_by_token(engine_case, monkeypatch):
    """A family that does not write the KV rows of a block keeps the token-by-token prefill; asking for the batched
    one says what is missing."""
    from psr_hf.engine.families.olmoe import OlmoeLayers
    from psr_hf.engine.layers import DecodeLayers

    model, ids, _ = _long_prompt(engine_case, "olmoe")
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["psr"])):
        batched = Decoder(model, MAX_LEN).prefill(ids).clone()
        monkeypatch.setattr(OlmoeLayers, "_prompt_kv", DecodeLayers._prompt_kv)
        monkeypatch.setattr(OlmoeLayers, "_transformers_kv", DecodeLayers._transformers_kv)
        decoder = Decoder(model, MAX_LEN)
        assert not decoder.layers.batched_prefill
        by_token = decoder.prefill(ids)
        with pytest.raises(ValueError, match="define neither _prompt_kv nor _transformers_kv"):
            decoder.prefill(ids, batched=True)
    assert _rel(by_token.float(), batched.float()) < LOGITS_TOL


def test_the_composite_qwen3_5_moe_prefills_as_one_block_and_generates_the_transformers_paths_tokens():
    """Qwen3.5/3.6-MoE's image-text class: the batched prefill hands transformers' Gated DeltaNet states to the
    engine (not token by token), and the engine's greedy tokens are the transformers path's."""
    from psr_hf.testing import tiny_model

    model = tiny_model("qwen3_5_moe", dtype=torch.float32)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with psr_hf.patched(model, RoutingConfig(**CONFIGS["psr"])):
        decoder = Decoder(model, MAX_LEN)
        assert decoder.layers.batched_prefill
        by_token = _run(model, ids, Decoder, False)
        batched = _run(model, ids, Decoder, True)
        transformers_path = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    torch.testing.assert_close(batched[1], by_token[1], rtol=0, atol=0)
    torch.testing.assert_close(batched[1], transformers_path, rtol=0, atol=0)
    assert _rel(batched[2], by_token[2]) < LOGITS_TOL
    for a, b in zip(batched[5], by_token[5]):  # keys, values, convolution and recurrent states
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(batched[3], by_token[3]):
        np.testing.assert_array_equal(a.selected, b.selected)
