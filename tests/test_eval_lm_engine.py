"""``--model psr_hf`` with ``engine=true``: the generations on the engine, the loglikelihoods on transformers' path.

The shipped ``tiny-moe`` in float32 on the CPU (the engine's eager decoder), the offline generative task
``psr_heldout_continuation`` and the multiple-choice ``psr_mmlu_exemplars`` through lm-eval's ``simple_evaluate``:
per sample, ``engine=true`` gives what ``engine=false`` (the harness's transformers path, batched) gives, for
exact and PSR routing, with and without offloaded experts; the engine serves every forward of the generations and
none of the loglikelihoods, which keep their batches; a generation after a loglikelihood batch is unaffected; a
sequence past the engine's KV cache continues on the transformers path and says so. The task's documents and
scorer are tested here too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch


from module_files import load_module

# the eval extra; the lent GPU's image has no lm-eval
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "eval_configs" / "tasks"
GEN, MC = "psr_heldout_continuation", "psr_mmlu_exemplars"
LIMIT = 3
ROUTINGS = {
    "exact": "policy=exact,residency=0.5",
    "psr": "policy=psr,lam=0.3,budget=1,residency=0.5",
    "psr_offloaded": "policy=psr,lam=0.3,budget=1,residency=0.25,offload=cpu,max_in_flight=1",
}
LOGGER = "lm_eval.models.psr_hf"


@pytest.fixture(scope="module")
def task_utils():
    return load_module("psr_eval_task_utils_engine", TASKS / "utils.py")


@pytest.fixture(scope="module")
def evaluate():
    """``evaluate(lm, tasks)``: lm-eval's per-sample results of the shipped offline tasks, ``LIMIT`` documents
    each, and the input shape of every call of the model by the harness (a pre-hook on the model, which the
    engine's own decoding loop and prefill do not pass), with whether it came from generate(), which passes a cache
    on every call (HFLM's loglikelihood batches pass none)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS), include_defaults=False)

    def run(lm, tasks) -> tuple[dict, list[tuple[tuple[int, ...], bool]]]:
        forwards: list[tuple[tuple[int, ...], bool]] = []

        def record(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            generating = kwargs.get("cache", kwargs.get("past_key_values")) is not None
            forwards.append((tuple(ids.shape), generating))

        handle = lm.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=LIMIT, task_manager=manager,
                                          log_samples=True, bootstrap_iters=0)
        finally:
            handle.remove()
        samples = {task: [{key: s[key] for key in ("doc_id", "resps", "filtered_resps", *s["metrics"])}
                          for s in out["samples"][task]] for task in tasks}
        return samples, forwards

    return run


def _model(args: str, engine: bool, batch_size: int = 4):
    from psr_hf.eval.lm_model import PSRLM

    # lm-eval's own parser of --model_args, as on the command line
    return PSRLM.create_from_arg_string(f"pretrained=tiny-moe,dtype=float32,engine={str(engine).lower()},{args}",
                                        {"batch_size": batch_size, "device": "cpu"})


@pytest.fixture(scope="module")
def harness(evaluate):
    """The transformers path's results (``engine=false``) per routing name, computed once."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            lm = _model(ROUTINGS[name], engine=False)
            cache[name] = (*evaluate(lm, (GEN, MC)), lm.routing_stats())
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------------- equal outputs
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_engine_generations_equal_the_transformers_paths_per_sample(name, evaluate, harness, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    reference, reference_forwards, reference_stats = harness(name)
    lm = _model(ROUTINGS[name], engine=True)
    assert type(lm.engine.decoder).__name__ == "Decoder"  # the eager decoder on the CPU
    assert "engine=true generates at batch 1; batch_size=4 applies to the loglikelihood" in caplog.text
    samples, forwards = evaluate(lm, (GEN, MC))
    assert samples == reference  # generated texts, loglikelihoods and metrics: bitwise
    assert any(s["continuation_lcs"] > 0 for s in samples[GEN])  # the greedy text follows the reference a bit

    stats = lm.routing_stats()
    engine = stats["engine"]
    assert reference_stats["engine"] is None
    assert engine["generate_calls"] == LIMIT and engine["generation_fallbacks"] == 0
    # the engine's own decoding loop ran every generation (no call of the model's forward), serving what the
    # transformers path runs as forward calls: a prompt and then one token at a time
    assert [shape for shape, generating in forwards if generating] == []
    assert engine["loop_calls"] == LIMIT and engine["served"] > LIMIT
    # and none of the loglikelihood batches, which ran on transformers' path as the harness ran them
    loglikelihood = [shape for shape, generating in forwards if not generating]
    assert loglikelihood == [shape for shape, generating in reference_forwards if not generating]
    assert max(rows for rows, _ in loglikelihood) > 1  # batched
    assert engine["fallbacks"] == len(loglikelihood)
    # the same routing decisions: every copy and token counted alike
    assert stats["stats"] == pytest.approx(reference_stats["stats"], rel=1e-6)
    assert {k: v for k, v in stats["stats"].items() if k != "displaced_mass"} == \
        {k: v for k, v in reference_stats["stats"].items() if k != "displaced_mass"}
    if "offload" in reference_stats:
        assert stats["offload"]["tokens"] == reference_stats["offload"]["tokens"] and stats["offload"]["bytes"] > 0

    # generations after the loglikelihood batches start from a clean engine: the same texts again
    again, forwards = evaluate(lm, (GEN,))
    assert again[GEN] == reference[GEN]
    engine_again = lm.routing_stats()["engine"]
    assert engine_again["served"] == 2 * engine["served"] and forwards == []  # the loglikelihoods served none
    assert engine_again["generation_fallbacks"] == 0
    assert engine_again["fallbacks"] == engine["fallbacks"]


def test_sequences_past_the_engines_kv_cache_continue_on_the_transformers_path_and_say_so(evaluate, harness,
                                                                                             caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    reference = harness("exact")[0]
    # 150 positions: the prompts have 121-183 tokens, so some do not fit and others run out while generating
    lm = _model(ROUTINGS["exact"] + ",engine_max_len=150", engine=True)
    assert "the engine's KV cache holds 150 positions, the harness's max_length is 512" in caplog.text
    samples, _ = evaluate(lm, (GEN,))
    assert samples[GEN] == reference[GEN]
    engine = lm.routing_stats()["engine"]
    assert engine["max_len"] == 150 and engine["generation_fallbacks"] > 0
    warnings = [r.getMessage() for r in caplog.records if "ran on the transformers path instead" in r.getMessage()]
    assert len(warnings) == 1 and "max_len=150" in warnings[0]
    evaluate(lm, (GEN,))
    assert len([r for r in caplog.records if "ran on the transformers path instead" in r.getMessage()]) == 1


# ---------------------------------------------------------------------------------------------- refused args
@pytest.mark.parametrize("args, message", [
    ("engine=yes", r"engine='yes' must be true or false"),
    ("engine_max_len=256", r"engine_max_len is used only with engine=true"),
    ("engine=true,engine_max_len=0", r"engine_max_len=0 must be a positive int"),
    ("engine=true,parallelize=True", r"engine=true and parallelize=True exclude each other: the engine runs every "
                                     r"layer on one device"),
    ("engine=true,mixed_precision_dtype=bfloat16", r"engine=true and mixed_precision_dtype='bfloat16' exclude"),
    ("engine=true,peft=adapter", r"engine=true and peft='adapter' exclude each other"),
])
def test_engine_args_the_engine_cannot_serve_fail_naming_them(args, message):
    from psr_hf.eval.lm_model import PSRLM

    with pytest.raises(ValueError, match=message):
        PSRLM.create_from_arg_string(f"pretrained=tiny-moe,residency=0.5,{args}", {"device": "cpu"})


def test_a_grown_model_name_takes_no_tokenizer_parallelize_or_integer_dtype():
    from psr_hf.eval.lm_model import PSRLM

    for arg in ("tokenizer=tiny-moe", "parallelize=True"):
        with pytest.raises(ValueError, match=r"pretrained=grown-olmoe-routing \(built in memory, with its own "
                                             r"tokenizer on one device\) takes neither"):
            PSRLM.create_from_arg_string(f"pretrained=grown-olmoe-routing,residency=0.5,{arg}", {"device": "cpu"})
    with pytest.raises(ValueError, match=r"dtype of pretrained=grown-olmoe-routing: give float32, bfloat16"):
        PSRLM.create_from_arg_string("pretrained=grown-olmoe-routing,residency=0.5,dtype=int8", {"device": "cpu"})


# ---------------------------------------------------------------------------------------------- the task
def test_continuation_documents_are_windows_of_the_held_out_text(task_utils):
    rows = task_utils.heldout_continuations()
    assert len(rows) == 60 and len({r["id"] for r in rows}) == 60
    assert rows == task_utils.heldout_continuations()  # deterministic
    text = task_utils.HELDOUT_TEXT.read_text(encoding="utf-8")
    for row in rows:
        assert len(row["prompt"].split()) == task_utils.CONTINUATION_PROMPT_WORDS
        assert row["prompt"] == row["prompt"].strip() and row["target"][:1].isspace()
        assert row["prompt"] + row["target"] in text  # the target is the text that follows
        rest = row["target"].lstrip(" ").split("\n", 1)[0].split()  # the rest of the cut paragraph
        assert 4 <= row["rest_of_paragraph"] == len(rest) <= 8 and "\n\n" in row["target"]
        assert not row["prompt"].startswith("Chapter")
        assert len(row["target"].split()) >= task_utils.CONTINUATION_SCORED_WORDS


def test_continuation_scores(task_utils):
    lcs = task_utils.words_in_order
    assert lcs("a b c d", "a b c d", n=4) == 1.0
    assert lcs("a x b y", "a b c d", n=4) == 0.5  # a, b in order
    assert lcs("b a", "a b c d", n=4) == 0.25  # order matters
    assert lcs("", "a b c d", n=4) == 0.0
    assert lcs("a b c d e f", "a b c d x x", n=4) == 1.0  # only the first n words of each count
    doc = task_utils.heldout_continuations()[0]
    score = task_utils.continuation_process_results
    assert score(doc, [doc["target"]]) == {"continuation_lcs": 1.0, "next_word": 1.0}
    words = doc["target"].split()
    # the next word right, then other words; the words right but one late
    assert score(doc, [f" {words[0]} x x x"]) == {"continuation_lcs": 1 / 16, "next_word": 1.0}
    assert score(doc, [" And " + " ".join(words)]) == {"continuation_lcs": 15 / 16, "next_word": 0.0}
    assert score(doc, [""]) == {"continuation_lcs": 0.0, "next_word": 0.0}


# ---------------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graphs_serve_the_generations_on_a_gpu(evaluate):
    from psr_hf.eval.lm_model import PSRLM

    runs = {}
    for engine in (False, True):
        lm = PSRLM.create_from_arg_string(f"pretrained=tiny-moe,dtype=float32,engine={str(engine).lower()},"
                                          f"{ROUTINGS['psr']},offload=cuda", {"batch_size": 4, "device": "cuda"})
        runs[engine] = (evaluate(lm, (GEN,))[0], lm.routing_stats()["engine"])
    engine = runs[True][1]
    assert engine["decoder"] == "GraphDecoder" and engine["generation_fallbacks"] == 0 and engine["served"] > 0
    # float32 on the GPU: the engine's kernels and transformers' round differently; the greedy texts agree
    assert [s["resps"] for s in runs[True][0][GEN]] == [s["resps"] for s in runs[False][0][GEN]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_grown_model_offloaded_generates_on_cuda_graphs(evaluate):
    from psr_hf.assets import OLMOE_ROUTING
    from psr_hf.eval.lm_model import PSRLM

    lm = PSRLM.create_from_arg_string(f"pretrained=grown-olmoe-routing,engine=true,{ROUTINGS['psr']},offload=cuda",
                                      {"batch_size": 4, "device": "cuda"})
    assert lm.model.config.hidden_size == 2048 and lm.model.dtype == torch.bfloat16  # real size, bf16 on a GPU
    assert lm.calibration_path == str(OLMOE_ROUTING / "calibration.safetensors")  # the small model's
    samples, forwards = evaluate(lm, (GEN, MC))
    stats = lm.routing_stats()
    engine = stats["engine"]
    assert engine["decoder"] == "GraphDecoder" and engine["generation_fallbacks"] == 0
    assert engine["served"] == sum(generating for _, generating in forwards) >= LIMIT
    assert engine["fallbacks"] == sum(not generating for _, generating in forwards) > 0  # the loglikelihoods
    assert stats["offload"]["bytes"] > 0 and len(samples[GEN]) == LIMIT
