"""psr_hf hands transformers the KV cache under the name the model's forward takes (``cache`` from transformers
5.23, ``past_key_values`` before) and reads it back from the output's own field, so the demo, a patched model's
generate() and teacher-forced decode report no deprecation of ``past_key_values``/``cache_params`` and keep working
once transformers removes the old names.

transformers reports the deprecation two ways: a ``FutureWarning`` when a forward is given the old keyword, and a
log record (``logger.warning_once``, once per process, on a library logger that does not propagate to the root)
when an output is read or built under the old name. The capture takes both: the warnings module, and the
``transformers`` logger itself with ``warning_once`` made to log every time."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

import psr_hf
import psr_hf.engine as engine
from psr_hf.bench.decode import decode_window
from psr_hf.hf.inputs import cache_keyword, output_cache
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

DEPRECATION = re.compile(r"`(past_key_values|cache_params)`.* deprecated")
CONFIG = psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def cache_name_deprecations(monkeypatch):
    """A function returning the cache-name deprecations transformers logged or warned so far in the test: every
    occurrence (an earlier test's would have used up ``warning_once``), at WARNING whatever verbosity was set."""
    import transformers.utils.logging  # noqa: F401  (installs logging.Logger.warning_once, restored after the test)

    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, *args, **kwargs: self.warning(*args, **kwargs))
    logger = logging.getLogger("transformers")
    level, handler = logger.level, _Messages()
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield lambda: [m for m in handler.messages + [str(w.message) for w in caught] if DEPRECATION.search(m)]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 200, (1, length), generator=torch.Generator().manual_seed(seed))


def test_the_capture_sees_the_old_cache_name_where_transformers_deprecates_it(cache_name_deprecations):
    from transformers import DynamicCache

    model = tiny_model("olmoe")
    if cache_keyword(model) != "cache":
        pytest.skip("this transformers takes only past_key_values: nothing is deprecated")
    with torch.no_grad():
        model(input_ids=_ids(0, 4), past_key_values=DynamicCache(config=model.config), use_cache=True)
    assert cache_name_deprecations()


def test_the_demo_logs_no_cache_name_deprecation(cache_name_deprecations):
    from psr_hf.demo import run_demo

    run_demo(new_tokens=2, model="tiny-moe", kl_windows=1, kl_tokens=16)
    assert cache_name_deprecations() == []


@pytest.mark.parametrize("family", ["olmoe", "qwen3_5_moe_text"])
def test_patched_forward_generate_and_decode_log_no_cache_name_deprecation(family, cache_name_deprecations):
    model = tiny_model(family)
    with psr_hf.patched(model, CONFIG), torch.no_grad():
        out = model(input_ids=_ids(1, 6), use_cache=True)  # a cache the forward made: the controller reads it back
        model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{cache_keyword(model): output_cache(out)})
        first = model.generate(_ids(2, 5), max_new_tokens=3, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True)
        model.generate(first.sequences, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       **{cache_keyword(model): output_cache(first)})
        decode_window(model, _ids(3, 6))
    assert cache_name_deprecations() == []


def test_engine_generate_logs_no_cache_name_deprecation(cache_name_deprecations):
    model = tiny_model("olmoe")
    with psr_hf.patched(model, CONFIG), torch.no_grad():
        engine.attach(model)
        try:
            out = model.generate(_ids(4, 6), max_new_tokens=3, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True)
            assert output_cache(out) is not None
        finally:
            engine.detach(model)
    assert cache_name_deprecations() == []
