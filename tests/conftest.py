"""Fixtures shared by the test modules that run tiny transformers models."""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models are far too small for intra-op threads: one thread is as fast alone and many times faster
    when other processes share the cores (OpenMP workers spin)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quiet_psr_hf(caplog):
    """patch() without a calibration warns (by design); keep the test log readable."""
    caplog.set_level(logging.ERROR, logger="psr_hf")
