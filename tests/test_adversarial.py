"""Adversarial cases: programs torch runs that remat must run too, programs remat must not get
silently wrong, and savings that must really happen.

Every comparison is against the same function without remat (or against
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` where that is the reference),
in float64, values and gradients. Where remat cannot be right, ``CheckpointError`` is expected.
"""

import copy
import functools
import itertools
from collections import namedtuple

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import funckpt
from funckpt import CheckpointError, checkpoint, checkpoint_name, checkpoint_sequential, policies, remat

D = torch.float64
aten = torch.ops.aten


def randn(*shape, seed=0, dtype=D):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# One derivative of ``fn(x, *rest)`` with respect to ``x``, computed the way ``how`` names.
# ---------------------------------------------------------------------------------------------

REVERSE = ["backward", "autograd_create_graph", "grad", "vjp", "vmap_grad", "jacrev", "hessian"]
FORWARD = ["jvp", "jacfwd"]
ALL = REVERSE + FORWARD


def tangent_like(x):
    return torch.linspace(-1, 1, x.numel(), dtype=x.dtype).reshape(x.shape)


def derivative(how, fn, x, *rest):
    """Values and a derivative of ``fn(x, *rest)`` (a tensor) with respect to ``x``."""

    def loss(x):
        return fn(x, *rest).sin().sum()

    if how == "backward":
        x = x.detach().requires_grad_()
        out = loss(x)
        out.backward()
        return out.detach(), x.grad
    if how == "autograd_create_graph":
        x = x.detach().requires_grad_()
        out = loss(x)
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        return out.detach(), g.detach(), gg
    if how == "grad":
        return tf.grad_and_value(loss)(x)
    if how == "vjp":
        out, vjp_fn = tf.vjp(lambda x: fn(x, *rest), x)
        return out, vjp_fn(tangent_like(out))
    if how == "vmap_grad":
        return tf.vmap(tf.grad(loss))(torch.stack([x, x.cos()]))
    if how == "jacrev":
        return tf.jacrev(lambda x: fn(x, *rest))(x)
    if how == "hessian":
        return tf.hessian(loss)(x)
    if how == "jvp":
        return tf.jvp(lambda x: fn(x, *rest), (x,), (tangent_like(x),))
    if how == "jacfwd":
        return tf.jacfwd(lambda x: fn(x, *rest))(x)
    raise AssertionError(how)


def make_counter_fn(body):
    """``body(n, x, *rest)`` called with n = 0, 1, 2, ... on successive calls."""
    calls = itertools.count()

    def fn(x, *rest):
        return body(next(calls), x, *rest)

    return fn


def raises_or_matches(how, make_fn, x, *rest):
    """Reverse mode must recompute, so it must raise. Forward mode may run ``fn`` once: then
    it must either raise or equal the un-remat'd function called once."""
    if how in REVERSE:
        with pytest.raises(CheckpointError):
            derivative(how, remat(make_fn()), x, *rest)
        return
    try:
        got = derivative(how, remat(make_fn()), x, *rest)
    except CheckpointError:
        return
    assert_close(got, derivative(how, make_fn(), x, *rest))


# =============================================================================================
# A. Programs torch runs: remat must run them too, with the same values and gradients.
# =============================================================================================


def test_frozen_broadcast_matmul_input_backward():
    def fn(x, w):
        return torch.matmul(x, w).sum()

    def run(f):
        x = randn(2, 5, 8, seed=1).requires_grad_()
        out = f(x, randn(1, 8, 4, seed=2))
        out.backward()
        return out, x.grad

    assert_close(run(remat(fn)), run(fn))


FROZEN = {
    "broadcast_matmul": (lambda x, w: torch.matmul(x, w).tanh(), lambda: (randn(1, 8, 4, seed=2),)),
    "reshape": (
        lambda x, w: (x.reshape(-1, 8) @ w.reshape(8, 4)).tanh().reshape(2, 5, 4),
        lambda: (randn(32, seed=2),),
    ),
    "mask": (lambda x, m: torch.where(m, x.tanh(), x.square()), lambda: (randn(2, 5, 8, seed=3) > 0,)),
    "float_mask": (lambda x, m: (x * m).tanh(), lambda: ((randn(2, 5, 8, seed=3) > 0).to(D),)),
    "masked_fill": (lambda x, m: x.tanh().masked_fill(m, 0.0), lambda: (randn(2, 5, 8, seed=3) > 0,)),
    "position_ids": (
        lambda x, pos, table: (x + table[pos]).tanh(),
        lambda: (torch.tensor([4, 0, 2, 2, 1]), randn(6, 8, seed=4)),
    ),
    "embedding": (
        lambda x, pos, table: x * F.embedding(pos, table),
        lambda: (torch.tensor([[4, 0, 2, 2, 1], [0, 1, 2, 3, 5]]), randn(6, 8, seed=4)),
    ),
    "gather": (
        lambda x, idx: x.tanh().gather(-1, idx),
        lambda: (torch.randint(0, 8, (2, 5, 3), generator=torch.Generator().manual_seed(5)),),
    ),
}


@pytest.mark.parametrize("how", ALL)
@pytest.mark.parametrize("case", list(FROZEN))
def test_frozen_non_differentiable_extra_inputs(case, how):
    fn, extra = FROZEN[case]
    x = randn(2, 5, 8, seed=1)
    assert_close(derivative(how, remat(fn), x, *extra()), derivative(how, fn, x, *extra()))


@pytest.mark.parametrize("how", ["backward", "autograd_create_graph", "grad", "vjp"])
def test_boolean_mask_indexing_with_data_dependent_shape(how):
    def fn(x, m):
        return x[m].tanh()

    m = randn(2, 5, 8, seed=3) > 0
    x = randn(2, 5, 8, seed=1)
    assert_close(derivative(how, remat(fn), x, m), derivative(how, fn, x, m))


def test_frozen_input_of_a_nested_remat_under_backward():
    inner = remat(lambda x, w: torch.matmul(x, w).tanh())

    def fn(x, w):
        return inner(x, w).sum()

    def run(f):
        x = randn(2, 5, 8, seed=1).requires_grad_()
        f(x, randn(1, 8, 4, seed=2)).backward()
        return x.grad

    assert_close(run(remat(fn)), run(fn))


def test_frozen_first_input_when_differentiating_the_second():

    def fn(x, w):
        return torch.matmul(x, w).tanh().sum()

    x = randn(2, 5, 8, seed=1)
    w = randn(1, 8, 4, seed=2)
    assert_close(tf.grad(remat(fn), argnums=1)(x, w), tf.grad(fn, argnums=1)(x, w))


def f_tanh_mm(x, w):
    return torch.tanh(x @ w) * 2


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_call_under_no_grad_or_inference_mode(ctx):
    x = randn(3, 4, seed=1).requires_grad_()
    w = randn(4, 4, seed=2).requires_grad_()
    with ctx():
        expected = f_tanh_mm(x, w)
        got = remat(f_tanh_mm)(x, w)
    assert_close(got, expected)
    assert got.requires_grad == expected.requires_grad
    assert got.is_inference() == expected.is_inference()


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_module_and_nested_remat_under_no_grad_or_inference_mode(ctx):
    net = nn.Sequential(nn.Linear(4, 6, dtype=D), nn.Tanh(), nn.Linear(6, 3, dtype=D))
    wrapped = remat(net)
    nested = remat(lambda x: remat(net)(x).sin())
    x = randn(5, 4, seed=1)
    with ctx():
        expected = net(x)
        got, got_nested = wrapped(x), nested(x)
    assert_close(got, expected)
    assert_close(got_nested, expected.sin())
    assert not got.requires_grad and not got_nested.requires_grad


def test_inference_mode_tensor_as_input_outside_inference_mode():
    """An inference tensor may enter autograd where it is not saved for backward (an add)."""

    def fn(x, w):
        return torch.tanh(w) * 2 + x

    with torch.inference_mode():
        x = randn(3, 4, seed=1) * 1
    w = randn(3, 4, seed=2).requires_grad_()

    def run(f):
        w.grad = None
        out = f(x, w)
        out.sin().sum().backward()
        return out.detach(), w.grad

    assert_close(run(remat(fn)), run(fn))


class Passthrough(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("how", ["backward", "autograd_create_graph"])
def test_torch_function_subclass_input(how):
    w = randn(4, 4, seed=2)

    def run(f):
        x = randn(3, 4, seed=1).as_subclass(Passthrough).requires_grad_()
        out = f(x, w)
        loss = out.sin().sum()
        if how == "backward":
            loss.backward()
            return type(out), out.as_subclass(torch.Tensor).detach(), x.grad.as_subclass(torch.Tensor)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        plain = (out.detach(), g, gg)
        return (type(out), *(t.as_subclass(torch.Tensor) for t in plain))

    got, expected = run(remat(f_tanh_mm)), run(f_tanh_mm)
    assert got[0] is expected[0]
    assert_close(got[1:], expected[1:])


def test_torch_function_subclass_weight_captured_by_a_module():
    net = nn.Linear(4, 3, dtype=D)
    net.weight = nn.Parameter(net.weight.detach().as_subclass(Passthrough))

    def run(m):
        net.zero_grad()
        x = randn(5, 4, seed=1).requires_grad_()
        m(x).tanh().sum().backward()
        return x.grad.as_subclass(torch.Tensor), net.weight.grad.as_subclass(torch.Tensor), net.bias.grad

    assert_close(run(remat(net)), run(net))


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, dtype=D), nn.Tanh(), nn.Linear(6, 3, dtype=D))


@pytest.mark.parametrize("primal_requires_grad", [False, True])
def test_forward_ad_dual_through_remat_module(primal_requires_grad):
    net = mlp()

    def run(m):
        net.zero_grad()
        x = randn(5, 4, seed=1).requires_grad_(primal_requires_grad)
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(m(fwAD.make_dual(x, tangent_like(x))))
            result = [primal.detach(), tangent]
            if primal_requires_grad:
                primal.square().sum().backward()
                result += [x.grad, *(p.grad for p in net.parameters())]
        return result

    assert_close(run(remat(net)), run(net))


def test_forward_ad_tangent_on_a_parameter_through_functional_call():
    net = mlp()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = randn(5, 4, seed=1)

    def run(m):
        with fwAD.dual_level():
            duals = {k: fwAD.make_dual(v, tangent_like(v)) if k == "0.weight" else v for k, v in params.items()}
            return fwAD.unpack_dual(tf.functional_call(m, duals, (x,)))

    got, expected = run(remat(net)), run(net)
    assert_close(tuple(got), tuple(expected))


def hvp(how, f, x, v):
    if how == "func_fwd_over_rev":
        return tf.jvp(tf.grad(f), (x,), (v,))[1]
    if how == "func_rev_over_fwd":
        return tf.grad(lambda x: tf.jvp(f, (x,), (v,))[1])(x)
    if how == "func_rev_over_rev":
        return tf.grad(lambda x: torch.dot(tf.grad(f)(x).flatten(), v.flatten()))(x)
    if how == "autograd_fwd_over_rev":
        x = x.clone().requires_grad_()
        with fwAD.dual_level():
            xd = fwAD.make_dual(x, v)
            (g,) = torch.autograd.grad(f(xd), xd, create_graph=True)
            return fwAD.unpack_dual(g).tangent
    if how == "autograd_fwd_over_rev_without_create_graph":
        # (the backward formulas still run on the saved duals: the gradient is a dual)
        x = x.clone().requires_grad_()
        with fwAD.dual_level():
            xd = fwAD.make_dual(x, v)
            (g,) = torch.autograd.grad(f(xd), xd)
            return fwAD.unpack_dual(g).tangent
    if how == "autograd_fwd_over_func_grad":
        with fwAD.dual_level():
            return fwAD.unpack_dual(tf.grad(f)(fwAD.make_dual(x, v))).tangent
    if how == "autograd_rev_over_fwd":
        x = x.clone().requires_grad_()
        with fwAD.dual_level():
            jvp = fwAD.unpack_dual(f(fwAD.make_dual(x, v))).tangent
        (h,) = torch.autograd.grad(jvp, x)
        return h
    if how == "autograd_rev_over_rev":
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
        (h,) = torch.autograd.grad(g, x, grad_outputs=v)
        return h
    raise AssertionError(how)


HVP = [
    "func_fwd_over_rev",
    "func_rev_over_fwd",
    "func_rev_over_rev",
    "autograd_fwd_over_rev",
    "autograd_fwd_over_rev_without_create_graph",
    "autograd_fwd_over_func_grad",
    "autograd_rev_over_fwd",
    "autograd_rev_over_rev",
]


@pytest.mark.parametrize("how", HVP)
def test_hessian_vector_product_of_a_remat_module(how):
    net = mlp()
    x = randn(5, 4, seed=1)
    v = tangent_like(x)

    def scalar(m):
        return lambda x: m(x).tanh().square().sum()

    assert_close(hvp(how, scalar(remat(net)), x, v), hvp(how, scalar(net), x, v))


@pytest.mark.parametrize("how", HVP)
def test_hessian_vector_product_of_nested_remat_functions(how):
    w = randn(4, 4, seed=2)
    inner = remat(f_tanh_mm)

    def outer(f):
        return lambda x: f(f(x, w), w).square().sum()

    x = randn(3, 4, seed=1)
    v = tangent_like(x)
    assert_close(hvp(how, remat(outer(inner)), x, v), hvp(how, outer(f_tanh_mm), x, v))


CAPTURED_PARAMETER = {
    "module": lambda lin: lin,
    "sequential": lambda lin: nn.Sequential(lin, nn.Tanh()),
    "closure_over_module": lambda lin: (lambda x: torch.tanh(lin(x))),
    "closure_over_parameter": lambda lin: (lambda x: torch.tanh(x @ lin.weight.T)),
}


@pytest.mark.parametrize("how", ["jvp_of_grad", "hessian", "jacfwd_of_jacrev"])
@pytest.mark.parametrize("case", list(CAPTURED_PARAMETER))
def test_forward_over_reverse_through_a_captured_parameter(case, how):
    torch.manual_seed(0)
    fn = CAPTURED_PARAMETER[case](nn.Linear(4, 3, dtype=D))
    x = randn(2, 4, seed=1)

    def run(f):
        def loss(x):
            return f(x).tanh().square().sum()

        if how == "jvp_of_grad":
            return tf.jvp(tf.grad(loss), (x,), (tangent_like(x),))
        if how == "hessian":
            return tf.hessian(loss)(x)
        return tf.jacfwd(tf.jacrev(loss))(x)

    assert_close(run(remat(fn)), run(fn))


def f_elementwise(x):
    return (x.sin() * x.cos().sum(-1, keepdim=True)).tanh()


@pytest.mark.parametrize(
    "how",
    ["jvp_vmap", "jacfwd_vmap", "jacrev_vmap", "vmap_jvp", "vmap_jacfwd", "jvp_vmap_vmap", "jacfwd_jacrev_vmap"],
)
def test_forward_mode_around_vmap_of_remat(how):
    xs = randn(3, 4, seed=1)
    t = tangent_like(xs)

    def run(f):
        if how == "jvp_vmap":
            return tf.jvp(tf.vmap(f), (xs,), (t,))
        if how == "jacfwd_vmap":
            return tf.jacfwd(tf.vmap(f))(xs)
        if how == "jacrev_vmap":
            return tf.jacrev(tf.vmap(f))(xs)
        if how == "vmap_jvp":
            return tf.vmap(lambda x, t: tf.jvp(f, (x,), (t,)))(xs, t)
        if how == "vmap_jacfwd":
            return tf.vmap(tf.jacfwd(f))(xs)
        if how == "jvp_vmap_vmap":
            return tf.jvp(tf.vmap(tf.vmap(f)), (xs.reshape(3, 2, 2),), (t.reshape(3, 2, 2),))
        return tf.jacfwd(tf.jacrev(lambda x: tf.vmap(f)(x).sum(0)))(xs)

    assert_close(run(remat(f_elementwise)), run(f_elementwise))


def dropout_fn(x, w):
    return F.dropout(torch.tanh(x @ w), p=0.5, training=True) * x.sum()


@pytest.mark.parametrize("create_graph", [False, True])
def test_is_grads_batched_with_seeded_dropout(create_graph):
    w = randn(4, 4, seed=2)

    def run(f):
        torch.manual_seed(123)
        x = randn(3, 4, seed=1).requires_grad_()
        out = f(x, w)
        batched = torch.eye(out.numel(), dtype=D).reshape(-1, *out.shape)
        (g,) = torch.autograd.grad(out, x, grad_outputs=batched, is_grads_batched=True, create_graph=create_graph)
        result = [out.detach(), g.detach()]
        if create_graph:
            result += torch.autograd.grad(g.sin().sum(), x)
        return result, torch.get_rng_state()

    (got, state_got), (expected, state_expected) = run(remat(dropout_fn)), run(dropout_fn)
    assert_close(got, expected)
    assert torch.equal(state_got, state_expected)


def test_is_grads_batched_through_remat_module_with_dropout():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6, dtype=D), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 2, dtype=D))

    def run(m):
        torch.manual_seed(5)
        x = randn(3, 4, seed=1).requires_grad_()
        out = m(x)
        batched = torch.eye(out.numel(), dtype=D).reshape(-1, *out.shape)
        return torch.autograd.grad(out, [x, net[0].weight], grad_outputs=batched, is_grads_batched=True)

    assert_close(run(remat(net)), run(net))


RETURNS_AN_INPUT_VIEW = {
    "identity": lambda x: x,
    "row": lambda x: x[0],
    "view": lambda x: x.view(-1),
    "transpose": lambda x: x.t(),
    "detach": lambda x: x.detach(),
    "pair_with_computed": lambda x: (x[1:], x * 2),
}


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
@pytest.mark.parametrize("case", list(RETURNS_AN_INPUT_VIEW))
def test_in_place_update_of_an_output_that_is_an_input_view(case, how):
    fn = RETURNS_AN_INPUT_VIEW[case]

    def program(f, a):
        x = a * 1  # a non-leaf input
        out = f(x)
        first = out[0] if isinstance(out, tuple) else out
        first.mul_(2)
        extra = out[1].sum() if isinstance(out, tuple) else 0
        return (x.sin() * 3).sum() + first.square().sum() + extra, x.detach().clone()

    def run(f):
        a = randn(3, 4, seed=1)
        if how == "backward":
            a.requires_grad_()
            loss, x_after = program(f, a)
            loss.backward()
            return loss.detach(), x_after, a.grad
        if how == "grad":
            return tf.grad_and_value(lambda a: program(f, a), has_aux=True)(a)
        loss, vjp_fn, x_after = tf.vjp(lambda a: program(f, a), a, has_aux=True)
        return loss, x_after, vjp_fn(torch.ones_like(loss))

    assert_close(run(remat(fn)), run(fn))


def test_in_place_add_on_an_output_that_is_a_leaf_input_view_raises_as_torch_does():
    """An in-place update of a view of a leaf that requires grad is refused by torch too."""
    x = randn(3, 4, seed=1).requires_grad_()
    with pytest.raises(RuntimeError):
        (lambda x: x[0])(x).mul_(2)
    with pytest.raises(RuntimeError):
        remat(lambda x: x[0])(x).mul_(2)


def returns_captured(c):
    def fn(x):
        return x.sin(), c

    return fn


def use_both(f):
    def g(x):
        a, b = f(x)
        return a * b.exp()

    return g


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "jacrev", "jvp"])
@pytest.mark.parametrize("captured_requires_grad", [False, True])
def test_returning_a_captured_tensor_unchanged(captured_requires_grad, how):
    fn = returns_captured(randn(3, seed=5).requires_grad_(captured_requires_grad))
    x = randn(3, seed=1)
    assert_close(derivative(how, use_both(remat(fn)), x), derivative(how, use_both(fn), x))


@pytest.mark.parametrize("how", ["backward", "autograd_grad"])
def test_a_captured_tensor_returned_unchanged_gets_its_gradient(how):
    c = randn(3, seed=5).requires_grad_()
    fn = returns_captured(c)

    def run(f):
        c.grad = None
        out = use_both(f)(randn(3, seed=1)).sum()
        if how == "backward":
            out.backward()
            return c.grad
        return torch.autograd.grad(out, c)[0]

    assert_close(run(remat(fn)), run(fn))


def test_returning_a_captured_tensor_is_the_same_value_and_aliases_it():
    c = randn(3, seed=5)
    _, out = remat(lambda x: (x.sin(), c))(randn(3, seed=1))
    assert_close(out, c)
    expected_alias = (lambda x: (x.sin(), c))(randn(3, seed=1))[1]
    # without remat the returned tensor *is* the captured one: an in-place update shows through
    assert (out.data_ptr() == c.data_ptr()) == (expected_alias.data_ptr() == c.data_ptr())


def test_returning_a_module_parameter_unchanged():
    net = nn.Linear(3, 3, dtype=D)

    def fn(x):
        return net(x), net.weight

    def run(f):
        net.zero_grad()
        x = randn(2, 3, seed=1).requires_grad_()
        y, w = f(x)
        (y.sin().sum() + (w * w).sum()).backward()
        return x.grad, net.weight.grad, net.bias.grad

    assert_close(run(remat(fn)), run(fn))


LEAF_INSIDE = {
    "zeros_then_attribute": lambda: _set_rg(torch.zeros(3, dtype=D)),
    "linspace_then_attribute": lambda: _set_rg(torch.linspace(1, 2, 3, dtype=D)),
    "factory_kwarg": lambda: torch.linspace(1, 2, 3, dtype=D, requires_grad=True),
    "requires_grad_": lambda: torch.ones(3, dtype=D).mul(2).requires_grad_(),
    "parameter": lambda: nn.Parameter(torch.full((3,), 1.5, dtype=D)),
}


def _set_rg(t):
    t.requires_grad = True
    return t


_PARAMETER_GAP = pytest.mark.xfail(
    strict=True,
    reason="known gap: nn.Parameter(...) is made without a torch function, so remat cannot tell it "
    "was created inside and refuses it as foreign (a CheckpointError, not a wrong gradient)",
)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=_PARAMETER_GAP) if c == "parameter" else c for c in LEAF_INSIDE]
)
def test_leaf_created_inside_the_function_as_torch_checkpoint(case):
    make = LEAF_INSIDE[case]

    def fn(x):
        b = make()
        return x * b + b.square()

    def run(call):
        x = randn(3, seed=1).requires_grad_()
        out = call(x)
        out.sin().sum().backward()
        return out.detach(), x.grad

    assert_close(run(remat(fn)), run(lambda x: torch_checkpoint(fn, x, use_reentrant=False)))


@pytest.mark.parametrize("how", ["grad", "vjp", "jacrev", "hessian", "jvp"])
def test_leaf_created_inside_the_function_under_transforms(how):
    def fn(x):
        b = _set_rg(torch.linspace(1, 2, 3, dtype=D))
        return x * b + b.square()

    assert_close(derivative(how, remat(fn), randn(3, seed=1)), derivative(how, fn, randn(3, seed=1)))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
@pytest.mark.parametrize("container", ["list", "ModuleList", "dict"])
def test_unused_batchnorm_reachable_from_closure_runs_between_forward_and_backward(container, how):
    torch.manual_seed(0)
    lin, bn = nn.Linear(4, 4, dtype=D), nn.BatchNorm1d(4, dtype=D)
    mods = {"list": [lin, bn], "ModuleList": nn.ModuleList([lin, bn]), "dict": {0: lin, "bn": bn}}[container]

    def fn(x):
        return mods[0](x).tanh()  # the closure reaches bn too, but fn does not use it

    def run(f):
        bn.reset_running_stats()
        bn.train()
        lin.zero_grad()
        x = randn(5, 4, seed=1)

        def between():
            bn(randn(6, 4, seed=9))  # bumps num_batches_tracked and the running stats in place

        if how == "backward":
            x.requires_grad_()
            out = f(x)
            between()
            out.square().sum().backward()
            return out.detach(), x.grad, lin.weight.grad, bn.running_mean.clone()
        out, vjp_fn = tf.vjp(f, x)
        between()
        return out, vjp_fn(tangent_like(out)), bn.running_mean.clone()

    assert_close(run(remat(fn)), run(fn))


def test_module_with_batchnorm_submodule_unused_in_forward_is_run_between():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=D)
            self.bn = nn.BatchNorm1d(4, dtype=D)

        def forward(self, x):
            return self.lin(x).tanh()

    torch.manual_seed(0)
    net = Net()

    def run(m):
        net.zero_grad()
        net.bn.reset_running_stats()
        x = randn(5, 4, seed=1).requires_grad_()
        out = m(x)
        net.bn(randn(6, 4, seed=9))
        out.sum().backward()
        return x.grad, net.lin.weight.grad

    assert_close(run(remat(net)), run(net))


# --- more of family A, found by hunting -------------------------------------------------------


def torch_call(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


def funckpt_call(fn, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _program_frozen(call):
    x = randn(2, 5, 8, seed=1).requires_grad_()
    out = call(lambda x, w: torch.matmul(x, w).sum(), x, randn(1, 8, 4, seed=2))
    out.backward()
    return out.detach(), x.grad


def _program_input_view_updated(call):
    a = randn(3, 4, seed=1).requires_grad_()
    x = a * 1
    out = call(lambda x: x[0], x)
    out.mul_(2)
    (x.sin().sum() + out.square().sum()).backward()
    return x.detach(), a.grad


def _program_leaf_inside(call):
    x = randn(3, seed=1).requires_grad_()
    out = call(lambda x: x * _set_rg(torch.linspace(1, 2, 3, dtype=D)), x)
    out.sin().sum().backward()
    return out.detach(), x.grad


def _program_captured_returned(call):
    c = randn(3, seed=5).requires_grad_()
    x = randn(3, seed=1).requires_grad_()
    a, b = call(lambda x: (x.sin(), c), x)
    (a * b.exp()).sum().backward()
    return x.grad, c.grad


def _program_keyword(call):
    x = randn(3, 4, seed=1).requires_grad_()
    w = randn(4, 4, seed=2).requires_grad_()
    out = call(lambda x, *, w, scale: torch.tanh(x @ w) * scale, x, w=w, scale=3.0)
    out.sin().sum().backward()
    return x.grad, w.grad


def _program_enables_grad(call):
    x = randn(3, 4, seed=1)
    w = randn(4, 4, seed=2).requires_grad_()
    with torch.no_grad():
        out = call(enables_grad, x, w)
    flag = out.requires_grad
    out.sum().backward()
    return flag, w.grad


def _program_dropout(call):
    torch.manual_seed(11)
    x = randn(3, 4, seed=1).requires_grad_()
    out = call(dropout_fn, x, randn(4, 4, seed=2))
    out.sum().backward()
    return out.detach(), x.grad, torch.get_rng_state()


DROP_IN_PROGRAMS = {
    "frozen": _program_frozen,
    "input_view_updated": _program_input_view_updated,
    "leaf_inside": _program_leaf_inside,
    "captured_returned": _program_captured_returned,
    "keyword": _program_keyword,
    "enables_grad_under_no_grad": _program_enables_grad,
    "dropout": _program_dropout,
}


@pytest.mark.parametrize("case", list(DROP_IN_PROGRAMS))
def test_drop_in_checkpoint_as_torch_checkpoint(case):
    program = DROP_IN_PROGRAMS[case]
    assert_close(program(funckpt_call), program(torch_call))


def test_frozen_input_with_retain_graph_and_a_second_backward():
    def fn(x, w):
        return torch.matmul(x, w).tanh().sum()

    def run(f):
        x = randn(2, 5, 8, seed=1).requires_grad_()
        out = f(x, randn(1, 8, 4, seed=2))
        out.backward(retain_graph=True)
        first = x.grad.clone()
        out.backward()
        return first, x.grad

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
def test_frozen_inputs_in_keywords_and_pytrees(how):
    def fn(x, extra, *, w, pos):
        return (torch.matmul(x, w) + extra["table"][pos]).tanh()

    extra = {"table": randn(5, 4, seed=3), "name": "t"}
    kwargs = dict(w=randn(1, 8, 4, seed=2), pos=torch.tensor([0, 3, 3, 1, 4]))
    x = randn(2, 5, 8, seed=1)
    got = derivative(how, lambda x: remat(fn)(x, extra, **kwargs), x)
    assert_close(got, derivative(how, lambda x: fn(x, extra, **kwargs), x))


def test_identity_module_output_then_in_place_relu():
    """A remat'd block that returns its input as is, followed by an in-place activation."""

    def run(m):
        a = randn(3, 4, seed=1).requires_grad_()
        x = a * 2
        y = F.relu(m(x), inplace=True)
        (y.square().sum() + x.sum()).backward()
        return y.detach(), a.grad

    assert_close(run(remat(nn.Identity())), run(nn.Identity()))


def test_eval_mode_dropout_module_returns_its_input_then_in_place_update():
    drop = nn.Dropout(0.5).eval()

    def run(m):
        a = randn(3, 4, seed=1).requires_grad_()
        x = a * 2
        m(x).add_(1)
        x.square().sum().backward()
        return x.detach(), a.grad

    assert_close(run(remat(drop)), run(drop))


def test_returning_a_module_parameter_under_functional_call_grad():
    net = nn.Linear(3, 3, dtype=D)

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x), self.net.weight

    both = Both()
    params = {k: v.detach() for k, v in both.named_parameters()}

    def loss(m):
        def f(p, x):
            y, w = tf.functional_call(m, p, (x,))
            return y.sin().sum() + (w * w).sum()

        return f

    x = randn(2, 3, seed=1)
    assert_close(tf.grad(loss(remat(both)))(params, x), tf.grad(loss(both))(params, x))


def test_returning_a_captured_tensor_from_a_nested_remat():
    c = randn(3, seed=5).requires_grad_()
    inner = remat(lambda x: (x.sin(), c))

    def fn(x):
        a, b = inner(x)
        return a * b

    def run(f):
        c.grad = None
        x = randn(3, seed=1).requires_grad_()
        f(x).sum().backward()
        return x.grad, c.grad

    assert_close(run(remat(fn)), run(lambda x: (lambda a, b: a * b)(x.sin(), c)))


@pytest.mark.parametrize("how", ["grad", "vjp", "jvp"])
def test_torch_function_subclass_input_under_transforms(how):
    w = randn(4, 4, seed=2)
    x = randn(3, 4, seed=1).as_subclass(Passthrough)

    def plain(t):
        return tuple(r.as_subclass(torch.Tensor) if isinstance(r, torch.Tensor) else plain(r) for r in t)

    got = plain(derivative(how, remat(f_tanh_mm), x, w))
    assert_close(got, plain(derivative(how, f_tanh_mm, x, w)))


@pytest.mark.parametrize("how", ["backward", "autograd_create_graph", "grad", "vjp", "vmap_grad", "jacrev", "forward only"])
def test_forward_ad_dual_level_entered_inside_the_function(how):
    """A function that computes a directional derivative itself with ``forward_ad.dual_level()``
    (a JVP inside a loss) gets its tangents in the forward run too, as without remat and under
    torch.utils.checkpoint: a Function's forward runs with forward-mode AD off, where ``make_dual``
    attaches no tangent (``unpack_dual(...).tangent`` was None in the forward run only)."""

    def fn(x, w):
        with fwAD.dual_level():
            y = torch.tanh(fwAD.make_dual(x, torch.ones_like(x)) @ w)
            primal, tangent = fwAD.unpack_dual(y)
        return primal * tangent

    x = randn(3, 4, seed=1)
    w = randn(4, 2, seed=2)
    if how == "forward only":
        assert_close(remat(fn)(x, w.requires_grad_()), fn(x, w))
        return
    assert_close(derivative(how, remat(fn), x, w), derivative(how, fn, x, w))


def test_forward_ad_dual_under_no_grad():
    net = mlp()

    def run(m):
        x = randn(5, 4, seed=1)
        with torch.no_grad(), fwAD.dual_level():
            return tuple(fwAD.unpack_dual(m(fwAD.make_dual(x, tangent_like(x)))))

    assert_close(run(remat(net)), run(net))


def test_forward_ad_through_nested_remat_with_seeded_dropout():
    def block(x, w):
        return F.dropout(torch.tanh(x @ w), p=0.3, training=True)

    w = randn(4, 4, seed=2)

    def run(b):
        torch.manual_seed(3)
        x = randn(3, 4, seed=1)
        with fwAD.dual_level():
            out = b(b(fwAD.make_dual(x, tangent_like(x)), w), w)
            return tuple(fwAD.unpack_dual(out)), torch.get_rng_state()

    (got, state_got), (expected, state_expected) = run(remat(block)), run(block)
    assert_close(got, expected)
    assert torch.equal(state_got, state_expected)


def test_jvp_of_vmap_of_remat_module_via_functional_call():
    net = mlp()
    params = {k: v.detach() for k, v in net.named_parameters()}
    xs = randn(2, 5, 4, seed=1)

    def run(m):
        f = tf.vmap(lambda x: tf.functional_call(m, params, (x,)))
        return tf.jvp(f, (xs,), (tangent_like(xs),))

    assert_close(run(remat(net)), run(net))


def test_is_grads_batched_through_nested_remat():
    inner = remat(f_tanh_mm)
    w = randn(4, 4, seed=2)

    def outer(f):
        return lambda x: f(f(x, w), w)

    def run(fn):
        x = randn(3, 4, seed=1).requires_grad_()
        out = fn(x)
        batched = torch.eye(out.numel(), dtype=D).reshape(-1, *out.shape)
        return torch.autograd.grad(out, x, grad_outputs=batched, is_grads_batched=True)

    assert_close(run(remat(outer(inner))), run(outer(f_tanh_mm)))


@pytest.mark.parametrize("how", ["backward", "vjp"])
def test_unused_parameter_reachable_from_closure_updated_in_place_between_forward_and_backward(how):
    """A closure over a whole model that uses one layer; an optimizer step on another layer runs
    before the backward pass (say, a second loss's update)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4, dtype=D), "other": nn.Linear(4, 4, dtype=D)})

    def fn(x):
        return model["used"](x).tanh()

    def run(f):
        model.zero_grad()
        with torch.no_grad():
            model["other"].weight.fill_(0.5)
        x = randn(5, 4, seed=1)
        if how == "backward":
            x.requires_grad_()
            out = f(x)
            with torch.no_grad():
                model["other"].weight.add_(1.0)
            out.sum().backward()
            return x.grad, model["used"].weight.grad
        out, vjp_fn = tf.vjp(f, x)
        with torch.no_grad():
            model["other"].weight.add_(1.0)
        return vjp_fn(tangent_like(out))

    assert_close(run(remat(fn)), run(fn))


# =============================================================================================
# B. Programs remat must not get silently wrong: right, or CheckpointError.
# =============================================================================================


def make_sin_then_cos():
    return make_counter_fn(lambda n, x: x.sin() if n == 0 else x.cos())


@pytest.mark.parametrize("how", ALL)
def test_function_that_computes_something_else_when_called_again(how):
    raises_or_matches(how, make_sin_then_cos, randn(3, 4, seed=1))


def make_slicing_differently():
    return make_counter_fn(lambda n, x: x[: n % 2 + 1].tanh())


@pytest.mark.parametrize("how", ALL)
def test_recomputation_that_slices_differently(how):
    raises_or_matches(how, make_slicing_differently, randn(3, 4, seed=1))


def make_scale_differently():
    """Same operators, same shapes: only a Python scalar changes between calls."""
    return make_counter_fn(lambda n, x: x.sin() * (n + 1))


@pytest.mark.parametrize("how", ALL)
def test_recomputation_with_a_different_python_constant(how):
    raises_or_matches(how, make_scale_differently, randn(3, 4, seed=1))


def make_dtype_differently():
    return make_counter_fn(lambda n, x: x.sin().to(D if n == 0 else torch.float32).to(D))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "vmap_grad"])
def test_recomputation_with_a_different_intermediate_dtype(how):
    raises_or_matches(how, make_dtype_differently, randn(3, 4, seed=1))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "vmap_grad", "hessian"])
def test_nested_remat_whose_inner_function_computes_something_else(how):
    def make():
        inner = make_sin_then_cos()
        return lambda x: remat(inner)(x).exp()

    raises_or_matches(how, make, randn(3, 4, seed=1))


ITERATOR_BODIES = {
    "next": lambda x, it: x.sin() * next(it) + x * next(it),
    "next_with_default": lambda x, it: x.sin() * next(it, 0.0) + x * next(it, 0.0),
    "for_loop": lambda x, it: sum((x.sin() * v for v in it), x.tanh()),
    "tensor_values": lambda x, it: x.sin() * next(it) + x * next(it),
}


@pytest.mark.parametrize("how", ["backward", "autograd_create_graph", "grad", "vjp", "vmap_grad", "jacrev", "hessian"])
@pytest.mark.parametrize("case", list(ITERATOR_BODIES))
def test_iterator_argument_exhausted_by_the_forward_run(case, how):
    body = ITERATOR_BODIES[case]
    values = [randn(4, seed=7), randn(4, seed=8)] if case == "tensor_values" else [2.0, 3.0]
    x = randn(3, 4, seed=1)
    expected = derivative(how, lambda x: body(x, iter(values)), x)
    try:
        got = derivative(how, lambda x: remat(body)(x, iter(values)), x)
    except CheckpointError:
        return
    assert_close(got, expected)


def test_generator_expression_argument_as_static_argnum():
    def body(x, gen):
        return sum((x * v for v in gen), x.sin())

    x = randn(3, 4, seed=1)
    expected = derivative("grad", lambda x: body(x, (float(i) for i in range(1, 4))), x)
    try:
        got = derivative("grad", lambda x: remat(body, static_argnums=(1,))(x, (float(i) for i in range(1, 4))), x)
    except CheckpointError:
        return
    assert_close(got, expected)


def test_list_argument_mutated_by_the_forward_run():
    """The function pops from a list it is given: the recomputation sees fewer items."""

    def body(x, stack):
        return x.sin() * stack.pop() + x.cos() * len(stack)

    x = randn(3, 4, seed=1)
    expected = derivative("grad", lambda x: body(x, [1.0, 2.0, 3.0]), x)
    try:
        got = derivative("grad", lambda x: remat(body)(x, [1.0, 2.0, 3.0]), x)
    except CheckpointError:
        return
    assert_close(got, expected)


ALIASING = {
    "h_and_column": lambda x: (lambda h: (h, h[:, 0]))(x.tanh() * 2),
    "same_twice": lambda x: (lambda a: (a, a))(x.tanh() * 2),
    "h_and_reshape": lambda x: (lambda h: (h, h.reshape(-1)))(x.tanh() * 2),
    "column_and_h": lambda x: (lambda h: (h[:, 0], h))(x.tanh() * 2),
}


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
@pytest.mark.parametrize("mutate", [False, True])
@pytest.mark.parametrize("case", list(ALIASING))
def test_outputs_aliasing_each_other(case, mutate, how):
    fn = ALIASING[case]

    def program(f, x):
        a, b = f(x)
        if mutate:
            (a if a.dim() == 2 else b).mul_(3)
        return (a.sin() * 2).sum() + (b * b.cos()).sum()

    def run(f):
        x = randn(3, 4, seed=1)
        if how == "backward":
            x.requires_grad_()
            out = program(f, x)
            out.backward()
            return out.detach(), x.grad
        if how == "grad":
            return tf.grad_and_value(lambda x: program(f, x))(x)
        out, vjp_fn = tf.vjp(lambda x: program(f, x), x)
        return out, vjp_fn(torch.ones_like(out))

    try:
        expected = run(fn)
    except RuntimeError:
        expected = RuntimeError
    if expected is RuntimeError:
        with pytest.raises(RuntimeError):
            run(remat(fn))
    else:
        assert_close(run(remat(fn)), expected)


def test_outputs_aliasing_each_other_are_still_views_after_remat():
    h, col = remat(lambda x: (lambda h: (h, h[:, 0]))(x.tanh()))(randn(3, 4, seed=1))
    h.mul_(3)
    assert_close(col, h[:, 0])
    a, b = remat(lambda x: (lambda a: (a, a))(x.tanh()))(randn(3, 4, seed=1))
    a.add_(1)
    assert_close(a, b)


def test_outputs_aliasing_an_input_and_each_other_under_backward():
    def fn(x):
        return x, x[0], x * 3

    def run(f):
        a = randn(3, 4, seed=1).requires_grad_()
        x = a * 2
        u, row, s = f(x)
        row.add_(1)
        (u.square().sum() + (row * s[0]).sum()).backward()
        return a.grad, u.detach()

    assert_close(run(remat(fn)), run(fn))


DTYPE_VIEWS = {
    "view_int64": (lambda x: (x.sin(), x.view(torch.int64)), lambda: randn(3, 4, seed=1)),
    "view_float32": (lambda x: (x.sin(), x.view(torch.float32)), lambda: randn(3, 4, seed=1)),
    "view_as_complex": (lambda x: torch.view_as_complex(x), lambda: randn(3, 2, seed=1)),
    "view_as_complex_of_computed": (lambda x: torch.view_as_complex(x.tanh()), lambda: randn(3, 2, seed=1)),
    "real_of_complex": (lambda z: z.real, lambda: torch.complex(randn(3, seed=1), randn(3, seed=2))),
    "imag_of_complex": (lambda z: z.imag, lambda: torch.complex(randn(3, seed=1), randn(3, seed=2))),
    "view_as_real": (lambda z: torch.view_as_real(z), lambda: torch.complex(randn(3, seed=1), randn(3, seed=2))),
    "view_as_real_of_computed": (
        lambda z: torch.view_as_real(z * z),
        lambda: torch.complex(randn(3, seed=1), randn(3, seed=2)),
    ),
}


def _real_loss(out):
    total = 0
    for t in out if isinstance(out, tuple) else (out,):
        if t.is_complex():
            total = total + (t * t).real.sum() + t.abs().sum()
        elif t.is_floating_point() and t.requires_grad:
            total = total + t.sin().sum()
    return total


def _snapshot(out):
    return tuple(t.detach().clone() for t in (out if isinstance(out, tuple) else (out,)))


@pytest.mark.parametrize("case", list(DTYPE_VIEWS))
def test_outputs_that_are_dtype_views_of_an_input(case):
    fn, make = DTYPE_VIEWS[case]

    def run(f):
        x = make().requires_grad_()
        out = f(x)
        flags = tuple((t.dtype, t.shape, t.requires_grad) for t in (out if isinstance(out, tuple) else (out,)))
        loss = _real_loss(out)
        grad = torch.autograd.grad(loss, x)[0] if isinstance(loss, torch.Tensor) else None
        return _snapshot(out), flags, grad

    got, expected = run(remat(fn)), run(fn)
    assert got[1] == expected[1]
    assert_close(got[0], expected[0])
    assert_close(got[2], expected[2])


@pytest.mark.parametrize(
    "case, how",
    [(c, h) for c in ["view_as_complex", "real_of_complex", "view_as_real"] for h in ["grad", "vjp"]]
    + [("view_as_complex", "jacrev")],  # jacrev takes real inputs only
)
def test_dtype_view_outputs_under_transforms(case, how):
    fn, make = DTYPE_VIEWS[case]
    x = make()

    def run(f):
        if how == "grad":
            return tf.grad(lambda x: _real_loss(f(x)))(x)
        if how == "vjp":
            out, vjp_fn = tf.vjp(f, x)
            return out, vjp_fn(torch.ones_like(out))
        return tf.jacrev(lambda x: torch.view_as_real(f(x)) if f(x).is_complex() else f(x))(x)

    assert_close(run(remat(fn)), run(fn))


def test_in_place_update_through_a_dtype_view_output_reaches_the_input():
    """``view_as_complex`` of a non-leaf input is a view: updating it updates the input."""

    def fn(x):
        return torch.view_as_complex(x)

    def run(f):
        a = randn(3, 2, seed=1).requires_grad_()
        x = a * 1
        z = f(x)
        z.mul_(2j)
        (x.sin().sum() + z.abs().sum()).backward()
        return x.detach(), a.grad

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_empty_tensors_keep_their_dtypes_and_values(dtype):
    def fn(x, i):
        return x.sin(), i * 2

    x, i = torch.randn(0, 3, dtype=dtype), torch.zeros(0, dtype=torch.long)
    got, expected = remat(fn)(x, i), fn(x, i)
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in expected]
    assert_close(got, expected)


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "jacrev", "jvp", "vmap_grad"])
def test_empty_batch_gradients(how):
    w = randn(3, 3, seed=2)
    x = randn(0, 3, seed=1)
    assert_close(derivative(how, remat(f_tanh_mm), x, w), derivative(how, f_tanh_mm, x, w))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_empty_batch_output_updated_in_place(requires_grad):
    w = randn(3, 3, seed=2).requires_grad_()

    def run(f):
        w.grad = None
        x = randn(0, 3, seed=1).requires_grad_(requires_grad)
        out = f(x, w)
        out.add_(1)
        out.sum().backward()
        return out.detach(), w.grad, x.grad

    assert_close(run(remat(f_tanh_mm)), run(f_tanh_mm))


def test_empty_integer_output_updated_in_place():
    def fn(x, i):
        return x.sin(), i * 2

    x, i = randn(0, 3, seed=1).requires_grad_(), torch.zeros(0, dtype=torch.long)
    s, j = remat(fn)(x, i)
    s.add_(1)
    j.add_(1)
    s.sum().backward()
    assert x.grad.shape == x.shape and j.dtype == torch.long


def enables_grad(x, w):
    with torch.enable_grad():
        return torch.tanh(x @ w).sin()


@pytest.mark.parametrize("grad_input", ["x", "w"])
def test_function_that_enables_grad_called_under_no_grad(grad_input):
    def run(f):
        x = randn(3, 4, seed=1).requires_grad_(grad_input == "x")
        w = randn(4, 4, seed=2).requires_grad_(grad_input == "w")
        with torch.no_grad():
            out = f(x, w)
        flag = out.requires_grad
        grads = torch.autograd.grad(out.square().sum(), x if grad_input == "x" else w, create_graph=True)[0]
        (second,) = torch.autograd.grad(grads.sum(), x if grad_input == "x" else w)
        return flag, out.detach(), grads.detach(), second

    got, expected = run(remat(enables_grad)), run(enables_grad)
    assert got[0] == expected[0]
    assert_close(got[1:], expected[1:])


def test_function_that_enables_grad_called_under_no_grad_with_a_module():
    net = mlp()

    def fn(x):
        with torch.enable_grad():
            return net(x).tanh()

    def run(f):
        net.zero_grad()
        with torch.no_grad():
            out = f(randn(5, 4, seed=1))
        assert out.requires_grad
        out.sum().backward()
        return [p.grad for p in net.parameters()]

    assert_close(run(remat(fn)), run(fn))


def test_function_that_disables_grad_inside():
    def fn(x, w):
        with torch.no_grad():
            scale = (x @ w).abs().max()
        return torch.tanh(x @ w) / scale

    x = randn(3, 4, seed=1)
    w = randn(4, 4, seed=2)
    for how in ["backward", "grad", "vjp", "jacrev", "jvp", "hessian"]:
        assert_close(derivative(how, remat(fn), x, w), derivative(how, fn, x, w))


@pytest.mark.parametrize("leaf", [True, False])
def test_hook_registered_on_an_input_inside_the_function(leaf):
    def fn(x):
        if x.requires_grad:
            x.register_hook(lambda g: g * 2)
        return x.sin() * 3

    def run(f):
        a = randn(3, 4, seed=1).requires_grad_()
        x = a if leaf else a * 1
        f(x).square().sum().backward()
        return a.grad

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("kind", ["tensor hook", "post-accumulate hook"])
@pytest.mark.parametrize("removed", [True, False])
def test_hook_registered_on_an_input_inside_the_function_follows_its_handle(kind, removed):
    """remat moves a hook the function registers on an input to the caller's tensor; the handle
    ``register_hook`` gave the function still removes it (between the forward and the backward
    pass), as without remat, and a hook left in place runs once."""
    handles = []
    seen = []

    def fn(x, w):
        if kind == "tensor hook":
            handles.append(w.register_hook(lambda g: g * 100))
        else:
            handles.append(w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone())))
        return torch.tanh(x @ w)

    def run(f):
        handles.clear()
        seen.clear()
        x = randn(3, 4, seed=1).requires_grad_()
        w = randn(4, 2, seed=2).requires_grad_()
        out = f(x, w)
        if removed:
            for handle in handles:
                handle.remove()
        out.square().sum().backward()
        return x.grad, w.grad, list(seen)

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("how", ["backward", "grad", "vmap_grad", "jacrev", "retain_graph_twice"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("removed", [(), (0,), (0, 1)])
def test_hook_registered_on_an_intermediate_inside_the_function_follows_its_handle(how, nested, removed):
    """A recomputation registers the hooks the function registers on tensors it makes again, on the
    tensors its backward pass goes through; the handles the forward run got still remove them
    (between the forward and the backward pass), as without remat (and under torch.utils.checkpoint).
    A hook left in place runs once; one closing over its tensor still counts it as made inside."""
    handles = []

    def fn(x):
        h = x * 2
        handles.append(h.register_hook(lambda g: g * 100))
        k = h.sin()
        handles.append(k.register_hook(lambda g: g * k))
        return k.exp()

    def run(f):
        def loss(x):
            handles.clear()
            y = f(x)
            for i in removed:
                handles[i].remove()
            return y.sum()

        x = randn(2, 3, seed=1)
        if how == "backward":
            x.requires_grad_()
            loss(x).backward()
            return x.grad
        if how == "grad":
            return tf.grad(loss)(x)
        if how == "vmap_grad":
            return tf.vmap(tf.grad(loss))(x)
        if how == "jacrev":
            return tf.jacrev(loss)(x)
        x.requires_grad_()
        y = loss(x)
        first = torch.autograd.grad(y, x, retain_graph=True)[0]
        for handle in handles:  # (removed after the first backward pass: the second runs none)
            handle.remove()
        return first, torch.autograd.grad(y, x)[0]

    remat_fn = remat(lambda x: remat(fn)(x) * 1) if nested else remat(fn)
    assert_close(run(remat_fn), run(fn))


@pytest.mark.parametrize("how", ["backward", "autograd_grad", "create_graph", "grad", "vjp"])
@pytest.mark.parametrize("reads_a_parameter", [False, True])
def test_hook_a_nested_calls_function_registers_on_its_input_acts(how, reads_a_parameter):
    """A remat'd call nested in another's run whose function registers a hook on its input (which
    the enclosing run made): the nested forward run moves the hook to the caller's tensor, as for a
    call that is not nested. The enclosing run noted it too, as a hook on a tensor it made, and its
    end made the hook's entry a no-op before it was moved: the hook never ran (a silently missing
    factor in the gradient). Under ``grad`` of a function reading a module's parameter, the
    enclosing runs go at a grad level of its own, whose tensor the nested call is given: its forward
    run, lowered out of that level, moved the hook to the tensor under it, which that level's
    backward does not go through (the hook never ran either); it stays with the recomputation."""
    fired = []
    lin = nn.Linear(3, 3).double()

    def inner(x):
        if x.requires_grad:
            x.register_hook(lambda g: (fired.append(1), g * 3)[1])
        return (lin(x) if reads_a_parameter else x * 1.5).sin()

    def run(f):
        fired.clear()
        if how == "grad":
            return tf.grad(lambda x: f(x).sum())(randn(3, seed=1)), len(fired)
        if how == "vjp":
            out, vjp_fn = tf.vjp(f, randn(3, seed=1))
            return vjp_fn(torch.ones_like(out))[0], len(fired)
        x = randn(3, seed=1).requires_grad_()
        y = f(x).sum()
        if how == "backward":
            y.backward()
            return x.grad, len(fired)
        (g,) = torch.autograd.grad(y, x, create_graph=how == "create_graph")
        if how == "create_graph":  # (values only: the recomputation for the second pass runs the hook again)
            return g, torch.autograd.grad(g.sum(), x)[0]
        return g, len(fired)

    nested = remat(inner)
    assert_close(run(remat(lambda x: nested(x * 2).sin() + x)), run(lambda x: inner(x * 2).sin() + x))


@pytest.mark.parametrize("on", ["intermediate", "intermediate_of_a_parameter"])
@pytest.mark.parametrize(
    "how", ["grad_of_grad", "vjp_of_grad", "jacrev_of_grad", "hessian", "hessian_of_vjp", "jacrev_of_jvp", "hessian_of_jvp"]
)
@pytest.mark.parametrize("nested", [False, True])
def test_hook_registered_on_an_intermediate_acts_at_the_grad_level_of_the_call_only(on, how, nested):
    """Without remat a hook the function registers on a tensor it makes (``if h.requires_grad:
    h.register_hook(...)``) is registered at the torch.func level the call was made at, and acts
    on that level's gradient only: an outer grad level (``grad(grad(f))``, ``jacrev``, ``hessian``)
    records the same operators without it, and under a jvp level (``jacrev(jvp(f))``) the function's
    tensors say they require no grad, so it registers none. remat's backward of that level, lowered
    into plain autograd and differentiated again, recomputed there: the hook sat in the graph the
    outer level differentiates, and acted on its gradient too; the backward of an outer level
    recomputed where the inputs require grad, and registered it (silently scaled derivatives). The
    first is now recomputed and differentiated at a grad level of its own, the second recomputed at
    one whose inputs require grad as at the call, and differentiated below it. (The function branches
    on requires_grad too: under jacrev(jvp(f)) that raised a false "did not reproduce".)"""
    lin = nn.Linear(3, 3).double()

    def fn(x):
        h = lin(x) if on == "intermediate_of_a_parameter" else x * 2
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)
        y = h.sin()
        return y * 2 if y.requires_grad else y

    def loss(g):
        return lambda x: g(x).sin().sum()

    def vjp_of(g):
        def f(x):
            out, vjp_fn = tf.vjp(g, x)
            return vjp_fn(tangent_like(out) + 0.5)[0] + out.sum()

        return f

    def jvp_of(g):
        def f(x):
            out, tangent = tf.jvp(g, (x,), (tangent_like(x) + 0.5,))
            return out + tangent

        return f

    def run(f):
        x = randn(3, seed=1)
        if how == "grad_of_grad":
            return tf.grad(loss(tf.grad(loss(f))))(x)
        if how == "vjp_of_grad":
            return vjp_of(tf.grad(loss(f)))(x)
        if how == "jacrev_of_grad":
            return tf.jacrev(tf.grad(loss(f)))(x)
        if how == "hessian":
            return tf.hessian(loss(f))(x)
        if how == "hessian_of_vjp":
            return tf.hessian(loss(vjp_of(f)))(x)
        if how == "jacrev_of_jvp":
            return tf.jacrev(jvp_of(f))(x)
        return tf.hessian(loss(jvp_of(f)))(x)

    remat_fn = remat(lambda x: remat(fn)(x * 2).sin() + x) if nested else remat(fn)
    assert_close(run(remat_fn), run(lambda x: fn(x * 2).sin() + x if nested else fn(x)))


@pytest.mark.parametrize("how", ["backward_twice", "autograd_grad_twice", "grad", "double_backward"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("removal", ["by_itself", "in_the_function"])
def test_hook_removed_by_the_function_is_removed_once_for_all_passes(how, nested, removal):
    """A hook on an intermediate that the function removes by the handle it got: the hook itself
    when it first runs (``handle.remove()`` inside it), or the function once a gradient of its own
    went through it (``torch.autograd.grad`` inside, then ``handle.remove()``). Without remat it is
    removed once: a second backward pass through the same graph (``retain_graph=True``) runs it no
    more, and the function's own gradient went through it. remat's recomputations register it again;
    removed by a recomputation's handle it stays removed for the next recomputation, and removed in
    the forward run it runs in the recomputation up to the same point. A backward pass that records
    a graph (``create_graph=True``) is recomputed to be differentiated: the hook runs there again, as
    it did in it."""

    def fn(x):
        h = x.sin()
        handle = None

        def hook(g):
            if removal == "by_itself":
                handle.remove()
            return g * 3

        handle = h.register_hook(hook)
        if removal == "in_the_function":
            inner = torch.autograd.grad(h.square().sum(), x, create_graph=True)[0]
            handle.remove()
            return h.exp() + inner
        return h.exp()

    def run(f):
        x = randn(2, 3, seed=1)
        if how == "grad":
            return tf.grad(lambda x: f(x).sum())(x)
        x.requires_grad_()
        y = f(x).sum()
        if how == "double_backward":
            g = torch.autograd.grad(y, x, create_graph=True)[0]
            return g, torch.autograd.grad(g.sum(), x)[0]
        if how == "backward_twice":
            y.backward(retain_graph=True)
            first = x.grad.clone()
            y.backward()
            return first, x.grad
        return torch.autograd.grad(y, x, retain_graph=True)[0], torch.autograd.grad(y, x)[0]

    remat_fn = remat(lambda x: remat(fn)(x) * 1) if nested else remat(fn)
    assert_close(run(remat_fn), run(fn))
    assert_close(run(lambda x: funckpt.checkpoint(fn, x)), run(fn))


@pytest.mark.parametrize("kind", ["hook", "prehook"])
@pytest.mark.parametrize("removal", ["by_the_caller", "by_itself", "in_the_function", "none"])
@pytest.mark.parametrize("how", ["backward_twice", "grad", "vmap_grad", "double_backward"])
@pytest.mark.parametrize("nested", [False, True])
def test_hook_registered_on_an_autograd_node_inside_the_function_follows_its_handle(kind, removal, how, nested):
    """A hook the function registers on an intermediate's autograd node (``h.grad_fn.register_hook``,
    ``register_prehook``) is followed as one on the tensor is: the recomputation registers it again
    on its own node, where it runs only while the forward run's handle has not removed it (the
    caller removing it between the forward and the backward pass), and a recomputation's handle
    removes it for good (the hook removing itself when it first runs: a second backward pass
    through the same graph runs it no more), as without remat and under torch.utils.checkpoint."""
    handles = []

    def fn(x):
        h = x.sin()
        handle = None

        def hook(*grads):
            if removal == "by_itself":
                handle.remove()
            return (grads[0][0] * 3,)

        node = h.grad_fn
        handle = node.register_hook(hook) if kind == "hook" else node.register_prehook(hook)
        handles.append(handle)
        if removal == "in_the_function":
            inner = torch.autograd.grad(h.square().sum(), x, create_graph=True)[0]
            handle.remove()
            return h.exp() + inner
        return h.exp()

    def run(f):
        def loss(x):
            handles.clear()
            y = f(x).sum()
            if removal == "by_the_caller":
                handles[0].remove()
            return y

        x = randn(2, 3, seed=1)
        if how == "grad":
            return tf.grad(loss)(x)
        if how == "vmap_grad":
            return tf.vmap(tf.grad(loss))(x)
        x.requires_grad_()
        y = loss(x)
        if how == "double_backward":
            g = torch.autograd.grad(y, x, create_graph=True)[0]
            return g, torch.autograd.grad(g.sum(), x)[0]
        y.backward(retain_graph=True)
        first = x.grad.clone()
        y.backward()
        return first, x.grad

    remat_fn = remat(lambda x: remat(fn)(x) * 1) if nested else remat(fn)
    assert_close(run(remat_fn), run(fn))
    assert_close(run(lambda x: funckpt.checkpoint(fn, x)), run(fn))


@pytest.mark.parametrize("on", ["argument", "closure"])
@pytest.mark.parametrize("how", ["grad", "vjp", "jacrev", "vmap_grad", "backward_twice"])
@pytest.mark.parametrize("nested", [False, True])
def test_a_hook_on_an_input_the_caller_computed_under_a_transform(on, how, nested):
    """A hook the function registers on an input the caller computed inside the transform (an
    argument, or a tensor it closes over, also used outside the call) sees that tensor's whole
    gradient and changes it, once, as without remat. (Under torch.func.grad it went on the forward
    run's stand-in and never ran: a silently wrong gradient.)"""
    lin = nn.Linear(3, 3).double()
    calls = []

    def body(x, c):
        c.register_hook(lambda g: (calls.append(1), g * 3)[1])
        return (x * c).sin().sum()

    def run(wrap):
        def loss(x0, x):
            c = lin(x0)
            f = wrap((lambda x, c: body(x, c)) if on == "argument" else (lambda x: body(x, c)))
            y = f(x, c) if on == "argument" else f(x)
            return y + c.square().sum()

        calls.clear()
        x0, x = randn(2, 3, seed=1), randn(2, 3, seed=2)
        if how == "grad":
            out = tf.grad(loss)(x0, x)
        elif how == "vjp":
            y, vjp_fn = tf.vjp(loss, x0, x)
            out = vjp_fn(torch.ones_like(y))
        elif how == "jacrev":
            out = tf.jacrev(loss, argnums=(0, 1))(x0, x)
        elif how == "vmap_grad":
            out = tf.vmap(tf.grad(loss), in_dims=(0, None))(randn(2, 2, 3, seed=1), x)
        else:
            x0.requires_grad_()
            y = loss(x0, x)
            y.backward(retain_graph=True)
            first = x0.grad.clone()
            y.backward()
            out = (first, x0.grad)
        return out, len(calls)

    def nest(f):
        inner = remat(f)
        return remat(lambda *a: inner(*a) * 1)

    expected = run(lambda f: f)
    assert_close(run(remat), expected)
    if nested:
        assert_close(run(nest), expected)


@pytest.mark.parametrize("how", ["grad_and_value", "vjp", "jacrev", "vmap_grad", "hessian", "backward"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("hooked", [False, True])
def test_a_parameter_says_it_requires_grad_as_without_remat(how, nested, hooked):
    """A module's parameter the function reaches says it requires grad inside a remat'd call as
    without remat, under every torch.func transform too (its stand-in, at the forward run's own
    grad level, says it does not): a penalty summed over the trainable parameters
    (``if p.requires_grad``) is in the value (it was silently left out of it), and a hook the function
    registers on them (``p.register_hook``, ``register_post_accumulate_grad_hook``) is registered on
    the parameter once, as without remat (torch refused it on the stand-in: a raw RuntimeError; and
    under ``.backward()`` a tensor hook registered so in a nested call silently did not run: the call
    around it took it for one on a tensor of its own, and left a no-op in its place)."""
    lin = nn.Linear(3, 3).double()
    lin.bias.requires_grad_(False)
    seen = []

    def fn(x):
        if hooked:
            lin.weight.register_hook(lambda g: seen.append(g.clone()))
            lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        penalty = sum(p.square().sum() for p in lin.parameters() if p.requires_grad)
        return lin(x).sin().sum() + penalty

    def run(f):
        x = randn(2, 3, seed=1)
        if how == "grad_and_value":
            return tf.grad_and_value(f)(x)
        if how == "vjp":
            y, vjp_fn = tf.vjp(f, x)
            return y, vjp_fn(torch.ones_like(y))
        if how == "jacrev":
            return tf.jacrev(lambda x: f(x) * x)(x)
        if how == "vmap_grad":
            return tf.vmap(tf.grad_and_value(f))(randn(2, 2, 3, seed=1))
        if how == "hessian":
            return tf.hessian(f)(x)
        x.requires_grad_()
        y = f(x)
        y.backward()
        return y, x.grad, lin.weight.grad

    def hooks_off():
        lin.zero_grad(set_to_none=True)
        lin.weight._backward_hooks = lin.weight._post_accumulate_grad_hooks = None
        return list(seen)

    remat_fn = remat(lambda x: remat(fn)(x) * 1) if nested else remat(fn)
    expected = run(fn), hooks_off()
    seen.clear()
    assert_close((run(remat_fn), hooks_off()), expected)


@pytest.mark.parametrize("kind", ["hook", "post_accumulate_grad_hook", "removing_itself"])
@pytest.mark.parametrize("how", ["backward", "backward_twice", "autograd_grad", "backward_inputs", "grad"])
@pytest.mark.parametrize("nested", [False, True])
def test_a_hook_on_a_leaf_the_function_makes_runs_as_without_remat(kind, how, nested):
    """A hook the function registers on a leaf requiring grad that it makes itself and drops
    (``z = torch.ones(3, requires_grad=True); z.register_hook(log)``) runs, with that leaf's
    gradient, in a ``.backward()`` that names no inputs, which without remat reaches every leaf of
    the graph (its post-accumulate-grad hooks too), once per backward pass; not in a backward pass
    over the inputs alone (``torch.autograd.grad``, ``inputs=``, ``torch.func.grad``), as without
    remat. (The recomputation was differentiated with respect to the call's inputs only: it never ran.)"""
    if kind == "post_accumulate_grad_hook" and how == "backward_twice":
        pytest.skip("each recomputation makes the leaf anew: its .grad does not accumulate over two passes (see the README)")
    seen = []

    def fn(x):
        z = torch.tensor([0.5, 1.0, 1.5], dtype=D, requires_grad=True)
        if kind == "post_accumulate_grad_hook":
            z.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.clone()))
        elif kind == "removing_itself":
            handle = None

            def once(g):
                seen.append(g.clone())
                handle.remove()

            handle = z.register_hook(once)
        else:
            z.register_hook(lambda g: seen.append(g.clone()))
        return (x * z).sin().sum(0)

    def run(f):
        seen.clear()
        x = randn(2, 3, seed=1)
        if how == "grad":
            return tf.grad(lambda x: f(x).sum())(x), list(seen)
        x.requires_grad_()
        y = f(x).sum()
        if how == "autograd_grad":
            g = torch.autograd.grad(y, x)[0]
        elif how == "backward_inputs":
            y.backward(inputs=[x])
            g = x.grad
        elif how == "backward_twice":
            y.backward(retain_graph=True)
            y.backward()
            g = x.grad
        else:
            y.backward()
            g = x.grad
        return g, list(seen)

    remat_fn = remat(lambda x: remat(fn)(x) * 1) if nested else remat(fn)
    assert_close(run(remat_fn), run(fn))


@pytest.mark.parametrize("on", ["argument", "closure"])
@pytest.mark.parametrize("kind", ["hook", "prehook", "branch"])
@pytest.mark.parametrize("removal", ["by_the_caller", "by_itself", "none"])
@pytest.mark.parametrize("how", ["backward_twice", "grad", "vjp", "jacrev", "vmap_grad"])
@pytest.mark.parametrize("nested", [False, True])
def test_an_inputs_autograd_node_is_the_callers(on, kind, removal, how, nested):
    """Inside a remat'd call, an input the caller computed (an argument, or a tensor the function
    closes over) has the caller's autograd node as its ``grad_fn``, as without remat: a hook the
    function registers there (``c.grad_fn.register_prehook``, ``register_hook``) is registered once
    and runs once per backward pass, removed by its handle (by the caller between the forward and
    the backward pass, or by itself) as without remat, and code that branches on ``grad_fn`` takes
    the same branch. (The forward run's inputs are leaves of its own: the hook was an AttributeError
    on ``None``, the branch silently the other one.)"""
    lin = nn.Linear(3, 3).double()
    handles, calls = [], []

    def body(x, c):
        handle = None

        def hook(*grads):
            calls.append(1)
            if removal == "by_itself":
                handle.remove()
            return (grads[-1][0] * 3,) if kind == "prehook" else None

        if kind == "branch":
            return (x * c).sum() * (2.0 if c.grad_fn is not None else 5.0)
        node = c.grad_fn
        handle = node.register_hook(hook) if kind == "hook" else node.register_prehook(hook)
        handles.append(handle)
        return (x * c).sum()

    def run(wrap):
        def loss(x0, x):
            handles.clear()
            c = lin(x0)
            f = wrap((lambda x, c: body(x, c)) if on == "argument" else (lambda x: body(x, c)))
            y = f(x, c) if on == "argument" else f(x)
            if removal == "by_the_caller" and handles:
                handles[0].remove()
            return y

        calls.clear()
        x0, x = randn(2, 3, seed=1), randn(2, 3, seed=2)
        if how == "grad":
            out = tf.grad(loss)(x0, x)
        elif how == "vjp":
            y, vjp_fn = tf.vjp(loss, x0, x)
            out = vjp_fn(torch.ones_like(y))[0]
        elif how == "jacrev":
            out = tf.jacrev(loss)(x0, x)
        elif how == "vmap_grad":
            out = tf.vmap(tf.grad(loss), in_dims=(0, None))(randn(2, 2, 3, seed=1), x)
        else:
            x0.requires_grad_()
            y = loss(x0, x)
            y.backward(retain_graph=True)
            first = x0.grad.clone()
            y.backward()
            out = (first, x0.grad)
        return out, len(calls)

    def nest(f):
        inner = remat(f)
        return remat(lambda *a: inner(*a) * 1)

    expected = run(lambda f: f)
    assert_close(run(remat), expected)
    if nested:
        assert_close(run(nest), expected)
    if on == "argument":
        assert_close(run(lambda f: lambda x, c: funckpt.checkpoint(f, x, c, use_reentrant=False)), expected)


@pytest.mark.parametrize("how", ALL)
@pytest.mark.parametrize("computed", [False, True], ids=["a leaf argument", "an argument the caller computed"])
def test_an_inputs_is_leaf_is_the_callers(how, computed):
    """Code that branches on an input's ``is_leaf`` takes the branch it takes without remat: the
    forward run's and the recomputation's inputs are leaves of their own, and an input the caller
    computed said ``is_leaf`` True there (a silently other value), as ``grad_fn`` said None before."""

    def fn(x):
        return x.sin() * (2.0 if x.is_leaf else 3.0)

    def caller(f):
        return (lambda x: f(x * 1)) if computed else f

    x = randn(3, 4, seed=1)
    assert_close(derivative(how, caller(remat(fn)), x), derivative(how, caller(fn), x))


@pytest.mark.parametrize("on", ["intermediate", "parameter_only", "input", "input_post_accumulate", "node", "module"])
@pytest.mark.parametrize("how", ["jvp", "jacfwd", "vmap_jvp", "jvp_vmap"])
@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_hook_registered_where_it_requires_grad_in_a_nested_call_under_jvp_then_backward(on, how, input_requires_grad):
    """Under torch.func.jvp (jacfwd) with no grad transform, what the function computes says it
    requires no grad, though its inputs or a module's parameters require grad at plain autograd's
    level below, through which ``.backward()`` then differentiates: a hook registered only where
    it does (``if h.requires_grad: h.register_hook(...)``, on a node ``if h.grad_fn is not None``,
    a post-accumulate-grad hook on an input, a module's full backward hook) is registered nowhere
    without remat. The outer call's forward run takes a grad level of its own, which wraps every
    input of the remat'd call nested in it: they say there that they require no grad, and below it,
    where the nested call's forward run goes lowered (below the vmap of ``jvp(vmap(f))``), they do.
    The nested call's forward run takes a grad level of its own too (it registered the hook, and
    silently changed the gradient, or refused the post-accumulate-grad hook)."""
    lin = nn.Linear(3, 3).double()
    if on == "module":
        lin.register_full_backward_hook(lambda m, gi, go: tuple(None if g is None else g * 3 for g in gi))

    def fn(x):
        h = lin(x)
        if on == "node":
            if h.grad_fn is not None:
                h.grad_fn.register_prehook(lambda go: (go[0] * 3,))
            return h.sin()
        if on == "module":
            return h.sin()
        if on == "input_post_accumulate":
            if x.requires_grad:
                x.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(3))
            return h.sin()
        if on == "intermediate":
            hooked = h
        elif on == "input":
            hooked = x
        else:  # (computed from a parameter alone)
            hooked = lin.weight * 2
            h = h + hooked.sum()
        if hooked.requires_grad:
            hooked.register_hook(lambda g: g * 3)
        return h.sin()

    def run(f):
        lin.zero_grad()
        x = randn(2, 3, seed=1).requires_grad_(input_requires_grad)
        t = randn(2, 3, seed=2)
        if how == "jvp":
            outs = tf.jvp(f, (x,), (t,))
        elif how == "jacfwd":
            outs = (tf.jacfwd(f)(x),)
        elif how == "vmap_jvp":
            outs = tf.vmap(lambda a, b: tf.jvp(f, (a,), (b,)))(x, t)
        else:
            outs = tf.jvp(tf.vmap(f), (x,), (t,))
        sum(o.square().sum() for o in outs).backward()
        return lin.weight.grad, lin.bias.grad, x.grad

    assert_close(run(remat(lambda x: remat(fn)(x * 2) * 1)), run(lambda x: fn(x * 2) * 1))


@pytest.mark.parametrize("nested", [False, True])
def test_requires_grad_only_below_the_jvp_of_an_input_computed_there(nested):
    """Under torch.func.jvp with no grad transform, an input the caller computed at the jvp's level
    from a tensor requiring grad below it (``y * w``, ``w`` a plain tensor requiring grad) says it
    requires no grad, and so does what the function computes from it: a hook registered only where
    it does is registered nowhere without remat. The call saw no input requiring grad at its own
    level; its forward run, lowered into plain autograd, saw them require grad and registered the
    hook (a silently wrong gradient of ``w``). It runs at a grad level of its own there too."""
    w = randn(3, seed=3).requires_grad_()

    def fn(x):
        h = x.sin()
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return h.cos()

    def run(f):
        w.grad = None
        y, t = randn(2, 3, seed=1), randn(2, 3, seed=2)

        def g(y):
            return f(y * w)

        outs = tf.jvp(g, (y,), (t,))
        sum(o.square().sum() for o in outs).backward()
        return w.grad

    remat_fn = remat(lambda x: remat(fn)(x * 2) * 1) if nested else remat(fn)
    assert_close(run(remat_fn), run(lambda x: fn(x * 2) * 1 if nested else fn(x)))


@pytest.mark.parametrize("nested", [False, True])
def test_branch_on_requires_grad_under_jvp_then_backward_as_without_remat(nested):
    """Under torch.func.jvp with plain autograd below (an input requiring grad outside the
    transform), what the function computes says it requires no grad: a function branching on it
    computes the same values in remat's forward run (at a grad level of its own, below the jvp) and
    in its recomputations, as without remat (it raised "did not reproduce": the forward run saw it
    require grad in plain autograd)."""

    def f(x):
        h = x.sin()
        return h * 2 if h.requires_grad else h

    def run(g):
        x = randn(3, seed=1).requires_grad_()
        outs = tf.jvp(g, (x,), (torch.ones_like(x),))
        sum(o.sum() for o in outs).backward()
        return outs, x.grad

    remat_fn = remat(lambda x: remat(f)(x * 2) * 1) if nested else remat(f)
    assert_close(run(remat_fn), run(lambda x: f(x * 2) * 1 if nested else f(x)))


@pytest.mark.parametrize("how", ["grad", "vjp", "autograd_create_graph"])
def test_hook_registered_on_an_input_inside_the_function_under_transforms(how):
    def fn(x):
        x.register_hook(lambda g: g * 2)
        return x.sin() * 3

    x = randn(3, 4, seed=1)
    assert_close(derivative(how, remat(fn), x), derivative(how, fn, x))


@pytest.mark.parametrize(
    "how",
    [
        "backward",
        "grad",
        "vjp",
        "hessian",
    ],
)
def test_hook_registered_on_an_intermediate_inside_the_function(how):
    def fn(x):
        h = x.sin()
        h.register_hook(lambda g: g * 2)
        return h * x

    x = randn(3, 4, seed=1)
    assert_close(derivative(how, remat(fn), x), derivative(how, fn, x))


def test_tensor_hook_on_the_output_of_a_remat_call():
    def run(f):
        x = randn(3, 4, seed=1).requires_grad_()
        out = f(x)
        out.register_hook(lambda g: g * 5)
        out.sum().backward()
        return x.grad

    assert_close(run(remat(torch.sin)), run(torch.sin))


RANDOM_WITH_GENERATOR = {
    "rand": lambda h, g: h * torch.rand(h.shape, generator=g, dtype=D),
    "randn": lambda h, g: h + torch.randn(h.shape, generator=g, dtype=D),
    "bernoulli_": lambda h, g: h * torch.empty_like(h).bernoulli_(0.5, generator=g) / 0.5,
    "normal_": lambda h, g: h * torch.empty_like(h).normal_(generator=g),
    "randperm": lambda h, g: h[:, torch.randperm(h.shape[1], generator=g)],
    "multinomial": lambda h, g: h * torch.multinomial(h.abs() + 0.1, 2, generator=g).sum(),
}


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
@pytest.mark.parametrize("op", list(RANDOM_WITH_GENERATOR))
def test_explicit_generator_as_a_static_argument(op, how):
    noise = RANDOM_WITH_GENERATOR[op]

    def fn(x, gen):
        return noise(torch.tanh(x), gen).sin()

    def run(f):
        gen = torch.Generator().manual_seed(31)
        torch.manual_seed(7)
        result = derivative(how, lambda x, g: f(x, g), randn(3, 4, seed=1), gen)
        return result, gen.get_state(), torch.get_rng_state()

    (got, gen_got, glob_got), (expected, gen_exp, glob_exp) = run(remat(fn, static_argnums=(1,))), run(fn)
    assert_close(got, expected)
    assert torch.equal(gen_got, gen_exp) and torch.equal(glob_got, glob_exp)


@pytest.mark.parametrize("where", ["positional", "keyword", "dict", "closure"])
def test_explicit_generator_anywhere_in_the_arguments(where):
    def fn(x, gens=None, *, gen=None):
        if where == "positional":
            g = gens
        elif where == "keyword":
            g = gen
        elif where == "dict":
            g = gens["g"]
        else:
            g = closure_gen
        return (torch.tanh(x) * torch.rand(x.shape, generator=g, dtype=D)).sin()

    closure_gen = torch.Generator().manual_seed(31)

    def run(f):
        closure_gen.manual_seed(31)
        gen = torch.Generator().manual_seed(31)
        args = {
            "positional": ((gen,), {}),
            "keyword": ((), {"gen": gen}),
            "dict": (({"g": gen},), {}),
            "closure": ((), {}),
        }[where]
        x = randn(3, 4, seed=1).requires_grad_()
        out = f(x, *args[0], **args[1])
        out.square().sum().backward()
        used = closure_gen if where == "closure" else gen
        return out.detach(), x.grad, used.get_state()

    assert_close(run(remat(fn)), run(fn))


class NoisyLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        h = self.lin(x)
        keep = torch.rand(h.shape, generator=self.gen, dtype=D) > 0.5
        return h * keep / 0.5


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
def test_explicit_generator_held_by_a_module_attribute(how):
    torch.manual_seed(0)
    net = NoisyLinear()

    def run(m):
        net.gen.manual_seed(17)
        net.zero_grad()
        x = randn(5, 4, seed=1)
        if how == "backward":
            x.requires_grad_()
            out = m(m(x))
            out.sin().sum().backward()
            return out.detach(), x.grad, net.lin.weight.grad, net.gen.get_state()
        if how == "grad":
            params = dict(net.named_parameters())
            def loss(p, x):
                return tf.functional_call(m, p, (tf.functional_call(m, p, (x,)),)).sin().sum()

            g = tf.grad(loss, argnums=(0, 1))(params, x)
            return g, net.gen.get_state()
        out, vjp_fn = tf.vjp(lambda x: m(m(x)), x)
        return out, vjp_fn(tangent_like(out)), net.gen.get_state()

    assert_close(run(remat(net)), run(net))


def test_explicit_generator_shared_by_two_remat_calls_in_sequence():
    def fn(x, gen):
        return x.tanh() * torch.rand(x.shape, generator=gen, dtype=D)

    def run(f):
        gen = torch.Generator().manual_seed(3)
        x = randn(3, 4, seed=1).requires_grad_()
        out = f(f(x, gen), gen)
        out.sum().backward()
        return out.detach(), x.grad, gen.get_state()

    assert_close(run(remat(fn, static_argnums=(1,))), run(fn))
    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("unused", ["not_used", "detached", "argmax_only", "shape_only"])
def test_allow_unused_gives_none_for_an_unused_input(unused, create_graph):
    def fn(x, y):
        extra = {
            "not_used": 0,
            "detached": y.detach().sum(),
            "argmax_only": y.argmax(),
            "shape_only": y.shape[0],
        }[unused]
        return (x.sin() * x).sum() + extra

    def run(f):
        x, y = randn(3, seed=1).requires_grad_(), randn(3, seed=2).requires_grad_()
        return torch.autograd.grad(f(x, y), (x, y), allow_unused=True, create_graph=create_graph)

    (gx, gy), (ex, ey) = run(remat(fn)), run(fn)
    assert ey is None
    assert gy is None
    assert_close(gx, ex)
    assert gx.requires_grad == ex.requires_grad


def test_allow_unused_with_materialize_grads_gives_zeros():
    def fn(x, y):
        return (x.sin() * x).sum()

    def run(f):
        x, y = randn(3, seed=1).requires_grad_(), randn(3, seed=2).requires_grad_()
        return torch.autograd.grad(f(x, y), (x, y), allow_unused=True, materialize_grads=True, create_graph=True)

    assert_close(run(remat(fn)), run(fn))


def test_unused_output_gets_no_gradient_and_unused_input_none_under_backward():
    def fn(x, y):
        return x.sin(), y.detach() * 2

    def run(f):
        x, y = randn(3, seed=1).requires_grad_(), randn(3, seed=2).requires_grad_()
        a, b = f(x, y)
        flag = b.requires_grad
        a.sum().backward()
        return flag, x.grad, y.grad

    got, expected = run(remat(fn)), run(fn)
    assert got[0] == expected[0]  # a detached output does not require grad
    assert expected[2] is None and got[2] is None
    assert_close(got[1], expected[1])


# --- more of family B, found by hunting -------------------------------------------------------


def test_drop_in_checkpoint_of_a_function_that_computes_something_else_raises():
    x = randn(3, 4, seed=1).requires_grad_()
    with pytest.raises(CheckpointError):
        checkpoint(make_sin_then_cos(), x, use_reentrant=False).sum().backward()


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "vmap_grad", "jacrev"])
def test_outer_remat_that_computes_something_else_around_a_stable_inner_one(how):
    def make():
        inner = remat(torch.tanh)
        return make_counter_fn(lambda n, x: inner(x).sin() if n == 0 else inner(x).cos())

    raises_or_matches(how, make, randn(3, 4, seed=1))


class FlakyModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return h.sin() if self.calls == 1 else h[: self.calls % 2 + 1].cos()


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "vmap_grad", "hessian"])
def test_remat_module_whose_forward_depends_on_a_call_counter(how):
    torch.manual_seed(0)
    net = FlakyModule()

    def make():
        net.calls = 0
        return net

    raises_or_matches(how, make, randn(3, 4, seed=1))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
def test_iterator_passed_as_a_keyword_argument(how):
    def body(x, *, it):
        return x.sin() * next(it) + x * next(it)

    x = randn(3, 4, seed=1)
    expected = derivative(how, lambda x: body(x, it=iter([2.0, 3.0])), x)
    try:
        got = derivative(how, lambda x: remat(body)(x, it=iter([2.0, 3.0])), x)
    except CheckpointError:
        return
    assert_close(got, expected)


@pytest.mark.parametrize("mutate", ["first", "second"])
def test_an_input_returned_twice_then_updated_in_place(mutate):
    def fn(x):
        return x, x

    def run(f):
        a = randn(3, 4, seed=1).requires_grad_()
        x = a * 2
        p, q = f(x)
        (p if mutate == "first" else q).mul_(3)
        (p.sin() * q).sum().backward()
        return p.detach(), q.detach(), x.detach(), a.grad

    assert_close(run(remat(fn)), run(fn))


def test_outputs_aliasing_each_other_inside_a_dict():
    def fn(x):
        h = x.tanh() * 2
        return {"h": h, "ht": h.t(), "row": h[1]}

    def run(f):
        x = randn(3, 4, seed=1).requires_grad_()
        out = f(x)
        out["ht"].mul_(3)
        (out["h"].sin().sum() + out["row"].square().sum()).backward()
        return out["h"].detach(), out["row"].detach(), x.grad

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("how", ["grad", "vjp", "vmap_grad"])
def test_outputs_aliasing_each_other_under_transforms_without_mutation(how):
    def fn(x):
        h = x.tanh() * 2
        return h, h[:, 0], h

    def combined(f):
        def g(x):
            a, b, c = f(x)
            return a * b[:, None] + c.exp()

        return g

    x = randn(3, 4, seed=1)
    assert_close(derivative(how, combined(remat(fn)), x), derivative(how, combined(fn), x))


def test_view_of_input_with_another_dtype_updated_in_place_shows_in_the_input():
    def fn(x):
        return x * 2, x.view(torch.int64)

    def run(f):
        a = randn(3, 4, seed=1).requires_grad_()
        x = a * 1
        s, bits = f(x)
        bits.zero_()  # 0 bits are 0.0 in float64
        (s.sum() + x.square().sum()).backward()
        return x.detach(), a.grad

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
def test_empty_tensor_among_non_empty_outputs(how):
    def fn(x):
        return x[:0].sin() + 1, x.tanh()

    def combined(f):
        def g(x):
            e, t = f(x)
            return t * (1 + e.sum())

        return g

    x = randn(3, 4, seed=1)
    assert_close(derivative(how, combined(remat(fn)), x), derivative(how, combined(fn), x))


def test_empty_tensors_keep_their_dtypes_under_grad_with_aux():
    def fn(x, i):
        return x.sin(), i * 2

    x, i = randn(0, 3, seed=1), torch.zeros(0, dtype=torch.long)

    def run(f):
        g, (s, j) = tf.grad(lambda x: (f(x, i)[0].sum(), f(x, i)), has_aux=True)(x)
        return g, s, j

    got, expected = run(remat(fn)), run(fn)
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    assert_close(got, expected)


def test_nested_remat_that_enables_grad_called_under_no_grad():
    def fn(x, w):
        with torch.enable_grad():
            return remat(f_tanh_mm)(x, w).sin()

    def run(f):
        w = randn(4, 4, seed=2).requires_grad_()
        with torch.no_grad():
            out = f(randn(3, 4, seed=1), w)
        flag = out.requires_grad
        out.sum().backward()
        return flag, w.grad

    assert_close(run(remat(fn)), run(lambda x, w: enables_grad_plain(x, w)))


def enables_grad_plain(x, w):
    with torch.enable_grad():
        return f_tanh_mm(x, w).sin()


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_hook_that_replaces_the_gradient_of_a_closure_parameter(how):
    net = nn.Linear(4, 4, dtype=D)

    def fn(x):
        h = net(x)
        h.register_hook(lambda g: g.clamp(-0.1, 0.1))
        return h.tanh()

    x = randn(3, 4, seed=1)
    assert_close(derivative(how, remat(fn), x), derivative(how, fn, x))


@pytest.mark.parametrize("holder", ["static_list", "partial", "bound_method"])
def test_explicit_generator_in_other_holders(holder):
    class Holder:
        def __init__(self):
            self.gen = torch.Generator().manual_seed(0)

        def noisy(self, x):
            return x.tanh() * torch.rand(x.shape, generator=self.gen, dtype=D)

    def noisy(x, gens):
        return x.tanh() * torch.rand(x.shape, generator=gens[0], dtype=D)

    def run(wrap):
        h = Holder()
        h.gen.manual_seed(21)
        gen = torch.Generator().manual_seed(21)
        if holder == "static_list":
            f = lambda x: wrap(noisy, static_argnums=(1,))(x, [gen])
        elif holder == "partial":
            f = wrap(functools.partial(noisy, gens=[gen]))
        else:
            f = wrap(h.noisy)
            gen = h.gen
        x = randn(3, 4, seed=1).requires_grad_()
        out = f(f(x))
        out.sum().backward()
        return out.detach(), x.grad, gen.get_state()

    assert_close(run(remat), run(lambda fn, **kw: fn))


@pytest.mark.parametrize("how", ["grad", "vjp"])
def test_explicit_generator_in_the_closure_under_transforms(how):
    gen = torch.Generator()

    def fn(x):
        return x.tanh() * torch.randn(x.shape, generator=gen, dtype=D)

    def run(f):
        gen.manual_seed(4)
        return derivative(how, f, randn(3, 4, seed=1)), gen.get_state()

    assert_close(run(remat(fn)), run(fn))


class _GeneratorConfig:
    """A generator read off a class attribute (a configuration class): no walk of the call reaches it."""

    gen = torch.Generator()


class _Sampler:
    def __init__(self, gen):
        self.gen = gen


class _NoisyThroughHolder(nn.Module):
    """A module holding its generator inside something of its own (a plain object, a dict, a list)."""

    def __init__(self, holder):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.holder = holder

    def forward(self, x):
        h = self.holder
        gen = h.gen if isinstance(h, _Sampler) else h["gen"] if isinstance(h, dict) else h[0]
        return self.lin(x).tanh() * torch.rand(x.shape, generator=gen, dtype=D)


@pytest.mark.parametrize("determinism_check", ["default", "none"])
@pytest.mark.parametrize("how", ["backward", "autograd_create_graph", "grad", "vjp", "jvp"])
@pytest.mark.parametrize("where", ["module_object", "module_dict", "module_list", "class_attribute", "nested", "scan", "fori_loop"])
def test_explicit_generator_no_walk_reaches_is_replayed_from_its_first_draw(where, how, determinism_check):
    """A generator the function draws from that the walk at the call does not find (held by a module
    inside an object, dict or list of its own, read off a class attribute) is noted at the forward
    run's first draw from it and replayed as one passed: the values and gradients, and the
    generator's state after forward and backward, are the function's without remat. (The
    recomputation drew other numbers: a false "did not reproduce", or with the check off a silently
    wrong gradient, and the caller's generator advanced.)"""
    if determinism_check == "none" and where in ("scan", "fori_loop"):
        pytest.skip("loops have no determinism_check option")
    gen = _GeneratorConfig.gen
    torch.manual_seed(0)
    holders = {"module_object": _Sampler(gen), "module_dict": {"gen": gen}, "module_list": [gen]}
    module = _NoisyThroughHolder(holders.get(where, [gen]))

    def noisy(x):
        return (x.tanh() * torch.rand(x.shape, generator=_GeneratorConfig.gen, dtype=D)).cos()

    def step(c):
        return noisy(c) * c

    def build(rematted):
        wrap = functools.partial(remat, determinism_check=determinism_check) if rematted else (lambda fn: fn)
        if where in holders:
            return wrap(module)
        if where == "class_attribute":
            return wrap(noisy)
        if where == "nested":
            inner = wrap(noisy)
            return wrap(lambda x: inner(inner(x) * x))
        if not rematted:
            return lambda x: functools.reduce(lambda c, _: step(c), range(4), x)
        if where == "scan":
            return lambda x: funckpt.scan(lambda c, _: (step(c), None), x, length=4, checkpoints=2)[0]
        return lambda x: funckpt.fori_loop(0, 4, lambda i, c: step(c), x, checkpoints=1)

    def run(rematted):
        gen.manual_seed(5)
        torch.manual_seed(6)
        result = derivative(how, build(rematted), randn(3, 4, seed=1))
        return result, gen.get_state(), torch.get_rng_state()

    assert_close(run(True), run(False))


def test_allow_unused_through_nested_remat_and_keywords():
    inner = remat(lambda x, y: x.sin() * 2)

    def fn(x, *, y, z):
        return inner(x, y).sum() + 0 * z.shape[0]

    def run(f):
        x, y, z = (randn(3, seed=s).requires_grad_() for s in (1, 2, 3))
        return torch.autograd.grad(f(x, y=y, z=z), (x, y, z), allow_unused=True, create_graph=True)

    got, expected = run(remat(fn)), run(lambda x, *, y, z: (x.sin() * 2).sum())
    assert [g is None for g in got] == [g is None for g in expected] == [False, True, True]
    assert_close(got[0], expected[0])


def test_allow_unused_for_an_input_used_only_for_an_integer_output():
    def fn(x, y):
        return x.sin(), y.argmax()

    def run(f):
        x, y = randn(3, seed=1).requires_grad_(), randn(3, seed=2).requires_grad_()
        s, idx = f(x, y)
        return torch.autograd.grad((s * idx).sum(), (x, y), allow_unused=True)

    got, expected = run(remat(fn)), run(fn)
    assert expected[1] is None and got[1] is None
    assert_close(got[0], expected[0])


# =============================================================================================
# C. Savings that must happen.
# =============================================================================================


class CallCounter:
    """Counts forward calls of every layer of a module through forward hooks."""

    def __init__(self, modules):
        self.counts = [0] * len(modules)
        for i, m in enumerate(modules):
            m.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args, out):
            self.counts[i] += 1

        return hook


def short_sequential(n_pairs=1):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8, dtype=D), nn.GELU()]
    for _ in range(n_pairs - 1):
        layers += [nn.Linear(8, 8, dtype=D), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(8, 3, dtype=D))


@pytest.mark.parametrize("segments", [None, 1, 2, 3])
@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
def test_remat_of_a_short_sequential_recomputes_every_layer_including_the_last(how, segments):
    seq = short_sequential()
    counter = CallCounter(list(seq))
    wrapped = remat(seq) if segments is None else remat(seq, segments=segments)
    x = randn(5, 4, seed=1)

    def run(m):
        if how == "backward":
            x_ = x.clone().requires_grad_()
            m(x_).sin().sum().backward()
            return x_.grad
        if how == "grad":
            return tf.grad(lambda x: m(x).sin().sum())(x)
        out, vjp_fn = tf.vjp(m, x)
        return vjp_fn(torch.ones_like(out))

    expected = run(seq)
    counter.counts = [0] * len(seq)
    assert_close(run(wrapped), expected)
    assert counter.counts == [2] * len(seq)


def test_remat_of_a_two_layer_sequential_inside_a_network_saves_only_its_input():
    seq = nn.Sequential(nn.Linear(4, 8, dtype=D), nn.Linear(8, 3, dtype=D))
    rs = funckpt.saved_residuals(lambda x: remat(seq)(x).sin().sum(), randn(5, 4, seed=1).requires_grad_())
    assert all(r.kind == "input" for r in rs)
    shapes = [tuple(r.shape) for r in rs]
    assert (5, 4) in shapes  # the input is kept: the call is checkpointed
    assert (5, 8) not in shapes  # the intermediate between the two layers is not


def test_remat_of_a_longer_sequential_recomputes_every_layer():
    seq = short_sequential(n_pairs=4)
    counter = CallCounter(list(seq))
    x = randn(5, 4, seed=1).requires_grad_()
    remat(seq)(x).sum().backward()
    assert counter.counts == [2] * len(seq)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))

    def count(self, *packets):
        return sum(op in packets for op in self.ops)


DOTS = aten.mm, aten.bmm, aten.addmm, aten.matmul, aten.baddbmm

NO_BATCH_DIM_DOTS = {
    "einsum_ij_jk": (lambda a, b: torch.einsum("ij,jk->ik", a, b), (4, 5), (5, 3)),
    "einsum_bij_jk": (lambda a, b: torch.einsum("bij,jk->bik", a, b), (2, 4, 5), (5, 3)),
    "matmul_3d_2d": (lambda a, b: a @ b, (2, 4, 5), (5, 3)),
    "linear": (lambda a, b: F.linear(a, b.t()), (4, 5), (5, 3)),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=([1], [0])), (4, 5), (5, 3)),
}


@pytest.mark.parametrize("case", list(NO_BATCH_DIM_DOTS))
def test_dots_with_no_batch_dims_saveable_keeps_plain_contractions(case):
    dot, sa, sb = NO_BATCH_DIM_DOTS[case]

    def fn(a, b):
        return dot(a, b).tanh()

    a, b = randn(*sa, seed=1).requires_grad_(), randn(*sb, seed=2).requires_grad_()
    wrapped = remat(fn, policy=policies.dots_with_no_batch_dims_saveable)
    rs = funckpt.saved_residuals(lambda a, b: wrapped(a, b).sum(), a, b)
    out_numel = fn(a, b).numel()
    kept = [r for r in rs if r.kind == "saved by policy"]
    assert [torch.Size(r.shape).numel() for r in kept] == [out_numel]

    def run(f):
        a.grad = b.grad = None
        with OpCounter() as counter:
            f(a, b).sin().sum().backward()
        return (a.grad, b.grad), counter.count(*DOTS)

    (got, n_got), (expected, n_expected) = run(wrapped), run(fn)
    assert_close(got, expected)
    assert n_got == n_expected  # the contraction is not run again in the backward pass


def test_dots_with_no_batch_dims_saveable_does_not_keep_a_batched_einsum():
    def fn(a, b):
        return torch.einsum("bij,bjk->bik", a, b).tanh()

    a, b = randn(2, 4, 5, seed=1).requires_grad_(), randn(2, 5, 3, seed=2).requires_grad_()
    rs = funckpt.saved_residuals(remat(fn, policy=policies.dots_with_no_batch_dims_saveable), a, b)
    assert [r for r in rs if r.kind == "saved by policy"] == []


@pytest.mark.parametrize("how", ["backward", "grad", "vmap_grad"])
def test_dots_with_no_batch_dims_saveable_einsum_gradients(how):
    b = randn(5, 3, seed=2)

    def fn(a, b):
        return torch.einsum("ij,jk->ik", a, b).tanh()

    wrapped = remat(fn, policy=policies.dots_with_no_batch_dims_saveable)
    assert_close(derivative(how, wrapped, randn(4, 5, seed=1), b), derivative(how, fn, randn(4, 5, seed=1), b))


Pair = namedtuple("Pair", ["a", "b"])

NAMED_PYTREES = {
    "tuple": lambda a, b: (a, b),
    "list": lambda a, b: [a, b],
    "dict": lambda a, b: {"a": a, "b": b},
    "namedtuple": lambda a, b: Pair(a, b),
    "nested": lambda a, b: (a, {"inner": [b]}),
}


def _leaves(tree):
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in _leaves(t)]
    return [tree]


@pytest.mark.parametrize("case", list(NAMED_PYTREES))
def test_checkpoint_name_tags_every_leaf_of_a_pytree(case):
    build = NAMED_PYTREES[case]
    types = []

    def fn(x):
        tree = build(x.sin(), x.cos() * 2)
        named = checkpoint_name(tree, "pair")
        types.append((type(named), type(tree)))
        a, b = _leaves(named)
        return (a * b).exp()

    x = randn(3, 4, seed=1).requires_grad_()
    wrapped = remat(fn, policy=policies.save_only_these_names("pair"))
    rs = funckpt.saved_residuals(lambda x: wrapped(x).sum(), x)
    kept = [r for r in rs if r.kind == "saved by policy"]
    assert len(kept) == 2 and all(tuple(r.shape) == (3, 4) for r in kept)
    assert types and all(named is tree for named, tree in types)
    assert_close(derivative("backward", wrapped, x), derivative("backward", fn, x))


def test_checkpoint_name_of_a_pytree_outside_remat_returns_the_same_structure():
    tree = {"a": randn(2, seed=1), "b": [randn(2, seed=2), 3, "s"], "c": Pair(randn(1, seed=3), None)}
    named = checkpoint_name(tree, "name")
    assert type(named) is dict and type(named["b"]) is list and type(named["c"]) is Pair
    assert named["b"][1:] == [3, "s"] and named["c"].b is None
    assert_close((named["a"], named["b"][0], named["c"].a), (tree["a"], tree["b"][0], tree["c"].a))


def test_checkpoint_name_of_a_pytree_recomputes_nothing_named():
    """The named values are kept: sin/cos producing them are not run again in the backward."""

    def fn(x):
        a, b = checkpoint_name((x.sin(), x.cos()), "pair")
        return (a * b).exp()

    wrapped = remat(fn, policy=policies.save_only_these_names("pair"))

    def run(f):
        x = randn(3, 4, seed=1).requires_grad_()
        with OpCounter() as counter:
            f(x).sum().backward()
        return x.grad, counter.count(aten.sin, aten.cos)

    (got, n_got), (expected, n_expected) = run(wrapped), run(fn)
    assert_close(got, expected)
    assert n_got == n_expected


# --- more of family C, found by hunting -------------------------------------------------------


def test_checkpoint_sequential_keeps_torch_semantics():
    """The drop-in ``checkpoint_sequential`` does not checkpoint the last segment, as PyTorch."""
    seq = short_sequential(n_pairs=2)
    counter = CallCounter(list(seq))

    def run(cs):
        counter.counts = [0] * len(seq)
        x = randn(5, 4, seed=1).requires_grad_()
        cs(seq, 2, x, use_reentrant=False).sin().sum().backward()
        return x.grad, list(counter.counts)

    got, n_got = run(funckpt.checkpoint_sequential)
    expected, n_expected = run(torch.utils.checkpoint.checkpoint_sequential)
    assert_close(got, expected)
    # 5 layers in 2 segments: layers 0-1 checkpointed, 2-4 (the last segment) run once.
    # (PyTorch's recomputation stops early, so only the first layer's count is compared.)
    assert n_got[0] == n_expected[0] == 2
    assert n_got[2:] == n_expected[2:] == [1, 1, 1]


def test_remat_of_a_one_layer_sequential_recomputes_it():
    seq = nn.Sequential(nn.Linear(4, 3, dtype=D))
    counter = CallCounter(list(seq))
    x = randn(5, 4, seed=1).requires_grad_()
    remat(seq)(x).sin().sum().backward()
    assert counter.counts == [2]


def test_remat_of_a_short_sequential_nested_in_a_network_recomputes_its_last_layer():
    block = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.GELU())
    counter = CallCounter(list(block))
    net = nn.Sequential(remat(block), nn.Tanh(), remat(block))
    params = {k: v.detach() for k, v in net.named_parameters()}
    tf.grad(lambda p, x: tf.functional_call(net, p, (x,)).sum())(params, randn(5, 4, seed=1))
    assert counter.counts == [4, 4]


@pytest.mark.parametrize("how", ["grad", "vjp"])
def test_dots_with_no_batch_dims_saveable_einsum_is_not_recomputed_under_transforms(how):
    def fn(a, b):
        return torch.einsum("ij,jk->ik", a, b).tanh()

    b = randn(5, 3, seed=2)

    def run(f):
        with OpCounter() as counter:
            result = derivative(how, f, randn(4, 5, seed=1), b)
        return result, counter.count(*DOTS)

    (got, n_got), (expected, n_expected) = run(remat(fn, policy=policies.dots_with_no_batch_dims_saveable)), run(fn)
    assert_close(got, expected)
    assert n_got == n_expected


@pytest.mark.parametrize(
    "policy, kept",
    [
        (policies.save_any_names_but_these("other"), 2),
        (policies.save_anything_except_these_names("pair"), None),
        (policies.save_from_both_policies(policies.nothing_saveable, policies.save_only_these_names("pair")), 2),
    ],
    ids=["save_any_names_but_these", "save_anything_except_these_names", "save_from_both_policies"],
)
def test_checkpoint_name_of_a_pytree_with_other_name_policies(policy, kept):
    def fn(x):
        a, b = checkpoint_name([x.sin(), x.cos()], "pair").copy()
        c = checkpoint_name(a * b, "other")
        return c.exp()

    x = randn(3, 4, seed=1).requires_grad_()
    wrapped = remat(fn, policy=policy)
    rs = [r for r in funckpt.saved_residuals(lambda x: wrapped(x).sum(), x) if r.kind == "saved by policy"]
    if kept is None:  # everything but the pair: the pair's leaves are not among the kept values
        assert not any("pair" in r.source for r in rs)
    else:
        assert len(rs) == kept and all("pair" in r.source for r in rs)
    assert_close(derivative("backward", wrapped, x), derivative("backward", fn, x))


# =============================================================================================
# Found by a second hunt: aliasing, version checks and write detection.
# =============================================================================================


def test_chunks_of_one_tensor_passed_as_two_arguments_route_each_view_to_its_own_input():
    """The RevNet coupling pattern: y1 = x2, y2 = x1 * 2 with x1, x2 chunks of one tensor."""

    def run(f):
        h = torch.arange(4.0, dtype=D, requires_grad=True)
        a, b = h.chunk(2)
        out_b, out_a = f(a, b)
        (out_b.sum() * 3 + out_a.sum()).backward()
        return out_b.detach(), out_a.detach(), h.grad

    f = lambda a, b: (b, a * 2)  # noqa: E731
    assert_close(run(remat(f)), run(f))


def test_detached_alias_returned_before_the_real_output_keeps_its_gradient():
    def f(x):
        h = x * 2
        return h.detach(), h

    def run(g):
        x = torch.ones(3, dtype=D, requires_grad=True)
        logged, h = g(x)
        flags = (h.requires_grad, logged.requires_grad)
        (h.square().sum() + logged.sum()).backward()
        return flags, x.grad

    (flags, grad), (flags_ref, grad_ref) = run(remat(f)), run(f)
    assert flags == flags_ref
    assert_close(grad, grad_ref)


def test_non_differentiable_input_permuted_in_place_before_the_backward_raises():
    """A value digest cannot see a permutation; the version check on inputs the run read does."""
    w = randn(4, 3, seed=1).requires_grad_()
    x = randn(5, 4, seed=2)
    y = remat(lambda w, x: x @ w)(w, x)
    x.copy_(x.flip(0))
    with pytest.raises(CheckpointError, match="modified in place between the forward and the backward"):
        (y * randn(5, 3, seed=3)).sum().backward()


def test_batchnorm_in_eval_mode_under_vmap_of_an_ensemble_is_no_write():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16, dtype=D), nn.BatchNorm1d(16, dtype=D)).eval() for _ in range(3)]
    params, buffers = tf.stack_module_state(models)
    x = randn(5, 8, seed=1)

    def run(base):
        return tf.vmap(lambda p, b: tf.functional_call(base, (p, b), (x,)))(params, buffers)

    import copy

    assert_close(run(remat(copy.deepcopy(models[0]))), run(copy.deepcopy(models[0])))


def test_differentiable_value_written_into_a_buffer_argument_raises():
    """Without remat the caller's buffer joins the graph; remat cannot give it that graph."""

    def f(buf, w, x):
        buf[:, :2] = x @ w
        return buf

    w = randn(2, 2, seed=1).requires_grad_()
    with pytest.raises(CheckpointError, match="wrote a value that requires grad into one of its inputs"):
        remat(f)(torch.zeros(3, 4, dtype=D), w, randn(3, 2, seed=2))


def test_double_backward_with_an_output_that_is_a_view_of_the_input():
    f = lambda x: (x.view(2, 2), x.exp())  # noqa: E731

    def run(g):
        x = torch.tensor([0.5, -1.0, 2.0, 0.1], dtype=D, requires_grad=True)
        a, b = g(x)
        (gx,) = torch.autograd.grad((a**3).sum() + b.sum(), x, create_graph=True)
        (hx,) = torch.autograd.grad(gx.sum(), x)
        return gx.detach(), hx

    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("how", ["jvp", "dual"])
def test_forward_mode_with_an_output_that_is_the_input_itself(how):
    f = lambda x: (x, x * 2, x.sin())  # noqa: E731
    x, t = randn(3, seed=1), randn(3, seed=2)

    def run(g):
        if how == "jvp":
            return tf.jvp(g, (x,), (t,))
        with fwAD.dual_level():
            return [fwAD.unpack_dual(o).tangent for o in g(fwAD.make_dual(x, t))]

    assert_close(run(remat(f)), run(f))


# =============================================================================================
# Found by a third hunt.
# =============================================================================================


def test_remat_of_a_sequential_keeps_the_sequentials_own_hooks():
    def run(wrap):
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(3, 3, dtype=D), nn.Tanh())
        seq.register_forward_hook(lambda m, a, o: o * 10)
        seq.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
        x = randn(4, 3, seed=1).requires_grad_()
        y = wrap(seq)(x)
        y.sum().backward()
        return y.detach(), x.grad, seq[0].weight.grad

    assert_close(run(remat), run(lambda m: m))


def test_conjugate_and_negative_view_outputs_keep_their_bits():
    f = lambda z: (z.conj(), z.conj().imag, z * 2)  # noqa: E731
    z = torch.randn(3, dtype=torch.complex128)
    assert_close(remat(f)(z), f(z))
    loss = lambda g: lambda z: sum(o.real.sum() + o.imag.sum() if o.is_complex() else o.sum() for o in g(z))  # noqa: E731
    assert_close(tf.grad(loss(remat(f)))(z), tf.grad(loss(f))(z))


def test_in_place_update_through_a_view_of_a_non_differentiable_input():
    def f(x, buf):
        return x.sin() * 2, buf[:2]

    def run(g):
        x = randn(3, seed=1).requires_grad_()
        buf = randn(3, seed=2)
        y, v = g(x, buf)
        v.zero_()
        y.sum().backward()
        return y.detach(), x.grad, buf

    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_outputs_that_are_views_of_an_internal_tensor_neither_of_them_is(how):
    def f(x):
        h = x.sin() * 2
        a, b, c = h[0], h[1:], h[:, 1]
        return a.sum() + b.square().sum() + c.exp().sum()  # each view differentiated on its own

    g = lambda x: (lambda h: (h[0], h[1:], h[:, 1]))(x.sin() * 2)  # noqa: E731
    via_remat = lambda x: (lambda a, b, c: a.sum() + b.square().sum() + c.exp().sum())(*remat(g)(x))  # noqa: E731
    x = randn(3, 4, seed=1)
    assert_close(derivative(how, via_remat, x), derivative(how, f, x))


def _view_under_no_grad(h):
    with torch.no_grad():
        return h[1]


@pytest.mark.parametrize("how", ["backward", "autograd_create_graph", "grad", "vjp", "jacrev", "jvp", "jacfwd"])
@pytest.mark.parametrize(
    "outputs",
    [
        # (and whether the caller may write into the first: torch refuses a write into the base
        # of a view made under no_grad, and one into x that x.sin() saved)
        (lambda x, h: (h[0], _view_under_no_grad(h)), False),
        (lambda x, h: (h, _view_under_no_grad(h)), False),
        (lambda x, h: (h.sin(), _view_under_no_grad(x)), True),
        (lambda x, h: (h.view(torch.int64), h[0], h[1:]), True),
        (lambda x, h: (h[0].detach(), h[1], h[2:]), True),
        (lambda x, h: (h.detach(), h[0]), True),
        (lambda x, h: (h.detach()[1], h[1]), True),
        (lambda x, h: (x[0].detach(), h), False),
        (lambda x, h: (h, h[0].detach()), True),
    ],
    ids=[
        "no_grad view of an intermediate",
        "of a returned one",
        "of an input",
        "beside a dtype view",
        "beside a detached row",
        "beside it detached",
        "beside a row of it detached",
        "a detached row of an input",
        "a detached row of a returned one",
    ],
)
@pytest.mark.parametrize("write", [False, True], ids=["read", "first written"])
def test_outputs_that_no_gradient_reaches_the_base_of(outputs, how, write):
    """A view made under no_grad says it requires grad but has no graph: no gradient goes through
    it to the tensor it views (a jvp's tangent does). Nor does one reach ``h`` through
    ``h.view(torch.int64)`` or ``h.detach()``, nor a tangent: the other views of ``h`` beside them
    still differentiate to it, and see the caller's write into them."""

    outputs, writable = outputs
    if write and not writable:
        pytest.skip("refused by torch without remat")

    def g(x):
        return outputs(x, x.sin() * 2)

    def fn(g):
        def f(x):
            outs = g(x * 1)
            if write and outs[0].is_floating_point():
                outs[0].mul_(3)
            outs = [o for o in outs if o.is_floating_point()]
            return torch.cat([o.reshape(-1) * torch.arange(1, o.numel() + 1, dtype=o.dtype) for o in outs])

        return f

    x = randn(3, 3, seed=1)
    assert_close(derivative(how, fn(remat(g)), x), derivative(how, fn(g), x))


# Where a vmap is around the grad level the call's outputs are differentiated at (hessian,
# vmap(grad(f)), grad(vmap(f)), vmap(f) and then backward), remat returns outputs viewing one
# intermediate as separate tensors over its memory (no views rebuilt): a write into one that
# reaches another is refused by the backward. Elsewhere they are views, and the write is right.
UNDER_VMAP = ["hessian", "vmap_grad", "grad_vmap", "vmap_vjp", "vmap_backward"]


def vmapped_derivative(how, fn, x):
    """:func:`derivative`, and the ways that put a vmap around the grad level ``fn`` is called at."""

    def loss(x):
        return fn(x).sin().sum()

    if how == "grad_vmap":
        return tf.grad(lambda x: tf.vmap(loss)(torch.stack([x, x.cos()])).sum())(x)
    if how == "vmap_vjp":
        return tf.vmap(lambda x: tf.vjp(fn, x)[1](tangent_like(fn(x))))(torch.stack([x, x.cos()]))
    if how == "vmap_backward":
        xs = torch.stack([x, x.cos()]).requires_grad_()
        out = tf.vmap(loss)(xs)
        out.sum().backward()
        return out.detach(), xs.grad
    return derivative(how, fn, x)


@pytest.mark.parametrize("how", UNDER_VMAP)
@pytest.mark.parametrize(
    "outputs",
    [
        lambda x, h: (h[0], _view_under_no_grad(h)),
        lambda x, h: (h, _view_under_no_grad(h)),
        lambda x, h: (h.sin(), _view_under_no_grad(x)),
    ],
    ids=["no_grad view of an intermediate", "of a returned one", "of an input"],
)
def test_outputs_made_under_no_grad_differentiated_under_vmap(outputs, how):
    """Under a vmap around the grad level too, a view made under no_grad passes no gradient (it
    was torch's raw "does not require grad and does not have a grad_fn" from the recomputation's vjp)."""

    def g(x):
        return outputs(x, x.sin() * 2)

    def fn(g):
        return lambda x: torch.cat([o.reshape(-1) * torch.arange(1, o.numel() + 1, dtype=o.dtype) for o in g(x * 1)])

    x = randn(3, 3, seed=1)
    assert_close(vmapped_derivative(how, fn(remat(g)), x), vmapped_derivative(how, fn(g), x))


SEVERAL_VIEWS = pytest.mark.parametrize(
    "views",
    [
        lambda x, h: (h.t(), h[0]),
        lambda x, h: (h[1:], h[:2], h.sum()),
        lambda x, h: (h.view(-1)[2:7], h[:, 1]),
        lambda x, h: (h, h[0]),
        lambda x, h: (h, h),
        lambda x, h: (h.t(), x[0], h[1]),  # (one a view of the input)
    ],
    ids=["transpose and row", "overlapping slices", "flat slice and column", "whole and row", "twice", "and an input's"],
)


def writing_the_first(views, remat_it):
    """``x -> views(x, h)`` (with ``h = x.sin() @ x``), the first of them written in place."""

    def g(x):
        return views(x, x.sin() @ x)

    def fn(x):
        outs = (remat(g) if remat_it else g)(x * 1)
        outs[0].mul_(3)
        return torch.cat([o.reshape(-1) * torch.arange(1, o.numel() + 1, dtype=o.dtype) for o in outs])

    return fn


@pytest.mark.parametrize("how", ["backward", "autograd_create_graph", "grad", "vjp", "jacrev", "jvp", "jacfwd"])
@SEVERAL_VIEWS
def test_caller_writing_one_of_several_views_of_an_internal_tensor_changes_the_others(views, how):
    """Without remat, outputs that view one intermediate (neither being it) share its memory: the
    caller's in-place update of one shows in the others, and in their gradients."""
    x = randn(3, 3, seed=1)
    assert_close(derivative(how, writing_the_first(views, True), x), derivative(how, writing_the_first(views, False), x))


@pytest.mark.parametrize("how", UNDER_VMAP)
@SEVERAL_VIEWS
def test_caller_writing_one_of_several_views_of_an_internal_tensor_under_vmap_is_refused(views, how):
    """Under a vmap around the grad level, the outputs are separate tensors over the intermediate's
    memory: the write would reach the others' values but not their gradients. Refused, not wrong."""
    with pytest.raises(CheckpointError, match="wrote in place into an output that shares memory with another"):
        vmapped_derivative(how, writing_the_first(views, True), randn(3, 3, seed=1))


@pytest.mark.parametrize("how", ALL + UNDER_VMAP[2:])
@SEVERAL_VIEWS
def test_several_views_of_an_internal_tensor_not_written_under_every_transform(views, how):
    """Outputs viewing one intermediate (and an input), read only: right under every transform."""

    def g(x):
        return views(x, x.sin() @ x)

    def fn(g):
        return lambda x: torch.cat([o.reshape(-1) * torch.arange(1, o.numel() + 1, dtype=o.dtype) for o in g(x * 1)])

    x = randn(3, 3, seed=1)
    assert_close(vmapped_derivative(how, fn(remat(g)), x), vmapped_derivative(how, fn(g), x))


@pytest.mark.parametrize("check", ["default", "none"])
@pytest.mark.parametrize("how", ["hessian", "vmap_grad", "grad_vmap", "vmap_vjp"])
def test_caller_writing_an_output_viewing_an_input_under_vmap_is_refused(how, check):
    """Under a vmap around the grad level, ``x[0]`` comes back as a tensor of its own over the
    input's memory: the write reaches ``x`` and the recomputation's start, not autograd. Refused
    as the write it is (it was reported as a recomputation that differs, or, with the determinism
    check off, gave a wrong gradient). (Under vmap then .backward(), torch refuses the write.)"""

    def fn(x):
        x = x * 1
        v, y = remat(lambda x: (x[0], x * 2), determinism_check=check)(x)
        v.mul_(3)
        return torch.cat([x.reshape(-1), y.reshape(-1)])

    with pytest.raises(CheckpointError, match="wrote in place into an output that shares memory"):
        vmapped_derivative(how, fn, randn(3, 3, seed=1))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known gap: under a vmap around the grad level x[0] is no view of the caller's x, and where no "
    "gradient reaches the call's outputs its backward (which refuses the write) never runs",
)
@pytest.mark.parametrize("how", ["hessian", "vmap_grad", "grad_vmap"])
def test_caller_writing_an_output_viewing_an_input_then_differentiating_the_input_alone(how):
    def fn(g):
        def f(x):
            x = x * 1
            v, _ = g(x)
            v.mul_(3)
            return x.reshape(-1) * 2

        return f

    g = lambda x: (x[0], x * 2)  # noqa: E731
    x = randn(3, 3, seed=1)
    assert_close(vmapped_derivative(how, fn(remat(g)), x), vmapped_derivative(how, fn(g), x))


@pytest.mark.parametrize("how", ALL + UNDER_VMAP[2:])
def test_caller_writing_one_of_several_views_of_an_internal_tensor_apart_from_the_others(how):
    """Rows of one intermediate share its memory but no element: writing one changes no other, so
    that write is right under every transform, vmap around grad included (nothing is refused)."""

    def g(x):
        h = x.sin() @ x
        return h[0], h[1], h[2:]

    def fn(g):
        def f(x):
            a, b, c = g(x * 1)
            b.mul_(3)
            return torch.cat([a * 2, b, c.reshape(-1) * 4])

        return f

    x = randn(3, 3, seed=1)
    assert_close(vmapped_derivative(how, fn(remat(g)), x), vmapped_derivative(how, fn(g), x))


def _dtype_views_batch():
    try:
        tf.vmap(lambda t: t.view(torch.int64))(torch.zeros(2, 2, dtype=D))
    except RuntimeError:  # (torch 2.11)
        return False
    return True


@pytest.mark.parametrize("how", ALL + UNDER_VMAP[2:])
def test_caller_writing_a_view_of_an_intermediate_beside_its_bits_in_another_dtype(how):
    """``h.view(torch.int64)`` shares the memory of ``h[0]``, but no gradient goes through it: the
    caller's write into ``h[0]`` is right under every transform, vmap around grad included (nothing
    is refused, as before the watch)."""
    if how in UNDER_VMAP and not _dtype_views_batch():
        pytest.skip(f"torch {torch.__version__} has no batching rule for view(dtype)")

    def g(x):
        h = x.sin() @ x
        return h[0], h.view(torch.int64), h[1:]

    def fn(g):
        def f(x):
            a, bits, c = g(x * 1)
            a.mul_(3)
            return torch.cat([a * 2, c.reshape(-1) * 4, (bits[0] != 0).to(x.dtype)])

        return f

    x = randn(3, 3, seed=1)
    assert_close(vmapped_derivative(how, fn(remat(g)), x), vmapped_derivative(how, fn(g), x))


@pytest.mark.parametrize("leaf", [True, False])
def test_hook_registered_on_an_input_applies_to_its_whole_gradient(leaf):
    """Without remat the hook sees the input's gradient from every use, not only through fn."""

    def fn(x):
        x.register_hook(lambda g: g * 3)
        return x.sin()

    def run(f):
        a = randn(4, seed=1).requires_grad_()
        x = a if leaf else a * 1
        (f(x).sum() + (x * 2).sum()).backward()
        return a.grad

    assert_close(run(remat(fn)), run(fn))


@pytest.mark.parametrize("once", [True, False], ids=["registered once", "registered at every call"])
@pytest.mark.parametrize("wrap", ["remat", "checkpoint"])
def test_post_accumulate_grad_hook_registered_inside_the_function_steps_the_optimizer(once, wrap):
    """A module that registers its parameters' post-accumulate-grad hooks in its forward (an
    optimizer step in the backward pass, set up lazily) gets them called as without remat: once
    per parameter and backward pass, with the accumulated gradient, on the caller's parameter."""

    def train(use_remat):
        torch.manual_seed(0)
        steps = []

        def step(p):
            if p.grad is None:  # (a hook registered at an earlier call; the first one stepped)
                return
            steps.append(p.grad.clone())
            with torch.no_grad():
                p.sub_(0.1 * p.grad)
            p.grad = None

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin, self.hooked = nn.Linear(3, 3, dtype=D), False

            def forward(self, x):
                if not (once and self.hooked):
                    for p in self.parameters():
                        p.register_post_accumulate_grad_hook(step)
                    self.hooked = True
                return self.lin(x).tanh()

        layer = Layer()
        if not use_remat:
            call = layer
        elif wrap == "remat":
            call = remat(layer)
        else:
            call = functools.partial(checkpoint, layer, use_reentrant=False)
        outs = []
        for s in range(3):
            x = randn(2, 3, seed=s).requires_grad_()
            y = call(x)
            y.sin().sum().backward()
            outs.append((y.detach(), x.grad))
        steps.sort(key=lambda g: g.numel())  # (the order of the parameters' hooks is autograd's)
        return outs, steps, [p.detach() for p in layer.parameters()]

    expected = train(False)
    assert len(expected[1]) == 6
    assert_close(train(True), expected)


# =============================================================================================
# Found by a sweep of real models: tensors escaping the forward run, writes into argument dicts.
# =============================================================================================


# Tensors the function computes and keeps outside the call (a forward hook's list, a module
# attribute, a global) become outputs of the remat'd call under plain autograd: gradients flow
# through them as without remat, as under torch.utils.checkpoint (HF's output_attentions,
# output_hidden_states and output_router_logits, an MoE layer's auxiliary loss).


def _grads_of(loss_fn, *leaves):
    return torch.autograd.grad(loss_fn(), leaves)


def test_a_forward_hook_that_keeps_a_submodule_output_passes_its_gradient():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh(), nn.Linear(4, 4, dtype=D))
    kept = []
    block[0].register_forward_hook(lambda m, i, o: kept.append(o))
    x = randn(3, 4, seed=1).requires_grad_()

    def loss(f):
        kept.clear()
        out = f(x)
        return out.square().sum() + kept[0].sin().sum()

    leaves = (x, *block.parameters())
    assert_close(_grads_of(lambda: loss(remat(block)), *leaves), _grads_of(lambda: loss(block), *leaves))


@pytest.mark.parametrize("also_returned", [False, True], ids=["kept only", "its base returned too"])
@pytest.mark.parametrize("view", ["slice", "transpose", "two views"])
def test_a_kept_view_of_an_intermediate_can_be_updated_in_place_by_the_caller(view, also_returned):
    """A forward hook keeping a view of a submodule's output (``out[:, 0]``, a CLS token) hands the
    caller a tensor it may update in place, as without remat; gradients flow through the update."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh(), nn.Linear(4, 4, dtype=D))
    kept = []

    def keep(module, inputs, out):
        if view == "slice":
            kept.append(out[:, :2])
        elif view == "transpose":
            kept.append(out.T)
        else:
            kept.extend([out[0], out[:, 1]])

    block[0].register_forward_hook(keep)
    wrapped = remat(block, segments=1)

    def loss(use_remat):
        kept.clear()
        x = randn(3, 4, seed=1).requires_grad_()
        if also_returned:
            out, h = remat(lambda x: (block(x), kept[-1]._base))(x) if use_remat else (block(x), kept[-1]._base)
        else:
            out, h = (wrapped if use_remat else block)(x), None
        for k, t in enumerate(kept):
            t.mul_(k + 2)  # (allowed without remat: the linear layer saved nothing of its output)
        total = out.square().sum() + sum(t.sin().sum() for t in kept) + (0 if h is None else h.cos().sum())
        forward_kept = list(kept)  # (the recomputation appends its own)
        total.backward()
        return [t.detach() for t in forward_kept], x.grad, [p.grad for p in block.parameters()]

    expected = loss(False)
    block.zero_grad()
    assert_close(loss(True), expected)


@pytest.mark.parametrize("update", ["none", "the kept one", "the returned one"])
@pytest.mark.parametrize("returns", ["h", "a view of h", "two views of h"])
def test_a_tensor_both_returned_and_kept_is_one_tensor_for_the_caller(returns, update):
    """``log.append(h); return h.tanh(), h``: without remat the caller's ``h`` and ``log[0]`` are one
    tensor (or views of one), so an in-place update through either is in the graph of both. remat
    gives the caller that one tensor too (not outputs sharing memory, whose graphs would not see
    each other's updates: a silently wrong gradient)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, dtype=D)
    log = []

    def fn(x):
        h = lin(x)
        log.append(h)
        if returns == "h":
            return h.tanh(), h
        if returns == "a view of h":
            return h.tanh(), h[:, 1]
        return h.T, h[1]

    def grads(f):
        log.clear()
        x = randn(3, 4, seed=1).requires_grad_()
        y, h = f(x)
        kept = log[0]
        assert kept is h or h._base is kept
        if update == "the kept one":
            kept.mul_(2)
        elif update == "the returned one":
            h.add_(1)
        loss = y.sin().sum() + h.sin().sum() + kept.square().sum()
        return (loss.detach(), *_grads_of(lambda: loss, x, *lin.parameters()))

    assert_close(grads(remat(fn)), grads(fn))


@pytest.mark.parametrize("returns", ["conj", "conj().imag", "real", "imag", "view_as_real"])
def test_a_returned_complex_view_of_a_kept_tensor_keeps_its_values(returns):
    """Lazy conjugate and negative views of a kept tensor (``h.conj()``) returned beside it: their
    values and gradients, as without remat (``as_strided`` would drop the conjugate bit)."""
    w = randn(4, 4, seed=2, dtype=torch.complex128)
    log = []

    def fn(x):
        h = x @ w
        log.append(h)
        view = {"conj": h.conj, "conj().imag": lambda: h.conj().imag, "real": lambda: h.real,
                "imag": lambda: h.imag, "view_as_real": lambda: torch.view_as_real(h)}[returns]()  # fmt: skip
        return view, (h * 2).real

    def run(f):
        log.clear()
        x = randn(3, 4, seed=1, dtype=torch.complex128).requires_grad_()
        view, other = f(x)
        values = torch.view_as_real(view.resolve_conj()) if view.is_complex() else view
        loss = (values * torch.arange(values.numel()).reshape(values.shape)).sum() + other.sum()
        loss = loss + torch.view_as_real(log[0]).square().sum()
        return values.detach(), *torch.autograd.grad(loss, x)

    assert_close(run(remat(fn)), run(fn))


class _AuxLoss(nn.Module):
    """An MoE layer's pattern: an auxiliary loss stored on the module, summed by the training loop."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        self.aux = (h * h).sum(1).mean()
        return h


def test_a_module_attribute_set_in_forward_passes_its_gradient():
    torch.manual_seed(0)
    layers = [_AuxLoss() for _ in range(3)]
    x = randn(2, 3, 4, seed=1).requires_grad_()

    def loss(wrap):
        h = x
        for layer in layers:
            h = wrap(layer)(h)
        return h.sum() + sum(layer.aux for layer in layers)

    leaves = (x, *(p for layer in layers for p in layer.parameters()))
    assert_close(_grads_of(lambda: loss(remat), *leaves), _grads_of(lambda: loss(lambda m: m), *leaves))


@pytest.mark.parametrize("kept_in", ["a module attribute", "a list kept across steps"])
def test_tensors_kept_outside_the_call_train_for_several_steps(kept_in):
    """The previous step's kept tensor (and the recomputation's copy of it, which the function
    keeps in the same place) has a spent graph: the next step's call must not make it an input,
    whose backward would run into that graph (and keep every earlier step alive)."""
    torch.manual_seed(0)
    layers = [_AuxLoss() for _ in range(2)]
    plain = [_AuxLoss() for _ in range(2)]
    for a, b in zip(plain, layers):
        b.load_state_dict(a.state_dict())
    log = []

    def grads(wrap, layers, x):
        h = x
        for layer in layers:
            h = wrap(layer)(h)
            if kept_in == "a list kept across steps":
                log.append(layer.aux)  # (a recomputation appends its own copy too)
        loss = h.sum() + sum(layer.aux for layer in layers)
        return torch.autograd.grad(loss, [x, *(p for layer in layers for p in layer.parameters())])

    for step in range(3):
        x = randn(2, 3, 4, seed=step).requires_grad_()
        assert_close(grads(remat, layers, x), grads(lambda m: m, plain, x))


class _State(nn.Module):
    """HF RecurrentGemma's pattern: state set to None, then to a tensor computed in the call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.state = None

    def forward(self, x):
        self.state = None
        h = torch.tanh(self.lin(x))
        self.state = h.sum(0)
        return h


_ROUTES = {
    "remat": remat,
    "checkpoint": lambda m: functools.partial(checkpoint, m, use_reentrant=False),
    "checkpoint-reentrant": lambda m: functools.partial(checkpoint, m, use_reentrant=True),
}


@pytest.mark.parametrize("route", list(_ROUTES))
@pytest.mark.parametrize("module", [_AuxLoss, _State])
def test_a_module_attribute_set_in_forward_over_training_steps(module, route):
    """The value a call keeps on its module is an output of that call; the next call reaches it
    (a tensor now, no longer None or absent) after the first backward pass freed its graph.
    Neither the recomputation's value nor a link to the freed graph may be left: both made the
    second backward pass raise 'backward through the graph a second time'."""
    torch.manual_seed(0)
    reference = nn.ModuleList([module() for _ in range(3)])
    results = []
    for wrap in (lambda m: m, _ROUTES[route]):
        net = copy.deepcopy(reference)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        values = []
        for step in range(3):
            h = randn(2, 4, seed=step)
            for layer in net:
                h = wrap(layer)(h)
            kept = [getattr(layer, "aux", None) for layer in net]
            loss = h.sum() + (sum(kept) if module is _AuxLoss else 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            values.append(loss.detach())
        results.append((values, net.state_dict()))
    assert_close(results[1], results[0])


def test_what_the_recomputation_rebinds_on_a_module_happens_again_as_under_torch_checkpoint():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=D)
            self.calls, self.last = 0, None

        def forward(self, x):
            self.calls += 1
            self.last = self.lin(x)
            return self.last.tanh()

    m = Counting()
    reference = copy.deepcopy(m)
    out = remat(m)(randn(2, 4, seed=1))
    out.sum().backward()  # the recomputation runs forward again, as under torch.utils.checkpoint
    torch_checkpoint(reference, randn(2, 4, seed=1), use_reentrant=False).sum().backward()
    assert m.calls == reference.calls == 2
    assert_close(m.last, reference.last)  # the recomputation's value, with its graph spent


def test_reading_a_module_attribute_whose_graph_was_freed_raises_as_without_remat():
    class Carry(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=D)
            self.state = None

        def forward(self, x, use):
            y = self.lin(x)
            if use:
                y = y + self.state  # the previous step's, whose graph its backward freed
            self.state = y.sum(0)
            return y

    for wrap, error in ((lambda m: m, "backward through the graph a second time"), (remat, "whose backward pass has run since")):
        m = Carry()
        wrap(m)(randn(2, 4, seed=1), False).sum().backward()
        with pytest.raises(RuntimeError, match=error) as info:
            wrap(m)(randn(2, 4, seed=2), True).sum().backward()
        assert wrap is not remat or isinstance(info.value, CheckpointError)


class _Box:
    t = None


def _storing(where):
    """A function that stores a tensor it computes outside the call (``where``), the object it
    is passed, and how to read the stored tensor back."""
    store, losses, box = {}, [], _Box()

    def fn(x, b):
        h = x.sin()
        if where == "global dict":
            store["h"] = h
        elif where == "closure list":
            losses.append(h.exp().sum())
        else:
            b.t = h * 3
        return h.exp()

    def stored():
        return store["h"] if where == "global dict" else losses[-1] if where == "closure list" else box.t

    return fn, box, stored


@pytest.mark.parametrize("where", ["global dict", "closure list", "argument object"])
def test_a_tensor_stored_outside_the_call_passes_its_gradient(where):
    fn, box, stored = _storing(where)
    x = randn(3, seed=1).requires_grad_()

    def loss(f):
        return f(x, box).sum() + 2 * stored().sum()

    assert_close(_grads_of(lambda: loss(remat(fn)), x), _grads_of(lambda: loss(fn), x))


@pytest.mark.parametrize("where", ["global dict", "argument object"])
def test_a_tensor_stored_outside_the_call_over_two_backward_passes(where):
    """The second call reaches the first one's stored tensor (a global, an attribute of an object
    it is passed), whose graph the first backward freed, and stores its own over it."""
    fn, box, stored = _storing(where)

    def grads(f):
        got = []
        for seed in (1, 2):
            x = randn(3, seed=seed).requires_grad_()
            out = f(x, box).sum()
            (out + 2 * stored().sum()).backward()  # (no pruning)
            got.append(x.grad)
        return got

    assert_close(grads(remat(fn)), grads(fn))


def test_a_kept_tensor_no_gradient_asks_for_leaves_the_gradient_as_without_it():
    kept = []

    def fn(x, w):
        h = torch.tanh(x @ w)
        kept.append(h * h)
        return h.cos()

    x, w = randn(3, 4, seed=1).requires_grad_(), randn(4, 4, seed=2).requires_grad_()
    assert_close(_grads_of(lambda: remat(fn)(x, w).sum(), x, w), _grads_of(lambda: fn(x, w).sum(), x, w))
    kept.clear()
    remat(fn)(x, w)  # only the kept tensor is differentiated
    got = torch.autograd.grad(kept[0].sum(), (x, w))
    kept.clear()
    fn(x, w)
    assert_close(got, torch.autograd.grad(kept[0].sum(), (x, w)))


def test_separate_backwards_through_the_output_and_a_kept_tensor():
    """Outputs of one autograd node: the first backward keeps its graph for the second with
    retain_graph=True (as the README says); the gradients then add up as without remat."""
    kept = []

    def fn(x, w):
        kept.append(x * 3.0)
        return torch.tanh(x @ w)

    def accumulated(f):
        kept.clear()
        x, w = randn(3, 4, seed=1).requires_grad_(), randn(4, 4, seed=2).requires_grad_()
        f(x, w).sum().backward(retain_graph=True)
        kept[0].square().sum().backward()
        return x.grad, w.grad

    assert_close(accumulated(remat(fn)), accumulated(fn))


def test_a_kept_tensor_lets_go_of_the_forward_runs_activations():
    """The kept tensor is pointed at the remat'd call's node: the forward run's local graph,
    and the activations it saved, are freed at the end of the call as when nothing is kept."""
    import weakref

    kept, intermediates = [], []

    def fn(x):
        a = x.sin()
        b = a.exp()
        intermediates.extend([weakref.ref(a), weakref.ref(b)])
        kept.append(b * b)  # its graph saves b
        return a.sum()

    remat(fn)(randn(5, seed=1).requires_grad_())
    assert [r() for r in intermediates] == [None, None]
    assert "Remat" in type(kept[0].grad_fn).__name__


@pytest.mark.parametrize("how", ["create_graph", "retain_graph", "forward_mode"])
def test_a_kept_tensor_under_higher_order_and_repeated_differentiation(how):
    kept = []

    def fn(x, w):
        a = (x @ w).sin()
        kept.append(a * a)
        return a.cos().sum()

    x, w = randn(3, 4, seed=1).requires_grad_(), randn(4, 4, seed=2).requires_grad_()

    def run(f):
        kept.clear()
        if how == "forward_mode":
            with fwAD.dual_level():
                xd = fwAD.make_dual(x.detach(), randn(3, 4, seed=3))
                out = f(xd, w.detach())
                return fwAD.unpack_dual(out).tangent, fwAD.unpack_dual(kept[0]).tangent
        out = f(x, w)
        if how == "create_graph":
            gx, gw = torch.autograd.grad(out + kept[0].pow(2).sum(), (x, w), create_graph=True)
            return torch.autograd.grad(gx.sin().sum() + gw.sum(), (x, w))
        first = kept[0]  # (a recomputation runs fn again: it appends to the list too)
        return (
            *torch.autograd.grad(out, (x, w), retain_graph=True),
            *torch.autograd.grad(first.sum(), (x, w), retain_graph=True),
            *torch.autograd.grad(out + first.sum(), (x, w)),
        )

    assert_close(run(remat(fn)), run(fn))


def test_a_kept_tensor_in_a_nested_remat():
    kept = []

    def inner(x, w):
        a = (x @ w).sin()
        kept.append(a * a)
        return a.cos()

    def outer(f):
        return lambda x, w: (f(x, w) * 2).exp().sum()

    x, w = randn(3, 4, seed=1).requires_grad_(), randn(4, 4, seed=2).requires_grad_()

    def loss(f):
        kept.clear()
        out = f(x, w)
        return out + 3 * kept[0].sum()

    expected = _grads_of(lambda: loss(outer(inner)), x, w)
    assert_close(_grads_of(lambda: loss(remat(outer(remat(inner)))), x, w), expected)
    assert_close(_grads_of(lambda: loss(remat(outer(inner))), x, w), expected)


@pytest.mark.parametrize("kept_by", ["the function", "a hook on the remat'd submodule"])
def test_a_nested_remat_calls_output_kept_outside_the_enclosing_call(kept_by):
    """The nested call's output is its Function's own tensor, made where no operator of the
    enclosing run returned it: it escapes the enclosing call all the same."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, dtype=D)
    kept = []

    def make(inner):
        if kept_by == "the function":

            def outer(x):
                h = inner(x)
                kept.append(h)
                return h.tanh().exp().sum(0)

            return outer
        inner.register_forward_hook(lambda m, i, o: kept.append(o))
        return nn.Sequential(inner, nn.Tanh())

    x = randn(3, 4, seed=1).requires_grad_()
    leaves = (x, *lin.parameters())

    def loss(f):
        kept.clear()
        return f(x).sum() + kept[0].pow(3).sum()

    expected = _grads_of(lambda: loss(make(lin)), *leaves)
    assert_close(_grads_of(lambda: loss(remat(make(remat(lin)))), *leaves), expected)


def test_a_kept_tensor_found_elsewhere_in_the_recomputation_is_named_in_the_error():
    """A kept tensor is found again by its position among the tensors the function's operators
    return: a constant a module makes on its first call only shifts it, and the error says so."""
    kept, cache = [], {}

    def fn(x, w):
        if "c" not in cache:
            cache["c"] = torch.arange(4, dtype=D) / 4
        h = (x @ w).sin()
        kept.append(h * cache["c"])
        return h.cos()

    x, w = randn(3, 4, seed=1).requires_grad_(), randn(4, 4, seed=2).requires_grad_()
    out = remat(fn)(x, w)
    with pytest.raises(CheckpointError, match="(?s)kept outside the call.*by its position.*on its first call only"):
        (out.sum() + kept[0].sum()).backward()
    kept.clear()
    out = remat(fn)(x, w)
    cache["c"] = cache["c"].flip(0)  # found at its position, with other values
    with pytest.raises(CheckpointError, match="(?s)pass: a tensor the function kept outside.*other values.*by its position"):
        (out.sum() + kept[0].sum()).backward()


_UNDER_TORCH_FUNC = {
    "grad": lambda f, w, xs: tf.grad(lambda w: f(w, xs[0]))(w),
    "vjp": lambda f, w, xs: tf.vjp(lambda w: f(w, xs[0]), w)[1](torch.ones((), dtype=D)),
    "vmap(grad)": lambda f, w, xs: tf.vmap(tf.grad(f), in_dims=(None, 0))(w, xs),
    "grad(grad)": lambda f, w, xs: tf.grad(lambda w: tf.grad(lambda v: f(v, xs[0]))(w).sin().sum())(w),
    "jacrev": lambda f, w, xs: tf.jacrev(lambda w: f(w, xs[0]))(w),
}


@pytest.mark.parametrize("how", list(_UNDER_TORCH_FUNC))
@pytest.mark.parametrize("kept_in", ["a list a forward hook appends to", "a dict", "a module attribute"])
def test_a_tensor_a_hook_appends_to_a_list_outside_the_call_gets_its_gradient_under_torch_func(kept_in, how):
    """A tensor the function computes and leaves in a list, dict or attribute held outside the call
    (HF's output recorder: a forward hook appending attention weights, router logits), which the
    caller's loss uses: under a torch.func transform that place gets the call's output standing for
    it (under plain autograd the tensor itself is the output), and its gradient flows as without remat."""
    lin = nn.Linear(4, 4).to(D)
    log: list[torch.Tensor] = []
    table: dict[str, torch.Tensor] = {}
    holder = _Cache()
    if kept_in == "a list a forward hook appends to":
        lin.register_forward_hook(lambda m, i, o: log.append(o.sin() * 2))

    def layer(w, x):
        h = torch.tanh(tf.functional_call(lin, {"weight": w, "bias": lin.bias}, (x,)))
        if kept_in == "a dict":
            table["h"] = h.cos()
        elif kept_in == "a module attribute":
            holder.keys = h * h
        return (h * h).sum(-1)

    def loss(wrap):
        def f(w, x):
            log.clear(), table.clear()
            y = wrap(layer)(w, x).sum()
            kept = log[0] if log else table["h"] if table else holder.keys
            return y + kept.square().sum()

        return f

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    assert_close(_UNDER_TORCH_FUNC[how](loss(remat), w, xs), _UNDER_TORCH_FUNC[how](loss(lambda f: f), w, xs))


@pytest.mark.parametrize("how", ["jvp", "jacfwd", "vmap(jvp)"])
def test_a_tensor_a_hook_appends_to_a_list_outside_the_call_raises_under_forward_mode(how):
    """Forward mode's rule runs the function again (its hook would append again), so there the list
    does not get the call's output: refused, never a tangent silently missing."""
    log: list[torch.Tensor] = []

    def layer(w, x):
        h = torch.tanh(x @ w)
        log.append(h.sin() * 2)
        return (h * h).sum(-1)

    def f(w, x):
        log.clear()
        return remat(layer)(w, x).sum() + log[0].square().sum()

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    with pytest.raises(CheckpointError, match="outlived the call other than as its return value"):
        _BELOW_A_VMAP[how](lambda w, x: f(w, x)[None], w, xs) if how != "jvp" else tf.jvp(lambda w: f(w, xs[0]), (w,), (torch.ones_like(w),))


class _KeptList(list):
    """A list subclass (a user's own record, an HF ``ModelOutput``-like container)."""


_Pair = namedtuple("_Pair", "first second")

#: Places outside the call where a function keeps a tensor it computed (and the kept value read back),
#: besides a plain list, dict or attribute (see the test above).
_KEPT_IN = {
    "a tuple in a list": (lambda st, h, c: st["list"].append((h, "h")), lambda st: st["list"][0][0]),
    "a namedtuple in a dict": (lambda st, h, c: st["dict"].update(k=_Pair(h, c)), lambda st: st["dict"]["k"].first * st["dict"]["k"].second),
    "tuples in a module attribute": (lambda st, h, c: setattr(st["module"], "cache", ((h, c),)), lambda st: st["module"].cache[0][0] * st["module"].cache[0][1]),
    "a closure cell": (lambda st, h, c: st["cell"](h), lambda st: st["cell"]()),
    "a list subclass": (lambda st, h, c: st["mine"].append(h), lambda st: st["mine"][0]),
}


def _a_cell():
    """A function writing its closure cell (``nonlocal``), and reading it when called without argument."""
    kept = None

    def cell(*value):
        nonlocal kept
        if value:
            kept = value[0]
        return kept

    return cell


@pytest.mark.parametrize("how", list(_UNDER_TORCH_FUNC))
@pytest.mark.parametrize("kept_in", list(_KEPT_IN))
def test_a_tensor_kept_outside_the_call_in_a_tuple_a_cell_or_a_list_subclass_gets_its_gradient_under_torch_func(kept_in, how):
    """A tensor kept in a tuple (rebuilt with the output standing for it, in the list, dict, cell
    or tuple holding it), a closure cell, or a list or dict subclass (written by the builtin class's
    ``__setitem__``), which the caller's loss uses: its gradient flows as without remat (each was
    refused as a tensor that outlived the call)."""
    keep, read = _KEPT_IN[kept_in]
    store = {"list": [], "dict": {}, "module": nn.Module(), "mine": _KeptList()}

    def layer(w, x):
        h = torch.tanh(x @ w)
        c = h.exp()
        keep(store, h, c)
        return (h + c).sum(-1)

    def loss(wrap):
        def f(w, x):
            store.update(list=[], dict={}, module=nn.Module(), mine=_KeptList(), cell=_a_cell())
            return wrap(layer)(w, x).sum() + read(store).square().sum()

        return f

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    assert_close(_UNDER_TORCH_FUNC[how](loss(remat), w, xs), _UNDER_TORCH_FUNC[how](loss(lambda f: f), w, xs))


# Routes where the forward run records no graph of its own: below a vmap around the caller's
# grad level with a saving policy, and below vmap(jvp). A derivative of ``fn(w, x)`` by each.
_BELOW_A_VMAP = {
    "vmap(grad)": lambda f, w, xs: tf.vmap(tf.grad(lambda w, x: f(w, x).sum()), in_dims=(None, 0))(w, xs),
    "grad(vmap)": lambda f, w, xs: tf.grad(lambda w: tf.vmap(f, in_dims=(None, 0))(w, xs).sum())(w),
    "vmap, then backward": lambda f, w, xs: (lambda w: torch.autograd.grad(tf.vmap(f, in_dims=(None, 0))(w, xs).sum(), w))(
        w.clone().requires_grad_()
    )[0],
    "vmap(jvp)": lambda f, w, xs: tf.vmap(lambda x: tf.jvp(lambda w: f(w, x), (w,), (torch.ones_like(w),))[1])(xs),
    "jacfwd": lambda f, w, xs: tf.jacfwd(lambda w: f(w, xs[0]))(w),
}


class _Cache:
    """A key/value cache in the shape of HF's: an object passed in, whose layer appends to it."""

    keys: torch.Tensor | None = None


def _attends_over_its_cache(w, x, cache):
    """Attends over the keys its cache holds and this call's: a recomputation that appends to the
    forward run's keys again gets the same values (each key twice) and half their gradient."""
    k = torch.tanh(x @ w)
    old = cache.keys if cache.keys is not None else k.new_zeros(0, k.shape[-1])
    cache.keys = torch.cat([old, k])
    return torch.softmax(cache.keys @ k.t(), dim=0).t() @ cache.keys


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
def test_a_key_value_cache_kept_outside_the_call_raises_below_a_vmap(how, policy):
    f = remat(_attends_over_its_cache, policy=policy)
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    with pytest.raises(CheckpointError, match="(?s)outlived the call other than as its return value.*use_cache=False"):
        _BELOW_A_VMAP[how](lambda w, x: f(w, x, _Cache()), w, xs)


def _keeps(what, log):
    """A function that keeps ``what`` outside the call, none of it carrying a derivative, or
    returns views of one intermediate."""

    def fn(w, x):
        h = x @ w
        if what == "a detached tensor":
            log.append(h.detach())
        elif what == "a constant made inside":
            log.append(torch.arange(4, dtype=D).cos())
        elif what == "what no_grad computed":
            with torch.no_grad():
                log.append(h * 2)
        elif what == "an integer tensor":
            log.append(h.argmax(-1))
        elif what == "a tensor made like one":
            log.append(torch.zeros_like(h) + h.new_ones(()))
        elif what == "views of an intermediate":
            return h[0].sin() + h.t()[:, 0] * h[1]
        return h.sin()

    return fn


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
@pytest.mark.parametrize(
    "what",
    [
        "a detached tensor",
        "a constant made inside",
        "what no_grad computed",
        "an integer tensor",
        "a tensor made like one",
        "views of an intermediate",
    ],
)
def test_what_carries_no_derivative_may_be_kept_below_a_vmap(what, how, policy):
    if what == "what no_grad computed" and how in ("vmap(jvp)", "jacfwd"):
        pytest.skip("no_grad does not stop a forward-mode derivative: kept, it carries one")
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    log = []
    assert_close(_BELOW_A_VMAP[how](remat(_keeps(what, log), policy=policy), w, xs), _BELOW_A_VMAP[how](_keeps(what, log), w, xs))


@pytest.mark.parametrize("inner", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("outer", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
def test_nested_calls_keeping_nothing_below_a_vmap(how, outer, inner):
    """What the operators of a run save for their derivative at its own level (below a vmap that
    ``.backward()`` differentiates, the graph its outputs carry until the call's node replaces it),
    and what an enclosing policy keeps, is alive at the run's end without being kept outside."""

    def block(w, x):
        h = x @ w
        return torch.tanh(h) * h.sin()

    def two(w, x, b=block):
        return b(w, b(w, x).cos() * x)

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    nested = remat(functools.partial(two, b=remat(block, policy=inner)), policy=outer)
    assert_close(_BELOW_A_VMAP[how](nested, w, xs), _BELOW_A_VMAP[how](two, w, xs))


_VIEWS_OF_AN_INPUT = {
    "a slice": lambda w: w[:, :2],
    "a transpose": lambda w: w.t(),
}


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.save_only_these_names("none")], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
@pytest.mark.parametrize("view", list(_VIEWS_OF_AN_INPUT))
@pytest.mark.parametrize("layer", ["a LayerNorm", "a LayerNorm's weight", "a Linear"])
def test_a_view_of_an_input_that_a_matmul_saves_is_not_kept_below_a_vmap(layer, view, how, policy):
    """With a saving policy below a vmap the run has no grad level of its own: a module's parameters
    require grad where it runs, so autograd records a graph there, and the matmul's node saves the view
    of the input it takes (``ln(x) @ w[:, :2]``). The outputs carry that graph until the call's node
    replaces it: the view is alive at the run's end without being kept outside the call."""
    torch.manual_seed(0)
    module = nn.Linear(4, 4, dtype=D) if layer == "a Linear" else nn.LayerNorm(4, dtype=D)
    first = (lambda x: x * module.weight) if layer == "a LayerNorm's weight" else module
    take = _VIEWS_OF_AN_INPUT[view]

    def fn(w, x):
        return first(x) @ take(w)

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    assert_close(_BELOW_A_VMAP[how](remat(fn, policy=policy), w, xs), _BELOW_A_VMAP[how](fn, w, xs))


@pytest.mark.parametrize("inner", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("outer", [policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
@pytest.mark.parametrize("view", list(_VIEWS_OF_AN_INPUT))
def test_a_view_of_an_input_that_a_nested_calls_matmul_saves_is_not_kept_below_a_vmap(view, how, outer, inner):
    """A call nested in one whose policy keeps its matmuls: the enclosing policy keeps the inner run's
    matmul output, which carries the graph the inner run records below the vmap (the view of the inner
    call's input its node saved) until the enclosing run ends. That view is not kept outside the inner call."""
    take = _VIEWS_OF_AN_INPUT[view]

    def block(w, h):
        return torch.tanh(h @ take(w))

    def two(w, x, b=block):
        return b(w, x @ w).sin()

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    nested = remat(functools.partial(two, b=remat(block, policy=inner)), policy=outer)
    assert_close(_BELOW_A_VMAP[how](nested, w, xs), _BELOW_A_VMAP[how](two, w, xs))


class _Log:
    """An object a function reaches through its closure, holding a list the code around the call appends to."""

    def __init__(self):
        self.entries = []


@pytest.mark.parametrize("loop", [False, True], ids=["a nested call", "a checkpointed loop's step"])
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
@pytest.mark.parametrize("what", ["an integer tensor", "a detached tensor"])
def test_what_carries_no_derivative_appended_to_a_list_a_call_reaches_is_no_rebound_input_below_a_vmap(what, how, loop):
    """The code around a remat'd call (or the step of a checkpointed loop) logs an integer or detached
    tensor into a list that the call's function reaches: its recomputation finds it there, a tensor of
    a live vmap level that was not there at the call. It carries no derivative: no rebound input."""
    log = _Log()

    def record(h):
        log.entries.append(h.argmax(-1) if what == "an integer tensor" else h.detach())

    def block(w, h):
        log  # (reaches the log, as a layer reaches its model)
        return torch.tanh(h @ w)

    def two(w, x, b=block):
        h = b(w, x @ w)
        record(h)
        return h.sin()

    def step(w):
        def f(c, _):
            h = torch.tanh(c @ w)
            record(h)
            return h, None

        return f

    if loop:
        ours = lambda w, x: funckpt.scan(step(w), x, length=2, checkpoints=1)[0]  # noqa: E731
        plain = lambda w, x: step(w)(step(w)(x, None)[0], None)[0]  # noqa: E731
    else:
        ours, plain = remat(functools.partial(two, b=remat(block))), two
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    assert_close(_BELOW_A_VMAP[how](ours, w, xs), _BELOW_A_VMAP[how](plain, w, xs))


_SEVERAL_VIEWS_AT_ONCE = {
    "one of unbind's": lambda h: [h.unbind(0)[1]],
    "all of unbind's": lambda h: list(h.unbind(0)),
    "one of split's, and its base": lambda h: [h.split(1)[1], h],
    "one of chunk's, of a transpose": lambda h: [h.t().chunk(2)[1]],
    "one of unbind's, and a slice": lambda h: [h.unbind(0)[0], h[1]],
}


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("returns", ["h", "h.sin()"])
@pytest.mark.parametrize("kept", list(_SEVERAL_VIEWS_AT_ONCE))
def test_a_kept_view_that_an_operator_returned_with_others_keeps_its_gradient(kept, returns, policy):
    """A view of an intermediate that ``unbind``, ``split`` or ``chunk`` returned with others, kept outside
    the call (``log.append(h.unbind(0)[1])``): autograd cannot make such a view's graph again from its
    base's, so it becomes an output of the call of its own (as the other views of its base), and the
    caller uses it, with create_graph too, as without remat."""
    take = _SEVERAL_VIEWS_AT_ONCE[kept]
    log = []

    def fn(w, x):
        h = x @ w
        log.extend(take(h))
        return h if returns == "h" else h.sin()

    def grads(f, create_graph):
        log.clear()
        w = randn(4, 4, seed=1).requires_grad_()
        out = f(w, randn(2, 4, seed=2))
        loss = out.square().sum() + sum((t * (k + 1)).square().sum() for k, t in enumerate(log))
        (g,) = torch.autograd.grad(loss, w, create_graph=create_graph)
        return torch.autograd.grad(g.square().sum(), w)[0] if create_graph else g

    for create_graph in (False, True):
        assert_close(grads(remat(fn, policy=policy), create_graph), grads(fn, create_graph))


_HOW_DIFFERENTIATED = {
    ".backward()": lambda f, w, x: (lambda w: torch.autograd.grad(f(w, x).sum(), w)[0])(w.clone().requires_grad_()),
    "grad": lambda f, w, x: tf.grad(lambda w: f(w, x).sum())(w),
    "vjp": lambda f, w, x: (lambda out, fn: fn(torch.ones_like(out))[0])(*tf.vjp(lambda w: f(w, x), w)),
    "jacrev": lambda f, w, x: tf.jacrev(lambda w: f(w, x))(w),
}


@pytest.mark.parametrize("how", list(_HOW_DIFFERENTIATED))
def test_a_nested_calls_output_logged_detached_where_it_reaches_it_keeps_its_gradient(how):
    """A call nested in one that keeps everything, whose function reaches a log the enclosing function
    appends the nested call's output to, detached. In the enclosing recomputation the nested call gets
    its output's kept value back, on the memory of the detached alias it now reaches: the output
    shares that constant's memory by chance, and is no view of it (its gradient is that of the matmul)."""
    log = _Log()

    def block(w, h):
        log  # (reaches the log)
        return torch.tanh(h @ w)

    def two(w, x, b=block):
        h = b(w, x)
        log.entries.append(h.detach())
        return h.sin()

    nested = remat(functools.partial(two, b=remat(block)), policy=policies.everything_saveable)
    w, x = randn(4, 4, seed=1), randn(2, 4, seed=2)
    assert_close(_HOW_DIFFERENTIATED[how](nested, w, x), _HOW_DIFFERENTIATED[how](two, w, x))


def _writes_its_cache_through_a_view(how):
    """A preallocated cache (HF's StaticCache) made inside, written through a slice of it: only the
    slice is written with what carries a derivative, the cache kept is its base."""

    def fn(w, x, cache):
        k = torch.tanh(x @ w)
        buf = torch.zeros_like(k).unsqueeze(0).repeat(2, 1, 1)
        if how == "copy_ into an index":
            buf[0].copy_(k)
        elif how == "index_copy_ into a slice":
            buf[:1].index_copy_(0, torch.tensor([0]), k.unsqueeze(0))
        else:  # a view made before the write: the slice kept, the base written
            cache.keys = buf[1:]
            buf.index_copy_(0, torch.tensor([1]), k.unsqueeze(0))
            return k.sin()
        cache.keys = buf
        return k.sin()

    return fn


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
@pytest.mark.parametrize("write", ["copy_ into an index", "index_copy_ into a slice", "a view made before the write"])
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # (torch's: index_copy_ under vmap loops)
def test_a_cache_written_through_a_view_and_kept_raises_below_a_vmap(write, how, policy):
    """Right under ``vmap(grad)`` without a policy, where the forward run has a grad level of its own:
    the cache's attribute gets the call's output standing for the tensor kept there."""
    fn = _writes_its_cache_through_a_view(write)
    f = remat(fn, policy=policy)
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    if how == "vmap(grad)" and policy is None:

        def kept(f):
            def g(w, x):
                cache = _Cache()
                return f(w, x, cache).sum() + cache.keys.square().sum()

            return g

        assert_close(_BELOW_A_VMAP[how](kept(f), w, xs), _BELOW_A_VMAP[how](kept(fn), w, xs))
        return
    with pytest.raises(CheckpointError, match="outlived the call other than as its return value"):
        _BELOW_A_VMAP[how](lambda w, x: f(w, x, _Cache()), w, xs)


@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
def test_a_tensor_the_mode_does_not_see_made_takes_no_derivative_from_a_dead_ones_id_below_a_vmap(how):
    """``torch.from_numpy`` makes a tensor without passing through the substitution mode: it may
    take the id of a dead tensor that carried a derivative, and a constant made from it and kept
    (a running log) carries none."""
    np = pytest.importorskip("numpy")
    log = []

    def fn(w, x):
        h = x @ w
        for i in range(50):
            t = torch.tanh(h) * i
            del t
            log.append(torch.from_numpy(np.full(4, float(i))) * 2)
        return h.sin()

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    assert_close(_BELOW_A_VMAP[how](remat(fn, policy=policies.dots_saveable), w, xs), _BELOW_A_VMAP[how](fn, w, xs))


def test_a_forward_hooks_output_carrying_a_tangent_raises_where_a_parameter_requires_grad():
    """``functional_call`` with the weight jvp differentiates, on a module whose own parameter requires
    grad: the run goes at a grad level of its own (for that parameter), whose graph does not show the
    tangent the hook's kept output carries."""
    lin = nn.Linear(4, 4, bias=False).to(D)
    kept = _Cache()
    lin.register_forward_hook(lambda m, i, o: setattr(kept, "keys", o))
    f = remat(lambda w, x: tf.functional_call(lin, {"weight": w}, (x,)).tanh())
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    with pytest.raises(CheckpointError, match="outlived the call other than as its return value"):
        _BELOW_A_VMAP["vmap(jvp)"](f, w, xs)


class _Node:
    pass


@pytest.mark.parametrize("policy", [None, policies.dots_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
def test_a_tensor_held_only_by_a_garbage_reference_cycle_is_not_kept_below_a_vmap(how, policy):
    """The collection before the escape check is given up on must not run while the check's own
    list holds what it found alive."""
    import gc

    def fn(w, x):
        h = torch.tanh(x @ w)
        n = _Node()
        n.me, n.t = n, h * 2  # garbage once the call returns
        return h.sin()

    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    enabled = gc.isenabled()
    gc.disable()  # (no collection between the call's return and the check)
    try:
        got = _BELOW_A_VMAP[how](remat(fn, policy=policy), w, xs)
    finally:
        if enabled:
            gc.enable()
    assert_close(got, _BELOW_A_VMAP[how](fn, w, xs))


class _Kept:
    """What a forward hook on a layer records: its output (as transformers 5 does for
    ``output_hidden_states``)."""

    value: torch.Tensor | None = None


def _keeps_what_it_returns(returns):
    def loss(wrap):
        def g(w, x):
            kept = _Kept()

            def layer(w, x):
                h = torch.tanh(x @ w)
                kept.value = h
                return h if returns == "it" else h[0]

            y = wrap(layer)(w, x)
            return y.sin().sum() + kept.value.pow(2).sum()

        return g

    return loss


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
@pytest.mark.parametrize("returns", ["it", "a view of it"])
def test_a_tensor_both_returned_and_kept_below_a_vmap(returns, how, policy):
    """Under a grad or jvp level the caller gets each output as another tensor (that level's
    wrapper): the one the function kept carries no derivative there, and is refused. Below a vmap
    that ``.backward()`` differentiates, the output is the caller's tensor itself, and right (with
    or without a policy: the forward run has no grad level of its own where the caller's innermost
    transform is a vmap); the base of a returned view is not, and is refused."""
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    loss = _keeps_what_it_returns(returns)
    ours = loss(lambda f: remat(f, policy=policy))
    if how == "vmap, then backward" and returns == "it":
        assert_close(_BELOW_A_VMAP[how](ours, w, xs), _BELOW_A_VMAP[how](loss(lambda f: f), w, xs))
        return
    with pytest.raises(CheckpointError, match="outlived the call other than as its return value"):
        _BELOW_A_VMAP[how](ours, w, xs)


def test_a_tensor_both_returned_and_kept_under_vmap_of_grad_is_refused_saying_to_keep_the_output():
    """Under ``vmap(grad)`` a tensor the function both returns and keeps is refused; the error says
    so (it told the user to return the tensor, which the function does) and what to do: keep the
    remat'd call's output, which gives the derivative without remat."""
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)
    with pytest.raises(CheckpointError, match=r"(?s)the function returns it and also keeps it.*Keep the remat'd call's output"):
        _BELOW_A_VMAP["vmap(grad)"](_keeps_what_it_returns("it")(remat), w, xs)

    def keeps_the_output(wrap):
        def g(w, x):
            kept = _Kept()
            kept.value = wrap(lambda w, x: torch.tanh(x @ w))(w, x)
            return kept.value.sin().sum() + kept.value.pow(2).sum()

        return g

    reference = _BELOW_A_VMAP["vmap(grad)"](_keeps_what_it_returns("it")(lambda f: f), w, xs)
    assert_close(_BELOW_A_VMAP["vmap(grad)"](keeps_the_output(remat), w, xs), reference)


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable], ids=str)
@pytest.mark.parametrize("how", list(_BELOW_A_VMAP))
def test_a_view_of_an_input_both_returned_and_kept_below_a_vmap(how, policy):
    """A returned view of an input that the function keeps as well (a layer recording a slice of
    its weight): under a grad level with a policy the caller gets another tensor, and the kept one
    carries no derivative (it was excused as an output). Refused as the returned-and-kept tensor
    the run made; below a vmap that ``.backward()`` differentiates it is right (with or without a
    policy)."""
    w, xs = randn(4, 4, seed=1), randn(3, 2, 4, seed=2)

    def loss(wrap):
        def g(w, x):
            kept = _Kept()

            def layer(w, x):
                kept.value = w[0]
                return kept.value, torch.tanh(x @ w)

            v, h = wrap(layer)(w, x)
            return (v * x).sum() + h.sum() + kept.value.pow(2).sum()

        return g

    ours = loss(lambda f: remat(f, policy=policy))
    if how == "vmap, then backward":
        assert_close(_BELOW_A_VMAP[how](ours, w, xs), _BELOW_A_VMAP[how](loss(lambda f: f), w, xs))
        return
    with pytest.raises(CheckpointError, match="outlived the call other than as its return value"):
        _BELOW_A_VMAP[how](ours, w, xs)


def test_a_view_of_an_input_kept_outside_the_call_raises():
    kept = []

    def fn(x):
        kept.append(x[0])
        return x.sin()

    with pytest.raises(CheckpointError, match="a view of one of the function's inputs"):
        remat(fn)(randn(3, 2, seed=1).requires_grad_())


def test_what_a_kept_tensors_graph_saved_is_no_error_even_a_view_of_an_input():
    """``x @ w.t()`` saves ``w.t()``, a view of remat's copy of ``w``: alive at the end of the forward
    run only through the kept tensor's graph, which goes once the kept tensor is an output."""
    kept = []

    def fn(x, w):
        h = x @ w.t()
        kept.append(h.sin())
        return h.cos()

    x, w = randn(3, 4, seed=1).requires_grad_(), randn(5, 4, seed=2).requires_grad_()

    def loss(f):
        kept.clear()
        return f(x, w).sum() + kept[0].square().sum()

    assert_close(_grads_of(lambda: loss(remat(fn)), x, w), _grads_of(lambda: loss(fn), x, w))


@pytest.mark.parametrize("view", ["slice", "transpose"])
def test_what_a_kept_views_graph_saved_is_no_error_even_a_view_of_an_input(view):
    """The same where the kept tensor is a view of an intermediate (transformers' recorder keeps
    ``attn_weights``, a slice of the softmax in DeepseekV4), whose graph saved a 0-d piece of an
    input (``w.unbind(0)``): the view is made again from the output's graph once the call ends."""
    kept = []

    def fn(x, w):
        a, b = w.unbind(0)
        p = torch.softmax(x * a, -1)
        kept.append(p[..., :-1] if view == "slice" else p.t())
        return p * b

    x, w = randn(3, 4, seed=1).requires_grad_(), randn(2, seed=2).requires_grad_()

    def loss(f):
        kept.clear()
        return f(x, w).sum() + kept[0].square().sum()

    assert_close(_grads_of(lambda: loss(remat(fn)), x, w), _grads_of(lambda: loss(fn), x, w))


def test_a_leaf_made_inside_that_only_a_kept_tensors_graph_holds_is_no_error():
    """HF T5 sets ``position_bias.requires_grad = True`` on a tensor it makes in the layer; with
    ``output_attentions`` the kept attention weights' graph holds it, and nothing else does."""
    kept = []

    def fn(x):
        b = torch.zeros(3, dtype=x.dtype)
        b.requires_grad = True
        a = x.sin() + b
        kept.append(a * 2)
        return a.cos()

    x = randn(3, seed=1).requires_grad_()

    def loss(f):
        kept.clear()
        return f(x).sum() + kept[0].sum()

    assert_close(_grads_of(lambda: loss(remat(fn)), x), _grads_of(lambda: loss(fn), x))


def test_a_kept_tensor_the_recomputation_computes_otherwise_raises():
    kept, calls = [], []

    def fn(x):
        calls.append(1)
        h = x.sin()
        kept.append(h * len(calls))  # another value in the recomputation
        return h.cos()

    x = randn(3, seed=1).requires_grad_()
    out = remat(fn)(x)
    with pytest.raises(CheckpointError, match="other values"):
        (out.sum() + kept[0].sum()).backward()


def test_a_leaf_created_in_the_function_and_kept_outside_raises():
    """Without remat its .grad gets what flows into it through the call; remat differentiates
    the call in its recomputation, where a new leaf stands in for it."""
    kept = []

    def fn(x):
        p = torch.ones_like(x).requires_grad_()
        kept.append(p)
        return x.sin() * p

    with pytest.raises(CheckpointError, match="created to require grad itself"):
        remat(fn)(randn(3, seed=1).requires_grad_())


def test_a_recomputation_that_does_not_compute_the_kept_tensor_again_raises():
    kept, calls = [], []

    def fn(x):
        calls.append(1)
        h = x.sin()
        out = h.cos()
        if len(calls) == 1:  # the forward run only
            kept.append(h.exp())
        return out

    x = randn(3, seed=1).requires_grad_()
    out = remat(fn)(x)
    with pytest.raises(CheckpointError, match="did not compute again a tensor"):
        (out.sum() + kept[0].sum()).backward()


def test_reading_the_metadata_of_a_tensor_remat_cannot_route_is_no_error():
    """A tensor that requires grad and that remat cannot route is refused where an operator
    uses its values; reading its shape, dtype or whether it requires grad passes no gradient."""
    hidden = {"t": randn(2, 3, seed=2).requires_grad_()}
    get = hidden.get

    def fn(x):
        t = get("t")  # reached through a bound method of a dict: not walked
        return x.sin() * t.shape[0] + float(t.requires_grad) + x.new_zeros(t.shape[1:]).sum()

    x = randn(3, seed=1).requires_grad_()
    assert_close(_grads_of(lambda: remat(fn)(x).sum(), x), _grads_of(lambda: fn(x).sum(), x))


# ---------------------------------------------------------------------------------------------
# Writes into the containers a function is passed: remat passes copies, and carries the writes back.
# ---------------------------------------------------------------------------------------------


class AppendList(nn.Sequential):
    """timm VoVNet's ``SequentialAppendList``: each layer's output goes into the caller's list."""

    def forward(self, x, concat_list):
        for i, module in enumerate(self):
            concat_list.append(module(x if i == 0 else concat_list[-1]))
        return torch.cat(concat_list, dim=1)


@pytest.mark.parametrize("how", ["remat", "checkpoint"])
def test_a_layer_appending_to_a_list_it_is_passed_runs_as_without_remat(how):
    torch.manual_seed(0)
    layer = AppendList(nn.Conv2d(4, 4, 3, padding=1, dtype=D), nn.Conv2d(4, 4, 3, padding=1, dtype=D))
    x = randn(1, 4, 5, 5, seed=1).requires_grad_()
    wrapped = remat(layer) if how == "remat" else functools.partial(checkpoint, layer, use_reentrant=False)

    def step(call):
        concat = [x]
        out = call(x, concat)
        # (the caller reads what the layer appended too: their gradients flow as without remat)
        loss = out.pow(2).sum() + concat[-1].sin().sum()
        return loss, concat, torch.autograd.grad(loss, [x, *layer.parameters()])

    loss, concat, grads = step(layer)
    loss_r, concat_r, grads_r = step(wrapped)
    assert_close(loss_r, loss)
    assert_close(grads_r, grads)
    assert len(concat_r) == len(concat) == 3
    assert concat_r[0] is x  # the caller's own tensor, not remat's copy of it
    assert_close(concat_r[1:], concat[1:])


def test_writes_into_a_dict_argument_are_carried_back():
    def fn(x, aux):
        aux["calls"] = aux.get("calls", 0) + 1
        aux["sin"] = x.sin()
        del aux["old"]
        return x.cos()

    x = randn(3, seed=1).requires_grad_()
    aux, aux_r = {"old": 0}, {"old": 0}
    loss = lambda f, aux: (f(x, aux).sum() + aux["sin"].pow(2).sum())  # noqa: E731
    assert_close(_grads_of(lambda: loss(remat(fn), aux_r), x), _grads_of(lambda: loss(fn, aux), x))
    assert list(aux_r) == list(aux) == ["calls", "sin"] and aux_r["calls"] == 1  # not 2: the recomputation's copy is its own


def test_writes_into_containers_inside_other_arguments_are_carried_back():
    """A list inside a tuple, a dict inside a list: written, each is the caller's as without remat."""

    def fn(x, pair, nested):
        pair[0].append(x.sin())
        nested[0]["k"] = x * 2
        nested.append(pair[1])
        return x.cos()

    x = randn(3, seed=1).requires_grad_()

    def run(f):
        pair, nested = ([], {"a": 1}), [{}]
        out = f(x, pair, nested)
        loss = out.sum() + pair[0][0].pow(2).sum() + nested[0]["k"].pow(3).sum()
        return pair, nested, _grads_of(lambda: loss, x)

    pair, nested, grads = run(fn)
    pair_r, nested_r, grads_r = run(remat(fn))
    assert_close(grads_r, grads)
    assert nested_r[1] is pair_r[1]  # the caller's dict, not remat's copy of it
    assert len(pair_r[0]) == 1 and list(nested_r[0]) == ["k"]


class AppendAndReturn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=D)

    def forward(self, hs):
        hs.append(torch.tanh(self.lin(hs[-1])))
        return hs


@pytest.mark.parametrize("how", ["remat", "checkpoint_sequential"])
def test_a_list_the_function_writes_and_returns_is_the_callers_own(how):
    """``hs.append(h); return hs``: without remat the result is the caller's list, with every
    layer's write. The copy the function got, returned, is the caller's list, written back."""
    torch.manual_seed(0)
    layers = nn.Sequential(AppendAndReturn(), AppendAndReturn(), AppendAndReturn())
    x = randn(2, 3, seed=1).requires_grad_()
    call = {
        "remat": remat(layers[0]),
        "checkpoint_sequential": lambda hs: checkpoint_sequential(layers, 2, hs, use_reentrant=False),
    }[how]

    def run(f):
        hs = [x]
        out = f(hs)
        loss = sum(h.pow(2).sum() for h in out)
        return out is hs, len(hs), torch.autograd.grad(loss, [x, *layers.parameters()], allow_unused=True)

    plain = {"remat": layers[0], "checkpoint_sequential": layers}[how]
    same, n, grads = run(plain)
    same_r, n_r, grads_r = run(call)
    assert same and same_r and n_r == n
    assert_close(grads_r, grads)


def test_a_list_inside_a_tuple_argument_gets_its_write():
    """No longer silently lost (only the arguments' outermost containers used to be watched)."""
    kept: list = []
    x = randn(3, seed=1).requires_grad_()
    out = remat(lambda x, t: (t[0].append(x.sin()), x.cos())[1])(x, (kept,))
    assert len(kept) == 1
    assert_close(_grads_of(lambda: out.sum() + kept[0].sum(), x), _grads_of(lambda: (x.cos() + x.sin()).sum(), x))


def test_a_container_passed_as_a_static_argument_is_the_callers_own():
    """Passed as it is (not copied), it is written by each run, as a list the function closes
    over is (the README's side effects), and as under torch.utils.checkpoint."""

    def fn(x, log):
        log.append(x.shape[0])
        return x.sin()

    log: list = []
    x = randn(3, seed=1).requires_grad_()
    remat(fn, static_argnums=(1,))(x, log).sum().backward()
    assert log == [3, 3]  # the forward run's write, then the recomputation's


def _writing(fn):
    """``fn(x, kept)`` called with a fresh list, which the loss then reads, as a caller would."""

    def run(x):
        kept: list = []
        out = fn(x, kept)
        return out + sum(k.sin().sum() * k.sum() for k in kept if isinstance(k, torch.Tensor))

    return run


@pytest.mark.parametrize("how", ALL)
def test_under_a_transform_a_computed_tensor_written_into_an_argument_gets_its_derivative(how):
    """Under a torch.func transform the function's tensors are not the caller's (the call's outputs
    are other tensors, of the caller's level): the caller's list gets the call's own output in
    place of the one the function appended, and its derivative flows as without remat."""

    def fn(x, kept):
        h = x.sin()
        kept.append(h * h.cos())
        return h.exp()

    x = randn(3, seed=1)
    assert_close(derivative(how, _writing(remat(fn)), x), derivative(how, _writing(fn), x))


@pytest.mark.parametrize("nested", ["remat", "scan", "fori_loop"])
def test_a_write_into_an_argument_beside_a_nested_call_or_loop_is_refused_naming_both(nested):
    """Under a transform, a tensor the function computed and wrote into a list it was passed becomes an
    output of the call, except where a remat'd call or a checkpointed loop is nested in the function:
    the refusal says so (not a forward hook or a key/value cache), and returning the tensor instead,
    as it says, gives the derivative without remat."""

    def inner(h):
        return h.sin() * 2

    def fn(x, kept, write):
        if nested == "remat":
            h = remat(inner)(x)
        elif nested == "scan":
            h = funckpt.scan(lambda c, _: (inner(c), None), x, None, length=2)[0]
        else:
            h = funckpt.fori_loop(0, 2, lambda i, c: inner(c), x)
        if write:
            kept.append(h * 1.5)
            return h.exp()
        return h.exp(), h * 1.5

    def written(f):
        def loss(x):
            kept: list = []
            return f(x, kept, True).sum() * kept[0].sum()

        return loss

    def returned(f):
        def loss(x):
            out, k = f(x, [], False)
            return out.sum() * k.sum()

        return loss

    x = randn(3, seed=1)
    with pytest.raises(CheckpointError, match=r"wrote into a list, dict or deque it was passed with a remat'd call or a checkpointed loop") as e:
        tf.grad(written(remat(fn)))(x)
    assert "key/value cache" not in str(e.value)
    assert_close(tf.grad(returned(remat(fn)))(x), tf.grad(written(fn))(x))


class _Entries(dict):
    """A dict subclass optree does not know: a leaf to it, passed to the function as it is."""


def test_under_a_transform_a_tensor_written_into_an_unknown_dict_subclass_gets_its_derivative():
    """remat carries writes back into the containers optree flattens; a dict subclass it does not is
    passed as it is, and what the function stores there under a transform gets, in its place, the
    call's output standing for it (written by dict's own ``__setitem__``), as in a dict held outside
    the call: the derivative is the one without remat, as under plain autograd (it was refused)."""

    def fn(x, entries):
        entries["h"] = x.sin()
        return x.exp()

    def run(f, kind):
        def loss(x):
            entries = kind()
            return f(x, entries).sum() * entries["h"].sum()

        return loss

    x = randn(3, seed=1)
    assert_close(tf.grad(run(remat(fn), _Entries))(x), tf.grad(run(fn, _Entries))(x))
    assert_close(tf.grad(run(remat(fn), dict))(x), tf.grad(run(fn, _Entries))(x))
    assert_close(derivative("backward", run(remat(fn), _Entries), x), derivative("backward", run(fn, _Entries), x))


@pytest.mark.parametrize("how", ["grad", "vmap_grad", "backward"])
def test_a_tensor_written_into_a_long_log_the_caller_passes_gets_its_derivative(how):
    """The list already holds more tensors than remat's walk for written tensors looks at (a log of
    every earlier step's): only the entries the run added are looked at. The written tensor was
    missed behind the caller's own and refused as kept outside the call, on a correct program."""

    def fn(x, log):
        log.append((x * 2).sin())
        return x.cos()

    def run(f):
        def loss(x):
            log = [torch.zeros(1, dtype=D)] * 10_001
            out = f(x, log)
            return out * log[-1]

        return loss

    x = randn(3, seed=1)
    assert_close(derivative(how, run(remat(fn)), x), derivative(how, run(fn), x))


@pytest.mark.parametrize("how", ALL)
def test_under_a_transform_written_views_dicts_and_nested_entries_get_their_derivatives(how):
    """A view of an intermediate, a tensor inside a tuple, a dict's entry, a number next to them;
    and a tensor both written and returned, which the caller gets as one tensor, as without remat."""

    def fn(x, kept, aux):
        h = x.sin()
        kept.append((h.cos(), h[1:]))
        kept.append(3)
        aux["h"] = h
        return h

    def run(f):
        def loss(x):
            kept, aux = [], {}
            out = f(x, kept, aux)
            assert aux["h"] is out
            return out * kept[0][0] + kept[0][1].sum() * kept[1] + aux["h"].exp()

        return loss

    x = randn(3, seed=1)
    assert_close(derivative(how, run(remat(fn)), x), derivative(how, run(fn), x))


@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "jacrev", "jvp", "jacfwd"])
@pytest.mark.parametrize("written", ["intermediate", "view of an input"])
def test_a_tensor_written_and_returned_beside_views_of_it_is_the_returned_one(how, written):
    """Outputs that view one another (``return h, h[1:]``) are rebuilt outside the call; a tensor the
    function also wrote into a list it was passed is then the caller's rebuilt output itself, as
    without remat, so an update in place through the list reaches the other outputs' gradients.
    It was a separate output over the same memory: the gradients (or, for a view of an input, the
    tangents) silently missed the write."""

    def fn(x, kept):
        h = x.sin() if written == "intermediate" else x[1:]
        kept.append(h)
        return h, h[1:]

    def run(f):
        def loss(x):
            x = x * 1
            kept = []
            h, tail = f(x, kept)
            identical = kept[0] is h
            kept[0].mul_(2)
            return (h.sin().sum() + tail.exp().sum() + x.sum()) * (1 if identical else float("nan"))

        return loss

    x = randn(4, seed=1)
    assert_close(derivative(how, run(remat(fn)), x), derivative(how, run(fn), x))


@pytest.mark.parametrize("how", ["grad", "jacrev"])
def test_a_written_view_of_a_returned_tensor_updated_in_place_raises(how):
    """``kept.append(h[1:]); return h``: the list's tensor is an output of its own over ``h``'s
    memory; the caller updating it in place would change ``h``'s values but not its gradient. The
    backward pass raises, as for outputs of one tensor under vmap (it gave a wrong gradient)."""

    def fn(x, kept):
        h = x.sin()
        kept.append(h[1:])
        return h

    def run(f, update):
        def loss(x):
            kept = []
            h = f(x, kept)
            if update:
                kept[0].mul_(2)
            return h.sin().sum() + kept[0].exp().sum()

        return loss

    x = randn(4, seed=1)
    assert_close(derivative(how, run(remat(fn), False), x), derivative(how, run(fn, False), x))
    with pytest.raises(CheckpointError, match="wrote in place into an output that shares memory"):
        derivative(how, run(remat(fn), True), x)


@pytest.mark.parametrize("how", ALL)
def test_a_view_of_an_input_written_into_an_argument_gets_its_derivative(how):
    """``outs.append(x.t())``: the function's view is of remat's stand-in for the input, which has
    no graph in the caller's autograd (kept in a global, it raises); written into a list the caller
    passed, the caller's list gets the call's own output in its place, under plain autograd too."""

    def fn(x, kept):
        kept.append(x[1:])
        kept.append(x.unsqueeze(0).t())
        return x.sin()

    x = randn(3, seed=1)
    assert_close(derivative(how, _writing(remat(fn)), x), derivative(how, _writing(fn), x))


@pytest.mark.parametrize("how", ["grad", "vmap_grad", "jacrev"])
def test_under_a_transform_a_layer_appending_to_a_list_it_is_passed_runs_as_without_remat(how):
    """timm VoVNet's ``SequentialAppendList``, remat'd alone, under ``functional_call``."""
    torch.manual_seed(0)
    layer = AppendList(nn.Conv2d(4, 4, 3, padding=1, dtype=D), nn.Conv2d(4, 4, 3, padding=1, dtype=D))
    wrapped = remat(layer)
    x = randn(1, 4, 5, 5, seed=1)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def run(module):
        def loss(p, x):
            concat = [x]
            out = tf.functional_call(module, p, (x, concat))
            return out.pow(2).sum() + concat[-1].sin().sum()

        return loss

    def derive(loss):
        if how == "grad":
            return tf.grad(loss, argnums=(0, 1))(params, x)
        if how == "vmap_grad":
            return tf.vmap(tf.grad(loss), in_dims=(None, 0))(params, torch.cat([x, x.cos()]).unsqueeze(1))
        return tf.jacrev(loss, argnums=1)(params, x)

    assert_close(derive(run(wrapped)), derive(run(layer)))


@pytest.mark.parametrize("how", ["grad", "jacrev"])
def test_under_a_transform_a_tensor_written_into_an_argument_after_a_nested_remat_raises(how):
    """Where remat'd calls nested in the function come before (a recomputation below a vmap runs
    them otherwise, and could not find the written tensor again where the forward run made it),
    the write is refused as before, with the error that says to return the tensor."""
    inner = remat(lambda x: x.sin())

    def fn(x, kept):
        h = inner(x)
        kept.append(h.cos())
        return h

    x = randn(3, seed=1)
    with pytest.raises(CheckpointError, match="outlived the call"):
        derivative(how, _writing(remat(fn)), x)

    def detaching(x, kept):  # (what carries no derivative may be kept, as in any other place)
        h = inner(x)
        kept.append(h.cos().detach())
        return h

    assert_close(derivative(how, _writing(remat(detaching)), x), derivative(how, _writing(detaching), x))


def test_under_a_transform_other_writes_into_an_argument_are_carried_back():
    """What carries no derivative (a number, a detached tensor) may be kept, as in any other place."""
    seen: dict = {}

    def fn(x, aux):
        aux["steps"] = 1
        aux["norm"] = x.detach().norm()
        return x.sin()

    x = randn(3, seed=1)
    assert_close(tf.grad(lambda x: remat(fn)(x, seen).sum())(x), tf.grad(lambda x: fn(x, {}).sum())(x))
    assert seen["steps"] == 1 and list(seen) == ["steps", "norm"]


def test_a_list_passed_twice_and_written_raises():
    shared: list = []
    x = randn(3, seed=1).requires_grad_()
    with pytest.raises(CheckpointError, match="passed twice"):
        remat(lambda x, a, b: (a.append(1), b.append(2), x.sin())[2])(x, shared, shared)
    assert shared == []


@pytest.mark.parametrize("where", ["two_arguments", "inside_one"])
def test_a_list_passed_twice_written_once_and_read_through_the_other_raises(where):
    """Without remat both are the one list: the write shows through the other. remat passes each
    place its own copy, so the function would read a list it had not written (a wrong value)."""

    def fn(x, a, b):
        a.append(x.sin())
        return x * len(b)

    x = randn(3, seed=1).requires_grad_()
    shared: list = []
    assert_close(fn(x, shared, shared), x * 1)  # (without remat)
    shared = []
    call = remat(fn) if where == "two_arguments" else remat(lambda x, p: fn(x, *p))
    with pytest.raises(CheckpointError, match="passed twice"):
        call(x, shared, shared) if where == "two_arguments" else call(x, (shared, shared))
    assert shared == []


def test_a_list_written_as_the_argument_and_through_a_closure_raises():
    """The closure writes the caller's list itself, the argument remat's copy: carried back, the
    copy's entries would overwrite the closure's (without remat the list holds both writes)."""
    log: list = []

    def fn(x, kept):
        kept.append(x.sin())
        log.append("step")
        return x.cos()

    x = randn(3, seed=1).requires_grad_()
    fn(x, log)
    assert len(log) == 2  # (without remat)
    log = []
    with pytest.raises(CheckpointError, match="reaches or wrote the caller.s own as well"):
        remat(fn)(x, log)
    assert log == ["step"]  # (the closure's own write: the function ran)


def test_a_list_written_as_the_argument_and_read_through_a_closure_raises():
    """The function appends to its argument and reads the caller's list through its closure:
    without remat the read sees the append; with remat's copy it would see the list as it was
    (``x * 0`` for ``x * 1``)."""
    box: list = []

    def fn(x, kept):
        kept.append(1)
        return x * len(box)

    x = randn(3, seed=1).requires_grad_()
    assert_close(fn(x, box), x * 1)  # (without remat)
    box.clear()
    with pytest.raises(CheckpointError, match="reaches or wrote the caller.s own as well"):
        remat(fn)(x, box)
    assert box == []


#: A global list whose name is also an attribute name in the function below: not a global it reads.
appended: list = []


def test_a_list_written_as_the_argument_that_is_a_global_named_only_as_an_attribute_runs():
    """``holder.appended`` loads an attribute, not the global ``appended`` (which the caller passes):
    no closure or global read of the caller's list, so the write is carried back (a false error
    where the code's attribute names were taken for globals)."""
    holder = type("Holder", (), {"appended": 2})()

    def fn(x, kept):
        kept.append(x.sin())
        return x.cos() * holder.appended

    x = randn(3, seed=1).requires_grad_()
    appended.clear()
    out = remat(fn)(x, appended)
    assert len(appended) == 1
    grads = _grads_of(lambda: out.sum() + appended[0].sum(), x)
    assert_close(grads, _grads_of(lambda: (x.cos() * 2 + x.sin()).sum(), x))
    appended.clear()


def test_an_input_written_inside_a_new_container_is_the_callers_own():
    """``kept.append([x, x.sin()])``, ``aux["p"] = (x, w)``: the input (or the parameter reached
    through the closure) inside the written structure is the caller's tensor, as without remat,
    and its gradient flows (remat's stand-in for it, carried back, had none: silently missing)."""
    lin = nn.Linear(3, 3, dtype=D)

    def fn(x, kept, aux):
        kept.append([x, x.sin()])
        aux["p"] = (x, lin.weight)
        return lin(x).cos()

    x = randn(3, seed=1).requires_grad_()

    def run(f):
        kept, aux = [], {}
        out = f(x, kept, aux)
        assert kept[0][0] is x and aux["p"][0] is x and aux["p"][1] is lin.weight
        loss = out.sum() + kept[0][0].pow(3).sum() + kept[0][1].exp().sum() + aux["p"][0].sum() + aux["p"][1].pow(2).sum()
        return torch.autograd.grad(loss, [x, lin.weight])

    assert_close(run(remat(fn)), run(fn))


def test_an_input_inside_an_object_written_into_an_argument_raises():
    """``kept.append(SimpleNamespace(t=x))``: the object (which remat does not rebuild) holds remat's
    stand-in for ``x``, whose gradient would be silently missing; as an input stored anywhere else
    the function reaches, it raises (without remat, the gradient flows through ``kept[0].t``)."""
    from types import SimpleNamespace

    def fn(x, kept):
        kept.append(SimpleNamespace(t=x))
        return x.cos()

    x = randn(3, seed=1).requires_grad_()
    kept: list = []
    out = fn(x, kept)
    assert_close(_grads_of(lambda: out.sum() + kept[0].t.pow(2).sum(), x), _grads_of(lambda: (x.cos() + x.pow(2)).sum(), x))
    kept = []
    with pytest.raises(CheckpointError, match="stored one of its inputs"):
        remat(fn)(x, kept)
    assert kept == []


def test_a_failed_call_leaves_the_callers_container_as_it_was():
    """A leaf the function makes and stores raises once the call knows the caller holds it (its
    .grad would miss what flows into it through the call): the writes go too."""

    def fn(x, kept):
        kept.append(torch.zeros(3, dtype=D, requires_grad=True))
        kept.append(1)
        return x.sin()

    kept = ["before"]
    x = randn(3, seed=1).requires_grad_()
    with pytest.raises(CheckpointError, match="created to require grad itself"):
        remat(fn)(x.clone(), kept)
    assert kept == ["before"]


def test_an_op_returning_its_input_is_not_an_escape():
    """x.to(x.dtype), x.contiguous(), eval-mode dropout return the input itself."""

    def fn(x):
        return x.to(x.dtype).contiguous().sin() * 2

    x = randn(3, 4, seed=1)
    assert_close(derivative("backward", remat(fn), x), derivative("backward", fn, x))


def test_an_argument_computed_inside_a_transform_from_a_tensor_that_requires_grad_is_no_false_alarm():
    # xs * 1 made inside torch.func.grad from a plain tensor that requires grad: a constant at
    # grad's level, but it requires grad one level lower, where remat's forward run records.
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(4, dtype=torch.float64)

    def f(c, x):
        return torch.tanh(c @ w + x)

    for transform in (torch.func.grad, torch.func.jacrev):
        got = transform(lambda c: remat(f)(c, xs[0] * 1).sum())(c0)
        want = transform(lambda c: f(c, xs[0] * 1).sum())(c0)
        torch.testing.assert_close(got, want)


def test_plain_forward_mode_dual_that_does_not_require_grad_through_a_create_graph_backward():
    # The dual input is saved as itself (an alias would drop its tangent) and stays a dual in the
    # recomputation, so the gradient's tangent equals the one without remat.
    import torch.autograd.forward_ad as fwAD

    w0 = torch.randn(3, 3, dtype=torch.float64)
    c0 = torch.randn(3, dtype=torch.float64)

    def run(wrap):
        w = w0.clone().requires_grad_()
        with fwAD.dual_level():
            c = fwAD.make_dual(c0, torch.ones_like(c0))
            out = wrap(lambda c: torch.tanh(c @ w))(c)
            (g,) = torch.autograd.grad(out.pow(2).sum(), w, create_graph=True)
            primal, tangent = fwAD.unpack_dual(g)
            return primal.detach().clone(), tangent.detach().clone()

    torch.testing.assert_close(run(remat), run(lambda f: f))


def test_forward_mode_vectorized_jacobian_of_inputs_requiring_grad():
    """torch.autograd.functional.jacobian(strategy="forward-mode", vectorize=True): plain forward-mode
    AD under autograd's legacy vmap, with inputs that require grad (pre-existing: a raw
    "Batching rule not implemented for aten::_unpack_dual" from _jvp_here, also at 7266062)."""
    x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def f(x):
        return x.sin() * x

    expected = torch.autograd.functional.jacobian(f, x, vectorize=True, strategy="forward-mode")
    got = torch.autograd.functional.jacobian(remat(f), x, vectorize=True, strategy="forward-mode")
    assert_close(got, expected)


def test_forward_over_reverse_vectorized_hessian_through_nested_remat():
    """torch.autograd.functional.hessian(vectorize=True, outer_jacobian_strategy="forward-mode"):
    the outer remat'd call's recomputation runs outside autograd's legacy vmap, where the inner
    call's tangents are still legacy-batched (was a raw "Batching rule not implemented for
    aten::_unpack_dual" wrapped in a CheckpointError)."""
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(x):
        return torch.tanh(lin(x)) * x

    def nested(x):
        return remat(lambda y: remat(lambda z: f(z) * 1.5)(y) / 1.5)(x)

    def hessian(g):
        return torch.autograd.functional.hessian(lambda x: g(x).pow(2).sum(), x, vectorize=True, outer_jacobian_strategy="forward-mode")

    assert_close(hessian(nested), hessian(f))
    assert_close(hessian(remat(f)), hessian(f))


# ---------------------------------------------------------------------------------------------
# Hooks inside a remat'd call whose backward is differentiated again: they run as often, and see
# the same gradients, as without remat.
# ---------------------------------------------------------------------------------------------


def _unwrapped(g):
    """``g``'s value under its torch.func wrappers (a hook may see them at another level than
    without remat, a grad level of remat's own, with the same value)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(g):
        g = torch._C._functorch.get_unwrapped(g)
    return g.detach().clone()


@pytest.mark.parametrize("on", ["intermediate", "node", "nested_input"])
@pytest.mark.parametrize("how", ["create_graph_then_backward", "grad_of_grad", "jacrev_of_grad", "vjp_of_grad"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("reads_a_parameter", [False, True])
def test_a_hook_in_a_backward_that_is_differentiated_again_runs_once(on, how, nested, reads_a_parameter):
    """A hook the function registers on a tensor of its recomputed graph (an intermediate, its node,
    or the input of a remat'd call nested in it) runs in the first backward pass, and, where that
    pass records a graph (``create_graph=True``, ``grad(grad(f))``), is not run again when that graph
    is differentiated: remat kept the recomputed backward as a remat'd call of its own and recomputed
    it for the second pass, and every hook in it ran once more (a logging hook counted two calls
    where the function without remat makes one). Now a backward that records a graph through hooks
    keeps its recomputation, as without remat."""
    seen = []
    lin = nn.Linear(3, 3).double()

    def hook(g):
        seen.append(_unwrapped(g))
        return g * 3

    def node_hook(grad_outputs):
        seen.append(_unwrapped(grad_outputs[0]))
        return (grad_outputs[0] * 3,)

    def inner(y):
        if y.requires_grad:
            y.register_hook(hook)
        return (lin(y) if reads_a_parameter else y * 1.5).sin() * y

    def fn(x, inner_call):
        if on == "nested_input":
            return inner_call(x.cos() * 2).cos()
        h = (lin(x) if reads_a_parameter else x * 2).sin()
        if h.requires_grad:
            if on == "intermediate":
                h.register_hook(hook)
            else:
                h.grad_fn.register_prehook(node_hook)
        return (h * x).cos()

    def run(f):
        seen.clear()
        x = randn(3, seed=1)
        if how == "create_graph_then_backward":
            x.requires_grad_()
            (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad(g.square().sum(), x)
            out = (g.detach(), gg)
        elif how == "grad_of_grad":
            out = tf.grad(lambda x: tf.grad(lambda x: f(x).sum())(x).sin().sum())(x)
        elif how == "jacrev_of_grad":
            out = tf.jacrev(tf.grad(lambda x: f(x).sum()))(x)
        else:
            out, vjp_fn = tf.vjp(tf.grad(lambda x: f(x).sum()), x)
            out = (out, vjp_fn(tangent_like(out))[0])
        return out, len(seen), seen

    remat_inner = remat(inner) if on == "nested_input" else inner
    remat_fn = remat(lambda x: fn(x, remat_inner))
    if nested:
        remat_fn = remat(lambda x, f=remat_fn: f(x * 1.0) + x)
        plain = lambda x: fn(x * 1.0, inner) + x  # noqa: E731
    else:
        plain = lambda x: fn(x, inner)  # noqa: E731
    assert_close(run(remat_fn), run(plain))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known gap: the second pass differentiates both the recorded backward and the call's outputs "
    "(through cos(y), the first loss's cotangent); remat has a graph for each, and the hook runs in each on "
    "a part of the gradient that it sees whole, once, without remat (right for a hook linear in it only)",
)
@pytest.mark.parametrize("on", ["intermediate", "nested_input", "module_full_backward_hook"])
def test_a_hook_sees_the_second_order_gradient_whole_where_the_first_loss_is_not_linear(on):
    """(A module's full backward hook inside the call, linear as it is here, runs in the second pass
    only where the gradient through the call's outputs goes: the part through the recorded backward
    reaches the module's input without it, once multiplied where it should be.)"""
    seen = []

    def hook(g):
        seen.append(g.detach().clone())
        return g / g.norm()  # (not linear in g: the sum of its calls on parts is not its call on the sum)

    if on == "module_full_backward_hook":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
        net[1].register_full_backward_hook(lambda m, gi, go: (seen.append(go[0].detach().clone()), (gi[0] * 3,))[1])

    def inner(y):
        y.register_hook(hook)
        return y.sin() * y

    def fn(x, inner_call):
        if on == "nested_input":
            return inner_call(x.cos() * 2).cos()
        if on == "module_full_backward_hook":
            return net(x)
        h = (x * 2).tanh()
        h.register_hook(hook)
        return h.sin() * x

    def run(f):
        seen.clear()
        x = randn(3, seed=1).requires_grad_()
        (g,) = torch.autograd.grad(f(x).sin().sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        return g.detach(), gg, seen

    remat_inner = remat(inner) if on == "nested_input" else inner
    assert_close(run(remat(lambda x: fn(x, remat_inner))), run(lambda x: fn(x, inner)))
