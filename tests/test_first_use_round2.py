"""First use, round 2: what a new user hits first (the wheel, the package's attributes, devices, goals on a CPU,
the numba cache). Each test failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
@pytest.mark.parametrize("argv", [["grow", "--model", "tiny-moe", "--device", "cuda"],
                                  ["sweep", "--model", "grown-olmoe-routing"],
                                  ["bench", "--model", "tiny", "--device", "cuda:0"]])
def test_a_cuda_device_this_torch_cannot_use_is_refused_before_anything_loads(tmp_path, capsys, argv):
    import time

    from psr_hf.cli import main

    if argv[0] == "grow":
        argv = argv + ["--out", str(tmp_path / "grown")]
    started = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "torch sees no CUDA device" in err and "use --device cpu" in err and "Traceback" not in err
    assert time.perf_counter() - started < 5.0


@pytest.mark.parametrize("model, device", [("tiny-moe", "cpu"), ("olmoe-routing", "cpu"), ("tiny", "cpu"),
                                           ("grown-olmoe-routing", "cuda:0")])
@pytest.mark.parametrize("command", ["sweep", "bench", "profile-window"])
def test_small_models_run_on_the_cpu_unless_told_otherwise(command, model, device):
    from psr_hf.cli import build_parser
    from psr_hf.cli.options import check_device

    args = build_parser().parse_args([command, "--model", model])
    if device.startswith("cuda") and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            check_device(args)
    else:
        check_device(args)
        assert args.device == device


def test_grow_help_names_the_shipped_models(capsys):
    from psr_hf.cli import main

    with pytest.raises(SystemExit):
        main(["grow", "--help"])
    out = capsys.readouterr().out
    assert "tiny-moe" in out and "olmoe-routing" in out


def test_import_psr_hf_makes_every_subpackage_an_attribute():
    import psr_hf

    assert psr_hf.engine.__name__ == "psr_hf.engine" and hasattr(psr_hf.engine, "attach")
    assert psr_hf.prefetch.__name__ == "psr_hf.prefetch" and psr_hf.eval.__name__ == "psr_hf.eval"
    assert {"engine", "prefetch", "eval"} <= set(dir(psr_hf))
    with pytest.raises(AttributeError):
        psr_hf.no_such_thing


def test_patch_uses_the_calibration_beside_a_model_loaded_from_its_folder(caplog):
    import logging

    import psr_hf
    from psr_hf.assets import TINY_MOE, load_shipped

    model, _, shipped = load_shipped("tiny-moe")
    assert model.config._name_or_path and psr_hf.Calibration.load(TINY_MOE / "calibration.safetensors")
    with caplog.at_level(logging.INFO, logger="psr_hf"):
        psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5))
    ctl = psr_hf.controller(model)
    assert (ctl.calibration.expert_counts == shipped.expert_counts).all()
    assert "using the calibration beside the model" in caplog.text and "no calibration" not in caplog.text
    psr_hf.unpatch(model)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5), calibration=False)
    assert not (psr_hf.controller(model).calibration.expert_counts == shipped.expert_counts).all()
    psr_hf.unpatch(model)


def test_a_misspelled_policy_gets_a_suggestion():
    import psr_hf

    with pytest.raises(ValueError, match=r"policy='pssr' is not supported; allowed: .*did you mean 'psr'\?"):
        psr_hf.RoutingConfig(policy="pssr", residency=0.5)


@pytest.mark.parametrize("name, hint", [("calibration", "make one with psr-hf calibrate"),
                                        ("predictor", "train one with psr-hf train-predictor")])
def test_a_missing_lm_eval_file_says_how_to_make_one(name, hint):
    from psr_hf.eval.lm_model import _existing_file

    with pytest.raises(ValueError, match=rf"{name}='nowhere.safetensors': no such file; {hint}"):
        _existing_file(name, "nowhere.safetensors")


@pytest.mark.parametrize("env, expected", [({}, 1), ({"PSR_HF_THREADS": "2"}, 2), ({"OMP_NUM_THREADS": "2"}, 2)])
def test_patch_gives_a_small_cpu_model_one_thread_unless_the_user_chose(monkeypatch, env, expected):
    import psr_hf
    from psr_hf.testing import tiny_model

    for name in ("PSR_HF_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = tiny_model("olmoe")
        psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5))
        assert torch.get_num_threads() == expected
        torch.set_num_threads(2)  # after patch(): the user's call wins
        assert torch.get_num_threads() == 2
        psr_hf.unpatch(model)
    finally:
        torch.set_num_threads(before)


def test_a_bad_thread_count_is_a_clear_error(monkeypatch):
    from psr_hf._threads import decide

    monkeypatch.setenv("PSR_HF_THREADS", "many")
    with pytest.raises(ValueError, match=r"PSR_HF_THREADS='many': give a number of threads >= 1"):
        decide(64, "cpu")
