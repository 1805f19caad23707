"""Packaging: the policy layer works without torch, `import psr_hf` is cheap, and the wheel has the right layout."""

import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
POLICY_DIR = REPO / "psr_hf" / "policy"

BLOCK_TORCH = textwrap.dedent(
    """
    import sys

    class _BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is made unimportable by this test")
            return None

    sys.meta_path.insert(0, _BlockTorch())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker did not work")
    """
)


def _run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _loaded_modules(stdout: str) -> dict[str, bool]:
    """Parse ``LOADED name=True`` lines printed by the subprocess."""
    found = re.findall(r"^LOADED (\w+)=(True|False)$", stdout, flags=re.M)
    return {name: value == "True" for name, value in found}


def test_policy_layer_imports_and_replays_without_torch():
    code = BLOCK_TORCH + textwrap.dedent(
        """
        import psr_hf
        import psr_hf.policy
        from psr_hf.policy.traces import calibration_from_trace, synthetic_trace

        trace = synthetic_trace(24, 3, 8, vocab_size=32, seed=1)
        calibration = calibration_from_trace(trace, top_k=2, vocab_size=32)
        result = psr_hf.policy.replay(
            psr_hf.RoutingConfig(policy="psr", capacity=4), trace.scores, trace.pregate, trace.tokens, calibration, 2
        )
        assert result.selected.shape == (24, 3, 2), result.selected.shape
        assert (result.selected >= 0).all() and (result.selected < 8).all()
        print("LOADED torch=" + str("torch" in sys.modules))
        print("REPLAY-OK")
        """
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert "REPLAY-OK" in proc.stdout
    assert _loaded_modules(proc.stdout) == {"torch": False}


def test_policy_layer_does_not_import_torch_even_when_available():
    code = textwrap.dedent(
        """
        import sys
        import psr_hf.policy
        from psr_hf.policy.traces import calibration_from_trace, synthetic_trace

        trace = synthetic_trace(8, 2, 6, vocab_size=16, seed=2)
        calibration = calibration_from_trace(trace, top_k=2, vocab_size=16)
        psr_hf.policy.replay(
            psr_hf.RoutingConfig(policy="cache_prior", capacity=3), trace.scores, None, trace.tokens, calibration, 2
        )
        print("LOADED torch=" + str("torch" in sys.modules))
        """
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert _loaded_modules(proc.stdout) == {"torch": False}


def test_no_policy_module_imports_torch():
    sources = sorted(POLICY_DIR.glob("*.py"))
    names = {path.name for path in sources}
    assert {"__init__.py", "config.py", "calibration.py", "cache.py", "replaying.py", "_kernels.py"} <= names
    torch_import = re.compile(r"^\s*(import|from)\s+torch\b", flags=re.M)
    offenders = [path.name for path in sources if torch_import.search(path.read_text())]
    assert offenders == []


def test_import_psr_hf_alone_does_not_import_numpy_numba_or_torch():
    code = textwrap.dedent(
        """
        import sys
        import psr_hf

        config = psr_hf.RoutingConfig(policy="psr", residency=0.25)
        assert config.capacity_for(64, 8) == 16
        for name in ("numpy", "numba", "torch"):
            print(f"LOADED {name}=" + str(name in sys.modules))
        """
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert _loaded_modules(proc.stdout) == {"numpy": False, "numba": False, "torch": False}


def test_psr_hf_exports_the_policy_names():
    import psr_hf
    import psr_hf.policy

    for name in ("Calibration", "CalibrationBuilder", "LogicalCache", "replay", "ReplayResult"):
        assert name in dir(psr_hf)
        assert getattr(psr_hf, name) is getattr(psr_hf.policy, name)
    assert psr_hf.RoutingConfig is psr_hf.policy.RoutingConfig


def test_unknown_psr_hf_attribute_raises_attribute_error():
    import psr_hf

    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(psr_hf, "not_a_name")


@pytest.mark.slow
def test_wheel_ships_patches_and_the_tiny_model_inside_psr_hf_with_the_cli_entry_point(tmp_path):
    # built from a copy of the sources, so that no build/ or egg-info left in the tree by an earlier build feeds it
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".models", "out", "shards_*", "run_*", "build", "dist", "*.egg-info", "__pycache__",
        "benchmarks", "tests", "*.nbi", "*.nbc"))
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = list(tmp_path.glob("psr_hf-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        entry_points = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        assert len(entry_points) == 1, sorted(names)
        entry_text = wheel.read(entry_points[0]).decode()
    # every family module in patches/ ships as psr_hf.patches.<name> with no list to update (one file per family)
    families = [f"psr_hf/patches/{p.name}" for p in sorted((REPO / "patches").glob("*.py"))]
    assert {"psr_hf/patches/__init__.py", "psr_hf/patches/base.py", "psr_hf/patches/olmoe.py"} <= set(families)
    for required in ("psr_hf/policy/_kernels.py", "psr_hf/cli/__init__.py", "psr_hf/cli/__main__.py",
                     "psr_hf/hf/controller.py",
                     "psr_hf/policy/_mass.py", *families):
        assert required in names, sorted(names)
    shipped = sorted(p.name for p in (REPO / "psr_hf" / "assets" / "tiny_moe").iterdir())
    assert {"config.json", "tokenizer.json", "calibration.safetensors", "README.md"} <= set(shipped), shipped
    for name in shipped:  # the trained tiny model travels whole with the package
        assert f"psr_hf/assets/tiny_moe/{name}" in names, sorted(names)
    assert "psr_hf/assets/persuasion_vol1.txt" in names, sorted(names)  # the demo's held-out text
    assert re.search(r"^\[console_scripts\]$", entry_text, flags=re.M), entry_text
    assert re.search(r"^psr-hf\s*=\s*psr_hf\.cli:main\s*$", entry_text, flags=re.M), entry_text
    assert not any(name.startswith("patches/") for name in names), sorted(names)
    assert not any(name.startswith("tests/") for name in names), sorted(names)
    with zipfile.ZipFile(wheels[0]) as wheel:
        assert wheel.read("psr_hf_lm_eval.pth").decode() == _pth_line()
    for required in ("psr_hf/eval/sandbox.py", "psr_hf/eval/_sandbox_child.py"):  # the HumanEval code runner
        assert required in names, sorted(names)
    assert not [name for name in names if name.endswith((".nbi", ".nbc"))]  # numba caches stay out of the wheel
    # every package of the tree ships (found, not listed: a listed one can be forgotten)
    packages = sorted(str(p.parent.relative_to(REPO)) for p in (REPO / "psr_hf").rglob("__init__.py")
                      if "__pycache__" not in p.parts and not p.parent.is_symlink())
    assert "psr_hf/prefetch" in packages
    for package in packages:
        assert f"{package}/__init__.py" in names, package
    assert not any("moonlight_routing" in name for name in names)  # built on the user's machine, never shipped
    _import_every_module_from_the_installed_wheel(wheels[0], tmp_path / "site")


def _import_every_module_from_the_installed_wheel(wheel: Path, site: Path) -> None:
    """Install the wheel alone into ``site`` and import every module of psr_hf from there, not from this tree."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    code = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        sys.path.insert(0, {str(site)!r})
        import psr_hf
        assert psr_hf.__file__.startswith({str(site)!r}), psr_hf.__file__
        names = sorted(m.name for m in pkgutil.walk_packages(psr_hf.__path__, "psr_hf.")
                       if not m.name.endswith("_sandbox_child"))
        for name in names:
            module = importlib.import_module(name)
            assert module.__file__.startswith({str(site)!r}), (name, module.__file__)
        for name in ("engine", "prefetch", "eval"):  # reachable as attributes of the package
            assert getattr(psr_hf, name).__name__ == "psr_hf." + name
        print(len(names))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=site, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) > 40


def test_policy_replay_is_the_function_even_after_every_submodule_is_imported():
    """psr_hf.policy.replay(config, scores, pregate, tokens, calibration, top_k) is a public signature; a
    submodule of the same name would shadow it once imported."""
    import importlib
    import pkgutil

    import psr_hf.policy

    for module in pkgutil.iter_modules(psr_hf.policy.__path__):
        importlib.import_module(f"psr_hf.policy.{module.name}")
    assert callable(psr_hf.policy.replay)
    import psr_hf

    assert psr_hf.replay is psr_hf.policy.replay


def _pth_line() -> str:
    """setup.py's PTH_LINE, read without running setup.py."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["PTH_LINE"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PTH_LINE")


@pytest.mark.parametrize("module_present", [True, False], ids=["installed", "module_removed"])
def test_pth_line_is_silent_when_the_startup_module_is_gone(tmp_path, module_present):
    """A .pth left behind by a partial uninstall must not print a traceback at every Python start."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    line = _pth_line()
    assert line.startswith("import ") and line.endswith("\n") and line.count("\n") == 1  # one .pth code line
    (site_dir / "psr_hf_lm_eval.pth").write_text(line)
    if module_present:
        shutil.copy(REPO / "startup" / "_psr_hf_lm_eval.py", site_dir)
    code = (f"import site, sys; site.addsitedir({str(site_dir)!r}); "
            "print('LOADED', '_psr_hf_lm_eval' in sys.modules)")
    # -S: no site-packages of this environment, so the editable install's own copy of the module is not found
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == f"LOADED {module_present}"
    if not module_present:  # the line as it was would have printed an error at start-up: the test can tell
        (site_dir / "psr_hf_lm_eval.pth").write_text("import _psr_hf_lm_eval\n")
        proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
        assert "Error processing line 1" in proc.stderr


def test_numba_caches_the_kernels_in_the_users_cache_folder_not_beside_the_package(tmp_path):
    """cache=True alone writes __pycache__/*.nbi|*.nbc next to the modules (site-packages when installed), which
    pip uninstall leaves behind; the kernels cache under $XDG_CACHE_HOME/psr_hf/numba instead, or under the
    user's NUMBA_CACHE_DIR."""
    import os

    code = textwrap.dedent(
        """
        import numba, psr_hf
        from psr_hf.policy import _kernels, _mass  # the two numba modules of the package, in psr_hf's order
        from psr_hf.policy.traces import calibration_from_trace, synthetic_trace

        trace = synthetic_trace(12, 2, 8, vocab_size=16, seed=3)
        calibration = calibration_from_trace(trace, top_k=2, vocab_size=16)
        psr_hf.policy.replay(psr_hf.RoutingConfig(policy="psr", capacity=4), trace.scores, trace.pregate,
                             trace.tokens, calibration, 2)
        print("CACHE_DIR", numba.config.CACHE_DIR)
        """
    )
    def beside_the_package():
        return {p: p.stat().st_mtime_ns for p in POLICY_DIR.rglob("*") if p.suffix in (".nbi", ".nbc")}

    before = beside_the_package()
    for user_dir in (None, tmp_path / "mine"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
        env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
        if user_dir is not None:
            env["NUMBA_CACHE_DIR"] = str(user_dir)
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        where = user_dir or tmp_path / "xdg" / "psr_hf" / "numba"
        assert f"CACHE_DIR {where}" in proc.stdout
        cached = {p.name for p in where.rglob("*") if p.suffix in (".nbi", ".nbc")}
        assert any(name.startswith("_kernels.") for name in cached), sorted(cached)
    assert beside_the_package() == before  # nothing written beside the modules
