"""The lm-evaluation-harness model ``psr_hf``: lm-eval's HF model with cache-aware expert routing (docs/lm-eval.md).

::

    lm-eval --model psr_hf --tasks ... \\
        --model_args pretrained=PATH,policy=psr,lam=0.2,budget=1,residency=0.5,calibration=calib.safetensors

:class:`PSRLM` is lm-eval's ``HFLM`` with the model patched (:func:`psr_hf.patch`) right after it is loaded, in the
shape of lm-eval's own ``steered`` model (``lm_eval/models/hf_steered.py``). Every batch row has its own logical
cache, reset at every request, and padding never touches the routing state, so a request gets the same routing
decisions at every batch size. ``@register_model("psr_hf")`` below registers the class, and the start-up hook
(:mod:`psr_hf.eval.lm_eval_hook`) a lazy placeholder before it, so ``lm-eval --model psr_hf`` finds it and
processes that never use lm-eval import nothing of psr_hf.

The class makes its choices once, in ``__init__``, and asks them afterwards: the model args are checked into a
:class:`~psr_hf.eval.lm_args.ModelArgs` before anything loads (:mod:`psr_hf.eval.lm_args`); where the experts live
is a placement (:mod:`psr_hf.eval.lm_placement`: resident, or offloaded with ``offload=``); how the
``generate_until`` requests run is a strategy (:mod:`psr_hf.eval.lm_generation`: lm-eval's batched ``generate()``,
the engine with ``engine=true``, speculative decoding with ``speculative=MODE`` and ``drafter=MODEL``); the
loglikelihood requests stay on the batched transformers path, their padding read by :mod:`psr_hf.eval.lm_inputs`.

With ``gate=FILE`` (a saved :class:`psr_hf.gates.MarginHead`) and ``distilled=FOLDER`` (a
:func:`psr_hf.training.gate.distill_routing` result, merged by :func:`psr_hf.training.gate.load_distilled` before the
model is patched; its own margin head, if it has one, is the gate) trained gates run under lm-eval (docs/gates.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..assets.loading import GROWN
from ..hf.patching import controller, patch
from .lm_args import GrownModel, ModelArgs
from .lm_generation import AttachedEngine, choose_generation
from .lm_inputs import InputLengths, long_sequences_windowed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..policy.blocks import BlockConfig

# a child of lm-eval's logger: lm-eval's CLI configures "lm_eval" only, and the statistics belong in its output
logger = logging.getLogger("lm_eval.models.psr_hf")


def grown_model(grown: GrownModel, calibration: str | None
                ) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, str | None]:
    """``(model, tokenizer, calibration file)`` of a grown model (``grown-olmoe-routing``,
    :data:`psr_hf.assets.loading.GROWN`): its shipped small trained model grown exactly to the real model's
    dimensions on ``grown.device`` in ``grown.dtype``, with the small model's tokenizer and, unless
    ``calibration`` names one, its calibration (growing leaves the routing unchanged). Built in memory, never
    written to disk."""
    from ..assets.grow import grow, target_by_name
    from ..assets.loading import load_model

    small_name, preset = GROWN[grown.name]
    small, tokenizer, info = load_model(small_name, "cpu")
    model = grow(small, target_by_name(preset), device=grown.device, dtype=grown.dtype).eval()
    logger.info("psr_hf: %s: %s grown to %s's dimensions on %s (%s)", grown.name, small_name, preset, grown.device,
                model.dtype)
    return model, tokenizer, calibration or info.get("calibration_file")


@register_model("psr_hf")
class PSRLM(HFLM):
    """lm-eval's HF model with the model patched by :func:`psr_hf.patch` after loading (docs/lm-eval.md).

    Attributes: ``routing`` (the :class:`RoutingConfig`), ``calibration_path``, ``predictor_path``, ``gate_path``
    and ``distilled_path`` (the files and folder given, or None), ``experts`` (where the experts live) and
    ``generation`` (how the generations run), whose ``engine`` (the attached engine with ``engine=true``),
    ``block_config`` (the :class:`~psr_hf.policy.blocks.BlockConfig` with ``speculative=``), ``drafter`` and
    ``draft_tokens`` the class shows, None where not used; :meth:`routing_stats` gives the statistics so far.
    """

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> PSRLM:
        """lm-eval's constructor; a bad argument's ``ValueError`` is also logged as one line, so that the message
        comes before the traceback lm-eval's command line prints."""
        try:
            return super().create_from_arg_obj(arg_dict, additional_config)
        except ValueError as error:
            logger.error("psr_hf model: %s", error)
            raise

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> PSRLM:
        """As :meth:`create_from_arg_obj`, from ``--model_args``' string."""
        try:
            return super().create_from_arg_string(arg_string, additional_config)
        except ValueError as error:
            logger.error("psr_hf model: %s", error)
            raise

    def __init__(self, pretrained: str | Path | torch.nn.Module, **model_args: Any) -> None:
        """``pretrained`` and the model args: psr_hf's own (:data:`~psr_hf.eval.lm_args.PSR_ARGS`, docs/lm-eval.md),
        the routing fields, and the rest goes to ``HFLM.__init__``. As in lm-eval's ``steered`` model, the values
        arrive already typed by lm-eval's parser of ``--model_args``; :meth:`ModelArgs.parse
        <psr_hf.eval.lm_args.ModelArgs.parse>` checks them all (any other name, and ``trust_remote_code=True``,
        raise ``ValueError``) before the model is loaded."""
        args = ModelArgs.parse(pretrained, model_args)
        pretrained, hflm, calibration = args.pretrained, dict(args.hflm), args.calibration
        if args.grown is not None:
            pretrained, hflm["tokenizer"], calibration = grown_model(args.grown, calibration)
        self.experts = args.experts  # read by _get_accelerate_args while HFLM loads
        super().__init__(pretrained=pretrained, **hflm)
        self.routing = args.routing
        self.calibration_path = calibration
        self.predictor_path = args.predictor_path
        self.gate_path, self.distilled_path = args.gate.path, args.gate.distilled
        self._input_lengths = InputLengths()  # the current loglikelihood requests'
        self._patch(args)
        self.generation = choose_generation(self, args, calibration)

    def _patch(self, args: ModelArgs) -> None:
        """Merge a distilled folder into the model, patch it, and send HFLM's inputs where the patch put them."""
        head = args.gate.head
        if args.gate.distilled is not None:
            from ..training.gate import load_distilled

            # merging the adapters may return a new module: HFLM's model becomes it
            self._model, folder_head = load_distilled(self.model, args.gate.distilled)
            head = folder_head if folder_head is not None else head
            logger.info("psr_hf: distilled routing %s merged into the model%s", args.gate.distilled,
                        "" if folder_head is None else ", with its gate")
        patch(self.model, self.routing, calibration=self.calibration_path,
              offload=self.experts.offload_for(getattr(self, "accelerator", None)), predictor=args.predictor,
              gate=head)
        ctl = controller(self.model)
        self._device = self.experts.after_patch(ctl, self._device)
        logger.info("psr_hf: %s routing, capacity %d of %d experts in %d MoE layers (top-%d), calibration %s%s",
                    self.routing.policy, ctl.capacity, ctl.num_experts, ctl.num_layers, ctl.top_k,
                    self.calibration_path, "" if self.gate_path is None else f", gate {self.gate_path}")

    # ------------------------------------------------------------------ what generates
    @property
    def engine(self) -> AttachedEngine | None:
        return self.generation.engine

    @property
    def block_config(self) -> BlockConfig | None:
        return self.generation.block_config

    @property
    def drafter(self) -> torch.nn.Module | None:
        return self.generation.drafter

    @property
    def draft_tokens(self) -> int | None:
        return self.generation.draft_tokens

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
        serve = functools.partial(super().generate_until, requests, disable_tqdm=disable_tqdm)
        return self.generation.generate_until(self, serve)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
                        ) -> torch.Tensor:
        return self.generation.model_generate(self, context, max_length, stop, super()._model_generate,
                                              **generation_kwargs)

    # ------------------------------------------------------------------ loading
    def _get_accelerate_args(self, *args: Any, **kwargs: Any) -> dict:
        return self.experts.accelerate_args() or super()._get_accelerate_args(*args, **kwargs)

    def _detect_batch_size(self, requests: list | None = None, pos: int = 0) -> int:
        # batch_size=auto probes memory with batches of ones: route them with the model's own routers, so the
        # probes never reach the routing state or the statistics
        with controller(self.model).bypassed():
            return super()._detect_batch_size(requests, pos)

    # ------------------------------------------------------------------ loglikelihoods
    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        # lm-eval tokenizes each whole document and cuts it into windows of max_length itself, so transformers'
        # warning that a sequence is longer than the model's maximum length (indexing errors) does not apply here
        with long_sequences_windowed(self.tokenizer):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None) -> list:
        # index the requests' inputs, so that _model_call can tell pads from real zeros
        self._input_lengths = InputLengths(requests, self.max_length)
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._input_lengths = InputLengths()

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        lengths = self._input_lengths.of(inps) if attn_mask is None else None
        with contextlib.nullcontext() if lengths is None else controller(self.model).right_padded(lengths):
            return self.generation.model_call(self, inps, attn_mask, labels, super()._model_call)

    # ------------------------------------------------------------------ results
    def routing_stats(self) -> dict[str, Any]:
        """The routing config, the cache geometry and the statistics over every request so far, with the
        offload's copies and memory where the experts are offloaded, and the ``engine``'s and the
        ``speculative`` decoding's statistics (None where the generations use neither)."""
        ctl = controller(self.model)
        return {
            "routing": self.routing.to_dict(),
            "calibration": self.calibration_path,
            "predictor": self.predictor_path,
            "gate": self.gate_path,
            "distilled": self.distilled_path,
            "capacity": ctl.capacity,
            "num_experts": ctl.num_experts,
            "top_k": ctl.top_k,
            "moe_layers": ctl.num_layers,
            "stats": ctl.stats().total,
            **self.experts.results(ctl),
            **{"engine": None, "speculative": None, **self.generation.results()},
        }

    def get_model_info(self) -> dict:
        """HFLM's model info plus ``psr_hf``: :meth:`routing_stats` (lm-eval stores it in the results JSON under
        ``config``, after the evaluation)."""
        info = super().get_model_info()
        info["psr_hf"] = self.routing_stats()
        s = info["psr_hf"]["stats"]
        logger.info("psr_hf routing stats: %d tokens in %d sequences, %.3f copies per token (%.3f demand, %.3f "
                    "prefetch), %.3f replaced per token, displaced mass %.4f", s["tokens"], s["sequences"],
                    s["copies_per_token"], s["demand_per_token"], s["prefetch_per_token"],
                    s["replaced_per_token"], s["displaced_mass"])
        self.generation.log_results(info["psr_hf"])
        return info
