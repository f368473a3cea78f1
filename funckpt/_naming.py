"""The thread's stack of recording regions, which ``checkpoint_name`` tells about a name.

At the bottom of the import graph so that ``policies`` (where ``checkpoint_name``
lives) and ``_saving`` (whose recorder pushes itself here) need not import each
other.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class _Active(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []  # the Saved of each recording region, innermost last


active = _Active()


def note_name(x: torch.Tensor, name: str) -> None:
    """Called by ``checkpoint_name``: tell the innermost recording region."""
    if active.stack:
        active.stack[-1].name_value(x, name)


class OnThreadStack:
    """Mixin for a mode that also sits on one of funckpt's thread-local stacks while entered.

    ``__enter__`` pushes ``self._stack_item()`` on ``self._thread_stack()`` and then
    enters the mode; ``__exit__`` exits it and pops, even when exiting raises, and a
    failed enter pops again: the stacks never keep an entry for a mode that is not active.
    """

    def _thread_stack(self) -> list[Any]:
        raise NotImplementedError

    def _stack_item(self) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Any:
        stack = self._thread_stack()
        stack.append(self._stack_item())
        try:
            return super().__enter__()  # type: ignore[misc]
        except BaseException:
            stack.pop()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[misc]
        finally:
            self._thread_stack().pop()
