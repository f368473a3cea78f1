"""Autocast state, recorded at the forward run and replayed by recomputations.

The backward pass usually runs outside the user's ``torch.autocast`` block, so
a recomputation must re-enter the autocast state the forward run saw, or it
would compute in other dtypes than the forward did (as
``torch.utils.checkpoint`` also ensures). Recorded for the CPU and for every
device type the call's tensors live on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


def capture(tensors: Iterable[torch.Tensor]) -> list[AutocastState]:
    device_types = dict.fromkeys(["cpu", *(t.device.type for t in tensors)])
    return [_current(d) for d in device_types if torch.amp.is_autocast_available(d)]


def _current(device_type: str) -> AutocastState:
    return AutocastState(
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


@contextlib.contextmanager
def replay(states: Iterable[AutocastState]) -> Iterator[None]:
    """Enter the recorded autocast state where it differs from the current one."""
    with contextlib.ExitStack() as stack:
        for s in states:
            if s == _current(s.device_type):
                continue
            stack.enter_context(
                torch.autocast(s.device_type, dtype=s.dtype, enabled=s.enabled, cache_enabled=s.cache_enabled)
            )
        yield
