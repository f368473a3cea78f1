"""Recomputing less: the last operations of a function, whose values no gradient needs.

A block typically ends with a projection and a residual add, ``x + h @ w2`` (a convolutional
one, ``(x + conv(h)) / scale``). The backward
pass needs what the matmul saved (``h`` and ``w2``), not what it returned, and the add saves
nothing. ``torch.utils.checkpoint``, which recomputes only until the forward graph's saved
tensors are all filled, never computes those two again; remat, which differentiates a graph
it records anew, would: the block's largest matmul recomputed for nothing.

So the forward run notes the calls it ends with (:attr:`Substitute.trail
<funckpt._capture.Substitute>`), and :func:`plan` keeps the longest run of them made of
matmuls, convolutions, adds and products by numbers whose results no later one saves (a
matmul saves its operands: an add feeding a matmul is not in it). Where their work is worth it, the recomputation records
their autograd nodes without running their matmul kernels (:class:`Deferring` and
:class:`_Skip`): the nodes save the real operands, so the gradient is the same, and the
results are uninitialized memory of the right layout (the adds run on it). A result that turns out to be read after all (a
later call takes it, the recomputation takes another course) is computed then, before the
reader sees it: being wrong costs time, never a value.

The determinism check, which compares the outputs' values, compares instead those of the
tensors the skipped calls read (the *frontier*): the outputs are a fixed function of them, and
the gradient depends on nothing else the skipped calls would compute.

Under a saving policy, the policy's replayer (a dispatch mode that counts every operator to
find the values it kept) skips the kernels itself: a mode above it would hide them from its
count. A matmul whose result the policy keeps is replayed, not computed, and is no tail.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ._errors import Digest, digest
from ._internals import DispatchMode

__all__ = ["TAIL", "TRAIL_LENGTH", "Deferring", "TailPlan", "plan", "run_or_skip"]

_MATMULS = frozenset(
    [
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.nn.functional.linear,
        torch.addmm,
        torch.Tensor.addmm,
    ]
)
_CONVS = frozenset(
    [
        torch.nn.functional.conv1d,
        torch.nn.functional.conv2d,
        torch.nn.functional.conv3d,
        torch.nn.functional.conv_transpose1d,
        torch.nn.functional.conv_transpose2d,
        torch.nn.functional.conv_transpose3d,
    ]
)
#: Functions whose backward saves their operands: a tail result they read is no tail result.
_SAVES_OPERANDS = _MATMULS | _CONVS
_ADDS = frozenset(
    [
        torch.add,
        torch.Tensor.add,
        torch.Tensor.__add__,
        torch.Tensor.__radd__,
        torch.sub,
        torch.Tensor.sub,
        torch.Tensor.__sub__,
        torch.Tensor.__rsub__,
    ]
)
#: A product or quotient by a Python number saves that number only (of a tensor, both operands).
_SCALED = frozenset(
    [torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.div, torch.Tensor.div, torch.Tensor.__truediv__]
)
#: The torch functions a tail is made of: each returns a new tensor, writes nothing, draws
#: nothing, and saves for its backward its operands at most (an add saves none, nor does a
#: product by a number), never its result.
TAIL = _SAVES_OPERANDS | _ADDS | _SCALED


def _saves_nothing_of(func: Any, args: tuple[Any, ...]) -> bool:
    """Does this call of a :data:`TAIL` function save none of its tensor arguments?"""
    if func in _ADDS:
        return True
    return func in _SCALED and len(args) == 2 and isinstance(args[0], torch.Tensor) and not isinstance(args[1], torch.Tensor)

#: The kernels :class:`_Skip` does not run: the matmuls and convolutions, where the work is,
#: whose result's layout their meta kernels give exactly (their operands share a dtype).
#: Everything else runs: the views, copies and casts around them, and the adds and products
#: (cheap, and their dtype follows promotion rules a meta tensor cannot stand in for: a Python
#: number's), on whatever a skipped kernel left.
_aten = torch.ops.aten
_SKIPPED = frozenset(
    [_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.convolution.default]
)

#: The most calls a tail holds (a block's end: a projection, its bias, a scale, the residual add),
#: and so the most the forward run notes (``Substitute.trail``), holding what they made: a run of
#: many adds and scalings (an elementwise loop) keeps no more of its intermediates alive.
TRAIL_LENGTH = 8

#: Multiply-adds of the skipped matmuls below which skipping is not worth its Python (a mode
#: on every call of the recomputation, a few tens of microseconds for a block): on the CPU,
#: 4M, about 0.1 ms of one core's work; on an accelerator, where the host's time is what a
#: launch-bound step waits for, 4G, about 20 us of an H100's in bfloat16 (a GPT block of
#: width 1024 on 8 x 1024 tokens ends with a matmul of 34G).
_WORTH = {"cpu": 1 << 22}
_WORTH_ELSEWHERE = 1 << 32


@dataclass
class TailPlan:
    """What the forward run found: the recomputation may skip the calls from ``start`` on."""

    start: int  # index of the first skipped call among the run's calls (metadata reads not counted)
    funcs: tuple[Any, ...]  # the skipped calls' functions, in order
    frontier_meta: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]
    frontier_digest: list[Digest | None] | None  # None: values not compared
    # Where each skipped call's arguments come from (an earlier skipped call, an input by its
    # position, a frontier tensor by its position, a number by its value): the frontier's values
    # determine the outputs only with the same wiring (another input for the last matmul, the
    # operands of a sub swapped, would give another gradient from the same frontier), and the
    # nodes save the numbers (a product's factor, a convolution's dilation).
    wiring: tuple[Any, ...] = ()
    # Per output of the run: the index of the skipped call that made it, or None. The outputs
    # no skipped call made are compared as without a tail (they are no function of the frontier).
    returns: tuple[int | None, ...] = ()


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


_NUMBERS = (numbers.Number, str, type(None))  # (a NumPy scalar too: numbers.Number registers them)


def _frontier(
    calls: Sequence[tuple[Any, tuple[Any, ...], torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    """The tensors ``calls`` read that none of them made and that are not the run's inputs, in
    order, and the calls' wiring (see :attr:`TailPlan.wiring`)."""
    made = {id(out): k for k, (_, _, out) in enumerate(calls)}
    given: dict[int, int] = {}
    for k, t in enumerate(inputs):
        given.setdefault(id(t), k)
    at: dict[int, int] = {}
    frontier: list[torch.Tensor] = []
    wiring = tuple((func, tuple(_source(a, made, given, at, frontier) for a in args)) for func, args, _ in calls)
    return frontier, wiring


def _source(a: Any, made: dict[int, int], given: dict[int, int], at: dict[int, int], frontier: list[torch.Tensor]) -> Any:
    """Where an argument of a skipped call comes from (a frontier tensor is added to ``frontier``).
    (A function of its own, not a closure: a recursive closure is a reference cycle, which would
    keep the frontier alive past the run, where it would look kept outside the call.)"""
    if isinstance(a, torch.Tensor):
        key = id(a)
        if key in made:
            return ("made", made[key])
        if key in given:
            return ("input", given[key])
        if key not in at:
            at[key] = len(frontier)
            frontier.append(a)
        return ("frontier", at[key])
    if isinstance(a, _NUMBERS):
        return ("value", type(a), a)
    if isinstance(a, (tuple, list)):  # (a convolution's stride, padding)
        return ("seq", type(a), tuple(_source(b, made, given, at, frontier) for b in a))
    return ("other", object())  # (no tail function takes another kind of value: never the same wiring)


def _multiply_adds(func: Any, args: tuple[Any, ...], out: torch.Tensor) -> int:
    if func in _CONVS:  # (each output value: a weight's input channels times its kernel)
        weight = args[1]
        return out.numel() * (weight.numel() // max(weight.shape[0], 1)) if isinstance(weight, torch.Tensor) else 0
    operand = args[1] if func in (torch.addmm, torch.Tensor.addmm) else args[0]
    depth = operand.shape[-1] if isinstance(operand, torch.Tensor) and operand.dim() else 1
    return out.numel() * depth


def _read_elsewhere(calls: Sequence[tuple[Any, tuple[Any, ...], torch.Tensor]], outputs: Sequence[torch.Tensor]) -> bool:
    """Does a node of the run's graph other than the calls' own take one of their results?

    What no torch-function mode sees (a custom ``autograd.Function`` whose forward calls a
    C++ extension, a module's backward hook) may read a result after the calls: it would read
    uninitialized memory in the recomputation. Only nodes made since the first call can.
    """
    own = {out.grad_fn for _, _, out in calls}
    first = min(node._sequence_nr() for node in own if node is not None)
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in own and node not in own:
                return True
            if child._sequence_nr() >= first:
                stack.append(child)
    return False


def plan(
    trail: Sequence[tuple[int, Any, tuple[Any, ...], Any]],
    inputs: tuple[torch.Tensor, ...],
    outputs: Sequence[torch.Tensor],
    compare_values: bool,
    kept: Callable[[torch.Tensor], bool] | None = None,
) -> TailPlan | None:
    """The tail the recomputation may skip, from the forward run's last calls (``trail``: index,
    function, positional arguments, result) and what it returned (``outputs``, with their graph),
    or ``None`` where there is none worth skipping. ``kept``: does a saving policy keep this
    result (its recomputation then computes nothing to skip: the replay hands it over)?"""
    saved: set[int] = set()  # what the matmuls kept so far save: their operands
    calls: list[tuple[Any, tuple[Any, ...], torch.Tensor]] = []
    start = -1
    for index, func, args, out in reversed(trail):
        if not isinstance(out, torch.Tensor) or id(out) in saved or not out.requires_grad:
            break
        if func in _SAVES_OPERANDS:
            saved.update(id(a) for a in _tensors(args))
        elif not _saves_nothing_of(func, args):
            break
        calls.append((func, args, out))
        start = index
    calls.reverse()
    work = [(f, a, o) for f, a, o in calls if f in _SAVES_OPERANDS]
    skipped = work if kept is None else [(f, a, o) for f, a, o in work if not kept(o)]
    if work and not skipped:
        return None  # (each replayed: nothing left to skip)
    worth = sum(_multiply_adds(f, a, o) for f, a, o in skipped)
    if not calls or worth < _WORTH.get(calls[-1][2].device.type, _WORTH_ELSEWHERE) or _read_elsewhere(calls, outputs):
        return None
    frontier, wiring = _frontier(calls, inputs)
    return TailPlan(
        start,
        tuple(f for f, _, _ in calls),
        tuple((t.shape, t.dtype, t.device) for t in frontier),
        digest(frontier) if compare_values else None,
        wiring,
        _returns([out for _, _, out in calls], outputs),
    )


def _returns(made: Sequence[torch.Tensor], outputs: Sequence[Any]) -> tuple[int | None, ...]:
    """Per output, the index among ``made`` of the tensor it is, or None."""
    at = {id(t): k for k, t in enumerate(made)}
    return tuple(at.get(id(t)) if isinstance(t, torch.Tensor) else None for t in outputs)


def run_or_skip(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Operator ``func`` on its arguments, below autograd, for a deferred call: a matmul or
    convolution kernel returns uninitialized memory of its result's layout (found by its meta
    kernel) instead; everything else runs."""
    if func in _SKIPPED:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # (A plain, strided layout: the meta kernels are asked with each operand's strides,
        # which a sparse or mkldnn operand, a graph's fixed adjacency matrix, has not.)
        if all(type(t) is torch.Tensor and t.layout == torch.strided for t in tensors):
            return _empty(func, args, kwargs, tensors)
    return func(*args, **kwargs)


def _empty(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> torch.Tensor:
    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return a

    with _disable_current_modes():  # (the modes below see no meta call: a flop counter counts none)
        shape = func(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
    return torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=tensors[0].device)


class _Skip(DispatchMode):
    """Below autograd, for one deferred call: :func:`run_or_skip` for each operator. (With a saving
    policy, its replayer skips instead: it must count every operator, see ``Replayer``.)"""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return run_or_skip(func, args, kwargs or {})


def _same(a: Any, b: Any) -> bool:
    """Equal wirings (a NaN among their numbers, or anything whose equality is not a bool, is not:
    the plan is then not followed)."""
    try:
        return bool(a == b)
    except Exception:  # (an object whose == raises, or returns an array)
        return False


class _Deferred:
    __slots__ = ("args", "func", "kwargs", "out")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out


class Deferring(TorchFunctionMode):
    """A recomputation's mode: the calls from the plan's ``start`` on that a tail may hold are
    deferred (recorded by autograd, not computed; a matmul's deferred operands are computed
    first, since it saves them). Any other call after a deferred one is another course than
    the forward run's: every deferred result is computed before it runs, and nothing more is
    deferred."""

    def __init__(
        self,
        tail: TailPlan,
        metadata: frozenset[Any],
        depth: Callable[[], int],
        nested: Callable[[int], bool],
        skip: Callable[[], AbstractContextManager[Any]] | None = None,
        strayed: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        # ``metadata``: the calls that read no value (not counted, as in the forward run); ``depth``
        # and ``nested``: funckpt's own work, or a nested region's run, is not this run's to defer.
        # ``skip``: what skips a deferred call's kernels (a saving policy's replayer, which must
        # see them to keep count; else a dispatch mode of its own, on for that call only).
        self.tail, self.metadata, self.depth, self.nested = tail, metadata, depth, nested
        self.skip: Callable[[], AbstractContextManager[Any]] = skip or _Skip
        # ``strayed``: called before a deferred result is computed, which the forward run did not
        # do there (the saving policy's replayer then stops handing back kept values: it counts
        # these operators too, and would take them for the forward run's next ones).
        self.strayed = strayed
        self.at: int | None = None  # how many substitutions are on where the function runs
        self.calls = 0
        self.pending: dict[int, _Deferred] = {}
        self.off = False
        self.stopped = False  # (another call came after a deferred one: nothing more is deferred)
        self.skipped: list[_Deferred] = []  # what finish left uninitialized

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.off or func in self.metadata:
            return func(*args, **kwargs)
        # (A call is counted once it has returned, as the forward run counts it: one that raises,
        # a fallback's probe in a try block, is not counted there.)
        index = self.calls
        if self.at is None:  # (the first call is the function's: the run's substitution, if any, is on)
            self.at = self.depth()
        pending = self.pending
        saves = func in _SAVES_OPERANDS
        if (
            not self.stopped
            and index >= self.tail.start
            and (saves or (func in TAIL and _saves_nothing_of(func, args)))
            and not kwargs
            and not self.nested(self.at)
            and torch.is_grad_enabled()
            and any(a.requires_grad for a in _tensors(args))
        ):
            if pending and saves:  # (its operands are saved: their values are needed)
                self._compute(args)
            with self.skip():
                out = func(*args)
            self.calls = index + 1
            if isinstance(out, torch.Tensor):
                pending[id(out)] = _Deferred(func, args, kwargs, out)
            return out
        if pending:
            # In the forward run, the tail was the last calls: any other call after a deferred one
            # is another course (or calls counted otherwise). Whatever it reads or writes, the
            # deferred results are computed now, from the values their operands hold now, and
            # nothing more is deferred (a later write to an operand, or a reader no mode sees,
            # would otherwise find them wrong).
            self.stopped = True
            self._compute([e.out for e in list(pending.values())])
        out = func(*args, **kwargs)
        self.calls = index + 1
        return out

    def _compute(self, values: Sequence[Any]) -> None:
        """Compute the deferred results among ``values`` (in lists and tuples too), in place."""
        for v in values:
            if isinstance(v, torch.Tensor):
                entry = self.pending.get(id(v))
                if entry is not None and entry.out is v:
                    if self.strayed is not None:
                        self.strayed()
                    del self.pending[id(v)]
                    self._compute(entry.args)
                    with torch.no_grad():
                        v.copy_(entry.func(*entry.args, **entry.kwargs))
            elif isinstance(v, (list, tuple)):
                self._compute(v)

    def finish(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
        """After the run: the frontier if the deferred calls are the plan's (their results then
        stay uninitialized), else ``None``, every result computed."""
        self.off = True
        entries = list(self.pending.values())
        frontier, wiring = _frontier([(e.func, e.args, e.out) for e in entries], inputs)
        meta = tuple((t.shape, t.dtype, t.device) for t in frontier)
        tail = self.tail
        if (
            tuple(e.func for e in entries) == tail.funcs
            and meta == tail.frontier_meta
            and _same(wiring, tail.wiring)
        ):
            self.pending = {}
            self.skipped = entries
            return frontier
        self._compute([e.out for e in entries])
        return None

    def returns_as_planned(self, outputs: Sequence[Any]) -> bool:
        """After :meth:`finish` returned a frontier: do the run's outputs hold the skipped results
        where the forward run's did? If not, the skipped results are computed (``False``)."""
        entries = self.skipped
        if _returns([e.out for e in entries], outputs) == self.tail.returns:
            return True
        self.pending = {id(e.out): e for e in entries}
        self._compute([e.out for e in entries])
        return False
