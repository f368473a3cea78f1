"""Checkpointing schedules for loops: plain Python, no torch.

A loop of ``n`` steps ``state[i + 1] = step_i(state[i])`` is differentiated in reverse
order, and reversing step ``i`` needs ``state[i]``. Keeping every state costs ``n``
states of memory; keeping at most ``c`` means recomputing the others from a kept one.
This module says *which* states to keep and *when* to recompute, as a list of
`Action` values that ``_loops.py`` executes on real carries; it knows nothing about
tensors, so it is tested on its own (``tests/test_schedule.py``) by running the
actions on integer "states".

Two schedules:

- `binomial` (the number of steps is known, ``scan``/``fori_loop``): the optimal
  offline schedule of Griewank (1992, "Achieving logarithmic growth of temporal and
  spatial complexity in reverse automatic differentiation") and Griewank and Walther
  (2000, "Algorithm 799: revolve", ACM TOMS 26(1)). With ``beta(c, r) = C(c + r, c)``
  and ``beta(c, r - 1) < n <= beta(c, r)``, it advances ``t(n, c) = r*n -
  beta(c + 1, r - 1)`` steps in all (the forward sweep included), the minimum
  (`binomial_advances`). The split point is chosen by the rule proved in `_split`.
- `Online` (the number of steps is not known until the loop stops, ``while_loop``):
  during the forward sweep the states to keep are chosen by Algorithm I of Stumm and
  Walther (2010, "New algorithms for optimal online checkpointing", SIAM J. Sci.
  Comput. 32(2)), exactly as Equinox's ``checkpointed_while_loop`` does it, and past
  its range (``beta(c, 2) - 1`` steps) by the dynamic checkpointing of Wang, Moin and
  Iaccarino (2009, "Minimal repetition dynamic checkpointing algorithm for unsteady
  adjoint calculation", SIAM J. Sci. Comput. 31(4)), also as Equinox does. When the
  loop stops, each interval between kept states is reversed by the binomial
  schedule with the slots then free.

Counting: ``t(n, c)`` counts the forward sweep up to state ``n - 1`` (the last step is
reversed from the current state, never stored). An online forward sweep cannot know
that a step is the last, so it always runs all ``n`` steps and must then restore and
recompute state ``n - 1``: its natural lower bound is ``t(n + 1, c)`` (the offline
problem with one more step whose reversal is free), which `Online` meets exactly
while the loop is within Algorithm I's range (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Action",
    "Advance",
    "Free",
    "Online",
    "Restore",
    "Reverse",
    "Store",
    "binomial",
    "binomial_advances",
]


@dataclass(frozen=True)
class Advance:
    """Run steps ``start, ..., stop - 1`` without recording: position ``start -> stop``."""

    start: int
    stop: int


@dataclass(frozen=True)
class Store:
    """Keep the current state (at ``position``, the current position) in a free slot."""

    position: int


@dataclass(frozen=True)
class Restore:
    """Current state := the stored state at ``position``, which stays stored."""

    position: int


@dataclass(frozen=True)
class Free:
    """Drop the stored state at ``position``."""

    position: int


@dataclass(frozen=True)
class Reverse:
    """Differentiate step ``position`` from the current state, which is at ``position``.

    Afterwards the current position is undefined: a `Restore` follows before any
    `Advance` or `Reverse`.
    """

    position: int


Action = Advance | Store | Restore | Free | Reverse


def _beta(c: int, r: int) -> int:
    """``beta(c, r) = C(c + r, c)``: the most steps ``c`` slots reverse with ``r`` repetitions."""
    return math.comb(c + r, c) if r >= 0 else 0


def _repetitions(n: int, c: int) -> int:
    """The least ``r >= 0`` with ``beta(c, r) >= n`` (the repetition number)."""
    r, b = 0, 1
    while b < n:
        r += 1
        b = b * (c + r) // r  # C(c+r-1, c) * (c+r) / r == C(c+r, c), exactly
    return r


def _check(n: int, checkpoints: int) -> None:
    if n < 1:
        raise ValueError(f"a schedule needs n >= 1 steps, got {n}")
    if checkpoints < 1:
        raise ValueError(f"a schedule needs checkpoints >= 1, got {checkpoints}")


def binomial_advances(n: int, checkpoints: int) -> int:
    """The fewest steps advanced to reverse ``n`` steps with ``checkpoints`` slots.

    Griewank and Walther's closed form ``t(n, c) = r*n - beta(c + 1, r - 1)`` for
    ``beta(c, r - 1) < n <= beta(c, r)``; the forward sweep's ``n - 1`` steps count.

    >>> binomial_advances(10, 1), binomial_advances(10, 9), binomial_advances(10, 3)
    (45, 9, 15)
    """
    _check(n, checkpoints)
    r = _repetitions(n, checkpoints)
    return r * n - _beta(checkpoints + 1, r - 1)


def _split(length: int, c: int) -> int:
    """An optimal offset ``m`` (``0 < m < length``) of the next checkpoint, for ``c >= 2``.

    Reversing ``length`` steps from a stored state with ``c`` slots by storing the
    state ``m`` steps on costs ``m + t(length - m, c - 1) + t(m, c)``. ``t(x, c)`` is
    continuous and piecewise linear in ``x`` with slope ``r`` on ``[beta(c, r - 1),
    beta(c, r)]``, so convex, and lies above each of its pieces: ``t(x, c) >= r*x -
    beta(c + 1, r - 1)`` for every ``r``. With ``r`` the repetition number of
    ``length``, taking the piece ``r`` for the right part and ``r - 1`` for the left
    bounds the cost below by ``r*length - beta(c, r - 1) - beta(c + 1, r - 2) =
    t(length, c)`` (Pascal's rule), with equality exactly when ``length - m`` lies in
    ``[beta(c - 1, r - 1), beta(c - 1, r)]`` and ``m`` in ``[beta(c, r - 2),
    beta(c, r - 1)]``. Those intervals meet (their end points sum to ``beta(c, r -
    1) < length <= beta(c, r)``), and the smallest ``m`` in both is returned.
    """
    r = _repetitions(length, c)
    return max(1, _beta(c, r - 2), length - _beta(c - 1, r))


def _reverse_interval(
    out: list[Action], start: int, stop: int, slots: int, position: int | None
) -> None:
    """Append the binomial reversal of steps ``start .. stop - 1`` to ``out``.

    The state at ``start`` is stored and counts as one of ``slots``; ``position`` is
    the current position (``None`` if undefined). Steps are reversed in descending
    order; the stored state at ``start`` is left stored. An explicit stack of pending
    tasks replaces recursion, whose depth can reach the number of steps.
    """
    # A task is (start, stop, slots) to reverse, or (position, -1, 0) to free.
    tasks: list[tuple[int, int, int]] = [(start, stop, slots)]
    while tasks:
        a, b, c = tasks.pop()
        if b < 0:
            out.append(Free(a))
            continue
        if b - a == 1 or c == 1:
            for i in range(b - 1, a - 1, -1):
                if position != a:
                    out.append(Restore(a))
                if i > a:
                    out.append(Advance(a, i))
                out.append(Reverse(i))
                position = None
            continue
        m = a + _split(b - a, c)
        if position != a:
            out.append(Restore(a))
        out.append(Advance(a, m))
        if b - m == 1:  # the right part is one step: reverse it now, no need to store
            out.append(Reverse(m))
            position = None
            tasks.append((a, m, c))
            continue
        out.append(Store(m))
        position = m
        tasks += [(a, m, c), (m, -1, 0), (m, b, c - 1)]


def binomial(n: int, checkpoints: int) -> list[Action]:
    """The optimal schedule reversing ``n`` steps with at most ``checkpoints`` stored states.

    It starts at position 0 with nothing stored and begins with ``Store(0)`` (the
    initial state takes one slot). Before the first `Reverse` there are only `Store`
    and `Advance`, reaching position ``n - 1`` (the forward sweep). Steps are reversed
    in the order ``n - 1, ..., 0``, and it ends with nothing stored. It advances
    `binomial_advances` steps in all. ``checkpoints >= n`` stores every state but the
    last.

    >>> binomial(3, 2)  # doctest: +NORMALIZE_WHITESPACE
    [Store(position=0), Advance(start=0, stop=1), Store(position=1),
     Advance(start=1, stop=2), Reverse(position=2), Restore(position=1),
     Reverse(position=1), Free(position=1), Restore(position=0), Reverse(position=0),
     Free(position=0)]
    """
    _check(n, checkpoints)
    out: list[Action] = [Store(0)]
    _reverse_interval(out, 0, n, checkpoints, 0)
    out.append(Free(0))
    return out


class Online:
    """Online checkpointing for a loop whose number of steps is unknown in advance.

    Call `forward` at each position ``0, 1, 2, ...`` before that step runs and take
    the `Store`/`Free` actions it returns; when the loop stops after ``n`` steps, call
    ``reverse(n)`` for the rest of the schedule. At most ``checkpoints`` states are
    stored at any time.

    Positions below ``beta(c, 2) - 1`` follow Algorithm I of Stumm and Walther (2010),
    in the form of Equinox's ``_stumm_walther_i``: a state machine ``(i, o, p, s)``
    that keeps ``o`` checkpoints moving forward until position ``p``, then fixes the
    last one and continues with one fewer. Later positions follow Wang, Moin and
    Iaccarino (2009) as Equinox's ``_wang_moin`` does (see `_wang_moin`): every slot
    has a level (the initial state's is infinite) and may be marked dispensable. The
    paper calls a state dispensable as soon as a later one has a higher level;
    Equinox marks it one promotion later, which measured slightly fewer advances for
    most ``c`` up to 20. Both are heuristics past ``beta(c, 2)`` steps.

    >>> online = Online(2)
    >>> [online.forward(k) for k in range(3)]
    [[Store(position=0)], [Store(position=1)], []]
    >>> online.reverse(3)  # doctest: +NORMALIZE_WHITESPACE
    [Restore(position=1), Advance(start=1, stop=2), Reverse(position=2),
     Restore(position=1), Reverse(position=1), Free(position=1),
     Restore(position=0), Reverse(position=0), Free(position=0)]
    """

    def __init__(self, checkpoints: int) -> None:
        if checkpoints < 1:
            raise ValueError(f"a schedule needs checkpoints >= 1, got {checkpoints}")
        self.checkpoints = checkpoints
        self._steps = 0  # positions seen by forward()
        self._slots: list[int | None] = [None] * checkpoints  # the position each slot holds
        # Stumm--Walther Algorithm I's state, as Equinox initialises it.
        self._i, self._o, self._p, self._s = 0, checkpoints, checkpoints, True
        self._switch = _beta(checkpoints, 2) - 1  # Equinox's u2_minus_1
        # Wang--Moin's level and dispensable mark of each slot (the initial state's
        # slot has an infinite level, so it is never reused).
        self._levels = [math.inf] + [0.0] * (checkpoints - 1)
        self._dispensable = [False] * checkpoints

    def forward(self, position: int) -> list[Action]:
        """The `Store`/`Free` actions to take at ``position``, before its step runs."""
        if position != self._steps:
            raise ValueError(f"forward() expected position {self._steps}, got {position}")
        self._steps += 1
        if position < self._switch:
            slot = self._stumm_walther(position)
        else:
            slot = self._wang_moin(position)
        if slot is None:
            return []
        actions: list[Action] = []
        old = self._slots[slot]
        if old is not None:
            actions.append(Free(old))
        self._slots[slot] = position
        actions.append(Store(position))
        return actions

    def _stumm_walther(self, step: int) -> int | None:
        """Algorithm I's decision at ``step``: the slot to store it in, or ``None``."""
        i, o, p, s = self._i, self._o, self._p, self._s
        slot = i if s else None
        if s:
            i += 1
            if i > o:
                i = 1
        if step + 1 == p:
            s = False
        if step == p:
            p, o = p + o, o - 1
            i, s = o, o > 0
        self._i, self._o, self._p, self._s = i, o, p, s
        return slot

    def _wang_moin(self, step: int) -> int | None:
        """Wang--Moin's decision at ``step`` as Equinox's ``_wang_moin``: a slot, or ``None``.

        A slot marked dispensable is reused (the newest such) at level 0; if none is,
        the newest slot (an empty one first) is reused at its level plus one, and every
        slot of a lower level than that slot had is marked dispensable.
        """
        if self.checkpoints == 1:
            return None  # the one slot holds the initial state
        newest = [math.inf if p is None else p for p in self._slots]
        marked = [i for i, d in enumerate(self._dispensable) if d]
        if marked:
            slot = max(marked, key=lambda i: newest[i])
            self._dispensable[slot] = False
            self._levels[slot] = 0.0
        else:
            slot = max(range(self.checkpoints), key=lambda i: newest[i])
            old = self._levels[slot]
            self._dispensable = [d or lv < old for d, lv in zip(self._dispensable, self._levels)]
            self._levels[slot] = old + 1
        return slot

    def stored(self) -> list[int]:
        """The positions stored now, in increasing order."""
        return sorted(p for p in self._slots if p is not None)

    def reverse(self, n: int) -> list[Action]:
        """The rest of the schedule once the loop stopped after ``n`` steps.

        The current position is ``n`` (``forward(n)`` was not called). The interval
        after each stored state is reversed, the last first, by the binomial schedule
        with the slots not held by earlier stored states; each stored state is freed
        once its interval is done.
        """
        if n != self._steps:
            raise ValueError(f"reverse() expected n = {self._steps} (forward() calls), got {n}")
        stored = self.stored()
        out: list[Action] = []
        position: int | None = n
        for j in range(len(stored) - 1, -1, -1):
            stop = stored[j + 1] if j + 1 < len(stored) else n
            _reverse_interval(out, stored[j], stop, self.checkpoints - j, position)
            out.append(Free(stored[j]))
            position = None
        return out
