"""ARCHITECTURE.md's rule for policies: no module outside ``psr_hf/policy/`` tests a policy's name. Such a module
reads the entry's flags (``RoutingConfig.follows_router``, ``POLICY_TABLE[name].biased``, ...), so that a new
entry in the table is taken everywhere with no other change.

The check parses every module of the package (and of ``patches/``, shipped as ``psr_hf.patches``) outside
``policy/`` and fails on a comparison (``==``, ``!=``, ``in``, ``not in``) or a ``startswith``/``endswith`` call
with a string constant equal to a policy name on one side, alone or inside a tuple, list or set. Strings used any
other way (help texts, docstrings, constructor arguments, choices built from the table) are fine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from psr_hf.policy.policies import POLICY_TABLE

ROOT = Path(__file__).resolve().parents[1]
POLICY_ROOM = ROOT / "psr_hf" / "policy"
COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
# the comparisons left in modules whose owners have yet to convert them (path, policy name): each entry must still
# be found (remove it with its comparison), and nothing else may appear
NOT_YET_CONVERTED: set[tuple[str, str]] = set()
PREFIX_TESTS = ("startswith", "endswith")


def _modules() -> list[Path]:
    files = sorted((ROOT / "psr_hf").rglob("*.py")) + sorted((ROOT / "patches").rglob("*.py"))
    return [path for path in files if POLICY_ROOM not in path.parents]


def _policy_names_in(node: ast.AST) -> list[str]:
    """The policy names ``node`` spells as a string constant, or as one element of a tuple, list or set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in POLICY_TABLE else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for element in node.elts for name in _policy_names_in(element)]
    return []


def policy_name_tests(source: str) -> list[tuple[int, str]]:
    """(line, policy name) of every comparison or prefix test of ``source`` against a policy name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides, sides[1:]):
                if isinstance(op, COMPARISONS):
                    found += [(node.lineno, name) for side in (left, right) for name in _policy_names_in(side)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in PREFIX_TESTS):
            found += [(node.lineno, name) for arg in node.args for name in _policy_names_in(arg)]
    return found


@pytest.mark.parametrize("source", [
    'if config.policy == "psr": pass',
    'ok = "exact" != policy',
    'ok = policy in ("psr", "cache_prior")',
    'ok = policy not in {"spec"}',
    'ok = a < b == "exact"',
    'ok = run.name.startswith("exact")',
    'ok = run.name.startswith(("spec", "x"))',
])
def test_the_check_finds_a_policy_name_test(source):
    assert policy_name_tests(source)


@pytest.mark.parametrize("source", [
    'config = RoutingConfig(policy="psr")',
    'choices = list(POLICY_TABLE)',
    'ok = config.follows_router',
    'ok = mode == "confidence"',
    '"""policy == "psr" in a docstring"""',
])
def test_the_check_leaves_other_uses_of_a_name_alone(source):
    assert not policy_name_tests(source)


def test_no_module_outside_policy_tests_a_policy_name():
    found = [(str(path.relative_to(ROOT)), line, name)
             for path in _modules() for line, name in policy_name_tests(path.read_text())]
    offences = [f"{path}:{line}: {name!r}" for path, line, name in found if (path, name) not in NOT_YET_CONVERTED]
    assert not offences, ("these lines test a policy's name; read the entry's flags instead (RoutingConfig."
                          "follows_router, POLICY_TABLE[name].biased, ...; add a field to Policy in "
                          "psr_hf/policy/policies.py where the table lacks the fact):\n" + "\n".join(offences))
    converted = NOT_YET_CONVERTED - {(path, name) for path, _, name in found}
    assert not converted, f"converted: remove {sorted(converted)} from NOT_YET_CONVERTED"
