"""Saving policies: which intermediate results ``remat`` keeps instead of recomputing.

By default a remat'd function keeps only its inputs and recomputes everything
else in the backward pass. A *policy* trades some of that memory back for
compute: it is called once per ATen operator during the forward run, as
``policy(op, *args, **kwargs)`` with the ``OpOverload`` and its arguments, and
returns ``True`` to keep that operator's outputs, or :data:`Offload` to keep them
in host memory between the passes (:func:`offload_dot_with_no_batch_dims`,
:func:`save_and_offload_only_these_names`). Kept outputs are not computed
again: during recomputation the operator returns its cached result (autograd
still records it, so gradients are exact). Everything else is recomputed.
:func:`memory_budget` chooses per call, from estimated costs and sizes, within a
fraction of what :data:`everything_saveable` would keep.

Policies are predicates; the ones here are small frozen values with a readable
``repr`` that say whether names matter to them (:class:`SavingPolicy`), and
any plain function with the same signature is a policy too::

    >>> import torch, funckpt
    >>> from funckpt import policies
    >>> def block(w, x):
    ...     h = funckpt.checkpoint_name(torch.tanh(x @ w), "hidden")
    ...     return (h @ w.T).relu()
    >>> w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
    >>> y = funckpt.remat(block, policy=policies.dots_saveable)(w, x)       # keep matmuls
    >>> y = funckpt.remat(block, policy=policies.save_only_these_names("hidden"))(w, x)
    >>> y = funckpt.remat(block, policy=lambda op, *args, **kwargs: op is torch.ops.aten.mm.default)(w, x)

Names. ``checkpoint_name(x, name)`` returns ``x`` and, inside a remat'd
function, asks the policy about ``(CHECKPOINT_NAME, x, name)``; if it answers
``True`` the operator that produced ``x`` is kept. Names add saved values; the
one policy that removes them is :func:`save_anything_except_these_names`, whose
excluded names override its own "save everything".

Never kept, whatever the policy says: random operators (they are replayed from
the recorded generator state instead, so later random draws stay in step) and
operators whose outputs alias their inputs (views and in-place updates, which
are cheap to redo).

This mirrors ``jax.checkpoint_policies``; :func:`from_torch` adapts a
``torch.utils.checkpoint`` selective-checkpointing policy.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import optree
import torch

from ._internals import OpOverload, OpOverloadPacket, define_operator
from ._naming import note_name

__all__ = [
    "CHECKPOINT_NAME",
    "Offload",
    "Offloadable",
    "Policy",
    "SavingPolicy",
    "checkpoint_name",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "from_torch",
    "memory_budget",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_and_offload_only_these_names",
    "save_from_both_policies",
    "save_only_these_names",
]

#: Where a kept value may live: JAX's memory kinds.
OFFLOAD_SOURCES = ("device",)
OFFLOAD_DESTINATIONS = ("pinned_host", "unpinned_host")


@dataclass(frozen=True, repr=False)
class Offloadable:
    """A policy's third answer: keep the output, but in host memory between the passes.

    ``Offload`` is the usual value (from device memory to pinned host memory);
    ``Offloadable(src, dst)`` names other memory kinds, as JAX's
    ``Offloadable`` does. A CPU tensor is already in host memory: it is simply kept.

        >>> Offload
        policies.Offload
        >>> Offloadable("device", "unpinned_host")
        policies.Offloadable(src='device', dst='unpinned_host')
    """

    src: str = "device"
    dst: str = "pinned_host"

    def __post_init__(self) -> None:
        _check_memory_kind("Offloadable", "src", self.src, OFFLOAD_SOURCES)
        _check_memory_kind("Offloadable", "dst", self.dst, OFFLOAD_DESTINATIONS)

    @property
    def pinned(self) -> bool:
        return self.dst == "pinned_host"

    def __repr__(self) -> str:
        if self == Offloadable():
            return "policies.Offload"
        return f"policies.Offloadable(src={self.src!r}, dst={self.dst!r})"


def _check_memory_kind(who: str, arg: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{who}: {arg} must be a string, one of {allowed}, got {value!r}")
    if value not in allowed:
        raise ValueError(f"{who}: {arg} must be one of {allowed}, got {value!r}")


#: Returned by a policy: keep that operator's outputs in (pinned) host memory between the passes.
Offload = Offloadable()

#: What a policy returns: True (keep), False (recompute) or an :class:`Offloadable` (keep on the host).
Verdict = bool | Offloadable
Policy = Callable[..., Verdict]
T = TypeVar("T")

aten = torch.ops.aten

_lib = define_operator(
    "funckpt",
    "checkpoint_name(Tensor x, str name) -> Tensor",
    "checkpoint_name",
    lambda x, name: x.clone(),
    "CompositeExplicitAutograd",
)

#: The operator a policy is asked about for a :func:`checkpoint_name`, with args ``(x, name)``:
#: ``policy(CHECKPOINT_NAME, x, "hidden")``. A policy compares ``op is CHECKPOINT_NAME``.
CHECKPOINT_NAME = torch.ops.funckpt.checkpoint_name.default


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


_DOTS_NO_BATCH = _packets(
    "mm", "addmm", "_addmm_activation", "mv", "addmv", "dot", "vdot", "linear", "_int_mm", "_scaled_mm"
)
_DOTS = _DOTS_NO_BATCH | _packets(
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "einsum",
    "tensordot",
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "mkldnn_convolution",
    "cudnn_convolution",
    "miopen_convolution",
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _everything_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep every operator's outputs: no recomputation at all (the most memory).

        >>> import torch
        >>> _everything_saveable(torch.ops.aten.sin.default)
        True
    """
    return True


def _nothing_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep nothing but the inputs; recompute everything (the default, the least memory).

        >>> import torch
        >>> _nothing_saveable(torch.ops.aten.mm.default)
        False
    """
    return False


def _dots_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep the results of matrix multiplies (every ATen form), convolutions and attention.

    Recomputation then redoes only the cheap elementwise work around them.

        >>> import torch
        >>> _dots_saveable(torch.ops.aten.bmm.default), dots_saveable(torch.ops.aten.gelu.default)
        (True, False)
    """
    return getattr(op, "overloadpacket", None) in _DOTS


def _dots_with_no_batch_dims_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep the results of matrix multiplies without batch dimensions (``mm``, ``addmm``, ``mv``, ...).

    Batched products (``bmm``, attention scores) are recomputed, as in JAX. A
    ``bmm`` whose batch has one element is a product without batch dimensions:
    torch lowers ``einsum('ij,jk->ik', a, b)`` to one, and JAX keeps it.

        >>> import torch
        >>> _dots_with_no_batch_dims_saveable(torch.ops.aten.mm.default)
        True
        >>> _dots_with_no_batch_dims_saveable(torch.ops.aten.bmm.default, torch.ones(4, 2, 2), torch.ones(4, 2, 2))
        False
        >>> _dots_with_no_batch_dims_saveable(torch.ops.aten.bmm.default, torch.ones(1, 2, 3), torch.ones(1, 3, 2))
        True
    """
    packet = getattr(op, "overloadpacket", None)
    if packet in _DOTS_NO_BATCH:
        return True
    if packet in _SINGLE_BATCH_DOTS:
        # bmm(a, b) / baddbmm(c, a, b): the batch is the leading dimension of the matrices.
        matrices = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 3]
        return bool(matrices) and all(a.shape[0] == 1 for a in matrices)
    return False


_SINGLE_BATCH_DOTS = _packets("bmm", "baddbmm")


# ------------------------------------------------------------------ policy values


@dataclass(frozen=True, repr=False)
class SavingPolicy:
    """A policy as a small frozen value: ``policy(op, *args, **kwargs) -> bool``, plus what remat asks of it.

    ``uses_names``: can naming a value (``checkpoint_name``) change what it keeps?
    (If not, remat need not track which operator produced each value, and under
    ``torch.compile`` the region can be lowered.) ``excluded_names``: names whose
    values it refuses to keep even where it keeps everything else. Plain
    callables are policies too; for them remat assumes names matter.
    """

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Verdict:
        raise NotImplementedError

    @property
    def uses_names(self) -> bool:
        return True

    @property
    def excluded_names(self) -> frozenset[str]:
        return frozenset()

    @property
    def lowerable(self) -> bool:
        """Can ``torch.compile``'s checkpoint region (a per-operator save-or-recompute choice) apply it?"""
        return not self.uses_names


@dataclass(frozen=True, repr=False)
class OperatorPolicy(SavingPolicy):
    """Decides by operator alone (``dots_saveable`` and kin)."""

    name: str
    decide: Callable[..., bool]

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return self.decide(op, *args, **kwargs)

    @property
    def uses_names(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"policies.{self.name}"


everything_saveable = OperatorPolicy("everything_saveable", _everything_saveable)
nothing_saveable = OperatorPolicy("nothing_saveable", _nothing_saveable)
dots_saveable = OperatorPolicy("dots_saveable", _dots_saveable)
dots_with_no_batch_dims_saveable = OperatorPolicy("dots_with_no_batch_dims_saveable", _dots_with_no_batch_dims_saveable)


def uses_names(policy: Policy) -> bool:
    """Can naming a value (``checkpoint_name``) change what ``policy`` keeps?"""
    return bool(getattr(policy, "uses_names", True))


def _names(names: Iterable[Any], who: str) -> frozenset[str]:
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{who}: names must be strings, got {bad!r}")
    return frozenset(names)


def save_only_these_names(*names: str) -> Policy:
    """Keep only the values tagged by :func:`checkpoint_name` with one of ``names``.

        >>> import torch
        >>> policy = save_only_these_names("hidden")
        >>> policy(CHECKPOINT_NAME, torch.ones(1), "hidden"), policy(CHECKPOINT_NAME, torch.ones(1), "other")
        (True, False)
    """
    return SaveOnlyTheseNames(_names(names, "save_only_these_names"))


def save_any_names_but_these(*names: str) -> Policy:
    """Keep every value tagged by :func:`checkpoint_name` except those with one of ``names``.

        >>> import torch
        >>> policy = save_any_names_but_these("big")
        >>> policy(CHECKPOINT_NAME, torch.ones(1), "small"), policy(CHECKPOINT_NAME, torch.ones(1), "big")
        (True, False)
    """
    return SaveAnyNamesButThese(_names(names, "save_any_names_but_these"))


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep everything (like :func:`everything_saveable`) except the values named with ``names``.

        >>> import torch
        >>> policy = save_anything_except_these_names("big")
        >>> policy(torch.ops.aten.mm.default), policy(CHECKPOINT_NAME, torch.ones(1), "big")
        (True, False)
    """
    return SaveAnythingExceptTheseNames(_names(names, "save_anything_except_these_names"))


def save_from_both_policies(policy_1: Policy, policy_2: Policy) -> Policy:
    """Keep what either policy keeps.

        >>> import torch
        >>> policy = save_from_both_policies(dots_saveable, save_only_these_names("hidden"))
        >>> policy(torch.ops.aten.mm.default), policy(CHECKPOINT_NAME, torch.ones(1), "hidden")
        (True, True)
    """
    for arg, p in (("policy_1", policy_1), ("policy_2", policy_2)):
        if not callable(p):
            raise TypeError(f"save_from_both_policies: {arg} must be a callable policy, got {p!r}")
        if is_policy_factory(p):
            raise TypeError(
                f"save_from_both_policies: {arg}=policies.{p.__name__} makes a policy, it is not one: "
                f"call it, for example policies.{p.__name__}(...)"
            )
        if budget_of(p) is not None:
            raise TypeError(
                f"save_from_both_policies: {arg} is {p!r}, which chooses among all of a call's values at "
                "once and cannot be combined; use it alone"
            )

    return SaveFromBothPolicies(policy_1, policy_2)


def excluded_names(policy: Policy) -> frozenset[str]:
    """Names whose values ``policy`` explicitly refuses to keep."""
    return frozenset(getattr(policy, "excluded_names", frozenset()))


def _keeps_by_operator(policy: Policy) -> bool:
    """Can ``policy`` keep a value for its operator alone (not only for its name)?"""
    if policy is nothing_saveable or isinstance(policy, (SaveOnlyTheseNames, SaveAnyNamesButThese, SaveAndOffloadNames)):
        return False
    if isinstance(policy, SaveFromBothPolicies):
        return _keeps_by_operator(policy.policy_1) or _keeps_by_operator(policy.policy_2)
    return True


def from_torch(policy_fn_or_list: Callable[..., Any] | Iterable[Any]) -> FromTorch:
    """Adapt a ``torch.utils.checkpoint`` selective-checkpointing policy.

    Accepts what ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
    accepts: a function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or
    bool), where ``MUST_SAVE``/``PREFER_SAVE`` keep the output and, where the
    installed torch has them, ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` keep it
    in host memory (:data:`Offload`), or a list of operators to keep
    (``OpOverload`` or ``OpOverloadPacket``).

        >>> import torch
        >>> from funckpt import policies
        >>> keep_mm = policies.from_torch([torch.ops.aten.mm])
        >>> keep_mm(torch.ops.aten.mm.default)
        True
    """
    if isinstance(policy_fn_or_list, (OpOverload, OpOverloadPacket)):  # callable, but an op, not a policy
        raise TypeError(
            f"from_torch: policy_fn_or_list is one operator ({policy_fn_or_list}); pass a list of operators to "
            f"keep, from_torch([{policy_fn_or_list}]), or a policy function (ctx, op, *args, **kwargs)"
        )
    if callable(policy_fn_or_list):
        return FromTorch(policy_fn_or_list)
    try:
        ops = list(policy_fn_or_list)
    except TypeError:
        raise TypeError(
            f"from_torch: expected a policy function or a list of ops, got {policy_fn_or_list!r}"
        ) from None
    bad = [op for op in ops if not isinstance(op, (OpOverload, OpOverloadPacket))]
    if bad:
        raise TypeError(f"from_torch: the list must hold OpOverload or OpOverloadPacket objects, got {bad!r}")
    return FromTorch(tuple(ops))


@dataclass(frozen=True, repr=False)
class _NamePolicy(SavingPolicy):
    names: frozenset[str]

    def __repr__(self) -> str:
        factory = {
            "SaveOnlyTheseNames": "save_only_these_names",
            "SaveAnyNamesButThese": "save_any_names_but_these",
            "SaveAnythingExceptTheseNames": "save_anything_except_these_names",
        }[type(self).__name__]
        return f"policies.{factory}({', '.join(repr(n) for n in sorted(self.names))})"


@dataclass(frozen=True, repr=False)
class SaveOnlyTheseNames(_NamePolicy):
    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is CHECKPOINT_NAME and args[1] in self.names


@dataclass(frozen=True, repr=False)
class SaveAnyNamesButThese(_NamePolicy):
    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is CHECKPOINT_NAME and args[1] not in self.names


@dataclass(frozen=True, repr=False)
class SaveAnythingExceptTheseNames(_NamePolicy):
    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return args[1] not in self.names if op is CHECKPOINT_NAME else True

    @property
    def excluded_names(self) -> frozenset[str]:
        return self.names


@dataclass(frozen=True, repr=False)
class SaveFromBothPolicies(SavingPolicy):
    policy_1: Policy
    policy_2: Policy

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Verdict:
        # Saving beats offloading beats recomputing.
        first = self.policy_1(op, *args, **kwargs)
        if first and not isinstance(first, Offloadable):
            return True
        second = self.policy_2(op, *args, **kwargs)
        if second and not isinstance(second, Offloadable):
            return True
        for verdict in (first, second):
            if isinstance(verdict, Offloadable):
                return verdict
        return False

    @property
    def uses_names(self) -> bool:
        return uses_names(self.policy_1) or uses_names(self.policy_2)

    @property
    def excluded_names(self) -> frozenset[str]:
        # A named value is refused where every part that keeps values by operator refuses it:
        # a part that keeps only named values (nothing_saveable, save_only_these_names, ...)
        # must not bring back what the other part excludes.
        parts = [p for p in (self.policy_1, self.policy_2) if _keeps_by_operator(p)]
        if not parts:
            return frozenset()
        return frozenset.intersection(*(excluded_names(p) for p in parts))

    @property
    def lowerable(self) -> bool:
        return lowerable(self.policy_1) and lowerable(self.policy_2)

    def __repr__(self) -> str:
        return f"policies.save_from_both_policies({self.policy_1!r}, {self.policy_2!r})"


@dataclass(frozen=True, repr=False)
class FromTorch(SavingPolicy):
    """A ``torch.utils.checkpoint`` selective policy: a function ``(ctx, op, ...)`` or a tuple of ops."""

    source: Callable[..., Any] | tuple[Any, ...]
    # torch's option to serve a kept value modified in place since; accepted, and moot here:
    # such a value is never served, its operator runs again.
    allow_cache_entry_mutation: bool = False

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Verdict:
        if op is CHECKPOINT_NAME:
            return False
        if isinstance(self.source, tuple):
            return op in self.source or getattr(op, "overloadpacket", None) in self.source
        from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

        verdict = self.source(SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)
        if isinstance(verdict, bool):
            return verdict
        if verdict in _TORCH_OFFLOAD:
            return Offload
        return verdict in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    @property
    def uses_names(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"policies.from_torch({self.source!r})"


def _torch_offload_values() -> frozenset[Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    return frozenset(getattr(CheckpointPolicy, n) for n in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD") if hasattr(CheckpointPolicy, n))


_TORCH_OFFLOAD = _torch_offload_values()


# ------------------------------------------------------------------ offloading


def _offload_kinds(who: str, src: Any, dst: Any) -> Offloadable:
    _check_memory_kind(who, "offload_src", src, OFFLOAD_SOURCES)
    _check_memory_kind(who, "offload_dst", dst, OFFLOAD_DESTINATIONS)
    kind = Offloadable(src, dst)
    return Offload if kind == Offload else kind  # so that `verdict is Offload` holds for the usual kind


@dataclass(frozen=True, repr=False)
class OffloadDots(SavingPolicy):
    """Offloads what an operator predicate selects, recomputes the rest."""

    name: str
    decide: Callable[..., bool]
    offload: Offloadable

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Verdict:
        return self.offload if self.decide(op, *args, **kwargs) else False

    @property
    def uses_names(self) -> bool:
        return False

    @property
    def lowerable(self) -> bool:
        return False  # the compiler's region would keep the values on the device

    def __repr__(self) -> str:
        if self.offload == Offload:
            return f"policies.{self.name}()"
        return f"policies.{self.name}(offload_src={self.offload.src!r}, offload_dst={self.offload.dst!r})"


def offload_dot_with_no_batch_dims(offload_src: str = "device", offload_dst: str = "pinned_host") -> Policy:
    """Keep matrix multiplies without batch dimensions in host memory; recompute the rest.

    What :data:`dots_with_no_batch_dims_saveable` saves, offloaded (as
    ``jax.checkpoint_policies.offload_dot_with_no_batch_dims``).

        >>> import torch
        >>> policy = offload_dot_with_no_batch_dims()
        >>> policy(torch.ops.aten.mm.default), policy(torch.ops.aten.sin.default)
        (policies.Offload, False)
    """
    offload = _offload_kinds("offload_dot_with_no_batch_dims", offload_src, offload_dst)
    return OffloadDots("offload_dot_with_no_batch_dims", _dots_with_no_batch_dims_saveable, offload)


@dataclass(frozen=True, repr=False)
class SaveAndOffloadNames(SavingPolicy):
    saved: frozenset[str]
    offloaded: frozenset[str]
    offload: Offloadable

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Verdict:
        if op is not CHECKPOINT_NAME:
            return False
        if args[1] in self.saved:
            return True
        return self.offload if args[1] in self.offloaded else False

    def __repr__(self) -> str:
        kinds = "" if self.offload == Offload else f", offload_src={self.offload.src!r}, offload_dst={self.offload.dst!r}"
        return (
            f"policies.save_and_offload_only_these_names(names_which_can_be_saved={tuple(sorted(self.saved))!r}, "
            f"names_which_can_be_offloaded={tuple(sorted(self.offloaded))!r}{kinds})"
        )


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: Iterable[str] = (),
    names_which_can_be_offloaded: Iterable[str] = (),
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
) -> Policy:
    """Keep the values named with ``names_which_can_be_saved``, offload those named with
    ``names_which_can_be_offloaded`` to host memory, recompute everything else.

    As ``jax.checkpoint_policies.save_and_offload_only_these_names``; a name may
    not be in both.

        >>> import torch
        >>> policy = save_and_offload_only_these_names(names_which_can_be_saved=["a"], names_which_can_be_offloaded=["b"])
        >>> [policy(CHECKPOINT_NAME, torch.ones(1), n) for n in "abc"]
        [True, policies.Offload, False]
    """
    who = "save_and_offload_only_these_names"
    for arg, value in (("names_which_can_be_saved", names_which_can_be_saved), ("names_which_can_be_offloaded", names_which_can_be_offloaded)):
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise TypeError(f"{who}: {arg} must be a list or tuple of names, got {value!r}")
    saved = _names(names_which_can_be_saved, f"{who}: names_which_can_be_saved")
    offloaded = _names(names_which_can_be_offloaded, f"{who}: names_which_can_be_offloaded")
    both = saved & offloaded
    if both:
        raise ValueError(
            f"{who}: names_which_can_be_saved and names_which_can_be_offloaded must not share names, "
            f"both hold {sorted(both)!r}"
        )
    return SaveAndOffloadNames(saved, offloaded, _offload_kinds(who, offload_src, offload_dst))


# ------------------------------------------------------------------ a memory budget


@dataclass(frozen=True, repr=False)
class MemoryBudget(SavingPolicy):
    """Keeps, per remat'd call, the values cheapest to keep per unit of recomputation saved.

    During the forward run it answers as :data:`everything_saveable` (so every
    candidate is recorded); at the end of the run the recorder keeps the
    candidates with the highest estimated recomputation cost per byte, in that
    order, as long as their bytes fit in ``fraction`` of all candidates' bytes,
    and drops the rest (see ``funckpt._budget``).
    """

    fraction: float

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Verdict:
        return self.fraction > 0

    @property
    def uses_names(self) -> bool:
        return False

    @property
    def budget(self) -> float:
        return self.fraction

    @property
    def lowerable(self) -> bool:
        return False  # it chooses among a whole call's values, not per operator

    def __repr__(self) -> str:
        return f"policies.memory_budget({self.fraction!r})"


def memory_budget(fraction: float) -> Policy:
    """Keep the values most expensive to recompute per byte, up to ``fraction`` of what
    :data:`everything_saveable` would keep.

    Decided per remat'd call from its operators: each value's recomputation
    cost is estimated from shapes (FLOPs for matrix multiplies, convolutions and
    attention, the number of elements for the rest), and the values are taken
    by cost per byte, highest first, while their total stays within
    ``fraction`` of all candidates' bytes. ``0.0`` keeps what
    :data:`nothing_saveable` keeps, ``1.0`` what :data:`everything_saveable`
    keeps, and a larger fraction never keeps fewer bytes nor recomputes more.
    :func:`~funckpt.print_saved_residuals` shows the choice.

        >>> memory_budget(0.25)
        policies.memory_budget(0.25)
        >>> memory_budget(0.0), memory_budget(1)
        (policies.nothing_saveable, policies.everything_saveable)
    """
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"memory_budget: fraction must be a number in [0, 1], got {fraction!r}")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:  # also refuses NaN
        raise ValueError(f"memory_budget: fraction must be in [0, 1], got {fraction!r}")
    # The endpoints are those policies, so they cost no more than they do (no recording of
    # every candidate only to drop them all, no cost estimates only to keep them all).
    if fraction == 0.0:
        return nothing_saveable
    if fraction == 1.0:
        return everything_saveable
    return MemoryBudget(fraction)


def lowerable(policy: Policy) -> bool:
    """Can a call with ``policy`` become ``torch.compile``'s checkpoint region? Plain callables:
    when names do not matter to them (then their answers become ``MUST_SAVE``/``PREFER_RECOMPUTE``;
    a ``from_torch`` function's offload answers keep the value on the device there)."""
    verdict = getattr(policy, "lowerable", None)
    return verdict if isinstance(verdict, bool) else not uses_names(policy)


def budget_of(policy: Any) -> float | None:
    """The memory budget fraction ``policy`` asks for, or None."""
    budget = getattr(policy, "budget", None)
    return budget if isinstance(budget, float) else None


def is_policy_factory(obj: Any) -> bool:
    """Is ``obj`` one of the functions above that *make* a policy (a common slip: passing it uncalled)?"""
    return obj in (
        save_only_these_names,
        save_any_names_but_these,
        save_anything_except_these_names,
        save_from_both_policies,
        from_torch,
        offload_dot_with_no_batch_dims,
        save_and_offload_only_these_names,
        memory_budget,
    )


def checkpoint_name(x: T, name: str) -> T:
    """Return ``x`` unchanged, tagged ``name`` for the name-based policies.

    ``x`` is a tensor or a pytree of them (optree: tuples, lists, dicts, ...):
    every tensor leaf is tagged, as ``jax.ad_checkpoint.checkpoint_name`` does.

    Inside a remat'd function whose policy keeps ``name``, the operator that
    produced ``x`` is not executed again during recomputation. Outside remat
    (or with a policy that ignores names) it does nothing. Gradients flow
    through it unchanged.

        >>> import torch, funckpt
        >>> x = torch.ones(2)
        >>> funckpt.checkpoint_name(x, "x") is x
        True
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: name must be a string, got {name!r}")
    if isinstance(x, torch.Tensor):
        note_name(x, name)
        return x
    leaves: list[Any] = optree.tree_leaves(cast(Any, x), none_is_leaf=False, namespace="funckpt")
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise TypeError(
            f"checkpoint_name: x must be a tensor or a pytree of tensors, got {type(x).__name__} with no tensor in it"
        )
    for t in tensors:
        note_name(t, name)
    return x
