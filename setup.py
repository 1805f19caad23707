"""Build step that pyproject.toml cannot express: ship ``psr_hf_lm_eval.pth`` at the top of site-packages.

The .pth imports ``_psr_hf_lm_eval`` (startup/_psr_hf_lm_eval.py), where it is importable, at interpreter
start, which registers the
``psr_hf`` lm-eval model when lm-eval loads its registry (lm-eval 0.4.13 discovers no models through entry points;
psr_hf/eval/lm_eval_hook.py explains why and how). A regular wheel gets the .pth from build_lib; an editable
install (PEP 660, ``pip install -e .``) gets it in the editable wheel, which setuptools assembles from the folder
that ``install_lib`` points at, beside its own ``__editable__`` finder (whose .pth sorts first, so
``_psr_hf_lm_eval`` is importable when ours runs). Also the package list, found rather than written out
(pyproject.toml cannot combine finding packages with one mapped from another folder). Everything else is in
pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH_NAME = "psr_hf_lm_eval.pth"
# Python runs each line of a .pth that starts with "import" at every start-up and prints a traceback when it
# raises: after a partial uninstall (the .pth left behind, the module gone) a plain "import _psr_hf_lm_eval"
# would do so in every Python process. This line imports the module only where it can be found.
PTH_LINE = (
    "import importlib.util; importlib.util.find_spec('_psr_hf_lm_eval') is not None and "
    "__import__('_psr_hf_lm_eval')\n"
)


class build_py_with_pth(build_py):
    """build_py that also writes :data:`PTH_NAME` to the root of the built (or editable) wheel."""

    def _pth_target(self) -> Path:
        if getattr(self, "editable_mode", False):
            # setuptools' editable_wheel points install_lib at the unpacked editable wheel it writes out
            return Path(self.get_finalized_command("install").install_lib, PTH_NAME)
        return Path(self.build_lib, PTH_NAME)

    def run(self) -> None:
        super().run()
        target = self._pth_target()
        self.mkpath(str(target.parent))
        target.write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(self._pth_target())]


# egg_base: the metadata folder stays at the top (setuptools would put it in startup/, the "" package dir)
# every package under psr_hf/ is found, none listed by hand (a listed one can be forgotten: a wheel without
# psr_hf.prefetch once shipped); patches/ is the one mapped from elsewhere (package-dir in pyproject.toml)
PACKAGES = sorted({*find_packages(include=["psr_hf", "psr_hf.*"]), "psr_hf.patches"})

setup(cmdclass={"build_py": build_py_with_pth}, options={"egg_info": {"egg_base": "."}}, packages=PACKAGES)
