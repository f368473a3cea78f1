"""Checkpointed loops: ``scan``, ``fori_loop`` and ``while_loop``.

Differentiating through a loop of ``n`` steps keeps every step's internals;
remat'ing each step keeps every step's carry, still O(n). With ``checkpoints=c``
the loop keeps at most ``c`` carries and reverses its steps along the schedule
of ``_schedule.py``: Griewank and Walther's binomial schedule (revolve) when the
number of steps is known (``scan``, ``fori_loop``), Stumm and Walther's online
schedule when it is not (``while_loop``). Memory is ``c`` carries plus one step's
internals, whatever ``n``; the price is the provably minimal number of steps run
again (about ``n log n`` for ``c ~ log n``).

How it is built on ``remat``'s machinery (``_autograd.py``):

* ``checkpoints=None`` is a Python loop of remat'd steps, ``scan(remat(f))``:
  each step keeps its input carry and is recomputed once.
* ``checkpoints=c``: the whole loop is one region (:class:`LoopRegion`, a
  :class:`~funckpt._call.UserRegion` whose function is the loop), so captured
  tensors, generators, autocast and every transform's rule come from there.
  Its forward run runs the schedule's forward sweep and keeps the carries it
  stores, with the generators' states at each. Its vjp (:meth:`LoopRegion.own_vjp`)
  executes the rest of the schedule: steps run forward without recording, and
  each step is differentiated on its own (:class:`StepRegion`) by the rule of
  the stack the backward runs at (plain autograd, ``torch.func``, the batched
  cotangents of ``jacrev``), the carry's cotangent chained from step to step.
  Where a vjp must itself be differentiable (``hessian``, ``create_graph=True``)
  the steps are run forward from the loop's inputs with the graph recorded, so
  the result depends on them. Forward mode, ``vmap`` of the region and any other
  recomputation run the loop whole, as ``remat`` runs any function.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch

from . import _autocast, _rng, _schedule
from ._autograd import Phase, Region, StepVjp, Tensors, apply
from ._call import UserRegion, finish, nothing_to_differentiate, prepare, recorded_as_the_function, run_prepared
from ._capture import (
    Roots,
    Substitute,
    changed_captures,
    local_graph_leaves,
    next_sequence_nr,
    reparametrized,
    tensors_inside,
)
from ._draws import Drawing, differs_here
from ._errors import AUTOCAST_UNDER_TRANSFORMS_HINT, CheckpointError, Digest, check_same_values, digest, rebound_error
from ._internals import (
    DisableFuncTorch,
    FunctionModesBack,
    autograd_included,
    bottom,
    compiler_disable,
    forward_ad_level,
    forward_mode_active,
    graph_task_keeps_graph,
    has_gradient_dtype,
    hide_saved_tensors_hooks,
    is_dead_tensor_wrapper,
    peek_interpreter_stack,
    restore_saved_tensors_hooks,
    transforms_active,
    unwrap_if_dead,
    vmap_active,
)
from ._options import RematOptions, callable_name
from ._pytree import NAMESPACE, TreeSlots, flatten, tree_flatten

__all__ = ["fori_loop", "scan", "while_loop"]

#: What torch raises for ``h.register_hook(...)`` on a tensor that does not require grad (see
#: LoopRegion._hook_in_sweep).
_HOOK_WITHOUT_GRAD = "cannot register a hook on a tensor that doesn't require gradient"

# (step number k, carry, x) -> (carry, y): the one signature the three loops share
Step = Callable[[int, Any, Any], tuple[Any, Any]]


# --------------------------------------------------------------------------- public


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    *,
    reverse: bool = False,
    checkpoints: int | None = None,
    policy: Callable[..., bool] | None = None,
    preserve_rng_state: bool = True,
) -> tuple[Any, Any]:
    """``jax.lax.scan``, differentiable with at most ``checkpoints`` carries kept.

    ``f(carry, x) -> (carry, y)`` runs once per slice ``x`` of ``xs`` along its
    leading dimension (or ``length`` times with ``x=None``); returns the final
    carry and the ``y`` stacked along a new leading dimension (``None`` if ``f``
    returns ``y=None``). With ``reverse=True`` the slices are taken from the last
    and ``ys[i]`` still belongs to ``xs[i]``.

    ``checkpoints=None`` keeps every step's input carry and recomputes each step
    once in the backward pass (``policy`` then says what else each step keeps, as
    in :func:`~funckpt.remat`). ``checkpoints=c`` keeps at most ``c`` carries and
    recomputes steps along the optimal binomial schedule; a step's internals then
    live only while that step is differentiated, so there is nothing for a policy
    to keep and ``policy`` has no effect.
    """
    _check_callable("scan", "f", f)
    _check_checkpoints("scan", checkpoints)
    if not isinstance(reverse, bool):
        raise TypeError(f"scan: reverse must be a bool, got {reverse!r}")
    n = _length("scan", xs, length)

    def step(k: int, carry: Any, x: Any) -> tuple[Any, Any]:
        out = f(carry, x)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"scan: f must return a pair (carry, y), got {type(out).__name__}; "
                "return (carry, None) if there is no per-step output"
            )
        return out

    options = _options("scan", policy=policy, preserve_rng_state=preserve_rng_state)
    return _run(step, callable_name(f), f, init, xs, n, reverse, checkpoints, options, reaches=f)


def fori_loop(
    lower: int,
    upper: int,
    body: Callable[[int, Any], Any],
    init: Any,
    *,
    checkpoints: int | None = None,
    policy: Callable[..., bool] | None = None,
) -> Any:
    """``jax.lax.fori_loop``: ``carry = body(i, carry)`` for ``i`` in ``range(lower, upper)``.

    ``i`` is a Python int. ``checkpoints`` and ``policy`` as in :func:`scan`.
    """
    for arg, value in (("lower", lower), ("upper", upper)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"fori_loop: {arg} must be a Python int, got {value!r}")
    _check_callable("fori_loop", "body", body)
    _check_checkpoints("fori_loop", checkpoints)

    def step(k: int, carry: Any, x: Any) -> tuple[Any, Any]:
        return body(lower + k, carry), None

    options = _options("fori_loop", policy=policy)
    n = max(upper - lower, 0)
    carry, _ = _run(step, callable_name(body), body, init, None, n, False, checkpoints, options, reaches=body, api="fori_loop")
    return carry


def while_loop(
    cond: Callable[[Any], Any],
    body: Callable[[Any], Any],
    init: Any,
    *,
    max_steps: int | None = None,
    checkpoints: int | None = None,
    policy: Callable[..., bool] | None = None,
) -> Any:
    """``jax.lax.while_loop``: ``carry = body(carry)`` while ``cond(carry)``, at most ``max_steps`` times.

    ``cond`` returns a Python (or NumPy) bool or a one-element bool tensor. The number of
    steps is not known in advance, so ``checkpoints=c`` places its carries with
    Stumm and Walther's online schedule. ``policy`` as in :func:`scan`.
    """
    _check_callable("while_loop", "cond", cond)
    _check_callable("while_loop", "body", body)
    _check_checkpoints("while_loop", checkpoints)
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 0):
        raise ValueError(f"while_loop: max_steps must be None or an int >= 0, got {max_steps!r}")

    def step(k: int, carry: Any, x: Any) -> tuple[Any, Any]:
        return body(carry), None

    def go_on(k: int, carry: Any) -> bool:
        return (max_steps is None or k < max_steps) and _truth(cond(carry))

    options = _options("while_loop", policy=policy)
    carry, _ = _run(
        step, callable_name(body), body, init, None, None, False, checkpoints, options, go_on, reaches=Roots((body, cond)),
        api="while_loop",
    )
    return carry


# ----------------------------------------------------------------------- arguments


def _check_callable(where: str, arg: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{where}: {arg} must be callable, got {value!r}")


def _check_checkpoints(where: str, checkpoints: Any) -> None:
    if checkpoints is None:
        return
    if not isinstance(checkpoints, int) or isinstance(checkpoints, bool) or checkpoints < 1:
        raise ValueError(
            f"{where}: checkpoints must be None (keep every carry) or an int >= 1 (keep at most that many), "
            f"got {checkpoints!r}"
        )


def _length(where: str, xs: Any, length: Any) -> int:
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 0):
        raise ValueError(f"{where}: length must be None or an int >= 0, got {length!r}")
    leaves, _ = tree_flatten(xs)
    sizes = set()
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            raise TypeError(
                f"{where}: every leaf of xs must be a tensor with a leading dimension to scan over, got {leaf!r}"
            )
        sizes.add(leaf.shape[0])
    if len(sizes) > 1:
        raise ValueError(f"{where}: the leaves of xs have different leading dimensions {sorted(sizes)}")
    if sizes:
        (size,) = sizes
        if length is not None and length != size:
            raise ValueError(f"{where}: length={length} but xs has leading dimension {size}")
        return int(size)
    if length is None:
        raise ValueError(f"{where}: give xs (with at least one tensor) or length, to know the number of steps")
    return int(length)


def _is_numpy_bool(value: Any) -> bool:
    """A NumPy bool (``np.bool_``, what a comparison of NumPy values returns), as JAX's while_loop
    takes it; told without importing NumPy."""
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def _options(api: str, **options: Any) -> RematOptions:
    """The loop's options, checked as remat's are, each error naming the loop rather than remat."""
    try:
        return RematOptions(**options)
    except (TypeError, ValueError) as e:
        message = str(e)
        if not message.startswith("remat:"):
            raise
        raise type(e)(api + message[len("remat") :]) from None


def _truth(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.bool:
            raise TypeError(
                f"while_loop: cond must return a Python bool or a one-element bool tensor, got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}"
            )
        try:
            return bool(value.item())
        except RuntimeError as e:  # data-dependent control flow: batched by vmap, or traced
            if not vmap_active():  # (a trace of the program, linearize's make_fx: no value to read)
                raise CheckpointError(
                    "while_loop: cond returned a tensor whose value cannot be read here (the program is "
                    "being traced, as torch.func.linearize does), and the number of steps depends on it. "
                    "Use fori_loop or scan with a fixed number of steps (and torch.where to stop updating), "
                    "or differentiate without tracing (torch.func.jvp, jacfwd)."
                ) from e
            raise CheckpointError(
                "while_loop: cond returned a tensor whose value differs across a vmap's batch, so the "
                "number of steps would differ per example; funckpt.while_loop runs one Python loop. "
                "Make cond independent of the batched values (a step count, a reduction outside vmap), "
                "or use fori_loop/scan with a fixed number of steps and torch.where to stop updating."
            ) from e
    if isinstance(value, (bool, numbers.Integral)) or _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"while_loop: cond must return a Python or NumPy bool or a one-element bool tensor, got {value!r}")


# ------------------------------------------------------------------------ the loops


def _tensor_leaves(y: Any) -> Any:
    """``y`` with its number leaves as tensors, as they are stacked."""
    if y is None:
        return None
    leaves, treespec = tree_flatten(y)
    return optree.tree_unflatten(treespec, [v if isinstance(v, torch.Tensor) else _number_as_tensor(v) for v in leaves])


def _number_as_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, (bool, int, float, complex)):
        return torch.as_tensor(v)
    raise TypeError(
        f"scan: f returned a y with a leaf of type {type(v).__name__} ({v!r}): each leaf of y is stacked "
        "along a new first dimension, so it must be a tensor or a number (or y None)"
    )


def _distinct(out: Any, inputs: Sequence[torch.Tensor] = ()) -> Any:
    """``out`` with a tensor that appears twice, or is one of the loop's ``inputs`` as it is (a
    carry leaf every step passes along), copied: each output of a Function is its own tensor.

    (An input returned as it is would be a view of it, whose tangent, under forward mode, torch
    requires to be a view of the input's tangent.)"""
    tensors, slots = flatten(out)
    seen: set[int] = {id(t) for t in inputs}
    fresh = []
    for t in tensors:
        fresh.append(t.clone() if id(t) in seen else t)
        seen.add(id(t))
    return slots.fill(fresh)


def _slice(xs: Any, i: int) -> Any:
    return None if xs is None else optree.tree_map(lambda leaf: leaf[i], xs, namespace=NAMESPACE)


def _stack(ys: Sequence[Any]) -> Any:
    """The per-step outputs stacked along a new leading dimension (``None`` when each is ``None``)."""
    if not ys:
        return None
    spec = optree.tree_structure(ys[0], namespace=NAMESPACE)
    for y in ys[1:]:
        if optree.tree_structure(y, namespace=NAMESPACE) != spec:
            raise TypeError(
                f"scan: f returned y of different structures in different steps: {spec} and "
                f"{optree.tree_structure(y, namespace=NAMESPACE)}"
            )
    return optree.tree_map(_stacked_leaf, *ys, namespace=NAMESPACE)


def _stacked_leaf(*leaves: Any) -> torch.Tensor:
    tensors = [torch.as_tensor(v) for v in leaves]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise TypeError(
            f"scan: f returned a y whose leaf changes shape from step to step ({sorted(shapes)}): each leaf "
            "of y is stacked along a new first dimension, so it must have the same shape at every step"
        )
    return torch.stack(tensors)


def _run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """:func:`_loop` as it is where a tracer records the program for a graph without remat
    (:func:`funckpt._call.recorded_as_the_function`: the plain loop of the step, which it
    records), eagerly elsewhere (a graph break under ``torch.compile``)."""
    return (_loop if recorded_as_the_function() else _run_eagerly)(*args, **kwargs)


def _loop(
    step: Step,
    name: str,
    user_fn: Callable[..., Any],
    init: Any,
    xs: Any,
    n: int | None,
    reverse: bool,
    checkpoints: int | None,
    options: RematOptions,
    go_on: Callable[[int, Any], bool] | None = None,
    reaches: Any = None,
    api: str = "scan",
) -> tuple[Any, Any]:
    """Run the loop: remat'd step by step (``checkpoints=None``), or as one :class:`LoopRegion`;
    the plain loop of the step where a tracer records the program (see :func:`_run`).

    ``reaches`` is what the step uses (the user's functions), walked for captured tensors.
    """
    if n == 0:  # nothing to run, nor to stack: the carry as it came in
        return init, None
    recorded = recorded_as_the_function()
    per_step_policy = checkpoints is None and options.policy is not None and not recorded
    if per_step_policy or recorded or nothing_to_differentiate():
        return _remat_each_step(step, name, init, xs, n, reverse, options, go_on, per_step_policy, reaches)
    loop = Loop(step, user_fn, n, reverse, checkpoints, go_on, api)

    def make_region(*args: Any, **kwargs: Any) -> LoopRegion:
        return LoopRegion(loop, *args, **kwargs)

    region, routed = prepare(_placeholder, options, (init, xs), {}, make_region, name, reaches)
    carry, ys = finish(region, routed, apply(region, routed))
    return carry, ys


#: Dynamo shows this where it refuses the loop (``fullgraph=True``): remat's own reason
#: (``eager_under_compile``) would advise an operator-based policy, which cannot make a loop one graph.
_LOOP_REASON = (
    "funckpt.scan, fori_loop and while_loop run eagerly under torch.compile: the loop is a graph break "
    "(the code before and after it is compiled, the loop's steps are not), whatever its policy or "
    "checkpoints, so fullgraph=True cannot include it: compile without fullgraph=True"
)
_run_eagerly = compiler_disable(_LOOP_REASON)(_loop)


def _placeholder(init: Any, xs: Any) -> Any:  # LoopRegion runs the loop itself
    raise AssertionError("unreachable")


def _remat_each_step(
    step: Step,
    name: str,
    init: Any,
    xs: Any,
    n: int | None,
    reverse: bool,
    options: RematOptions,
    go_on: Callable[[int, Any], bool] | None,
    checkpointed: bool,
    reaches: Any,
) -> tuple[Any, Any]:
    """``checkpoints=None`` (or nothing to differentiate): a Python loop of remat'd steps."""
    carry, ys, k = init, [], 0
    while (n is None or k < n) and (go_on is None or go_on(k, carry)):
        i = n - 1 - k if reverse and n is not None else k
        args = (k, carry, _slice(xs, i))
        if checkpointed and not nothing_to_differentiate():
            # remat(step) with the captured tensors looked for in the user's functions
            # (funckpt's own wrappers are library code, which the walk does not enter).
            region, routed = prepare(step, options, args, {}, None, name, reaches)
            region.caller_arguments = None  # (what a step writes into the carry it gets is its own, as in JAX)
            carry, y = run_prepared(region, routed)
        else:
            carry, y = step(*args)
        ys.append(y)
        k += 1
    if reverse:
        ys.reverse()
    return carry, None if all(y is None for y in ys) else _stack(ys)


class Loop:
    """What a checkpointed loop runs: its steps, their number, the order of its slices, its schedule."""

    def __init__(
        self,
        step: Step,
        user_fn: Callable[..., Any],
        n: int | None,
        reverse: bool,
        checkpoints: int | None,
        go_on: Callable[[int, Any], bool] | None,
        api: str = "scan",
    ) -> None:
        self.step, self.user_fn, self.n, self.reverse = step, user_fn, n, reverse
        self.checkpoints, self.go_on = checkpoints, go_on
        self.api = api  # the function that made it (scan, fori_loop, while_loop), for errors

    def schedule(self, n: int) -> list[_schedule.Action]:
        """The whole schedule for ``n`` steps (known in advance) from the loop's start, nothing kept:
        a replay's (see :meth:`LoopRegion.backward_actions`)."""
        return _schedule.binomial(n, self.checkpoints) if self.checkpoints is not None else _every_step(n)

    def sweep_schedule(self, n: int) -> list[_schedule.Action]:
        """The schedule whose forward sweep the forward pass runs and whose rest the backward pass runs.

        The forward pass runs all ``n`` steps (the loop's result is the carry after the last), so
        its backward pass starts from position ``n``; ``binomial(n, c)`` starts reversing at
        position ``n - 1``, which it reaches without keeping it, and the backward pass would run
        again the steps from the last carry kept to ``n - 1`` (one more step than the optimum, or
        none; with ``checkpoints >= n``, one step run again where none need be). This is the
        binomial schedule of ``n + 1`` steps: its forward sweep runs the ``n`` steps, its first
        reversal, ``Reverse(n)``, costs nothing (the result's cotangent is that of the carry at
        ``n``), and it advances the optimum ``t(n + 1, c)`` steps in all, as ``Online`` does."""
        return _schedule.binomial(n + 1, self.checkpoints) if self.checkpoints is not None else _every_step(n)

    def online(self) -> _schedule.Online | EveryStep:
        """The schedule that decides as the loop goes (a while loop's)."""
        return _schedule.Online(self.checkpoints) if self.checkpoints is not None else EveryStep()

    def index(self, k: int) -> int:
        """The slice of ``xs`` (and of ``ys``) step ``k`` takes."""
        if not self.reverse:
            return k
        assert self.n is not None
        return self.n - 1 - k


def _every_step(n: int) -> list[_schedule.Action]:
    """``checkpoints=None``: keep the carry at every position; each step is run once more, to differentiate it."""
    actions: list[_schedule.Action] = []
    for k in range(n):
        actions += [_schedule.Store(k), _schedule.Advance(k, k + 1)] if k < n - 1 else [_schedule.Store(k)]
    for k in range(n - 1, -1, -1):
        # the carry after step k is freed once step k is differentiated: its recomputation is checked against it
        actions += [_schedule.Restore(k), _schedule.Reverse(k)]
        if k + 1 < n:
            actions.append(_schedule.Free(k + 1))
    return [*actions, _schedule.Free(0)]


class EveryStep:
    """:func:`_every_step` for a loop whose number of steps is known only at its end."""

    def __init__(self) -> None:
        self.steps = 0

    def forward(self, position: int) -> list[_schedule.Action]:
        self.steps += 1
        return [_schedule.Store(position)]

    def reverse(self, n: int) -> list[_schedule.Action]:
        return _every_step(n)[2 * n - 1 :]



class _State:
    """A carry at one position of the loop: its tensors, the rest of it, and the generators' states there."""

    __slots__ = ("rng", "slots", "tensors")

    def __init__(self, carry: Any, rng: _rng.RngState | None) -> None:
        tensors, self.slots = flatten(carry)
        self.tensors: list[torch.Tensor] = tensors
        self.rng = rng

    @staticmethod
    def kept(carry: Any, rng: _rng.RngState | None) -> _State:
        """A carry the forward sweep keeps for the backward pass: its tensors as detached aliases
        (same memory), so that one the loop then returns (a carry leaf a later step passes on, a
        shift register's) becomes the Function's output without the kept state becoming it too."""
        tensors, slots = flatten(carry)
        return _State.of([t.detach() for t in tensors], slots, rng)

    @staticmethod
    def of(tensors: Sequence[torch.Tensor], slots: TreeSlots, rng: _rng.RngState | None) -> _State:
        state = _State.__new__(_State)
        state.tensors, state.slots, state.rng = list(tensors), slots, rng
        return state

    @property
    def carry(self) -> Any:
        return self.slots.fill(self.tensors)


#: torch.utils.checkpoint's warning, with use_reentrant=True, where none of its inputs requires grad.
_NO_INPUT_REQUIRES_GRAD = "None of the inputs have requires_grad=True"


@contextlib.contextmanager
def _reentrant_checkpoint_warning_off() -> Iterator[None]:
    """Without torch.utils.checkpoint's :data:`_NO_INPUT_REQUIRES_GRAD` (see LoopRegion._carries_not_requiring_grad)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _NO_INPUT_REQUIRES_GRAD, UserWarning, r"torch\.utils\.checkpoint")
        yield


class LoopRegion(UserRegion):
    """A checkpointed loop as one region: ``(init, xs) -> (carry, ys)``, reversed step by step."""

    recomputes_like_forward = False  # its reversal runs steps in other orders and contexts

    def __init__(self, loop: Loop, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop = loop
        # The loop itself runs through run_fn, not through fn: a bound method of this
        # region stored here would be a reference cycle that keeps the kept carries
        # until the garbage collector runs. fn is the user's step function.
        self.fn = loop.user_fn
        # The forward run records no graph (that would keep every step's internals),
        # and outputs that alias inputs stay the Function's own (as views of them).
        self.caller_grad_enabled = False
        self.views_outside = False
        self.saved = None  # a step's internals live only while it is differentiated: nothing to keep
        self.kept: dict[int, _State] | None = None  # what the forward sweep stored, until the backward
        self.prefix: list[_schedule.Action] = []  # the forward sweep's actions, for a replay
        # Per step of the forward sweep, the digest of what it returned (its carry and y), which
        # every run of it again in the backward pass must reproduce (the determinism check).
        self.step_digests: list[list[Digest | None]] = []
        # And the shape and dtype of each tensor it returned (checked with the check off too).
        self.step_metas: list[list[tuple[torch.Size, torch.dtype]]] = []
        self.n_steps = 0
        self.swept = False  # has a forward sweep counted the steps (n_steps), which a recomputation runs?
        self.carry_slots: TreeSlots | None = None
        self.n_carry = 0
        self._forward = False
        self._inputs: tuple[torch.Tensor, ...] = ()
        # The run's stand-ins for the captured tensors (id of one to its stand-in), for the
        # steps that return a captured tensor as it is (see _call_step).
        self._stand_ins: dict[int, torch.Tensor] = {}
        self._run_inputs: Tensors = ()  # the run's inputs (see _distinct)
        self._online: _schedule.Online | EveryStep | None = None
        self._last_rng: _rng.RngState | None = None
        self._sweep_kept: dict[int, _State] | None = None  # what the forward sweep has stored, while it runs
        # During a reversal: the differentiable tensors the step function reaches and did not at the
        # call (see reached_since_the_call), whose use its steps run again refuse (see substituted).
        self.reached: list[torch.Tensor] = []
        # During the forward run, the non-tensor leaves the loop returned (see _refuse_hidden_tensors).
        self._returned_leaves: tuple[Any, ...] = ()
        # During the forward sweep: the carry the last step returned with its tensors' versions, and
        # the first step that wrote into its carry in place (see _watch_carry_writes).
        self._sweep_carry: tuple[list[torch.Tensor], list[int]] | None = None
        self._carry_written: int | None = None

    # ---------------------------------------------------------------- the runs

    escapes_become_outputs = False  # (its steps are reversed one at a time, not found in a recomputation)

    def _call_fn(self, args: tuple[Any, ...], kwargs: dict[str, Any], forward: bool, grad_forward: bool) -> Any:
        self._forward = forward
        with self._carries_not_requiring_grad():
            return super()._call_fn(args, kwargs, forward, grad_forward)

    def _carries_not_requiring_grad(self) -> contextlib.AbstractContextManager[Any]:
        """Around steps run without grad to advance the loop (the forward sweep, a reversal's runs from a
        kept carry): without ``torch.utils.checkpoint(..., use_reentrant=True)``'s warning that none of
        its inputs requires grad, where the loop is differentiated.

        Those runs record nothing, so the carries a step gets there do not require grad, where without
        funckpt they do (the loop's differentiable inputs flow into them), and a reentrant checkpoint in
        the step warns "Gradients will be None": they are not, the steps run again to be differentiated
        get carries that require grad. (The same warning where the loop is not differentiated is torch's.)
        """
        if torch.is_grad_enabled() or not any(self.differentiable):
            return contextlib.nullcontext()
        return _reentrant_checkpoint_warning_off()

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        self._stand_ins = self.replacements([flat[i] for i in self.captured_index])[1]
        self._run_inputs = flat
        try:
            return super().run(flat, phase)
        finally:
            self._stand_ins, self._run_inputs = {}, ()

    def forward_run(self, flat: Tensors) -> Tensors:
        self._inputs = flat
        self._carry_written = None
        try:
            out = super().forward_run(flat)
        finally:
            self._returned_leaves, self._sweep_carry = (), None
        if not any(self.differentiable):  # (with nothing to differentiate, nothing runs again)
            return out
        assert self.carry_slots is not None
        init_index = set(self.arg_index[: len(self.carry_slots.tensor_positions)])
        if any(i in init_index for i in self.snapshots):
            self._undo_writes(flat)
            raise self._carry_written_error(0)
        if self.snapshots:
            self._undo_writes(flat)
            raise CheckpointError(
                f"{self.loop.api}({self.name}): a step modified one of the loop's inputs in place (for example a "
                "BatchNorm's running statistics in training mode). A checkpointed loop runs steps again "
                "from its kept carries and cannot replay such updates. Carry the state in the loop's "
                "carry, put the module in eval mode, or write the loop in Python with funckpt.remat on "
                "each step (for x in xs: carry, y = funckpt.remat(f)(carry, x)), which replays them."
            )
        return out

    def _undo_writes(self, flat: Tensors) -> None:
        """Put the inputs the forward sweep wrote in place back as they were at the call.

        The sweep ran every step before the writes could be refused (a BatchNorm's running
        statistics updated once per step): the call then raises, and a caller that catches the
        error and runs the loop another way (a Python loop of remat'd steps, as the error says)
        must find its modules as they were, not advanced by the refused call's steps.
        """
        with torch.no_grad():
            for i, before in self.snapshots.items():
                if i in self.unbatched_snapshots:  # (copied from under functorch's wrappers: written there)
                    with DisableFuncTorch():
                        bottom(flat[i]).copy_(before)
                else:
                    flat[i].copy_(before)

    def _refuse_hidden_tensors(self, leaves: tuple[Any, ...], plain_autograd: bool) -> None:
        """As remat's, and the leaves the loop returned are kept for the rest of the forward run.

        The sweep runs without grad, so a tensor a step returns inside a type optree does not
        flatten (a carry of a plain dataclass) does not require grad there and passes remat's
        check; its computation from the differentiable inputs is found afterwards, as a tensor
        kept outside the call, and :meth:`_refuse_escape_under_transform` then names the type."""
        super()._refuse_hidden_tensors(leaves, plain_autograd)
        self._returned_leaves = leaves

    def _unflattened_leaf_holding(self, t: torch.Tensor) -> Any:
        """A leaf of what the loop returned (its carry, its ys) that optree does not flatten and that
        holds ``t``, if one does (asked only to word a refusal)."""
        for leaf in self._returned_leaves:
            if leaf is None or isinstance(leaf, (str, bytes, int, float, complex, torch.dtype, torch.device)):
                continue
            if any(u is t for u in tensors_inside(leaf)):
                return leaf
        return None

    def _refuse_escape_under_transform(self, t: torch.Tensor, also_returned: bool = False) -> None:
        api = self.loop.api
        holder = self._unflattened_leaf_holding(t)
        if holder is not None:
            kind = type(holder).__qualname__
            raise CheckpointError(
                f"{api}({self.name}): a step returned a tensor of shape {tuple(t.shape)} inside a {kind} in its "
                f"carry, a type optree does not flatten, so the loop passes the {kind} along as it is and a "
                f"gradient through the tensor would be silently missing. Register {kind} as a pytree node "
                f"(optree.register_pytree_node({kind}, flatten_fn, unflatten_fn, namespace='funckpt')), or "
                "carry the tensor in a tuple, list, dict or namedtuple."
            )
        where = "its step or its cond" if api == "while_loop" else "its step"
        keep = "from the step, as its y (scan stacks the ys)" if api == "scan" else "in the carry (or use scan, and return it as its y)"
        raise CheckpointError(
            f"{api}({self.name}): a tensor of shape {tuple(t.shape)} that {where} computed from the loop's "
            "differentiable inputs outlived the call other than as its return value in a step of a checkpointed "
            "loop (kept by a forward hook, a list or dict it appends to, a global, or a module attribute; "
            "an auxiliary loss stored on a module). The loop's forward sweep records no graph, and its steps run again one at a time in "
            f"the backward pass, so a gradient through that tensor would be silently missing. Return it {keep}, "
            "or detach it if it is only kept for logging (also one computed under torch.no_grad in a step: "
            "the sweep itself runs under no_grad, so that cannot tell it from one with a gradient)."
        )

    def reached_since_the_call(self) -> list[torch.Tensor]:
        self._reached = changed_captures(self.loop.user_fn, self.captured)
        return self._reached

    def rebound(self, t: torch.Tensor) -> CheckpointError:
        return rebound_error(
            f"{self.loop.api}({self.name})", "the step function", t, "Pass such tensors in the carry or xs", self._reached
        )

    def run_fn(self, init: Any, xs: Any) -> tuple[Any, Any]:
        """The loop's function: the forward sweep in the forward run, the whole loop in a recomputation."""
        return self._forward_sweep(init, xs) if self._forward else self._whole(init, xs)

    def _steps_go_on(self, k: int, carry: Any) -> bool:
        loop = self.loop
        if loop.n is not None:
            return k < loop.n
        assert loop.go_on is not None
        try:
            return loop.go_on(k, carry)
        except RuntimeError as e:
            if self._forward and _HOOK_WITHOUT_GRAD in str(e):
                raise self._hook_in_sweep(k, "its cond, before step") from e
            raise

    def _call_step(self, k: int, carry: Any, xs: Any) -> tuple[Any, Any]:
        x = None if xs is None else _slice(xs, self.loop.index(k))
        try:
            new, y = self.loop.step(k, carry, x)
        except RuntimeError as e:
            if self._forward and _HOOK_WITHOUT_GRAD in str(e):
                raise self._hook_in_sweep(k) from e
            raise
        assert self.carry_slots is not None
        tensors, slots = flatten(new)
        if (slots.treespec, slots.tensor_positions) != (self.carry_slots.treespec, self.carry_slots.tensor_positions):
            if slots.treespec == self.carry_slots.treespec:
                # Same structure, a leaf became a tensor (or stopped being one): JAX's weakly typed init=0.
                was, now = set(self.carry_slots.tensor_positions), set(slots.tensor_positions)
                leaf = min(was ^ now)
                raise TypeError(
                    f"{self.loop.api}({self.name}): a step returned a carry whose leaf {leaf} is "
                    f"{'a tensor' if leaf in now else type(slots.leaves[leaf]).__name__} where the loop's initial "
                    f"carry has {'a tensor' if leaf in was else type(self.carry_slots.leaves[leaf]).__name__}: a "
                    "loop's carry keeps its structure and which leaves are tensors. Give the initial carry a "
                    "tensor there (torch.tensor(0.0), not 0)."
                )
            raise TypeError(
                f"{self.loop.api}({self.name}): a step returned a carry of structure {slots.treespec}, but the "
                f"loop's initial carry has structure {self.carry_slots.treespec} (with tensors at the same "
                "places): a loop's carry keeps its structure"
            )
        y = _tensor_leaves(y)
        if self._stand_ins:  # a captured tensor returned as it is: its stand-in, as an operator would get
            new = slots.fill(_stood_in(tensors, self._stand_ins))
            y_tensors, y_slots = flatten(y)
            y = y_slots.fill(_stood_in(y_tensors, self._stand_ins))
        if self._forward:
            self._watch_carry_writes(k, tensors)
            outputs = _step_outputs(new, y)
            self.step_metas.append([(t.shape, t.dtype) for t in outputs])
            if self._compares_values():
                self.step_digests.append(digest(outputs))
        return new, y

    def _recomputation_message(self, e: Exception) -> str:
        """remat's message for what a step (or a while loop's cond) run again raised, naming the loop."""
        message = super()._recomputation_message(e)
        remat = f"remat({self.name}): "
        return f"{self.loop.api}({self.name}): " + message[len(remat) :] if message.startswith(remat) else message

    def _carry_written_error(self, k: int) -> CheckpointError:
        where = "its cond or step" if self.loop.api == "while_loop" else "step"
        return CheckpointError(
            f"{self.loop.api}({self.name}): {where} {k} modified its carry in place (a tensor the "
            f"{'previous step returned' if k else 'loop was given as its initial carry'}: `i += 1`, "
            "`h.mul_(...)`, `c[j] = ...` on a carry tensor). A checkpointed loop keeps carries and runs steps "
            "again from them in the backward pass, and differentiates each step at its input carry, which "
            "such a write changes. Compute the new carry out of place (`i = i + 1`, `h = h * ...`, "
            "`torch.where`, `index_put`), or clone the carry in the step before writing into it (`h = h.clone()`)."
        )

    def _watch_carry_writes(self, k: int, tensors: list[torch.Tensor]) -> None:
        """In the forward sweep: note the first step ``k`` that wrote into the carry the step before
        returned (its version counter moved; the initial carry's writes are the write watch's), which
        :meth:`own_vjp` refuses. Such a write also changes that carry where the sweep kept it (a
        detached alias), and the steps run again from it in the backward pass would compute another
        thing: a refusal that blamed the step's determinism, or none where values are not compared
        (``preserve_rng_state=False``), a silently wrong gradient. (Forward mode and a vmap run the
        loop whole, as the Python loop, where such a write is as harmless as there.)"""
        if self._sweep_carry is not None and self._carry_written is None:
            before, versions = self._sweep_carry
            if _versions(before) != versions:
                self._carry_written = k
        self._sweep_carry = (tensors, _versions(tensors))

    def _hook_in_sweep(self, k: int, where: str = "step") -> CheckpointError:
        """The error for a step (or a while loop's cond) that registers a hook (``h.register_hook``)
        on a tensor the loop computed.

        The forward sweep runs the steps without grad (it records no graph: each step is
        differentiated only when it runs again in the backward pass), so no tensor a step computes
        there requires grad, and torch refuses the hook, where without the loop it is allowed.
        A Python loop of remat'd steps supports such hooks (and their handles' ``remove()``)."""
        return CheckpointError(
            f"{self.loop.api}({self.name}): {where} {k} registered a hook (register_hook) on a tensor the loop "
            "computed (an intermediate, or a carry an earlier step returned), which torch refused: a checkpointed "
            "loop's forward sweep runs its steps without grad (it records no graph; each step is differentiated "
            "when it runs again in the backward pass), so nothing a step computes there requires grad. Hooks on "
            "a step's intermediates and carries are not supported in a checkpointed loop: register the hook on "
            "the loop's result or on its inputs (the initial carry, xs, a parameter), "
            "or write the loop in Python with funckpt.remat on each step (for x in xs: carry, y = "
            "funckpt.remat(f)(carry, x)), which supports them. (If that tensor does not require grad without "
            "the loop either, torch refuses the hook there too.)"
        )

    def check_step_again(self, k: int, outputs: list[torch.Tensor]) -> None:
        """Did step ``k``, run again in the backward pass, return what it returned in the forward sweep
        (``outputs``: its carry's tensors and its y's, :func:`_step_outputs`)?"""
        if k < len(self.step_metas) and len(outputs) != len(self.step_metas[k]):
            raise CheckpointError(
                f"{self.loop.api}({self.name}): run again in the backward pass, step {k} returned {len(outputs)} tensors (its "
                f"carry's and its y's) where the forward pass had {len(self.step_metas[k])}. A step must compute the same "
                "thing when called again with the same carry: it may depend on state that changed (a counter, a "
                "global, an iterator). Pass such values in the carry or xs."
            )
        if k < len(self.step_digests) and self._compares_values():
            try:
                check_same_values(f"{self.loop.api}({self.name})", self.step_digests[k], digest(outputs), None, step=k)
            except CheckpointError as e:
                if self.autocast is _autocast.OFF or not transforms_active():
                    raise
                raise CheckpointError(str(e) + AUTOCAST_UNDER_TRANSFORMS_HINT) from None

    def _forward_sweep(self, init: Any, xs: Any) -> tuple[Any, Any]:
        loop = self.loop
        tensors, self.carry_slots = flatten(init)
        kept: dict[int, _State] = {}
        self._sweep_kept = kept  # (for generator_found, while the sweep runs)
        prefix: list[_schedule.Action] = []
        ys: list[Any] = []
        # (A carry of containers the first step may write into, as in JAX its own: not the run's
        # argument, which outlives the sweep, and would keep what the step wrote there.)
        carry = self.carry_slots.fill(tensors)
        if loop.n is not None:  # known number of steps: the schedule's forward sweep, then any step it leaves
            actions = loop.sweep_schedule(loop.n) if loop.n > 0 else []
            for action in actions:
                if isinstance(action, _schedule.Reverse):
                    break
                prefix.append(action)
                if isinstance(action, _schedule.Store):
                    kept[action.position] = _State.kept(carry, self._generators_now())
                elif isinstance(action, _schedule.Free):
                    kept.pop(action.position, None)
                elif isinstance(action, _schedule.Advance):
                    for k in range(action.start, action.stop):
                        carry, y = self._call_step(k, carry, xs)
                        ys.append(y)
            for k in range(len(ys), loop.n):  # (checkpoints=None: the last step)
                carry, y = self._call_step(k, carry, xs)
                ys.append(y)
            self.n_steps = loop.n
        else:  # a while loop: the online schedule decides as it goes
            online = loop.online()
            k = 0
            while self._steps_go_on(k, carry):
                for action in online.forward(k):
                    prefix.append(action)
                    if isinstance(action, _schedule.Store):
                        kept[action.position] = _State.kept(carry, self._generators_now())
                    elif isinstance(action, _schedule.Free):
                        kept.pop(action.position, None)
                carry, y = self._call_step(k, carry, xs)
                prefix.append(_schedule.Advance(k, k + 1))
                ys.append(y)
                k += 1
            self.n_steps = k
            self._online = online
        self.swept = True
        self.kept, self.prefix = kept, prefix
        self._sweep_kept = self._sweep_carry = None
        tensors, _ = flatten(carry)
        self.n_carry = len(tensors)
        stacked = self._stacked(ys)
        carry, stacked = _distinct((carry, stacked), self._run_inputs)
        return carry, stacked

    def _stacked(self, ys: list[Any]) -> Any:
        if self.loop.reverse:
            ys = ys[::-1]
        return None if all(y is None for y in ys) else _stack(ys)

    def _whole(self, init: Any, xs: Any) -> tuple[Any, Any]:
        """The loop run straight through (a recomputation: forward mode, vmap, a higher-order vjp's).

        As many steps as the forward sweep ran: a while loop's ``cond`` is called before each step and
        at the end, as in the sweep, for the random numbers it draws (see :meth:`cond_again`), but its
        answer was the sweep's. A ``cond`` that counts its calls or the steps in a Python variable
        (``max_iter``) would stop a recomputation early, and the steps it runs are checked anyway."""
        tensors, slots = flatten(init)
        carry, ys = slots.fill(tensors), []  # (the first step's own carry: see _forward_sweep)
        if self.loop.n is None and not self.swept:  # (no sweep counted them: cond decides)
            k = 0
            while self._steps_go_on(k, carry):
                carry, y = self._call_step(k, carry, xs)
                ys.append(y)
                k += 1
        else:
            draws = self.loop.go_on is not None and self.options.preserve_rng_state
            for k in range(self.n_steps):
                if draws:
                    self._steps_go_on(k, carry)
                carry, y = self._call_step(k, carry, xs)
                ys.append(y)
            if draws:
                self._steps_go_on(self.n_steps, carry)  # (where the sweep's last call of cond stopped it)
        carry, stacked = _distinct((carry, self._stacked(ys)), self._run_inputs)
        return carry, stacked

    def generator_found(self, generator: torch.Generator) -> None:
        """As a remat'd call's (see ``UserRegion.generator_found``), and the carries the forward sweep
        has stored so far replay it too, from the same state: the steps before the first draw from
        it left it as it was at the call."""
        assert self.rng is not None
        state = generator.get_state()
        super().generator_found(generator)
        for kept in (self._sweep_kept or {}).values():
            if kept.rng is not None and kept.rng is not self.rng:
                _rng.add(kept.rng, generator, state)

    def _generators_now(self) -> _rng.RngState | None:
        """The generators' states here, to replay from a kept carry.

        A step that draws no random numbers leaves them unchanged: the state kept
        with the previous carry is then shared (the CPU generator's alone is 5 KB,
        more than many carries).
        """
        if not self.options.preserve_rng_state:
            return None
        state = _rng.capture(self._inputs, self.generators)
        if self._last_rng is not None and _rng.same(state, self._last_rng):
            return self._last_rng
        self._last_rng = state
        return state

    def release_kept(self) -> None:
        super().release_kept()
        self.kept = None

    def run_step_again(self, k: int, carry: Any, x: Any, cond_first: bool = False) -> tuple[Any, Any]:
        """Step ``k`` in the backward pass; what it raises that the forward pass did not is a CheckpointError.

        ``cond_first``: a while loop's ``cond`` runs before it, as in the forward sweep (see
        :meth:`cond_again`)."""
        if cond_first:
            self.cond_again(k, carry)
        with self._as_in_the_sweep(), self._carries_not_requiring_grad():
            cache_was_on = _autocast.cache_off(self.autocast)
            try:
                return self.loop.step(k, carry, x)
            finally:
                if cache_was_on:
                    _autocast.cache_on()

    def cond_again(self, k: int, carry: Any) -> None:
        """A while loop's ``cond`` at position ``k`` in the backward pass, for the random numbers it draws.

        The forward sweep calls ``cond`` before each step, and stores each carry with the generators'
        states after that call: a ``cond`` that draws (a loop that stops at random) moves them
        between two steps. A run of steps again from a stored carry calls it before each step but
        the first, and at the position it stops at, so that each step draws what it drew in the
        forward sweep, and a carry stored again has the states after ``cond``, as the sweep's.
        (Its answer was the forward sweep's: the steps it ran again are checked.)"""
        if self.loop.n is not None or not self.options.preserve_rng_state:
            return
        assert self.loop.go_on is not None
        with self._as_in_the_sweep():
            self.loop.go_on(k, carry)

    @contextlib.contextmanager
    def _as_in_the_sweep(self) -> Iterator[None]:
        """Run a step (or a while loop's ``cond``) again in the backward pass as the forward sweep ran
        it; what it raises that the sweep did not is a CheckpointError.

        Autocast as in the forward run, around the step only: its vjp runs under the backward's
        autocast, as the loop's would without remat. Its dropouts as at the loop's call (see _draws):
        a step's vjp may run it under transforms the call was not made under, or below those it was."""
        try:
            functorch = self.functorch_draws
            drawing = Drawing(functorch, self.draws_by_layout and differs_here(functorch))
            with _autocast.replay(self.autocast), drawing, FunctionModesBack(self.function_modes):
                yield
        except CheckpointError:
            raise
        except Exception as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise self._recomputation_raised(e) from e

    # ---------------------------------------------------------------- the vjp

    @contextlib.contextmanager
    def substituted(
        self, captured: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], differentiated: bool = False
    ) -> Iterator[dict[int, torch.Tensor]]:
        """The step function sees ``captured`` where it reaches the tensors captured at the call.

        Yields the substitution (``id`` of a captured tensor to what stands in for it): a step
        that returns a captured tensor as it is (``lambda c, x: (c * w, w)``) hands back the
        tensor itself, which no operator received; :func:`_stood_in` puts the stand-in there.
        Where the step function reaches tensors it did not at the call (:attr:`reached`, during
        a reversal), the substitution runs to refuse a use of one. ``differentiated``: the step runs
        to be differentiated (not to advance from a kept carry, where values are all it needs)."""
        replace, mapping = self.replacements(captured)
        with contextlib.ExitStack() as stack:
            if self.captured.modules:
                stack.enter_context(reparametrized(self.captured, replace))
            if mapping or self.reached:
                substitute = Substitute(mapping, tuple(inputs), False, self.name, 0)
                if self.reached:
                    substitute.reached_since_the_call(self.reached, self.rebound)
                # Below torch.func.vjp's vjp_fn the captured tensors are wrappers of a level that is
                # gone, and a custom autograd.Function's .apply hands its forward the tensor under
                # such a wrapper, not the wrapper the substitution swaps: a use of it is refused (its
                # gradient would be silently missing; see StepRegion._refuse_unrouted for the rest).
                dead = {
                    id(u): u
                    for u in (unwrap_if_dead(t) for t in self.captured.tensors if id(t) in mapping and is_dead_tensor_wrapper(t))
                } if differentiated else {}
                if dead:
                    rebound = substitute.rebound
                    substitute.reached_since = {**substitute.reached_since, **dead}
                    substitute.rebound = lambda t: self.unrouted() if id(t) in dead else rebound(t)  # type: ignore[misc]
                stack.enter_context(substitute)
            yield mapping

    def unrouted(self) -> CheckpointError:
        """The error for a step that uses a tensor it reaches without routing it (see StepRegion._refuse_unrouted)."""
        return CheckpointError(
            f"{self.loop.api}({self.name}): a differentiable tensor the step reaches without "
            "receiving it (in its closure, a global) reached its result without being routed through "
            "the loop: typically passed straight to a custom autograd.Function (whose .apply remat "
            "cannot intercept). Its gradient would be missing. Pass the tensor in the carry (or "
            "xs), or call the Function inside a remat'd function that takes it as an argument."
        )

    def stood_in_again(self, tensors: list[torch.Tensor], mapping: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """:func:`_stood_in` for what steps run again in a reversal returned; a tensor among them the
        step function reaches only since the call (:attr:`reached`: a closure variable rebound since,
        returned as it is, which no operator received for the mode to refuse) is refused."""
        if self.reached:
            self._refuse_reached_returned(tensors, self.reached)
        return _stood_in(tensors, mapping)

    def own_vjp(
        self,
        primals: Tensors,
        cotangents: Tensors,
        needs: Sequence[bool],
        *,
        create_graph: bool,
        advancing: Callable[[], contextlib.AbstractContextManager[Any]],
        step_vjp: StepVjp,
    ) -> list[torch.Tensor | None] | None:
        if self._carry_written is not None:
            raise self._carry_written_error(self._carry_written)
        reached, self.reached = self.reached, self.reached_since_the_call()
        hidden = hide_saved_tensors_hooks()  # (the steps' graphs are the loop's internals, as in its runs)
        try:
            # (the steps run again record the graphs the gradient comes from, also below a
            # torch.func level entered in inference_mode: see UserRegion's recomputation)
            with autograd_included():
                return Reversal(self, primals, cotangents, needs, create_graph, advancing, step_vjp).run()
        finally:
            self.reached = reached
            if hidden:
                restore_saved_tensors_hooks()

    def backward_actions(self, replay: bool) -> list[_schedule.Action]:
        """The schedule from the end of the forward sweep (or, with ``replay``, from the loop's start)."""
        n = self.n_steps
        if n == 0:
            return []
        if self.loop.n is not None:
            if replay:
                return self.loop.schedule(n)
            actions = self.loop.sweep_schedule(n)
            first = next(i for i, a in enumerate(actions) if isinstance(a, _schedule.Reverse))
            if actions[first] == _schedule.Reverse(n):  # (the carry at n is the result: nothing to do)
                first += 1
            return actions[first:]
        assert self._online is not None
        rest = self._online.reverse(n)
        if replay:  # the forward sweep again, up to the last step's start
            assert isinstance(self.prefix[-1], _schedule.Advance)
            return [*self.prefix[:-1], *rest]
        return rest


class StepRegion(Region):
    """Step ``k`` of a loop as a region: ``(carry, x, captured) -> (carry, y)``, for its vjp."""

    def __init__(self, region: LoopRegion, k: int, carry_slots: TreeSlots, x_slots: TreeSlots | None) -> None:
        self.region, self.k, self.carry_slots, self.x_slots = region, k, carry_slots, x_slots
        self.name = region.name
        self.n_carry = len(carry_slots.tensor_positions)
        self.n_x = 0 if x_slots is None else len(x_slots.tensor_positions)
        self.expected: list[tuple[torch.Size, torch.dtype]] = []  # the outputs' shapes and dtypes (the cotangents')

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        nc, nx = self.n_carry, self.n_x
        carry = self.carry_slots.fill(flat[:nc])
        x = None if self.x_slots is None else self.x_slots.fill(flat[nc : nc + nx])
        with self.region.substituted(flat[nc + nx :], flat, differentiated=True) as mapping:
            first_node = next_sequence_nr()
            new, y = self.region.run_step_again(self.k, carry, x)
        outputs = _step_outputs(new, _tensor_leaves(y))
        self.region.check_step_again(self.k, outputs)
        if mapping and torch.is_grad_enabled():
            self._refuse_unrouted(outputs, flat, mapping, first_node)
        tensors = self.region.stood_in_again(outputs, mapping)
        for t, (shape, dtype) in zip(tensors, self.expected):
            if t.shape != shape or (has_gradient_dtype(t) and t.dtype != dtype):
                raise CheckpointError(
                    f"{self.region.loop.api}({self.name}): run again in the backward pass, step {self.k} returned a tensor of "
                    f"shape {tuple(t.shape)} and dtype {t.dtype} where the forward pass had shape "
                    f"{tuple(shape)} and dtype {dtype}. A step must compute the same thing when called again "
                    "with the same carry: it may depend on state that changed (a counter, a global, an "
                    "iterator). Pass such values in the carry or xs."
                )
        return tuple(tensors)

    def _refuse_unrouted(
        self, outputs: list[torch.Tensor], flat: Tensors, mapping: dict[int, torch.Tensor], first_node: int
    ) -> None:
        """Refuse a step whose graph reaches a captured tensor itself rather than its stand-in.

        The stand-ins are what the step's vjp differentiates; a captured tensor passed straight to
        a custom ``autograd.Function`` (whose ``.apply`` no torch-function mode sees, so the
        substitution cannot route it) is a graph edge to the caller's tensor, whose gradient the
        vjp would silently drop (remat's forward run refuses the same; a loop's forward sweep
        records no graph, so it is told here, the first time the step is differentiated). Found as
        in :func:`~funckpt._capture.local_graph_leaves`: the captured tensor's own leaf, or a node
        made before the step ran (a captured tensor computed outside) other than the inputs'.
        """
        inputs: set[int] | None = None  # the inputs' own nodes, where older ones are met (create_graph)

        def older_input(number: int) -> bool:
            nonlocal inputs
            if inputs is None:
                inputs = {t.grad_fn._sequence_nr() for t in (*flat, *mapping.values()) if t.grad_fn is not None}
            return number in inputs

        foreign, _ = local_graph_leaves(outputs, (), first_node, lambda leaf: id(leaf) not in mapping, older_input)
        if foreign:
            raise self.region.unrouted()


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """The tensors' version counters (-1 for an inference tensor, which has none: nothing outside
    inference mode can write it)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # (an inference tensor: rare, so asked only then)
        return [-1 if t.is_inference() else t._version for t in tensors]


def _step_outputs(carry: Any, y: Any) -> list[torch.Tensor]:
    """The tensors a step returned, its carry's and its y's, in order: what its digest is taken of."""
    return flatten((carry, y))[0]


def _stood_in(tensors: list[torch.Tensor], mapping: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each captured tensor a step returned as it is replaced by its stand-in, as an
    operator receiving it would have it: the stand-in is the input the step is differentiated at."""
    return [mapping.get(id(t), t) for t in tensors] if mapping else tensors


class Reversal:
    """One execution of a loop's backward schedule: cotangents in, gradients of the loop's inputs out."""

    def __init__(
        self,
        region: LoopRegion,
        primals: Tensors,
        cotangents: Tensors,
        needs: Sequence[bool],
        create_graph: bool,
        advancing: Callable[[], contextlib.AbstractContextManager[Any]],
        step_vjp: StepVjp,
    ) -> None:
        self.region, self.primals, self.needs = region, primals, needs
        self.create_graph, self.advancing, self.step_vjp = create_graph, advancing, step_vjp
        self.loop = region.loop
        n_args = len(region.arg_index)
        n_init = len(region.carry_slots.tensor_positions) if region.carry_slots is not None else 0
        self.init_index = region.arg_index[:n_init]
        self.xs_index = region.arg_index[n_init:n_args]
        self.captured = tuple(primals[i] for i in region.captured_index)
        self.xs = [primals[i] for i in self.xs_index]
        self.x_slots: TreeSlots | None = None
        if self.xs:
            xs_tree = region.argspec.dynamic.fill([primals[i] for i in region.arg_index])[0][1]
            _, self.x_slots = flatten(_slice(xs_tree, 0))
        nc = region.n_carry
        self.ct_carry: list[torch.Tensor] = list(cotangents[:nc])
        # The loop's input carry's gradients, from the first step's vjp: None where nothing used it,
        # as in the plain loop (a later step's carry gets a zero cotangent where none came).
        self.init_grads: list[torch.Tensor | None] | None = None
        self.ct_ys = list(cotangents[nc:])
        self.grads: list[torch.Tensor | None] = [None] * len(primals)
        self.stored: dict[int, _State] = {}  # the carries kept now, by position
        self.x_grads: dict[int, list[torch.Tensor | None]] = {
            j: [None] * region.n_steps for j, i in enumerate(self.xs_index) if needs[i]
        }

    def _add(self, i: int, g: torch.Tensor | None) -> None:
        if g is None or not self.needs[i]:
            return
        old = self.grads[i]
        self.grads[i] = g if old is None else old + g

    def _x(self, k: int) -> list[torch.Tensor]:
        i = self.loop.index(k)
        return [x[i] for x in self.xs]

    def run(self) -> list[torch.Tensor | None]:
        region = self.region
        n = region.n_steps
        stored = self._take_kept()
        replay = stored is None
        # The generators as at the loop's start, put back afterwards. Not autocast: the
        # steps' vjps run under the backward's, only their recomputations under the forward's.
        with region._replay_state(autocast=False):
            if stored is None:
                stored = {}
                init = [self.primals[i] for i in self.init_index]
                assert region.carry_slots is not None
                start = _State.of(init, region.carry_slots, region.rng)
                if region.loop.n is None:  # (the generators as at position 0: after cond, see cond_again)
                    with self.advancing(), region.substituted(self.captured, self.primals):
                        region.cond_again(0, start.carry)
                state: _State | None = start
                position: int | None = 0
            else:
                state, position = None, None
            self.stored = stored
            for action in region.backward_actions(replay):
                if isinstance(action, _schedule.Advance):
                    state, position = self._goto(stored, state, position, action.start)
                    state = self._advance(state, action.start, action.stop)
                    position = action.stop
                elif isinstance(action, _schedule.Store):
                    assert state is not None and position == action.position
                    stored[action.position] = _State.of(state.tensors, state.slots, region._generators_now())
                elif isinstance(action, _schedule.Restore):
                    state, position = self._restore(stored, action.position), action.position
                elif isinstance(action, _schedule.Free):
                    stored.pop(action.position, None)
                elif isinstance(action, _schedule.Reverse):
                    k = action.position
                    state, position = self._goto(stored, state, position, k)
                    self._reverse(state, k)
                    state, position = None, None
        for i, g in zip(self.init_index, self.ct_carry if self.init_grads is None else self.init_grads):
            self._add(i, g)
        for j, per_step in self.x_grads.items():
            if any(g is not None for g in per_step):
                xs = self.xs[j]
                self._add(
                    self.xs_index[j],
                    torch.stack([torch.zeros_like(xs[0]) if g is None else g for g in per_step]),
                )
        return self.grads

    def _take_kept(self) -> dict[int, _State] | None:
        """The forward sweep's carries, if this backward may start from them.

        Not when the result must be differentiable, by reverse mode (``create_graph``)
        or forward mode (a jvp of this backward): the carries were computed without a
        graph or tangents. Handed over (so the schedule frees them as it goes)
        unless another backward through the same graph will need them.
        """
        region = self.region
        kept = region.kept
        if kept is None or self.create_graph or forward_mode_active():
            return None
        if any(is_dead_tensor_wrapper(t) for state in kept.values() for t in state.tensors):
            return None  # kept inside a vmap that has returned (the loop's batching rule): run again
        if peek_interpreter_stack() is None and graph_task_keeps_graph():
            return dict(kept)
        region.kept = None
        return kept

    def _restore(self, stored: dict[int, _State], position: int) -> _State:
        state = stored[position]
        if state.rng is not None:
            _rng.restore(state.rng)
        return state

    def _goto(self, stored: dict[int, _State], state: _State | None, position: int | None, k: int) -> tuple[_State, int]:
        """The carry at position ``k``: the current one, or the nearest stored one before it run forward."""
        if position == k and state is not None:
            return state, k
        start = max(p for p in stored if p <= k)
        state = self._restore(stored, start)
        return self._advance(state, start, k), k

    def _advance(self, state: _State, start: int, stop: int) -> _State:
        """Run steps ``start .. stop-1`` forward, recording nothing the result needs not."""
        if start == stop:
            return state
        carry = state.carry
        # (The carry is the steps' input too: one this reversal computed and stored carries a tangent
        # inside the user's fwAD.dual_level(), where it is not the loop's input, nor made in this run.)
        inputs = (*self.primals, *state.tensors) if forward_ad_level() >= 0 else self.primals
        with self.advancing(), self.region.substituted(self.captured, inputs) as mapping:
            for k in range(start, stop):
                x = None if self.x_slots is None else self.x_slots.fill(self._x(k))
                carry, y = self.region.run_step_again(k, carry, x, cond_first=k > start)
                self.region.check_step_again(k, _step_outputs(carry, _tensor_leaves(y)))
            if stop < self.region.n_steps:
                self.region.cond_again(stop, carry)  # (the generators as stored at position stop)
        tensors, slots = flatten(carry)
        return _State.of(self.region.stood_in_again(tensors, mapping), slots, None)

    def _reverse(self, state: _State, k: int) -> None:
        """Differentiate step ``k`` from ``state``; the carry's cotangent moves to the step's input."""
        xs = self._x(k)
        nc, nx = len(state.tensors), len(xs)
        step = StepRegion(self.region, k, state.slots, self.x_slots)
        i = self.loop.index(k)
        cotangents = (*self.ct_carry, *(c[i] for c in self.ct_ys))
        if k < len(self.region.step_metas):
            # What the step returned in the forward sweep: a y of another dtype than the stacked ys
            # (promoted by the stack) takes its cotangent in its own dtype, as autograd gives it.
            step.expected = self.region.step_metas[k]
            cotangents = tuple(
                c.to(dtype) if c.dtype != dtype and has_gradient_dtype(c) else c
                for c, (_, dtype) in zip(cotangents, step.expected)
            )
        else:
            step.expected = [(c.shape, c.dtype) for c in cotangents]
        primals = (*state.tensors, *xs, *self.captured)
        # The first step's carry is the loop's input: its gradient is needed if the caller's is.
        # A later carry's is needed to go on: something before it (a parameter, xs) needs one.
        carry_needs = (self.needs[j] for j in self.init_index) if k == 0 else (has_gradient_dtype(t) for t in state.tensors)
        needs = (
            *carry_needs,
            *(self.needs[j] for j in self.xs_index),
            *(self.needs[j] for j in self.region.captured_index),
        )
        grads = self.step_vjp(step, primals, cotangents, needs)
        if k == 0:
            self.init_grads = list(grads[:nc])
        self.ct_carry = [torch.zeros_like(t) if g is None else g for g, t in zip(grads[:nc], state.tensors)]
        for j, g in enumerate(grads[nc : nc + nx]):
            if j in self.x_grads:
                self.x_grads[j][i] = g
        for index, g in zip(self.region.captured_index, grads[nc + nx :]):
            self._add(index, g)

