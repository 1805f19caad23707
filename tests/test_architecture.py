"""The house rules of ARCHITECTURE.md, checked on the source (imports inside functions count too): rooms import only
downward, no module imports itself back through others (no cycles), no module imports another room's private
names, the policy room imports no torch (numpy, numba and the standard library only), the helpers only the standard
library where they load, the engine's base class never imports its families, nothing imports the former path of
the gate training, every module that jits sets numba's cache folder first, the reference imports neither the policy
table nor the kernels, the kernels never branch on a policy's code, only the CLI prints, and every test file is
named by the room it tests.

The page's other rules are tested where their code is: no module outside ``policy/`` tests a policy's name
(``tests/test_policy_names.py``); ``import psr_hf`` loads no torch, numpy or numba
(``tests/test_package_wheel.py``); a family is one file per layer, found on its package's path
(``tests/test_patches_discovery.py``, ``tests/test_patches_family_discovery.py``); a policy that combines behaviours
the kernels have is one table entry (``tests/test_policy_new_entry.py``); bench/ and eval/ import no private name of
another module at all (``tests/test_bench_common.py``)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module prefix -> (rank, room); a module may import only modules of its own rank or lower. The most specific
# prefix wins. ARCHITECTURE.md draws the same table.
ROOMS: dict[str, tuple[int, str]] = {
    "psr_hf._text": (0, "library: helpers"),
    "psr_hf._paths": (0, "library: helpers"),
    "psr_hf._metadata": (0, "library: helpers"),
    "psr_hf._threads": (0, "library: helpers"),
    "psr_hf._progress": (0, "library: helpers"),
    "psr_hf._lazy": (0, "library: helpers"),
    "psr_hf._registry": (0, "library: helpers"),
    "psr_hf.policy": (0, "library: policy"),
    "psr_hf.assets": (1, "library: assets"),
    "psr_hf.patches": (1, "library: patches"),
    "psr_hf.gates": (1, "library: gates"),
    "psr_hf.gates.train": (4, "library: training"),  # the former path of psr_hf.training.gate, an alias of it
    "psr_hf.training": (4, "library: training"),
    "psr_hf.offload": (2, "library: offload"),
    "psr_hf.hf": (3, "library: hf"),
    "psr_hf.engine": (4, "library: engine"),
    "psr_hf.prefetch": (4, "library: prefetch"),
    "psr_hf.eval": (5, "eval"),
    "psr_hf.bench": (6, "bench"),
    "psr_hf.cli": (7, "apps"),
    "psr_hf.demo": (7, "apps"),
    "psr_hf.testing": (7, "apps"),
}
# the package's own __init__ is the public face: it may name anything of the library (lazily), nothing above
FACADE = "psr_hf"
FACADE_RANK = 4


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "psr_hf").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(p for p in parts if p != "__init__")] = path
    for path in sorted((ROOT / "patches").rglob("*.py")):  # shipped as psr_hf.patches
        parts = ("psr_hf", "patches", *path.relative_to(ROOT / "patches").with_suffix("").parts)
        files[".".join(p for p in parts if p != "__init__")] = path
    return files


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """psr_hf modules that ``name`` imports anywhere in its source (module level or inside functions)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import mod` names a module when pkg.mod is one
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "psr_hf" or target.startswith("psr_hf."):
                while target not in MODULES and "." in target:
                    target = target.rpartition(".")[0]
                found.add(target)
    found.discard(name)
    return found


def _rank(name: str) -> tuple[int, str]:
    if name == FACADE:
        return FACADE_RANK, "facade"
    best = max((p for p in ROOMS if name == p or name.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{name} is in no room: add it to ROOMS here and to ARCHITECTURE.md")
    return ROOMS[best]


def test_every_module_is_in_a_room():
    for name in MODULES:
        _rank(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_rooms_import_only_downward(name):
    rank, room = _rank(name)
    upward = []
    for target in sorted(_imports(name)):
        target_rank, target_room = _rank(target)
        if target_rank > rank:
            upward.append(f"{target} ({target_room})")
    assert not upward, f"{name} ({room}) imports a higher room: {', '.join(upward)}"


def test_there_are_no_import_cycles():
    graph = {name: _imports(name) for name in MODULES}
    # a package's __init__ that re-exports its modules lazily is not an edge back into it
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if target.startswith(node + "."):  # a package naming its own modules
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rules above would catch a library module importing the CLI (the cycle this layout removed)."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from ..cli import main\n")
    monkeypatch.setitem(MODULES, "psr_hf.hf.fake", fake)
    assert "psr_hf.cli" in _imports("psr_hf.hf.fake")
    with pytest.raises(AssertionError, match="imports a higher room: psr_hf.cli"):
        test_rooms_import_only_downward("psr_hf.hf.fake")


def test_policy_never_imports_torch():
    for name, path in MODULES.items():
        if _rank(name)[1] != "library: policy":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{name} imports torch"


# ---------------------------------------------------------------------------------------------------- private names
HELPERS = "library: helpers"  # psr_hf/_*.py: private to the package, shared by every room (their public names)
# private names another room still imports, each being removed by its owner: each must still be found (remove it
# with its import), and nothing else may appear
NOT_YET_PUBLIC: set[tuple[str, str]] = set()


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _imported_names(name: str) -> list[tuple[str, str, int]]:
    """``(module imported from, dotted name imported, line)`` for every psr_hf name ``name`` imports: ``from m import
    x`` gives ``(m or m.x where that is a module, m.x)``, ``import m`` gives ``(m, m)``."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                prefix = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            pairs = [(f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix, f"{prefix}.{a.name}")
                     for a in node.names]
        elif isinstance(node, ast.Import):
            pairs = [(a.name, a.name) for a in node.names]
        else:
            continue
        for target, dotted in pairs:
            if target == "psr_hf" or target.startswith("psr_hf."):
                while target not in MODULES and "." in target:
                    target = target.rpartition(".")[0]
                found.append((target, dotted, node.lineno))
    return found


def private_imports(name: str) -> list[str]:
    """The private names of another room that ``name`` imports: a ``_name``, or any name of a ``_module``, of a
    module in another room (the helpers' modules aside: their public names are the whole package's)."""
    room = _rank(name)[1]
    found = []
    for target, dotted, line in _imported_names(name):
        target_room = _rank(target)[1]
        if target_room == room:
            continue
        parts = dotted.split(".")[1:]
        private = [p for p in parts if _is_private(p) and not (target_room == HELPERS and p == parts[0])]
        if private:
            found.append(f"{dotted} ({target_room}; line {line})")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_private_name_of_another_room(name):
    """ARCHITECTURE.md ("Results and counters"): a room's private modules and names are its own; another room goes
    through its public names (the policy's kernels through LogicalCache, numba's cache folder through
    policy.numba_setup)."""
    found = [f for f in private_imports(name) if (name, f.split(" ")[0]) not in NOT_YET_PUBLIC]
    assert not found, f"{name} imports private names of another room: {', '.join(found)}"


def test_the_private_names_not_yet_public_are_still_imported():
    for name, dotted in sorted(NOT_YET_PUBLIC):
        assert any(f.startswith(dotted + " ") for f in private_imports(name)), f"{name} no longer imports {dotted}"


@pytest.mark.parametrize("source, private", [
    ("from ..policy import _kernels", True),  # the side-effect import this rule removed
    ("from ..policy._kernels import plan_layout", True),
    ("from ..offload.experts import _SlotExperts", True),
    ("import psr_hf.policy._mass", True),
    ("from .._threads import _user_threads", True),
    ("from .._threads import keep_torch_threads", False),  # a helper's public name
    ("from ..policy.numba_setup import use_user_cache_folder", False),
    ("from .routing import _private_of_my_room", False),
])
def test_the_checker_sees_a_private_name_of_another_room(tmp_path, monkeypatch, source, private):
    fake = tmp_path / "fake.py"
    fake.write_text(source + "\n")
    monkeypatch.setitem(MODULES, "psr_hf.hf.fake", fake)
    assert bool(private_imports("psr_hf.hf.fake")) == private


# ---------------------------------------------------------------------------------------------------- third-party
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _third_party(path: Path, module_level_only: bool = False) -> set[str]:
    """Top-level names of the packages ``path`` imports that are neither the standard library nor psr_hf
    (relative imports aside); ``module_level_only``: those imported when the module loads, not inside functions."""
    tree = ast.parse(path.read_text())
    nodes = []
    if module_level_only:
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            nodes.append(node)
            stack.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - STDLIB - {"psr_hf"}


def test_the_policy_room_imports_numpy_numba_and_the_standard_library_only():
    """(and, inside the functions that read and write files, safetensors' numpy API for the calibration and yaml for
    the configuration's YAML form)"""
    for name, path in MODULES.items():
        if _rank(name)[1] == "library: policy":
            assert _third_party(path, module_level_only=True) <= {"numpy", "numba"}, f"{name} loads more"
            assert _third_party(path) <= {"numpy", "numba", "safetensors", "yaml"}, f"{name}: {_third_party(path)}"


def test_the_helpers_load_the_standard_library_only():
    """ARCHITECTURE.md's helpers: the standard library when they load (and tqdm, whose bars ``_progress`` is);
    torch (``_threads``) and safetensors (``_metadata``) only inside the functions that need them."""
    for name, path in MODULES.items():
        if _rank(name)[1] == HELPERS:
            allowed = {"tqdm"} if name == "psr_hf._progress" else set()
            assert _third_party(path, module_level_only=True) <= allowed, f"{name} loads {_third_party(path, True)}"


# ---------------------------------------------------------------------------------------------------- single rules
def test_the_engine_base_class_never_imports_its_families():
    """The factory (build_layers) sits with the families; the base they derive from names none of them."""
    assert not {t for t in _imports("psr_hf.engine.layers") if t.startswith("psr_hf.engine.families")}


def test_nothing_imports_the_former_path_of_the_gate_training():
    """psr_hf.gates.train is kept for callers outside the package (an alias of psr_hf.training.gate, in the training
    room); inside it, nothing imports it, so the gates room holds no arrow up to hf."""
    assert not [name for name in MODULES if "psr_hf.gates.train" in _imports(name)]


def _njit_lines(tree: ast.Module) -> list[int]:
    """Lines of the module-level functions decorated with ``njit(cache=True)`` (or ``numba.njit``)."""
    lines = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", None)) == "njit"
                        and any(k.arg == "cache" for k in d.keywords)):
                    lines.append(node.lineno)
    return lines


def test_every_module_that_jits_sets_numbas_cache_folder_before_its_first_kernel():
    """ARCHITECTURE.md: numba's cache folder is set by one explicit call (policy.numba_setup.use_user_cache_folder)
    at the top of each module that jits with cache=True, never by importing another module for its side effect."""
    jitting = 0
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        kernels = _njit_lines(tree)
        if not kernels:
            continue
        jitting += 1
        calls = [node.lineno for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                 and getattr(node.value.func, "id", None) == "use_user_cache_folder"]
        assert calls and min(calls) < min(kernels), f"{name} jits before it calls use_user_cache_folder()"
    assert jitting >= 4  # _kernels, _mass, _block_kernels, offload.slot_book


def test_the_reference_imports_neither_the_policy_table_nor_the_kernels():
    """ARCHITECTURE.md: reference.py is written from ALGORITHM.md alone, to catch the table's and the kernels'
    mistakes."""
    assert not _imports("psr_hf.policy.reference") & {
        "psr_hf.policy", "psr_hf.policy.policies", "psr_hf.policy.config", "psr_hf.policy.cache",
        "psr_hf.policy._kernels", "psr_hf.policy._mass", "psr_hf.policy._block_kernels"}


def test_the_kernels_branch_on_a_policys_behaviour_never_on_its_code():
    """ARCHITECTURE.md: the kernels read the entry's behaviour flags (MI_INSERTS, MI_BIASED, MI_EXECUTES_PREGATE);
    MI_POLICY, the policy's code, is written by LogicalCache and read by no kernel."""
    tree = ast.parse(MODULES["psr_hf.policy._kernels"].read_text())
    reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "MI_POLICY"
             and isinstance(n.ctx, ast.Load)]
    assert not reads, f"_kernels.py reads MI_POLICY at lines {reads}"


def test_only_the_cli_prints():
    """ARCHITECTURE.md: psr_hf/cli/ is the only code that prints; the library (and the other apps) log."""
    printing = []
    for name, path in MODULES.items():
        if name == "psr_hf.cli" or name.startswith("psr_hf.cli."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                printing.append(f"{name}:{node.lineno}")
    assert not printing, f"print() outside the CLI: {', '.join(printing)}"


def test_each_command_group_is_a_cli_module_registering_its_sub_commands():
    """ARCHITECTURE.md ("Benchmarks and the CLI"): one module per command group, each registering its own
    sub-commands; the CLI's shared pieces (options, console) aside."""
    import psr_hf.cli as cli

    shared = {"psr_hf.cli", "psr_hf.cli.__main__", "psr_hf.cli.options", "psr_hf.cli.console"}
    groups = {name for name in MODULES if name.startswith("psr_hf.cli.") and name not in shared}
    assert {group.__name__ for group in cli.GROUPS} == groups
    assert all(callable(group.register) for group in cli.GROUPS)


def test_no_library_code_depends_on_the_cli():
    """The CLI holds no library code: nothing outside it imports it (the apps' own modules aside)."""
    users = [name for name in MODULES if _rank(name)[1] != "apps" and any(
        t == "psr_hf.cli" or t.startswith("psr_hf.cli.") for t in _imports(name))]
    assert not users


# ---------------------------------------------------------------------------------------------------- test files
# ARCHITECTURE.md, "Tests": tests/test_<room>_<what>.py; the house's own tests by what they check
TEST_ROOMS = ("policy", "patches", "assets", "gate", "offload", "hf", "engine", "prefetch", "eval", "bench", "cli",
              "package")
HOUSE_TESTS = ("architecture", "docs", "examples", "eval_configs", "slow_tests")
# test files named otherwise, to be renamed by their owners (test_<room>_faults.py, ...): each must still exist
NOT_YET_NAMED_BY_ROOM = {
    "test_block_selection.py", "test_faults_gates.py", "test_faults_process.py", "test_faults_routing.py",
    "test_faults_speculative.py", "test_no_deprecated_cache_keyword.py", "test_speculative_harness.py",
}


def test_every_test_file_is_named_by_the_room_it_tests():
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    stray = [f for f in files if f not in NOT_YET_NAMED_BY_ROOM and not any(
        f == f"test_{prefix}.py" or f.startswith(f"test_{prefix}_") for prefix in TEST_ROOMS + HOUSE_TESTS)]
    assert not stray, f"test files not named by a room: {stray}"
    assert NOT_YET_NAMED_BY_ROOM <= set(files), "a renamed file: remove it from NOT_YET_NAMED_BY_ROOM"
