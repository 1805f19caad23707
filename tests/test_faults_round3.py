"""Faults and hostile input, round 3: each test failed on the code before its fix (silent wrong results in the
controller, the engine and the offload; loaders and the CLI with hostile input; outputs checked before the work)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.hf.inputs import cache_keyword
import psr_hf.engine
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, new=6):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


# ---------------------------------------------------------------------------------------------- reconfigure
def test_reconfigure_without_a_calibration_keeps_the_models_and_false_drops_it():
    model = tiny_model("olmoe")
    calibration = psr_hf.calibrate(model, _ids(0, 4, 24), progress=False)
    psr = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)
    exact = RoutingConfig(policy="exact", eviction="score", budget=1, residency=0.25)
    ids = _ids(1, 1, 5)
    with psr_hf.patched(model, exact, calibration=calibration):
        want = _generate(model, ids), psr_hf.controller(model).stats().total
    with psr_hf.patched(model, psr, calibration=calibration):
        ctl = psr_hf.controller(model)
        ctl.reconfigure(exact)  # no calibration=: the model's own
        assert ctl.calibration is not None and np.array_equal(ctl.calibration.expert_counts,
                                                              calibration.expert_counts)
        got = _generate(model, ids), ctl.stats().total
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])
        assert got[1] == want[1]
        ctl.reconfigure(exact, calibration=False)  # explicitly uncalibrated
        assert not np.array_equal(ctl.calibration.expert_counts, calibration.expert_counts)
        ctl.reconfigure(exact)  # uncalibrated stays uncalibrated
        assert not np.array_equal(ctl.calibration.expert_counts, calibration.expert_counts)


# ---------------------------------------------------------------------------------------------- the engine's weights
def _engine_case(offload=None):
    import psr_hf.engine as engine

    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5), offload=offload)
    engine.attach(model, max_len=32)
    return model


@pytest.mark.parametrize("layer", [0, -1])  # a stacked router (with the next layer's) and the last one
@pytest.mark.parametrize("how", ["copy_", "load_state_dict", "replace"])
def test_a_compiled_generate_routes_with_router_weights_changed_after_compile(layer, how):
    model = _engine_case()
    ids = _ids(2, 1, 5)
    router = psr_hf.controller(model).layers[layer].router
    new = router.weight.detach() * -1.5 + 0.01
    if how == "copy_":
        with torch.no_grad():
            router.weight.copy_(new)
    elif how == "load_state_dict":
        router.load_state_dict({"weight": new}, strict=False)
    else:
        router.weight = torch.nn.Parameter(new.clone())
    if how == "replace" and layer == -1:  # the last router is read where it lives: refused, with what to do
        with pytest.raises(RuntimeError, match="attach the engine again"):
            _generate(model, ids)
        return
    got = _generate(model, ids)
    psr_hf.engine.detach(model)
    want = _generate(model, ids)  # the transformers path, on the same weights
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_a_compiled_model_converted_to_another_dtype_fails_naming_the_engine():
    model = _engine_case()
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"engine was built on it .*attach the engine again"):
        _generate(model, _ids(3, 1, 4))


# ---------------------------------------------------------------------------------------------- continuation
def _step(model, token, cache):
    with torch.no_grad():
        return model(input_ids=token, use_cache=True, **{cache_keyword(model): cache})


@pytest.mark.parametrize("longer", [False, True])  # the prompt in between shorter or longer than the first
def test_continuing_a_kv_cache_after_another_prompts_forward_raises(longer):
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5))
    first = _step(model, _ids(4, 1, 6), None)
    _step(model, _ids(5, 1, 9 if longer else 3), None)  # another prompt: a new routing sequence
    token = first.logits[:, -1:].argmax(-1)
    with pytest.raises(RuntimeError, match=r"KV cache of 6 positions.*belongs to .*reset\(\)"):
        _step(model, token, first.past_key_values)
    psr_hf.controller(model).reset()  # what the message says: continue this cache with fresh routing state
    assert _step(model, token, first.past_key_values).logits.shape[1] == 1


def test_continuing_the_same_cache_and_generate_with_it_still_work():
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5))
    out = _step(model, _ids(6, 1, 5), None)
    for _ in range(3):
        out = _step(model, out.logits[:, -1:].argmax(-1), out.past_key_values)
    ids = _ids(7, 1, 4)
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        more = model.generate(first.sequences, **{cache_keyword(model): first.past_key_values}, max_new_tokens=3,
                              do_sample=False, pad_token_id=0)
    assert more.shape[1] == first.sequences.shape[1] + 3


def test_a_compiled_generate_past_max_len_counts_and_records_the_sequence_once():
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5))
    ids = _ids(8, 1, 5)
    ctl = psr_hf.controller(model)
    with ctl.record() as want_rec:
        want = _generate(model, ids, new=20)
    want_stats = ctl.stats().total
    ctl.reset_stats()
    psr_hf.engine.attach(model, max_len=16)  # 5 + 20 positions: the engine hands over to transformers midway
    with ctl.record() as got_rec:
        got = _generate(model, ids, new=20)
    got_stats = ctl.stats().total
    assert psr_hf.engine.attached(model).fallbacks > 0
    assert torch.equal(got[0], want[0])
    assert got_stats["tokens"] == want_stats["tokens"] == 24  # each routed position once
    assert got_stats["demand_per_token"] == pytest.approx(want_stats["demand_per_token"])
    assert len(got_rec.recordings) == len(want_rec.recordings) == 1
    np.testing.assert_array_equal(got_rec.recordings[0].selected, want_rec.recordings[0].selected)


# ---------------------------------------------------------------------------------------------- CPU determinism
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_cpu_offload_is_bitwise_deterministic_across_calls_and_slot_layouts(family, threads, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("PSR_HF_THREADS", str(threads))  # patch() would give a small CPU model one thread
    try:
        model = tiny_model(family)
        psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
                     offload=OffloadConfig(device="cpu"))
        assert torch.get_num_threads() == threads
        block = _ids(9, 2, 12)
        logits, generated, layouts = [], [], set()
        for i in range(3):
            with torch.no_grad():
                logits.append(model(block).logits)
            generated.append(_generate(model, block[:1], new=5)[1])
            with torch.no_grad():  # another sequence in between leaves another slot layout
                model(_ids(30 + i, 3, 9))
            layouts.add(tuple(tuple(st.slot_expert.tolist()) for st in psr_hf.controller(model).offload.scheduler.layers))
        assert len(layouts) > 1  # the slots held the experts in other places between the calls
        assert all(torch.equal(x, logits[0]) for x in logits)
        assert all(torch.equal(x, generated[0]) for x in generated)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- hostile files
def _predictor_file(tmp_path, name="p.safetensors", scale=1.0, **header):
    from safetensors.torch import save_file

    from psr_hf.prefetch.predictor import Predictor

    g = torch.Generator().manual_seed(0)
    A = [torch.randn(2, 8, generator=g) * scale for _ in range(2)]
    B = [torch.randn(4, 2, generator=g) for _ in range(2)]
    path = Predictor(A, B, {"made": "by a test"}).save(tmp_path / name)
    if header:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
        meta.update(header)
        save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("header, message", [
    (dict(num_layers="4000000"), r"says 4000000 layers .* holds 4"),
    (dict(num_layers="many"), r"num_layers 'many' is not an integer"),
    (dict(user="[" * 100_000 + "]" * 100_000), r"nested too deeply"),
    (dict(user="[1, 2]"), r"must be a JSON object, not a list"),
    (dict(user="x" * (2 << 20)), r"is not a JSON text of at most"),
])
def test_predictor_load_refuses_a_hostile_header_cheaply(tmp_path, header, message):
    from psr_hf.prefetch.predictor import Predictor

    path = _predictor_file(tmp_path, **header)
    with pytest.raises(ValueError, match=message) as error:
        Predictor.load(path)
    assert len(str(error.value)) < 400  # the message names the problem, it does not echo the file


def test_predictor_load_refuses_weights_no_trained_predictor_has(tmp_path):
    from psr_hf.prefetch.predictor import Predictor

    with pytest.raises(ValueError, match=r"A.0 holds values that are not finite or beyond"):
        Predictor.load(_predictor_file(tmp_path, scale=1e20))
    assert Predictor.load(_predictor_file(tmp_path, name="ok.safetensors")).metadata["made"] == "by a test"


@pytest.mark.parametrize("user, message", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                           ("[1]", "must be a JSON object")])
def test_calibration_load_refuses_hostile_user_metadata(tmp_path, user, message):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("olmoe")
    path = tmp_path / "c.safetensors"
    psr_hf.calibrate(model, _ids(0, 2, 12), progress=False).save(path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "user": user})
    with pytest.raises(ValueError, match=message):
        psr_hf.Calibration.load(path)


@pytest.mark.parametrize("text, message", [
    ("policy: [psr]\nresidency: 0.5\n", r"policy=\['psr'\] is not supported; allowed: .*\(a policy name, as a string\)"),
    ("policy: !!python/object/apply:os.system ['true']\n", r"YAML tags that build objects are refused"),
    ("policy: psr\n  residency: [0.5\n", r"not valid YAML"),
])
def test_a_hostile_routing_yaml_is_a_value_error_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        RoutingConfig.load_yaml(path)


# ---------------------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("offload", [None, OffloadConfig(device="cpu")], ids=["resident", "offloaded"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copying_a_patched_model_fails_naming_psr_hf_and_what_to_do(tmp_path, offload, how):
    import copy
    import pickle

    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5), offload=offload)
    copies = {"deepcopy": lambda: copy.deepcopy(model), "pickle": lambda: pickle.dumps(model),
              "torch.save": lambda: torch.save(model, tmp_path / "m.pt")}
    with pytest.raises(TypeError, match=r"psr_hf: a patched model cannot be deep-copied or pickled.*unpatch"):
        copies[how]()
    torch.save(model.state_dict(), tmp_path / "state.pt")  # what the message offers works
    psr_hf.unpatch(model)
    copies[how]()  # and the unpatched model copies as before


# ---------------------------------------------------------------------------------------------- outputs first
def _cli(argv):
    import time as _time

    from psr_hf.cli import main

    started = _time.perf_counter()
    code = main(argv)
    return code, _time.perf_counter() - started


@pytest.mark.parametrize("case", ["calibrate-missing-folder", "calibrate-folder", "train-predictor-under-a-file",
                                  "grow-dangling-link", "kl-json-missing-folder", "kl-plot-missing-folder",
                                  "kl-text-folder", "kl-residency"])
def test_outputs_and_inputs_are_checked_before_the_work(tmp_path, capsys, case):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    text = tmp_path / "text.txt"
    text.write_text("def f():\n    return 1\n" * 50)
    argv, expected = {
        "calibrate-missing-folder": (["calibrate", "--model", "tiny-moe", "--text", str(text), "--out",
                                      str(tmp_path / "no" / "c.safetensors")], "does not exist; create it first"),
        "calibrate-folder": (["calibrate", "--model", "tiny-moe", "--text", str(text), "--out", str(tmp_path)],
                             "is a folder; give the file to write"),
        "train-predictor-under-a-file": (["train-predictor", "--model", "tiny-moe", "--out",
                                          str(tmp_path / "a_file" / "p.safetensors")], "does not exist"),
        "grow-dangling-link": (["grow", "--model", "tiny-moe", "--out", str(tmp_path / "dangling")],
                               "a symbolic link to nothing"),
        "kl-json-missing-folder": (["excess-nll", "--model", "tiny-moe", "--json", str(tmp_path / "no" / "kl.json")],
                                   "does not exist; create it first"),
        "kl-plot-missing-folder": (["excess-nll", "--model", "tiny-moe", "--plot", str(tmp_path / "no" / "kl.png")],
                                   "does not exist; create it first"),
        "kl-text-folder": (["excess-nll", "--model", "tiny-moe", "--text", str(tmp_path)], "--text .*: no such file"),
        "kl-residency": (["excess-nll", "--model", "tiny-moe", "--residencies", "1.5"], "residency=1.5"),
    }[case]
    code, seconds = _cli(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    import re

    assert re.search(expected, err), err
    assert seconds < 5.0  # before loading a model or running anything
