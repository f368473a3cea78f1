"""More ports from jax tests/lax_control_flow_test.py (while loops with many args, nested
while with dynamic_update_slice, conjunction condition, custom pytree carry)."""
import pytest, optree
import torch, torch.func as tf
from torch.testing import assert_close
import funckpt
from funckpt import while_loop, fori_loop, scan, remat
from tests.ports.common import *

W = list(WHILE_IMPLS)

@pytest.mark.parametrize("impl", W)
def test_testWhileWithManyArgs(impl):
    wl = WHILE_IMPLS[impl]
    out = wl(lambda s: s[0] < 2, lambda s: tuple(v + 1 for v in s), (0,) * 256)
    assert out == (2,) * 256
    xs = tuple(t(float(i + 1)) for i in range(64))
    f = lambda xs: sum(wl(lambda s: bool(s[0] < 2), lambda s: tuple(v * 1.5 for v in s), xs))
    g = tf.grad(f)(xs)
    assert_close(g, tuple(t(2.25) for _ in range(64)))

@pytest.mark.parametrize("impl", W)
@pytest.mark.parametrize("style", ["index_put", "clone_setitem", "inplace_setitem"])
def test_testNestedWhileWithDynamicUpdateSlice(impl, style, request):
    wl = WHILE_IMPLS[impl]
    num = 5
    def update(out, val, i, j):
        if style == "index_put":
            return out.index_put((torch.tensor(i), torch.tensor(j)), val)
        if style == "clone_setitem":
            out = out.clone(); out[i, j] = val; return out
        out[i, j] = val; return out
    def outer_loop(arr, loop):
        def body(state):
            i, arr, out = state
            return i + 1, arr, inner_loop(i, arr, out, loop)
        return loop(lambda s: s[0] < num, body, (0, arr, torch.zeros_like(arr)))[2]
    def inner_loop(i, arr, out, loop):
        def body(state):
            j, arr, out = state
            return j + 1, arr, update(out, arr[i, j], i, j)
        return loop(lambda s: s[0] <= i, body, (0, arr, out))[2]
    arr = randn(5, 5, seed=1)
    assert_close(outer_loop(arr, wl), torch.tril(arr))
    if style == "inplace_setitem":
        return
    g = tf.grad(lambda a: (outer_loop(a, wl) * torch.arange(25., dtype=D).reshape(5, 5)).sum())(arr)
    assert_close(g, torch.tril(torch.arange(25., dtype=D).reshape(5, 5)))

@pytest.mark.parametrize("impl", W)
def test_testLoopWithConjunctionCondition(impl):
    wl = WHILE_IMPLS[impl]
    def sum_first_n(arr, num):
        def cond(s):
            arr, num, i, _ = s
            return (i < num) and (i < arr.shape[0])
        def body(s):
            arr, num, i, total = s
            return arr, num, i + 1, total + arr[i]
        return wl(cond, body, (arr, num, 0, t(0.)))[3]
    x = randn(10, seed=2)
    for num in [0, 5, 10, 15]:
        assert_close(sum_first_n(x, num), x[:num].sum())
        assert_close(tf.grad(lambda x: sum_first_n(x, num))(x), (torch.arange(10) < num).to(D))

class Node:
    def __init__(self, x, y): self.x, self.y = x, y
optree.register_pytree_node(Node, lambda o: ((o.x, o.y), None, None), lambda _, xy: Node(*xy), namespace="funckpt")

@pytest.mark.parametrize("impl", W)
def test_testWhileLoopCustomPytree(impl):
    wl = WHILE_IMPLS[impl]
    out = wl(lambda o: bool(o.x > 0.), lambda c: Node(c.x - 1., c.y * 2.), Node(t(2.), t(1.5)))
    assert_close((out.x, out.y), (t(0.), t(6.)))
    g = tf.grad(lambda y: wl(lambda o: bool(o.x > 0.), lambda c: Node(c.x - 1., c.y * c.y), Node(t(2.), y)).y)(t(1.5))
    assert_close(g, 4 * t(1.5) ** 3)
