"""benchmarks/eval/fp8_divergence.py: what FP8 weights add to exact routing's divergence, beside the routing rows',
on a sweep record's windows (tiny-moe and a record of random token ids here)."""

import json

import numpy as np
import pytest

from module_files import ROOT, load_module

fp8_divergence = load_module("fp8_divergence", ROOT / "benchmarks" / "eval" / "fp8_divergence.py")

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


def _record(tmp_path):
    rng = np.random.default_rng(0)
    ids = {text: [rng.integers(3, 2000, 20).tolist() for _ in range(3)] for text in ("selfgen", "heldout")}
    path = tmp_path / "record.json"
    drawn = {"ids": ids["selfgen"], "prompt_tokens": [1, 1, 1], "tokens": 19, "seed": 0}
    path.write_text(json.dumps({"selfgen": drawn, "heldout": {"ids": ids["heldout"]}}))
    return path


def test_the_fp8_rows_excess_over_bf16_exact_is_their_own_plus_what_fp8_adds(tmp_path):
    out = fp8_divergence.main(["--model", "tiny-moe", "--record", str(_record(tmp_path)), "--configs",
                               "psr_lam0.3_n1", "--residencies", "0.5", "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["texts"].keys() == {"selfgen", "heldout", "selfgen_fp8"}
    sampled = out["selfgen_fp8"]["ids"]  # from FP8-exact, after the record's one-token prompts
    assert [len(w) for w in sampled] == [20, 20, 20]
    assert [w[0] for w in sampled] == [ids[0] for ids in json.loads(_record(tmp_path).read_text())["selfgen"]["ids"]]
    for text in ("selfgen", "heldout", "selfgen_fp8"):
        t = out["texts"][text]
        gap = t["fp8_exact_vs_bf16_exact"]
        assert len(gap["window_excess"]) == 3
        assert 0 < abs(gap["excess_nll"]) < 0.1  # e4m3 changes the weights, a little
        lo, hi = gap["excess_nll_ci95"]
        assert lo <= gap["excess_nll"] <= hi
        own = t["rows_fp8"]["psr_lam0.3_n1_res50"]["excess_nll"]
        both = t["rows_fp8_vs_bf16_exact"]["psr_lam0.3_n1_res50"]["excess_nll"]
        assert both == pytest.approx(own + gap["excess_nll"], abs=1e-12)
        assert t["rows_bf16"]["psr_lam0.3_n1_res50"]["copies_per_token"] > 0


def test_a_name_that_is_no_routing_row_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="'psr_fast'"):
        fp8_divergence.main(["--model", "tiny-moe", "--record", str(_record(tmp_path)), "--configs", "psr_fast"])
