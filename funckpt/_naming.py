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
