"""How ``--model psr_hf`` serves the ``generate_until`` requests, chosen once from the model args (docs/lm-eval.md).

Three strategies, in the shape of vLLM's method objects (each call gets the model class it serves):
:class:`HarnessGeneration` is lm-eval's own batched ``generate()`` on the patched transformers path;
:class:`EngineGeneration` (``engine=true``) serves it at batch 1 on the engine (:func:`psr_hf.engine.attach`) and
counts what it served; :class:`SpeculativeGeneration` (``speculative=MODE``, ``drafter=MODEL``) generates at
batch 1 by :func:`psr_hf.hf.speculative.speculative_generate`. :func:`choose_generation` picks one; the
loglikelihood requests stay on the batched transformers path under every strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..hf.patching import controller

if TYPE_CHECKING:
    from lm_eval.models.huggingface import HFLM

    from ..hf.speculative import SpeculativeResult
    from ..policy.blocks import BlockConfig
    from ..policy.calibration import Calibration
    from .lm_args import ModelArgs, SpeculativeArgs

logger = logging.getLogger("lm_eval.models.psr_hf")

Serve = Callable[[], list]  # HFLM's generate_until on the requests at hand
Generate = Callable[..., torch.Tensor]  # HFLM's _model_generate
Call = Callable[..., torch.Tensor]  # HFLM's _model_call


class AttachedEngine(Protocol):
    """What the model class reads of :func:`psr_hf.engine.attached`'s result."""

    decoder: object
    max_len: int
    served: int  # forward calls the engine served
    fallbacks: int  # forward calls that ran on the transformers path
    loop_calls: int  # generate() calls the engine's own decoding loop ran
    logged: set[tuple[str, str]]  # (what, why) of those fallbacks


class HarnessGeneration:
    """lm-eval's own generation: ``generate()`` of the patched model on left-padded batches. The attributes name
    what a strategy generates with (``engine``; ``block_config``, ``drafter``, ``draft_tokens``): None here."""

    engine: AttachedEngine | None = None
    block_config: BlockConfig | None = None
    drafter: torch.nn.Module | None = None
    draft_tokens: int | None = None

    def generate_until(self, lm: HFLM, serve: Serve) -> list:
        return serve()

    def model_generate(self, lm: HFLM, context: torch.Tensor, max_length: int, stop: list[str] | None,
                       generate: Generate, **generation_kwargs: Any) -> torch.Tensor:
        return generate(context, max_length, stop, **generation_kwargs)

    def model_call(self, lm: HFLM, inps: torch.Tensor, attn_mask: torch.Tensor | None,
                   labels: torch.Tensor | None, call: Call) -> torch.Tensor:
        return call(inps, attn_mask=attn_mask, labels=labels)

    def results(self) -> dict[str, Any]:
        """This strategy's entries of the results' ``config.psr_hf``: none here."""
        return {}

    def log_results(self, results: Mapping[str, Any]) -> None:
        """Log this strategy's entries of ``results`` (the results' ``config.psr_hf``) at the end of a run."""


@contextlib.contextmanager
def _one_request_per_call(lm: HFLM) -> Iterator[None]:
    """Inside the block, HFLM's generate_until makes one generate() call per request: a single row without padding,
    which the engine and speculative_generate serve."""
    batch_size, lm.batch_size_per_gpu = lm.batch_size_per_gpu, 1
    try:
        yield
    finally:
        lm.batch_size_per_gpu = batch_size


class EngineGeneration(HarnessGeneration):
    """``engine=true``: the generations at batch 1 on the engine attached to the patched model, counted; the
    loglikelihood forwards with ``use_cache=False``, so that the engine serves none of them."""

    def __init__(self, engine: AttachedEngine):
        self.engine = engine
        self.generate_calls = 0  # generate() calls of generate_until
        self.generation_fallbacks = 0  # their forward calls that ran on the transformers path
        self._fallback_reported = False

    @classmethod
    def attach(cls, lm: HFLM, max_len: int | None) -> EngineGeneration:
        """Attach the engine to ``lm``'s patched model: its KV cache holds ``max_len`` positions, default the
        harness's ``max_length`` (every generation request fits: lm-eval cuts the prompt to ``max_length -
        max_gen_toks``) capped at the engine's default of 4096; a longer sequence continues on the transformers
        path, which :meth:`generate_until` reports."""
        from ..engine.generate import DEFAULT_MAX_LEN, attach, attached

        if max_len is None:
            max_len = min(int(lm.max_length), DEFAULT_MAX_LEN)
        try:
            attach(lm.model, max_len=max_len)
        except ValueError as exc:
            raise ValueError(f"psr_hf model arg engine=true: {exc}") from None
        engine = attached(lm.model)
        if max_len < lm.max_length:
            logger.warning("psr_hf: the engine's KV cache holds %d positions, the harness's max_length is %d: a "
                           "generation longer than %d tokens (prompt and new tokens) continues on the transformers "
                           "path (engine_max_len= raises it)", max_len, lm.max_length, max_len)
        if lm.batch_size_per_gpu != 1:
            logger.info("psr_hf: engine=true generates at batch 1; batch_size=%s applies to the loglikelihood "
                        "requests", lm.batch_size_per_gpu)
        logger.info("psr_hf: the engine (%s, KV cache of %d positions) serves the generate_until requests",
                    type(engine.decoder).__name__, max_len)
        return cls(engine)

    def generate_until(self, lm: HFLM, serve: Serve) -> list:
        fallbacks, reasons = self.engine.fallbacks, set(self.engine.logged)
        try:
            with _one_request_per_call(lm):
                return serve()
        finally:
            self._count_fallbacks(self.engine.fallbacks - fallbacks, self.engine.logged - reasons)

    def _count_fallbacks(self, missed: int, reasons: set[tuple[str, str]]) -> None:
        """Count the generations' forward calls that ran on the transformers path; warn of the first ones."""
        self.generation_fallbacks += missed
        if missed and not self._fallback_reported:
            self._fallback_reported = True
            logger.warning("psr_hf: %d forward calls of the generations ran on the transformers path instead of "
                           "the engine (%s); the results count them in config.psr_hf.engine.generation_fallbacks",
                           missed, "; ".join(sorted(f"{what}: {why}" for what, why in reasons)) or "see the log of "
                           "psr_hf.engine.generate")

    def model_generate(self, lm: HFLM, context: torch.Tensor, max_length: int, stop: list[str] | None,
                       generate: Generate, **generation_kwargs: Any) -> torch.Tensor:
        self.generate_calls += 1
        return generate(context, max_length, stop, **generation_kwargs)

    def model_call(self, lm: HFLM, inps: torch.Tensor, attn_mask: torch.Tensor | None,
                   labels: torch.Tensor | None, call: Call) -> torch.Tensor:
        """HFLM's forward of the loglikelihood requests, with ``use_cache=False``: they need every position's logits
        and no cache, so the engine serves none of them, a one-token row included (the engine's wrapper passes the
        call to the patched transformers forward and drops the sequence it held)."""
        if attn_mask is not None:
            return call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad(), torch.autocast(device_type=lm.device.type, dtype=lm.mixed_precision_dtype,
                                             enabled=lm.mixed_precision_dtype is not None):
            return lm.model(inps, use_cache=False).logits

    def stats(self) -> dict[str, Any]:
        """Which implementation generated: the decoder (``Decoder``: eager, ``GraphDecoder``: CUDA graphs) and its KV
        cache positions (``max_len``), the ``generate()`` calls of the generation requests, those the engine's own
        decoding loop ran (``loop_calls``), the forward calls the engine ``served`` (its loop's prompts and tokens
        included), every forward that ran on the transformers path (``fallbacks``: the loglikelihood batches too),
        those of the generations (``generation_fallbacks``: 0 when the engine generated everything) and the
        engine's reasons for them."""
        return {"decoder": type(self.engine.decoder).__name__, "max_len": self.engine.max_len,
                "generate_calls": self.generate_calls, "loop_calls": self.engine.loop_calls,
                "served": self.engine.served,
                "fallbacks": self.engine.fallbacks, "generation_fallbacks": self.generation_fallbacks,
                "fallback_reasons": sorted(self.engine.logged)}

    def results(self) -> dict[str, Any]:
        return {"engine": self.stats()}

    def log_results(self, results: Mapping[str, Any]) -> None:
        stats = results["engine"]
        logger.info("psr_hf engine: %d generate() calls, %d forward calls served by the engine (%s), %d of the "
                    "generations' forward calls on the transformers path", stats["generate_calls"], stats["served"],
                    stats["decoder"], stats["generation_fallbacks"])


@dataclasses.dataclass
class SpeculativeCounts:
    """Over every speculative generation so far: ``verifications`` (target forward passes of draft blocks),
    ``accepted`` drafts, committed ``tokens``, ``copies`` (host loads of the verifications over every layer) and
    ``prompt_copies``."""

    generations: int = 0
    verifications: int = 0
    accepted: int = 0
    tokens: int = 0
    copies: int = 0
    prompt_copies: int = 0

    def add(self, result: SpeculativeResult) -> None:
        self.generations += 1
        self.verifications += result.verifications
        self.accepted += sum(result.accepted)
        self.tokens += len(result.tokens)
        self.copies += sum(result.copies)
        self.prompt_copies += result.prompt_copies


class SpeculativeGeneration(HarnessGeneration):
    """``speculative=MODE``: each generation at batch 1 by speculative decoding, greedy (the drafter proposes, the
    target verifies a block at a time with block-level expert selection; docs/speculative.md)."""

    def __init__(self, block_config: BlockConfig, drafter: torch.nn.Module, drafter_name: str, draft_tokens: int,
                 calibration: Calibration | None):
        self.block_config = block_config
        self.drafter = drafter
        self.drafter_name = drafter_name
        self.draft_tokens = draft_tokens
        self.calibration = calibration  # its expert counts give the warm pool
        self.counts = SpeculativeCounts()
        self._ignored: set[str] = set()  # generation kwargs already reported as ignored

    @classmethod
    def attach(cls, lm: HFLM, spec: SpeculativeArgs, calibration_path: str | None) -> SpeculativeGeneration:
        """Load the drafter on the target's device in its dtype and fix the block selection: ``ValueError`` for a
        target whose routers block selection does not cover, a drafter of another vocabulary and a pool outside
        ``top_k .. num_experts``."""
        from transformers import AutoModelForCausalLM

        from ..hf.speculative import moe_routers
        from ..policy.blocks import BlockConfig
        from ..policy.calibration import Calibration

        ctl = controller(lm.model)
        try:
            moe_routers(lm.model)
        except ValueError as exc:
            raise ValueError(f"psr_hf model arg speculative={spec.mode}: {exc}") from None
        pool = ctl.capacity if spec.pool is None else spec.pool
        if not ctl.top_k <= pool <= ctl.num_experts:
            raise ValueError(f"psr_hf model arg pool={pool} must be between the model's top-K ({ctl.top_k}) and its "
                             f"{ctl.num_experts} experts per MoE layer")
        block_config = BlockConfig(mode=spec.mode, pool=pool, top_k=ctl.top_k, threshold=spec.threshold)
        device = next(lm.model.parameters()).device
        drafter = AutoModelForCausalLM.from_pretrained(
            spec.drafter.location, dtype=lm.model.dtype, **spec.drafter.from_pretrained_kwargs).to(device).eval()
        vocab = lm.model.config.get_text_config().vocab_size
        drafter_vocab = drafter.config.get_text_config().vocab_size
        if drafter_vocab != vocab:
            raise ValueError(f"psr_hf model arg drafter={spec.drafter.name}: its vocabulary has {drafter_vocab} "
                             f"tokens, the target's {vocab}; a drafter must share the target's tokenizer")
        calibration = None if calibration_path is None else Calibration.load(
            calibration_path, num_layers=ctl.num_layers, num_experts=ctl.num_experts)
        logger.info("psr_hf: speculative decoding (%s blocks, pool %d of %d experts, %d drafts from %s) serves the "
                    "generate_until requests at batch 1", spec.mode, pool, ctl.num_experts, spec.draft_tokens,
                    spec.drafter.name)
        return cls(block_config, drafter, spec.drafter.name, spec.draft_tokens, calibration)

    def generate_until(self, lm: HFLM, serve: Serve) -> list:
        with _one_request_per_call(lm):
            return serve()

    def _check_request(self, context: torch.Tensor, generation_kwargs: dict[str, Any]) -> None:
        """``ValueError`` for a sampling task and for a batch that is not one unpadded row; a warning, once per
        name, for the generation kwargs greedy speculative decoding ignores."""
        mode = self.block_config.mode
        temperature = generation_kwargs.get("temperature") or 0.0
        if generation_kwargs.get("do_sample") or float(temperature) > 0:
            raise ValueError(f"psr_hf model arg speculative={mode} accepts drafts greedily; this task samples "
                             f"(do_sample={generation_kwargs.get('do_sample')}, temperature={temperature}): run it "
                             "without speculative= or with do_sample: false")
        mask = generation_kwargs.get("attention_mask")
        if context.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            raise ValueError(f"psr_hf speculative={mode} generates one unpadded row per call; got a batch of shape "
                             f"{tuple(context.shape)} (generate_until serves one request at a time)")
        ignored = set(generation_kwargs) - {"attention_mask", "do_sample", "temperature"} - self._ignored
        if ignored:
            self._ignored |= ignored
            logger.warning("psr_hf: speculative decoding is greedy and ignores the generation kwargs %s",
                           ", ".join(sorted(ignored)))

    def model_generate(self, lm: HFLM, context: torch.Tensor, max_length: int, stop: list[str] | None,
                       generate: Generate, **generation_kwargs: Any) -> torch.Tensor:
        """HFLM's ``_model_generate`` contract on one row: ``[1, S + new]``, greedy; stops at the tokenizer's
        end-of-sequence token, after ``max_length - S`` new tokens, or after a block whose new text holds a stop
        string (HFLM cuts the text at the first one)."""
        from ..hf.speculative import speculative_generate

        self._check_request(context, generation_kwargs)
        strings = [s for s in (stop or []) if s]

        def stopped(tokens: list[int]) -> bool:
            text = lm.tokenizer.decode(tokens, skip_special_tokens=False)
            return any(s in text for s in strings)

        with torch.autocast(device_type=lm.device.type, dtype=lm.mixed_precision_dtype,
                            enabled=lm.mixed_precision_dtype is not None):
            result = speculative_generate(
                lm.model, self.drafter, context, self.block_config,
                max_new_tokens=int(max_length) - context.shape[1], draft_tokens=self.draft_tokens,
                calibration=self.calibration, eos_token_id=lm.tokenizer.eos_token_id,
                stop=stopped if strings else None)
        self.counts.add(result)
        new = torch.tensor([result.tokens], dtype=context.dtype, device=context.device)
        return torch.cat([context, new], dim=1)

    def stats(self) -> dict[str, Any]:
        """The block selection (``mode``, ``pool``, ``threshold``), the ``drafter`` and ``draft_tokens``, the
        :class:`SpeculativeCounts`, ``tau`` (tokens per verification before a stop cut a block short: ``accepted /
        verifications + 1``) and ``copies_per_token``."""
        c = self.counts
        return {"mode": self.block_config.mode, "pool": self.block_config.pool,
                "threshold": self.block_config.threshold, "drafter": self.drafter_name,
                "draft_tokens": self.draft_tokens, **dataclasses.asdict(c),
                "tau": c.accepted / c.verifications + 1 if c.verifications else None,
                "copies_per_token": c.copies / c.tokens if c.tokens else None}

    def results(self) -> dict[str, Any]:
        return {"speculative": self.stats()}

    def log_results(self, results: Mapping[str, Any]) -> None:
        stats = results["speculative"]
        if stats["verifications"]:
            logger.info("psr_hf speculative (%s, pool %d): %d tokens in %d generations, %d verifications (tau "
                        "%.2f), %.3f copies per token, %d prompt copies", stats["mode"], stats["pool"],
                        stats["tokens"], stats["generations"], stats["verifications"], stats["tau"],
                        stats["copies_per_token"], stats["prompt_copies"])


def choose_generation(lm: HFLM, args: ModelArgs, calibration_path: str | None) -> HarnessGeneration:
    """The strategy ``args`` choose for ``lm``, whose model is patched: the engine with ``engine=true``,
    speculative decoding with ``speculative=`` (the args never give both), else lm-eval's own."""
    if args.engine:
        return EngineGeneration.attach(lm, args.engine_max_len)
    if args.speculative is not None:
        return SpeculativeGeneration.attach(lm, args.speculative, calibration_path)
    return HarnessGeneration()
