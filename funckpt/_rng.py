"""Capture and replay of random-number-generator state.

With ``preserve_rng_state=True`` a remat'd call records, just before its
forward run, the state of

* the CPU generator,
* the current generator of every device its tensors live on, for every device
  type at once (``torch.utils.checkpoint`` saves one non-CPU device type only),
* every ``torch.Generator`` it was handed explicitly, anywhere in its
  arguments' pytree, or reaches through its closure, and every other one its
  forward run draws from (noted at its first draw, :func:`add`: one held where
  the walk of the closure does not look),

and each recomputation runs with those states restored. Around the
recomputation the current states are saved and put back, so the recomputation
is invisible to the caller's random streams: after forward and backward every
generator is where it would be without remat. (Around a ``context_fn``'s
recomputation context too, :class:`kept`, as ``torch.utils.checkpoint``'s
``fork_rng`` holds that context.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

__all__ = ["RngState", "add", "capture", "kept", "replay", "restore", "same"]


def _device_module(device: torch.device) -> Any:
    return getattr(torch, device.type, None)


def _get_state(device: torch.device) -> torch.Tensor:
    module = _device_module(device)
    try:
        return cast(torch.Tensor, module.get_rng_state(device))
    except TypeError:  # e.g. mps: one device, no argument
        return cast(torch.Tensor, module.get_rng_state())


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    module = _device_module(device)
    try:
        module.set_rng_state(state, device)
    except TypeError:
        module.set_rng_state(state)


def accelerator_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct non-CPU devices of ``tensors`` that have a global generator."""
    devices: dict[torch.device, None] = {}
    for t in tensors:
        if t.is_cpu:  # (reading .device makes a device object: only where needed)
            continue
        d = t.device
        if d.type in ("cpu", "meta"):
            continue
        if d.index is None and d.type != "mps":
            d = torch.device(d.type, _device_module(d).current_device())
        module = _device_module(d)
        if module is not None and hasattr(module, "get_rng_state"):
            devices[d] = None
    return list(devices)


@dataclass
class RngState:
    """The generator states a forward run started from."""

    cpu: torch.Tensor
    devices: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    explicit: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)


def capture(tensors: Iterable[torch.Tensor], generators: Sequence[torch.Generator] = ()) -> RngState:
    devices = accelerator_devices(tensors)
    return RngState(
        _CPU.get_state(),
        {d: _get_state(d) for d in devices} if devices else {},
        [(g, g.get_state()) for g in {id(g): g for g in generators}.values()] if generators else [],
    )


_CPU = torch.default_generator  # what torch.get_rng_state and set_rng_state read and write


def add(state: RngState, generator: torch.Generator, now: torch.Tensor | None = None) -> bool:
    """Record ``generator``'s state now (``now``, if given) in ``state``, unless ``state`` records it
    already: among its explicit generators, or as the CPU generator or the current generator of one
    of its devices (whose states ``state`` has from its capture, which a later one must not
    override). Was it added?"""
    if generator is _CPU or any(g is generator for g, _ in state.explicit):
        return False
    for d in state.devices:
        defaults = getattr(_device_module(d), "default_generators", ())
        if d.index is not None and d.index < len(defaults) and defaults[d.index] is generator:
            return False
    state.explicit.append((generator, generator.get_state() if now is None else now))
    return True


def same(a: RngState, b: RngState) -> bool:
    """Do ``a`` and ``b`` record the same states (so one object can stand for both)?"""
    return (
        torch.equal(a.cpu, b.cpu)
        and a.devices.keys() == b.devices.keys()
        and all(torch.equal(s, b.devices[d]) for d, s in a.devices.items())
        and len(a.explicit) == len(b.explicit)
        and all(g is h and torch.equal(s, t) for (g, s), (h, t) in zip(a.explicit, b.explicit))
    )


def restore(state: RngState) -> None:
    """Put every generator ``state`` recorded back to it (inside :func:`replay`, which undoes it)."""
    _CPU.set_state(state.cpu)
    for d, s in state.devices.items():
        _set_state(d, s)
    for g, s in state.explicit:
        g.set_state(s)


def _now(state: RngState) -> RngState:
    """The states now of the generators ``state`` records."""
    return RngState(
        _CPU.get_state(),
        {d: _get_state(d) for d in state.devices} if state.devices else {},
        [(g, g.get_state()) for g, _ in state.explicit] if state.explicit else [],
    )


class replay:
    """Run the body from ``state``; put every generator back as it was afterwards."""

    def __init__(self, state: RngState) -> None:
        self.state = state
        self.saved: RngState | None = None

    def __enter__(self) -> None:
        state = self.state
        self.saved = _now(state)
        try:
            restore(state)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: Any) -> None:
        saved, self.saved = self.saved, None
        assert saved is not None
        restore(saved)


class kept:
    """Put every generator ``state`` records back as it was before the body, which draws from them
    where they are (a recomputation's ``context_fn`` context, around its :class:`replay`)."""

    def __init__(self, state: RngState) -> None:
        self.state = state
        self.saved: RngState | None = None

    def __enter__(self) -> None:
        self.saved = _now(self.state)

    def __exit__(self, *exc: Any) -> None:
        saved, self.saved = self.saved, None
        assert saved is not None
        restore(saved)
