"""How a policy's choices are kept and served: two dispatch modes over one op trace.

During the forward run, :class:`Recorder` (a ``TorchDispatchMode``, so below
autograd and every functorch transform) numbers each ATen operator, remembers
its name and argument metadata, asks the policy about it, and keeps the outputs
of the operators the policy chose. During a recomputation, :class:`Replayer`
walks the same numbering: where the operator at position ``i`` is the one the
forward run executed there (same operator, same argument shapes and dtypes) and
position ``i`` was kept, it returns the kept outputs instead of executing.
Autograd, which sits above, still records the operator, so gradients are those
of the original computation.

Safety:

* Recomputations under forward-mode AD (``jvp``, ``jacfwd``, a dual level)
  interleave tangent operators with the primal ones, so they do not replay:
  they recompute everything (``UserRegion.run`` decides).
* If a recomputation diverges from the forward's trace (another operator at
  some position, which can happen when an operator decomposes differently with
  and without grad tracking), caching stops for the rest of that run: the
  remaining operators are recomputed. A kept value is never served at a
  position it was not made at.
* A kept value that the forward run itself later modified in place is dropped
  at the end of the forward run (it no longer holds what the operator made).
  One modified *after* the forward run (an output of the call the caller updates
  in place, ``h += x``) is not served: its operator runs again.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from . import _budget, _offload, _tail
from ._errors import CheckpointError
from ._internals import DispatchMode, OpOverload, OpOverloadPacket, bottom, clone_storage, skip_code, storage_of
from ._naming import OnThreadStack, active
from .policies import CHECKPOINT_NAME, Offloadable, Policy, Verdict, budget_of, excluded_names, uses_names

# Not numbered: autograd dispatches a detach when it saves an op's output for
# backward, so grad-enabled recomputations have detaches the no-grad forward run
# lacks. They alias their input and are never kept, so skipping them is safe.
_UNNUMBERED = frozenset({torch.ops.aten.detach.default})


_CACHEABLE: dict[Any, bool] = {}


_WRITTEN: dict[Any, tuple[int, ...]] = {}


# Operators whose schemas do not annotate a write they make: batch norm updates its
# running statistics (arguments 3 and 4) in training mode.
_UNANNOTATED_WRITES = {
    getattr(torch.ops.aten, name): (3, 4)
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if hasattr(torch.ops.aten, name)
}


# Batch-norm operators with running statistics at positions 3 and 4 and the training
# flag at 5: in evaluation mode they read the statistics and write nothing, whatever
# their schema says.
_RUNNING_STATS: dict[Any, int] = {}


def _is_batch_norm_with_stats(op: Any) -> bool:
    verdict = _RUNNING_STATS.get(op)
    if verdict is None:
        arguments = op._schema.arguments
        verdict = _RUNNING_STATS[op] = int(
            "batch_norm" in op._schema.name
            and len(arguments) > 5
            and arguments[3].name == "running_mean"
            and arguments[5].name == "training"
        )
    return bool(verdict)


def _evaluating(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    training = args[5] if len(args) > 5 else kwargs.get("training", True)
    return training is False


def _written_args(op: Any) -> tuple[int, ...]:
    """Positions of the arguments whose values ``op`` writes (in-place and out= operators).

    In-place view operators (``squeeze_``, ``t_``, ...) change metadata only.
    """
    positions = _WRITTEN.get(op)
    if positions is None:
        annotated = tuple(
            i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        positions = _WRITTEN[op] = (
            ()
            if torch.Tag.inplace_view in op.tags
            else tuple(sorted({*annotated, *_UNANNOTATED_WRITES.get(op.overloadpacket, ())}))
        )
    return positions


_RESHAPED: dict[Any, tuple[int, ...]] = {}


def _reshaped_args(op: Any) -> tuple[int, ...]:
    """Positions of the arguments whose shape, strides or storage an in-place view operator
    changes (``unsqueeze_``, ``t_``, ``as_strided_``, ``resize_``: metadata, not values)."""
    positions = _RESHAPED.get(op)
    if positions is None:
        positions = _RESHAPED[op] = (
            tuple(i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
            if torch.Tag.inplace_view in op.tags
            else ()
        )
    return positions


def clone_together(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` that alias each other as the originals do.

    Tensors on one storage (say ``a`` and ``a[1:]``) get one copy of that storage
    and are rebuilt on it with their own offset, sizes and strides, so a write
    through one copy is seen through the others, as it was through the originals.
    """
    copies: dict[int | None, torch.UntypedStorage] = {}
    out = []
    for t in tensors:
        key = storage_of(t)
        if key is None:  # no storage to share (a batched or functorch tensor): a plain copy
            out.append(t.clone())
            continue
        if key not in copies:
            copies[key] = clone_storage(t.untyped_storage())
        out.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(copies[key], t.storage_offset(), t.size(), t.stride()))
    return out


#: Operators returning uninitialized memory: nothing to keep (their values mean nothing until
#: written, and recomputing them costs nothing); kept, one later filled by ``set_`` (which the
#: write checks take for a change of metadata) would be served as it was made.
_UNINITIALIZED = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")
    if hasattr(torch.ops.aten, name)
)


def _cacheable(op: Any) -> bool:
    """Random operators, operators that write any of their arguments or return aliases of them or
    nothing, and factories of uninitialized memory are never kept.

    A kept operator is not run again by a recomputation, which is handed what it returned:
    a write it makes would be skipped, and what the recomputation computes after it from the
    written tensor would start from the values before (batch norm's running statistics when
    they are an intermediate the function reads again, ``_foreach_add_``, which returns nothing,
    ``unbind_copy(out=[...])``): a silently wrong gradient."""
    verdict = _CACHEABLE.get(op)
    if verdict is None:
        verdict = _CACHEABLE[op] = (
            torch.Tag.nondeterministic_seeded not in op.tags
            and _returns_new_values(op)
            and op.overloadpacket not in _UNINITIALIZED
        )
    return verdict


def _returns_new_values(op: Any) -> bool:
    """Does ``op`` return something, none of it an alias of an argument, and write none of them?"""
    return (
        bool(op._schema.returns)
        and not any(r.alias_info is not None for r in op._schema.returns)
        and not _written_args(op)
    )


_DROPOUT_AT: dict[Any, int | None] = {}


def _keepable(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """:func:`_cacheable`, or this call draws nothing: an attention operator (every overload of
    ``scaled_dot_product_attention`` is tagged as random, for its dropout) called with
    ``dropout_p`` 0, as in evaluation and wherever attention has no dropout. Its result is then
    a function of its arguments, kept as a matmul's is (``dots_saveable`` promises attention)."""
    if _cacheable(op):
        return True
    at = _DROPOUT_AT.get(op, -1)
    if at == -1:
        names = [a.name for a in op._schema.arguments]
        at = _DROPOUT_AT[op] = names.index("dropout_p") if "dropout_p" in names and _returns_new_values(op) else None
    if at is None:
        return False
    p = _argument(op, args, kwargs, at)
    return p is None or (isinstance(p, (int, float)) and p == 0)


def _argument(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int) -> Any:
    """ATen operator ``op``'s argument at position ``i`` of its schema, given by position or keyword."""
    return args[i] if i < len(args) else kwargs.get(op._schema.arguments[i].name)


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    """The tensors an operator returned (a tensor, or a tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(t for t in out if isinstance(t, torch.Tensor))
    return ()


def _meta(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args)


class _Plain:
    """A member of an operator's returned tuple that is not a tensor (a number, ``None``), as it was."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


class Saved:
    """One remat'd call's kept operator outputs, by position in its op trace."""

    def __init__(self, policy: Policy, name: str, hooks: SavedTensorsHooks | None = None) -> None:
        self.policy = policy
        self.name = name
        # The caller's saved-tensor hooks (pack, unpack), where checkpoint's respect_saved_tensors_hooks
        # asks for the kept values to go through them as the tensors autograd saves do.
        self.hooks = hooks
        self.excluded = excluded_names(policy)
        self.track_producers = uses_names(policy)
        self.trace: list[tuple[Any, tuple[Any, ...]]] = []
        # position -> outputs (as the op returned them), or an _offload.Offloaded copy of them
        self.kept: dict[int, Any] = {}
        self.offload: dict[int, Offloadable] = {}  # positions the policy asked to keep in host memory
        self.budget = budget_of(policy)
        self.costs: dict[int, float] = {}  # position -> estimated recomputation cost (memory_budget only)
        self.choice: _budget.Choice | None = None  # what the budget kept, for reports
        self.previous: weakref.ref[Saved] | None = None  # the call that offloaded values before this one
        self.pending = _offload.Pending()  # copies back to the device started by a prefetch
        self.offload_lock = threading.Lock()
        self.versions: dict[int, list[int]] = {}
        self.labels: dict[int, str] = {}  # position -> the name that kept it, if any
        # id(output tensor) -> (weak reference, position, version as made), forward run only; the
        # weak reference guards against a freed tensor's id being reused by another.
        self.producer: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self.written: set[int | None] = set()  # storages written by in-place ops in the forward run
        # position -> an alias of its output as made, where an in-place view operator reshaped it since
        # (what checkpoint_name keeps of it: see Recorder._reshaping), forward run only.
        self.reshaped: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, tuple[Any, list[weakref.ref[torch.Tensor] | _Plain], list[int]]] = {}

    # forward run

    def ask(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict:
        """The policy's verdict on ``op``: a bool or an ``Offloadable``, or a clear error."""
        try:
            verdict = self.policy(op, *args, **kwargs)
        except torch.OutOfMemoryError:
            raise  # (the caller's to handle, as anywhere else in the call: a loop skipping the batch)
        except Exception as e:
            raise CheckpointError(
                f"remat({self.name}): the saving policy {self.policy!r} raised {type(e).__name__}: {e} "
                f"when asked about {op}. A policy is called as policy(op, *args, **kwargs) and returns a "
                "bool (factories such as save_only_these_names must be called: "
                "save_only_these_names('name'))."
            ) from e
        if not isinstance(verdict, (bool, Offloadable)):
            raise CheckpointError(
                f"remat({self.name}): the saving policy {self.policy!r} returned {verdict!r} for {op}; a "
                "policy returns True (keep) or False (recompute), or funckpt.policies.Offload (keep in host "
                "memory). For a torch.utils.checkpoint policy returning CheckpointPolicy values, use "
                "funckpt.policies.from_torch(policy)."
            )
        return verdict

    def keep(self, position: int, out: Any, label: str | None = None, verdict: Verdict = True) -> None:
        self.kept[position] = out
        self.versions[position] = _versions(out)
        if isinstance(verdict, Offloadable):
            self.offload[position] = verdict
        else:
            self.offload.pop(position, None)  # saving beats offloading
        if label is not None:
            self.labels[position] = label

    def name_value(self, x: torch.Tensor, name: str) -> None:
        value = bottom(x)
        entry = self.producer.get(id(value))
        if entry is None or entry[0]() is not value:
            # A view over all of an operator's output: ``nn.Linear`` of a 3-D input is ``addmm``'s
            # output viewed back to 3-D, ``torch.einsum``'s a ``bmm``'s, permuted and viewed. That
            # output is kept (the same memory): the recomputation views it again.
            base = value._base
            if base is None or base.numel() != value.numel():
                return
            entry = self.producer.get(id(base))
            if entry is None or entry[0]() is not base:
                return
            value = base
        position = entry[1]
        reshaped = self.reshaped.get(position)
        if reshaped is not None:  # (``x @ w`` of a vector ends in ``squeeze_``: kept as mm returned it)
            if storage_of(reshaped) in self.written:
                return
            value = reshaped
        elif _versions(value) != [entry[2]]:
            # Written since the operator made it: no longer what the operator returns, so never
            # handed back for it.
            return
        verdict = self.ask(CHECKPOINT_NAME, (x, name), {})
        if verdict:
            if position in self.kept:
                self.labels[position] = name
                if verdict is True:
                    self.offload.pop(position, None)  # saving beats offloading
                elif name in self.excluded:
                    # Kept by an operator-level answer the name's exclusion takes back; what
                    # remains of it is the offload the name asked for.
                    self.offload[position] = verdict
                return
            # (Every producer noted is an operator whose results may be kept: see Recorder.)
            refs = self._outputs.get(position)
            if refs is None:  # a single-tensor output: the named tensor is that output (as made)
                self.keep(position, value, label=name, verdict=verdict)
                return
            structure, weak, made = refs
            alive = [w() for w in weak]
            # (else: recompute that op, never serve part of it)
            if all(t is not None for t, w in zip(alive, weak) if not isinstance(w, _Plain)) and _versions(alive) == made:
                self.keep(position, structure(alive), label=name, verdict=verdict)
        elif name in self.excluded:
            self.kept.pop(position, None)
            self.versions.pop(position, None)
            self.offload.pop(position, None)

    def finish_forward(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """Drop the kept values that could have changed; detach the rest.

        Dropped (recomputed instead): values whose version changed, values
        whose storage an in-place operator wrote during the forward run (an
        alias such as ``_unsafe_view`` does not share the version counter), and
        values sharing storage with an output of the region other than
        themselves (the caller could modify that output in place later).

        Detached, a kept value no longer holds on to the forward run's local
        autograd graph (and so to every activation that graph saved). This runs
        after the dispatch modes have exited, on purpose: a detach issued inside
        ``__torch_dispatch__`` runs below autograd and would not share the
        version counter that the mutation check relies on.
        """
        exposed = {storage_of(b): b for b in (bottom(t) for t in outputs)}
        for position in list(self.kept):
            kept = _tensors(self.kept[position])
            if (
                _versions(self.kept[position]) != self.versions[position]
                or any(storage_of(t) in self.written for t in kept)
                or any(storage_of(t) in exposed and exposed[storage_of(t)] is not t for t in kept)
            ):
                self._drop(position)
            else:
                self.kept[position] = _detached(self.kept[position])
        self.producer.clear()
        self.reshaped.clear()
        self._outputs.clear()
        self.written.clear()
        if self.budget is not None:
            self._apply_budget(self.budget)
        if self.offload:
            self._offload_kept({s for s in exposed if s is not None})
        if self.hooks is not None:
            self._pack_kept({s for s in exposed if s is not None})

    def _drop(self, position: int) -> None:
        del self.kept[position], self.versions[position]
        self.labels.pop(position, None)
        self.offload.pop(position, None)

    def _apply_budget(self, fraction: float) -> None:
        """memory_budget: every candidate was recorded; keep the chosen, drop the rest."""
        candidates = [
            _budget.Candidate(p, sum(t.numel() * t.element_size() for t in _tensors(out)), self.costs.get(p, 0.0))
            for p, out in self.kept.items()
        ]
        chosen = _budget.choose(candidates, fraction)
        self.choice = _budget.Choice(fraction, candidates, chosen)
        for position in list(self.kept):
            if position not in chosen:
                self._drop(position)
        self.costs.clear()

    def _offload_kept(self, exposed: set[int | None]) -> None:
        """Start copying the values to offload to host memory (see ``_offload``); CPU values stay.

        A kept value that is also an output of the call is not offloaded: the caller holds it
        on the device anyway (a copy would save nothing), and may write to it, which the
        version check of a value kept in place catches and a copy in flight would not.
        """
        moved = False
        for position in [p for p in self.offload if p in self.kept]:
            if any(storage_of(t) in exposed for t in _tensors(self.kept[position])):
                del self.offload[position]
                continue
            host = _offload.to_host(self.kept[position], self.offload[position].pinned)
            if host is not None:
                self.kept[position] = host
                moved = True
        if moved:
            self.previous = _offload.chain(self)

    def _pack_kept(self, exposed: set[int | None]) -> None:
        """Hand the kept values to the caller's pack hook (those not offloaded: the policy chose
        where they go). Not a kept value that is an output of the call: the caller holds it anyway,
        and may write to it, which the version check of a value kept as it is catches."""
        assert self.hooks is not None
        pack = self.hooks[0]
        for position, out in self.kept.items():
            if isinstance(out, (_offload.Offloaded, Packed)) or not isinstance(out, (torch.Tensor, tuple, list)):
                continue
            if any(storage_of(t) in exposed for t in _tensors(out)):
                continue
            single = isinstance(out, torch.Tensor)
            items = [out] if single else list(out)
            self.kept[position] = Packed(
                None if single else type(out), [(pack(t), True) if isinstance(t, torch.Tensor) else (t, False) for t in items]
            )

    def release(self) -> None:
        """Forget the kept values (the backward through them ended): replays recompute them."""
        with self.offload_lock:
            self.kept.clear()
            self.pending.values.clear()
        self.versions.clear()
        self.labels.clear()

    def kept_tensors(self, position: int) -> tuple[list[torch.Tensor], bool]:
        """The tensors kept at ``position`` (host copies where offloaded), and whether the policy offloaded them."""
        out = self.kept[position]
        if isinstance(out, _offload.Offloaded):
            tensors = out.tensors()
        elif isinstance(out, Packed):  # (what the pack hook returned, where it is a tensor)
            tensors = [v for v, _ in out.items if isinstance(v, torch.Tensor)]
        else:
            tensors = list(_tensors(out))
        return tensors, position in self.offload

    def fetch(self) -> dict[int, Any]:
        """This call's offloaded values back on their devices, and start the previous call's (a
        prefetch); its values packed by the caller's hooks, unpacked."""
        fetched: dict[int, Any] = {}
        if self.offload:
            with self.offload_lock:
                fetched = _offload.fetch(self.kept, self.pending)
            _offload.prefetch(self.previous)
        if self.hooks is not None:
            unpack = self.hooks[1]
            for position, out in list(self.kept.items()):
                if isinstance(out, Packed):
                    fetched[position] = out.unpacked(unpack)
        return fetched

    def recorder(self, watch: WriteWatch) -> Recorder:
        return Recorder(self, watch.storages, watch.before_write)

    def keeps(self, t: torch.Tensor) -> bool:
        """Is ``t``'s memory that of a value this call keeps (held as it is, not offloaded)?"""
        storage = storage_of(t)
        return storage is not None and any(storage_of(k) == storage for v in self.kept.values() for k in _tensors(v))

    def replayer(self) -> Replayer:
        return Replayer(self, self.fetch())


SavedTensorsHooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class Packed:
    """An operator's kept outputs, each tensor as the caller's pack hook returned it."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type | None, items: list[tuple[Any, bool]]) -> None:
        self.kind = kind  # None: a single tensor; else the tuple or list type the operator returned
        self.items = items  # (packed or plain value, whether it was packed)

    def unpacked(self, unpack: Callable[[Any], torch.Tensor]) -> Any:
        values = [unpack(v) if was_packed else v for v, was_packed in self.items]
        return values[0] if self.kind is None else self.kind(values)


def recording_marks() -> list[tuple[Saved, int]]:
    """Where the trace of each region recording now stands (see ``detach_kept_since``)."""
    return [(saved, len(saved.trace)) for saved in active.stack]


def detach_kept_since(marks: list[tuple[Saved, int]]) -> None:
    """Detach the values the enclosing recording regions kept since ``marks``, during a nested run.

    A region nested in one whose policy keeps values: the outer recorder keeps the very
    tensors the inner run's operators made, and where that run records a local graph
    (plain autograd) they carry it, with every activation it saved (a matmul's input, the
    view behind it). Once the inner run ends nothing may hold on to that graph: its
    activations would look like tensors that escaped the inner call, and would stay alive
    until the outer run ends. The outer detaches its kept values then anyway
    (``finish_forward``); doing so earlier for these changes nothing else: a detached
    tensor shares the storage and the version counter the checks use, and none of them
    is an output of the outer call (the inner's outputs reach it through the inner's
    autograd Function, as other tensors). Called above autograd, outside
    ``__torch_dispatch__``: ``detach`` is not numbered in the outer trace (``_UNNUMBERED``).
    """
    for saved, start in marks:
        for position, out in list(saved.kept.items()):
            if position >= start:
                saved.kept[position] = _detached(out)


def held_by_recording_regions() -> set[int]:
    """Ids of the tensors the policies of the regions recording now keep (until their forward run ends).

    A region nested in one whose policy keeps values: the outer recorder holds the very
    tensors the inner run made, so they outlive the inner run without having escaped it.
    """
    return {id(t) for saved in active.stack for out in saved.kept.values() for t in _tensors(out)}


def _detached(out: Any) -> Any:
    """``out`` (a tensor, or a tuple or list of them and other values) with detached tensors."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if not isinstance(out, (tuple, list)):  # a Python number (aten::_local_scalar_dense, .item())
        return out
    return type(out)(t.detach() if isinstance(t, torch.Tensor) else t for t in out)


def _cloned(out: Any) -> Any:
    """``out`` (a tensor, or a tuple or list of them and other values) with its tensors copied,
    aliasing each other as they did (:func:`clone_together`)."""
    copies = iter(clone_together(list(_tensors(out))))
    if isinstance(out, torch.Tensor):
        return next(copies)
    return type(out)(next(copies) if isinstance(t, torch.Tensor) else t for t in out)


def _versions(out: Any) -> list[int]:
    """The version counters of ``out``'s tensors (-1 for an inference tensor, which has none:
    nothing outside inference mode can write it)."""
    return [-1 if t.is_inference() else t._version for t in _tensors(out)]


class WriteWatch(DispatchMode):
    """Calls ``before_write(index)`` before any operator writes to input ``index``'s storage."""

    def __init__(self, storages: dict[int | None, int], before_write: Callable[[int, torch.Tensor], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = storages
        self.before_write = before_write

    def _watch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
        """Call ``before_write`` for the inputs ``func`` is about to write; return the storages written.

        An in-place view operator (``resize_``, ``unsqueeze_``) changes no values, but the
        snapshot must be taken before it all the same: one taken at a later write would
        keep the changed shape (and, after ``resize_``, memory never written), and the
        recomputation would start from there (an observer's empty ``min_val`` resized then
        filled: the recomputation took the moving-average branch on garbage).
        """
        written = []
        positions = _written_args(func)
        if positions and _is_batch_norm_with_stats(func) and _evaluating(func, args, kwargs):
            positions = tuple(i for i in positions if i not in (3, 4))  # batch norm in eval mode reads them
        for i in positions:
            target = _argument(func, args, kwargs, i)
            for t in _tensors(target):
                storage = storage_of(t)
                written.append(storage)
                index = self.storages.get(storage)
                if index is not None:
                    self.before_write(index, t)
        for i in _reshaped_args(func):
            self._before_writing(_argument(func, args, kwargs, i))
        return written

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self._watch(func, args, kwargs)
        return func(*args, **kwargs)

    def call(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[[], Any] | None = None
    ) -> Any:
        """``func(*args, **kwargs)``, a torch function as a torch-function mode receives it, watched
        (``run()`` instead, where given: the same call computed another way, ``_draws.redrawn``).

        The same watch as :meth:`__torch_dispatch__` gives every ATen operator, asked of
        the torch function instead, where its writes are known beforehand
        (:func:`_function_writes`): the watch then costs a dictionary lookup per torch
        function rather than a Python dispatch mode around every operator. A torch
        function whose writes are not known (one written in Python, such as
        ``F.batch_norm``, which updates the running statistics it is handed) runs with
        this watch as a dispatch mode, which sees each operator it executes.
        """
        if type(func) is OpOverload:
            self._watch(func, args, kwargs)
            return func(*args, **kwargs) if run is None else run()
        known = _FUNCTION_WRITES.get(func, _UNCLASSIFIED)
        if known is _UNCLASSIFIED:
            known = _FUNCTION_WRITES[func] = _function_writes(func)
            if known is not None and not known.positions and known.flag is None:
                _READS_ONLY[func] = known.keywords
        rule = cast("_Writes | None", known)
        if rule is None:
            with self:
                return func(*args, **kwargs) if run is None else run()
        if rule.positions or kwargs:
            for target in rule.targets(args, kwargs):
                self._before_writing(target)
        return func(*args, **kwargs) if run is None else run()

    def _before_writing(self, target: Any) -> None:
        """``before_write`` for the inputs ``target`` (a tensor, or a sequence of them) is on the storage of."""
        for t in _tensors(target):
            index = self.storages.get(storage_of(t))
            if index is not None:
                self.before_write(index, t)


# Eager code a compiled function runs after a graph break calls this from the substitution
# mode's handler: Dynamo must not compile it as a frame of its own.
skip_code(WriteWatch.call.__code__)

_UNCLASSIFIED = object()


class _Writes:
    """Which arguments of a torch function are written: those at ``positions``, those given by a
    keyword in ``keywords``, and only where the argument ``flag`` ((position, name, default)),
    if there is one, is set (not ``None`` or ``False``: ``inplace=True``, batch norm's
    ``training``, an embedding's ``max_norm``). A flag that is anything else (``0.0``, a
    tensor) counts as set: a snapshot too many, never a write missed."""

    __slots__ = ("flag", "keywords", "positions")

    def __init__(
        self, positions: tuple[int, ...], keywords: frozenset[str], flag: tuple[int, str, Any] | None = None
    ) -> None:
        self.positions, self.keywords, self.flag = positions, keywords, flag

    def targets(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if self.flag is not None:
            i, name, default = self.flag
            value = args[i] if i < len(args) else kwargs.get(name, default)
            if value is None or value is False:
                return []
        written = [args[i] for i in self.positions if i < len(args)]
        if kwargs:  # a written argument given by keyword: out=, or torch.relu_(input=c)
            written += [v for k, v in kwargs.items() if k in self.keywords]
        return written


#: Torch function -> which arguments it writes, or ``None``: not known beforehand.
_FUNCTION_WRITES: dict[Any, _Writes | None] = {}
#: The torch functions classified so far that write no argument given by position (most:
#: ``torch.matmul``, ``x.view``, ``F.linear``, ``torch.cat``), each with the keywords by which it
#: would write one (``out``): see :func:`may_write`.
_READS_ONLY: dict[Any, frozenset[str]] = {}


def may_write(func: Any, kwargs: dict[str, Any] | None) -> bool:
    """Could this call of the torch function ``func`` write an argument, so that :meth:`WriteWatch.call`
    must see it? Not where ``func`` writes none given by position and the call names none of its
    written keywords: the watch would only call it. (Asked by the watch's caller first, per operator.)"""
    keywords = _READS_ONLY.get(func)
    return keywords is None or bool(kwargs and not keywords.isdisjoint(kwargs))


#: The keywords of a function's first argument where it is written: ``self`` in its schema,
#: ``input`` in the Python binding of a function (``torch.relu_(input=c)``).
_FIRST = frozenset({"out", "self", "input"})
_OUT = frozenset({"out"})
_WRITES_FIRST = _Writes((0,), _FIRST)
_WRITES_OUT = _Writes((), _OUT)  # (a function that writes no argument it is handed but its out=)
#: In-place operators of Python's syntax (``x[i] = v``, ``x += v``): they write their first argument.
_INPLACE_DUNDERS = frozenset(
    f"__{op}__" for op in ("setitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow",
                           "iand", "ior", "ixor", "ilshift", "irshift", "idiv")
)  # fmt: skip
#: Modules of torch's own functions written in Python that are named as its built-ins are.
_FOLLOWS_CONVENTIONS = frozenset({"torch._tensor", "torch.functional"})
#: Tensor methods that hand out the tensor's memory (a storage, a NumPy array, a DLPack capsule).
_SHARES_MEMORY = frozenset({"untyped_storage", "storage", "numpy", "__array__", "__dlpack__"})
#: ATen operators that write arguments their schemas do not mark as written: batch norm and
#: instance norm update the running statistics they are handed (in training mode only): the
#: composites, and the operators the dispatch watch knows the writes of (_UNANNOTATED_WRITES).
_UNMARKED_WRITES = frozenset(
    {"batch_norm", "instance_norm", "_batch_norm_impl_index", *(packet.__name__ for packet in _UNANNOTATED_WRITES)}
)


def _function_writes(func: Any) -> _Writes | None:
    """Positions and keywords of the arguments ``func`` writes, or ``None`` where that is not known beforehand.

    Known for torch's built-in functions and tensor methods, which bind one ATen operator
    name and take their arguments in its schema's order, and by its names as keywords (its
    ``self`` as ``input``): the arguments its overloads mark as written (``Tensor(a!) self``,
    and ``out=``; a TorchScript overload of the same name, such as ``sort`` of a list, may
    mark one more, which costs a snapshot, never a missed write). Python's in-place
    operators write their first argument, its other protocols nothing; any other built-in
    whose name ends in a single underscore (torch's convention for in-place methods) writes
    its first. So are torch.Tensor's and torch.functional's functions written in Python
    (below), and ``torch.nn.functional``'s, by their parameters (:func:`_functional_writes`).
    Not known for other functions written in Python, for operator packets, and for the
    batch-norm operators whose schemas leave their writes unmarked.
    """
    name = getattr(func, "__name__", None)
    if name in _SHARES_MEMORY and getattr(torch.Tensor, name, None) is func:
        # The tensor's memory, handed out: it may then be written with no torch function or
        # operator at all (``storage.copy_``, ``storage.fill_``, a NumPy array's items), and
        # without moving the tensor's version counter. Snapshotted before, as for a write.
        return _WRITES_FIRST
    if isinstance(func, (types.FunctionType, types.MethodType, functools.partial)) or not callable(func):
        # Written in Python. torch.Tensor's own such methods and torch.functional's follow the
        # built-ins' conventions: those wrapping a built-in (``x ** 2``, ``x **= 2``) write what
        # it writes, Python's protocols (``1 - x``, ``len(x)``) and those named after an ATen
        # operator (``x.split``, ``torch.einsum``) are known by name. (Each would otherwise run
        # with the dispatch watch, a Python call per operator again.)
        if func is torch._assert:  # (timm's blocks call it per call: it reads a bool)
            return _WRITES_OUT
        if getattr(func, "__module__", None) == "torch.nn.functional" and isinstance(func, types.FunctionType):
            return _functional_writes(func)
        if getattr(func, "__module__", None) not in _FOLLOWS_CONVENTIONS or not isinstance(name, str):
            return None
        wrapped = getattr(func, "__wrapped__", None)
        if wrapped is not None and not isinstance(wrapped, types.FunctionType):
            return _function_writes(wrapped)
        if name == "backward" or not (name.startswith("__") and name.endswith("__") or _aten_packet(name) is not None):
            # (x.unique(): named otherwise; x.backward() runs the backward functions of a graph,
            # hooks and custom Functions among them, which may write anything)
            return None
    if not isinstance(name, str) or isinstance(func, OpOverloadPacket):
        return None
    if name.startswith("__") and name.endswith("__"):  # Python's protocols (x[i], x == y, bool(x))
        # (A property's setter writes its tensor too: ``x.data = y`` makes it hold other values;
        # unpickling, ``__setstate__``, the tensor it fills.)
        return _WRITES_FIRST if name in _INPLACE_DUNDERS or name in ("__set__", "__setstate__") else _WRITES_OUT
    if name in _UNMARKED_WRITES:
        return None
    if name in _FLAG_ONLY:
        return _WRITES_OUT
    packet = _aten_packet(name)
    if packet is None:
        return _WRITES_FIRST if name.endswith("_") and not name.endswith("__") else _WRITES_OUT
    written: set[int] = set()
    names = set(_OUT)
    for overload in packet.overloads():
        for i, a in enumerate(getattr(packet, overload)._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only:
                written.add(i)
                names.add(a.name)
    if name.endswith("_") and not name.endswith("__"):
        written.add(0)
    if 0 in written:
        names.update(_FIRST)
    return _Writes(tuple(sorted(written)), frozenset(names))


#: In-place by name, but what they set is a flag of the tensor object, not its values or shape:
#: ``c.detach().requires_grad_()`` inside a step (a gradient of an energy) writes nothing.
_FLAG_ONLY = frozenset({"requires_grad_"})


def _aten_packet(name: str) -> Any:
    """The ATen operator packet named ``name``, or ``None``."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


#: Functions of ``torch.nn.functional`` that write an argument their parameters do not name as
#: written: name -> (the written parameters, the parameter that turns the write on).
_FLAGGED_WRITES = {
    "batch_norm": (("running_mean", "running_var"), "training"),
    "instance_norm": (("running_mean", "running_var"), "use_input_stats"),
    "embedding": (("weight",), "max_norm"),
    "embedding_bag": (("weight",), "max_norm"),
}


def _functional_writes(func: types.FunctionType) -> _Writes | None:
    """What a function of ``torch.nn.functional`` (written in Python) writes, from its parameters.

    Such a function writes only arguments it is handed, and only as its parameters say: an
    ``inplace`` flag (its first argument), an ``out`` argument, a name ending in ``_``, or as
    :data:`_FLAGGED_WRITES` lists (batch norm's running statistics in training mode, an
    embedding's weight with ``max_norm``). (Checked against its sources: any other write there
    is to a tensor it made, ``var.clone().clamp_()``.) Without this, every ``F.layer_norm``,
    ``F.dropout``, ``F.silu``, ``F.softmax``, ``F.pad`` of a call with a non-differentiable
    input ran under the dispatch watch: a Python call per operator, 15-40 us per call on CPU.
    """
    name = func.__name__
    if getattr(torch.nn.functional, name, None) is not func:
        return None
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    position = {p.name: i for i, p in enumerate(parameters) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}

    def writes(*written: str, flag: str | None = None) -> _Writes:
        positions = tuple(position[w] for w in written if w in position)  # (keyword-only ones: by name only)
        if flag is None:
            return _Writes(positions, frozenset(written))
        default = next(p.default for p in parameters if p.name == flag)
        at = position.get(flag, len(parameters) + 1_000)  # (a keyword-only flag: never positional)
        switch = (at, flag, None if default is inspect.Parameter.empty else default)
        return _Writes(positions, frozenset(written), switch)

    names = {p.name for p in parameters}
    if name in _FLAGGED_WRITES:
        written, switch = _FLAGGED_WRITES[name]
        if not set(written) | {switch} <= names:
            return None  # (another torch's signature than the one this table describes)
        return writes(*written, flag=switch)
    first = parameters[0].name if parameters and parameters[0].name in position else None
    if "inplace" in names and first is not None:
        return writes(first, flag="inplace")
    if name.endswith("_") and not name.endswith("__"):
        return writes(first) if first is not None else None
    if "out" in names:
        return writes("out")
    return _WRITES_OUT


class Recorder(OnThreadStack, WriteWatch):
    """Records the forward run for a policy (and watches input writes, as WriteWatch does)."""

    def __init__(
        self, saved: Saved, storages: dict[int | None, int], before_write: Callable[[int, torch.Tensor], None]
    ) -> None:
        super().__init__(storages, before_write)
        self.saved = saved

    def _thread_stack(self) -> list[Any]:
        return active.stack

    def _stack_item(self) -> Any:
        return self.saved

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _UNNUMBERED:
            return func(*args, **kwargs)
        meta = _meta(args)  # before running: in-place ops change their arguments' shapes
        saved = self.saved
        saved.written.update(self._watch(func, args, kwargs))
        reshaped = _reshaped_args(func)
        if reshaped:  # (rare: an in-place view operator, x @ w of a vector ends in squeeze_)
            return self._reshaping(func, args, kwargs, reshaped, meta)
        out = func(*args, **kwargs)
        position = len(saved.trace)
        saved.trace.append((func, meta))
        if _keepable(func, args, kwargs):
            verdict = saved.ask(func, args, kwargs)
            if verdict:
                saved.keep(position, out, verdict=verdict)
                if saved.budget is not None:
                    saved.costs[position] = _budget.estimate_cost(func, args, kwargs, out)
            if saved.track_producers:  # for checkpoint_name: which op made which value
                # Every tuple or list, kept or not, whatever else it holds: a name on one of its
                # members keeps the whole of it (a kept one may be taken back by a name the policy
                # excludes, then kept again by another; convolution_backward returns Nones too).
                if isinstance(out, (tuple, list)):
                    saved._outputs[position] = (
                        type(out),
                        [weakref.ref(t) if isinstance(t, torch.Tensor) else _Plain(t) for t in out],
                        _versions(out),
                    )
                for t in _tensors(out):
                    saved.producer[id(t)] = (weakref.ref(t), position, _versions(t)[0])
        return out


    def _reshaping(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reshaped: tuple[int, ...], meta: Any) -> Any:
        """Run an in-place view operator (``squeeze_``, ``t_``), which changes the shape of its
        argument, not its values: where that is a value kept (or one whose producer is noted for
        ``checkpoint_name``), what is kept from here on is an alias of it as the operator that made
        it returned it (:func:`_own_alias`; ``x @ w`` of a vector is ``mm`` then ``squeeze_``: without
        this, ``dots_saveable`` kept nothing of it, its shape having changed). Not a keepable operator
        itself: nothing else of :meth:`__torch_dispatch__` applies to it."""
        saved = self.saved
        targets = [t for i in reshaped for t in _tensors(_argument(func, args, kwargs, i))]
        aliases: list[tuple[torch.Tensor, torch.Tensor, int | None, int | None]] = []
        for t in targets:
            entry = saved.producer.get(id(t))
            produced = entry[1] if entry is not None and entry[0]() is t and entry[2] == t._version else None
            # (Looked for from the last kept value back, where it is as a rule (mm's, then squeeze_): a
            # map of every kept value, built per operator, made a long run of them quadratic.)
            position = next((p for p in reversed(saved.kept) if saved.kept[p] is t), None)
            if position is not None and saved.versions.get(position) != _versions(t):
                position = None  # (written since it was kept: dropped at the end of the run)
            if position is not None or produced is not None:
                aliases.append((t, _own_alias(t), position, produced))
        out = func(*args, **kwargs)
        saved.trace.append((func, meta))
        for t, alias, position, produced in aliases:
            if position is not None:
                saved.kept[position] = alias
                saved.versions[position] = _versions(alias)
            if produced is not None:
                saved.reshaped[produced] = alias
        return out


def _own_alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it is now, over its memory, with a version counter of its own: the operator that
    reshapes ``t`` in place moves ``t``'s (autograd does so after this mode returns), and a write
    into the memory is seen as one into its storage (:attr:`Saved.written`)."""
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


class Replayer(DispatchMode):
    def __init__(self, saved: Saved, fetched: dict[int, Any] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.saved = saved
        self.fetched = fetched or {}  # offloaded values, back on their devices for this run
        self.position = 0
        self.diverged = False
        # Storages of the kept values this run was handed (an alias of each), by position: see _copy_before_write.
        self.handed: dict[int | None, int] = {}
        # On for a call a recomputation defers (see _tail.Deferring): its matmul kernels are skipped
        # here, where they are counted, rather than by a dispatch mode above, which would hide them.
        self.skipping = False

    def skip_kernels(self) -> _SkipKernels:
        return _SkipKernels(self)

    def stop_replaying(self) -> None:
        """The run left the forward run's course (a deferred tail result is computed where the
        forward run computed no such thing): the operators from here on are run, none replayed.
        Counted as positions of the forward's trace, they could match a kept value of another
        operator of the same shapes (a square matmul's), and be handed it."""
        self.diverged = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _UNNUMBERED:
            return func(*args, **kwargs)
        saved = self.saved
        position = self.position
        self.position += 1
        if not self.diverged:
            if position >= len(saved.trace) or saved.trace[position] != (func, _meta(args)):
                self.diverged = True
            elif position in self.fetched:
                # A fresh copy of what the forward run made: a later in-place change of the
                # original cannot reach it.
                return self.fetched[position]
            elif position in saved.kept and _versions(saved.kept[position]) == saved.versions[position]:
                out = saved.kept[position]
                for t in _tensors(out):
                    self.handed[storage_of(t)] = position
                return _detached(out)
            # (a kept value modified in place since the forward run, through an output of the call
            # it is, as a residual ``h += x`` does: no longer what the operator made, so it runs)
        if self.handed:
            self._copy_before_write(func, args, kwargs)
        if self.skipping:
            return _tail.run_or_skip(func, args, kwargs)
        return func(*args, **kwargs)

    def _copy_before_write(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A kept value this run was handed is about to be written: it gets a copy of its own first.

        The run holds an alias of the kept value, and may write it in place where the forward
        run did not (under torch.func transforms a linear's bias is added in place to the
        replayed matmul, out of place in the forward run). Written through the alias, the kept
        value would hand those new values to the next recomputation (``jacrev(jacrev(f))``
        recomputes twice): silently wrong. The alias here takes the write, as it must; the
        kept value stays as the forward run made it.
        """
        saved = self.saved
        for i in _written_args(func):
            target = _argument(func, args, kwargs, i)
            for t in _tensors(target):
                position = self.handed.pop(storage_of(t), None)
                if position is None or position not in saved.kept:
                    continue
                out = saved.kept[position]
                for other in _tensors(out):
                    self.handed.pop(storage_of(other), None)
                copy = _cloned(out)
                saved.kept[position] = copy
                saved.versions[position] = _versions(copy)


class _SkipKernels:
    """:meth:`Replayer.skip_kernels`: the replayer skips matmul kernels while it is on."""

    __slots__ = ("replayer",)

    def __init__(self, replayer: Replayer) -> None:
        self.replayer = replayer

    def __enter__(self) -> None:
        self.replayer.skipping = True

    def __exit__(self, *exc: Any) -> None:
        self.replayer.skipping = False
