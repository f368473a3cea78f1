"""Checkpointed loops: values and gradients equal the plain Python loop's, whatever the schedule.

Every test compares ``funckpt.scan``/``fori_loop``/``while_loop`` against the same
loop written in Python without remat, in float64, under each transform; the
schedule's own properties (optimal counts) are in ``test_schedule.py``, and here
only what the loop executes: how often it calls the step, and what it holds.
"""

from __future__ import annotations

import functools

import numpy as np
import optree
import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import funckpt
from benchmarks._common import held_bytes, peak_bytes
from funckpt import _schedule
from tests.fakes import LiveBf16Casts

D = torch.float64
CHECKPOINTS = [None, 1, 2, 3, 50]


def make(n: int = 7, width: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, width, dtype=D, generator=g) / width**0.5
    b = torch.randn(width, dtype=D, generator=g)
    xs = torch.randn(n, width, dtype=D, generator=g)
    c0 = torch.randn(width, dtype=D, generator=g)
    return w, b, xs, c0


def cell(w, b, c, x):
    h = torch.tanh(c @ w + x + b)
    return h, (h * x).sum()


def python_scan(f, init, xs, reverse=False):
    carry, ys = init, []
    n = xs.shape[0]
    order = range(n - 1, -1, -1) if reverse else range(n)
    for i in order:
        carry, y = f(carry, xs[i])
        ys.append(y)
    if reverse:
        ys.reverse()
    return carry, torch.stack(ys)


def losses(checkpoints, reverse=False):
    """The same loss through funckpt.scan and through the Python loop, as functions of (w, b, xs, c0)."""

    def with_scan(w, b, xs, c0):
        carry, ys = funckpt.scan(functools.partial(cell, w, b), c0, xs, reverse=reverse, checkpoints=checkpoints)
        return (carry**2).sum() + (ys**2).sum()

    def without(w, b, xs, c0):
        carry, ys = python_scan(functools.partial(cell, w, b), c0, xs, reverse)
        return (carry**2).sum() + (ys**2).sum()

    return with_scan, without


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_backward_equals_python_loop(checkpoints, reverse):
    args = [t.requires_grad_() for t in make()]
    with_scan, without = losses(checkpoints, reverse)
    assert_close(with_scan(*args), without(*args))
    assert_close(torch.autograd.grad(with_scan(*args), args), torch.autograd.grad(without(*args), args))


@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("how", ["torch.func.grad", "autograd.grad"])
def test_scan_gradient_inside_a_dual_level_is_a_dual(checkpoints, how):
    """Forward over reverse with plain forward-mode AD (a Hessian-vector product): inside
    ``forward_ad.dual_level()`` the gradient of a dual is a dual (``torch.func.grad``, or
    ``torch.autograd.grad`` without ``create_graph``), the steps' recomputations starting from
    their inputs' tangents too. They used to start from detached inputs: the tangent was wrong."""
    import torch.autograd.forward_ad as fwAD

    w, b, xs, c0 = make()
    with_scan, without = losses(checkpoints)

    def tangent(loss):
        with fwAD.dual_level():
            if how == "torch.func.grad":
                g = tf.grad(loss)(fwAD.make_dual(w, w.cos()), b, xs, c0)
            else:
                dual = fwAD.make_dual(w.clone().requires_grad_(), w.cos())
                (g,) = torch.autograd.grad(loss(dual, b, xs, c0), dual)
            primal, tangent = fwAD.unpack_dual(g)
            return primal.detach(), tangent

    assert_close(tangent(with_scan), tangent(without))


TRANSFORMS = {
    "grad": lambda L, a: tf.grad(L, argnums=(0, 1, 2, 3))(*a),
    "vjp": lambda L, a: tf.vjp(L, *a)[1](torch.tensor(1.5, dtype=D)),
    "jacrev": lambda L, a: tf.jacrev(L, argnums=(0, 3))(*a),
    "jacfwd": lambda L, a: tf.jacfwd(L, argnums=(0, 3))(*a),
    "jvp": lambda L, a: tf.jvp(L, tuple(a), tuple(torch.ones_like(t) for t in a)),
    "hessian": lambda L, a: tf.hessian(L, argnums=3)(*a),
    "grad_of_grad": lambda L, a: tf.grad(lambda c: tf.grad(L, argnums=3)(*a[:3], c).sum())(a[3]),
    "jvp_of_grad": lambda L, a: tf.jvp(lambda c: tf.grad(L, argnums=3)(*a[:3], c), (a[3],), (torch.ones_like(a[3]),)),
    "vmap_of_grad": lambda L, a: tf.vmap(tf.grad(L, argnums=3), in_dims=(None, None, None, 0))(
        *a[:3], torch.stack([a[3], 2 * a[3], -a[3]])
    ),
    "grad_of_vmap": lambda L, a: tf.grad(
        lambda c: tf.vmap(L, in_dims=(None, None, None, 0))(*a[:3], torch.stack([c, 2 * c])).sum()
    )(a[3]),
}


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_scan_under_every_transform_equals_python_loop(transform, checkpoints):
    args = list(make(n=5))
    with_scan, without = losses(checkpoints)
    assert_close(TRANSFORMS[transform](with_scan, args), TRANSFORMS[transform](without, args))


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_of_grad", "hessian"])
def test_a_closed_over_tensor_a_step_returns_as_it_is_gets_its_gradient(transform, checkpoints):
    """``lambda c, x: (c @ w, w)``: the step hands back the captured tensor itself (no operator
    receives it), as ``y`` and, in a fori_loop, as the carry; its gradient flows as without remat."""
    w, b, xs, c0 = make(n=4)

    def losses_of(loop):
        def with_loop(w, c0):
            carry, ys = loop(lambda c, x: (torch.tanh(c @ w + x), w), c0, xs)
            kept = funckpt.fori_loop(0, 3, lambda i, c: w * 1 if i == 0 else w, torch.zeros_like(w), checkpoints=checkpoints)
            return (carry**2).sum() + (ys**2).sum() + (kept * w).sum()

        return with_loop

    scan = functools.partial(funckpt.scan, checkpoints=checkpoints)
    ours = losses_of(lambda f, c0, xs: scan(f, c0, xs))
    plain = losses_of(python_scan)
    if transform == "backward":
        args = [w.requires_grad_(), c0.requires_grad_()]
        got, expected = torch.autograd.grad(ours(*args), args), torch.autograd.grad(plain(*args), args)
    elif transform == "grad":
        got, expected = tf.grad(ours, argnums=(0, 1))(w, c0), tf.grad(plain, argnums=(0, 1))(w, c0)
    elif transform == "vmap_of_grad":
        c0s = torch.stack([c0, -c0])
        got, expected = (tf.vmap(tf.grad(L), in_dims=(None, 0))(w, c0s) for L in (ours, plain))
    else:
        got, expected = tf.hessian(ours, argnums=1)(w, c0), tf.hessian(plain, argnums=1)(w, c0)
    assert_close(got, expected)


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_hessian_of_a_loop_whose_step_takes_a_jvp(loop, checkpoints):
    """A step that takes a jvp of its own (a flow's divergence by forward mode), under a Hessian:
    its vjp below jacrev's vmap ran the steps forward from a kept carry under no_grad, where
    SiLU's tangent takes the fused silu_backward, which the Hessian's jvp level cannot
    differentiate (torch raised NotImplementedError); the plain loop runs them with grad mode on."""
    g = torch.Generator().manual_seed(8)
    x, e = torch.randn(5, dtype=D, generator=g), torch.randn(5, dtype=D, generator=g)

    def step(c):
        return c + 0.1 * tf.jvp(torch.nn.functional.silu, (c,), (e,))[1]

    def plain(x):
        for _ in range(3):
            x = step(x)
        return x.square().sum()

    def ours(x):
        if loop == "scan":
            return funckpt.scan(lambda c, _: (step(c), None), x, length=3, checkpoints=checkpoints)[0].square().sum()
        return funckpt.fori_loop(0, 3, lambda i, c: step(c), x, checkpoints=checkpoints).square().sum()

    assert_close(tf.hessian(ours)(x), tf.hessian(plain)(x))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_second_backward_with_retain_graph_and_create_graph(checkpoints):
    args = [t.requires_grad_() for t in make()]
    with_scan, without = losses(checkpoints)
    for loss in (with_scan, without):
        out = loss(*args)
        first = torch.autograd.grad(out, args, retain_graph=True)
        second = torch.autograd.grad(out, args)
        assert_close(first, second)
    g1 = torch.autograd.grad(with_scan(*args), args[3], create_graph=True)[0]
    g2 = torch.autograd.grad(without(*args), args[3], create_graph=True)[0]
    assert_close(torch.autograd.grad(g1.sum(), args), torch.autograd.grad(g2.sum(), args))


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_module_parameters_reached_through_the_step_get_gradients(checkpoints):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()).double()

    def loss(params, c0):
        def f(c, _):
            return torch.func.functional_call(net, params, (c,)), None

        carry, _ = funckpt.scan(f, c0, None, length=6, checkpoints=checkpoints)
        return carry.pow(2).sum()

    def plain(params, c0):
        c = c0
        for _ in range(6):
            c = torch.func.functional_call(net, params, (c,))
        return c.pow(2).sum()

    params = dict(net.named_parameters())
    c0 = torch.randn(2, 3, dtype=D)
    assert_close(tf.grad(loss)(params, c0), tf.grad(plain)(params, c0))

    # and through plain autograd, the module itself closed over
    def closed(c0):
        return funckpt.scan(lambda c, _: (net(c), None), c0, length=6, checkpoints=checkpoints)[0].pow(2).sum()

    closed(c0).backward()
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    plain(dict(net.named_parameters()), c0).backward()
    assert_close(got, [p.grad for p in net.parameters()])


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_pytree_carry_and_outputs_with_non_tensor_leaves(checkpoints):
    w, _, xs, c0 = (t.requires_grad_() for t in make())

    def f(carry, x):
        h, count = carry["h"], carry["count"]
        h2 = torch.sin(h @ w) + x
        return {"h": h2, "count": count + 1, "pair": (h2.sum(), h)}, {"y": h2 * 2, "s": h2.mean()}

    init = {"h": c0, "count": 0, "pair": (c0.sum(), c0)}
    carry, ys = funckpt.scan(f, init, xs, checkpoints=checkpoints)
    ref_carry, ref_ys = init, []
    for i in range(xs.shape[0]):
        ref_carry, y = f(ref_carry, xs[i])
        ref_ys.append(y)
    assert carry["count"] == xs.shape[0]
    assert_close(ys["y"], torch.stack([y["y"] for y in ref_ys]))
    loss = carry["h"].sum() + carry["pair"][0] + ys["s"].sum() + ys["y"].pow(2).sum()
    ref = ref_carry["h"].sum() + ref_carry["pair"][0] + sum(y["s"] + y["y"].pow(2).sum() for y in ref_ys)
    assert_close(torch.autograd.grad(loss, (w, xs, c0)), torch.autograd.grad(ref, (w, xs, c0)))


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_dropout_inside_a_step_replays_exactly(checkpoints):
    w, b, xs, c0 = (t.requires_grad_() for t in make(n=9))

    def f(c, x):
        h = torch.nn.functional.dropout(torch.tanh(c @ w + x), p=0.5, training=True)
        return h + torch.rand_like(h) * 0.1, h.sum()

    torch.manual_seed(3)
    carry, ys = funckpt.scan(f, c0, xs, checkpoints=checkpoints)
    after_forward = torch.get_rng_state()
    grads = torch.autograd.grad(carry.sum() + ys.pow(2).sum(), (w, xs, c0))
    assert torch.equal(torch.get_rng_state(), after_forward), "the recomputation moved the caller's generator"
    torch.manual_seed(3)
    ref_carry, ref_ys = python_scan(f, c0, xs)
    assert_close(carry, ref_carry)
    assert_close(grads, torch.autograd.grad(ref_carry.sum() + ref_ys.pow(2).sum(), (w, xs, c0)))


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_fori_loop_equals_python_loop(checkpoints):
    w, b, _, c0 = make()

    def body(i, c):
        return torch.tanh(c @ w + i * b)

    def loss(w, b, c0, loop):
        return loop(c0).pow(2).sum()

    def with_fori(c):
        return funckpt.fori_loop(2, 9, body, c, checkpoints=checkpoints)

    def plain(c):
        for i in range(2, 9):
            c = body(i, c)
        return c

    assert_close(with_fori(c0), plain(c0))
    assert_close(tf.jacrev(with_fori)(c0), tf.jacrev(plain)(c0))
    assert_close(tf.jacfwd(with_fori)(c0), tf.jacrev(plain)(c0))
    assert funckpt.fori_loop(3, 3, body, c0, checkpoints=checkpoints) is c0


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("tensor_cond", [False, True])
def test_while_loop_equals_python_loop(checkpoints, tensor_cond):
    w, b, _, c0 = make()
    w = w * 0.9

    def cond(carry):
        c, i = carry
        return (i < 11) if not tensor_cond else (c.abs().sum() > -1) & torch.tensor(i < 11)

    def body(carry):
        c, i = carry
        return torch.tanh(c @ w + b), i + 1

    def with_while(c):
        return funckpt.while_loop(cond, body, (c, 0), checkpoints=checkpoints)[0]

    def plain(c):
        carry = (c, 0)
        while cond(carry):
            carry = body(carry)
        return carry[0]

    assert_close(with_while(c0), plain(c0))
    assert_close(tf.grad(lambda c: with_while(c).sum())(c0), tf.grad(lambda c: plain(c).sum())(c0))
    assert_close(tf.jacrev(with_while)(c0), tf.jacrev(plain)(c0))
    c = c0.clone().requires_grad_()
    with_while(c).pow(2).sum().backward()
    ref = c0.clone().requires_grad_()
    plain(ref).pow(2).sum().backward()
    assert_close(c.grad, ref.grad)


def test_while_loop_stops_at_max_steps():
    c0 = torch.ones(2, dtype=D, requires_grad=True)
    out = funckpt.while_loop(lambda c: True, lambda c: c * 1.5, c0, max_steps=5, checkpoints=2)
    assert_close(out, c0 * 1.5**5)
    (g,) = torch.autograd.grad(out.sum(), c0)
    assert_close(g, torch.full_like(c0, 1.5**5))


def test_xs_none_with_length_and_y_none():
    c0 = torch.randn(3, dtype=D, requires_grad=True)
    carry, ys = funckpt.scan(lambda c, x: (c * 2, None), c0, length=4, checkpoints=2)
    assert ys is None
    assert_close(carry, c0 * 16)
    carry, ys = funckpt.scan(lambda c, x: (c * 2, c.sum()), c0, length=0, checkpoints=2)
    assert carry is c0 or torch.equal(carry, c0)


@pytest.mark.parametrize("n,checkpoints", [(1, 1), (10, 1), (10, 2), (10, 3), (25, 3), (30, 4), (12, 12), (12, 40)])
def test_step_calls_follow_the_schedule(n, checkpoints):
    calls = []
    w, b, xs, c0 = (t.requires_grad_() for t in make(n=n))

    def f(c, x):
        calls.append(1)
        return cell(w, b, c, x)

    carry, ys = funckpt.scan(f, c0, xs, checkpoints=checkpoints)
    assert len(calls) == n
    (carry.sum() + ys.sum()).backward()
    # The optimum: the forward pass runs the n steps and the backward pass starts from the carry after
    # the last, Griewank and Walther's problem of n + 1 steps whose last reversal is free; t(n + 1, c)
    # steps advanced (the forward pass's n included), and each of the n steps once more to differentiate it.
    assert len(calls) == _schedule.binomial_advances(n + 1, checkpoints) + n
    if checkpoints >= n:  # every carry kept: each step run once more, none run again only to advance
        assert len(calls) == 2 * n


@pytest.mark.parametrize("policy", [None, funckpt.policies.dots_saveable])
def test_checkpoints_none_calls_each_step_twice(policy):
    calls = []
    w, b, xs, c0 = (t.requires_grad_() for t in make(n=8))

    def f(c, x):
        calls.append(1)
        return cell(w, b, c, x)

    carry, _ = funckpt.scan(f, c0, xs, policy=policy)
    carry.sum().backward()
    assert len(calls) == 16


def _chain(n, width, checkpoints):
    """A loop whose carry is big and whose step makes several carry-sized temporaries."""
    w = (torch.eye(width) * 0.5).requires_grad_()

    def f(c, _):
        h = torch.tanh(c * 1.01)
        return torch.sin(h) + h * 0.5 + c @ w, None

    c0 = torch.randn(64, width, requires_grad=True)
    return lambda: funckpt.scan(f, c0, None, length=n, checkpoints=checkpoints)[0]


def test_memory_held_between_passes_is_c_carries_whatever_n():
    width = 256
    carry_bytes = 64 * width * 4
    for n in (20, 80):
        held = held_bytes(_chain(n, width, checkpoints=3))
        # the (at most 3) stored carries, the output and small state (generator states)
        assert held <= 5 * carry_bytes, (n, held / carry_bytes)
    every = held_bytes(_chain(80, width, checkpoints=None))
    assert every >= 60 * carry_bytes, every / carry_bytes


@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
@pytest.mark.parametrize("checkpoints", [None, 1, 3, 50])
def test_saved_residuals_list_the_carries_a_loop_keeps(loop, checkpoints):
    """``saved_residuals`` lists what a loop keeps between the passes: its inputs and the carries its
    schedule keeps (every one with ``checkpoints=None``: it listed the inputs alone), each once, the
    initial carry as the input it is. As many bytes as the loop holds beyond its inputs."""
    n, width = 12, 64
    w = (torch.eye(width) * 0.5).requires_grad_()
    c0 = torch.randn(8, width, requires_grad=True)

    def run():
        step = lambda c: torch.tanh(c @ w) + c  # noqa: E731
        if loop == "scan":
            return funckpt.scan(lambda c, _: (step(c), None), c0, None, length=n, checkpoints=checkpoints)[0]
        if loop == "fori_loop":
            return funckpt.fori_loop(0, n, lambda i, c: step(c), c0, checkpoints=checkpoints)
        return funckpt.while_loop(lambda c: True, step, c0, max_steps=n, checkpoints=checkpoints)

    residuals = funckpt.saved_residuals(run)
    inputs = [r for r in residuals if r.kind == "input"]
    carries = [r for r in residuals if r.kind == "carry kept by the loop"]
    assert len(inputs) + len(carries) == len(residuals)
    assert len(inputs) == 2  # c0 and w
    kept = n - 1 if checkpoints is None else min(checkpoints, n) - 1  # (the initial carry: an input)
    assert 0 < len(carries) <= kept if kept else not carries
    if checkpoints is None or checkpoints >= n:
        assert len(carries) == kept
    assert len({r.source for r in carries}) == len(carries)
    assert all(r.shape == tuple(c0.shape) and r.nbytes == c0.numel() * c0.element_size() for r in carries)
    held = held_bytes(run)
    assert held >= sum(r.nbytes for r in carries)


def test_peak_memory_is_bounded_by_checkpoints_not_steps():
    width = 256
    carry_bytes = 64 * width * 4

    def step(n, checkpoints):
        run = _chain(n, width, checkpoints)
        return lambda: run().sum().backward()

    short = peak_bytes(step(20, 3))
    long = peak_bytes(step(160, 3))
    assert long <= short + 2 * carry_bytes, (short / carry_bytes, long / carry_bytes)
    every = peak_bytes(step(160, None))
    assert long < every / 4, (long / carry_bytes, every / carry_bytes)


def test_in_place_update_of_module_state_in_a_step_raises():
    bn = torch.nn.BatchNorm1d(3).double()
    c0 = torch.randn(4, 3, dtype=D, requires_grad=True)
    for checkpoints in (None, 2):
        with pytest.raises(funckpt.CheckpointError, match="funckpt.remat on each step"):
            funckpt.scan(lambda c, _: (bn(c), None), c0, length=3, checkpoints=checkpoints)


@pytest.mark.parametrize("route", ["backward", "grad", "jvp"])
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
def test_a_refused_in_place_update_of_module_state_leaves_the_state_as_it_was(loop, route):
    """The sweep runs every step before it can refuse their in-place writes (BatchNorm's
    running statistics): the refused call leaves the module's buffers as it found them, as a
    refused rebinding does, so that the Python loop of remat'd steps the error suggests starts
    from the same state as the plain loop."""
    for checkpoints in (None, 2):
        bn = torch.nn.BatchNorm1d(3).double()
        before = {k: v.clone() for k, v in bn.state_dict().items()}
        c0 = torch.randn(4, 3, dtype=D)
        w = torch.randn(3, 3, dtype=D, requires_grad=True)

        def loss(w):
            if loop == "scan":
                c = funckpt.scan(lambda c, _: (bn(c @ w), None), c0, length=3, checkpoints=checkpoints)[0]
            elif loop == "fori_loop":
                c = funckpt.fori_loop(0, 3, lambda i, c: bn(c @ w), c0, checkpoints=checkpoints)
            else:
                c = funckpt.while_loop(lambda t: t[1] < 3, lambda t: (bn(t[0] @ w), t[1] + 1), (c0, 0), checkpoints=checkpoints)[0]
            return c.sum()

        with pytest.raises(funckpt.CheckpointError, match="funckpt.remat on each step"):
            if route == "backward":
                loss(w).backward()
            elif route == "grad":
                tf.grad(loss)(w)
            else:
                tf.jvp(loss, (w,), (torch.ones_like(w),))
        assert_close(bn.state_dict(), before, rtol=0, atol=0)


class _MatMul(torch.autograd.Function):
    """``h @ w`` as a custom autograd.Function (whose ``.apply`` no torch-function mode sees)."""

    @staticmethod
    def forward(h, w):
        return h @ w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        return g @ w.T, h.T @ g


@pytest.mark.parametrize("route", ["backward", "create_graph", "grad", "vjp"])
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
@pytest.mark.parametrize("checkpoints", [None, 1])
def test_a_closure_tensor_passed_straight_to_a_custom_function_raises(checkpoints, loop, route):
    """A step passing a tensor of its closure straight to a custom autograd.Function: the loop
    cannot route it (as remat cannot), and its gradient was silently missing or partial. Refused,
    as remat refuses it; passed in the carry it gets the plain loop's gradient."""
    c0 = torch.randn(2, 3, dtype=D)
    w0 = torch.randn(3, 3, dtype=D)

    def run(w, step, init):
        if loop == "scan":
            return funckpt.scan(lambda c, _: (step(c), None), init, length=2, checkpoints=checkpoints)[0]
        if loop == "fori_loop":
            return funckpt.fori_loop(0, 2, lambda i, c: step(c), init, checkpoints=checkpoints)
        return funckpt.while_loop(
            lambda t: t[1] < 2, lambda t: (step(t[0]), t[1] + 1), (init, 0), checkpoints=checkpoints
        )[0]

    def closing_over(w):
        return run(w, lambda c: torch.tanh(_MatMul.apply(c, w)), c0)

    def in_the_carry(w):
        return run(w, lambda c: (torch.tanh(_MatMul.apply(c[0], c[1])), c[1]), (c0, w))[0]

    def plain(w):
        return torch.tanh(torch.tanh(c0 @ w) @ w)

    def gradient(f):
        w = w0.clone().requires_grad_()
        if route == "grad":
            return tf.grad(lambda w: f(w).sum())(w)
        if route == "vjp":  # (its vjp_fn runs the steps again once the transform's level is gone)
            return tf.vjp(lambda w: f(w).sum(), w)[1](torch.ones((), dtype=D))[0]
        if route == "create_graph":
            return torch.autograd.grad(f(w).sum(), w, create_graph=True)[0]
        f(w).sum().backward()
        return w.grad

    with pytest.raises(funckpt.CheckpointError, match="custom autograd.Function"):
        gradient(closing_over)
    assert_close(gradient(in_the_carry), gradient(plain))


@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("route", ["backward", "grad"])
def test_a_hook_on_a_steps_intermediate_is_refused_with_what_to_do(checkpoints, route):
    """A step registering a hook on a tensor it computed: the forward sweep runs without grad,
    where torch refuses the hook; the loop says so, and a Python loop of remat'd steps, which
    it points to, gives the plain loop's gradient."""
    w0, b, xs, c0 = make(n=5)

    def step(w, c, x):
        h = torch.tanh(c @ w + x + b)
        h.register_hook(lambda g: 2 * g)
        return h, h.sum()

    def python_loop(w, each):
        c, total = c0, 0
        for x in xs:
            c, y = each(lambda c, x: step(w, c, x))(c, x)
            total = total + y
        return total + c.sum()

    def scanned(w):
        c, ys = funckpt.scan(lambda c, x: step(w, c, x), c0, xs, checkpoints=checkpoints)
        return ys.sum() + c.sum()

    def gradient(f):
        w = w0.clone().requires_grad_()
        if route == "grad":
            return tf.grad(f)(w)
        f(w).backward()
        return w.grad

    with pytest.raises(funckpt.CheckpointError, match=r"^scan\(<lambda>\): step 0 registered a hook.*funckpt.remat on each step"):
        gradient(scanned)
    assert_close(gradient(lambda w: python_loop(w, funckpt.remat)), gradient(lambda w: python_loop(w, lambda f: f)))


class _Counting(torch.nn.Module):
    """A cell that rebinds its own state at each call, as without remat it may."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, dtype=D)
        self.register_buffer("count", torch.zeros((), dtype=D))

    def forward(self, c):
        self.count = self.count + 1
        return torch.tanh(self.lin(c)) * self.count


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_module_state_a_step_rebinds_raises_and_per_step_remat_replays_it(loop):
    """A step's rebinding (self.count = self.count + 1) cannot be replayed from kept carries:
    refused by name, before any gradient, where before it surfaced as values that differ. The
    Python loop of remat'd steps the error suggests gives the plain loop's values, gradients
    and state."""
    c0 = torch.randn(4, 3, dtype=D, requires_grad=True)
    for checkpoints in (None, 2):
        cell = _Counting()
        with pytest.raises(funckpt.CheckpointError, match=r"rebound _Counting.count.*funckpt.remat on each step"):
            if loop == "scan":
                funckpt.scan(lambda c, _: (cell(c), None), c0, length=3, checkpoints=checkpoints)
            else:
                funckpt.fori_loop(0, 3, lambda i, c: cell(c), c0, checkpoints=checkpoints)
        assert cell.count.item() == 0  # the refused sweep left the state as it found it

    def run(step):
        torch.manual_seed(0)
        cell = _Counting()
        c = c0
        for _ in range(3):
            c = step(cell)(c)
        c.square().sum().backward()
        return c.detach(), cell.lin.weight.grad, cell.count

    expected = run(lambda cell: cell)
    got = run(funckpt.remat)
    assert_close(got, expected)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: funckpt.scan(1, torch.zeros(1), length=2), "f must be callable"),
        (lambda: funckpt.scan(lambda c, x: (c, x), torch.zeros(1), length=2, checkpoints=0), "checkpoints"),
        (lambda: funckpt.scan(lambda c, x: (c, x), torch.zeros(1), length=2, checkpoints=True), "checkpoints"),
        (lambda: funckpt.scan(lambda c, x: (c, x), torch.zeros(1)), "length"),
        (lambda: funckpt.scan(lambda c, x: (c, x), torch.zeros(1), torch.zeros(3), length=2), "length=2"),
        (lambda: funckpt.scan(lambda c, x: (c, x), torch.zeros(1), (torch.zeros(3), torch.zeros(2))), "leading"),
        (lambda: funckpt.scan(lambda c, x: c, torch.zeros(1), length=2), "pair"),
        (lambda: funckpt.fori_loop(0, 2.0, lambda i, c: c, torch.zeros(1)), "upper"),
        (lambda: funckpt.while_loop(lambda c: True, lambda c: c, torch.zeros(1), max_steps=-1), "max_steps"),
        (lambda: funckpt.while_loop(lambda c: c, lambda c: c, torch.zeros(2), max_steps=3), "one-element bool"),
    ],
)
def test_bad_arguments_raise_naming_them(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_carry_that_changes_structure_raises():
    c0 = torch.zeros(2, requires_grad=True)
    with pytest.raises(TypeError, match="structure"):
        funckpt.scan(lambda c, x: ((c, c), None), c0, length=2, checkpoints=1)


def test_under_no_grad_it_is_the_plain_loop():
    calls = []

    def f(c, x):
        calls.append(1)
        return c + x, c

    with torch.no_grad():
        carry, ys = funckpt.scan(f, torch.zeros(2), torch.ones(5, 2), checkpoints=2)
    assert len(calls) == 5
    assert_close(carry, torch.full((2,), 5.0))
    assert ys.shape == (5, 2)


def test_steps_without_randomness_share_one_generator_state():
    # The CPU generator's state is 5 KB: kept once per carry it would outweigh small carries.
    c0 = torch.randn(4, requires_grad=True)
    held = held_bytes(lambda: funckpt.scan(lambda c, _: (torch.sin(c), None), c0, length=200)[0])
    assert held < 200 * 4 * 4 * 3 + 2 * torch.get_rng_state().numel(), held


@pytest.mark.parametrize("checkpoints", [None, 3])
def test_grad_of_vmap_of_scan_reverses_step_by_step(checkpoints):
    # The loop's batching rule (remat(vmap(loop))) keeps the schedule: each step is
    # differentiated once more, not the whole vmapped loop recomputed with its graph.
    w, b, xs, c0 = make(n=12)
    calls = []

    def f(c, x):
        calls.append(1)
        return cell(w, b, c, x)

    def loss(c, loop):
        return tf.vmap(lambda ci: loop(f, ci, xs)[0])(torch.stack([c, 2 * c])).pow(2).sum()

    got = tf.grad(lambda c: loss(c, lambda *a: funckpt.scan(*a, checkpoints=checkpoints)))(c0)
    counted = len(calls)
    assert_close(got, tf.grad(lambda c: loss(c, python_scan))(c0))
    if checkpoints is None:
        assert counted == 2 * 12


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_under_torch_compile_a_loop_is_an_eager_region(checkpoints):
    w, b, xs, c0 = make(n=5)
    with_scan, without = losses(checkpoints)
    torch._dynamo.reset()
    compiled = torch.compile(with_scan, backend="aot_eager")
    args = [t.clone().requires_grad_() for t in (w, b, xs, c0)]
    assert_close(torch.autograd.grad(compiled(*args), args), torch.autograd.grad(without(*args), args))
    torch._dynamo.reset()
    got = torch.compile(tf.grad(with_scan, argnums=(0, 3)), backend="aot_eager")(w, b, xs, c0)
    assert_close(got, tf.grad(without, argnums=(0, 3))(w, b, xs, c0))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_fullgraph_compile_of_a_loop_says_the_loop_is_a_graph_break(checkpoints):
    """The refusal names the loop and says to compile without fullgraph=True, not remat's
    advice (an operator-based policy), which cannot make a loop one graph."""
    w, b, xs, c0 = make(n=3)
    with_scan, _ = losses(checkpoints)
    torch._dynamo.reset()
    compiled = torch.compile(with_scan, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="fullgraph") as info:
        compiled(w, b, xs, c0)
    torch._dynamo.reset()
    assert "funckpt.scan, fori_loop and while_loop" in str(info.value)
    assert "operator-based policy" not in str(info.value)


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
def test_a_step_that_computes_differently_when_run_again_raises(checkpoints):
    calls = []

    def f(c, _):
        calls.append(1)
        return c * (1 + 0.01 * len(calls)), None  # depends on how often it ran

    c0 = torch.ones(3, dtype=D, requires_grad=True)
    carry, _ = funckpt.scan(f, c0, length=6, checkpoints=checkpoints)
    with pytest.raises(funckpt.CheckpointError, match=r"^scan\(f\): step \d, run again in the backward pass, did not reproduce") as info:
        carry.sum().backward()
    # (remat's options to skip the check or trace the runs: a loop takes neither, and said to pass them)
    assert "determinism_check" not in str(info.value) and "debug=True" not in str(info.value)


def test_while_loop_with_a_condition_batched_by_vmap_raises_a_clear_error():
    def run(c):
        return funckpt.while_loop(lambda c: c.sum() < 5, lambda c: c + 1, c, checkpoints=2)

    with pytest.raises(funckpt.CheckpointError, match="differs across a vmap's batch"):
        tf.vmap(run)(torch.zeros(3, 2))


def test_while_loop_second_backward_with_retain_graph():
    w = (torch.randn(3, 3, dtype=D) * 0.5).requires_grad_()
    c0 = torch.randn(3, dtype=D, requires_grad=True)

    def body(c):
        return torch.tanh(c @ w) + 0.1

    def cond(c):
        return bool(c.sum() < 50)

    out = funckpt.while_loop(cond, body, c0, max_steps=30, checkpoints=3)
    first = torch.autograd.grad(out.sum(), (w, c0), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (w, c0))
    c = c0
    for _ in range(30):
        c = body(c) if cond(c) else c
    expected = torch.autograd.grad(c.sum(), (w, c0))
    assert_close(first, expected)
    assert_close(second, expected)


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_forward_mode_through_a_step_with_eval_batchnorm(checkpoints):
    """The step's buffers (running statistics) get no tangent in the recomputation, as in the Python loop."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(D).eval()
    net[1].running_mean.normal_()

    def step(h, x):
        return torch.tanh(net(h) + x), None

    def python_loop(h):
        for x in xs:
            h, _ = step(h, x)
        return h

    xs, h0 = torch.randn(5, 3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    scanned = lambda h: funckpt.scan(step, h, xs, checkpoints=checkpoints)[0]  # noqa: E731
    assert_close(tf.jvp(scanned, (h0,), (h0,)), tf.jvp(python_loop, (h0,), (h0,)))
    assert_close(tf.jacfwd(scanned)(h0), tf.jacfwd(python_loop)(h0))


class _TorchOnlyBox:
    """A container registered with torch's own pytree only (as transformers registers its ModelOutputs)."""

    def __init__(self, h):
        self.h = h


torch.utils._pytree.register_pytree_node(_TorchOnlyBox, lambda b: ([b.h], None), lambda children, _: _TorchOnlyBox(children[0]))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_scan_over_and_into_containers_registered_with_torchs_pytree_only(checkpoints):
    w, _, xs, init = make()
    w = w.clone().requires_grad_()

    def step(c, x):
        h = torch.tanh(c @ w + x.h)
        return h, _TorchOnlyBox(h * 2)

    carry, ys = funckpt.scan(step, init, _TorchOnlyBox(xs), checkpoints=checkpoints)
    assert isinstance(ys, _TorchOnlyBox)
    got = torch.autograd.grad(carry.sum() + ys.h.square().sum(), w)

    c, total = init, 0
    for x in xs:
        c, y = step(c, _TorchOnlyBox(x))
        total = total + y.h.square().sum()
    assert_close(got, torch.autograd.grad(c.sum() + total, w))


_HOLDER = {"lin": None}


def _deep(h):  # the module is five functions and a dict away from the loop's body: the walk's last level
    return _deeper(h)


def _deeper(h):
    return _deeper_still(h)


def _deeper_still(h):
    return _deepest(h)


def _deepest(h):
    return torch.tanh(_HOLDER["lin"](h))


def test_while_loop_finds_what_its_body_reaches_as_deep_as_fori_loop_does():
    """A while loop's body and condition are each walked from the top for captured tensors, as a
    fori_loop's body is (walked as one pair, the body lost a level of the walk's depth)."""
    torch.manual_seed(0)
    _HOLDER["lin"] = lin = torch.nn.Linear(3, 3, dtype=D)
    c0 = torch.randn(3, dtype=D)
    grads = []
    for run in (
        lambda: funckpt.fori_loop(0, 3, lambda i, h: _deep(h), c0),
        lambda: funckpt.while_loop(lambda c: c[1] < 3, lambda c: (_deep(c[0]), c[1] + 1), (c0, 0))[0],
    ):
        lin.zero_grad()
        run().sum().backward()
        grads.append(lin.weight.grad.clone())
    h = c0
    for _ in range(3):
        h = _deep(h)
    lin.zero_grad()
    h.sum().backward()
    assert_close(grads, [lin.weight.grad, lin.weight.grad])


@pytest.mark.parametrize("checkpoints", [None, 1, 2, 3])
@pytest.mark.parametrize("what", ["carry", "y", "y missing"])
def test_every_step_run_again_in_the_backward_is_checked(checkpoints, what):
    """Whichever call of the step computes something else in the backward pass (a step the
    schedule runs forward again from a kept carry, or one it differentiates), in its carry or
    its y, the determinism check raises instead of a silently wrong gradient."""
    w, b, xs, c0 = make(n=6)
    w.requires_grad_()
    calls = [0]
    odd_call = [None]

    def step(c, x):
        calls[0] += 1
        odd = calls[0] == odd_call[0]
        h = torch.tanh(c @ w + x + b) * (1.5 if odd and what == "carry" else 1.0)
        y = (h * x).sum() * (1.5 if odd and what == "y" else 1.0)
        return h, None if odd and what == "y missing" else y

    def run():
        calls[0] = 0
        carry, ys = funckpt.scan(step, c0, xs, checkpoints=checkpoints)
        return torch.autograd.grad((carry**2).sum() + (ys**2).sum(), w)

    run()  # every call as in the forward pass: no alarm
    total = calls[0]
    assert total > 6
    for odd_call[0] in range(7, total + 1):  # each call of the backward pass in turn
        with pytest.raises(funckpt.CheckpointError, match="did not reproduce the forward pass|returned 1 tensors"):
            run()


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_taking_the_gradient_of_an_energy_of_its_carry(checkpoints):
    """``c.detach().requires_grad_()`` then ``torch.autograd.grad`` inside the step (a gradient flow):
    ``requires_grad_`` sets a flag of a new tensor object, it writes none of the loop's inputs."""
    w, b, xs, c0 = make(n=3)
    w.requires_grad_()

    def step(c, x):
        with torch.enable_grad():
            cc = c if c.requires_grad else c.detach().requires_grad_()
            (g,) = torch.autograd.grad((torch.sin(cc @ w) ** 2).sum(), cc, create_graph=True)
        return c - 0.1 * g + x, None

    expected, got = c0, funckpt.scan(step, c0, xs, checkpoints=checkpoints)[0]
    for x in xs:
        expected, _ = step(expected, x)
    assert_close(torch.autograd.grad(got.sum(), w), torch.autograd.grad(expected.sum(), w))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_y_whose_dtype_differs_between_steps_takes_its_cotangent_in_its_own_dtype(checkpoints):
    """``torch.stack`` promotes the ys (float32 and float64: float64); the plain loop's gradient
    reaches the float32 step through a cast, and so does the loop's."""
    w = torch.tensor([0.5, 1.5], dtype=D, requires_grad=True)
    xs = torch.tensor([[1.0], [0.0], [1.0]], dtype=D)

    def step(c, x):
        y = (c * w).sum()
        return c * w, y if x.item() else y.float()

    carry, ys = funckpt.scan(step, torch.ones(2, dtype=D), xs, checkpoints=checkpoints)
    plain_carry, plain_ys = python_scan(step, torch.ones(2, dtype=D), xs)
    assert ys.dtype == plain_ys.dtype
    assert_close(torch.autograd.grad(ys.sum() + carry.sum(), w), torch.autograd.grad(plain_ys.sum() + plain_carry.sum(), w))


def _passing_along(a, b, checkpoints):  # the second carry leaf passed on unchanged by every step
    (p, q), _ = funckpt.scan(lambda c, x: ((c[0] * 2, c[1]), None), (a, b), length=3, checkpoints=checkpoints)
    return (p * q).sum()


def _shifting(a, b, checkpoints):  # a shift register: the new second leaf is the old first
    (p, q), _ = funckpt.scan(lambda c, x: ((c[0] * 2, c[0]), None), (a, b), length=3, checkpoints=checkpoints)
    return (p * q).sum()


def _python_loop_of(step_of_carry, a, b):
    c = (a, b)
    for _ in range(3):
        c = step_of_carry(c)
    return (c[0] * c[1]).sum()


@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("loop", ["passing along", "shifting"])
@pytest.mark.parametrize("transform", ["jvp", "grad", "jvp of remat", "grad of remat", "jvp of nested scans", "dual"])
def test_a_carry_leaf_a_step_returns_as_it_came(loop, transform, checkpoints):
    """A carry leaf the loop returns as it came in (an input, or a carry the sweep kept): the
    loop's outputs are its own tensors, so forward mode gets a tangent for them and an enclosing
    remat finds no tensor of its run outliving it."""
    ours = functools.partial(_passing_along if loop == "passing along" else _shifting, checkpoints=checkpoints)
    step = (lambda c: (c[0] * 2, c[1])) if loop == "passing along" else (lambda c: (c[0] * 2, c[0]))
    plain = functools.partial(_python_loop_of, step)
    a, b = torch.tensor([1.0, 2.0], dtype=D), torch.tensor([3.0, 4.0], dtype=D)
    t = (torch.ones(2, dtype=D), torch.full((2,), 0.5, dtype=D))
    if transform == "jvp":
        assert_close(tf.jvp(ours, (a, b), t), tf.jvp(plain, (a, b), t))
    elif transform == "grad":
        assert_close(tf.grad(ours, argnums=(0, 1))(a, b), tf.grad(plain, argnums=(0, 1))(a, b))
    elif transform == "jvp of remat":
        assert_close(tf.jvp(funckpt.remat(ours), (a, b), t), tf.jvp(plain, (a, b), t))
    elif transform == "grad of remat":
        assert_close(tf.grad(funckpt.remat(ours), argnums=(0, 1))(a, b), tf.grad(plain, argnums=(0, 1))(a, b))
    elif transform == "jvp of nested scans":

        def outer(a, b):
            (p, q), _ = funckpt.scan(lambda c, x: ((ours(*c) * c[0], c[1]), None), (a, b), length=2, checkpoints=checkpoints)
            return (p * q).sum()

        def outer_plain(a, b):
            c = (a, b)
            for _ in range(2):
                c = (plain(*c) * c[0], c[1])
            return (c[0] * c[1]).sum()

        assert_close(tf.jvp(outer, (a, b), t), tf.jvp(outer_plain, (a, b), t))
    else:
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            got = fwAD.unpack_dual(ours(a, fwAD.make_dual(b, t[1]))).tangent
            expected = fwAD.unpack_dual(plain(a, fwAD.make_dual(b, t[1]))).tangent
        # (The shift register drops b: no tangent without remat, a zero one through the loop's
        # Function, which gives every differentiable output one.)
        assert_close(got, torch.zeros((), dtype=D) if expected is None else expected)


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_an_initial_carry_no_step_uses_gets_no_gradient(checkpoints):
    """As in the plain loop: ``None``, not zeros (an optimizer skips a parameter without a gradient,
    where a zero one still moves its weight decay and moments)."""
    w, b, xs, c0 = make(n=4)
    w.requires_grad_(), c0.requires_grad_()
    carry, _ = funckpt.scan(lambda c, x: (torch.tanh(x @ w + b), None), c0, xs, checkpoints=checkpoints)
    assert torch.autograd.grad(carry.sum(), (w, c0), allow_unused=True)[1] is None


def _loop_over(loop, checkpoints, body, c0, xs):
    """``c = body(k, c, xs[k])`` for each step ``k`` (a Python int) by ``loop``, or by the plain Python loop."""
    n = xs.shape[0]
    if loop == "python":
        for k in range(n):
            c0 = body(k, c0, xs[k])
        return c0
    if loop == "scan":  # (the step's index comes in xs, unbatched)
        step = lambda c, kx: (body(int(kx[0]), c, kx[1]), None)  # noqa: E731
        return funckpt.scan(step, c0, (torch.arange(n), xs), checkpoints=checkpoints)[0]
    if loop == "fori_loop":
        return funckpt.fori_loop(0, n, lambda k, c: body(k, c, xs[k]), c0, checkpoints=checkpoints)
    step = lambda s: (s[0] + 1, body(int(s[0]), s[1], xs[int(s[0])]))  # noqa: E731
    return funckpt.while_loop(lambda s: int(s[0]) < n, step, (torch.tensor(0), c0), checkpoints=checkpoints)[1]


def _backward(loss, c0s, xss, inputs):
    """The first example's loss differentiated by plain autograd."""
    return torch.autograd.grad(loss(c0s[0], xss[:, 0]), inputs, allow_unused=True)


def _vmap_then_backward(loss, c0s, xss, inputs):
    """The examples' losses under a vmap over (c0, xs), summed and differentiated by plain autograd."""
    return torch.autograd.grad(tf.vmap(loss, in_dims=(0, 1))(c0s, xss).sum(), inputs, allow_unused=True)


def _vmap_of_grad_then_backward(loss, c0s, xss, inputs):
    """The examples' gradients with respect to (c0, xs) by vmap(grad), differentiated again by plain autograd."""
    per_example = tf.vmap(tf.grad(loss, argnums=(0, 1)), in_dims=(0, 1))(c0s, xss)
    return torch.autograd.grad(sum(g.pow(2).sum() for g in per_example), inputs, allow_unused=True)


# Gradients of ``loss(c0, xs)`` with respect to ``inputs`` by plain autograd (``None`` for those it
# does not reach), with the loop below no transform, below a vmap, and below a vmap of a grad.
_ROUTES_TO_BACKWARD = {
    "backward": _backward,
    "vmap, then backward": _vmap_then_backward,
    "vmap(grad), then backward": _vmap_of_grad_then_backward,
}


def _assert_same_gradients(got, expected):
    """Equal gradients, and ``None`` exactly where the reference has ``None`` (not a zero tensor)."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if e is None:
            assert g is None, f"input {i}: a gradient where the plain loop gives None"
        else:
            assert_close(g, e)


@pytest.mark.parametrize("route", list(_ROUTES_TO_BACKWARD))
@pytest.mark.parametrize("checkpoints", [None, 1, 2])
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
def test_a_module_the_step_reaches_but_never_calls_gets_no_gradient(loop, checkpoints, route):
    """A module in the step's closure that the step never calls: its parameters get ``None``, as in
    the plain loop, under a vmap too (they got zeros there, and AdamW moves a parameter whose
    gradient is zero); a weight used in every step and one used in some steps only get the plain
    loop's gradients, as do the carry and xs."""
    g = torch.Generator().manual_seed(0)
    w, u = torch.randn(4, 4, dtype=D, generator=g) / 2, torch.randn(4, dtype=D, generator=g)
    c0s, xss = torch.randn(2, 4, dtype=D, generator=g), torch.randn(3, 2, 4, dtype=D, generator=g)
    unused = torch.nn.Linear(4, 4, dtype=D)

    def body(k, c, x):
        unused  # noqa: B018  # (reached, never called)
        h = torch.tanh(c @ w + x)
        return h * u if k % 2 else h  # (u in step 1 only)

    def grads(loop):
        inputs = [t.requires_grad_() for t in (w, u, c0s, xss)] + list(unused.parameters())
        loss = lambda c, x: _loop_over(loop, checkpoints, body, c, x).pow(2).sum()  # noqa: E731
        return _ROUTES_TO_BACKWARD[route](loss, c0s, xss, inputs)

    _assert_same_gradients(grads(loop), grads("python"))


@pytest.mark.parametrize("route", list(_ROUTES_TO_BACKWARD))
@pytest.mark.parametrize("checkpoints", [None, 1, 2])
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
@pytest.mark.parametrize("unread", ["the initial carry", "xs"])
def test_an_initial_carry_or_xs_no_step_reads_gets_no_gradient(unread, loop, checkpoints, route):
    """As in the plain loop, under a vmap too: ``None``, not zeros, for the loop's input no step reads."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=D, generator=g) / 2
    c0s, xss = torch.randn(2, 4, dtype=D, generator=g), torch.randn(3, 2, 4, dtype=D, generator=g)
    if unread == "the initial carry":
        body = lambda k, c, x: torch.tanh(x @ w)  # noqa: E731
    else:
        body = lambda k, c, x: torch.tanh(c @ w)  # noqa: E731

    def grads(loop):
        inputs = [t.requires_grad_() for t in (w, c0s, xss)]
        loss = lambda c, x: _loop_over(loop, checkpoints, body, c, x).pow(2).sum()  # noqa: E731
        return _ROUTES_TO_BACKWARD[route](loss, c0s, xss, inputs)

    _assert_same_gradients(grads(loop), grads("python"))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_saved_tensors_hooks_pack_the_loops_inputs_not_its_steps(checkpoints):
    """A user's ``saved_tensors_hooks`` around a loop and its backward pass see what they see
    around a remat'd call: its inputs, not what its steps save when they run again."""
    w, b, xs, c0 = make()
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    w, c0 = w.clone().requires_grad_(), c0.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        carry, ys = funckpt.scan(functools.partial(cell, w, b), c0, xs, checkpoints=checkpoints)
        (carry.sum() + ys.sum()).backward()
    plain_w, plain_c0 = w.detach().clone().requires_grad_(), c0.detach().clone().requires_grad_()
    carry, ys = python_scan(functools.partial(cell, plain_w, b), plain_c0, xs)
    (carry.sum() + ys.sum()).backward()
    assert_close((w.grad, c0.grad), (plain_w.grad, plain_c0.grad))
    assert len(packed) <= 4  # (the loop's tensor inputs, saved by its node)


@pytest.mark.parametrize("checkpoints", [None, 1])
def test_transforms_entered_in_inference_mode(checkpoints):
    """Below a torch.func level entered in ``torch.inference_mode()`` autograd is excluded from
    dispatch: the steps run again in the backward pass must record their graphs anyway."""
    w, b, xs, c0 = make()

    def loss(loop):
        return lambda w: sum(map(torch.sum, loop(functools.partial(cell, w, b), c0, xs)))

    scan = functools.partial(funckpt.scan, checkpoints=checkpoints)
    with torch.inference_mode():
        assert_close(tf.grad(loss(scan))(w), tf.grad(loss(python_scan))(w))
        try:
            expected = tf.jacfwd(loss(python_scan))(w)
        except RuntimeError:  # (torch 2.11's own jacfwd fails inside inference_mode)
            return
        assert_close(tf.jacfwd(loss(scan))(w), expected)


def test_autocast_cache_keeps_no_cast_of_the_steps_run_again():
    """A loop differentiated inside its autocast block: the casts of the steps run again in the
    backward pass are not cached to the block's end (their number grew with the loop's length)."""
    w = torch.randn(16, 16, requires_grad=True)
    c0 = torch.randn(4, 16, requires_grad=True)
    step = lambda i, c: torch.tanh(c @ w).float()  # noqa: E731
    counts = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for n in (4, 12):
            with LiveBf16Casts() as casts:
                funckpt.fori_loop(0, n, step, c0, checkpoints=2).sum().backward()
                counts.append(casts.alive())
    assert counts[1] <= counts[0]




@pytest.mark.parametrize("in_dim", [1, -1])
@pytest.mark.parametrize("checkpoints", [None, 1])
def test_vmap_over_a_non_leading_dim_gives_each_gradient_its_inputs_layout(in_dim, checkpoints):
    """``vmap(loop, in_dims=1)`` differentiated: the loop's batched vjp returns each input's
    gradient batched where the input is (it came back at dim 0: transposed, silently, for a
    square input), and an unbatched weight's as the sum over the examples."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=D, generator=g)
    c = torch.randn(4, 4, dtype=D, generator=g)  # (square: a transposed gradient would fit)
    weights = torch.arange(1.0, 5.0, dtype=D)

    def loss(loop):
        def f(w, c):
            body = lambda i, c: torch.tanh(c @ w) * (i + 1)  # noqa: E731
            out = tf.vmap(lambda c: loop(body, c), in_dims=in_dim)(c)
            return (out * weights[:, None]).sum()

        return f

    plain = lambda body, c: body(2, body(1, body(0, c)))  # noqa: E731
    checkpointed = lambda body, c: funckpt.fori_loop(0, 3, body, c, checkpoints=checkpoints)  # noqa: E731
    assert_close(tf.grad(loss(checkpointed), argnums=(0, 1))(w, c), tf.grad(loss(plain), argnums=(0, 1))(w, c))


@pytest.mark.parametrize("transform", ["grad_of_vmap", "vmap_of_grad", "backward"])
def test_remat_of_a_loop_that_carries_its_weights_through(transform):
    """A remat around a loop whose step returns a carry leaf as it is (an RNN's weights carried
    read-only): the loop's digests of its steps, taken inside the enclosing call's run, are
    funckpt's own operators, not the function's use of a tensor it was not given."""
    g = torch.Generator().manual_seed(0)
    w, xs = torch.randn(4, 4, dtype=D, generator=g), torch.randn(5, 4, dtype=D, generator=g)
    body = lambda i, c: (c[0], torch.tanh(c[1] @ c[0]))  # noqa: E731
    plain = lambda w, x: body(2, body(1, body(0, (w, x))))[1]  # noqa: E731
    looped = funckpt.remat(lambda w, x: funckpt.fori_loop(0, 3, body, (w, x))[1])

    def run(f):
        if transform == "grad_of_vmap":
            return tf.grad(lambda w: tf.vmap(f, in_dims=(None, 0))(w, xs).sum())(w)
        if transform == "vmap_of_grad":
            return tf.vmap(tf.grad(lambda w, x: f(w, x).sum()), in_dims=(None, 0))(w, xs)
        leaf = w.clone().requires_grad_()
        f(leaf, xs).sum().backward()
        return leaf.grad

    assert_close(run(looped), run(plain))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_writing_its_carry_in_place_with_nothing_to_differentiate_runs(checkpoints):
    """A step updating its carry in place (``c[i] = ...``, JAX's dynamic_update_slice) cannot be
    replayed from a kept carry, so a loop differentiated through raises; with nothing requiring
    grad nothing runs again, and the loop runs as the Python loop does."""

    def body(i, c):
        c[i] = i + 1.0
        return c

    expected = body(2, body(1, body(0, torch.zeros(3, dtype=D))))
    assert_close(funckpt.fori_loop(0, 3, body, torch.zeros(3, dtype=D), checkpoints=checkpoints), expected)
    with pytest.raises(funckpt.CheckpointError, match="modified one of its differentiable inputs in place"):
        funckpt.fori_loop(0, 3, body, torch.zeros(3, dtype=D).requires_grad_() * 1, checkpoints=checkpoints)


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
@pytest.mark.parametrize("how", ["backward", "grad", "vmap_of_grad"])
def test_a_step_updating_its_container_carry_in_place_and_returning_it(checkpoints, how):
    """``c["h"] = ...; return c``: the step's carry is its own, as in JAX, so writing into it is
    no error (it raised, and under a transform a tensor so written looked kept outside the call);
    values and gradients are the Python loop's. The caller's initial carry is left as it was."""
    torch.manual_seed(0)
    w0, h0, xs = torch.randn(3, 3, dtype=D), torch.randn(3, dtype=D), torch.randn(5, 3, dtype=D)

    def step(c, x):
        c["h"] = torch.tanh(c["h"] @ c["w"] + x)
        c["seen"] = c["seen"] + 1
        return c, c["h"].sum()

    def loss(w, h, looped):
        init = {"h": h, "w": w, "seen": 0}
        if looped:
            c, ys = funckpt.scan(step, init, xs, checkpoints=checkpoints)
        else:
            c, ys = dict(init), []
            for x in xs:
                c, y = step(c, x)
                ys.append(y)
            ys = torch.stack(ys)
        assert init["h"] is h and init["seen"] == 0 and c["seen"] == len(xs)
        return c["h"].pow(2).sum() + ys.sum()

    def grads(looped):
        if how == "grad":
            return tf.grad(loss, argnums=(0, 1))(w0, h0, looped)
        if how == "vmap_of_grad":
            return tf.vmap(tf.grad(loss, argnums=(0, 1)), in_dims=(None, 0, None))(w0, h0.expand(2, 3) * 1, looped)
        w, h = w0.clone().requires_grad_(), h0.clone().requires_grad_()
        return torch.autograd.grad(loss(w, h, looped), (w, h))

    assert_close(grads(True), grads(False))


def test_a_loops_errors_name_the_loop_function():
    """A fori_loop's (or while_loop's) refusal says fori_loop, not scan."""
    count = torch.zeros(())

    def body(i, c):
        count.add_(1)  # (state updated in place, as a BatchNorm's statistics)
        return c.sin()

    with pytest.raises(funckpt.CheckpointError, match=r"^fori_loop\(body\): a step modified"):
        funckpt.fori_loop(0, 3, body, torch.ones(3, dtype=D).requires_grad_() * 1, checkpoints=2)


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_what_a_step_run_again_raises_is_told_by_the_loop(checkpoints):
    """A step that raises when run again in the backward pass (and did not in the forward pass) is
    told as the loop's, not as remat's (it said ``remat(body)``), the exception's type kept."""
    calls = []

    def body(i, c):
        calls.append(i)
        if len(calls) > 3:
            raise ValueError("boom")
        return c.sin()

    c = funckpt.fori_loop(0, 3, body, torch.ones(3, dtype=D, requires_grad=True), checkpoints=checkpoints)
    with pytest.raises(ValueError, match=r"^fori_loop\(body\): .*raised ValueError: boom"):
        c.sum().backward()


def test_a_carry_leaf_that_becomes_a_tensor_is_named():
    """``scan(f, 0, xs)`` with a step returning a tensor carry (JAX's weakly typed ``init=0``): the
    error names the leaf and says to start from a tensor, not two identical structures."""
    xs = torch.arange(4.0, dtype=D)
    with pytest.raises(TypeError, match=r"leaf 0 is a tensor where the loop's initial carry has int.*torch.tensor\(0.0\)"):
        funckpt.scan(lambda c, x: (c + x, c + x), 0, xs)
    carry, _ = funckpt.scan(lambda c, x: (c + x, c + x), torch.tensor(0.0, dtype=D), xs)
    assert_close(carry, xs.sum())


def test_a_tensor_condition_under_linearize_says_the_program_is_traced():
    """``torch.func.linearize`` traces the program: a while_loop's tensor condition has no value to
    read there, and the error says so (not that it differs across a vmap's batch)."""
    x = torch.tensor([0.5], dtype=D)
    loop = lambda x: funckpt.while_loop(lambda c: c.sum() < 2, lambda c: c * 1.5, x)  # noqa: E731
    with pytest.raises(funckpt.CheckpointError, match="being traced"):
        tf.linearize(loop, x)


@pytest.mark.parametrize("use", ["ys", "carry"])
def test_a_loss_on_some_outputs_still_reverses_the_loop_along_its_schedule(use):
    """A loss on the ys alone (an RNN's) or the final carry alone leaves the other outputs without
    a gradient: the loop is still reversed step by step from its kept carries (as many step runs
    as with every output used), not recomputed whole at once with every step's internals alive."""
    runs = []

    def step(c, x):
        runs.append(1)
        out = torch.tanh(torch.tanh(c * x) * 1.5)
        return out, out.sum()

    xs = torch.randn(30, 5, dtype=D, generator=torch.Generator().manual_seed(0))

    def step_runs_in_the_backward(which):
        c0 = torch.randn(5, dtype=D, requires_grad=True)
        carry, ys = funckpt.scan(step, c0, xs, checkpoints=3)
        loss = {"both": carry.sum() + ys.sum(), "ys": ys.sum(), "carry": carry.sum()}[which]
        runs.clear()
        loss.backward()
        return len(runs)

    assert step_runs_in_the_backward(use) == step_runs_in_the_backward("both") > len(xs)


@pytest.mark.parametrize("checkpoints", [None, 1])
@pytest.mark.parametrize("transform", ["grad", "backward"])
def test_vmap_of_a_loop_with_an_unbatched_output_used(checkpoints, transform):
    """``vmap(loop, out_dims=(None, 0))``, the unbatched output (computed from the weights alone)
    used by the loss: the loop's batched vjp gives each example a share of its cotangent, so the
    weights' gradient takes it once, not once per example."""
    g = torch.Generator().manual_seed(0)
    w, xs = torch.randn(4, 4, dtype=D, generator=g), torch.randn(5, 4, dtype=D, generator=g)
    body = lambda i, c: (c[0] * 1.1, torch.tanh(c[1] @ c[0]))  # noqa: E731

    def grad_of(loop):
        def loss(w):
            a, b = tf.vmap(lambda x: loop((w, x)), out_dims=(None, 0))(xs)
            return a.sum() * 0.7 + b.sum()

        if transform == "grad":
            return tf.grad(loss)(w)
        leaf = w.clone().requires_grad_()
        loss(leaf).backward()
        return leaf.grad

    plain = lambda c: body(2, body(1, body(0, c)))  # noqa: E731
    assert_close(grad_of(lambda c: funckpt.fori_loop(0, 3, body, c, checkpoints=checkpoints)), grad_of(plain))


# A derivative of a loss that reads what a loop's step kept outside it, by several routes.
_KEEPING_ROUTES = {
    "backward": lambda loss, w: (lambda leaf: torch.autograd.grad(loss(leaf), leaf)[0])(w.clone().requires_grad_()),
    "grad": lambda loss, w: tf.grad(loss)(w),
    "vmap(grad)": lambda loss, w: tf.vmap(tf.grad(lambda w, s: loss(w) * s), in_dims=(None, 0))(w, torch.ones(2, dtype=D)),
}


def _loop_keeping(what, loop, checkpoints, xs, c0):
    """A loss through ``loop`` whose step keeps ``what`` in a list, read after the loop."""

    def loss(w):
        kept = []

        def cell_keeping(c, x):
            h = torch.tanh(c @ w + x)
            if what == "a tensor with a gradient":
                kept.append(h.sin())
            elif what == "a detached tensor":
                kept.append(h.detach().sin())
            elif what == "a number":
                kept.append(h.sum().item())
            elif what == "an integer tensor":
                kept.append(h.argmax())
            elif what == "its .data":
                kept.append(h.data)
            elif what == "its sign (a zero derivative)":
                kept.append(torch.sign(h))
            return h, h.sum()

        if loop == "scan":
            c, ys = funckpt.scan(cell_keeping, c0, xs, checkpoints=checkpoints)
        elif loop == "python":
            c, ys = python_scan(cell_keeping, c0, xs)
        else:
            c = funckpt.fori_loop(0, xs.shape[0], lambda i, c: cell_keeping(c, xs[i])[0], c0, checkpoints=checkpoints)
            ys = c.sum()
        read = sum((t * 1.0).pow(2).sum() if isinstance(t, torch.Tensor) else t for t in kept)
        return c.pow(2).sum() + ys.sum() + read

    return loss


@pytest.mark.parametrize("route", list(_KEEPING_ROUTES))
@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_keeping_a_tensor_with_a_gradient_outside_the_loop_raises(checkpoints, loop, route):
    """The forward sweep records no graph and the backward pass runs the steps again one at a
    time: a tensor a step computes and keeps outside it (an auxiliary loss in a list or on a
    module) would get no gradient. Refused, saying to return it as the step's y."""
    w, _, xs, c0 = make(n=5)
    with pytest.raises(funckpt.CheckpointError, match="(?s)in a step of a checkpointed loop.*as its y"):
        _KEEPING_ROUTES[route](_loop_keeping("a tensor with a gradient", loop, checkpoints, xs, c0), w)


@pytest.mark.parametrize("route", list(_KEEPING_ROUTES))
@pytest.mark.parametrize("what", ["a detached tensor", "a number", "an integer tensor", "its .data", "its sign (a zero derivative)"])
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_may_keep_what_carries_no_gradient(checkpoints, what, route):
    w, _, xs, c0 = make(n=5)
    got = _KEEPING_ROUTES[route](_loop_keeping(what, "scan", checkpoints, xs, c0), w)
    assert_close(got, _KEEPING_ROUTES[route](_loop_keeping(what, "python", checkpoints, xs, c0), w))



class _PlainState:
    """A carry type optree does not flatten (a dataclass nobody registered): a leaf to the loop."""

    def __init__(self, h, n):
        self.h, self.n = h, n


class _RegisteredState(_PlainState):
    pass


optree.register_pytree_node(
    _RegisteredState, lambda s: ((s.h, s.n), None), lambda _, children: _RegisteredState(*children), namespace="funckpt"
)


@pytest.mark.parametrize("route", list(_KEEPING_ROUTES))
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_carry_of_a_type_optree_does_not_flatten_is_named(checkpoints, loop, route):
    """A step returning its new tensor inside an object optree does not flatten (a plain class, an
    unregistered dataclass) hands the loop a leaf it passes along as it is, so the gradient through
    that tensor would be missing. Refused naming the type and how to register it (it said to return
    the tensor in the carry, where it was); registered, the loop equals the Python loop."""
    w, _, xs, c0 = make(n=4)

    def loss(w, kind, looped):
        def body(s):
            return kind(torch.tanh(s.h @ w + xs[s.n]), s.n + 1)

        init = kind(c0, 0)
        if not looped:
            s = init
            for _ in range(len(xs)):
                s = body(s)
        elif loop == "scan":
            s, _ = funckpt.scan(lambda s, x: (body(s), None), init, xs, checkpoints=checkpoints)
        elif loop == "fori_loop":
            s = funckpt.fori_loop(0, len(xs), lambda i, s: body(s), init, checkpoints=checkpoints)
        else:
            s = funckpt.while_loop(lambda s: s.n < len(xs), body, init, checkpoints=checkpoints)
        return s.h.pow(2).sum()

    with pytest.raises(funckpt.CheckpointError, match=r"(?s)inside a _PlainState.*optree.register_pytree_node\(_PlainState"):
        _KEEPING_ROUTES[route](functools.partial(loss, kind=_PlainState, looped=True), w)
    got = _KEEPING_ROUTES[route](functools.partial(loss, kind=_RegisteredState, looped=True), w)
    assert_close(got, _KEEPING_ROUTES[route](functools.partial(loss, kind=_RegisteredState, looped=False), w))


def _counting_loss(w, h, looped, checkpoints=None, preserve_rng_state=True, clone_first=True, i0=None):
    """A loss through a scan whose step counts its steps in an integer tensor of its carry, ``i += 1``:
    in place into the carry the step before returned, and into the initial carry ``i0`` unless the
    first step clones it (``clone_first``)."""

    def step(c, x):
        h, i, first = c
        if first and clone_first:
            i = i.clone()
        i += 1
        return (torch.tanh(h * w[i] + x), i, False), None

    i0 = torch.tensor(0) if i0 is None else i0
    init, xs = (h, i0, True), torch.linspace(0, 1, 6, dtype=D)[:, None].expand(6, 3)
    if looped:
        (h, _, _), _ = funckpt.scan(step, init, xs, checkpoints=checkpoints, preserve_rng_state=preserve_rng_state)
    else:
        c = init
        for x in xs:
            c, _ = step(c, x)
        h = c[0]
    return h.pow(2).sum()


@pytest.mark.parametrize("route", list(_KEEPING_ROUTES))
@pytest.mark.parametrize("preserve_rng_state", [True, False])
@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_writing_into_the_carry_the_step_before_returned_is_refused(checkpoints, preserve_rng_state, route):
    """A step writing into its carry in place (``i += 1``) changes the carry where the loop keeps it,
    and the steps run again from it in the backward pass compute something else: refused, saying
    to compute the new carry out of place. (It raised that the step was not deterministic, or an
    in-place error of the step's recomputation, and with ``preserve_rng_state=False``, where the
    steps run again are not compared, gave a silently wrong gradient.)"""
    w, h = torch.randn(20, 3, dtype=D), torch.randn(3, dtype=D)

    def loss(w):
        return _counting_loss(w, h, True, checkpoints, preserve_rng_state)

    with pytest.raises(funckpt.CheckpointError, match="step 1 modified its carry in place.*out of place"):
        _KEEPING_ROUTES[route](loss, w)


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_carry_leaf_made_in_inference_mode_is_passed_along(checkpoints):
    """An inference tensor (no version counter) in the carry, passed on by every step, as the
    Python loop passes it (the watch for writes into the carry read its version counter, and raised)."""
    with torch.inference_mode():
        scale = torch.full((3,), 0.5, dtype=D)
    w, c0, xs = torch.randn(3, 3, dtype=D), torch.randn(3, dtype=D), torch.randn(4, 3, dtype=D)

    def loss(w, looped):
        def step(c, x):
            h, s = c
            return (torch.tanh(h @ w + x) * s, s), None

        if looped:
            (h, _), _ = funckpt.scan(step, (c0, scale), xs, checkpoints=checkpoints)
        else:
            c = (c0, scale)
            for x in xs:
                c, _ = step(c, x)
            h = c[0]
        return h.pow(2).sum()

    assert_close(tf.grad(loss)(w, True), tf.grad(loss)(w, False))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_writing_into_its_carry_runs_where_no_step_runs_again(checkpoints):
    """Forward mode and vmap run the loop whole, as the Python loop does: the write is harmless there."""
    w, h, hs = torch.randn(20, 3, dtype=D), torch.randn(3, dtype=D), torch.randn(2, 3, dtype=D)

    def run(looped):
        jacobians = tf.jacfwd(_counting_loss, argnums=(0, 1))(w, h, looped, checkpoints)
        return jacobians, tf.vmap(_counting_loss, in_dims=(None, 0, None, None))(w, hs, looped, checkpoints)

    assert_close(run(True), run(False))


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_step_writing_into_the_initial_carry_is_refused_and_leaves_it_as_it_was(checkpoints):
    w, h, i0 = torch.randn(20, 3, dtype=D, requires_grad=True), torch.randn(3, dtype=D), torch.tensor(0)
    with pytest.raises(funckpt.CheckpointError, match="step 0 modified its carry in place.*initial carry"):
        _counting_loss(w, h, True, checkpoints, clone_first=False, i0=i0)
    assert i0.item() == 0


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop"])
def test_a_kept_tensor_is_told_by_the_loop_that_keeps_it(loop):
    """The refusal names the loop the user called (not remat) and, where the loop has no y, says to
    carry the tensor; a while_loop's cond is run in the sweep too, and what it keeps is told."""
    w, _, xs, c0 = make(n=5)

    def loss(w):
        kept = []

        def body(*a):
            c = a[-1]
            return torch.tanh(c @ w)

        def cond(c):
            kept.append((c * c).sum())
            return True

        if loop == "fori_loop":
            c = funckpt.fori_loop(0, 3, lambda i, c: (kept.append(c.sin()), body(c))[1], c0)
        else:
            c = funckpt.while_loop(cond, body, c0, max_steps=3)
        return c.sum() + sum(kept)

    with pytest.raises(funckpt.CheckpointError, match=rf"(?s)^{loop}\(.*in a step of a checkpointed loop.*in the carry"):
        tf.grad(loss)(w)


class _LoopModel(torch.nn.Module):
    """A model whose forward runs a checkpointed loop of its own layer (for torch.export)."""

    def __init__(self, loop: str) -> None:
        super().__init__()
        self.lin, self.loop = torch.nn.Linear(4, 4).double(), loop

    def step(self, c: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(c))

    def forward(self, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
        if plain:
            for _ in range(3):
                x = self.step(x)
            return x
        if self.loop == "scan":
            return funckpt.scan(lambda c, _: (self.step(c), None), x, length=3, checkpoints=1)[0]
        return funckpt.fori_loop(0, 3, lambda i, c: self.step(c), x, checkpoints=2)


_TRACERS = {
    "export-strict": lambda model, x: torch.export.export(model, (x,), strict=True).module(),
    "export-non-strict": lambda model, x: torch.export.export(model, (x,), strict=False).module(),
    "jit.trace": lambda model, x: torch.jit.trace(model, x, check_trace=False),
}


@pytest.mark.parametrize("tracer", list(_TRACERS))
@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_a_traced_checkpointed_loop_computes_the_plain_loop(loop, tracer):
    """torch.export and torch.jit.trace record a checkpointed loop as the plain Python loop of
    its step (a remat'd call is its function there): the recorded program gives its output."""
    model, x = _LoopModel(loop), torch.randn(2, 4, dtype=torch.float64)
    assert_close(_TRACERS[tracer](model, x)(x), model(x, plain=True))



class _Log:
    """An object a step reaches through its closure (as a layer reaches its model), holding a list
    the code around the loop appends to."""

    def __init__(self):
        self.entries = []


def _logged_scan(loop):
    """``f(w, x)``: two steps of ``tanh(c @ w)`` (a checkpointed scan if ``loop``, else in Python)
    whose step reaches a log that the loop's output is appended to after the call."""
    log = _Log()

    def f(w, x):
        def step(c, _):
            log  # (reaches the log)
            return torch.tanh(c @ w), None

        y = funckpt.scan(step, x, length=2, checkpoints=1)[0] if loop else step(step(x, None)[0], None)[0]
        log.entries.append(y)
        return y.sin()

    return f


def _by_backward(f, w, xs):
    w = w.clone().requires_grad_()
    f(w, xs[0]).sum().backward()
    return w.grad


_LOGGED_ROUTES = {
    "backward": _by_backward,
    "grad": lambda f, w, xs: tf.grad(lambda w: f(w, xs[0]).sum())(w),
    "vmap(grad)": lambda f, w, xs: tf.vmap(tf.grad(lambda w, x: f(w, x).sum()), in_dims=(None, 0))(w, xs),
    "grad(vmap)": lambda f, w, xs: tf.grad(lambda w: tf.vmap(f, in_dims=(None, 0))(w, xs).sum())(w),
    "jacrev": lambda f, w, xs: tf.jacrev(lambda w: f(w, xs[0]))(w),
}


@pytest.mark.parametrize("route", list(_LOGGED_ROUTES))
def test_a_step_reaching_the_list_the_loops_output_is_logged_to(route):
    """In the backward pass the step reaches the loop's own output, logged since the call: a
    differentiable tensor it did not reach at the call, and never reads. No rebound closure."""
    w, _, xs, _ = make(n=6)
    xs = xs.reshape(3, 2, 4)
    differentiate = _LOGGED_ROUTES[route]
    assert_close(differentiate(_logged_scan(True), w, xs), differentiate(_logged_scan(False), w, xs))


def test_a_steps_closure_tensor_rebound_before_the_backward_raises():
    """Rebound between the forward and the backward pass and read by the step, the tensor would
    change the gradient: refused."""
    w, _, xs, c0 = make(n=3)
    w = w.clone().requires_grad_()

    def step(c, x):
        return torch.tanh(c @ w + x), None

    c = funckpt.scan(step, c0, xs, checkpoints=1)[0]
    w = w.detach().clone().requires_grad_()  # noqa: F841 - rebinds the step's cell
    with pytest.raises(funckpt.CheckpointError, match="was rebound"):
        c.sum().backward()


@pytest.mark.parametrize("checkpoints", [None, 1, 2])
def test_a_step_returning_a_rebound_closure_tensor_as_it_is_raises(checkpoints):
    """No operator receives a closure tensor a step returns untouched as its y: the reversal
    refuses the one rebound since the call all the same (with equal values the determinism check
    cannot see it, and the old tensor's gradient would silently be missing)."""
    w = torch.randn(3, dtype=D, requires_grad=True)

    def step(c, x):
        return c * 2, w

    c, ys = funckpt.scan(step, torch.randn(3, dtype=D, requires_grad=True), None, length=2, checkpoints=checkpoints)
    w = w.detach().clone().requires_grad_()  # noqa: F841 - rebinds step's cell, same values
    with pytest.raises(funckpt.CheckpointError, match="was rebound"):
        (c.sum() + ys.sum()).backward()


@pytest.mark.parametrize("checkpoints", [1, 2])
def test_a_step_reading_a_rebound_closure_tensor_detached_raises(checkpoints):
    """The reversal refuses a closure tensor rebound since the call also where a step reads it
    detached (a straight-through estimator: the values do not show it): the gradient would follow
    the new one, where without remat the steps read the old one."""
    w = torch.tensor([1.1, 0.9, 1.05], dtype=D, requires_grad=True)

    def step(c, x):
        return c + (c * w.detach() - (c * w.detach()).detach()), None

    c = torch.randn(3, dtype=D, requires_grad=True)
    out = funckpt.scan(step, c, None, length=4, checkpoints=checkpoints)[0].sum()
    w = torch.tensor([11.0, 9.0, 10.5], dtype=D, requires_grad=True)  # noqa: F841 - rebinds step's cell
    with pytest.raises(funckpt.CheckpointError, match="was rebound"):
        out.backward()


@pytest.mark.parametrize("checkpoints", [None, 1, 2])
def test_a_step_reaching_a_value_whose_graph_a_backward_freed_is_as_the_plain_loop(checkpoints):
    """A step that reaches, and does not use, what an earlier differentiated call left in a container
    (its graph freed): not an input of the loop, whose backward pass would visit that graph and raise
    torch's "backward through the graph a second time"."""
    w, b, xs, c0 = make()
    w = w.requires_grad_()
    held = {"old": torch.sin(c0 @ w)}
    held["old"].sum().backward()

    def step(c, x):
        assert "old" in held  # (reaches it)
        return cell(w, b, c, x)

    def grad_of(loop):
        w.grad = None
        c, ys = loop(step, c0, xs)
        (c.sum() + ys.sum()).backward()
        return w.grad

    plain = grad_of(python_scan)
    assert_close(grad_of(lambda f, c, xs: funckpt.scan(f, c, xs, checkpoints=checkpoints)), plain)


def _reordered_twins():
    a = torch.tensor([1.1, 0.9, 1.05], dtype=D, requires_grad=True)
    return [a, a.detach().clone().requires_grad_()]


_REORDERED_LOOPS = {
    "scan": lambda step, c: funckpt.scan(step, c, None, length=3)[0],
    "scan checkpoints=1": lambda step, c: funckpt.scan(step, c, None, length=3, checkpoints=1)[0],
    "fori_loop": lambda step, c: funckpt.fori_loop(0, 3, lambda i, c: step(c, None)[0], c),
    "while_loop": lambda step, c: funckpt.while_loop(lambda c: c.abs().sum() < 1e9, lambda c: step(c, None)[0], c, max_steps=3),
}


@pytest.mark.parametrize("loop", list(_REORDERED_LOOPS))
def test_a_steps_closure_list_reordered_before_the_backward_raises(loop):
    """Reordered between the forward and the backward pass (equal values), the list would have the
    steps run again read the second tensor where the forward sweep read the first: the first's
    gradient would go to the second. Refused where a step uses it."""
    lst = _reordered_twins()

    def step(c, x):
        return c * lst[0] + 0.1, None

    c = torch.randn(3, dtype=D, requires_grad=True)
    out = _REORDERED_LOOPS[loop](step, c).sum()
    lst.reverse()
    with pytest.raises(funckpt.CheckpointError, match=r"at 'lst\[0\]'.*reached at the call elsewhere.*in the carry or xs"):
        out.backward()


@pytest.mark.parametrize("route", ["backward", "grad"])
def test_a_steps_closure_list_appended_to_before_the_backward(route):
    """No false alarm: the steps read at the backward what they read at the call."""

    def run(use_loop):
        lst = _reordered_twins()

        def step(c, x):
            return c * lst[0] + lst[1], None

        def loss(c):
            if use_loop:
                out = funckpt.scan(step, c, None, length=3, checkpoints=1)[0]
            else:
                out = c
                for _ in range(3):
                    out = step(out, None)[0]
            lst.append(torch.ones(3, dtype=D, requires_grad=True))
            lst.insert(2, torch.zeros(3, dtype=D))
            return out.sum()

        c = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(5))
        if route == "grad":
            return [tf.grad(loss)(c)]
        c.requires_grad_()
        loss(c).backward()
        return [c.grad, lst[0].grad, lst[1].grad]

    assert_close(run(True), run(False))


@pytest.mark.parametrize("checkpoints", [None, 1])
def test_a_steps_closure_list_of_modules_reordered_before_the_backward_raises(checkpoints):
    """A plain list of equal modules reordered: the steps run again would run the second with its own
    parameters where the forward sweep ran the first. Refused."""
    layer = torch.nn.Linear(3, 3, dtype=D)
    twin = torch.nn.Linear(3, 3, dtype=D)
    twin.load_state_dict(layer.state_dict())
    layers = [layer, twin]
    c0 = torch.randn(3, dtype=D, requires_grad=True)
    c = funckpt.scan(lambda c, _: (torch.tanh(layers[0](c)), None), c0, None, length=3, checkpoints=checkpoints)[0]
    layers.reverse()
    with pytest.raises(funckpt.CheckpointError, match=r"module at 'layers\[0\]'.*reached at the call elsewhere.*nn.ModuleList"):
        c.sum().backward()


def test_while_loop_takes_a_numpy_bool_from_cond_as_jax_does():
    """``np.float64(v) < 5.0`` is a NumPy bool, not a Python one: taken as its truth value."""
    body = lambda c: c * 1.5 + 1  # noqa: E731
    cond = lambda c: np.float64(c.sum().item()) < 20.0  # noqa: E731
    init = torch.ones(2, dtype=D).requires_grad_()
    expected = init
    while bool(np.float64(expected.sum().item()) < 20.0):
        expected = body(expected)
    got = funckpt.while_loop(cond, body, init, checkpoints=2)
    assert_close(got, expected)
    assert_close(torch.autograd.grad(got.sum(), init), torch.autograd.grad(expected.sum(), init))


@pytest.mark.parametrize("api", ["scan", "fori_loop", "while_loop"])
def test_a_bad_policy_is_named_by_the_loop_it_was_given_to(api):
    calls = {
        "scan": lambda: funckpt.scan(lambda c, x: (c, None), torch.zeros(2), length=2, policy="dots_saveable"),
        "fori_loop": lambda: funckpt.fori_loop(0, 2, lambda i, c: c, torch.zeros(2), policy="dots_saveable"),
        "while_loop": lambda: funckpt.while_loop(lambda c: False, lambda c: c, torch.zeros(2), policy="dots_saveable"),
    }
    with pytest.raises(TypeError, match=rf"^{api}: policy must be a callable"):
        calls[api]()


@pytest.mark.parametrize("loop", ["fori_loop", "fori_loop_checkpoints", "scan"])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_a_reentrant_checkpoint_in_a_step_warns_as_without_funckpt(loop, grad_mode):
    """A step calling ``torch.utils.checkpoint(..., use_reentrant=True)`` warns as the Python loop does:
    not "None of the inputs have requires_grad=True" in the forward sweep and the runs that advance
    from a kept carry, where the carries do not require grad because those runs record nothing (they
    do without funckpt); still where the loop runs under no_grad, as the Python loop does. The
    gradients are the Python loop's."""
    import warnings

    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    lin = torch.nn.Linear(3, 3, dtype=D)

    def body(i, c):
        return torch_checkpoint(lambda c: torch.tanh(lin(c)), c, use_reentrant=True)

    def python_loop(x):
        for i in range(5):
            x = body(i, x)
        return x

    loops = {
        "fori_loop": lambda x: funckpt.fori_loop(0, 5, body, x),
        "fori_loop_checkpoints": lambda x: funckpt.fori_loop(0, 5, body, x, checkpoints=2),
        "scan": lambda x: funckpt.scan(lambda c, _: (body(0, c), None), x, length=5)[0],
    }

    def run(f):
        x = torch.randn(2, 3, dtype=D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.set_grad_enabled(grad_mode):
                out = f(x).sum()
            if grad_mode:
                out.backward()
        messages = [str(w.message) for w in caught if "requires_grad=True" in str(w.message)]
        return messages, (x.grad, lin.weight.grad) if grad_mode else out

    expected = run(python_loop)
    lin.zero_grad(set_to_none=True)
    got = run(loops[loop])
    assert got[0] == expected[0]
    assert_close(got[1], expected[1])
