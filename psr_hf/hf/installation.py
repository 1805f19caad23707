"""What is installed on a patched model, as the steps that undo it (:class:`Installation`); the model's attribute
that holds its controller; and the refusal to copy either.

The :class:`~psr_hf.hf.installer.Installer` fills a controller's :class:`Installation` step by step; ``undo()``
restores the originals in reverse order.
"""

from __future__ import annotations

from typing import Callable, NoReturn

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
    """What is installed on a model for its controller, as the steps that undo it: :meth:`undo` runs them in
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
