"""One table of wrong calls, each with the error it gets and the words it must say.

Every row runs the whole wrong program (decoration, call, backward where it
gets that far) and checks three things: the exception type, that the message
names the argument or says what to do, and that no global state is left changed
(grad mode, the default generator, torch-function and dispatch mode stacks,
the functorch stack).

Two wrong calls live next to the machinery they need: a ``fully_shard``'ed module called
inside a remat'd function in ``test_distributed.py`` and ``torch.compile(fullgraph=True)`` in
``test_compile.py``.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.func as tf
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

import funckpt
from funckpt import CheckpointError, checkpoint, checkpoint_name, checkpoint_sequential, policies, remat

x = torch.randn(3, requires_grad=True)


def sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


class Box:
    """A container optree does not know."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _yielding(t):
    """A generator function: without remat its body runs as the caller iterates (its tensors then require grad)."""
    yield t.sin()


@dataclass(slots=True)
class SlotsBox:
    t: torch.Tensor


class Holder:
    w = torch.randn(3, requires_grad=True)  # reachable only through a class attribute


@dataclass
class Row:
    call: Callable[[], object]
    error: type[BaseException]
    says: str  # a regular expression the message must match


def _self_containing() -> list:
    cycle: list = [x]
    cycle.append(cycle)
    return cycle


def _module_holding(t: torch.Tensor) -> nn.Module:
    m = nn.Module()
    m._cache = t
    return m


def _mutated_between_forward_and_backward() -> None:
    h = x * 1
    y = remat(sin)(h)
    with torch.no_grad():
        h.add_(1)
    y.sum().backward()


def _differentiable_input_modified_inside() -> None:
    def f(t):
        t.mul_(2)
        return t.sin()

    f_ = remat(f)
    f_(x * 1).sum().backward()


def _closure_rebound_between_forward_and_backward() -> None:
    w = torch.ones(3, requires_grad=True)

    def f(t):
        return t * w

    y = remat(f)(x)
    w = torch.full((3,), 2.0, requires_grad=True)  # noqa: F841 - rebinding the cell is the point
    y.sum().backward()


def _recomputation_with_another_shape() -> None:
    calls = []

    def f(t):
        calls.append(1)
        return t[: len(calls) + 1].sin()

    remat(f)(x).sum().backward()


def _differentiated_again_at_the_same_level() -> None:
    def inner(t):
        y = remat(sin)(t).sum()
        (g,) = torch.autograd.grad(y, t, create_graph=True)
        return g.sum()

    tf.grad(inner)(x.detach())


class _Suppressing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


class _Flaky(nn.Module):
    """Raises on its second call only: in the recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calls = nn.Linear(3, 3), 0

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("transient failure")
        return self.lin(t).tanh()


def _recomputation_raising_where_the_forward_did_not() -> None:
    with torch.random.fork_rng():  # (its initialization draws: not what is checked)
        module = _Flaky()
    remat(module)(x).sum().backward()


def _random_op_under_vmap_randomness_error() -> None:
    tf.vmap(remat(lambda t: torch.nn.functional.dropout(t, 0.5)), randomness="error")(torch.ones(2, 3))


ROWS: dict[str, Row] = {
    # --- arguments of remat, at decoration
    "fn not callable": Row(lambda: remat(3), TypeError, r"fn must be callable"),
    "fn a ModuleList": Row(lambda: remat(nn.ModuleList([nn.ReLU()])), TypeError, r"no forward to checkpoint"),
    "fn a module class, not a module": Row(lambda: remat(nn.Linear), TypeError, r"remat an instance.*remat\(Linear\(...\)\)"),
    "policy a string": Row(lambda: remat(sin, policy="dots_saveable"), TypeError, r"policy must be a callable"),
    "policy the policies module": Row(lambda: remat(sin, policy=policies), TypeError, r"policy must be a callable"),
    "policy factory not called": Row(
        lambda: remat(sin, policy=policies.save_only_these_names), TypeError, r"policy=policies.save_only_these_names\(...\)"
    ),
    "static_argnums a string": Row(lambda: remat(sin, static_argnums="0"), TypeError, r"static_argnums must be an int"),
    "static_argnums floats": Row(lambda: remat(sin, static_argnums=(0.5,)), TypeError, r"static_argnums must be an int"),
    "preserve_rng_state not a bool": Row(lambda: remat(sin, preserve_rng_state="yes"), TypeError, r"preserve_rng_state must be a bool"),
    "determinism_check unknown": Row(lambda: remat(sin, determinism_check="strict"), ValueError, r"determinism_check must be one of"),
    "debug not a bool": Row(lambda: remat(sin, debug=1), TypeError, r"debug must be a bool"),
    "context_fn not callable": Row(lambda: remat(sin, context_fn=3), TypeError, r"context_fn must be a callable"),
    "segments on a non-Sequential": Row(lambda: remat(sin, segments=2), ValueError, r"segments applies to an nn.Sequential only"),
    "segments zero": Row(lambda: remat(nn.Sequential(nn.Tanh()), segments=0), ValueError, r"segments must be a positive int"),
    "option misspelt": Row(lambda: remat(sin, polcy=policies.dots_saveable), TypeError, r"unexpected keyword argument 'polcy'"),
    # --- at the call
    "static_argnums out of range": Row(lambda: remat(sin, static_argnums=1)(x), ValueError, r"static_argnums=\(1,\) names argument 1"),
    "context_fn returning one context": Row(lambda: remat(sin, context_fn=lambda: None)(x), TypeError, r"context_fn must return a tuple of two"),
    "context_fn returning a non-context": Row(
        lambda: remat(sin, context_fn=lambda: (torch.enable_grad(), 1))(x), TypeError, r"context_fn must return a tuple of two"
    ),
    "context_fn's recomputation context turning grad off": Row(
        lambda: remat(sin, context_fn=lambda: (torch.enable_grad(), torch.no_grad()))(x).sum().backward(),
        CheckpointError,
        r"turned gradient recording off",
    ),
    "context_fn's recomputation context turning grad off, under torch.func.grad": Row(
        lambda: tf.grad(lambda t: remat(sin, context_fn=lambda: (torch.enable_grad(), torch.no_grad()))(t).sum())(x),
        CheckpointError,
        r"turned gradient recording off",
    ),
    "context_fn's context suppressing fn's error": Row(
        lambda: remat(lambda t: 1 / 0, context_fn=lambda: (_Suppressing(), _Suppressing()))(x),
        CheckpointError,
        r"suppressed an error the function raised",
    ),
    "recomputation raising where the forward run did not": Row(
        _recomputation_raising_where_the_forward_did_not, CheckpointError, r"raised ValueError: transient failure"
    ),
    "policy returning None": Row(
        lambda: remat(sin, policy=lambda op, *a, **k: None)(x), CheckpointError, r"returned None .* returns True \(keep\) or False"
    ),
    "torch selective policy passed as is": Row(
        lambda: remat(sin, policy=lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE)(x), CheckpointError, r"from_torch"
    ),
    "fn raising": Row(lambda: remat(lambda t: 1 / 0)(x), ZeroDivisionError, r"division by zero"),
    # --- outputs
    "non-tensor output under grad": Row(
        lambda: tf.grad(remat(lambda t: t.sum().item()))(x), RuntimeError, r"Expected f\(\*args\) to return a Tensor"
    ),
    "tuple output under grad": Row(
        lambda: tf.grad(remat(lambda t: (t.sum(), 1)))(x), RuntimeError, r"Expected f\(\*args\) to return a Tensor"
    ),
    "tensor output hidden in an unknown container": Row(
        lambda: remat(lambda t: Box(t.sin()))(x), CheckpointError, r"inside a Box, a type optree does not flatten.*register_pytree_node"
    ),
    "tensor output hidden in an unknown container, under torch.func.grad": Row(
        lambda: tf.grad(lambda t: remat(lambda u: Box(u.sin()))(t).t.sum())(x), CheckpointError, r"inside a Box"
    ),
    "tensor output in a slots dataclass": Row(lambda: remat(lambda t: SlotsBox(t.sin()))(x), CheckpointError, r"inside a SlotsBox"),
    "tensor output in an iterator": Row(lambda: remat(lambda t: iter([t.sin()]))(x), CheckpointError, r"inside a list_iterator"),
    "a generator function remat'd": Row(
        lambda: remat(_yielding)(x), CheckpointError, r"returned a generator \(it is a generator or async function.*Remat the code that consumes it"
    ),
    "tensor output in a module's private attribute": Row(
        lambda: remat(lambda t: _module_holding(t.sin()))(x), CheckpointError, r"inside a Module"
    ),
    "returned closure over an argument": Row(
        lambda: remat(lambda t: (t.sin(), lambda z: z * t))(x), CheckpointError, r"returned a callable \(function\)"
    ),
    "tensor output in a built-in bound method": Row(
        lambda: remat(lambda t: (t.sin(), (t * 2).mul))(x), CheckpointError, r"returned a callable \(builtin_function_or_method\)"
    ),
    "tensor output in an operator.methodcaller": Row(
        lambda: remat(lambda t: (t.sin(), operator.methodcaller("add", t * 2)))(x), CheckpointError, r"callable \(methodcaller\)"
    ),
    "tensor output in an itertools.chain": Row(
        lambda: remat(lambda t: (t.sin(), itertools.chain([t * 2])))(x), CheckpointError, r"inside a chain"
    ),
    "object holding an argument": Row(lambda: remat(lambda t: (t.sin(), Box(t)))(x), CheckpointError, r"inside a Box"),
    # --- tensors remat cannot route, and state changed behind its back
    "differentiable class attribute": Row(lambda: remat(lambda t: t * Holder.w)(x), CheckpointError, r"Pass the tensor"),
    "differentiable input modified inside fn": Row(
        _differentiable_input_modified_inside, CheckpointError, r"modified one of its differentiable inputs in place"
    ),
    "saved input modified between forward and backward": Row(
        _mutated_between_forward_and_backward, CheckpointError, r"modified in place between the forward and the backward"
    ),
    "closure tensor rebound before the backward": Row(
        _closure_rebound_between_forward_and_backward, CheckpointError, r"closure variable, global or partial argument was rebound"
    ),
    "input stored into an argument object": Row(lambda: _store_into("argument"), CheckpointError, r"stored one of its inputs"),
    "input appended to a closure list": Row(lambda: _store_into("closure"), CheckpointError, r"stored one of its inputs"),
    "input appended to a global list": Row(lambda: _store_into("global"), CheckpointError, r"stored one of its inputs"),
    "recomputation of another shape": Row(_recomputation_with_another_shape, CheckpointError, r"shape"),
    "remat'd gradient differentiated again at its own level": Row(
        _differentiated_again_at_the_same_level, CheckpointError, r"Nest torch.func transforms instead"
    ),
    "random op under vmap(randomness='error')": Row(_random_op_under_vmap_randomness_error, RuntimeError, r"randomness"),
    # --- the rest of the API
    "checkpoint of a non-callable": Row(lambda: checkpoint(3, x, use_reentrant=False), TypeError, r"function must be callable"),
    "checkpoint use_reentrant not a bool": Row(
        lambda: checkpoint(sin, x, use_reentrant="no"), TypeError, r"use_reentrant must be None, True or False"
    ),
    "checkpoint_sequential with zero segments": Row(
        lambda: checkpoint_sequential(nn.Sequential(nn.Tanh()), 0, x, use_reentrant=False), ValueError, r"segments must be a positive int"
    ),
    "checkpoint_sequential of a module that is not a Sequential": Row(
        lambda: checkpoint_sequential(nn.Tanh(), 2, x, use_reentrant=False), TypeError, r"functions must be an nn.Sequential"
    ),
    "scan with a y leaf that is not a number": Row(
        lambda: funckpt.scan(lambda c, t: (c * t, "tag"), x, torch.ones(2, 3)), TypeError, r"y with a leaf of type str"
    ),
    "scan with a y leaf changing shape": Row(
        lambda: funckpt.scan(lambda c, t: (c * t, c[: 1 + int(t[0] > 0)]), x, torch.tensor([[1.0] * 3, [-1.0] * 3])),
        TypeError,
        r"y whose leaf changes shape",
    ),
    "checkpoint_name of a non-tensor": Row(lambda: checkpoint_name(3, "a"), TypeError, r"x must be a tensor"),
    "checkpoint_name with a non-string name": Row(lambda: checkpoint_name(x, 3), TypeError, r"name must be a string"),
    "save_only_these_names with a non-string": Row(lambda: policies.save_only_these_names(3), TypeError, r"names must be strings"),
    "save_from_both_policies with a non-policy": Row(
        lambda: policies.save_from_both_policies(policies.dots_saveable, 3), TypeError, r"policy_2 must be a callable policy"
    ),
    "save_from_both_policies with a policy factory not called": Row(
        lambda: policies.save_from_both_policies(policies.save_only_these_names, policies.dots_saveable),
        TypeError,
        r"policy_1=policies.save_only_these_names makes a policy",
    ),
    "from_torch of a number": Row(lambda: policies.from_torch(3), TypeError, r"a policy function or a list of ops"),
    "from_torch of a list of non-ops": Row(lambda: policies.from_torch(["mm"]), TypeError, r"OpOverload or OpOverloadPacket"),
    "saved_residuals of a non-callable": Row(lambda: funckpt.saved_residuals(3, x), TypeError, r"fn must be callable"),
    "an argument that contains itself": Row(lambda: remat(lambda t, l: t.sin())(x, _self_containing()), ValueError, r"argument 1 contains itself"),
    "a keyword argument that contains itself": Row(
        lambda: checkpoint(lambda t, l: t.sin(), x, l=_self_containing(), use_reentrant=False), ValueError, r"keyword argument 'l' contains itself"
    ),
}


def _global_state() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch.get_rng_state(),
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        torch._C._functorch.peek_interpreter_stack(),
    )


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_wrong_call_raises_a_clear_error_and_changes_nothing(row: Row):
    before = _global_state()
    with pytest.raises(row.error, match=row.says):
        row.call()
    after = _global_state()
    assert before[0] == after[0] and before[2:] == after[2:]
    assert torch.equal(before[1], after[1]), "the default generator moved"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a generator on another device")
def test_generator_on_another_device_fails_in_the_forward_not_the_backward():
    g = torch.Generator(device="cuda").manual_seed(0)
    state = g.get_state()
    f = remat(lambda t, gen: t * torch.rand(3, generator=gen))
    with pytest.raises(RuntimeError, match="generator"):
        f(x, g)  # a CPU op given a CUDA generator: torch's own error, raised at the call
    assert torch.equal(g.get_state(), state)


def test_row_names_are_unique():  # a dict literal silently keeps the last of two equal keys
    import re
    from pathlib import Path

    names = re.findall(r'^    "([^"]+)": Row', Path(__file__).read_text(), flags=re.M)
    assert len(names) == len(set(names)) == len(ROWS)


def test_the_table_is_large():
    assert len(ROWS) >= 40


STORED: list = []  # (a global list a function stores its input into: its gradient would be missing)


def _store_into(where: str) -> None:
    box, losses = Box(None), []

    def f(t, b):  # (a tensor it computes and stores becomes an output: test_adversarial.py)
        if where == "argument":
            b.t = t
        elif where == "global":
            STORED.append(t)
        else:
            losses.append(t)
        return t.sin().sum()

    remat(f)(x, box)
