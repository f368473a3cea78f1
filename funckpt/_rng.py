"""Capture and replay of random-number-generator state.

With ``preserve_rng_state=True`` a remat'd call records, just before its
forward run, the state of the CPU generator and of the current generator of
every device its tensors live on (every device type, not only one), and each
recomputation runs with those states restored. Around the recomputation the
caller's states are saved and put back, so the recomputation is invisible to
the caller's random stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["RngState", "capture", "replay"]


def _device_module(device: torch.device):  # type: ignore[no-untyped-def]
    return getattr(torch, device.type, None)


def _get_state(device: torch.device) -> torch.Tensor:
    module = _device_module(device)
    try:
        return module.get_rng_state(device)
    except TypeError:  # e.g. mps: one device, no argument
        return module.get_rng_state()


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


def capture(tensors: Iterable[torch.Tensor]) -> RngState:
    return RngState(
        cpu=torch.get_rng_state(),
        devices={d: _get_state(d) for d in accelerator_devices(tensors)},
    )


@contextlib.contextmanager
def replay(state: RngState) -> Iterator[None]:
    """Run the body from ``state``; restore the caller's generators afterwards."""
    saved_cpu = torch.get_rng_state()
    saved_devices = {d: _get_state(d) for d in state.devices}
    try:
        torch.set_rng_state(state.cpu)
        for d, s in state.devices.items():
            _set_state(d, s)
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        for d, s in saved_devices.items():
            _set_state(d, s)
