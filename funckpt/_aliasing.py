"""Outputs that alias an input or each other: rebuilt as views outside the autograd Function.

A custom ``autograd.Function`` cannot tell autograd that its outputs alias each
other, and an output that is a view of an input becomes a view "created in a
custom Function", which autograd refuses to modify in place. Without remat,
``fn`` returning ``x[0]``, ``x.view(torch.int64)``, ``(h, h[:, 0])`` or
``(a, a)`` gives the caller real views: in-place updates propagate, and
gradients flow through the view relations.

So the forward run classifies each output by storage (:func:`plan`):

* **owned**: an output of the Function, as usual;
* **a view of input j**: not an output of the Function; the caller gets the
  same view of its own tensor ``j`` (the tensor itself when the view is the
  whole of it), so autograd records a view of the caller's tensor;
* **a view of owned output r**: not an output of the Function either; the
  caller gets that view of the Function's output ``r``;
* **a view of a hidden base**: two outputs that are both views of an internal
  tensor neither of them is (``h = ...; return h.t(), h[0]``): that tensor
  becomes an output of the Function the caller never sees, and each of them
  is rebuilt as its view, so an in-place update through one reaches the other,
  as without remat (the views keep the tensor's memory alive either way);
* **a copy**: outputs sharing a storage some other way (no common ``_base``),
  and an output aliasing an input through a custom
  ``autograd.Function`` (a gradient-reversal layer returning ``x.view_as(x)``):
  rebuilt as a view, its gradient would be the view's, not the Function's.

Views are rebuilt with ``as_strided`` on the same storage (after
``view_as_real``/``view_as_complex``/``view(dtype)`` when the dtype differs),
so any view the function made, however it made it, is reproduced. The
recomputation returns the owned outputs only, at the positions the forward run
chose. This runs where the forward run is plain autograd and the caller is not
inside ``vmap`` (whose batched tensors have no storage to view); elsewhere every
output is owned and the Function itself makes input views (``_autograd.py``).

There, outputs viewing one intermediate (or an input) come back to the caller as
separate tensors over one memory: the caller's in-place update of one reaches the
others' values (and the input's) but not their gradients. Nothing rebuilds them as
views there; instead each such memory is watched (:func:`watch_shared_memory`)
and the backward refuses a write into it (:func:`written`), rather than compute a
wrong gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
from typing import cast

import torch

from ._capture import has_tangent
from ._internals import PLAIN_TENSORS, DisableFuncTorch, bottom, has_gradient_dtype, is_fake, made_under_no_grad, set_versions, storage_of


@dataclass(frozen=True)
class View:
    """Output rebuilt as ``source.as_strided(size, stride, offset)`` in ``dtype``."""

    source: int  # an input index ("input"), or an output's position ("output"; a hidden base's: past the last output)
    of_input: bool
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    differentiable: bool
    whole: bool  # same geometry and dtype as the source: the source itself
    # Made under no_grad: it says it requires grad, and a jvp's tangent reaches it, but no gradient
    # goes through it to its source. Rebuilt under no_grad too.
    under_no_grad: bool = False


@dataclass(frozen=True)
class Plan:
    """For each output position: ``None`` (owned, or copied) or the :class:`View` rebuilding it."""

    views: tuple[View | None, ...]
    owned: tuple[int, ...]  # positions of the Function's outputs
    copied: frozenset[int]  # positions returned as copies
    # Per hidden base (the Function's outputs after the owned ones): the position of an output
    # whose ``_base`` it is, in every run.
    bases: tuple[int, ...] = ()


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.size()), tuple(t.stride()), cast(int, t.storage_offset())


def _view(source: int, of_input: bool, out: torch.Tensor, base: torch.Tensor, grad_recorded: bool) -> View:
    size, stride, offset = _geometry(out)
    whole = (size, stride, offset) == _geometry(base) and out.dtype == base.dtype
    differentiable = out.requires_grad if grad_recorded else has_gradient_dtype(out)
    under_no_grad = differentiable and not _differentiable(out, grad_recorded)
    return View(source, of_input, size, stride, offset, out.dtype, differentiable, whole, under_no_grad)


def plan(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], grad_recorded: bool) -> Plan | None:
    """How to return ``outputs`` (plain tensors of the forward run); ``None`` if nothing aliases.

    ``grad_recorded``: the run recorded a local graph, so an output's
    ``requires_grad`` says whether it is differentiable (a ``detach()``ed view is not).
    """
    if _apart(inputs, outputs):
        return None
    inputs_on: dict[int, list[int]] = {}
    for j, t in enumerate(inputs):
        key = storage_of(t)
        if key is not None:
            inputs_on.setdefault(key, []).append(j)
    groups: dict[int, list[int]] = {}
    for i, o in enumerate(outputs):
        key = storage_of(o)
        if key is not None:
            groups.setdefault(key, []).append(i)
    if not any(key in inputs_on or len(members) > 1 for key, members in groups.items()):
        return None
    views: list[View | None] = [None] * len(outputs)
    copied: set[int] = set()
    bases: list[int] = []
    for key, members in groups.items():
        bits = [i for i in members if _has_bits(outputs[i])]
        copied.update(bits)  # as_strided drops the conjugate and negative bits: copies
        members = [i for i in members if i not in bits]
        if key in inputs_on:
            through = [
                i
                for i in members
                if grad_recorded and (_through_a_custom_function(outputs[i]) or _apart_in_its_graph(outputs[i], inputs, inputs_on[key]))
            ]
            copied.update(through)
            for i in (i for i in members if i not in through):
                o = outputs[i]
                j = _source(o, inputs, inputs_on[key])
                views[i] = _view(j, True, o, inputs[j], grad_recorded)
            continue
        if len(members) == 1:
            continue
        differentiable = {i: _differentiable(outputs[i], grad_recorded) for i in members}
        # A differentiable root, if any: the others are its views. Rebuilding a differentiable
        # output as a view of a detached one (``return h.detach(), h``) would cut its gradient.
        r = next((i for i in members if outputs[i]._base is None and differentiable[i]), None)
        if r is not None:
            for i in members:
                if i != r:
                    views[i] = _view(r, False, outputs[i], outputs[r], grad_recorded)
            continue
        # Else views of an internal tensor none of them is (``return h.t(), h[0]``; beside them,
        # tensors no gradient goes through: ``h.detach()``, ``h.view(torch.int64)``): that tensor
        # becomes an output of the Function, the hidden base, and each of them its view (those
        # detached), so a write through one reaches the others, as without remat.
        some = any(differentiable.values())
        viewing = [i for i in members if outputs[i]._base is not None and (differentiable[i] or not some)]
        base = outputs[viewing[0]]._base if viewing else None
        if base is not None and all(outputs[i]._base is base for i in viewing):
            for i in members:
                views[i] = _view(len(outputs) + len(bases), False, outputs[i], base, grad_recorded)
            bases.append(viewing[0])
        elif not some and any(outputs[i]._base is None for i in members):
            r = next(i for i in members if outputs[i]._base is None)
            for i in members:  # (no gradient to cut: views of one of them)
                if i != r:
                    views[i] = _view(r, False, outputs[i], outputs[r], grad_recorded)
        else:  # views of several tensors on one storage: copies
            copied.update(members[1:])
    owned = tuple(i for i, v in enumerate(views) if v is None)
    return Plan(tuple(views), owned, frozenset(copied), tuple(bases))


def view_of(source: int, out: torch.Tensor, base: torch.Tensor) -> View:
    """A differentiable output rebuilt as a view of the Function's output at ``source`` (``base``).
    (``out`` may be its detached alias already: differentiable is said, not read off it.)"""
    return dataclasses.replace(_view(source, False, out, base, False), differentiable=True, under_no_grad=False)


def _differentiable(o: torch.Tensor, grad_recorded: bool) -> bool:
    """Is output ``o`` differentiable (see :func:`plan`)? Not a view made under ``no_grad``, whatever it says."""
    if not grad_recorded:
        return has_gradient_dtype(o)
    return o.requires_grad and not made_under_no_grad(o)


def _apart(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> bool:
    """Does no output share memory with an input or another output? Told by where each one's
    storage starts, without making storage objects (the common case, on every call). A tensor
    whose storage has no memory or cannot tell where it starts answers no: the exact test decides."""
    starts: set[int] = set()
    try:
        for t in (*inputs, *outputs):
            if type(t) not in PLAIN_TENSORS and is_fake(t):
                return False  # (no memory: a read of a FakeTensor's data pointer warns, or raises)
            start = t.data_ptr() - cast(int, t.storage_offset()) * t.element_size()
            if start == 0 or start in starts:
                return False
            starts.add(start)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # (sparse, wrapped, opaque)
        return False
    return True


def _apart_in_its_graph(t: torch.Tensor, inputs: Sequence[torch.Tensor], on: Sequence[int]) -> bool:
    """Is ``t`` differentiable while none of the inputs on its memory is? It is then no view of them
    for autograd (a view of a tensor that does not require grad does not either, and a write of what
    does into an input is refused): its memory is theirs by chance. A value an enclosing policy kept,
    handed back in the enclosing call's recomputation, is the memory of a detached alias of it that the
    function reaches (logged after the forward pass): rebuilt as a view of that constant, the output
    would lose its gradient. It is returned as a copy."""
    return t.requires_grad and not any(inputs[j].requires_grad for j in on)


def _through_a_custom_function(t: torch.Tensor) -> bool:
    """Does ``t``'s graph reach the tensor it views through a custom ``autograd.Function`` (whose
    forward returned its input, or a view of it, with a backward of its own)?

    Views made by torch's view operators lead back through a chain of single-input nodes; a
    Function's node is found on it as a ``BackwardCFunction``."""
    node = t.grad_fn
    for _ in range(_LONGEST_VIEW_CHAIN):
        if node is None:
            return False
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return True
        edges = [n for n, _ in node.next_functions if n is not None]
        if len(edges) != 1:
            return False
        node = edges[0]
    return False


_LONGEST_VIEW_CHAIN = 64


def _has_bits(t: torch.Tensor) -> bool:
    """A lazy conjugate or negative view (``z.conj()``, its ``.imag``), which ``as_strided`` would not keep."""
    return bool(t.is_conj() or t.is_neg())


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """First and last byte of the storage that ``t``'s elements touch."""
    size = t.element_size()
    start = cast(int, t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    low = sum((n - 1) * st for n, st in zip(t.size(), t.stride()) if st < 0) * size
    high = sum((n - 1) * st for n, st in zip(t.size(), t.stride()) if st > 0) * size
    return start + low, start + high + size - 1


def _source(out: torch.Tensor, inputs: Sequence[torch.Tensor], candidates: list[int]) -> int:
    """The input ``out`` is a view of, among the ``candidates`` sharing its storage.

    The input itself, or the one whose view it is (``_base``), or one of the same
    geometry; else the smallest one whose bytes contain ``out``'s. Two chunks of one
    tensor passed as two arguments share a storage: the view of the second must be
    rebuilt from the second, or its gradient goes to the first.
    """
    for j in candidates:
        if inputs[j] is out or out._base is inputs[j]:
            return j
    for j in candidates:
        if _geometry(inputs[j]) == _geometry(out) and inputs[j].dtype == out.dtype:
            return j
    first, last = _byte_range(out)
    ranges = {j: _byte_range(inputs[j]) for j in candidates}
    containing = [j for j, (low, high) in ranges.items() if low <= first and last <= high]
    if containing:
        return min(containing, key=lambda j: ranges[j][1] - ranges[j][0])
    return candidates[0]


def owned_outputs(p: Plan | None, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The Function's outputs: the owned ones, copies made where planned, then the hidden bases."""
    if p is None:
        return list(outputs)
    owned = [_copy(outputs[i]) if i in p.copied else outputs[i] for i in p.owned]
    # (A recomputation whose output is no view any more returns it in the base's place: its
    # shape then differs from the forward run's, which the determinism check reports.)
    return owned + [outputs[i] if outputs[i]._base is None else cast(torch.Tensor, outputs[i]._base) for i in p.bases]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy in fresh memory, lazy conjugate and negative bits resolved (a clone keeps them)."""
    return t.resolve_conj().resolve_neg() if _has_bits(t) else t.clone()


def rebuild(p: Plan | None, owned: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every output, from the Function's ``owned`` outputs (the hidden bases last) and the caller's ``inputs``."""
    if p is None:
        return list(owned)
    full: list[torch.Tensor | None] = [None] * len(p.views)
    for i, o in zip(p.owned, owned):
        full[i] = o
    full += owned[len(p.owned) :]
    for i, v in enumerate(p.views):
        if v is None:
            continue
        base = inputs[v.source] if v.of_input else full[v.source]
        assert base is not None
        full[i] = _make_view(base, v)
    return full[: len(p.views)]  # type: ignore[return-value]


def _make_view(base: torch.Tensor, v: View) -> torch.Tensor:
    if v.under_no_grad:
        with torch.no_grad():
            return (base if base.dtype == v.dtype else _reinterpret(base, v.dtype)).as_strided(v.size, v.stride, v.offset)
    if v.whole:
        out = base
    elif base.dtype == v.dtype:
        out = base.as_strided(v.size, v.stride, v.offset)
    else:
        out = _reinterpret(base, v.dtype).as_strided(v.size, v.stride, v.offset)
    if not v.differentiable and (out.requires_grad or has_tangent(out)):
        out = out.detach()  # (under jvp too: a detached output carries no tangent)
    return out


def _reinterpret(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole storage under ``base`` as a flat tensor of ``dtype`` (a view, differentiable where torch allows)."""
    n = bottom(base).untyped_storage().nbytes() // base.element_size()
    flat = base.as_strided((n,), (1,), 0)
    if flat.is_complex() and not torch.empty(0, dtype=dtype).is_complex() and flat.real.dtype == dtype:
        return torch.view_as_real(flat).reshape(-1)
    if not flat.is_complex() and torch.empty(0, dtype=dtype).is_complex() and torch.empty(0, dtype=dtype).real.dtype == flat.dtype:
        return torch.view_as_complex(flat.reshape(-1, 2))
    return flat.view(dtype)


# ----------------------------------------------------- where nothing rebuilds views: watched


@dataclass(frozen=True)
class Watch:
    """An intermediate's version counter at the end of the forward run, through ``counter``: a
    tensor sharing that counter (every view of the intermediate bumps it on a write) but not its
    memory, which stays the caller's to free."""

    counter: torch.Tensor
    version: int


def watch_shared_memory(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], differentiable_outputs: Sequence[bool] | None = None
) -> tuple[Watch, ...]:
    """A :class:`Watch` per memory that two ``outputs`` of the Function overlap in, or that one
    shares with an input that requires grad; ``()`` if there is none (the common case).

    Where no plan is made (under ``vmap`` with reverse mode at or around it: ``hessian``,
    ``vmap(grad(f))``), ``h = ...; return h.t(), h[0]`` gives the caller two tensors of its own
    level over the memory of ``h`` (the plain tensors under functorch's wrappers): the caller
    writing one in place changes the other's values, but autograd at the caller's level does not
    see the relation, so the other's gradient would miss the write. So for ``return x[0]`` and
    the input ``x`` (and the recomputation, which would start from the written values). Outputs
    apart in an intermediate's memory (``h[0]``, ``h[1]``) are not watched: a write into one
    changes nothing the others hold. Nor is an input no gradient flows into (a buffer the caller
    may write), whose change the determinism check sees; one that requires grad is saved with a
    version check, which refuses the caller's writes into it directly: this one sees those
    through an output.
    """
    plain = [bottom(o) for o in outputs]
    given = [bottom(t) for t in inputs]
    if _apart(given, plain):
        return ()
    differentiable = {storage_of(t) for t, x in zip(given, inputs) if x.requires_grad}
    others = {storage_of(t) for t, x in zip(given, inputs) if not x.requires_grad} - differentiable
    groups: dict[int, list[torch.Tensor]] = {}
    tracked: dict[int, list[torch.Tensor]] = {}  # the differentiable ones
    for k, o in enumerate(plain):
        key = storage_of(o)
        if key is not None and key not in others:
            groups.setdefault(key, []).append(o)
            if differentiable_outputs is None or differentiable_outputs[k]:
                tracked.setdefault(key, []).append(o)
    # (A write into an output no gradient goes through, h.detach() or h.view(torch.int64), or one
    # that changes only such outputs, changes no gradient: without remat autograd sees neither.)
    shared = [
        members[0]
        for key, members in groups.items()
        if key in differentiable or (len(tracked.get(key, ())) > 1 and _overlapping(tracked[key]))
    ]
    return tuple(w for w in map(_watch, shared) if w is not None)


def _overlapping(ts: Sequence[torch.Tensor]) -> bool:
    """Do two of ``ts`` (plain tensors on one storage) share an element? Told exactly on a map of
    the storage's elements; views in other dtypes, or tensors without data, are taken to."""
    first = ts[0]
    if any(t.dtype != first.dtype for t in ts):
        return True
    try:
        with DisableFuncTorch(), torch.no_grad():
            elements = first.untyped_storage().nbytes() // first.element_size()
            seen = torch.zeros(elements, dtype=torch.bool, device=first.device)
            for t in ts:
                marks = seen.as_strided(t.size(), t.stride(), t.storage_offset())
                if marks.any():
                    return True
                marks.fill_(True)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # (fake or meta memory, exotic layouts)
        return True
    return False


def _watch(t: torch.Tensor) -> Watch | None:
    try:
        version = t._version
        with DisableFuncTorch(), torch.no_grad():
            counter = t.detach()  # (shares the version counter)
            counter.set_(counter.new_empty(0).untyped_storage())  # (no memory: bumps the counter, set back below)
        set_versions((counter,), (version,))
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # (inference tensors, subclasses)
        return None
    return Watch(counter, version)


def written(watches: Sequence[Watch]) -> bool:
    """Was a watched memory written since the forward run?"""
    return any(w.counter._version != w.version for w in watches)
