"""Offloading: kept values held in host memory between the passes, and brought back ahead of use.

A policy answering :data:`~funckpt.policies.Offload` for an operator asks for
its outputs to be kept, but not in accelerator memory. At the end of the
call's forward run (after the checks that may drop a kept value, see
``Saved.finish_forward``), each such output on an accelerator is copied to
host memory (pinned, unless the policy asked for ``"unpinned_host"``) on a
side stream, so the copy overlaps the rest of the forward pass; the device
tensor is then dropped, and the allocator is told (``record_stream``) not to
reuse its memory before the copy has read it.

In the backward pass, when a call is recomputed, its values are copied back
(unless a prefetch already started that) and the recomputation's stream
waits for those copies only; then the copies of the call recorded just
before it in the forward pass are started, so they overlap this call's
recomputation and backward. Calls are chained in forward order
(``previous``), which is the order the backward pass visits them in reverse.

A CPU tensor is already in host memory: it is simply kept, and no copy is
made. The copy logic is written against a small :class:`Backend` interface
(CUDA streams and events; a synchronous copy for other accelerators), so its
structure is tested on a CPU-only machine by registering a fake backend for
``"cpu"`` in :data:`BACKENDS`.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ._internals import outside_functorch

__all__ = ["BACKENDS", "Backend", "Moved", "Offloaded", "chain", "fetch", "prefetch", "to_host"]


class Backend(Protocol):
    def to_host(self, t: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, Any]:
        """Start copying ``t`` to host memory; return the host tensor and what marks the copy done."""

    def to_device(self, host: torch.Tensor, device: torch.device, done: Any) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` back to ``device`` (after ``done``); return the tensor and its mark."""

    def ready(self, t: torch.Tensor, done: Any) -> None:
        """Make the current stream wait for ``done`` before it uses ``t``."""


class _CudaBackend:
    """Copies on one side stream per device, ordered with the compute stream by events."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _side(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return stream

    def to_host(self, t: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, Any]:
        side = self._side(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t has been computed
        with torch.cuda.stream(side):
            host = torch.empty_like(t, device="cpu", pin_memory=pinned)
            host.copy_(t, non_blocking=pinned)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        t.record_stream(side)  # the allocator may not hand t's memory out before the copy read it
        return host, done

    def to_device(self, host: torch.Tensor, device: torch.device, done: Any) -> tuple[torch.Tensor, Any]:
        side = self._side(device)
        with torch.cuda.stream(side):
            side.wait_event(done)
            t = torch.empty_like(host, device=device)
            t.copy_(host, non_blocking=host.is_pinned())
            back = torch.cuda.Event()  # type: ignore[no-untyped-call]
            back.record(side)
        return t, back

    def ready(self, t: torch.Tensor, done: Any) -> None:
        current = torch.cuda.current_stream(t.device)
        current.wait_event(done)
        t.record_stream(current)  # allocated on the side stream, used and freed on this one


class _SynchronousBackend:
    """Other accelerators: plain blocking copies (still out of device memory between the passes)."""

    def to_host(self, t: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, Any]:
        return t.to("cpu"), None

    def to_device(self, host: torch.Tensor, device: torch.device, done: Any) -> tuple[torch.Tensor, Any]:
        return host.to(device), None

    def ready(self, t: torch.Tensor, done: Any) -> None:
        pass


#: Device type -> how values are moved off it. A type not listed is an accelerator without
#: streams here (synchronous copies); ``cpu`` and ``meta`` values stay where they are.
BACKENDS: dict[str, Backend] = {"cuda": _CudaBackend()}
_STAY = frozenset({"cpu", "meta"})
_SYNCHRONOUS = _SynchronousBackend()


def _backend(device: torch.device) -> Backend | None:
    found = BACKENDS.get(device.type)
    if found is not None:
        return found
    return None if device.type in _STAY else _SYNCHRONOUS


@dataclass
class Moved:
    """One tensor in host memory, with what is needed to bring it back."""

    host: torch.Tensor
    device: torch.device
    backend: Backend
    done: Any  # the copy to host's completion mark
    nbytes: int


@dataclass
class Offloaded:
    """An operator's outputs with their device tensors replaced by :class:`Moved` copies."""

    kind: type | None  # None: a single tensor; else the tuple or list type the operator returned
    items: list[Any]

    def tensors(self) -> list[torch.Tensor]:
        """The host copies (and any tensor that stayed), for reports."""
        return [i.host if isinstance(i, Moved) else i for i in self.items if isinstance(i, (Moved, torch.Tensor))]


@dataclass
class Pending:
    """Copies back to the device that were started and not yet waited for: position -> (outputs, marks)."""

    values: dict[int, tuple[Any, list[tuple[torch.Tensor, Backend, Any]]]] = field(default_factory=dict)


def to_host(out: Any, pinned: bool) -> Offloaded | None:
    """Start moving ``out``'s accelerator tensors to host memory; None if it has none (kept as is)."""
    if not isinstance(out, (torch.Tensor, tuple, list)):  # a Python number (.item()): kept as it is
        return None
    single = isinstance(out, torch.Tensor)
    items = [out] if single else list(out)
    moved = False
    for i, t in enumerate(items):
        if isinstance(t, torch.Tensor):
            backend = _backend(t.device)
            if backend is not None:
                host, done = backend.to_host(t, pinned)
                items[i] = Moved(host, t.device, backend, done, t.numel() * t.element_size())
                moved = True
    if not moved:
        return None
    return Offloaded(None if single else type(out), items)


def _start_back(value: Offloaded) -> tuple[Any, list[tuple[torch.Tensor, Backend, Any]]]:
    # The copies back are plain tensors, made outside any torch.func transform active where
    # the backward runs (under vmap(grad) or jacrev they came out wrapped, and the replayer
    # serves them below functorch).
    with outside_functorch():
        return _copies_back(value)


def _copies_back(value: Offloaded) -> tuple[Any, list[tuple[torch.Tensor, Backend, Any]]]:
    marks = []
    items = []
    for item in value.items:
        if isinstance(item, Moved):
            t, done = item.backend.to_device(item.host, item.device, item.done)
            marks.append((t, item.backend, done))
            items.append(t)
        else:
            items.append(item)
    out = items[0] if value.kind is None else value.kind(items)
    return out, marks


class _Chain(threading.local):
    """The calls that offloaded values, in forward order (each points at the one before).

    One chain per thread: the calls of one forward pass are made in one thread, and the
    backward pass through them visits them in reverse. Threads running their own models
    at once (``nn.DataParallel``'s replicas) must not prefetch each other's values, which
    would bring them back long before their own backward needs them.
    """

    def __init__(self) -> None:
        self.last: weakref.ref[Any] | None = None


_chain = _Chain()


def chain(saved: Any) -> weakref.ref[Any] | None:
    """Append ``saved`` (a call that offloaded values) to this thread's chain; return the call before it."""
    previous, _chain.last = _chain.last, weakref.ref(saved)
    return previous


def fetch(kept: dict[int, Any], pending: Pending) -> dict[int, Any]:
    """The offloaded values of one call, back on their devices and safe to use on the current stream."""
    started = dict(pending.values)
    pending.values.clear()
    for position, value in kept.items():
        if isinstance(value, Offloaded) and position not in started:
            started[position] = _start_back(value)
    out = {}
    for position, (value, marks) in started.items():
        if position not in kept:  # released meanwhile
            continue
        for t, backend, done in marks:
            backend.ready(t, done)
        out[position] = value
    return out


_MAX_WALK = 64


def prefetch(previous: weakref.ref[Any] | None) -> None:
    """Start bringing back the values of the nearest earlier call that still has some in host memory."""
    for _ in range(_MAX_WALK):
        saved = previous() if previous is not None else None
        if saved is None:
            return
        with saved.offload_lock:
            waiting = {p: v for p, v in saved.kept.items() if isinstance(v, Offloaded)}
            if waiting:
                if not saved.pending.values:
                    for position, value in waiting.items():
                        saved.pending.values[position] = _start_back(value)
                return
        previous = saved.previous
