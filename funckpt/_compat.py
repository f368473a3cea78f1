"""A drop-in for ``torch.utils.checkpoint`` that also works under ``torch.func``.

``funckpt.checkpoint`` and ``funckpt.checkpoint_sequential`` take the same
arguments as PyTorch's and give the same results and gradients, under
``.backward()`` and under every ``torch.func`` transform, where PyTorch's
raise. ``use_reentrant`` is accepted for compatibility only: both values run
the same implementation (``remat``), which has the non-reentrant variant's
features (keyword arguments, ``context_fn``, ``debug``, nesting, and inputs
that need no grad) and composes with ``torch.func``. It is therefore never
required, and leaving it unset does not warn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as upstream

from ._modules import run_in_segments
from ._call import call
from ._options import RematOptions
from .policies import Policy, from_torch

__all__ = ["checkpoint", "checkpoint_sequential", "noop_context_fn"]


def noop_context_fn() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """The default ``context_fn``: two context managers that do nothing.

        >>> forward_context, recompute_context = noop_context_fn()
        >>> with forward_context:
        ...     pass
    """
    return contextlib.nullcontext(), contextlib.nullcontext()


def _is_noop(context_fn: Callable[..., Any]) -> bool:
    return context_fn is noop_context_fn or context_fn is upstream.noop_context_fn


def _options(
    use_reentrant: bool | None,
    context_fn: Callable[[], tuple[Any, Any]],
    determinism_check: str,
    debug: bool,
    preserve_rng_state: bool,
) -> RematOptions:
    if not (use_reentrant is None or use_reentrant is True or use_reentrant is False):
        raise TypeError(f"checkpoint: use_reentrant must be None, True or False, got {use_reentrant!r}")
    if not callable(context_fn):
        raise TypeError(f"checkpoint: context_fn must be callable, got {context_fn!r}")
    policy = _selective_policy(context_fn)
    return RematOptions(
        policy=policy,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        context_fn=None if policy is not None or _is_noop(context_fn) else context_fn,
    )


def _selective_policy(context_fn: Callable[..., Any]) -> Policy | None:
    """The policy in ``partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, ...)``.

    That is how PyTorch users ask for selective checkpointing; PyTorch's own
    caching modes depend on its checkpoint internals, so funckpt reads the
    policy out of the partial and applies it with its own machinery.
    """
    if not (isinstance(context_fn, functools.partial) and context_fn.func is upstream.create_selective_checkpoint_contexts):
        return None
    bound = inspect.signature(upstream.create_selective_checkpoint_contexts).bind(*context_fn.args, **context_fn.keywords)
    bound.apply_defaults()
    policy = from_torch(bound.arguments["policy_fn_or_list"])
    return dataclasses.replace(
        policy, allow_cache_entry_mutation=bool(bound.arguments.get("allow_cache_entry_mutation", False))
    )


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint one call of ``function(*args, **kwargs)``, like ``torch.utils.checkpoint.checkpoint``.

    Between forward and backward only the inputs are kept; the backward pass
    recomputes ``function``. Unlike PyTorch's, this works under
    ``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian`` and the rest.

    Without ``function`` (and arguments), it returns a decorator, as PyTorch's does from
    2.14: ``@checkpoint(use_reentrant=False)`` checkpoints every call of the function or
    method it decorates.

    ``early_stop`` is accepted as PyTorch's checkpoint accepts it, and is not passed on to
    ``function``; the recomputation always runs to the end here (its outputs are where the
    backward pass starts from, and what the determinism check compares).

    ``respect_saved_tensors_hooks=True`` (PyTorch >= 2.14's): the values a selective
    ``context_fn`` keeps go through the ``torch.autograd.graph.saved_tensors_hooks`` the
    call is made under (``save_on_cpu``, ...), packed at the end of the forward run and
    unpacked for the recomputation. ``None`` and ``False`` keep them as they are.

    Example::

        >>> import torch, torch.func as tf, funckpt
        >>> w = torch.randn(3, 3)
        >>> g = tf.grad(lambda w: funckpt.checkpoint(torch.tanh, w, use_reentrant=False).sum())(w)
        >>> torch.testing.assert_close(g, 1 - torch.tanh(w) ** 2)
    """
    if not (early_stop is True or early_stop is False):
        raise TypeError(f"checkpoint: early_stop must be True or False, got {early_stop!r}")
    if not (respect_saved_tensors_hooks is None or isinstance(respect_saved_tensors_hooks, bool)):
        raise TypeError(
            f"checkpoint: respect_saved_tensors_hooks must be None, True or False, got {respect_saved_tensors_hooks!r}"
        )
    options = _options(use_reentrant, context_fn, determinism_check, debug, preserve_rng_state)
    if respect_saved_tensors_hooks:
        options = dataclasses.replace(options, respect_saved_tensors_hooks=True)
    if function is None and not args:
        if kwargs:
            raise ValueError(
                "checkpoint: without a function it makes a decorator, which takes no keyword arguments "
                f"for the function: got {', '.join(sorted(kwargs))}"
            )
        return functools.partial(_checkpointed, options=options)
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {function!r}")
    return call(function, options, args, kwargs)


def _checkpointed(function: Callable[..., Any], *, options: RematOptions) -> Callable[..., Any]:
    """``function`` with every call checkpointed (``checkpoint``'s decorator form).

    A plain function, so decorating a method binds ``self`` as for any function; a module
    stays the module it is (its calls are checkpointed, as ``checkpoint(module, x)`` would)."""
    if not callable(function):
        raise TypeError(f"checkpoint: the decorated object must be callable, got {function!r}")

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return call(function, options, args, kwargs)

    functools.update_wrapper(checkpointed, function, updated=())  # (not a module's __dict__)
    return checkpointed


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` in sequence, checkpointing all but the last of ``segments`` chunks.

    Same arguments as ``torch.utils.checkpoint.checkpoint_sequential``
    (``functions`` an ``nn.Sequential`` or a list of modules or functions;
    keyword arguments ``preserve_rng_state``, ``context_fn``,
    ``determinism_check``, ``debug``), and it works under ``torch.func``.

    Example::

        >>> import torch, funckpt
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> y = funckpt.checkpoint_sequential(net, 2, torch.randn(2, 4), use_reentrant=False)
    """
    unknown = set(kwargs) - {"preserve_rng_state", "context_fn", "determinism_check", "debug"}
    if unknown:
        raise ValueError(f"checkpoint_sequential: unexpected keyword arguments: {', '.join(sorted(unknown))}")
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"checkpoint_sequential: segments must be a positive int, got {segments!r}")
    layers: list[Any] = [None]  # (refused below, unless one of the kinds accepted)
    if isinstance(functions, torch.nn.Sequential):
        layers = list(functions.children())
    elif isinstance(functions, (list, tuple, torch.nn.ModuleList)):
        layers = list(functions)
    if not all(callable(f) for f in layers):
        raise TypeError(
            f"checkpoint_sequential: functions must be an nn.Sequential or a list of callables, got {functions!r}"
        )
    options = _options(
        use_reentrant,
        kwargs.get("context_fn", noop_context_fn),
        kwargs.get("determinism_check", "default"),
        kwargs.get("debug", False),
        kwargs.get("preserve_rng_state", True),
    )
    return run_in_segments(layers, segments, input, options, checkpoint_last=False)
