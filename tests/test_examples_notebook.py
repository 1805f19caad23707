"""examples/quickstart.ipynb: committed without outputs, and it runs top to bottom in a real python3 kernel
(nbclient + ipykernel) on the shipped tiny-moe, showing what its text claims."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

# the dev extra's notebook tools; the lent GPU's image has none of them
nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[dev]')")
NotebookClient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[dev]')"
                                     ).NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def _read() -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def _text(outputs: list) -> str:
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def test_the_committed_notebook_has_no_outputs():
    nb = _read()
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert len(code) >= 8
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, f"strip the outputs of: {cell.source[:80]!r}"
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
def test_the_notebook_runs_and_shows_what_it_says(monkeypatch):
    for module in ("ipykernel", "matplotlib"):  # the notebook's kernel and its plot
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[dev]')")
    # a user's default settings (the kernel inherits this environment): load_tiny_moe() gives the small model one
    # torch thread, which is as fast alone and far faster when other processes share the cores
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PSR_HF_THREADS", raising=False)
    nb = _read()
    start = time.perf_counter()
    NotebookClient(nb, kernel_name="python3", timeout=180,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on a failing cell
    seconds = time.perf_counter() - start
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    text = "".join(_text(cell.outputs) for cell in code)
    assert "padding side: left" in text
    # the batch's continuations are printed, one line per prompt
    assert "'It was a truth universally" in text and "'def main():" in text
    assert "copies_per_token" in text  # stats().total
    assert "psr_lam0.2_n1_res25" in text  # the divergence table
    assert sum("image/png" in out.get("data", {}) for cell in code for out in cell.outputs) == 1  # the plot
    assert "experts on cpu:" in text and "OffloadStats(" in text
    assert "same tokens as without offloading: True" in text
    assert "logits equal the unpatched model's: True" in text
    assert "patched exact equals the unpatched model: True" in text
    assert "IProgress" not in text  # progress bars draw as text where Jupyter's widgets are missing
    assert seconds < 60, f"the notebook took {seconds:.0f} s; the README and docs/models.md say under a minute"
