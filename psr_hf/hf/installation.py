"""What a :class:`~psr_hf.hf.controller.Controller` installs on its model, and how it is removed.

:class:`Installer` puts it on in order (router forwards replaced; the model's and its decoder's forward, its
``generate()`` and ``_reorder_cache()`` wrapped; the experts offloaded; the model's attribute that
:func:`psr_hf.controller` reads) and remembers each step in an :class:`Installation`, whose ``undo()`` restores
the originals in reverse order. The wrappers keep the original's name, docstring and signature
(``functools.wraps``) and hand every call to the controller.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch

from .checkpointing import checkpointing_modules, route_checkpoints, unroute_checkpoints

if TYPE_CHECKING:
    from ..offload.config import OffloadConfig

logger = logging.getLogger(__name__)

CONTROLLER_ATTRIBUTE = "_psr_hf_controller"  # the model's instance attribute that holds its Controller while patched

_COPY_REFUSED = (
    "psr_hf: a patched model cannot be deep-copied or pickled (torch.save(model), multiprocessing): its routing state "
    "holds a lock, the offload's copy thread and the replaced router forwards. Copy or pickle the unpatched model "
    "(psr_hf.unpatch(model), or psr_hf.patched(...) as a block) and patch the copy; to store weights use "
    "model.save_pretrained() or torch.save(model.state_dict()), which work on a patched model"
)


def refuse_copy(*_: object) -> NoReturn:
    """``__deepcopy__`` / ``__reduce_ex__`` of a patched model and of its controller."""
    raise TypeError(_COPY_REFUSED)


class Installation:
    """What a :class:`Controller` installed on a model, as the steps that undo it: :meth:`undo` runs them in
    reverse order, so each original is restored over what was installed after it."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        return bool(self._undo)

    def add(self, undo: Callable[[], None]) -> None:
        """Remember ``undo`` (no arguments), which removes one thing that was just installed."""
        self._undo.append(undo)

    def set_attr(self, obj: object, name: str, value: object) -> None:
        """Set ``obj.name`` to ``value`` as an instance attribute (bypassing ``nn.Module.__setattr__``), remembering
        how to restore what the instance had: its own previous attribute, or none (the class's shows again)."""
        had = name in vars(obj)
        previous = vars(obj).get(name)
        object.__setattr__(obj, name, value)

        def undo() -> None:
            if had:
                object.__setattr__(obj, name, previous)
            elif name in vars(obj):
                object.__delattr__(obj, name)

        self._undo.append(undo)

    def undo(self) -> None:
        """Undo every step, the latest first. A step that fails does not stop the others; the first error is
        raised after all of them ran."""
        error: BaseException | None = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as exc:  # keep restoring: a half-removed patch is worse than one error
                error = error or exc
        if error is not None:
            raise error


class Installer:
    """Installs ``controller`` on its model (:meth:`install`) and removes it (:meth:`uninstall`)."""

    def __init__(self, controller: Any):  # the Controller (which imports this module)
        self.controller = controller
        self.installation = Installation()
        self._checkpointing: list = []  # the modules transformers may checkpoint

    @property
    def installed(self) -> bool:
        return bool(self.installation)

    def install(self, offload: OffloadConfig | None = None) -> None:
        """All or nothing: if a step fails, what the earlier ones installed is removed and the error is raised."""
        if self.installed:
            raise RuntimeError("psr_hf: this controller is already installed; uninstall() it first")
        model = self.controller.model
        try:
            self._install_routers()
            self._install_forwards()
            self._install_generate()
            self._install_checkpointing()
            if offload is not None:
                self._install_offload(offload)
            self.installation.set_attr(model, CONTROLLER_ATTRIBUTE, self.controller)
            # copy.deepcopy and pickle (torch.save(model) too) look these up on the instance first
            self.installation.set_attr(model, "__deepcopy__", refuse_copy)
            self.installation.set_attr(model, "__reduce_ex__", refuse_copy)
        except BaseException:
            try:
                self.uninstall()
            except Exception:  # the install step's error is the one to report; this one is logged
                logger.exception("psr_hf: removing what a failed install had put on the model failed as well")
            raise

    def uninstall(self) -> None:
        """Remove everything, the latest first."""
        self.installation.undo()

    def _install_routers(self) -> None:
        ctl = self.controller
        for layer in ctl.layers:
            router = layer.router
            self.installation.set_attr(router, "forward", ctl.router_forward(layer, router.forward))

    def _install_forwards(self) -> None:
        # the model itself, and its decoder for direct calls (the composite model's language model). A wrapper of
        # forward rather than forward hooks: torch runs always_call forward hooks only after an Exception, and the
        # forward pass must be closed after any BaseException (Ctrl-C in a notebook, SystemExit, GeneratorExit)
        ctl = self.controller
        for module in dict.fromkeys((ctl.model, ctl.family.decoder())):
            self.installation.set_attr(module, "forward", _forward_wrapper(ctl, module, module.forward))

    def _install_generate(self) -> None:
        ctl = self.controller
        model = ctl.model
        self.installation.set_attr(model, "_reorder_cache",
                                   _reorder_cache_wrapper(ctl, getattr(model, "_reorder_cache", None)))
        if hasattr(model, "generate"):
            self.installation.set_attr(model, "generate", _generate_wrapper(ctl, model.generate))
        if hasattr(model, "_get_stopping_criteria"):
            self.installation.set_attr(model, "_get_stopping_criteria",
                                       _stopping_criteria_wrapper(ctl, model._get_stopping_criteria))

    def _install_checkpointing(self) -> None:
        """Gradient checkpointing replays each forward's routing (:mod:`.checkpointing`); the wrapping itself happens
        at each training forward pass, since transformers sets the checkpoint functions when it is enabled."""
        self._checkpointing = checkpointing_modules(self.controller.model)
        self.installation.add(lambda: unroute_checkpoints(self._checkpointing))

    def route_checkpoints(self) -> None:
        """Wrap the checkpoint functions transformers set since the last call
        (:func:`.checkpointing.route_checkpoints`)."""
        route_checkpoints(self._checkpointing, self.controller.routing)

    def _install_offload(self, config: OffloadConfig) -> None:
        """Move the experts to a host store with device slots (:class:`~psr_hf.offload.OffloadedExperts`), the
        controller's expert store until uninstalled."""
        from ..offload.experts import OffloadedExperts

        ctl = self.controller
        experts = OffloadedExperts(ctl.model, ctl.layers, ctl.num_experts, ctl.capacity, config)
        self.installation.add(ctl.detach_store)
        ctl.attach_store(experts)


def _forward_wrapper(ctl: Any, module: torch.nn.Module, original: Callable) -> Callable:
    """The forward that replaces ``module``'s (the model's or its decoder's; ``original`` bound)."""

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return ctl.run_forward(module, original, args, kwargs)

    return forward


def _generate_wrapper(ctl: Any, original: Callable) -> Callable:
    """The model's ``generate`` that also tells the controller the stop tokens and the prompt length."""

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        return ctl.run_generate(original, args, kwargs)

    return generate


def _stopping_criteria_wrapper(ctl: Any, original: Callable) -> Callable:
    """The model's ``_get_stopping_criteria`` whose list also tells the controller which rows each step stopped
    (stop strings, lm-eval's ``until``, any custom criterion), so the pad tokens generate() feeds a stopped row
    afterwards never touch its routing state or statistics."""
    from transformers import StoppingCriteriaList

    class RowStops(StoppingCriteriaList):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            done = super().__call__(input_ids, scores, **kwargs)
            ctl.rows_stopped(done)
            return done

        def __deepcopy__(self, memo: dict) -> StoppingCriteriaList:  # a plain list: the controller is not copied
            return StoppingCriteriaList(copy.deepcopy(list(self), memo))

    @functools.wraps(original)
    def get_stopping_criteria(*args: Any, **kwargs: Any) -> Any:
        criteria = original(*args, **kwargs)
        return RowStops(criteria) if isinstance(criteria, StoppingCriteriaList) else criteria

    return get_stopping_criteria


def _reorder_cache_wrapper(ctl: Any, original: Callable | None) -> Callable:
    """The model's ``_reorder_cache`` (None: it has none, and the KV cache reorders itself) that also reorders
    the per-row state like the KV cache (beam search)."""

    def reorder(past: Any, beam_idx: torch.Tensor) -> Any:
        ctl.reorder(beam_idx.detach().to("cpu").numpy())
        if original is not None:
            return original(past, beam_idx)
        past.reorder_cache(beam_idx)
        return past

    if original is None:
        def _reorder_cache(past_key_values: Any, beam_idx: torch.Tensor) -> Any:
            """Reorder the KV cache ``past_key_values`` and psr_hf's per-row state by ``beam_idx``; returns the
            reordered cache."""
            return reorder(past_key_values, beam_idx)

        return _reorder_cache

    @functools.wraps(original)
    def reorder_cache(past_key_values: Any, beam_idx: torch.Tensor) -> Any:
        return reorder(past_key_values, beam_idx)

    return reorder_cache
