"""remat under ``torch.compile``: the compiler's own checkpoint where it can, eager elsewhere.

Inside a function Dynamo is compiling, a remat'd call takes one of two paths.

* **Lowered** (no graph break): the call becomes
  ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``, which
  Dynamo traces into a ``tag_activation_checkpoint`` region of the graph;
  AOTAutograd's partitioner then recomputes the region's operators in the
  compiled backward instead of saving them, and a policy becomes a
  selective-checkpoint policy (``True`` -> ``MUST_SAVE``, ``False`` ->
  ``PREFER_RECOMPUTE``). The region is compiled and fused like the code around
  it, and ``fullgraph=True`` works. Taken when:

  - no ``torch.func`` transform is being traced around the call (the
    compiler's checkpoint uses saved-tensor hooks, which those refuse);
  - the policy decides by operator alone (``checkpoint_name`` tags are a
    funckpt mechanism the compiler does not see);
  - no ``context_fn`` and no ``debug`` (both are eager-mode features);
  - Dynamo's ``nested_graph_breaks`` is off (see :func:`_nested_graph_breaks`).

* **Eager** (a graph break): the call runs funckpt's eager remat, whose entry
  points are ``torch.compiler.disable``d (see ``_autograd.py``). Dynamo compiles
  the code before and after it; the region itself is not compiled. Everything
  works as without ``torch.compile``.

A lowered region that writes one of its inputs in place (an argument, a global,
a module buffer: BatchNorm's counter) is not lowered either: the compiler's
checkpoint recomputes it from the written value, a wrong gradient. The region
checks its own graph at trace time and, if so, graph-breaks on purpose.

A lowered region Dynamo cannot trace (say an op given an explicit
``torch.Generator``) must also end up eager, and not in ``torch.utils.checkpoint``
run eagerly, which does not replay explicit generators: Dynamo would graph-break
at the innermost frame that calls ``checkpoint`` and run that call as is. So the
frame that chooses, ``_call.call``, is :func:`skip_as_frame`: Dynamo inlines
it into a caller's graph, but when it must run a call of it on its own (after a
graph break) it runs it uncompiled, where ``torch.compiler.is_compiling()`` is
false and the eager path is taken.

Outside ``torch.compile`` none of this runs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ._errors import debug_enabled
from ._internals import StorageWeakRef, comptime, skip_code, storage_weak_ref, transforms_active
from .policies import FromTorch, Policy, lowerable

if TYPE_CHECKING:
    from ._options import RematOptions

__all__ = ["can_lower", "lowered_call", "skip_as_frame"]


def skip_as_frame(fn: Callable[..., Any]) -> None:
    """Dynamo may inline ``fn`` into a graph but never compiles a call of it on its own."""
    skip_code(fn.__code__)


def can_lower(options: RematOptions) -> bool:
    """Can this call, now being traced by Dynamo, become a compiled checkpoint region?"""
    return (
        options.context_fn is None
        and not debug_enabled(options.debug)
        # Not a policy that uses names, offloads, or chooses per call (a memory budget).
        and (options.policy is None or lowerable(options.policy))
        and not _nested_graph_breaks()
        # Last: Dynamo records this call in the graph rather than folding it.
        and not transforms_active()
    )


def _nested_graph_breaks() -> bool:
    """Is Dynamo's ``nested_graph_breaks`` setting on (torch >= 2.13, experimental)?

    With it, a graph break inside a lowered region (an explicit generator, a write of
    an input) resumes inside :func:`lowered_call`'s frame and runs
    ``torch.utils.checkpoint`` eagerly, instead of funckpt's eager remat: a generator's
    draws are not replayed (a wrong gradient), an input written is recomputed from or
    refused by its version check. Every call is then an eager region.
    """
    return bool(getattr(torch._dynamo.config, "nested_graph_breaks", False))


def _selective(policy: Policy) -> Callable[..., CheckpointPolicy]:
    # A from_torch policy: what torch.utils.checkpoint would be given. Dynamo must
    # hold the context_fn as a constant, which it cannot with a closure over the
    # frozen FromTorch value (fullgraph=True failed with "Not a Python constant").
    source = getattr(policy, "source", None) if isinstance(policy, FromTorch) else None
    if isinstance(source, tuple):
        return _from_torch_ops(source)
    if source is not None:
        return _from_torch_source(source)
    # An operator policy's plain predicate: Dynamo inlines a module-level function
    # more readily than the frozen value's __call__.
    policy = getattr(policy, "decide", policy)

    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if policy(op, *args, **kwargs) else CheckpointPolicy.PREFER_RECOMPUTE

    return torch_policy


def _from_torch_ops(ops: tuple[Any, ...]) -> Callable[..., CheckpointPolicy]:
    # Operators or their packets, as FromTorch.__call__ matches them.
    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        saved = op in ops or getattr(op, "overloadpacket", None) in ops
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return torch_policy


_TORCH_VERDICTS = (
    CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE,
)


def _from_torch_source(source: Callable[..., Any]) -> Callable[..., CheckpointPolicy]:
    # A bool answer (which from_torch accepts) as the compiler's policy value.
    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        verdict = source(ctx, op, *args, **kwargs)
        if verdict is True:
            return CheckpointPolicy.MUST_SAVE
        if verdict is False:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if verdict in _TORCH_VERDICTS:
            return cast(CheckpointPolicy, verdict)
        return CheckpointPolicy.MUST_SAVE  # an offload answer: kept on the device here (see lowerable)

    return torch_policy


def lowered_call(fn: Callable[..., Any], options: RematOptions, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` as the compiler's checkpoint region (see the module docstring)."""
    extra: dict[str, Any] = {}
    if options.policy is not None:
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective(options.policy))
    n, names = len(args), tuple(kwargs)

    def region(*flat: Any) -> Any:
        # All arguments positional: checkpoint() would take a keyword of fn's that
        # shares a name with one of its own (debug, context_fn, ...) for itself.
        out = fn(*flat[:n], **dict(zip(names, flat[n:])))
        comptime(_fall_back_if_an_input_was_written)
        return out

    return checkpoint(
        region,
        *args,
        *kwargs.values(),
        use_reentrant=False,
        preserve_rng_state=options.preserve_rng_state,
        determinism_check=options.determinism_check,
        **extra,
    )


_IN_PLACE_OPERATORS = frozenset(
    {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
     operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
     operator.irshift, operator.imatmul}
)


def _writes(node: torch.fx.Node) -> bool:
    """Is this node of a Dynamo graph named like an in-place write of its first argument?"""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in _IN_PLACE_OPERATORS:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.startswith("__i") and name.endswith("__"):  # x.__iadd__(1)
        return True
    return name.endswith("_") and (not name.startswith("_") or name.startswith("_foreach_")) and name != "requires_grad_"


def _storage(value: Any) -> StorageWeakRef | None:
    if isinstance(value, torch.Tensor):
        return storage_weak_ref(value.untyped_storage())
    return None


def _input_written(graph: torch.fx.Graph) -> bool:
    """Did the traced region write one of its inputs (graph placeholders) in place?

    Two independent signals, either suffices: the placeholders' fake values
    carry version counters, which in-place operators (through views and ``out=``
    too) bump while Dynamo traces them; and nodes named like in-place writes
    whose first argument (or list of arguments) shares storage with an input.
    """
    placeholders = [n.meta.get("example_value") for n in graph.nodes if n.op == "placeholder"]
    if any(isinstance(v, torch.Tensor) and v._version > 0 for v in placeholders):
        return True
    inputs = {_storage(v) for v in placeholders} - {None}
    for node in graph.nodes:
        if not (_writes(node) and node.args):
            continue
        first = node.args[0]
        targets = first if isinstance(first, (list, tuple)) else [first]
        for target in targets:
            if isinstance(target, torch.fx.Node) and _storage(target.meta.get("example_value")) in inputs:
                return True
    return False


def _fall_back_if_an_input_was_written(ctx: Any) -> None:
    """At trace time, end of a lowered region: did it write one of its inputs in place?

    The region's inputs here are its arguments and every tensor it reads from
    outside (closures, globals, module state), which Dynamo lifts into inputs.
    The compiler's checkpoint recomputes such a region from the inputs as they
    are after the write, which gives a wrong gradient; funckpt's eager remat
    snapshots them (or raises). A graph break here makes Dynamo give up on the
    region, and the call runs eagerly (see the module docstring).
    """
    try:
        written = _input_written(ctx.graph())
    except Exception:  # a Dynamo internal changed: be safe, run the region eagerly
        written = True
    if written:
        ctx.graph_break("funckpt: the remat'd region writes one of its inputs in place; it runs eagerly")
