"""Loading a SpecPrefetch predictor file (psr_hf.prefetch.predictor): a hostile header or weights no trained
predictor has are refused cheaply, with a short message naming the problem."""

from __future__ import annotations

import pytest
import torch


def _predictor_file(tmp_path, name="p.safetensors", scale=1.0, **header):
    from safetensors.torch import save_file

    from psr_hf.prefetch.predictor import Predictor

    g = torch.Generator().manual_seed(0)
    A = [torch.randn(2, 8, generator=g) * scale for _ in range(2)]
    B = [torch.randn(4, 2, generator=g) for _ in range(2)]
    path = Predictor(A, B, {"made": "by a test"}).save(tmp_path / name)
    if header:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
        meta.update(header)
        save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("header, message", [
    (dict(num_layers="4000000"), r"says 4000000 layers .* holds 4"),
    (dict(num_layers="many"), r"num_layers 'many' is not an integer"),
    (dict(user="[" * 100_000 + "]" * 100_000), r"nested too deeply"),
    (dict(user="[1, 2]"), r"must be a JSON object, not a list"),
    (dict(user="x" * (2 << 20)), r"is not a JSON text of at most"),
])
def test_predictor_load_refuses_a_hostile_header_cheaply(tmp_path, header, message):
    from psr_hf.prefetch.predictor import Predictor

    path = _predictor_file(tmp_path, **header)
    with pytest.raises(ValueError, match=message) as error:
        Predictor.load(path)
    assert len(str(error.value)) < 400  # the message names the problem, it does not echo the file


def test_predictor_load_refuses_weights_no_trained_predictor_has(tmp_path):
    from psr_hf.prefetch.predictor import Predictor

    with pytest.raises(ValueError, match=r"A.0 holds values that are not finite or beyond"):
        Predictor.load(_predictor_file(tmp_path, scale=1e20))
    assert Predictor.load(_predictor_file(tmp_path, name="ok.safetensors")).metadata["made"] == "by a test"
