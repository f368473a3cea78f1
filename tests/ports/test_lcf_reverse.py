"""testScanGrad/JVP/Vmap with reverse=True (jax test_scan_reverse extended to derivatives)."""
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
from tests.ports.common import *

def make_f(d):
    def f(c, a):
        b = torch.cos(torch.sum(torch.sin(a)) + torch.sum(torch.cos(c)) + torch.sum(d))
        return torch.sin(c * b), b
    return f

@pytest.mark.parametrize("impl", list(SCAN_IMPLS))
def test_scan_reverse_derivatives(impl):
    sc = SCAN_IMPLS[impl]
    d = randn(2, seed=1); f = make_f(d)
    as_, c = randn(5, 3, seed=2), randn(4, seed=3)
    run = lambda c, as_: sc(f, c, as_, reverse=True)
    ref = lambda c, as_: scan_reference(f, c, as_, reverse=True)
    assert_close(run(c, as_), ref(c, as_))
    check_grads(run, ref, (c, as_), order=2)
    assert_close(tf.vmap(run)(randn(3, 4, seed=4), randn(3, 5, 3, seed=5)), tf.vmap(ref)(randn(3, 4, seed=4), randn(3, 5, 3, seed=5)))
    g = lambda fn: tf.grad(lambda c, a: tf.vmap(fn)(c, a)[1].sum(), argnums=(0, 1))(randn(3, 4, seed=4), randn(3, 5, 3, seed=5))
    assert_close(g(run), g(ref))
