"""What the commands write besides their tables: lines on stderr that leave progress bars intact, the notice that
numba is compiling, and the JSON records."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator


def err(message: str) -> None:
    """A line on stderr that does not break a progress bar."""
    from .._progress import tqdm

    tqdm.write(message, file=sys.stderr)


def progress_line(message: str) -> None:
    """A benchmark's progress message, indented, on stderr."""
    err("  " + message)


class HeaderFirst:
    """A benchmark's progress callback that prints the command's header (stdout) before the first progress line:
    a benchmark checks its arguments before it reports anything, so an argument it refuses leaves no header above
    the error. :meth:`show` prints the header where no progress line came."""

    def __init__(self, header: str) -> None:
        self.header: str | None = header

    def __call__(self, message: str) -> None:
        self.show()
        progress_line(message)

    def show(self) -> None:
        if self.header is not None:
            print(self.header, flush=True)  # flushed: the progress lines go to stderr
            self.header = None


def write_json(path: str, record: Any, **dumps: Any) -> None:
    """Write ``record`` to ``path`` (indented JSON; ``dumps`` go to ``json.dumps``) and say where."""
    Path(path).write_text(json.dumps(record, indent=2, **dumps))
    print(f"JSON record: {path}")


@contextlib.contextmanager
def compile_notice() -> Iterator[None]:
    """Say once on stderr when numba compiles the policy kernels (the first run after installation: it caches
    them), so a long first run is explained."""
    from numba.core import event

    class Notice(event.Listener):
        shown = False

        def on_start(self, ev: Any) -> None:
            if not self.shown:
                self.shown = True
                err("psr-hf: compiling the policy kernels with numba (first run only: they are cached after; "
                    "about 15 s on a 2-core machine; `psr-hf warm-up`, which make install runs, does it ahead)")

        def on_end(self, ev: Any) -> None:
            pass

    listener = Notice()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)
