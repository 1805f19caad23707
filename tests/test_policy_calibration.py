"""Calibration (compressed token prior, safetensors storage, checks) and CalibrationBuilder."""

import re

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import psr_hf
from psr_hf.policy.calibration import Calibration, CalibrationBuilder
from psr_hf.testing import tiny_model
from test_offload import _ids

ARRAY_NAMES = ("delta", "expert_counts", "prior_indptr", "prior_experts", "prior_values", "token_counts")
BASE_TENSORS = {"delta", "expert_counts", "prior_indptr", "prior_experts", "prior_values"}


def _pattern(*fragments: str) -> str:
    return ".*".join(re.escape(fragment) for fragment in fragments)


def _small_arrays(seed=0, V=7, L=3, E=5):
    """A sparse-ish random dense prior [V, L, E] (row 2 of token 4 all zero) with matching delta and counts."""
    rng = np.random.default_rng(seed)
    prior = rng.random((V, L, E)).astype(np.float32)
    prior[rng.random((V, L, E)) < 0.6] = 0.0
    prior[4, 2] = 0.0
    delta = rng.random(L) * 3.0
    expert_counts = rng.integers(0, 50, size=(L, E)).astype(np.float64)
    return delta, expert_counts, prior


# ---------------------------------------------------------------------------------------------- from_arrays
def test_dense_prior_returns_exactly_the_input():
    delta, counts, prior = _small_arrays()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    dense = calibration.dense_prior()
    assert dense.dtype == np.float32
    assert np.array_equal(dense, prior)
    assert (calibration.vocab_size, calibration.num_layers, calibration.num_experts) == prior.shape


def test_only_nonzero_prior_entries_are_stored():
    delta, counts, prior = _small_arrays()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    assert calibration.prior_values.size == np.count_nonzero(prior)
    assert calibration.prior_indptr.size == prior.shape[0] * prior.shape[1] + 1


def test_prior_of_token_and_layer_equals_the_input_row():
    delta, counts, prior = _small_arrays()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    V, L, _ = prior.shape
    for token in range(V):
        for layer in range(L):
            row = calibration.prior(token, layer)
            assert np.array_equal(row, prior[token, layer].astype(np.float64))


def test_delta_and_expert_counts_are_kept():
    delta, counts, prior = _small_arrays()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    assert np.array_equal(calibration.delta, delta)
    assert np.array_equal(calibration.expert_counts, counts)


def test_prior_of_a_token_outside_the_vocabulary_is_rejected():
    delta, counts, prior = _small_arrays()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    with pytest.raises(ValueError, match=_pattern("token id 7", "[0, 7)")):
        calibration.prior(7, 0)


def test_calibration_without_token_prior_gives_zero_prior():
    calibration = Calibration.from_arrays(delta=np.ones(2), expert_counts=np.ones((2, 4)))
    assert calibration.vocab_size == 0
    assert np.array_equal(calibration.prior(123, 1), np.zeros(4))


def test_empty_calibration_has_zero_counts_and_first_experts_as_warm_set():
    calibration = Calibration.empty(3, 8)
    assert np.array_equal(calibration.delta, np.zeros(3))
    assert np.array_equal(calibration.expert_counts, np.zeros((3, 8)))
    assert list(calibration.warm_set(1, 4)) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- storage
def _assert_same(a: Calibration, b: Calibration) -> None:
    for name in ARRAY_NAMES:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        assert np.array_equal(x, y), name
    assert dict(a.metadata or {}) == dict(b.metadata or {})


def test_save_load_round_trip_preserves_every_array_and_metadata(tmp_path):
    delta, counts, prior = _small_arrays()
    token_counts = np.array([5, 0, 3, 1, 0, 9, 2])
    metadata = {"model": "tiny/test", "tokens": "12345"}
    calibration = Calibration.from_arrays(
        delta=delta, expert_counts=counts, token_prior=prior, token_counts=token_counts, metadata=metadata
    )
    path = tmp_path / "calib.safetensors"
    calibration.save(path)
    loaded = Calibration.load(path)
    _assert_same(calibration, loaded)
    assert loaded.metadata == metadata
    assert np.array_equal(loaded.dense_prior(), calibration.dense_prior())


def test_save_load_round_trip_without_token_counts(tmp_path):
    delta, counts, prior = _small_arrays(seed=3)
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    path = tmp_path / "calib.safetensors"
    calibration.save(path)
    loaded = Calibration.load(path)
    assert loaded.token_counts is None
    _assert_same(calibration, loaded)


def test_save_load_round_trip_of_an_empty_calibration(tmp_path):
    calibration = Calibration.empty(4, 16)
    path = tmp_path / "empty.safetensors"
    calibration.save(path)
    loaded = Calibration.load(path)
    _assert_same(calibration, loaded)
    assert loaded.vocab_size == 0


def test_saved_file_is_safetensors_with_exactly_the_calibration_tensors(tmp_path):
    delta, counts, prior = _small_arrays()
    token_counts = np.arange(prior.shape[0])
    calibration = Calibration.from_arrays(
        delta=delta, expert_counts=counts, token_prior=prior, token_counts=token_counts
    )
    path = tmp_path / "calib.safetensors"
    calibration.save(path)
    with safe_open(str(path), framework="numpy") as handle:
        assert set(handle.keys()) == BASE_TENSORS | {"token_counts"}
        meta = handle.metadata()
        assert meta["format"] == "psr_hf.calibration"
        assert (meta["num_layers"], meta["num_experts"], meta["vocab_size"]) == ("3", "5", "7")
        assert np.array_equal(handle.get_tensor("prior_values"), calibration.prior_values)


def test_saved_file_without_token_counts_has_no_token_counts_tensor(tmp_path):
    delta, counts, prior = _small_arrays()
    path = tmp_path / "calib.safetensors"
    Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior).save(path)
    with safe_open(str(path), framework="numpy") as handle:
        assert set(handle.keys()) == BASE_TENSORS


# ---------------------------------------------------------------------------------------------- compactness (OLMoE)
OLMOE_V, OLMOE_L, OLMOE_E, OLMOE_K = 50304, 16, 64, 8
DENSE_BYTES = OLMOE_V * OLMOE_L * OLMOE_E * 4
CANDIDATES = 12  # each (token, layer) draws its top-8 from 12 token-specific experts, so rows repeat


@pytest.fixture(scope="module")
def olmoe_calibration(tmp_path_factory):
    """An OLMoE-shaped calibration built from ~200k tokens of a Zipf (p ~ 1/rank) stream, in batches."""
    V, L, E, K = OLMOE_V, OLMOE_L, OLMOE_E, OLMOE_K
    num_tokens, batch = 200_000, 25_000
    rng = np.random.default_rng(2024)
    probs = 1.0 / np.arange(1, V + 1)
    probs /= probs.sum()
    tokens = rng.choice(V, size=num_tokens, p=probs).astype(np.int64)
    base = rng.integers(0, E, size=(V, L))  # token- and layer-specific first candidate
    builder = CalibrationBuilder(L, E, V, K)
    selected_all = np.empty((num_tokens, L, K), dtype=np.uint8)
    for start in range(0, num_tokens, batch):
        tok = tokens[start : start + batch]
        offsets = np.argsort(rng.random((tok.size, L, CANDIDATES)), axis=-1)[..., :K]  # 8 distinct of 12
        selected = (base[tok][:, :, None] + offsets) % E
        builder.add(tok, selected, rng.random((tok.size, L)) * 4.0)
        selected_all[start : start + batch] = selected
    calibration = builder.build(metadata={"source": "zipf test"})
    path = tmp_path_factory.mktemp("olmoe") / "olmoe.safetensors"
    calibration.save(path)
    return calibration, path, tokens, selected_all


def test_olmoe_calibration_file_is_below_15_percent_of_the_dense_prior(olmoe_calibration):
    _, path, _, _ = olmoe_calibration
    size = path.stat().st_size
    # floor of this format: K * L = 128 entries of 5 bytes per token seen at least once
    assert size < 0.15 * DENSE_BYTES, f"file is {size / DENSE_BYTES:.1%} of the dense {DENSE_BYTES} bytes"


def test_olmoe_calibration_in_memory_is_below_a_fifth_of_the_dense_prior(olmoe_calibration):
    calibration, _, _, _ = olmoe_calibration
    assert calibration.nbytes < 0.20 * DENSE_BYTES, f"nbytes is {calibration.nbytes / DENSE_BYTES:.1%} of dense"


def test_olmoe_calibration_loads_back_with_count_over_occurrence_priors(olmoe_calibration):
    calibration, path, tokens, selected_all = olmoe_calibration
    loaded = Calibration.load(path)
    _assert_same(calibration, loaded)
    assert (loaded.vocab_size, loaded.num_layers, loaded.num_experts) == (OLMOE_V, OLMOE_L, OLMOE_E)
    occurrences = np.bincount(tokens, minlength=OLMOE_V)
    seen = np.flatnonzero(occurrences)
    once = seen[occurrences[seen] == 1]
    checked = [int(seen[0]), int(seen[len(seen) // 2]), int(once[-1])]
    assert occurrences[checked[0]] > 1000 and occurrences[checked[2]] == 1
    for token in checked:
        rows = selected_all[tokens == token]  # [n, L, K]
        for layer in (0, 7, OLMOE_L - 1):
            counts = np.bincount(rows[:, layer].ravel(), minlength=OLMOE_E)
            expected = (counts / occurrences[token]).astype(np.float32).astype(np.float64)
            assert np.array_equal(loaded.prior(token, layer), expected)


def test_olmoe_calibration_gives_unseen_tokens_the_marginal(olmoe_calibration):
    calibration, _, tokens, selected_all = olmoe_calibration
    occurrences = np.bincount(tokens, minlength=OLMOE_V)
    unseen = int(np.flatnonzero(occurrences == 0)[0])
    layer = 5
    marginal = np.bincount(selected_all[:, layer].ravel(), minlength=OLMOE_E) / tokens.size
    assert np.array_equal(calibration.prior(unseen, layer), marginal)


# ---------------------------------------------------------------------------------------------- fallback
def test_unseen_token_falls_back_to_the_layer_marginal():
    delta, counts, prior = _small_arrays()
    token_counts = np.array([5, 0, 3, 1, 0, 9, 2])
    calibration = Calibration.from_arrays(
        delta=delta, expert_counts=counts, token_prior=prior, token_counts=token_counts
    )
    total = token_counts.sum()
    for token in np.flatnonzero(token_counts == 0):
        for layer in range(counts.shape[0]):
            assert np.array_equal(calibration.prior(int(token), layer), counts[layer] / total)
    for token in np.flatnonzero(token_counts > 0):
        for layer in range(counts.shape[0]):
            assert np.array_equal(calibration.prior(int(token), layer), prior[token, layer].astype(np.float64))
    dense = calibration.dense_prior()
    assert np.array_equal(dense[1], (counts / total).astype(np.float32))
    assert np.array_equal(dense[0], prior[0])


def test_zero_row_of_a_dense_prior_without_token_counts_stays_zero():
    delta, counts, prior = _small_arrays()
    assert not prior[4, 2].any()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)
    assert np.array_equal(calibration.prior(4, 2), np.zeros(counts.shape[1]))
    assert not calibration.dense_prior()[4, 2].any()


# ---------------------------------------------------------------------------------------------- warm set
def _warm_set_by_definition(counts, capacity):
    return sorted(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:capacity])


@pytest.mark.parametrize("capacity", [1, 2, 3, 4, 6])
def test_warm_set_takes_largest_counts_with_ties_to_the_lower_index(capacity):
    counts = np.array([[3.0, 5.0, 5.0, 1.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    calibration = Calibration.from_arrays(delta=np.zeros(2), expert_counts=counts)
    for layer in range(2):
        warm = calibration.warm_set(layer, capacity)
        assert list(warm) == _warm_set_by_definition(counts[layer], capacity)
        assert np.all(np.diff(warm) > 0)


def test_warm_set_of_tied_counts_is_the_lowest_indices():
    counts = np.array([[3.0, 5.0, 5.0, 1.0, 5.0, 0.0]])
    calibration = Calibration.from_arrays(delta=np.zeros(1), expert_counts=counts)
    assert list(calibration.warm_set(0, 2)) == [1, 2]
    assert list(calibration.warm_set(0, 4)) == [0, 1, 2, 4]


def test_warm_set_is_returned_ascending_not_by_count():
    counts = np.array([[0.0, 9.0, 2.0, 10.0, 1.0]])
    calibration = Calibration.from_arrays(delta=np.zeros(1), expert_counts=counts)
    assert list(calibration.warm_set(0, 3)) == [1, 2, 3]


# ---------------------------------------------------------------------------------------------- errors
def test_delta_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match=_pattern("delta has shape (3,)", "expected (2,)")):
        Calibration.from_arrays(delta=np.zeros(3), expert_counts=np.zeros((2, 4)))


def test_token_prior_with_wrong_trailing_shape_is_rejected():
    with pytest.raises(ValueError, match=_pattern("token_prior has shape (5, 2, 3)", "[V, 2, 4]")):
        Calibration.from_arrays(delta=np.zeros(2), expert_counts=np.zeros((2, 4)), token_prior=np.zeros((5, 2, 3)))


def test_token_prior_with_wrong_ndim_is_rejected():
    with pytest.raises(ValueError, match=_pattern("token_prior must be 3-D", "(5, 8)")):
        Calibration.from_arrays(delta=np.zeros(2), expert_counts=np.zeros((2, 4)), token_prior=np.zeros((5, 8)))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_token_prior_is_rejected(bad):
    prior = np.zeros((5, 2, 4), dtype=np.float32)
    prior[3, 1, 2] = bad
    with pytest.raises(ValueError, match="token_prior contains NaN or inf"):
        Calibration.from_arrays(delta=np.zeros(2), expert_counts=np.zeros((2, 4)), token_prior=prior)


def test_negative_expert_counts_are_rejected():
    counts = np.zeros((2, 4))
    counts[1, 3] = -1.0
    with pytest.raises(ValueError, match=_pattern("expert_counts", ">= 0")):
        Calibration.from_arrays(delta=np.zeros(2), expert_counts=counts)


def test_negative_delta_is_rejected():
    with pytest.raises(ValueError, match=_pattern("delta", ">= 0")):
        Calibration.from_arrays(delta=np.array([0.5, -0.1]), expert_counts=np.zeros((2, 4)))


def test_negative_token_counts_are_rejected():
    with pytest.raises(ValueError, match=_pattern("token_counts", ">= 0")):
        Calibration.from_arrays(
            delta=np.zeros(2),
            expert_counts=np.zeros((2, 4)),
            token_prior=np.zeros((3, 2, 4)),
            token_counts=np.array([1, -1, 0]),
        )


def test_token_counts_of_the_wrong_length_are_rejected():
    with pytest.raises(ValueError, match=_pattern("token_counts has shape (4,)", "expected (3,)")):
        Calibration.from_arrays(
            delta=np.zeros(2),
            expert_counts=np.zeros((2, 4)),
            token_prior=np.zeros((3, 2, 4)),
            token_counts=np.array([1, 1, 0, 2]),
        )


def test_non_numeric_arrays_are_rejected():
    with pytest.raises(ValueError, match=_pattern("expert_counts must hold numbers")):
        Calibration.from_arrays(delta=np.zeros(1), expert_counts=np.array([["a", "b"]]))


@pytest.fixture
def small_calibration():
    delta, counts, prior = _small_arrays()
    return Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)


def test_check_accepts_matching_dimensions(small_calibration):
    small_calibration.check(num_layers=3, num_experts=5, vocab_size=7, capacity=5)


@pytest.mark.parametrize("num_layers, num_experts", [(4, 5), (3, 6)])
def test_check_with_other_model_dimensions_names_them_and_suggests_recalibrating(
    small_calibration, num_layers, num_experts
):
    expected = _pattern(
        "made for 3 MoE layers x 5 experts", f"model has {num_layers} x {num_experts}", "calibrate this model"
    )
    with pytest.raises(ValueError, match=expected):
        small_calibration.check(num_layers=num_layers, num_experts=num_experts)


def test_check_with_another_vocabulary_suggests_recalibrating(small_calibration):
    with pytest.raises(ValueError, match=_pattern("over 7 token ids", "vocabulary has 50304", "recalibrate")):
        small_calibration.check(num_layers=3, num_experts=5, vocab_size=50304)


def test_check_accepts_any_vocabulary_without_token_prior():
    Calibration.empty(3, 5).check(num_layers=3, num_experts=5, vocab_size=50304)


def test_check_rejects_capacity_above_num_experts(small_calibration):
    with pytest.raises(ValueError, match=_pattern("capacity 6", "5 experts")):
        small_calibration.check(num_layers=3, num_experts=5, capacity=6)


def test_load_of_a_missing_file_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=_pattern("missing.safetensors", "does not exist")):
        Calibration.load(tmp_path / "missing.safetensors")


def test_load_of_a_safetensors_file_that_is_not_a_calibration_is_rejected(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"weight": np.zeros((2, 2), dtype=np.float32)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=_pattern("is not a psr_hf calibration", "format='pt'")):
        Calibration.load(path)


def test_load_of_a_safetensors_file_without_metadata_is_rejected(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"delta": np.zeros(2)}, str(path))
    with pytest.raises(ValueError, match=_pattern("is not a psr_hf calibration", "format=None")):
        Calibration.load(path)


def test_load_of_a_non_safetensors_file_is_rejected(tmp_path):
    path = tmp_path / "random.safetensors"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="is not a safetensors calibration file"):
        Calibration.load(path)


def test_load_of_a_newer_format_version_is_rejected(tmp_path, small_calibration):
    path = tmp_path / "calib.safetensors"
    small_calibration.save(path)
    with safe_open(str(path), framework="numpy") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        meta = dict(handle.metadata())
    meta["version"] = "99"
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=_pattern("version 99", "upgrade psr_hf")):
        Calibration.load(path)


@pytest.mark.parametrize("user, message", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                           ("[1]", "must be a JSON object")])
def test_calibration_load_refuses_hostile_user_metadata(tmp_path, user, message):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("olmoe")
    path = tmp_path / "c.safetensors"
    psr_hf.calibrate(model, _ids(0, 2, 12), progress=False).save(path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "user": user})
    with pytest.raises(ValueError, match=message):
        psr_hf.Calibration.load(path)


# ---------------------------------------------------------------------------------------------- coerce
def test_coerce_returns_a_calibration_unchanged(small_calibration):
    assert Calibration.coerce(small_calibration) is small_calibration


def test_coerce_loads_a_path(tmp_path, small_calibration):
    path = tmp_path / "calib.safetensors"
    small_calibration.save(path)
    _assert_same(Calibration.coerce(path), small_calibration)
    _assert_same(Calibration.coerce(str(path)), small_calibration)


def test_coerce_builds_from_a_mapping():
    delta, counts, prior = _small_arrays()
    calibration = Calibration.coerce({"delta": delta, "expert_counts": counts, "token_prior": prior})
    assert np.array_equal(calibration.dense_prior(), prior)


def test_coerce_of_an_unsupported_type_is_rejected():
    with pytest.raises(ValueError, match=_pattern("calibration must be a psr_hf.Calibration", "got int")):
        Calibration.coerce(42)


def test_coerce_of_a_mapping_with_an_unknown_key_is_rejected():
    with pytest.raises(ValueError, match=_pattern("unknown calibration keys ['priors']", "allowed")):
        Calibration.coerce({"delta": np.zeros(2), "expert_counts": np.zeros((2, 4)), "priors": None})


# ---------------------------------------------------------------------------------------------- builder
BUILDER_V, BUILDER_L, BUILDER_E, BUILDER_K = 10, 3, 6, 2


def _builder_batches(seed=7, sizes=(9, 14, 5)):
    rng = np.random.default_rng(seed)
    batches = []
    for n in sizes:
        tokens = rng.integers(0, BUILDER_V, size=n)
        selected = np.argsort(rng.random((n, BUILDER_L, BUILDER_E)), axis=-1)[..., :BUILDER_K]
        score_range = rng.random((n, BUILDER_L)) * 5.0
        batches.append((tokens, selected, score_range))
    return batches


def _build(batches):
    builder = CalibrationBuilder(BUILDER_L, BUILDER_E, BUILDER_V, BUILDER_K)
    for batch in batches:
        builder.add(*batch)
    return builder.build()


def test_builder_delta_is_the_mean_score_range_per_layer():
    batches = _builder_batches()
    calibration = _build(batches)
    ranges = np.concatenate([b[2] for b in batches])
    assert np.allclose(calibration.delta, ranges.mean(axis=0), rtol=1e-12, atol=0)


def test_builder_delta_skips_non_finite_score_ranges():
    batches = _builder_batches()
    batches[0][2][0, 1] = np.inf
    batches[1][2][3, 1] = np.nan
    batches[2][2][:, 2] = np.inf  # a layer with no finite range at all in one batch
    calibration = _build(batches)
    ranges = np.concatenate([b[2] for b in batches])
    finite = np.where(np.isfinite(ranges), ranges, np.nan)
    assert np.allclose(calibration.delta, np.nanmean(finite, axis=0), rtol=1e-12, atol=0)


def test_builder_expert_counts_are_the_bincount_of_selections_per_layer():
    batches = _builder_batches()
    calibration = _build(batches)
    selected = np.concatenate([b[1] for b in batches])
    for layer in range(BUILDER_L):
        expected = np.bincount(selected[:, layer].ravel(), minlength=BUILDER_E)
        assert np.array_equal(calibration.expert_counts[layer], expected)


def test_builder_token_counts_and_prior_are_occurrence_fractions():
    batches = _builder_batches()
    calibration = _build(batches)
    tokens = np.concatenate([b[0] for b in batches])
    selected = np.concatenate([b[1] for b in batches])
    occurrences = np.bincount(tokens, minlength=BUILDER_V)
    assert np.array_equal(calibration.token_counts, occurrences)
    expected = np.zeros((BUILDER_V, BUILDER_L, BUILDER_E))
    for t in range(tokens.size):
        for layer in range(BUILDER_L):
            expected[tokens[t], layer, selected[t, layer]] += 1
    seen = occurrences > 0
    expected[seen] /= occurrences[seen][:, None, None]
    expected[~seen] = calibration.expert_counts / tokens.size
    assert np.array_equal(calibration.dense_prior(), expected.astype(np.float32))


def test_builder_result_does_not_depend_on_batching():
    batches = _builder_batches()
    merged = tuple(np.concatenate([b[i] for b in batches]) for i in range(3))
    batched, whole = _build(batches), _build([merged])
    for name in ARRAY_NAMES[1:]:  # counts and prior are integers and exact ratios: equal bit for bit
        assert np.array_equal(getattr(batched, name), getattr(whole, name)), name
    # delta is a float sum, whose rounding may depend on the order of the additions
    assert np.allclose(batched.delta, whole.delta, rtol=1e-12, atol=0)


def test_builder_records_top_k_and_user_metadata():
    builder = CalibrationBuilder(BUILDER_L, BUILDER_E, BUILDER_V, BUILDER_K)
    builder.add(*_builder_batches()[0])
    calibration = builder.build(metadata={"model": "tiny"})
    assert calibration.metadata == {"top_k": str(BUILDER_K), "model": "tiny"}


def test_builder_with_nothing_added_is_rejected():
    builder = CalibrationBuilder(BUILDER_L, BUILDER_E, BUILDER_V, BUILDER_K)
    with pytest.raises(ValueError, match="no calibration tokens were added"):
        builder.build()


def test_builder_with_only_empty_batches_is_rejected():
    builder = CalibrationBuilder(BUILDER_L, BUILDER_E, BUILDER_V, BUILDER_K)
    builder.add(np.zeros(0, dtype=np.int64), np.zeros((0, BUILDER_L, BUILDER_K)), np.zeros((0, BUILDER_L)))
    with pytest.raises(ValueError, match="no calibration tokens were added"):
        builder.build()


@pytest.mark.parametrize(
    "change, message",
    [
        ("selected_k", _pattern("selected has shape (4, 3, 3)", "expected (4, 3, 2)")),
        ("selected_layers", _pattern("selected has shape (4, 2, 2)", "expected (4, 3, 2)")),
        ("score_range", _pattern("score_range has shape (4, 2)", "expected (4, 3)")),
        ("tokens_2d", _pattern("tokens must be 1-D")),
        ("token_high", _pattern("token ids must lie in [0, 10)")),
        ("token_negative", _pattern("token ids must lie in [0, 10)")),
        ("expert_high", _pattern("selected expert ids must lie in [0, 6)")),
        ("expert_negative", _pattern("selected expert ids must lie in [0, 6)")),
    ],
)
def test_builder_add_rejects_wrong_shapes_and_out_of_range_ids(change, message):
    tokens, selected, score_range = _builder_batches(sizes=(4,))[0]
    if change == "selected_k":
        selected = np.concatenate([selected, selected[..., :1]], axis=-1)
    elif change == "selected_layers":
        selected = selected[:, :2]
    elif change == "score_range":
        score_range = score_range[:, :2]
    elif change == "tokens_2d":
        tokens = tokens[:, None]
    elif change == "token_high":
        tokens = tokens.copy()
        tokens[2] = BUILDER_V
    elif change == "token_negative":
        tokens = tokens.copy()
        tokens[0] = -1
    elif change == "expert_high":
        selected = selected.copy()
        selected[1, 2, 0] = BUILDER_E
    elif change == "expert_negative":
        selected = selected.copy()
        selected[3, 0, 1] = -1
    builder = CalibrationBuilder(BUILDER_L, BUILDER_E, BUILDER_V, BUILDER_K)
    with pytest.raises(ValueError, match=message):
        builder.add(tokens, selected, score_range)
    # a rejected batch leaves the builder empty
    assert builder.token_counts.sum() == 0
    assert builder.expert_counts.sum() == 0


# ---------------------------------------------------------------------------------------------- hostile files
def _tensors_and_meta(path):
    with safe_open(str(path), framework="numpy") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, dict(handle.metadata())


def test_load_refuses_a_file_with_an_unknown_tensor_without_reading_it(tmp_path, small_calibration):
    import tracemalloc

    path = tmp_path / "calib.safetensors"
    small_calibration.save(path)
    tensors, meta = _tensors_and_meta(path)
    tensors["padding"] = np.ones(16 * 2**20, dtype=np.float32)  # 64 MiB nobody asked for
    save_file(tensors, str(path), metadata=meta)
    del tensors
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=_pattern("not part of a psr_hf calibration", "['padding']",
                                                      "none of them was read")):
            Calibration.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak


@pytest.mark.parametrize("name, array, message", [
    ("prior_values", np.ones(10_000, dtype=np.float32), "expected at most V x L x E"),
    ("delta", np.zeros(4), "tensor delta has shape (4,)"),
    ("expert_counts", np.zeros((3, 6)), "tensor expert_counts has shape (3, 6)"),
    ("token_counts", np.zeros(9, dtype=np.int64), "tensor token_counts has shape (9,)"),
    ("prior_indptr", np.zeros(3, dtype=np.float32), "prior_indptr has dtype F32; expected integer"),
])
def test_load_checks_every_tensor_against_the_header_before_reading(tmp_path, small_calibration, name, array,
                                                                    message):
    path = tmp_path / "calib.safetensors"
    small_calibration.save(path)
    tensors, meta = _tensors_and_meta(path)
    tensors[name] = array
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=re.escape(message)):
        Calibration.load(path)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.__setitem__("token_counts", -t["token_counts"] - 1), "token_counts must be >= 0"),
    (lambda t: t.__setitem__("token_counts", np.full_like(t["token_counts"], 2**62)), "overflow"),
    (lambda t: t.__setitem__("prior_values", np.full_like(t["prior_values"], 1e30)), "must lie in [0, 1]"),
    (lambda t: t.__setitem__("prior_values", -t["prior_values"] - 0.5), "must lie in [0, 1]"),
    (lambda t: t.__setitem__("expert_counts", -t["expert_counts"] - 1), "expert_counts must be finite and >= 0"),
    (lambda t: t.__setitem__("delta", t["delta"] * np.inf), "delta must be finite"),
])
def test_load_validates_every_value_like_from_arrays(tmp_path, change, message):
    delta, counts, prior = _small_arrays()
    calibration = Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior,
                                          token_counts=np.arange(prior.shape[0]) + 1)
    path = tmp_path / "calib.safetensors"
    calibration.save(path)
    tensors, meta = _tensors_and_meta(path)
    change(tensors)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=re.escape(message)):
        Calibration.load(path)


def test_from_arrays_rejects_a_prior_outside_zero_one():
    delta, counts, prior = _small_arrays()
    prior[0, 0, 0] = 1e30
    with pytest.raises(ValueError, match=re.escape("token_prior values must lie in [0, 1]")):
        Calibration.from_arrays(delta=delta, expert_counts=counts, token_prior=prior)


def test_load_with_the_model_dimensions_refuses_another_model_before_reading(tmp_path, small_calibration):
    path = tmp_path / "calib.safetensors"
    small_calibration.save(path)
    L, E = small_calibration.num_layers, small_calibration.num_experts
    assert Calibration.load(path, num_layers=L, num_experts=E).num_layers == L
    with pytest.raises(ValueError, match=_pattern(f"made for {L} MoE layers x {E} experts", f"{L + 1} x {E}")):
        Calibration.load(path, num_layers=L + 1, num_experts=E)
    with pytest.raises(ValueError, match="different tokenizer"):
        Calibration.load(path, vocab_size=small_calibration.vocab_size + 1)


def test_check_rejects_a_calibration_made_at_another_top_k():
    builder = CalibrationBuilder(2, 8, 10, 4)
    rng = np.random.default_rng(0)
    builder.add(np.arange(10), np.stack([rng.permutation(8)[:4] for _ in range(20)]).reshape(10, 2, 4),
                np.ones((10, 2)))
    calibration = builder.build()
    assert calibration.top_k == 4
    calibration.check(num_layers=2, num_experts=8, vocab_size=10, top_k=4)
    with pytest.raises(ValueError, match=_pattern("made with top-k 4", "routes to 8 experts per token")):
        calibration.check(num_layers=2, num_experts=8, vocab_size=10, top_k=8)


def test_repr_of_a_calibration_is_one_short_line(small_calibration):
    text = repr(small_calibration)
    assert "\n" not in text and len(text) < 160, text
    assert f"{small_calibration.num_layers} MoE layers x {small_calibration.num_experts} experts" in text
