"""The house rules of ARCHITECTURE.md, checked on the source: rooms import only downward, and no module imports
itself back through others (no cycles), counting imports inside functions too."""

from __future__ import annotations

import ast
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
