"""``remat``: the user-facing transform.

``remat(fn)`` returns a function with the same values and gradients as ``fn``
that, between the forward and the backward pass, keeps only its tensor inputs
(and whatever a saving policy keeps) and recomputes everything else during the
backward pass, under plain autograd and every ``torch.func`` transform.

This module validates the options (``_options.py``) and wraps ``fn``: a module
becomes an ``nn.Module`` (``_modules.py``), anything else a function whose every
call is one checkpointed call (``_call.py``). ARCHITECTURE.md walks one call
through the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast, overload

import torch

from ._call import call
from ._internals import class_forward
from ._modules import Remat, RematSequential
from ._options import RematOptions, normalize_static_argnums
from .policies import Policy

__all__ = ["remat"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def remat(
    fn: F,
    /,
    *,
    policy: Policy | None = ...,
    static_argnums: int | Sequence[int] = ...,
    preserve_rng_state: bool = ...,
    determinism_check: str = ...,
    debug: bool = ...,
    context_fn: Callable[[], tuple[Any, Any]] | None = ...,
    segments: int | None = ...,
) -> F: ...
@overload
def remat(
    fn: None = None,
    /,
    *,
    policy: Policy | None = ...,
    static_argnums: int | Sequence[int] = ...,
    preserve_rng_state: bool = ...,
    determinism_check: str = ...,
    debug: bool = ...,
    context_fn: Callable[[], tuple[Any, Any]] | None = ...,
    segments: int | None = ...,
) -> Callable[[F], F]: ...


def remat(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    policy: Policy | None = None,
    static_argnums: int | Sequence[int] = (),
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    segments: int | None = None,
) -> Any:
    """Checkpoint ``fn``: keep only its inputs, recompute the rest in the backward pass.

    ``remat`` (rematerialization, ``jax.checkpoint``'s other name) trades compute
    for memory. A remat'd call runs ``fn`` without recording anything for the
    backward pass except its tensor inputs; when gradients are needed, ``fn`` is
    run again to rebuild what the backward pass needs, one remat'd call at a
    time. Values and gradients are those of ``fn`` under ``torch.func.grad``,
    ``grad_and_value``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``, ``hessian``,
    ``vmap``, ``functional_call``, any nesting of those, and plain autograd.

    Arguments and results are pytrees (optree): tensor leaves are inputs and
    outputs, other leaves pass through unchanged, and ``static_argnums`` marks
    positional arguments passed through whole. Tensors ``fn`` reaches without
    receiving them (module parameters, closure cells, ``functools.partial``
    arguments, globals) get their gradients too; one remat cannot route raises
    :class:`~funckpt.CheckpointError` instead of silently getting none.

    Inside ``torch.compile``, a call with no policy or an operator-based one is
    compiled as the compiler's own checkpoint region; any other runs eagerly
    between two graphs (see the README's "Under torch.compile").

    Example::

        >>> import torch, funckpt
        >>> def block(w, x):
        ...     return torch.tanh(x @ w) @ w.T
        >>> w, x = torch.randn(8, 8), torch.randn(4, 8)
        >>> loss = lambda w, x: funckpt.remat(block)(w, x).square().sum()
        >>> g = torch.func.grad(loss)(w, x)        # recomputes block's tanh
        >>> torch.testing.assert_close(g, torch.func.grad(lambda w, x: block(w, x).square().sum())(w, x))

    Args:
        fn: the function (or ``nn.Module``) to checkpoint. ``remat`` also works
            as a bare decorator ``@remat`` or with options ``@remat(...)``.
        policy: which intermediate results to save instead of recomputing
            (see :mod:`funckpt.policies`); ``None`` saves nothing.
        static_argnums: positional arguments passed through untouched.
        preserve_rng_state: replay random ops exactly during recomputation.
        determinism_check: ``"default"`` checks that the recomputation returns
            tensors of the same shape, dtype and device; ``"none"`` skips it.
        debug: record the operators of both runs and show them in errors.
        context_fn: returns two context managers, wrapping the forward run and
            the recomputation.
        segments: for an ``nn.Sequential``, how many checkpointed segments.

    Returns:
        The checkpointed function, with ``fn``'s ``__name__``, ``__doc__`` and
        ``__wrapped__``.
    """
    options = RematOptions(
        policy=policy,
        static_argnums=normalize_static_argnums(static_argnums),
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        context_fn=context_fn,
        segments=segments,
    )
    if fn is None:
        return functools.partial(_decorate, options=options)
    return _decorate(fn, options=options)


def _decorate(fn: Callable[..., Any], *, options: RematOptions) -> Any:
    if not callable(fn):
        raise TypeError(f"remat: fn must be callable (a function or an nn.Module), got {fn!r}")
    if isinstance(fn, type) and issubclass(fn, torch.nn.Module):
        raise TypeError(
            f"remat: fn is the class {fn.__name__}, not a module: remat an instance, "
            f"for example remat({fn.__name__}(...))"
        )
    if isinstance(fn, torch.nn.Module) and class_forward(fn) is torch.nn.Module.forward and "forward" not in vars(fn):
        # (torch.compile's OptimizedModule sets its forward on the instance)
        # A container (ModuleList, ModuleDict): the wrapper would be neither callable nor iterable.
        raise TypeError(
            f"remat: fn is a {type(fn).__name__}, which has no forward to checkpoint: remat its "
            f"modules instead, for example [remat(m) for m in modules]"
        )
    # (By type: a remat'd module is an instance of its module's class, and remat of a wrapper wraps it whole.)
    # A subclass with a forward of its own (a residual stage, timm's dense stages, torchvision's
    # ASPPPooling) is checkpointed whole, as any module: its forward is what the module computes.
    sequential = (
        issubclass(type(fn), torch.nn.Sequential)
        and class_forward(cast(torch.nn.Module, fn)) is torch.nn.Sequential.forward
        and "forward" not in vars(fn)
    )
    if options.segments is not None and not sequential:
        raise ValueError(
            f"remat: segments applies to an nn.Sequential only, whose forward runs its layers in order "
            f"(a subclass with a forward of its own is checkpointed whole), got segments={options.segments} "
            f"for {type(fn).__name__}"
        )
    if sequential:
        return RematSequential(cast(torch.nn.Sequential, fn), options)
    if isinstance(fn, torch.nn.Module):
        return Remat(fn, options)

    def remat_wrapper(*args: Any, **kwargs: Any) -> Any:
        return call(fn, options, args, kwargs)

    try:
        functools.update_wrapper(remat_wrapper, fn)
    except AttributeError:  # pragma: no cover - exotic callables
        remat_wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return remat_wrapper
