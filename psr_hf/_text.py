"""Plain-text tables for the command line and for library functions that format reports."""

from __future__ import annotations

from typing import Any


def text_table(rows: list[list[Any]], header: list[str]) -> str:
    """Left-aligned first column, right-aligned others, a dashed rule under the header."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
