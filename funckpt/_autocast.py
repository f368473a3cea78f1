"""Autocast state, recorded at the forward run and replayed by recomputations.

The backward pass usually runs outside the user's ``torch.autocast`` block, so
a recomputation must re-enter the autocast state the forward run saw, or it
would compute in other dtypes than the forward did (as
``torch.utils.checkpoint`` also ensures). Recorded for the CPU and for every
device type the call's tensors live on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch


class AutocastState(NamedTuple):
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


#: What :func:`capture` records when autocast is off on every device (the common
#: case, told by one call): a recomputation then runs with autocast off too.
OFF: tuple[AutocastState, ...] = ()


def any_enabled() -> bool:
    """Is autocast on for any device type?"""
    # torch's one-call check does not cover MPS (torch 2.13): asked separately, where torch has MPS.
    return bool(torch._C._is_any_autocast_enabled() or (_MPS and torch.is_autocast_enabled("mps")))


_MPS = torch.backends.mps.is_built()


def capture(tensors: Iterable[torch.Tensor]) -> Sequence[AutocastState]:
    if not any_enabled():
        return OFF
    device_types = ["cpu"]
    for t in tensors:
        if not t.is_cpu:  # (reading .device makes a device object: only where needed)
            device_type = t.device.type
            if device_type not in device_types:
                device_types.append(device_type)
    return [_current(d) for d in device_types if torch.amp.is_autocast_available(d)]


def _current(device_type: str) -> AutocastState:
    return AutocastState(
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


class replay:
    """Enter the recorded autocast state where it differs from the current one."""

    def __init__(self, states: Sequence[AutocastState]) -> None:
        self.states = states
        self.stack: contextlib.ExitStack[bool | None] | None = None

    def __enter__(self) -> None:
        if self.states is OFF:
            if not any_enabled():
                return
            # The backward runs under autocast, the forward did not: turn it off where it is on.
            self.states = [_current(d)._replace(enabled=False) for d in _available_device_types()]
        for s in self.states:
            if s == _current(s.device_type):
                continue
            if self.stack is None:
                self.stack = contextlib.ExitStack()
            self.stack.enter_context(
                torch.autocast(s.device_type, dtype=s.dtype, enabled=s.enabled, cache_enabled=s.cache_enabled)
            )

    def __exit__(self, *exc: Any) -> bool | None:
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc) if stack is not None else None


def cache_off(states: Sequence[AutocastState]) -> bool:
    """Turn autocast's cast cache off for a run of a call whose forward run recorded autocast
    ``states`` (:func:`capture`), where the cache is on; return whether it did (then
    :func:`cache_on` must follow). Where the forward run had autocast off (``OFF``), its runs
    have it off too, with nothing to cache.

    The cache keeps the cast of every leaf that requires grad until the outermost autocast
    block exits. A remat'd call's runs make their own leaves of its inputs each time: cached,
    their casts (of every block's input and weights) would stay alive to the end of the
    forward pass, more than the call keeps, and one fn makes itself would look to the checks
    like a tensor that outlived the call. Without the cache a weight used twice in one run is
    cast twice: the same values in the forward pass, but its gradient sums the two uses in
    float32 where the cached cast's node sums them in the 16-bit type first (a gradient one unit
    in the last place of that type apart: see the README's limits).
    """
    if states is OFF or not torch.is_autocast_cache_enabled():
        return False
    torch.set_autocast_cache_enabled(False)
    return True


def cache_on(*_exc: Any) -> None:
    torch.set_autocast_cache_enabled(True)


def _available_device_types() -> list[str]:
    """The device types that have autocast (to turn it off where the forward run had none)."""
    candidates = ["cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", torch._C._get_privateuse1_backend_name()]
    return [d for d in dict.fromkeys(candidates) if torch.amp.is_autocast_available(d)]
