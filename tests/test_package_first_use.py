"""The package as a new user first meets it: ``import psr_hf`` makes every subpackage an attribute, and the one
thread decision (``psr_hf/_threads.py``, made by the CLI only, never by ``patch()`` or ``load_shipped()``) gives a small
CPU model one torch thread unless the user chose, and says what a bad ``PSR_HF_THREADS`` should be."""

from __future__ import annotations

import pytest
import torch


def test_import_psr_hf_makes_every_subpackage_an_attribute():
    import psr_hf

    assert psr_hf.engine.__name__ == "psr_hf.engine" and hasattr(psr_hf.engine, "attach")
    assert psr_hf.prefetch.__name__ == "psr_hf.prefetch" and psr_hf.eval.__name__ == "psr_hf.eval"
    assert {"engine", "prefetch", "eval"} <= set(dir(psr_hf))
    with pytest.raises(AttributeError):
        psr_hf.no_such_thing


@pytest.mark.parametrize("env, expected", [({}, 1), ({"PSR_HF_THREADS": "2"}, 2), ({"OMP_NUM_THREADS": "2"}, 2)])
def test_the_decision_gives_a_small_cpu_model_one_thread_unless_the_user_chose(monkeypatch, env, expected):
    from psr_hf._threads import decide

    for name in ("PSR_HF_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert decide(64, "cpu") == expected == torch.get_num_threads()
        torch.set_num_threads(2)
        assert decide(4096, "cpu") == 2  # a large model keeps the count
    finally:
        torch.set_num_threads(before)


def test_a_bad_thread_count_is_a_clear_error(monkeypatch):
    from psr_hf._threads import decide

    monkeypatch.setenv("PSR_HF_THREADS", "many")
    with pytest.raises(ValueError, match=r"PSR_HF_THREADS='many': give a number of threads >= 1"):
        decide(64, "cpu")
