"""Ports of upstream checkpointing tests that the other port files leave out.

JAX (``jax-ml/jax`` ``tests/api_test.py``, read at cec06d116c): the parts of ``RematTest`` /
``Remat3Test`` that ``tests/test_jax_ports.py`` lists in ``SKIPPED`` or ports only in part,
where an eager analogue exists: ``lax.cond`` becomes Python control flow on a concrete value
(eager tensors are concrete; the ``x.sum() > 0`` of JAX's tests is evaluated, and one branch
runs, as ``lax.cond`` does at run time), a custom ``primitive`` with a batching rule becomes
an ``autograd.Function`` with a ``vmap`` staticmethod, ``custom_jvp`` / ``custom_vjp`` an
``autograd.Function``, ``jax.jit`` nothing (eager), and a jaxpr-text count a count of the
ATen operators the backward pass runs.

PyTorch (``pytorch/pytorch``): ``test/distributed/_composable/test_checkpoint.py``
(composable ``checkpoint(module)`` -> ``remat(module)``), ``test/distributed/fsdp/
test_checkpoint_wrapper.py`` (``checkpoint_wrapper`` -> ``remat(module)``) and the eager
halves of ``test/dynamo/test_activation_checkpointing.py`` (that file compiles each function
and counts operators in the compiled graphs; what carries over is the comparison of the
checkpointed function with the plain one, with the same selective-checkpointing contexts,
through ``funckpt.checkpoint``, and through ``torch.func`` where torch's own checkpoint
cannot go).

Each test names its upstream test in its docstring and compares against the un-checkpointed
function in float64. Upstream tests left out, and why, are listed in ``NOT_PORTED``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import traceback

import pytest
import torch
import torch.func as tf
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import funckpt
from funckpt import checkpoint_name, policies, remat
from tests.fakes import OpCounter

D = torch.float64
aten = torch.ops.aten

NOT_PORTED = {
    # JAX
    "RematTest.test_remat_residual_logging": "JAX's DEBUG log lines; funckpt reports residuals through saved_residuals instead (ported as such below)",
    "RematTest.test_remat_grad_accum_refs": "jax.ref mutable references: no torch counterpart",
    "RematTest.test_remat_of_cond (lax.cond traced)": "torch.cond runs only under torch.compile (eager: 'doesn't work unless it is captured completely with torch.compile'); ported with Python control flow",
    # torch dynamo: every test there compiles; these have no eager content beyond what is ported
    "test_tags_*": "operator counts in AOT-compiled graphs (the eager halves of their functions are ported in test_sac_eager_* below)",
    "test_compile_selective_checkpoint_invalid_context": "torch.compile's check that context_fn returns TorchDispatchModes; eager checkpoint accepts any context managers",
    "test_compile_selective_checkpoint_inplace_op": "skipped upstream; also fails without checkpointing (relu_ on sigmoid's saved output)",
    "test_region_activation_memory_budget_*": "torch.compile-only API (eager use raises in torch itself)",
    "RematerializeACNodesPassTests": "graph passes of torch.compile",
    "test_checkpoint_wrapper_parity / test_checkpoint_wrapper_cpu_offload": "CUDA memory statistics / CUDA saved-tensor hooks",
}


def t(v, **kw):
    return torch.tensor(v, dtype=D, **kw)


def check_grads_rev(f, ref, x, order=2):
    """JAX's ``jtu.check_grads(f, (x,), order=2, modes=['rev'])``, against the un-remat'd ``ref``."""
    assert_close(f(x), ref(x))
    assert_close(tf.jacrev(f)(x), tf.jacrev(ref)(x))
    if order >= 2:
        assert_close(tf.jacrev(tf.jacrev(f))(x), tf.jacrev(tf.jacrev(ref))(x))
    assert torch.autograd.gradcheck(f, (x.detach().clone().requires_grad_(),))


def backward_counts(f, *args):
    """Run ``f`` forward, then count the operators its backward pass (``.backward()``) runs."""
    args = [a.detach().clone().requires_grad_() for a in args]
    out = f(*args)
    with OpCounter() as c:
        torch.autograd.grad(out.sum(), args)
    return c.counts


# =============================================================================== JAX


class _IntroduceConstant(torch.autograd.Function):
    """JAX's ``constant_introducing_p``: the identity per example, but its batching rule adds
    ``arange`` over the whole batched tensor (so ``vmap`` of it is not the per-example map)."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g

    @staticmethod
    def jvp(ctx, t):
        return t

    @staticmethod
    def vmap(info, in_dims, x):
        return x + torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape), in_dims[0]


@pytest.mark.parametrize("policy", [None, policies.nothing_saveable, policies.everything_saveable])
def test_remat_vmap_constant_introducing_batching_rule(policy):
    """RematTest.test_remat_vmap, its last part: ``vmap(remat(constant_introducing_p.bind))``.
    remat's batching rule must run the function's own batching rule (``remat(vmap(f))``), in
    the forward run and in the recomputation: the values, and the gradients through them,
    are those of ``vmap`` of the un-remat'd function, not of the per-example one."""
    f = _IntroduceConstant.apply
    g = remat(f, policy=policy)
    x = torch.ones(20, dtype=D)
    assert_close(tf.vmap(g)(x), tf.vmap(f)(x))
    assert not torch.equal(tf.vmap(f)(x), x)  # (the rule does introduce a constant)

    def body(fn):
        return lambda x: torch.sin(fn(x)) * fn(x)

    for outer in (
        lambda fn: tf.vmap(fn),
        lambda fn: tf.grad(lambda x: tf.vmap(fn)(x).sum()),
        lambda fn: tf.vmap(tf.grad(lambda x: fn(x).sum())),
        lambda fn: tf.jacrev(tf.vmap(fn)),
    ):
        assert_close(outer(remat(body(f), policy=policy))(x), outer(body(f))(x))
    xr = x.clone().requires_grad_()
    got = torch.autograd.grad(tf.vmap(remat(body(f), policy=policy))(xr).sum(), xr)
    assert_close(got, torch.autograd.grad(tf.vmap(body(f))(xr).sum(), xr))


@pytest.mark.parametrize(
    "name,f",
    [
        ("basic", lambda x: torch.sin(torch.sin(x))),
        ("cond", lambda x: torch.sin(x) if x > 0 else torch.cos(x)),
        ("cond_where", lambda x: torch.where(x > 0, torch.sin(x), torch.cos(x))),
    ],
)
@pytest.mark.parametrize("x", [0.3, -0.3])
def test_remat_higher_order_ad_preserves_remat_primitive(name, f, x):
    """RematTest.test_remat_higher_order_ad_preserves_remat_primitive: ``grad(grad(remat(f)))``
    equals ``grad(grad(f))``, with ``lax.cond(x > 0, sin, cos, x)`` as Python control flow on
    the concrete value (and as ``torch.where``). (The jaxpr inspection has no counterpart.)"""
    g = remat(f)
    x = t(x)
    assert_close(tf.grad(tf.grad(g))(x), tf.grad(tf.grad(f))(x))
    assert_close(tf.grad(tf.grad(tf.grad(g)))(x), tf.grad(tf.grad(tf.grad(f)))(x))


def _cond(pred, true_fn, false_fn, x):
    """``lax.cond`` in eager mode: the predicate is a concrete value; one branch runs."""
    return true_fn(x) if bool(pred) else false_fn(x)


@pytest.mark.parametrize("policy", [None, policies.nothing_saveable])
def test_remat_of_cond(policy):
    """RematTest.test_remat_of_cond (both of its functions), with ``jtu.check_grads(order=2,
    modes=['rev'])`` against the un-remat'd function, for both branches, and the jvp that JAX
    linearizes. (``torch.func.linearize`` traces with make_fx, where a condition on a tensor's
    value fails with or without remat.)"""
    fns = [
        lambda x: _cond(x > 0.0, lambda c: (torch.sin(c), torch.sin(c)), lambda c: (torch.sin(c), torch.sin(c)), x),
        lambda x: _cond(x > 0.0, lambda c: torch.sin(torch.sin(c)), lambda c: c, x),
    ]
    for f in fns:
        ref = lambda x, f=f: torch.stack(list(f(x))) if isinstance(f(x), tuple) else f(x)  # noqa: E731
        rf = remat(f, policy=policy)
        g = lambda x, rf=rf: (lambda o: torch.stack(list(o)) if isinstance(o, tuple) else o)(rf(x))  # noqa: E731
        for x in (t(3.0), t(-3.0)):
            check_grads_rev(g, ref, x)
            assert_close(tf.jvp(g, (x,), (t(1.0),)), tf.jvp(ref, (x,), (t(1.0),)))


def test_remat_of_cond_policy():
    """RematTest.test_remat_of_cond_policy: a save-cos policy on remat of a cond; the backward
    pass then reruns neither sin nor cos (JAX: no sin or cos in the linearized jaxpr), and
    grads are right to order 2."""
    save_cos = lambda op, *_, **__: op.overloadpacket is aten.cos  # noqa: E731
    ref = lambda x: _cond(x > 0, torch.sin, lambda x: x, x)  # noqa: E731
    f = remat(ref, policy=save_cos)
    check_grads_rev(f, ref, t(3.0))
    counts = backward_counts(f, t(4.0))
    # sin's backward is cos(x) * g: one cos, computed by autograd, no sin rerun. (A sin saved
    # by nothing and recomputed would show up as a sin.)
    assert counts[aten.sin] == 1  # the recomputation's forward sin (funckpt replays unsaved ops)
    assert counts[aten.cos] == 1


class _TimesArange(torch.autograd.Function):
    """JAX's custom_jvp ``f(x) = x * arange(3)`` whose jvp makes the constant anew."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * torch.arange(3.0, dtype=x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * torch.arange(3.0, dtype=g.dtype)

    @staticmethod
    def jvp(ctx, xdot):
        return xdot * torch.arange(3.0, dtype=xdot.dtype)


def test_const_in_jvp_cond():
    """RematTest.test_const_in_jvp_cond: ``grad`` of a remat'd function whose cond applies a
    custom-derivative function making a constant in its rule. Also ``jacfwd`` (the jvp rule)."""
    f = _TimesArange.apply

    def g_ref(x):
        y = _cond(x.sum() > 0, f, lambda x: x, x)
        return y.sum()

    g = remat(g_ref)
    x = torch.arange(3.0, dtype=D)
    assert_close(tf.grad(g)(x), tf.grad(g_ref)(x))
    assert_close(tf.grad(g)(-x - 1), tf.grad(g_ref)(-x - 1))
    assert_close(tf.jacfwd(g)(x), tf.jacfwd(g_ref)(x))


def _dots_cond_f(x0):
    def f(W):
        def inner(x):
            x = torch.sin(x @ W)
            x = torch.sin(x @ W)
            return torch.sin(x @ W)

        return _cond(x0.sum() > 0, inner, lambda x: x, x0)

    return f


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_remat_checkpoint_dots_cond(where):
    """RematTest.test_remat_checkpoint_dots_inside_cond / _outside_cond: a dots-saving remat
    around (or inside) a cond of three matmul+sin layers, ``vjp`` with respect to ``W`` only.
    JAX's counts of the backward jaxpr: 3 cos (sin's derivatives) and 5 dots (two per matmul,
    one for the first, whose left operand is a constant); the matmuls themselves are saved,
    not rerun. funckpt reruns the sins the policy did not save (3; JAX's DCE drops the last,
    2), as ``tests/test_jax_ports.py::test_remat_checkpoint_dots`` notes."""
    x0 = torch.ones(5, dtype=D)
    W = torch.ones(5, 5, dtype=D) * 0.1 + torch.eye(5, dtype=D) * 0.3
    ref = _dots_cond_f(x0)
    if where == "outside":
        f = remat(ref, policy=policies.dots_saveable)
    else:
        def f(W):
            inner = remat(lambda x: torch.sin(torch.sin(torch.sin(x @ W) @ W) @ W), policy=policies.dots_saveable)
            return _cond(x0.sum() > 0, inner, lambda x: x, x0)
    y, vjp = tf.vjp(f, W)
    y_ref, vjp_ref = tf.vjp(ref, W)
    assert_close((y, vjp(torch.ones_like(y))), (y_ref, vjp_ref(torch.ones_like(y_ref))))
    counts = backward_counts(f, W)
    dots = counts[aten.mm] + counts[aten.mv] + counts[aten.dot]
    assert counts[aten.cos] == 3
    assert dots == 5
    assert counts[aten.sin] == 3
    # jtu.check_grads(jit(f), order=2, modes=['fwd', 'rev'])
    assert_close(tf.jacrev(tf.jacrev(f))(W), tf.jacrev(tf.jacrev(ref))(W))
    assert_close(tf.jacfwd(tf.jacrev(f))(W), tf.jacfwd(tf.jacrev(ref))(W))
    assert_close(tf.jacfwd(f)(W), tf.jacfwd(ref)(W))


def test_remat_of_cond_funky_custom_jvp():
    """RematTest.test_remat_of_cond_funky_custom_jvp: a custom-derivative sin (an
    ``autograd.Function`` computing sin and cos together in its rules) applied in a cond,
    under remat with save-cos, save-sin, everything and nothing; grads to order 2."""

    class Sin(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.sin(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            (x,) = inputs
            ctx.save_for_backward(x)
            ctx.save_for_forward(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            _, c = torch.sin(x), torch.cos(x)
            return c * g

        @staticmethod
        def jvp(ctx, xdot):
            (x,) = ctx.saved_tensors
            return torch.cos(x) * xdot

    cond_apply = lambda f, x: _cond(x.sum() > float("-inf"), f, lambda x: x, x)  # noqa: E731
    save_cos = lambda op, *_, **__: op.overloadpacket is aten.cos  # noqa: E731
    save_sin = lambda op, *_, **__: op.overloadpacket is aten.sin  # noqa: E731
    x = t(3.0)
    for policy in (save_cos, save_sin, policies.everything_saveable, policies.nothing_saveable):
        ref = functools.partial(cond_apply, Sin.apply)
        check_grads_rev(remat(ref, policy=policy), ref, x)
        ref2 = lambda x: cond_apply(Sin.apply, cond_apply(Sin.apply, x))  # noqa: E731
        check_grads_rev(remat(ref2, policy=policy), ref2, x)


def test_excess_precision_hell():
    """RematTest.test_excess_precision_hell: bfloat16 through two custom-vjp functions under a
    save-everything remat; the vjp of ones is exactly the output (no excess precision kept by
    the saved values), as without remat, under ``torch.func.vjp`` and ``.backward()``."""

    class Dot(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x @ x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g

    class Foo(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.tensor(1.0, dtype=torch.float32) * x.float()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return torch.tensor(1.0, dtype=torch.float32) * x.float()

    def f(x):
        return Foo.apply(Dot.apply(x))

    eps = torch.finfo(torch.bfloat16).eps
    x = (torch.tensor(1, dtype=torch.bfloat16) + eps) * torch.eye(2, dtype=torch.bfloat16)
    for policy in (lambda *_, **__: True, policies.everything_saveable, None):
        g = remat(f, policy=policy)
        y, vjp = tf.vjp(g, x)
        (y_,) = vjp(torch.ones_like(y))
        assert_close(y, y_.float(), atol=0, rtol=0)
        y_ref, vjp_ref = tf.vjp(f, x)
        assert torch.equal(y, y_ref) and torch.equal(y_, vjp_ref(torch.ones_like(y_ref))[0])
        xx = x.clone().requires_grad_()
        g(xx).backward(torch.ones(2, 2))
        assert torch.equal(xx.grad, y_)


def test_name_stack_annotation_grads():
    """RematTest.test_name_stack_annotation (its computation): a remat'd function of ``x`` and
    a list of weights alternating two layer kinds, one naming its matmul ``save_me``; the vjp
    with respect to the list, under no policy, the name, and dots."""

    def g(x, y):
        return x @ y

    def g1(x, y):
        return checkpoint_name(x @ y, "save_me")

    def f2(x, ws):
        for i, w in enumerate(ws):
            x = g1(x, w) if i % 8 == 1 else g(x, w)
            x = torch.tanh(x)
        return x.sum()

    x = torch.linspace(-1, 1, 48, dtype=D).reshape(6, 8)
    ws = [torch.linspace(-0.3, 0.3, 80, dtype=D).reshape(8, 10), torch.linspace(0.2, -0.2, 80, dtype=D).reshape(10, 8)]
    for policy in (None, policies.save_only_these_names("save_me"), policies.dots_saveable):
        f = remat(f2, policy=policy)
        out, vjp = tf.vjp(functools.partial(f, x), ws)
        out_ref, vjp_ref = tf.vjp(functools.partial(f2, x), ws)
        assert_close((out, vjp(torch.ones_like(out))), (out_ref, vjp_ref(torch.ones_like(out_ref))))
        assert_close(tf.grad(f, argnums=(0, 1))(x, ws), tf.grad(f2, argnums=(0, 1))(x, ws))


def test_remat_residual_logging_as_saved_residuals():
    """RematTest.test_remat_residual_logging, read through ``saved_residuals`` (funckpt's
    report, not a log): no policy keeps only the inputs; a save-everything policy keeps sin's
    and cos's outputs; a save-cos policy keeps cos's and not sin's."""

    def f(x):
        x = torch.sin(x)
        return torch.cos(x.sum())

    x = torch.arange(3.0, dtype=D, requires_grad=True)
    f1 = remat(f)
    f2 = remat(f, policy=lambda *_, **__: True)
    f3 = remat(f, policy=lambda op, *_, **__: op.overloadpacket is aten.cos)

    def kept(fn):
        return [r.source for r in funckpt.saved_residuals(fn, x) if r.kind != "input"]

    assert [r.kind for r in funckpt.saved_residuals(f1, x)] == ["input"]
    assert any("sin" in s for s in kept(f2)) and any("cos" in s for s in kept(f2))
    assert not any("sin" in s for s in kept(f3)) and any("cos" in s for s in kept(f3))
    for fn in (f1, f2, f3):
        assert_close(tf.grad(fn)(x.detach()), tf.grad(f)(x.detach()))


def test_concreteness_error_includes_user_code():
    """RematTest.test_concreteness_error_includes_user_code (and _with_static_argnums): Python
    control flow on a traced value. Eager tensors are concrete, so remat runs it; under ``vmap``
    (whose values are not) remat raises what the un-remat'd function raises, with the user's
    line in the traceback."""

    def f(x, _=None):
        if x > 0:
            return x
        else:
            return torch.sin(x)

    for g in (remat(f), remat(f, static_argnums=(1,))):
        assert_close(g(t(3.0), 1.0), t(3.0))
        assert_close(tf.grad(g)(t(-1.0), 1.0), torch.cos(t(-1.0)))
        with pytest.raises(RuntimeError, match="data-dependent control flow") as info:
            tf.vmap(g, in_dims=(0, None))(t([1.0, -2.0]), 1.0)
        assert "x > 0" in "".join(traceback.format_exception(info.value))
        with pytest.raises(RuntimeError, match="data-dependent control flow"):
            tf.vmap(f, in_dims=(0, None))(t([1.0, -2.0]), 1.0)


def test_remat_static_argnames_as_keywords():
    """Remat3Test.test_remat_unhashable_static_argnums, its ``static_argnames='cfg'`` half: a
    dict of Python numbers passed by keyword is passed through untouched."""

    def h(x, cfg):
        return x * cfg["scale"]

    x = torch.ones(4, dtype=D)
    g = tf.grad(lambda x: remat(h)(x, cfg={"scale": 3.0}).sum())(x)
    assert_close(g, torch.full((4,), 3.0, dtype=D))
    g = tf.grad(lambda x: remat(h, static_argnums=1)(x, {"scale": 2.0}).sum())(x)
    assert_close(g, torch.full((4,), 2.0, dtype=D))


@pytest.mark.parametrize("static_argnums", [1, (1,), -2, (-2,), (1, -2)])
def test_remat_static_argnums_forms(static_argnums):
    """``jax.checkpoint``'s ``static_argnums`` (``_remat_static_argnums``): an int or a tuple of
    ints, negative ones counted from the end (``-len(args) <= d < len(args)``); duplicates
    name one argument."""

    def f(x, n, y):
        out = x
        for _ in range(n):
            out = torch.sin(out) * y
        return out

    x, y = t(0.7), t(1.3)
    g = remat(f, static_argnums=static_argnums)
    assert_close(tf.grad(g, argnums=(0, 2))(x, 3, y), tf.grad(f, argnums=(0, 2))(x, 3, y))
    for bad in ((3,), (-4,)):
        with pytest.raises(ValueError, match="static_argnums"):
            remat(f, static_argnums=bad)(x, 3, y)
    with pytest.raises(TypeError, match="static_argnums"):
        remat(f, static_argnums=1.0)


# ============================================================== torch: composable / wrapper


class _ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(20, 20)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(20, 20), nn.ReLU())

    def forward(self, x):
        return self.seq(self.l1(x))


class _MultiOutputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(10, 10, dtype=D))
        self.w2 = nn.Parameter(torch.randn(10, 10, dtype=D))

    def forward(self, x):
        z = nn.functional.relu(x @ self.w1) @ self.w2
        return z.sin(), z.cos()


class _MultiInputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 10, dtype=D))

    def forward(self, xs):
        assert len(xs) == 2, f"Expects 2 args but got {len(xs)}"
        x, y = xs
        return nn.functional.relu((x + y) @ self.w)


def _param_grads(net):
    return [p.grad for p in net.parameters()]


def test_composable_tensor_only_cpu():
    """test/distributed/_composable/test_checkpoint.py TestCheckpoint.test_tensor_only_cpu:
    checkpointing a submodule in place (``net.seq = remat(net.seq)``, funckpt's form of
    ``checkpoint(net.seq)``) gives the parameters the plain model's gradients."""
    net1 = _ToyModel().double()
    net2 = copy.deepcopy(net1)
    net2.seq = remat(net2.seq)
    x = torch.randn(8, 20, dtype=D)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    net1(x1).sum().backward()
    net2(x2).sum().backward()
    assert_close(_param_grads(net2), _param_grads(net1))
    assert_close(x2.grad, x1.grad)
    assert list(net2.state_dict()) == list(net1.state_dict())


def test_composable_random_cpu():
    """test/distributed/_composable/test_checkpoint.py TestCheckpoint.test_random_cpu: a module
    drawing ``torch.randn`` in its forward, remat'd, gives the gradients of the plain module
    with the same CPU RNG state."""

    class RandomModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.randn(10, 10, dtype=D))

        def forward(self, x):
            y = torch.matmul(self.p, torch.randn(10, 10, dtype=D, device=self.p.device))
            return torch.matmul(x, y)

    net1 = RandomModel()
    net2 = copy.deepcopy(net1)
    x1 = torch.randn(6, 10, dtype=D, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    state = torch.get_rng_state()
    net1(x1).sum().backward()
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    remat(net2)(x2).sum().backward()
    assert torch.equal(torch.get_rng_state(), after)
    assert_close(_param_grads(net2), _param_grads(net1))
    assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize("how", ["each", "whole", "whole_segments_4", "checkpoint_sequential"])
def test_composable_multi_args(how):
    """test/distributed/_composable/test_checkpoint.py TestCheckpoint.test_multi_args: modules
    whose outputs are tuples feeding modules that take one tuple, checkpointed one by one as
    upstream does (and as a whole remat'd ``nn.Sequential``, whose segments pass the tuples,
    and through ``checkpoint_sequential``); also under ``functional_call`` + ``grad``."""
    torch.manual_seed(0)
    net1 = nn.Sequential(_MultiOutputModel(), _MultiInputModel(), _MultiOutputModel(), _MultiInputModel())
    net2 = copy.deepcopy(net1)
    if how == "each":
        net2[0] = remat(net2[0])
        net2[2] = remat(net2[2])
        run = net2
    elif how == "checkpoint_sequential":
        run = lambda x: funckpt.checkpoint_sequential(net2, 2, x, use_reentrant=False)  # noqa: E731
    else:
        run = remat(net2, segments=4 if how.endswith("4") else None)
    x = torch.randn(5, 10, dtype=D)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    net1(x1).sum().backward()
    run(x2).sum().backward()
    assert_close(_param_grads(net2), _param_grads(net1))
    assert_close(x2.grad, x1.grad)
    if isinstance(run, nn.Module):
        params = {k: v.detach() for k, v in run.named_parameters()}
        got = tf.grad(lambda p, x: torch.func.functional_call(run, p, (x,)).sum(), argnums=(0, 1))(params, x)
        ref_params = {k: v.detach() for k, v in net1.named_parameters()}
        want = tf.grad(lambda p, x: torch.func.functional_call(net1, p, (x,)).sum(), argnums=(0, 1))(ref_params, x)
        assert_close(list(got[0].values()) + [got[1]], list(want[0].values()) + [want[1]])


def test_checkpoint_wrapper_load_activation_checkpointed_module():
    """test/distributed/fsdp/test_checkpoint_wrapper.py test_load_activation_checkpointed_module
    and test_fqn: a remat'd module's state_dict loads into the plain module and back, with the
    plain module's keys."""
    lin = remat(nn.Linear(10, 10, bias=False))
    state_dict = copy.deepcopy(lin.state_dict())
    lin_new = nn.Linear(10, 10, bias=False)
    lin_new.load_state_dict(state_dict)
    for p1, p2 in zip(lin.parameters(), lin_new.parameters()):
        assert torch.equal(p1, p2)
    with torch.no_grad():
        for p in lin_new.parameters():
            p.add_(0.5)
    lin.load_state_dict(copy.deepcopy(lin_new.state_dict()))
    for p1, p2 in zip(lin.parameters(), lin_new.parameters()):
        assert torch.equal(p1, p2)
    for fqn, _ in lin.named_parameters():
        assert fqn in lin.state_dict(), f"{fqn} not in state_dict."


def test_checkpoint_wrapper_kwarg_support():
    """test/distributed/fsdp/test_checkpoint_wrapper.py test_checkpoint_wrapper_kwarg_support:
    a forward with defaulted and ``**kwargs`` parameters (extra tensors passed by keyword and
    unused), and one with keyword-only parameters; values, ``requires_grad`` and gradients as
    without remat, through ``remat(module)`` and ``funckpt.checkpoint``."""

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10, dtype=D)

        def forward(self, a, b, c=None, d=None, **kwargs):
            return (self.lin(a), self.lin(b), self.lin(c), self.lin(d))

    base = MyModel()
    inp = torch.ones(4, 10, dtype=D, requires_grad=True)
    loss = lambda out: sum((k + 1) * o.sum() for k, o in enumerate(out))  # noqa: E731
    want = torch.autograd.grad(loss(base(inp, inp, c=inp, d=inp, e=inp, f=inp)), [inp, *base.parameters()])
    for use_reentrant in (True, False):
        model = remat(copy.deepcopy(base))
        out = model(inp, inp, c=inp, d=inp, e=inp, f=inp)
        assert isinstance(out, tuple) and len(out) == 4
        out_no_kwarg = model(inp, inp, inp, inp)
        for t1, t2 in zip(out_no_kwarg, out):
            assert_close(t1, t2)
            assert t1.requires_grad == t2.requires_grad
        assert_close(torch.autograd.grad(loss(out), [inp, *model.parameters()]), want)
        out = funckpt.checkpoint(base, inp, inp, c=inp, d=inp, e=inp, f=inp, use_reentrant=use_reentrant)
        assert_close(torch.autograd.grad(loss(out), [inp, *base.parameters()]), want)

    class ModelEnforceKwarg(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10, dtype=D)

        def forward(self, *, a=None, b=None):
            return (self.lin(a), self.lin(b))

    base = ModelEnforceKwarg()
    model = remat(copy.deepcopy(base))
    out = model(a=inp, b=inp)
    assert len(out) == 2
    assert_close(
        torch.autograd.grad(loss(out), [inp, *model.parameters()]),
        torch.autograd.grad(loss(base(a=inp, b=inp)), [inp, *base.parameters()]),
    )


def test_checkpoint_wrapper_forward_missing_attributes():
    """test/distributed/fsdp/test_checkpoint_wrapper.py test_forward_missing_attributes:
    indexing and attributes the wrapper lacks reach the wrapped module."""
    lin = nn.Linear(1, 1)
    m = nn.Sequential(lin, lin)
    wrapped = remat(m)
    assert wrapped[0] is lin
    m._foo = "bar"
    assert wrapped._foo == "bar"


def test_apply_activation_checkpointing():
    """test/distributed/fsdp/test_checkpoint_wrapper.py test_apply_activation_checkpointing:
    every ``nn.Linear`` of a model with BatchNorm swapped for its remat'd self; six steps with
    a keyword input; each step's loss, gradients and BatchNorm statistics equal the plain
    model's, every checkpointed parameter gets a gradient, and the state_dict keys stay."""
    torch.manual_seed(0)

    class LinearWithBatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.bn = nn.BatchNorm1d(10)
            self.nested_linear = nn.Sequential(nn.Linear(10, 10))

        def forward(self, x):
            return self.bn(self.nested_linear(self.lin(x)))

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(LinearWithBatchNorm(), LinearWithBatchNorm(), LinearWithBatchNorm())

        def forward(self, x):
            return self.seq(x)

    base = MyModel().double()
    model = copy.deepcopy(base)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())

    def swap(module):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, remat(child))
            else:
                swap(child)

    swap(model)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == n_linear
    inp = torch.randn(4, 10, dtype=D, requires_grad=True)
    for _ in range(6):
        base.zero_grad()
        model.zero_grad()
        loss = model(x=inp).sum()
        assert loss.requires_grad
        loss.backward()
        base(x=inp).sum().backward()
        for (name, p), q in zip(model.named_parameters(), base.parameters()):
            assert p.grad is not None, name
            assert_close(p.grad, q.grad)
        assert_close(list(model.buffers()), list(base.buffers()))
    assert list(model.state_dict()) == list(base.state_dict())


# ==================================================== torch: dynamo activation checkpointing


def _get_custom_policy(no_recompute_list=None, must_recompute_list=None):
    def _custom_policy(ctx, func, *args, **kwargs):
        if no_recompute_list is not None and func in no_recompute_list:
            return CheckpointPolicy.MUST_SAVE
        if must_recompute_list is not None and func in must_recompute_list:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return _custom_policy


def _sac(**kw):
    return lambda: create_selective_checkpoint_contexts(_get_custom_policy(**kw))


def _compare_orig_and_checkpointed(gn, args, context_fn=None, preserve_rng_state=True, bwd_counts=None):
    """test_activation_checkpointing.py ``_compare_orig_and_checkpointed_fns`` in eager mode: the
    checkpointed function's outputs and gradients equal the original's (same seed), under
    ``.backward()`` and under ``torch.func.grad``. ``bwd_counts``: {op packet: count} that the
    checkpointed backward pass must run (upstream counts them in the compiled backward graph)."""
    kwargs = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn

    def checkpointed(*a):
        return funckpt.checkpoint(gn, *a, **kwargs)

    def run(f):
        a = [x.detach().clone().requires_grad_(x.requires_grad) for x in args]
        torch.manual_seed(0)
        out = f(*a)
        with OpCounter() as c:
            out.sum().backward()
        return (out, [x.grad for x in a]), c.counts

    want, _ = run(gn)
    got, counts = run(checkpointed)
    assert_close(got, want)
    for op, n in (bwd_counts or {}).items():
        assert counts[op] == n, (op, counts[op], n)
    argnums = tuple(range(len(args)))
    detached = [x.detach() for x in args]
    torch.manual_seed(0)
    want = tf.grad(lambda *a: gn(*a).sum(), argnums=argnums)(*detached)
    torch.manual_seed(0)
    got = tf.grad(lambda *a: checkpointed(*a).sum(), argnums=argnums)(*detached)
    assert_close(got, want)


def _xy(n=4):
    torch.manual_seed(1)
    return torch.randn(n, n, dtype=D, requires_grad=True), torch.randn(n, n, dtype=D, requires_grad=True)


def _gemm(x, y):
    return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y


def test_sac_eager_must_recompute():
    """test_compile_selective_checkpoint_must_recompute: ``cos(sin(x @ x @ x))`` with mm
    MUST_RECOMPUTE (the backward reruns the 2 matmuls: 2 + 2 * 2 = 6 mm) and with mm MUST_SAVE
    (4 mm)."""
    x, _ = _xy()
    gn = lambda x: torch.cos(torch.sin(torch.matmul(x, x) @ x))  # noqa: E731
    _compare_orig_and_checkpointed(gn, [x], _sac(must_recompute_list=[aten.mm.default]), bwd_counts={aten.mm: 6})
    _compare_orig_and_checkpointed(gn, [x], _sac(no_recompute_list=[aten.mm.default]), bwd_counts={aten.mm: 4})


def test_sac_eager_must_not_recompute_gemm():
    """test_compile_selective_checkpoint_must_not_recompute_gemm (and its _no_functionalization
    and _partial_ctx_fn forms): mm saved, so the backward runs only the 4 mm of the gradients,
    and sigmoid is rerun once."""
    x, y = _xy()
    _compare_orig_and_checkpointed(
        _gemm, [x, y], _sac(no_recompute_list=[aten.mm.default]), bwd_counts={aten.mm: 4, aten.sigmoid: 1}
    )
    partial_ctx = functools.partial(
        lambda lst: create_selective_checkpoint_contexts(_get_custom_policy(no_recompute_list=lst)), [aten.mm.default]
    )
    _compare_orig_and_checkpointed(_gemm, [x, y], partial_ctx, bwd_counts={aten.mm: 4})


def test_sac_eager_with_partial_context_fn_policy_object():
    """test_sac_with_partial_context_fn: a policy that is a callable object (whose extra
    parameter takes the operator), through ``functools.partial(create_selective_checkpoint_contexts,
    CustomPolicy())``: everything saved, nothing rerun, gradients as without checkpointing."""

    class CustomPolicy:
        def __call__(self, ctx, out, func, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE

    x, y = _xy()
    _compare_orig_and_checkpointed(
        _gemm, [x, y], functools.partial(create_selective_checkpoint_contexts, CustomPolicy()), bwd_counts={aten.mm: 4}
    )


def test_sac_eager_custom_rule():
    """test_compile_selective_checkpoint_custom_rule: a policy returning bools, keeping every mm
    but the second it sees per context (it counts per ``ctx``, so forward and recomputation
    count separately)."""

    def context_fn():
        meta = {}

        def _custom_policy(mode, func, *args, **kwargs):
            key = f"{mode}_mm_count"
            meta.setdefault(key, 0)
            if func == aten.mm.default:
                meta[key] += 1
            return func in [aten.mm.default] and not (func == aten.mm.default and meta[key] == 2)

        return create_selective_checkpoint_contexts(_custom_policy)

    x, y = _xy()
    gn = lambda x, y: torch.sigmoid(torch.sigmoid(torch.matmul(torch.matmul(x, y) * y, y) * y))  # noqa: E731
    _compare_orig_and_checkpointed(gn, [x, y], context_fn)


def test_sac_eager_outplace_op_and_list_ops():
    """test_compile_selective_checkpoint_outplace_op (mm and sigmoid saved: sigmoid not rerun)
    and _list_ops (``cat`` of a list, nothing saved: cat rerun once)."""
    x, y = _xy()
    gn = lambda x, y: torch.sigmoid(torch.selu(torch.matmul(torch.matmul(x, y), y))).relu()  # noqa: E731
    _compare_orig_and_checkpointed(
        gn, [x, y], _sac(no_recompute_list=[aten.mm.default, aten.sigmoid.default]), bwd_counts={aten.mm: 4, aten.sigmoid: 0}
    )
    _compare_orig_and_checkpointed(
        lambda x, y: torch.cat([x, y]).sin(), [x, y], _sac(no_recompute_list=[]), bwd_counts={aten.cat: 1}
    )


def test_sac_eager_random_op():
    """test_compile_selective_checkpoint_random_op: dropout between two sigmoids, sigmoid saved;
    with ``preserve_rng_state=True`` the gradients equal the un-checkpointed function's with the
    same seed, and sigmoid (saved) is not rerun in the backward pass."""
    x, _ = _xy()
    gn = lambda x: torch.sigmoid(torch.dropout(torch.sigmoid(x), p=0.5, train=True))  # noqa: E731
    _compare_orig_and_checkpointed(
        gn, [x], _sac(no_recompute_list=[aten.sigmoid.default]), bwd_counts={aten.sigmoid: 0}
    )


def test_sac_eager_custom_function_in_region():
    """test_compile_selective_checkpoint_triton_kernel, without triton: an ``autograd.Function``
    writing its result into a fresh buffer (``empty_like`` + ``copy_``) inside an mm-saving
    region."""

    class AddOne(torch.autograd.Function):
        @staticmethod
        def forward(x):
            out = torch.empty_like(x)
            out.copy_(x + 1)
            return out

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g

    x, y = _xy()
    gn = lambda x, y: torch.sigmoid(torch.matmul(torch.matmul(AddOne.apply(x.sin()), y), y)) * y  # noqa: E731
    _compare_orig_and_checkpointed(gn, [x, y], _sac(no_recompute_list=[aten.mm.default]), bwd_counts={aten.mm: 4})


def test_sac_eager_tensor_subclass():
    """test_compile_selective_checkpoint_tensor_subclass: ``TwoTensor`` inputs (a wrapper
    subclass dispatching each op to two tensors) through an mm-saving region: values and
    gradients (themselves TwoTensors) as without checkpointing."""
    from torch.testing._internal.two_tensor import TwoTensor

    r = torch.randn(4, 4, dtype=D)

    def run(f):
        x = TwoTensor(r, r.clone()).requires_grad_()
        y = TwoTensor(r.clone(), r.clone()).requires_grad_()
        out = f(x, y)
        out.sum().backward()
        return out, x.grad, y.grad

    want = run(_gemm)
    got = run(lambda x, y: funckpt.checkpoint(_gemm, x, y, use_reentrant=False, context_fn=_sac(no_recompute_list=[aten.mm.default])))
    assert all(type(g) is type(w) for g, w in zip(got, want))
    assert_close(got, want)


def test_sac_eager_parametrization():
    """test_compile_selective_checkpoint_parametrization: every parameter of a model
    reparametrized (``register_parametrization(..., unsafe=True)``) by a module whose forward
    checkpoints ``sigmoid(x * x)`` with mul and sigmoid MUST_RECOMPUTE and the rest MUST_SAVE;
    gradients as with the plain parametrization, under ``.backward()`` and under
    ``functional_call`` + ``torch.func.grad`` (where torch's own checkpoint raises)."""

    def sac_policy():
        def _custom_policy(ctx, func, *args, **kwargs):
            to_recompute = func in {aten.mul.Tensor, aten.sigmoid.default}
            return CheckpointPolicy.MUST_RECOMPUTE if to_recompute else CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(_custom_policy)

    def make(ck):
        class Parametrization(nn.Module):
            def parametrization(self, x):
                return torch.sigmoid(torch.mul(x, x))

            def forward(self, x):
                if ck is None:
                    return self.parametrization(x)
                return ck(self.parametrization, x, use_reentrant=False, context_fn=sac_policy)

        class MLPModule(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(5)
                self.net1 = nn.Linear(16, 16, bias=False, dtype=D)

            def forward(self, x):
                return self.net1(x)

        model = MLPModule()
        for mod in list(model.modules()):
            for p_name, p in dict(mod.named_parameters(recurse=False)).items():
                mod.register_parameter(p_name, nn.Parameter(p))
                nn.utils.parametrize.register_parametrization(mod, p_name, Parametrization(), unsafe=True)
        return model

    inp = torch.randn(8, 16, dtype=D)
    results = {}
    for name, ck in (("plain", None), ("funckpt", funckpt.checkpoint)):
        model = make(ck)
        x = inp.clone().requires_grad_()
        out = model(x)
        out.sum().backward()
        params = {k: v.detach() for k, v in model.named_parameters()}
        g = tf.grad(lambda p, x: torch.func.functional_call(model, p, (x,)).sum(), argnums=(0, 1))(params, inp)
        results[name] = (out, x.grad, [p.grad for p in model.parameters()], g)
    assert_close(results["funckpt"], results["plain"])


def test_sac_eager_kwargs_and_list_inputs():
    """test_kwargs (``checkpoint(gn, x, y, z=z)`` with ``z`` a keyword tensor), test_list_inputs
    (a module taking a list and returning its input beside a list, inputs with and without
    grad) and test_return_same_element_twice, in eager mode with both ``use_reentrant``
    values."""
    x, y = _xy()
    z = torch.randn(4, 4, dtype=D, requires_grad=True)

    def gn(x, y, z=None):
        a = torch.matmul(x, y)
        return torch.matmul(a, z) if z is not None else a

    for ur in (True, False):
        got = torch.cos(funckpt.checkpoint(gn, x, y, use_reentrant=ur, z=z))
        want = torch.cos(gn(x, y, z=z))
        assert_close(got, want)
        assert_close(torch.autograd.grad(got.sum(), (x, y, z)), torch.autograd.grad(want.sum(), (x, y, z)))

    class MockModule(nn.Module):
        def forward(self, x, ys):
            a = torch.sin(x)  # noqa: F841
            return (x, [torch.cos(ys[0]), torch.cos(ys[1])])

    mod = MockModule()
    loss = lambda o: (o[0] * 2).sum() + o[1][0].sum() + (o[1][1] ** 2).sum()  # noqa: E731
    for rg in (False, True):
        for ur in (True, False):
            xs = [v.detach().clone().requires_grad_(rg) for v in (x, y, z)]
            got = funckpt.checkpoint(mod, xs[0], [xs[1], xs[2]], use_reentrant=ur)
            want = mod(xs[0], [xs[1], xs[2]])
            assert_close(got, want)
            if rg:
                assert_close(torch.autograd.grad(loss(got), xs), torch.autograd.grad(loss(want), xs))

    def twice(x):
        y = torch.sin(x)
        return y, y

    a, b = funckpt.checkpoint(twice, x, use_reentrant=True)
    assert_close((a, b), twice(x))
    assert_close(torch.autograd.grad(a.sum() + 2 * b.sum(), x), torch.autograd.grad(3 * torch.sin(x).sum(), x))


def test_sac_eager_nonlocal_mutations():
    """test_nonlocal_mutation (a counter in the closure is incremented by the forward run and
    again by the recomputation: 2, as torch's eager checkpoint does) and
    test_nonlocal_list_mutation / _hidden (a tensor appended to a list argument inside the
    region is returned by the caller; its gradient flows)."""
    counter = 0

    def gn(x):
        nonlocal counter
        counter += 1
        return torch.sin(x)

    x, _ = _xy()
    funckpt.checkpoint(gn, x, use_reentrant=True).sum().backward()
    assert counter == 2

    for hidden in (False, True):

        def gn2(x, z):
            o = torch.matmul(x, x) @ x
            out = x.sin()
            z.append(out)
            if hidden:
                return torch.cos(torch.sin(o)), torch.sin(x)
            return torch.cos(torch.sin(o)), out

        def fn(ck):
            def f(x):
                z = []
                outs = gn2(x, z) if ck is None else ck(gn2, x, z, use_reentrant=False)
                return (outs[0] + outs[-1], z[0]) if hidden else (outs[0], z[0])

            return f

        loss = lambda o: o[0].sum() + (o[1] * 3).sum()  # noqa: E731
        assert_close(fn(funckpt.checkpoint)(x), fn(None)(x))
        assert_close(torch.autograd.grad(loss(fn(funckpt.checkpoint)(x)), x), torch.autograd.grad(loss(fn(None)(x)), x))
        xd = x.detach()
        assert_close(tf.grad(lambda x: loss(fn(funckpt.checkpoint)(x)))(xd), tf.grad(lambda x: loss(fn(None)(x)))(xd))


def test_sac_eager_frozen_dataclass_pytree_output():
    """test_frozen_dataclass_pytree_output: a checkpointed ``mlp.forward`` taking and returning
    frozen dataclasses registered with ``torch.utils._pytree``; output and gradients as
    without checkpointing."""
    from torch.utils import _pytree as pytree

    @dataclasses.dataclass(frozen=True)
    class InputNode:
        x: torch.Tensor

    @dataclasses.dataclass(frozen=True)
    class OutputNode:
        y: torch.Tensor

    pytree.register_dataclass(InputNode)
    pytree.register_dataclass(OutputNode)
    try:

        class TinyMLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(4, 8, dtype=D)
                self.fc2 = nn.Linear(8, 4, dtype=D)

            def forward(self, inp):
                return OutputNode(y=self.fc2(nn.functional.silu(self.fc1(inp.x))))

        mlp = TinyMLP()
        x = torch.randn(2, 4, dtype=D)
        results = []
        for ck in (None, funckpt.checkpoint):
            mlp.zero_grad()
            xi = x.clone().requires_grad_()
            out = mlp(InputNode(x=xi)) if ck is None else ck(mlp.forward, InputNode(x=xi), use_reentrant=False)
            out.y.sum().backward()
            results.append((out.y, xi.grad, [p.grad for p in mlp.parameters()]))
        assert_close(results[1], results[0])
    finally:
        for cls in (InputNode, OutputNode):
            pytree.SUPPORTED_NODES.pop(cls, None)
            pytree.SUPPORTED_SERIALIZED_TYPES.pop(cls, None)
            pytree.CONSTANT_NODES.discard(cls)


def test_sac_eager_record_function():
    """test_checkpoint_with_record_function: ``torch.profiler.record_function`` inside the
    checkpointed function; gradients as without checkpointing, under ``torch.func.grad`` too."""

    def gn(x, y):
        with torch.profiler.record_function("matmul_region"):
            return torch.sigmoid(torch.matmul(x, y))

    x, y = _xy()
    _compare_orig_and_checkpointed(lambda x, y: gn(torch.sin(x), y), [x, y])


@pytest.mark.parametrize(
    "name,fn,save",
    [
        ("pre_mode_decomp_has_sac_ignored_ops", lambda x: (lambda a: (a.detach() + a).cos())(x.sin()),
         {aten.sin.default, aten.add.Tensor, aten.cos.default}),
        ("post_mode_decomp", lambda x: nn.functional.silu(x.sin()).cos(), {aten.silu.default}),
        ("multi_output_op", lambda x: torch.topk(x.sin(), k=2)[0].sum().cos() * x, {aten.topk.default}),
    ],
)
def test_sac_annotation_policies(name, fn, save):
    """test_pre_mode_decomp_has_sac_ignored_ops / test_post_mode_decomp / test_multi_output_op:
    the functions whose SAC annotations upstream checks (a detach between a saved op and its
    use; silu saved; a multi-output ``topk`` saved), through ``context_fn`` and through
    ``policies.from_torch``: gradients and Hessians as without checkpointing, and the saved
    values are the listed ops' outputs."""

    def policy_fn(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.linspace(-1, 1, 7, dtype=D)
    _compare_orig_and_checkpointed(fn, [x.clone().requires_grad_()], functools.partial(create_selective_checkpoint_contexts, policy_fn))
    for policy in (policies.from_torch(policy_fn), policies.from_torch(list(save))):
        f = remat(fn, policy=policy)
        assert_close(tf.grad(lambda x: f(x).sum())(x), tf.grad(lambda x: fn(x).sum())(x))
        assert_close(tf.hessian(lambda x: f(x).sum())(x), tf.hessian(lambda x: fn(x).sum())(x))
        kept = {r.source for r in funckpt.saved_residuals(f, x.clone().requires_grad_()) if r.kind != "input"}
        assert kept == {str(op) for op in save}, kept


def test_tags_must_save_tensor_that_has_backward_hook():
    """test_tags_must_save_tensor_that_has_backward_hook, eager: a forward hook of the
    checkpointed submodule registers a backward hook on its output; the hook runs once per
    backward and the gradients equal the plain model's."""
    calls = []

    def my_backward_hook(grad):
        calls.append(1)
        return grad * 2

    def my_post_forward_hook(submod, args, output):
        output.register_hook(my_backward_hook)
        return output

    class MySubmod(nn.Module):
        def forward(self, x):
            y = torch.matmul(x, x)
            return y * y

    class MyMod(nn.Module):
        def __init__(self, ck):
            super().__init__()
            self.ck = ck
            self.submod = MySubmod()
            self.norm = nn.LayerNorm(4, dtype=D)

        def forward(self, x):
            out = self.submod(x) if self.ck is None else self.ck(self.submod, x, use_reentrant=False)
            return self.norm(out)

    grads = []
    for ck in (None, funckpt.checkpoint):
        torch.manual_seed(0)
        mod = MyMod(ck)
        mod.submod.register_forward_hook(my_post_forward_hook)
        x = (torch.arange(16, dtype=D).reshape(4, 4) / 16).requires_grad_()
        calls.clear()
        mod(x).sum().backward()
        assert len(calls) == 1
        grads.append((x.grad, [p.grad for p in mod.parameters()]))
    assert_close(grads[1], grads[0])


@pytest.mark.parametrize("checkpoints", [None, 1, 3])
@pytest.mark.parametrize("where", ["remat", "scan", "both"])
def test_remat_scan_layout_change_offloadable(checkpoints, where):
    """memories_test.py test_remat_scan_layout_change_offloadable (its computation; the sharding
    constraint and the compiled-HLO checks have no counterpart): a scan over a one-element list
    of xs whose step names ``y`` (saved) and ``z``, ``w`` (offloaded), with a transpose between
    ``z`` and ``w``, under ``save_and_offload_only_these_names`` given to a remat around the
    scan, to the scan itself, or both; ``grad``, ``.backward()`` and grad-of-grad as without
    remat, and the named values kept as the policy says."""
    inp = torch.arange(32, dtype=D).reshape(8, 4) / 32
    policy = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["y"], names_which_can_be_offloaded=["z", "w"],
        offload_src="device", offload_dst="pinned_host",
    )

    def g(ys, _):
        y, _unused = ys
        y = checkpoint_name(torch.sin(y), "y")
        z = checkpoint_name(torch.sin(y), "z")
        z = z.T
        w = checkpoint_name(torch.sin(z), "w")
        return (w.T, torch.sum(w)), None

    def python_scan(f, init, xs):
        carry = init
        for i in range(xs[0].shape[0]):
            carry, _ = f(carry, [xs[0][i]])
        return carry, None

    def make(scanner):
        def f(x):
            (_, scan_out), _ = scanner(g, (x, torch.tensor(1.0, dtype=D)), [inp])
            return scan_out

        return f

    ref = make(python_scan)
    f = make(functools.partial(funckpt.scan, checkpoints=checkpoints, policy=None if where == "remat" else policy))
    if where != "scan":
        f = remat(f, policy=policy)
    assert_close(tf.grad(f)(inp), tf.grad(ref)(inp))
    x = inp.clone().requires_grad_()
    assert_close(torch.autograd.grad(f(x), x), torch.autograd.grad(ref(x), x))
    assert_close(tf.grad(lambda x: tf.grad(f)(x).sum())(inp), tf.grad(lambda x: tf.grad(ref)(x).sum())(inp))
    if where != "scan":
        kept = [(r.source.split("named ")[-1], r.offloaded) for r in funckpt.saved_residuals(f, inp.clone().requires_grad_()) if r.kind == "saved by policy"]
        assert kept and all(off == (name != "'y'") for name, off in kept), kept


# ----------------------------------------------- lax_control_flow_test.py: cond_with_new_checkpoint


def _cond_with_new_checkpoint(pred, true_fun, false_fun, *args):
    """lax_control_flow_test.py's ``cond_with_new_checkpoint``: the predicate, converted to an
    integer tensor, is passed as an argument to a remat'd function that selects the branch
    (``lax.switch`` on a concrete index: Python indexing)."""
    index = torch.as_tensor(pred).to(torch.int32)
    return remat(lambda index, *args: [false_fun, true_fun][int(index)](*args))(index, *args)


def _cond_plain(pred, true_fun, false_fun, *args):
    return true_fun(*args) if bool(pred) else false_fun(*args)


@pytest.mark.parametrize("xv", [3.14, 2.72])
def test_lcf_cond_jvp2_and_grad3(xv):
    """lax_control_flow_test.py testCondJVP2 / testCondGrad3 with ``cond_with_new_checkpoint``:
    one branch returns a constant, the other ``2 x``; jvp, grads to order 2 in both modes."""

    def mk(cond):
        return lambda x: cond(x < 3, lambda _: torch.tensor(2.0, dtype=D), lambda x: 2.0 * x, x)

    f, ref = mk(_cond_with_new_checkpoint), mk(_cond_plain)
    x = t(xv)
    assert_close(tf.jvp(f, (x,), (x,)), tf.jvp(ref, (x,), (x,)))
    assert_close(tf.grad(f)(x), tf.grad(ref)(x))
    assert_close(tf.grad(tf.grad(f))(x), tf.grad(tf.grad(ref))(x))
    assert_close(tf.jacfwd(tf.jacfwd(f))(x), tf.jacfwd(tf.jacfwd(ref))(x))


@pytest.mark.parametrize("xv", [2.14, 1.72])
def test_lcf_cond_grad2(xv):
    """lax_control_flow_test.py testCondGrad2 (its default ``cond_with_new_checkpoint``): a
    branch multiplying by a constant made inside it, the other ``sin``; grads to order 2, both
    modes, and gradgradcheck."""

    def mk(cond):
        return lambda x: cond(
            x[0] < 2, lambda x: torch.tensor([1.0, 2.0], dtype=x.dtype) * x, lambda x: torch.sin(x), x
        ).sum()

    f, ref = mk(_cond_with_new_checkpoint), mk(_cond_plain)
    x = xv * torch.ones(2, dtype=D)
    assert_close(tf.grad(f)(x), tf.grad(ref)(x))
    for J in (tf.jacrev, tf.jacfwd):
        assert_close(J(J(f))(x), J(J(ref))(x))
    assert torch.autograd.gradgradcheck(f, (x.clone().requires_grad_(),))


@pytest.mark.parametrize("xv", [3.14, 2.72])
def test_lcf_cond_grad4_closure(xv):
    """lax_control_flow_test.py testCondGrad4 with ``cond_with_new_checkpoint``: the true branch
    ignores its operand and uses ``y`` from the enclosing function's closure; gradients with
    respect to ``y`` (and ``x``), Hessians, and plain autograd."""

    def mk(cond):
        return lambda x, y: cond(x < 3, lambda _: 2.0 * torch.sin(y), lambda x: 2.0 * x, x)

    f, ref = mk(_cond_with_new_checkpoint), mk(_cond_plain)
    x, y = t(xv), t(5.8)
    assert_close(tf.grad(f, 1)(x, y), tf.grad(ref, 1)(x, y))
    assert_close(tf.grad(f, (0, 1))(x, y), tf.grad(ref, (0, 1))(x, y))
    assert_close(tf.hessian(f, (0, 1))(x, y), tf.hessian(ref, (0, 1))(x, y))
    xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
    kw = dict(allow_unused=True, materialize_grads=True)
    assert_close(torch.autograd.grad(f(xx, yy), (xx, yy), **kw), torch.autograd.grad(ref(xx, yy), (xx, yy), **kw))


def test_lcf_cond_linearize2_and_switch_grad():
    """lax_control_flow_test.py testCondLinearize2 (as jvp: ``torch.func.linearize`` traces, and
    a branch chosen by a tensor's value cannot be traced, with or without remat) and
    testSwitchGrad (an index out of range clamped, as ``lax.switch`` clamps), through a remat'd
    branch selection."""
    for v in (2.14, -2.14):

        def mk(cond):
            return lambda x: cond(
                x[0] < 2, lambda x: torch.tensor([1.0, 2.0], dtype=x.dtype) * x, lambda x: torch.cos(torch.sin(x)), x
            ).sum()

        x = v * torch.ones(2, dtype=D)
        assert_close(tf.jvp(mk(_cond_with_new_checkpoint), (x,), (x,)), tf.jvp(mk(_cond_plain), (x,), (x,)))

    branches = [
        (lambda i: (lambda x: torch.sin(x) * (i + 1)) if i % 2 else (lambda x: torch.cos(x) ** (i + 1)))(i)
        for i in range(4)
    ]
    x = torch.linspace(0.1, 1, 3, dtype=D)
    for i in range(-1, 5):
        idx = torch.tensor(i)
        f = lambda x: remat(lambda idx, x: branches[int(torch.clamp(idx, 0, 3))](x))(idx, x).sum()  # noqa: E731
        ref = lambda x: branches[min(max(i, 0), 3)](x).sum()  # noqa: E731
        assert_close(tf.grad(f)(x), tf.grad(ref)(x))
        assert_close(tf.hessian(f)(x), tf.hessian(ref)(x))
