"""The ``psr-hf`` command as a first user meets it: one model-name resolver for every command (shipped names, local
directories, hub ids, typos, non-MoE models, offline), help texts, devices and outputs checked before any work,
progress on stderr, the plots, the thread choice, and short reprs of the result objects."""

from __future__ import annotations

import argparse
import socket
import time

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.assets import TINY_MOE, resolve_model
from psr_hf._threads import SMALL_HIDDEN
from psr_hf.cli import build_parser, main
from psr_hf.testing import save_tiny, tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if anything resolves a host name (every connection to the hub starts with one)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access attempted: getaddrinfo{args}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


@pytest.fixture
def gpt2_dir(tmp_path):
    """A saved tiny GPT-2 (not a Mixture of Experts), built from a config offline."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)).save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------- resolver
def test_the_shipped_name_resolves_to_the_packaged_directory(no_network):
    source = resolve_model("tiny-moe")
    assert source.kind == "shipped" and source.directory == TINY_MOE
    assert source.model_type == "olmoe" and source.hidden_size == 128
    assert source.from_pretrained_kwargs == {"local_files_only": True}


def test_a_local_model_directory_resolves_with_its_config(tmp_path, no_network):
    path = save_tiny("olmoe", tmp_path / "model")
    source = resolve_model(str(path))
    assert source.kind == "directory" and source.directory == path and source.model_type == "olmoe"


@pytest.mark.parametrize("name, message", [
    ("tiny_moe", "no model 'tiny_moe': not a named model (tiny-moe, olmoe-routing, moonlight-routing, qwen36-routing), not a local directory, not a hub id "
                 "(owner/name); did you mean tiny-moe?"),
    ("tinymoe", "did you mean tiny-moe?"),
    ("/nonexistent/path/model", "no model '/nonexistent/path/model': no such local directory"),
])
def test_a_name_that_is_nothing_says_what_was_looked_for(name, message, no_network):
    with pytest.raises(ValueError) as info:
        resolve_model(name)
    assert message in str(info.value)


def test_a_misspelt_directory_suggests_the_one_beside_it(tmp_path, no_network):
    save_tiny("olmoe", tmp_path / "my-model")
    with pytest.raises(ValueError, match=r"did you mean .*my-model\?"):
        resolve_model(str(tmp_path / "my-modle"))


def test_a_non_moe_model_is_refused_naming_the_supported_types(gpt2_dir, no_network):
    with pytest.raises(ValueError) as info:
        resolve_model(str(gpt2_dir))
    message = str(info.value)
    assert "gpt2 (GPT2LMHeadModel): not a Mixture-of-Experts model" in message
    for model_type in psr_hf.testing.FAMILIES:
        assert model_type in message


def test_an_unsupported_moe_architecture_is_named_as_one(tmp_path, no_network):
    path = tmp_path / "mixtral"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], '
                                      '"num_local_experts": 8}')
    with pytest.raises(ValueError, match="a Mixture-of-Experts architecture psr_hf does not support yet"):
        resolve_model(str(path))


def test_offline_a_hub_id_is_looked_up_in_the_local_cache_only(monkeypatch, tmp_path, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"the hub is offline .* not in the local hub cache"):
        resolve_model("someone/some-moe")
    assert time.perf_counter() - start < 2.0  # no retries
    assert not no_network


@pytest.mark.parametrize("command", [
    ["calibrate", "--text", "x.txt", "--out", "c.safetensors", "--model"],
    ["demo", "--model"],
    ["excess-nll", "--model"],
    ["bench", "--device", "cpu", "--model"],
])
def test_every_command_resolves_names_the_same_way_and_fails_fast(command, monkeypatch, capsys, gpt2_dir,
                                                                  no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    assert main([*command, "tiny_moe"]) == 2
    err = capsys.readouterr().err
    assert "no model 'tiny_moe'" in err and "did you mean tiny-moe?" in err
    assert main([*command, "owner/not-cached-anywhere"]) == 2
    assert "the hub is offline" in capsys.readouterr().err
    assert main([*command, str(gpt2_dir)]) == 2
    err = capsys.readouterr().err
    assert "not a Mixture-of-Experts model" in err and "Traceback" not in err
    assert time.perf_counter() - start < 10.0
    assert not no_network


def test_a_typo_names_the_nearest_model_on_stderr(capsys, no_network):
    assert main(["excess-nll", "--model", "tiny_moe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("psr-hf excess-nll: error: no model 'tiny_moe'") and "did you mean tiny-moe?" in err


@pytest.mark.parametrize("given", ["olmoe-1b-7b", "moonlight-16b-a3b", "Qwen3.6-35B-A3B"])
def test_a_grow_targets_name_given_as_a_model_names_the_model_grown_to_it(given, capsys, no_network):
    from psr_hf.assets.loading import GROWN, load_model, model_hidden_size

    grown = next(name for name, (_, preset) in GROWN.items() if preset == given.lower())
    message = f"model '{given}' is a grow target .* named {grown}: use that name"
    with pytest.raises(ValueError, match=message):
        model_hidden_size(given)
    with pytest.raises(ValueError, match=message):
        load_model(given, "cpu")
    assert main(["bench", "--model", given, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"psr-hf bench: error: model '{given}' is a grow target") and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------- help
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_command_has_help():
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, parser in _subcommands().items() for action in parser._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not missing, f"options without help: {missing}"


def test_the_top_level_help_describes_the_tool(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "The library logs" not in out
    assert "Mixture-of-Experts" in out and "tiny-moe" in out


def test_kl_is_another_name_of_excess_nll(capsys):
    commands = _subcommands()
    assert commands["kl"] is commands["excess-nll"]
    assert main(["kl", "--residencies", "1.5"]) == 2
    assert capsys.readouterr().err.startswith("psr-hf kl: error: residency=1.5 must be a number in (0, 1]")


def test_the_shared_options_say_the_same_on_every_command():
    from psr_hf.cli.options import THREADS_HELP

    helps: dict[str, set[str]] = {"--model": set(), "--device": set(), "--threads": set()}
    for name, parser in _subcommands().items():
        for action in parser._actions:
            for option in set(action.option_strings) & set(helps):
                if not (option == "--threads" and name == "bench-policy"):  # its own: numba's replay threads
                    helps[option].add(action.help)
    assert helps["--threads"] == {THREADS_HELP}
    assert all("a model directory or a hub id owner/name (docs/models.md)" in h for h in helps["--model"])
    assert all(h.startswith("torch device") for h in helps["--device"])


def test_bench_help_lists_the_shipped_model(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "tiny-moe" in capsys.readouterr().out


def test_grow_help_names_the_shipped_models(capsys):
    from psr_hf.cli import main

    with pytest.raises(SystemExit):
        main(["grow", "--help"])
    out = capsys.readouterr().out
    assert "tiny-moe" in out and "olmoe-routing" in out


# ---------------------------------------------------------------------------------------------------- devices, outputs
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_a_sweeps_divergence_stage_alone_needs_only_its_quality_device():
    from psr_hf.cli import build_parser
    from psr_hf.cli.options import check_device

    base = ["sweep", "--model", "grown-olmoe-routing", "--device", "cuda:0"]
    check_device(build_parser().parse_args(base + ["--quality-device", "cpu", "--stage", "quality"]))
    for extra, option in ((["--quality-device", "cpu"], "--device"), (["--stage", "quality"], "--device"),
                          (["--quality-device", "cuda:0", "--stage", "quality"], "--quality-device")):
        with pytest.raises(ValueError, match=f"{option} cuda:0: torch sees no CUDA device"):
            check_device(build_parser().parse_args(base + extra))


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


# ---------------------------------------------------------------------------------------------------- threads
def test_a_small_model_on_the_cpu_runs_with_one_thread_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    text = tmp_path / "t.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 20)
    command = ["calibrate", "--model", "tiny-moe", "--text", str(text), "--out", str(tmp_path / "c.safetensors"),
               "--max-tokens", "64"]
    assert resolve_model("tiny-moe").hidden_size <= SMALL_HIDDEN
    try:
        torch.set_num_threads(2)
        assert main(command) == 0
        assert torch.get_num_threads() == 1  # the CLI's choice for a small model
        assert main([*command, "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2  # the user's
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert main(command) == 0
        assert torch.get_num_threads() == 2  # OMP_NUM_THREADS set: the CLI leaves torch alone
    finally:
        torch.set_num_threads(1)
    assert main([*command, "--threads", "0"]) == 2
    assert "--threads 0: give at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- progress, plots
def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_excess_nll_shows_progress_on_stderr_and_writes_its_plot(tmp_path, capsys):
    plot = tmp_path / "excess-nll.png"
    assert main(["excess-nll", "--windows", "2", "--tokens", "32", "--residencies", "0.5,0.25", "--lams", "0.1,0.3",
                 "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    assert "excess NLL: 100%" in captured.err and "window" in captured.err  # the tqdm bar, finished
    assert "excess NLL: " not in captured.out
    assert f"plot: {plot}" in captured.out and _is_png(plot)


def test_demo_shows_progress_on_stderr_and_writes_its_plot(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    assert main(["demo", "--new-tokens", "2", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    assert "generating: 100%" in captured.err and "excess NLL: 100%" in captured.err
    assert "generating" not in captured.out
    assert _is_png(plot)


def test_bench_prints_its_header_only_once_the_benchmark_has_checked_its_arguments(capsys):
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--configs", "no_such_row"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no header above the error
    assert "psr-hf bench: error: --configs: unknown no_such_row" in captured.err


def test_warm_up_says_it_compiles_on_a_line_of_its_own_before_the_bar(monkeypatch, capsys):
    from numba.core import event

    import psr_hf.testing
    from psr_hf._progress import tqdm

    def compile_kernels(progress=False):  # the warm-up's bar, and numba's event while it compiles a kernel
        bar = tqdm(total=2, unit="run", desc="warm-up", disable=not progress)
        with event.trigger_event("numba:compile"):
            bar.update()
        bar.update()
        bar.close()
        return 2

    monkeypatch.setattr(psr_hf.testing, "warm_up", compile_kernels)
    assert main(["warm-up"]) == 0
    first, rest = capsys.readouterr().err.split("\n", 1)
    assert first.startswith("psr-hf warm-up: compiling the policy kernels into numba's cache")
    assert "warm-up: 100%" in rest and "compil" not in rest


def test_the_plot_refuses_no_rows_and_rows_of_something_else(tmp_path):
    from psr_hf.eval.divergence import plot_divergence

    with pytest.raises(ValueError, match="no divergence rows to plot"):
        plot_divergence([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="is not a divergence row"):
        plot_divergence([{"name": "bench row", "ms_per_token": 1.0}], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------------- reprs
def _short(obj: object, name: str) -> str:
    text = repr(obj)
    assert text.startswith(name + "(") and "\n" not in text and len(text) <= 200, text
    assert "array(" not in text and "..." not in text, text
    return text


def test_result_objects_have_short_one_line_reprs():
    from psr_hf.eval.divergence import divergence
    from psr_hf.offload.config import OffloadConfig

    model = tiny_model("olmoe")
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    config = psr_hf.RoutingConfig(policy="psr", residency=0.5)
    with psr_hf.patched(model, config, offload=OffloadConfig(device="cpu")):
        ctl = psr_hf.controller(model)
        with ctl.record() as rec:
            model(input_ids=ids)
        stats = ctl.stats()
        assert "tokens=48" in _short(stats, "RoutingStats")
        _short(stats.offload, "OffloadStats")
        _short(ctl.memory(), "OffloadMemory")
        _short(ctl.cache.stats(), "CacheStats")
    recording = rec.recordings[0]
    assert _short(recording, "Recording").startswith("Recording(tokens=24, layers=3, experts=16, top_k=4")
    result = psr_hf.replay(config, recording)
    assert "tokens=24" in _short(result, "ReplayResult")

    cache = psr_hf.LogicalCache(config, num_layers=2, num_experts=16, top_k=4)
    rng = np.random.default_rng(0)
    one = cache.step(0, rng.standard_normal((1, 1, 16)).astype(np.float32))
    assert _short(one, "StepPlan").startswith("StepPlan(selected=[")
    block = cache.step(1, rng.standard_normal((1, 50, 16)).astype(np.float32),
                       rng.standard_normal((1, 50, 16)).astype(np.float32), np.zeros((1, 50), dtype=np.int64))
    assert "block=[1, 50]" in _short(block, "StepPlan")

    rows = divergence(model, [ids[:1]], {"exact": psr_hf.RoutingConfig(policy="exact", residency=0.5)})
    assert "excess_nll=0.0000" in _short(rows[0], "DivergenceRow")


# ---------------------------------------------------------------------------------------------------- warm-up
_COUNT_COMPILES = """
import sys, torch
from numba.core import event
from psr_hf.testing import tiny_model  # first, as a notebook would: every kernel module must still cache
import psr_hf
compiled = []
class L(event.Listener):
    def on_start(self, ev): compiled.append(str(ev.data.get("dispatcher", "")))
    def on_end(self, ev): pass
event.register("numba:compile", L())
model = tiny_model(sys.argv[1])
ids = torch.arange(12).reshape(1, 12)
calibration = psr_hf.calibrate(model, ids, max_length=12, progress=False)
for offload in (None, psr_hf.OffloadConfig(device="cpu")):  # the policy's kernels, then the slot scheduler's too
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, capacity=8), calibration=calibration,
                 offload=offload)
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    model(ids.repeat(2, 1))  # a block of rows
    psr_hf.unpatch(model)
print("COMPILED", len(compiled))
"""


def _compiles(family, env):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _COUNT_COMPILES, family], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split("COMPILED")[-1])


def test_warm_up_fills_the_numba_cache_so_a_first_generate_compiles_nothing(tmp_path, capsys):
    """`make install` runs `psr-hf warm-up`: afterwards a new process patching a model and generating loads every
    policy kernel from the on-disk cache (no numba compilation), where an empty cache compiles them."""
    import os
    import subprocess
    import sys

    from pathlib import Path

    # the user's default cache folder (no NUMBA_CACHE_DIR): where psr_hf puts it, whichever module loads first
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    assert _compiles("olmoe", env) > 0  # an empty cache compiles
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache2")
    warm = subprocess.run([sys.executable, "-m", "psr_hf.cli", "warm-up"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert "policy kernels compiled and cached" in warm.stdout
    assert _compiles("olmoe", env) == 0
    assert _compiles("deepseek_v3", env) == 0  # the sigmoid-with-bias router's argument types too
    package = Path(__file__).resolve().parents[1] / "psr_hf"
    assert not list(package.rglob("*.nbi")) and not list(package.rglob("*.nbc"))  # nothing beside the sources


def test_sweep_join_needs_the_record_it_completes(tmp_path, capsys):
    from psr_hf.cli import main

    assert main(["sweep", "--model", "tiny", "--join", str(tmp_path / "quality.json")]) == 2
    err = capsys.readouterr().err
    assert "--join RECORD needs --json" in err and "Traceback" not in err
    assert main(["sweep", "--model", "tiny", "--json", str(tmp_path / "a.json"),
                 "--join", str(tmp_path / "missing.json")]) == 2
    assert "no such sweep record" in capsys.readouterr().err
