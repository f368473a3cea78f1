"""The bugs the ports found, each a statement of behaviour (bug 5, the last open, was fixed when the
jvp recomputation below every transform came to nest torch.func.jvp rather than make duals at its level)."""
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
from funckpt import remat, checkpoint, fori_loop, scan
D = torch.float64

def test_bug1_grad_of_vmap_nonleading_loop_square_is_transposed():
    c = torch.randn(3, 3, dtype=D); w = torch.arange(1., 4., dtype=D)
    body = lambda i, c: torch.sin(c) * (i + 1)
    loss = lambda loop: (lambda c: (tf.vmap(lambda c: loop(0, 2, body, c), in_dims=1)(c) * w[:, None]).sum())
    assert_close(tf.grad(loss(fori_loop))(c), tf.grad(loss(lambda lo, hi, b, c: b(1, b(0, c))))(c))

def test_bug2_remat_of_loop_passthrough_carry_under_grad_of_vmap():
    body = lambda i, c: (c[0], c[1] * 2)
    def f(use):
        loop = lambda a, b: fori_loop(0, 3, body, (a, b))
        loop = remat(loop) if use else loop
        return lambda a, b: (loop(a, b)[0] * loop(a, b)[1]).sum()
    A, B = torch.randn(5, 4, dtype=D), torch.randn(5, 4, dtype=D)
    g = lambda fn: tf.grad(lambda A, B: tf.vmap(fn)(A, B).sum(), argnums=(0, 1))(A, B)
    assert_close(g(f(True)), g(f(False)))

def test_bug3_vmap_out_dims_none_for_an_unbatched_output():
    f = lambda w, x: (w.sin(), x @ w)
    w, xs = torch.randn(2, 2, dtype=D), torch.randn(4, 2, dtype=D)
    assert_close(tf.vmap(remat(f), in_dims=(None, 0), out_dims=(None, 0))(w, xs), tf.vmap(f, in_dims=(None, 0), out_dims=(None, 0))(w, xs))

class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x
    @staticmethod
    def backward(ctx, g): return 2 * g

@pytest.mark.parametrize("wrap", ["remat", "checkpoint"])
def test_bug4_function_returning_its_input(wrap):
    f = lambda x: _Double.apply(x)
    g = remat(f) if wrap == "remat" else (lambda x: checkpoint(f, x, use_reentrant=False))
    a = torch.tensor(3.0, requires_grad=True); g(a).backward()
    assert a.grad.item() == 2.0

class _DoubleFn(torch.autograd.Function):
    @staticmethod
    def forward(x): return x
    @staticmethod
    def setup_context(ctx, inputs, output): pass
    @staticmethod
    def backward(ctx, g): return 2 * g
    @staticmethod
    def jvp(ctx, t): return 2 * t

def test_bug5_jvp_of_remat_with_view_returning_function():
    f = lambda x: _DoubleFn.apply(x * 1.0).sin()
    x = torch.tensor(3.0, dtype=D)
    assert_close(tf.jvp(remat(f), (x,), (torch.tensor(1., dtype=D),)), tf.jvp(f, (x,), (torch.tensor(1., dtype=D),)))

@pytest.mark.parametrize("ck", [None, 2])
def test_bug6_inplace_carry_update_with_nothing_to_differentiate(ck):
    def body(i, c):
        c[i] = i + 1.0
        return c
    assert_close(fori_loop(0, 3, body, torch.zeros(3), checkpoints=ck), torch.tensor([1., 2., 3.]))
