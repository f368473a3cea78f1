"""Ports of jax tests/custom_api_test.py remat tests (CustomJVPTest/CustomVJPTest test_remat,
test_remat_higher_order, test_remat_pytree_arg, test_remat_nondiff_argnums, test_symbolic_zeros_remat).
custom_jvp / custom_vjp -> torch.autograd.Function (setup_context style) with a deliberately
'wrong' derivative 2*cos, so that using the custom rule is observable."""
import functools
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
from funckpt import remat, checkpoint
from tests.ports.common import *

class F(torch.autograd.Function):     # sin with derivative 2*cos (custom_jvp and custom_vjp)
    @staticmethod
    def forward(x): return torch.sin(x)
    @staticmethod
    def setup_context(ctx, inputs, output): ctx.save_for_backward(inputs[0]); ctx.save_for_forward(inputs[0])
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * torch.cos(x) * g
    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2 * torch.cos(x) * t
    @staticmethod
    def vmap(info, in_dims, x): return F.apply(x), in_dims[0]

g = lambda x: F.apply(F.apply(x))
REM = {"remat": remat, "checkpoint": lambda fn: (lambda *a: checkpoint(fn, *a, use_reentrant=False))}

@pytest.mark.parametrize("r", REM)
def test_custom_remat(r):
    rg = REM[r](g)
    x = t(2.)
    assert_close(rg(x), torch.sin(torch.sin(x)))
    exp = 4. * tf.grad(lambda x: torch.sin(torch.sin(x)))(x)
    assert_close(tf.grad(rg)(x), exp)
    assert_close(tf.jvp(rg, (x,), (t(1.),))[1], exp)
    assert_close(tf.jacfwd(rg)(x), exp)
    xx = x.clone().requires_grad_(); rg(xx).backward(); assert_close(xx.grad, exp)
    xs = torch.linspace(0, 1, 4, dtype=D)
    assert_close(tf.vmap(tf.grad(rg))(xs), tf.vmap(tf.grad(g))(xs))

@pytest.mark.parametrize("r", REM)
def test_custom_remat_higher_order(r):
    x = t(2.)
    R = REM[r]
    assert_close(tf.grad(tf.grad(R(g)))(x), tf.grad(tf.grad(g))(x))
    assert_close(tf.grad(R(tf.grad(g)))(x), tf.grad(tf.grad(g))(x))
    assert_close(tf.grad(tf.grad(tf.grad(R(g))))(x), tf.grad(tf.grad(tf.grad(g)))(x))
    assert_close(tf.jacfwd(tf.jacrev(R(g)))(x), tf.jacfwd(tf.jacrev(g))(x))
    assert_close(tf.hessian(R(g))(x), tf.hessian(g)(x))

class Mul(torch.autograd.Function):
    @staticmethod
    def forward(a, b): return a * b
    @staticmethod
    def setup_context(ctx, inputs, output): ctx.save_for_backward(*inputs)
    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a

def test_custom_remat_pytree_arg():
    gg = remat(lambda xy: torch.sin(Mul.apply(xy["a"], xy["b"])))
    xy = {"a": t(2.), "b": t(3.)}
    assert_close(gg(xy), torch.sin(t(6.)))
    assert_close(tf.grad(gg)(xy), {"a": torch.cos(t(6.)) * 3., "b": torch.cos(t(6.)) * 2.})

class FK(torch.autograd.Function):
    @staticmethod
    def forward(k, x): return torch.sin(k * x)
    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[0]; ctx.save_for_backward(torch.cos(inputs[0] * inputs[1]))
    @staticmethod
    def backward(ctx, g):
        (c,) = ctx.saved_tensors
        return None, ctx.k * c * g

def test_custom_remat_nondiff_argnums():
    gg = remat(lambda x: FK.apply(2., x) * 3.)
    assert_close(gg(t(.5)), 3. * torch.sin(t(1.)))
    assert_close(tf.grad(gg)(t(.5)), 3. * 2. * torch.cos(t(1.)))
    gs = remat(lambda k, x: FK.apply(k, x) * 3., static_argnums=(0,))
    assert_close(tf.grad(gs, argnums=1)(2., t(.5)), 3. * 2. * torch.cos(t(1.)))

class Ident(torch.autograd.Function):  # custom_vjp identity (JAX test_symbolic_zeros_remat)
    @staticmethod
    def forward(x): return x
    @staticmethod
    def setup_context(ctx, inputs, output): pass
    @staticmethod
    def backward(ctx, g): return g

class IdentClone(Ident):
    @staticmethod
    def forward(x): return x.clone()

@pytest.mark.parametrize("cls", [Ident, IdentClone])
def test_symbolic_zeros_remat(cls):
    foo = remat(lambda x: cls.apply(cls.apply(x)))
    assert_close(tf.grad(foo)(t(3.)), t(1.))
    xx = t(3., requires_grad=True); foo(xx).backward(); assert_close(xx.grad, t(1.))
