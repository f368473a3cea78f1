"""Ports of jax tests/memories_test.py remat offload tests (CPU: offloaded values are simply kept)."""
import functools
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
import funckpt
from funckpt import remat, scan, policies, checkpoint_name
from tests.ports.common import *

def test_remat_jaxpr_offloadable():
    policy = policies.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=["a", "b", "c"],
                                                       offload_src="device", offload_dst="pinned_host")
    def f(x):
        x = checkpoint_name(torch.sin(x), "a")
        x = checkpoint_name(torch.sin(x), "b")
        x = checkpoint_name(torch.sin(x), "c")
        return torch.sum(x)
    rf = remat(f, policy=policy)
    inp = torch.arange(16., dtype=D)
    assert_close(tf.grad(rf)(inp), tf.grad(f)(inp))
    rs = funckpt.saved_residuals(rf, inp.clone().requires_grad_())
    kept = [r for r in rs if r.kind != "input"]
    assert len(kept) == 3, rs
    assert all(r.offloaded for r in kept), rs
    assert_close(tf.hessian(rf)(inp[:4]), tf.hessian(f)(inp[:4]))
    assert_close(tf.vmap(tf.grad(rf))(inp.reshape(4, 4)), tf.vmap(tf.grad(f))(inp.reshape(4, 4)))

def test_remat_scan_offload_names_exclusive():
    with pytest.raises(ValueError):
        policies.save_and_offload_only_these_names(names_which_can_be_saved=["y"], names_which_can_be_offloaded=["y", "w"],
                                                   offload_src="device", offload_dst="pinned_host")

@pytest.mark.parametrize("impl", list(SCAN_IMPLS))
@pytest.mark.parametrize("transpose", [False, True])
def test_remat_scan_jaxpr_offloadable(impl, transpose):
    """also test_remat_scan_layout_change_offloadable (transpose=True)."""
    sc = SCAN_IMPLS[impl]
    policy = policies.save_and_offload_only_these_names(names_which_can_be_saved=["y"], names_which_can_be_offloaded=["z", "w"],
                                                       offload_src="device", offload_dst="pinned_host")
    np_inp = torch.arange(16 * 8, dtype=D).reshape(16, 8) / 100
    def make(s):
        def f(x):
            def g(ys, _):
                y, _ = ys
                y = checkpoint_name(torch.sin(y), "y")
                z = checkpoint_name(torch.sin(y), "z")
                if transpose: z = z.T
                w = checkpoint_name(torch.sin(z), "w")
                return ((w.T if transpose else w), torch.sum(w)), None
            _, scan_out = s(g, (x, torch.tensor(1., dtype=D)), [np_inp])[0]
            return scan_out
        return f
    rf = remat(make(sc), policy=policy)
    ref = make(scan_reference)
    x = np_inp.clone()
    assert_close(tf.grad(rf)(x), tf.grad(ref)(x))
    xx = x.clone().requires_grad_(); rf(xx).backward(); assert_close(xx.grad, tf.grad(ref)(x))
    # policy passed to the scan itself
    def inner(x):
        def g(ys, _):
            y, _ = ys
            y = checkpoint_name(torch.sin(y), "y"); z = checkpoint_name(torch.sin(y), "z")
            w = checkpoint_name(torch.sin(z), "w")
            return (w, torch.sum(w)), None
        return scan(g, (x, torch.tensor(1., dtype=D)), [np_inp], policy=policy)[0][1]
    assert_close(tf.grad(inner)(x), tf.grad(make(scan_reference) if not transpose else (lambda x: inner(x)))(x))

def test_remat_checkpoint_dots_with_no_batch_dims_offload():
    policy = policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    def f(x):
        for _ in range(3):
            x = torch.sin(torch.einsum("ij,jk->ik", x, x))
        return torch.sum(x)
    rf = remat(f, policy=policy)
    inp = torch.ones(2, 2, dtype=D) * 0.3
    assert_close(tf.grad(rf)(inp), tf.grad(f)(inp))
    rs = funckpt.saved_residuals(rf, inp.clone().requires_grad_())
    assert len([r for r in rs if r.offloaded]) == 3, rs
    check_grads(rf, f, (inp,))

def test_primitive_with_multiple_outputs_offload():
    policy = policies.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=["foo"],
                                                       offload_src="device", offload_dst="pinned_host")
    def f(x):
        x1, _ = torch.topk(x, k=2)
        x1 = checkpoint_name(x1, "foo")
        return torch.sum(x1 * x1)
    rf = remat(f, policy=policy)
    inp = torch.arange(128., dtype=D) / 7
    assert_close(tf.grad(rf)(inp), tf.grad(f)(inp))
    assert_close(tf.vmap(tf.grad(rf))(inp.reshape(4, 32)), tf.vmap(tf.grad(f))(inp.reshape(4, 32)))
    xx = inp.clone().requires_grad_(); rf(xx).backward(); assert_close(xx.grad, tf.grad(f)(inp))
