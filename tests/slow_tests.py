"""The list of slow tests (``tests/slow_tests.txt``) from a pytest log run with ``--durations=0``: every test whose
setup, call and teardown took more than ``--over`` seconds (default 1) together; the committed list uses 0.5. ``conftest.py`` marks them
``slow``, so that ``make test-quick`` leaves them out.

    python tests/slow_tests.py LOG > tests/slow_tests.txt
"""

from __future__ import annotations

import argparse
import collections
import re

HEADER = """\
# Tests that took more than {over:g} s on the 2-core CI machine (setup included), marked `slow` by conftest.py so that
# `make test-quick` leaves them out; `make test` runs them all. Regenerate from a run with --durations=0:
#   python tests/slow_tests.py LOG > tests/slow_tests.txt"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--over", type=float, default=1.0)
    args = ap.parse_args()
    text = open(args.log, encoding="utf-8").read()
    if "slowest durations" not in text:
        raise SystemExit(f"{args.log}: no durations (run pytest with --durations=0)")
    spent: dict[str, float] = collections.defaultdict(float)
    for line in text.split("slowest durations", 1)[1].splitlines():
        m = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S.*)$", line)
        if m:
            spent[m.group(2).strip()] += float(m.group(1))
    print(HEADER.format(over=args.over))
    for name in sorted(n for n, s in spent.items() if s > args.over):
        print(name)


if __name__ == "__main__":
    main()
