"""The validated options of :func:`~funckpt.remat`, checked once at decoration time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ._errors import DETERMINISM_CHECKS
from .policies import Policy, is_policy_factory

__all__ = ["RematOptions", "callable_name", "check_static_argnums", "normalize_static_argnums"]


@dataclass(frozen=True)
class RematOptions:
    """The validated keyword arguments of :func:`remat`."""

    policy: Policy | None = None
    static_argnums: tuple[int, ...] = ()
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    segments: int | None = None
    # checkpoint's respect_saved_tensors_hooks (torch >= 2.14): values a policy keeps go
    # through the caller's saved-tensor hooks, as the tensors autograd saves do.
    respect_saved_tensors_hooks: bool = False

    def __post_init__(self) -> None:
        if self.policy is not None and not callable(self.policy):
            raise TypeError(
                f"remat: policy must be a callable policy(op, *args, **kwargs) -> bool "
                f"(see funckpt.policies) or None, got {self.policy!r}"
            )
        if is_policy_factory(self.policy):
            name = self.policy.__name__  # type: ignore[union-attr]
            raise TypeError(
                f"remat: policy=policies.{name} makes a policy, it is not one: call it, "
                f"for example policy=policies.{name}(...)"
            )
        if not isinstance(self.preserve_rng_state, bool):
            raise TypeError(f"remat: preserve_rng_state must be a bool, got {self.preserve_rng_state!r}")
        if self.determinism_check not in DETERMINISM_CHECKS:
            raise ValueError(
                f"remat: determinism_check must be one of {DETERMINISM_CHECKS}, got {self.determinism_check!r}"
            )
        if not isinstance(self.debug, bool):
            raise TypeError(f"remat: debug must be a bool, got {self.debug!r}")
        if self.context_fn is not None and not callable(self.context_fn):
            raise TypeError(
                f"remat: context_fn must be a callable returning two context managers, got {self.context_fn!r}"
            )
        if self.segments is not None and (
            isinstance(self.segments, bool) or not isinstance(self.segments, int) or self.segments < 1
        ):
            raise ValueError(f"remat: segments must be a positive int or None, got {self.segments!r}")


def normalize_static_argnums(static_argnums: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        return (static_argnums,)
    try:
        items = tuple(cast("Iterable[int]", static_argnums))  # a bool raises TypeError here
    except TypeError:
        items = None
    if items is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise TypeError(f"remat: static_argnums must be an int or a sequence of ints, got {static_argnums!r}")
    return items


def callable_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__



def check_static_argnums(name: str, options: RematOptions, args: tuple[Any, ...]) -> tuple[int, ...]:
    """``static_argnums`` as non-negative positions, or a clear error if one is out of range."""
    static = []
    for i in options.static_argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(
                f"remat({name}): static_argnums={options.static_argnums} names argument {i}, "
                f"but the function was called with {len(args)} positional arguments"
            )
        static.append(i % len(args))
    return tuple(static)
