"""The checkpointing schedules of ``funckpt._schedule``, run on integer "states".

A small simulator executes a schedule where the state at position ``i`` is ``i`` and
advancing adds to it, and checks every rule ``_loops.py`` relies on: at most ``c``
states stored, each step reversed once in descending order from its own state, stores
only of the current state, nothing left stored. Advance counts are checked against
Griewank and Walther's closed form, which is itself checked against the recursion it
solves and, for tiny cases, against an exhaustive search over all schedules.
"""

from __future__ import annotations

import heapq
import math
import time
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funckpt._schedule import (
    Action,
    Advance,
    Free,
    Online,
    Restore,
    Reverse,
    Store,
    binomial,
    binomial_advances,
)


def execute(actions: list[Action], n: int, c: int, position: int | None = 0,
            stored: dict[int, int] | None = None) -> int:
    """Run ``actions`` on integer states, check every invariant, return the steps advanced."""
    state = position
    slots = dict(stored or {})
    advanced = 0
    expected = n - 1  # the next step to reverse
    for action in actions:
        if isinstance(action, Advance):
            assert state is not None and state == action.start < action.stop, action
            advanced += action.stop - action.start
            state = action.stop
        elif isinstance(action, Store):
            assert state == action.position not in slots, action
            assert len(slots) < c, f"{action} with {sorted(slots)} stored, c = {c}"
            slots[action.position] = state
        elif isinstance(action, Restore):
            state = slots[action.position]
        elif isinstance(action, Free):
            del slots[action.position]
        else:
            assert isinstance(action, Reverse)
            assert action.position == expected == state, (action, expected, state)
            expected -= 1
            state = None
    assert expected == -1, f"steps 0..{expected} not reversed"
    assert not slots, f"left stored: {sorted(slots)}"
    return advanced


def check_forward_sweep(actions: list[Action], n: int) -> None:
    """Before the first Reverse: only Store and Advance, reaching position n - 1."""
    first = next(i for i, a in enumerate(actions) if isinstance(a, Reverse))
    assert actions[0] == Store(0)
    assert all(isinstance(a, (Store, Advance)) for a in actions[:first])
    assert actions[first] == Reverse(n - 1)


def run_online(n: int, c: int) -> int:
    """Drive Online(c) through n steps and its reversal; return the steps advanced."""
    online = Online(c)
    actions: list[Action] = []
    for k in range(n):
        now = online.forward(k)
        assert all(isinstance(a, (Store, Free)) for a in now)
        assert all(a.position == k for a in now if isinstance(a, Store))
        actions += now
        actions.append(Advance(k, k + 1))
    actions += online.reverse(n)
    return execute(actions, n, c)


def beta(c: int, r: int) -> int:
    return math.comb(c + r, c)


@cache
def dp(n: int, c: int) -> int:
    """t(n, c) by the recursion: store at m, reverse the right with c - 1, the left with c."""
    if n == 1:
        return 0
    if c == 1:
        return n * (n - 1) // 2
    return min(m + dp(n - m, c - 1) + dp(m, c) for m in range(1, n))


def exhaustive(n: int, c: int, reach: int) -> int:
    """The fewest advances of any schedule reversing n steps with c slots whose forward
    sweep reaches position ``reach`` before the first reversal (Dijkstra over all states)."""
    start = (0, frozenset[int](), n - 1, reach == 0)
    best = {start: 0}
    queue = [(0, 0, start)]
    tie = 0
    while queue:
        cost, _, node = heapq.heappop(queue)
        if cost > best[node]:
            continue
        pos, slots, nxt, reached = node
        if nxt < 0:
            return cost
        moves: list[tuple[int, tuple[int, frozenset[int], int, bool]]] = []
        moves += [(0, (p, slots, nxt, reached)) for p in slots]  # restore
        moves += [(0, (pos, slots - {p}, nxt, reached)) for p in slots]  # free
        if pos >= 0 and pos not in slots and len(slots) < c:
            moves.append((0, (pos, slots | {pos}, nxt, reached)))
        limit = nxt if reached else reach
        if 0 <= pos < limit:
            moves.append((1, (pos + 1, slots, nxt, reached or pos + 1 == reach)))
        if reached and pos == nxt:
            moves.append((0, (-1, slots, nxt - 1, reached)))
        for step, new in moves:
            if cost + step < best.get(new, math.inf):
                best[new] = cost + step
                tie += 1
                heapq.heappush(queue, (cost + step, tie, new))
    raise AssertionError("unreachable")


# -- the closed form -------------------------------------------------------------------

def test_closed_form_known_values() -> None:
    for n in range(1, 60):
        assert binomial_advances(n, 1) == n * (n - 1) // 2
        for c in range(n - 1, n + 3):
            if c >= 1:
                assert binomial_advances(n, c) == n - 1
    assert binomial_advances(10, 3) == 15  # r = 2: 2*10 - beta(4, 1)


def test_closed_form_equals_recursion() -> None:
    for c in range(1, 9):
        for n in range(1, 81):
            assert binomial_advances(n, c) == dp(n, c), (n, c)


def test_closed_form_is_the_true_optimum_for_tiny_cases() -> None:
    for c in range(1, 4):
        for n in range(1, 8):
            assert exhaustive(n, c, reach=0) == binomial_advances(n, c), (n, c)


def test_closed_form_at_the_binomial_boundaries() -> None:
    for c in range(1, 15):
        for r in range(1, 6):
            n = beta(c, r)
            assert binomial_advances(n, c) == r * n - beta(c + 1, r - 1)
            assert binomial_advances(n + 1, c) == (r + 1) * (n + 1) - beta(c + 1, r)


def test_rejects_bad_arguments() -> None:
    for n, c in [(0, 1), (1, 0), (-1, 3)]:
        with pytest.raises(ValueError):
            binomial(n, c)
        with pytest.raises(ValueError):
            binomial_advances(n, c)
    with pytest.raises(ValueError):
        Online(0)


# -- the offline schedule --------------------------------------------------------------

def test_binomial_small_exhaustively() -> None:
    for c in range(1, 10):
        for n in range(1, 100):
            schedule = binomial(n, c)
            check_forward_sweep(schedule, n)
            assert execute(schedule, n, c) == binomial_advances(n, c), (n, c)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 60))
def test_binomial_is_valid_and_optimal(n: int, c: int) -> None:
    schedule = binomial(n, c)
    check_forward_sweep(schedule, n)
    assert execute(schedule, n, c) == binomial_advances(n, c)


def test_binomial_with_enough_slots_advances_once() -> None:
    for n in range(1, 30):
        for c in (n - 1, n, 2 * n):
            if c >= 1:
                schedule = binomial(n, c)
                assert execute(schedule, n, c) == n - 1
                assert sum(isinstance(a, Advance) for a in schedule) == max(n - 1, 0)
    assert binomial(1, 1) == [Store(0), Reverse(0), Free(0)]


def test_binomial_is_fast_and_flat_for_long_loops() -> None:
    started = time.perf_counter()
    schedule = binomial(10_000, 10)
    assert time.perf_counter() - started < 1.0
    assert execute(schedule, 10_000, 10) == binomial_advances(10_000, 10) == 57_624
    # c = 1 would recurse n deep if written recursively
    assert execute(binomial(5_000, 1), 5_000, 1) == 5_000 * 4_999 // 2


# -- the online schedule ---------------------------------------------------------------

def test_online_forward_follows_equinox_algorithm_i() -> None:
    # Hand-run of Equinox's _stumm_walther_i for checkpoints = 3 (state (i, o, p, s)
    # starting at (0, 3, 3, True)): the positions stored after each forward() call.
    expected = [[0], [0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 4], [0, 4, 5], [0, 4, 5],
                [0, 4, 7], [0, 4, 7]]
    online = Online(3)
    for k, stored in enumerate(expected):
        online.forward(k)
        assert online.stored() == stored, k


def test_online_matches_the_offline_optimum_within_algorithm_i() -> None:
    # The forward sweep cannot know which step is last, so it runs all n and state
    # n - 1 must be recomputed: the best any schedule can do is t(n + 1, c) (checked
    # exhaustively below). Stumm--Walther's Algorithm I reaches it for n < beta(c, 2).
    for c in range(1, 13):
        for n in range(1, beta(c, 2)):
            assert run_online(n, c) == binomial_advances(n + 1, c), (n, c)


def test_online_lower_bound_is_t_of_n_plus_one() -> None:
    for c in range(1, 4):
        for n in range(1, 7):
            assert exhaustive(n, c, reach=n) == binomial_advances(n + 1, c), (n, c)


def test_online_beyond_algorithm_i_stays_within_measured_bounds() -> None:
    # Past beta(c, 2) - 1 steps Equinox's Wang--Moin rule takes over; measured for
    # c <= 30, n <= 10_000: at most 1.4 t(n + 1, c), and under n extra advances.
    for c in range(1, 16):
        for n in sorted({*range(1, 200, 7), beta(c, 2), beta(c, 2) + 1, beta(c, 3)}):
            online, best = run_online(n, c), binomial_advances(n + 1, c)
            assert best <= online <= 1.5 * best, (n, c)
            assert online - best <= n, (n, c)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 40))
def test_online_is_valid(n: int, c: int) -> None:
    online, best = run_online(n, c), binomial_advances(n + 1, c)
    assert best <= online <= 1.5 * best


def test_online_argument_checks_and_empty_loop() -> None:
    assert Online(3).reverse(0) == []
    online = Online(3)
    online.forward(0)
    with pytest.raises(ValueError):
        online.forward(2)
    with pytest.raises(ValueError):
        online.reverse(2)
    assert execute(online.reverse(1), 1, 3, position=1, stored={0: 0}) == 0
