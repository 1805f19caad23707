"""What :func:`psr_hf.patch` installs on a model, and how :func:`psr_hf.unpatch` removes it: :class:`Installer`.

It puts the controller on in order (router forwards replaced; the model's and its decoder's forward, its
``generate()`` and ``_reorder_cache()`` wrapped, through :class:`~.wrapped_calls.WrappedCalls`; the experts
offloaded; the model's attribute that :func:`psr_hf.controller` reads) and remembers each step in the controller's
:class:`~.installation.Installation`, whose ``undo()`` restores the originals in reverse order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..offload.store import PatchedExpertStore, ResidentExperts
from .checkpointing import checkpointing_modules, unroute_checkpoints
from .controller import Controller
from .installation import CONTROLLER_ATTRIBUTE, refuse_copy
from .wrapped_calls import WrappedCalls

if TYPE_CHECKING:
    from ..offload.config import OffloadConfig

logger = logging.getLogger(__name__)


class Installer:
    """Installs ``controller`` on its model (:meth:`install`) and removes it (:meth:`uninstall`); what is installed
    is ``controller.installation``."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self.installation = controller.installation
        self.calls = WrappedCalls(controller)

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` put the controller on its model (and :meth:`uninstall` has not removed it)."""
        return bool(self.installation)

    def install(self, offload: OffloadConfig | None = None) -> None:
        """Put cache-aware routing on the model, in this order: each MoE router's forward replaced, the forward of
        the model and of its text decoder wrapped, ``generate()`` and ``_reorder_cache()`` wrapped, the experts
        offloaded when ``offload`` (an :class:`~psr_hf.offload.OffloadConfig`, or None) is given, and last the
        model's attribute that :func:`psr_hf.controller` reads. All or nothing: if a step fails, what the earlier
        ones installed is removed and the error is raised."""
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
        """Remove everything :meth:`install` put on the model, the latest first (the offload first: the weights
        go back to their devices and the model's own experts implementation is restored), so that the model
        computes exactly as before. Idempotent. Waits for a forward pass or ``generate()`` running in another
        thread."""
        ctl = self.controller
        with ctl._lock:
            ctl._reclaim()
            self.installation.undo()

    def _install_routers(self) -> None:
        for layer in self.controller.layers:
            router = layer.router
            self.installation.set_attr(router, "forward", self.calls.wrap_router(layer, router.forward))

    def _install_forwards(self) -> None:
        # the model itself, and its decoder for direct calls (the composite model's language model). A wrapper of
        # forward rather than forward hooks: torch runs always_call forward hooks only after an Exception, and the
        # forward pass must be closed after any BaseException (Ctrl-C in a notebook, SystemExit, GeneratorExit)
        ctl = self.controller
        for module in dict.fromkeys((ctl.model, ctl.family.decoder())):
            self.installation.set_attr(module, "forward", self.calls.wrap_forward(module, module.forward))

    def _install_generate(self) -> None:
        model = self.controller.model
        self.installation.set_attr(model, "_reorder_cache",
                                   self.calls.wrap_reorder_cache(getattr(model, "_reorder_cache", None)))
        if hasattr(model, "generate"):
            self.installation.set_attr(model, "generate", self.calls.wrap_generate(model.generate))
        if hasattr(model, "_get_stopping_criteria"):
            self.installation.set_attr(model, "_get_stopping_criteria",
                                       self.calls.wrap_stopping_criteria(model._get_stopping_criteria))

    def _install_checkpointing(self) -> None:
        """Gradient checkpointing replays each forward's routing (:mod:`.checkpointing`); the wrapping itself happens
        at each training forward pass, since transformers sets the checkpoint functions when it is enabled."""
        modules = self.calls.checkpointing = checkpointing_modules(self.controller.model)
        self.installation.add(lambda: unroute_checkpoints(modules))

    def _install_offload(self, config: OffloadConfig) -> None:
        """Move the experts to a host store with device slots (:class:`~psr_hf.offload.OffloadedExperts`, in FP8
        where the model comes from an FP8 checkpoint: :func:`~psr_hf.offload.fp8_experts.offloaded_experts`), the
        controller's expert store until uninstalled."""
        from ..offload.fp8_experts import offloaded_experts

        ctl = self.controller
        experts = offloaded_experts(ctl.model, ctl.layers, ctl.num_experts, ctl.capacity, config)
        self.installation.add(self._detach_store)
        self._attach_store(experts)

    def _attach_store(self, store: PatchedExpertStore) -> None:
        """Route through ``store`` (an :class:`~psr_hf.offload.OffloadedExperts`: its slots follow the cache)."""
        ctl = self.controller
        ctl.expert_store = ctl.routing.store = store
        ctl.routing.refresh_devices()  # the routers may have moved to the offload device

    def _detach_store(self) -> None:
        """Close the attached store (the weights go back to their devices) and route over the model's own
        experts again."""
        ctl = self.controller
        store = ctl.expert_store
        ctl.expert_store = ctl.routing.store = ResidentExperts([layer.block.experts for layer in ctl.layers],
                                                               ctl.num_experts)
        try:
            store.close()
        finally:
            ctl.routing.refresh_devices()
