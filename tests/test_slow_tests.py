"""tests/slow_tests.txt (the tests `make test-quick` leaves out) names tests that exist: a renamed or removed test
would otherwise silently run in the quick suite again, or the list would rot."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_every_listed_slow_test_exists():
    listed = [line.strip() for line in (HERE / "slow_tests.txt").read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#")]
    assert len(listed) > 50
    missing = []
    for nodeid in listed:
        path, _, rest = nodeid.partition("::")
        name = rest.split("[", 1)[0].split("::")[-1]  # a parameter's id may hold "::" itself
        source = HERE.parent / path
        if not source.is_file() or f"def {name}(" not in source.read_text(encoding="utf-8"):
            missing.append(nodeid)
    assert not missing, f"tests/slow_tests.txt names tests that do not exist (regenerate it): {missing[:5]}"
