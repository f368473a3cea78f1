"""What remat keeps between the forward and the backward pass, listed (JAX's print_saved_residuals).

:func:`saved_residuals` runs a function once on example arguments, watching
every remat'd call inside it, and lists the tensors those calls keep for the
backward pass: their inputs (arguments, captured tensors, module parameters)
and the values their saving policies keep (with the operator, or the
:func:`~funckpt.checkpoint_name`, that produced them); for a checkpointed loop
(``scan``, ``fori_loop``, ``while_loop``), the carries it keeps as well. Memory
held by the rest of the program (un-remat'd code) is not listed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import optree
import torch

from ._internals import bottom, storage_of



class UserRegion(Protocol):
    """What a residual report reads of a remat'd call's region (``_call.UserRegion``)."""

    name: str
    saved: Any
    argspec: Any
    arg_index: list[int]
    captured: Any
    captured_index: list[int]

__all__ = ["Residual", "print_saved_residuals", "saved_residuals"]


@dataclass(frozen=True)
class Residual:
    """One tensor a remat'd call keeps for the backward pass (see :func:`saved_residuals`).

        >>> import torch, funckpt
        >>> (r,) = funckpt.saved_residuals(funckpt.remat(torch.sin), torch.ones(3, requires_grad=True))
        >>> r.kind, r.source, r.shape, r.nbytes
        ('input', 'args[0]', (3,), 12)
    """

    region: str  #: the remat'd function's name
    #: ``"input"``, ``"saved by policy"`` (offloaded ones too: see ``offloaded``) or, for a checkpointed
    #: loop, ``"carry kept by the loop"``
    kind: str
    source: str  #: where it comes from: an argument path, a parameter name, an operator or a name
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    #: kept in host memory between the passes, as an ``Offload`` policy asked (for a CPU tensor: simply kept)
    offloaded: bool = False


class _Observers(threading.local):
    def __init__(self) -> None:
        self.stack: list[list[tuple[UserRegion, tuple[torch.Tensor, ...]]]] = []


_observers = _Observers()


def notify(region: UserRegion, inputs: tuple[torch.Tensor, ...]) -> None:
    """Called for every remat'd call; records it when a report is being made."""
    if _observers.stack:
        _observers.stack[-1].append((region, inputs))


@contextlib.contextmanager
def _observe() -> Iterator[list[tuple[UserRegion, tuple[torch.Tensor, ...]]]]:
    seen: list[tuple[UserRegion, tuple[torch.Tensor, ...]]] = []
    _observers.stack.append(seen)
    try:
        yield seen
    finally:
        _observers.stack.pop()


def saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Run ``fn(*args, **kwargs)`` once and list what its remat'd calls keep for the backward pass.

    Example::

        >>> import torch, funckpt
        >>> from funckpt import policies
        >>> f = funckpt.remat(lambda w, x: torch.tanh(x @ w) @ w, policy=policies.dots_saveable)
        >>> for r in funckpt.saved_residuals(f, torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)):
        ...     print(r.kind, r.source, r.shape)
        input args[0] (8, 8)
        input args[1] (4, 8)
        saved by policy aten.mm.default (4, 8)
        saved by policy aten.mm.default (4, 8)
    """
    return _collect(fn, args, kwargs)[0]


def _collect(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Residual], list[str]]:
    """The residuals, and a line per call whose policy chose by a memory budget."""
    if not callable(fn):
        raise TypeError(f"saved_residuals: fn must be callable, got {fn!r}")
    with _observe() as seen, torch.enable_grad():
        fn(*args, **kwargs)
    residuals = []
    notes = []
    for region, inputs in seen:
        sources = _input_sources(region)
        for i, t in enumerate(inputs):
            residuals.append(_residual(region.name, "input", sources.get(i, "input"), t))
        saved = region.saved
        if saved is not None:
            for position in sorted(saved.kept):
                op = saved.trace[position][0]
                label = saved.labels.get(position)
                source = f"{op} named {label!r}" if label else str(op)
                tensors, offloaded = saved.kept_tensors(position)
                for t in tensors:
                    residuals.append(_residual(region.name, "saved by policy", source, t, offloaded))
            if saved.choice is not None:
                notes.append(f"{region.name}: {saved.choice.summary()}")
        for position, t in _kept_carries(region, inputs):
            residuals.append(_residual(region.name, "carry kept by the loop", f"carry before step {position}", t))
    return residuals, notes


def _kept_carries(region: Any, inputs: tuple[torch.Tensor, ...]) -> list[tuple[int, torch.Tensor]]:
    """The tensors of the carries a checkpointed loop keeps for its backward pass (``LoopRegion.kept``,
    by position: every carry with ``checkpoints=None``, at most ``checkpoints`` of them otherwise),
    each storage once and none its inputs hold (the initial carry, a tensor a step passes on as it is)."""
    kept = getattr(region, "kept", None)
    if not kept:
        return []

    def storage(t: torch.Tensor) -> int:
        found = storage_of(bottom(t))
        return id(t) if found is None else found

    seen = {storage(t) for t in inputs}
    carries = []
    for position in sorted(kept):
        for t in kept[position].tensors:
            if storage(t) not in seen:
                seen.add(storage(t))
                carries.append((position, t))
    return carries


def _residual(region: str, kind: str, source: str, t: torch.Tensor, offloaded: bool = False) -> Residual:
    return Residual(region, kind, source, tuple(t.shape), t.dtype, t.numel() * t.element_size(), offloaded)


def _input_sources(region: UserRegion) -> dict[int, str]:
    sources: dict[int, str] = {}
    paths = optree.treespec_paths(region.argspec.dynamic.treespec)
    dynamic_positions = [i for i in range(region.argspec.nargs) if i not in region.argspec.static]
    for slot, position in zip(region.arg_index, region.argspec.dynamic.tensor_positions):
        path = paths[position]
        head = f"args[{dynamic_positions[path[1]]}]" if path[0] == 0 else f"kwargs[{path[1]!r}]"
        sources.setdefault(slot, head + "".join(f"[{p!r}]" for p in path[2:]))
    names = {id(t): name for _, named in region.captured.modules for name, t in named.items()}
    for t, slot in zip(region.captured.tensors, region.captured_index):
        sources.setdefault(slot, f"parameter/buffer {names[id(t)]!r}" if id(t) in names else "captured tensor")
    return sources


def print_saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print :func:`saved_residuals` as a table, with the total.

        >>> import torch, funckpt
        >>> funckpt.print_saved_residuals(funckpt.remat(torch.sin), torch.ones(3, requires_grad=True))
        remat'd call  kind   source   shape  dtype    size
        sin           input  args[0]  [3]    float32  12 B
        total: 12 B in 1 tensors
    """
    residuals, notes = _collect(fn, args, kwargs)
    rows = [
        (
            r.region,
            "offloaded by policy" if r.offloaded else r.kind,
            r.source,
            f"{list(r.shape)}",
            str(r.dtype).removeprefix("torch."),
            _size(r.nbytes),
        )
        for r in residuals
    ]
    header = ("remat'd call", "kind", "source", "shape", "dtype", "size")
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    total = sum(r.nbytes for r in residuals)
    offloaded = sum(r.nbytes for r in residuals if r.offloaded)
    print(f"total: {_size(total)} in {len(residuals)} tensors" + (f", {_size(offloaded)} of it offloaded" if offloaded else ""))
    for note in notes:
        print(note)


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "GiB":
            break
    return f"{nbytes:.1f} {unit}"
