"""Errors, the determinism check and the debug operator traces.

A recomputation must produce tensors of the same shape, dtype and device as the
forward pass, or the gradients it yields belong to a different function. With
``determinism_check="default"`` every recomputation compares the metadata of its
outputs against the forward's and raises :class:`CheckpointError` naming what
differed. With ``debug=True`` both runs also record the ATen operators they
executed, and the error shows the two traces side by side from the first
divergence.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CheckpointError", "set_checkpoint_debug_enabled"]

DETERMINISM_CHECKS = ("default", "none")


class CheckpointError(RuntimeError):
    """Raised where remat cannot give the right gradient: the message says what to do.

    For example when the recomputation does not reproduce the forward pass, or
    when a differentiable tensor cannot be routed:

        >>> import torch, funckpt
        >>> class Holder:
        ...     w = torch.ones(2, requires_grad=True)
        >>> try:
        ...     funckpt.remat(lambda x: x * Holder.w)(torch.ones(2))
        ... except funckpt.CheckpointError as e:
        ...     print("Pass the tensor" in str(e))
        True
    """


# --------------------------------------------------------------------------- debug


class _DebugState(threading.local):
    override: bool | None = None


_debug_state = _DebugState()


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Context manager that sets ``debug`` for every checkpoint inside it.

    ``True`` or ``False`` overrides the ``debug=`` argument of each call;
    ``None`` restores the per-call setting. Mirrors
    ``torch.utils.checkpoint.set_checkpoint_debug_enabled``.

    Example::

        >>> import torch, funckpt
        >>> with funckpt.set_checkpoint_debug_enabled(True):
        ...     y = funckpt.remat(torch.sin)(torch.ones(2, requires_grad=True))
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_checkpoint_debug_enabled: enabled must be a bool or None, got {enabled!r}")
    previous = _debug_state.override
    _debug_state.override = enabled
    try:
        yield
    finally:
        _debug_state.override = previous


def debug_enabled(requested: bool) -> bool:
    """The effective ``debug`` flag: the context manager's override wins."""
    override = _debug_state.override
    return requested if override is None else override


class OpTrace(TorchDispatchMode):
    """Records ``op -> output shapes`` for every ATen operator executed under it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        shapes = [
            f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
            for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor)
        ]
        self.lines.append(f"{func} -> {', '.join(shapes) or '()'}")
        return out


def format_traces(forward: Sequence[str], recompute: Sequence[str], context: int = 5) -> str:
    """Both operator traces, from a few lines before their first divergence."""
    first = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute)) if a != b),
        min(len(forward), len(recompute)),
    )
    start = max(0, first - context)
    lines = [f"operator traces (first divergence at operator #{first}):"]
    for title, trace in (("forward", forward), ("recomputation", recompute)):
        lines.append(f"  {title} ({len(trace)} operators):")
        lines += [f"    {i:4d}  {trace[i]}" for i in range(start, min(len(trace), first + context + 1))]
    return "\n".join(lines)


# --------------------------------------------------------------------- determinism


def tensor_meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device)


def graph_fingerprint(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[str]:
    """The autograd nodes between ``inputs`` and ``outputs``, by type, in a fixed traversal order.

    The walk stops at the inputs (their own history belongs to the caller) and
    leaves out leaf accumulators.

    Two runs of the same computation record the same graph; a recomputation
    that computes something else records another one even when its outputs
    have the same shapes (``torch.utils.checkpoint`` detects this through the
    tensors saved for backward; saved-tensor hooks are not available under
    ``torch.func``, so the graph itself serves).
    """
    names: list[str] = []
    seen: set[int] = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    stack = [t.grad_fn for t in reversed(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            continue
        names.append(node.name())
        stack.extend(n for n, _ in reversed(node.next_functions) if n is not None)
    return names


def check_same_graph(
    name: str,
    forward: Sequence[str],
    recomputed: Sequence[str],
    traces: tuple[Sequence[str], Sequence[str]] | None,
) -> None:
    if list(forward) == list(recomputed):
        return
    if len(forward) != len(recomputed):
        problem = (
            f"autograd recorded {len(forward)} operations in the forward pass, "
            f"{len(recomputed)} in the recomputation"
        )
    else:
        i = next(i for i, (a, b) in enumerate(zip(forward, recomputed)) if a != b)
        problem = f"autograd operation {i} was {forward[i]} in the forward pass, {recomputed[i]} in the recomputation"
    message = (
        f"remat({name}): the recomputation during the backward pass did not reproduce the forward pass: "
        f"{problem}. The function must compute the same thing when called again with the same inputs. "
        "Pass determinism_check='none' to skip this check."
    )
    if traces is not None:
        message += "\n" + format_traces(*traces)
    else:
        message += " Pass debug=True to see the operators each run executed."
    raise CheckpointError(message)


def check_same_outputs(
    name: str,
    forward_meta: Sequence[tuple[Any, ...]],
    recomputed: Sequence[torch.Tensor],
    traces: tuple[Sequence[str], Sequence[str]] | None,
) -> None:
    """Raise :class:`CheckpointError` if the recomputed outputs' metadata differ."""
    problems = []
    if len(forward_meta) != len(recomputed):
        problems.append(
            f"the forward pass returned {len(forward_meta)} tensors, the recomputation {len(recomputed)}"
        )
    for i, (meta, t) in enumerate(zip(forward_meta, recomputed)):
        for what, a, b in zip(("shape", "dtype", "device"), meta, tensor_meta(t)):
            if a != b:
                problems.append(f"output tensor {i}: {what} was {a} in the forward pass, {b} in the recomputation")
    if not problems:
        return
    message = (
        f"remat({name}): the recomputation during the backward pass did not reproduce the forward pass:\n  "
        + "\n  ".join(problems)
        + "\nThe function must compute the same thing when called again with the same inputs "
        "(no dependence on global state that changes between forward and backward). "
        "Pass determinism_check='none' to skip this check."
    )
    if traces is None:
        message += " Pass debug=True to see the operators each run executed."
    else:
        message += "\n" + format_traces(*traces)
    raise CheckpointError(message)
