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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..assets import calibration_beside, resolve_model
from ..hf.patching import controller, patch
from ..offload.config import OffloadConfig
from ..policy.config import RoutingConfig

# a child of lm-eval's logger: lm-eval's CLI configures "lm_eval" only, and the statistics belong in its output
logger = logging.getLogger("lm_eval.models.psr_hf")

ROUTING_ARGS = tuple(field.name for field in dataclasses.fields(RoutingConfig))
PSR_ARGS = ("calibration", "config", "offload", "max_in_flight", "predictor")


def _hflm_args() -> list[str]:
    """The named parameters of ``HFLM.__init__`` (introspected, so a new lm-eval argument is accepted as is)."""
    params = inspect.signature(HFLM.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def allowed_args() -> str:
    """The accepted model arg names, grouped, for error messages."""
    return (f"routing: {', '.join(ROUTING_ARGS)}; psr_hf: {', '.join(PSR_ARGS)}; "
            f"lm-eval's HF model: {', '.join(_hflm_args())}")


def check_args(names: Any) -> None:
    """Raise ``ValueError`` naming the allowed args if a name in ``names`` is neither a routing field, one of
    psr_hf's own nor a named parameter of ``HFLM.__init__`` (which would pass it on to ``from_pretrained``)."""
    unknown = sorted(set(names) - set(ROUTING_ARGS) - set(PSR_ARGS) - set(_hflm_args()))
    if unknown:
        raise ValueError(f"unknown psr_hf model arg(s) {', '.join(unknown)}; allowed: {allowed_args()}")


def _existing_file(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not Path(value).is_file():
        hint = {"calibration": "; make one with psr-hf calibrate --model MODEL --text FILE --out FILE",
                "predictor": "; train one with psr-hf train-predictor --model MODEL --out FILE"}.get(name, "")
        raise ValueError(f"psr_hf model arg {name}={value!r}: no such file{hint}")
    return str(value)


def routing_config(fields: Mapping[str, Any], config: str | None = None) -> RoutingConfig:
    """The :class:`RoutingConfig` of the routing model args ``fields`` (field name -> value as lm-eval parsed it;
    None leaves a field at its default) over the YAML file ``config`` if given. Raises RoutingConfig's
    ``ValueError`` (naming the field) for an invalid value, and ``ValueError`` for a missing file."""
    config_path = _existing_file("config", config)
    if config_path is not None:
        routing = RoutingConfig.load_yaml(config_path)
        return routing.replace(**fields) if fields else routing
    return RoutingConfig(**{name: value for name, value in fields.items() if value is not None})


def offload_config(offload: Any = None, max_in_flight: int | None = None) -> OffloadConfig | None:
    """The :class:`~psr_hf.OffloadConfig` of the model args ``offload=DEVICE`` (``cuda``, ``cuda:N``, ``cpu``;
    True means ``cuda``) and ``max_in_flight=N``; None without ``offload`` (None or False). Raises ``ValueError``
    naming the field."""
    if offload is None or offload is False:
        if max_in_flight is not None:
            raise ValueError("psr_hf model arg max_in_flight is used only with offload= (e.g. offload=cuda:0)")
        return None
    device = "cuda" if offload is True else offload
    if not isinstance(device, str):
        raise ValueError(f"psr_hf model arg offload={offload!r} must be a device: cuda, cuda:N or cpu")
    return OffloadConfig(device=device.strip(),
                         **({} if max_in_flight is None else {"max_in_flight": max_in_flight}))


def model_and_calibration(pretrained: Any, calibration: str | None) -> tuple[Any, str | None]:
    """``pretrained`` resolved by :func:`psr_hf.assets.resolve_model` (``tiny-moe`` is the shipped model's
    directory; a typo, a missing directory or a model psr_hf cannot patch raises ``ValueError`` before anything
    loads; a hub id found in the local cache while offline becomes its snapshot directory), and the calibration
    file: ``calibration`` if given (it must exist), else a ``calibration.safetensors`` saved beside the model, else
    None. A model object (not a name) is passed through."""
    calibration = _existing_file("calibration", calibration)
    directory = None
    if isinstance(pretrained, (str, Path)):
        source = resolve_model(pretrained)
        pretrained, directory = source.location, source.directory
    if calibration is None and directory is not None:
        beside = calibration_beside(directory)
        if beside is not None:
            calibration = str(beside)
            logger.info("psr_hf: calibration %s (saved beside the model; calibration= overrides it)", beside)
    return pretrained, calibration


_LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' key for it


@contextlib.contextmanager
def _long_sequences_windowed(tokenizer: Any) -> Iterator[None]:
    """Inside the block, ``tokenizer`` does not warn that a sequence exceeds the model's maximum length (the caller
    windows it); after it, the tokenizer warns as it did before (once, as transformers does)."""
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if not isinstance(shown, dict):
        yield
        return
    before = shown.get(_LONG_SEQUENCE_WARNING)
    shown[_LONG_SEQUENCE_WARNING] = True  # transformers' own "already warned" mark
    try:
        yield
    finally:
        if before is None:
            shown.pop(_LONG_SEQUENCE_WARNING, None)
        else:
            shown[_LONG_SEQUENCE_WARNING] = before


def _key(tokens: list[int]) -> tuple[int, int]:
    """A key of the tokens without trailing pad ids (HFLM right-pads loglikelihood inputs with 0): their length
    and hash (a collision can only add a candidate length, see :meth:`PSRLM._real_lengths`)."""
    end = len(tokens)
    while end and tokens[end - 1] == 0:
        end -= 1
    return end, hash(tuple(tokens[:end]))


@register_model("psr_hf")
class PSRLM(HFLM):
    """lm-eval's HF model with the model patched by :func:`psr_hf.patch` after loading (docs/lm-eval.md).

    Attributes: ``routing`` (the :class:`RoutingConfig`), ``calibration_path``; :meth:`routing_stats` gives the
    statistics so far.
    """

    def __init__(self, pretrained: Any, calibration: str | None = None, config: str | None = None,
                 offload: str | bool | None = None, max_in_flight: int | None = None, predictor: str | None = None,
                 **kwargs: Any) -> None:
        """``pretrained`` and psr_hf's own args (:data:`PSR_ARGS`, docs/lm-eval.md); ``kwargs``: the routing fields,
        and the rest goes to ``HFLM.__init__``. As in lm-eval's ``steered`` model, the values arrive already typed
        by lm-eval's parser of ``--model_args`` (``simple_parse_args_string``: ``0.5`` a float, ``2`` an int,
        ``true`` True, ``None`` None). Any other name, and ``trust_remote_code=True``, raise ``ValueError`` before
        the model is loaded."""
        check_args(kwargs)  # before anything loads
        if kwargs.get("trust_remote_code"):
            raise ValueError("psr_hf model arg trust_remote_code=True: psr_hf patches transformers' native model "
                             "classes only, and the hub's remote code would run before that could be checked; drop "
                             "trust_remote_code (transformers has native OLMoE, DeepSeek-V3/Moonlight, Qwen3.5-MoE "
                             "and Qwen3-Next)")
        fields = {name: kwargs.pop(name) for name in ROUTING_ARGS if name in kwargs}
        routing = routing_config(fields, config)
        predictor_path = _existing_file("predictor", predictor)
        if (predictor_path is None) != (routing.prefetch != "predictor"):
            raise ValueError("psr_hf model args predictor= and prefetch=predictor go together: predictor=FILE (from "
                             "psr-hf train-predictor) ranks the prefetches of prefetch=predictor")
        loaded_predictor = None
        if predictor_path is not None:
            from ..prefetch.predictor import Predictor

            loaded_predictor = Predictor.load(predictor_path)  # a file that is no predictor fails before loading
        pretrained, calibration = model_and_calibration(pretrained, calibration)
        offload = offload_config(offload, max_in_flight)
        self._psr_offload = offload
        if offload is not None:
            if kwargs.get("parallelize"):
                raise ValueError("psr_hf model args offload= and parallelize=True exclude each other: the offload "
                                 "puts every non-expert weight on one device and the experts in host memory")
            kwargs["device"] = "cpu"  # load on the host; the offload moves everything but the experts
        super().__init__(pretrained=pretrained, **kwargs)
        self.routing = routing
        self.calibration_path = calibration
        # real input lengths of the current loglikelihood requests, by their tokens without trailing zeros
        self._input_lengths: dict[tuple[int, int], set[int]] | None = None
        if offload is not None and getattr(self, "accelerator", None) is not None:
            # data parallel (accelerate launch): every process offloads to its own device
            offload = dataclasses.replace(offload, device=str(self.accelerator.device))
        patch(self.model, routing, calibration=calibration, offload=offload, predictor=loaded_predictor)
        self.predictor_path = predictor_path
        ctl = controller(self.model)
        if ctl.offload is not None:
            self._device = ctl.offload.device
            logger.info("psr_hf: %s", ctl.memory())
        logger.info("psr_hf: %s routing, capacity %d of %d experts in %d MoE layers (top-%d), calibration %s",
                    routing.policy, ctl.capacity, ctl.num_experts, ctl.num_layers, ctl.top_k, calibration)

    def _get_accelerate_args(self, *args: Any, **kwargs: Any) -> dict:
        if self._psr_offload is not None:  # the model loads on the host (data parallel included)
            return {"device_map": {"": "cpu"}, "max_memory": None}
        return super()._get_accelerate_args(*args, **kwargs)

    # ------------------------------------------------------------------ rolling loglikelihood
    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        # lm-eval tokenizes each whole document and cuts it into windows of max_length itself, so transformers'
        # warning that a sequence is longer than the model's maximum length (indexing errors) does not apply here
        with _long_sequences_windowed(self.tokenizer):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    # ------------------------------------------------------------------ padding
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None) -> list:
        # HFLM builds each row as (context + continuation)[-(max_length + 1):][:-1], right-pads the batch with 0
        # and passes no attention mask; index those inputs so _model_call can tell pads from real zeros
        lengths: dict[tuple[int, int], set[int]] = {}
        for _, context, continuation in requests:
            inp = (context + continuation)[-(self.max_length + 1):][:-1]
            lengths.setdefault(_key(inp), set()).add(len(inp))
        self._input_lengths = lengths
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._input_lengths = None

    def _real_lengths(self, inps: torch.Tensor) -> list[int] | None:
        """Per row of a right-padded batch, its real length: the longest request input that the row's tokens
        match up to trailing zeros, or the whole row where no request matches; None when no row is padded. The
        row's own input is always a candidate, so a real token is never taken for padding (a real trailing 0
        stays real); at worst, where two inputs differ only in trailing zeros, a pad counts as real, which
        cannot change the row's decisions (they run in position order)."""
        if self._input_lengths is None or inps.ndim != 2:
            return None
        width = int(inps.shape[1])
        result = []
        for row in inps.tolist():
            candidates = [n for n in self._input_lengths.get(_key(row), ()) if n <= width]
            result.append(max(candidates) if candidates else width)
        return None if min(result) == width else result

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        lengths = self._real_lengths(inps) if attn_mask is None else None
        if lengths is None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with controller(self.model).right_padded(lengths):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _detect_batch_size(self, requests: Any = None, pos: int = 0) -> int:
        # batch_size=auto probes memory with batches of ones: route them with the model's own routers, so the
        # probes never reach the routing state or the statistics
        with controller(self.model).bypassed():
            return super()._detect_batch_size(requests, pos)

    # ------------------------------------------------------------------ results
    def routing_stats(self) -> dict[str, Any]:
        """The routing config, the cache geometry and the statistics over every request so far."""
        ctl = controller(self.model)
        return {
            "routing": self.routing.to_dict(),
            "calibration": self.calibration_path,
            "predictor": self.predictor_path,
            "capacity": ctl.capacity,
            "num_experts": ctl.num_experts,
            "top_k": ctl.top_k,
            "moe_layers": ctl.num_layers,
            "stats": ctl.stats().total,
            **({} if ctl.offload is None else {"offload": ctl.stats().offload.to_dict(),
                                                "memory": ctl.memory().to_dict()}),
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
        return info
