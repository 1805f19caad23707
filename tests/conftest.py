"""Fixtures shared by the test modules that run tiny transformers models.

Threads: every test runs tiny models, whose matrix products take microseconds: torch's intra-op threads gain
nothing and, on a machine that other processes share, each parallel region waits for a descheduled OpenMP worker
(many times slower). So the whole session runs torch with one intra-op thread, and subprocesses the tests start
inherit ``OMP_NUM_THREADS=1`` unless the environment sets it (the same decision as ``psr-hf``'s, see
``psr_hf/_threads.py``). A test of thread handling sets what it needs itself.
"""

from __future__ import annotations

import logging
import os
import pathlib

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads OpenMP; subprocesses inherit it

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_session():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module (the session default already; kept for the modules that name it,
    and restored after a test module that changed it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quiet_psr_hf(caplog):
    """patch() without a calibration warns (by design); keep the test log readable."""
    caplog.set_level(logging.ERROR, logger="psr_hf")


@pytest.fixture
def interpreter(monkeypatch):
    """Triton kernels run in triton's interpreter (on the CPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def compiled(monkeypatch):
    """Triton kernels compiled for the GPU (the interpreter off, whatever the environment says)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


ENGINE_TEXT = "The engine decodes one token at a time, and every step"


@pytest.fixture(scope="module")
def engine_case():
    """``engine_case(name)``: ``(model, prompt ids [1, S], calibration, pad id)`` for the engine tests: the tiny
    random model of that name ("olmoe", "deepseek_v3", "qwen3_5_moe_text"; 8 seeded random ids, no calibration) or "shipped" (olmoe-routing with its
    calibration, :data:`ENGINE_TEXT`). Built once per test module."""
    import torch

    from psr_hf.assets import OLMOE_ROUTING_NAME, load_shipped
    from psr_hf.testing import tiny_model

    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            if name == "shipped":
                model, tokenizer, calibration = load_shipped(OLMOE_ROUTING_NAME)
                ids = torch.tensor([tokenizer(ENGINE_TEXT)["input_ids"]])
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
                cache[name] = (model, ids, calibration, pad)
            else:
                ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
                cache[name] = (tiny_model(name), ids, None, 0)
        return cache[name]

    return get


_SLOW_TESTS = pathlib.Path(__file__).with_name("slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    """Mark the tests listed in slow_tests.txt ``slow`` (``make test-quick`` runs ``-m "not slow"``)."""
    listed = {line.strip() for line in _SLOW_TESTS.read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
