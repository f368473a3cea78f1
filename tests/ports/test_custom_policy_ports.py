"""RematTest.test_remat_custom_jvp_policy / test_remat_custom_vjp_policy / test_remat_custom_jvp_linear_policy,
listed as 'skipped' in tests/test_jax_ports.py ("no torch equivalent of custom_jvp under remat
policies"): an autograd.Function with setup_context + jvp (+ vmap) is that equivalent."""
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
from funckpt import remat, scan, policies
from tests.ports.common import *
from tests.fakes import OpCounter

class Sin(torch.autograd.Function):
    @staticmethod
    def forward(x): return torch.sin(x)
    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0]); ctx.save_for_forward(inputs[0])
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * g
    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * t
    @staticmethod
    def vmap(info, in_dims, x): return Sin.apply(x), in_dims[0]

class Sum0(torch.autograd.Function):
    @staticmethod
    def forward(x): return torch.sum(x, dim=0)
    @staticmethod
    def setup_context(ctx, inputs, output): ctx.shape = inputs[0].shape
    @staticmethod
    def backward(ctx, g): return g.expand(ctx.shape)
    @staticmethod
    def jvp(ctx, t): return Sum0.apply(t)
    @staticmethod
    def vmap(info, in_dims, x):
        d = in_dims[0]
        if d is None: return Sum0.apply(x), None
        return Sum0.apply(x.movedim(d, 1)), 0

def f_ref(x):
    for _ in range(3):
        x = x @ x if x.dim() == 2 else x * x
        x = Sin.apply(x * 1e-3)
    return x

@pytest.mark.parametrize("policy", [policies.dots_saveable, policies.dots_with_no_batch_dims_saveable, policies.everything_saveable, None])
@pytest.mark.parametrize("shape", [(), (2, 2)])
def test_remat_custom_jvp_policy(policy, shape):
    f = remat(f_ref, policy=policy)
    x = torch.full(shape, 3., dtype=D) if shape else t(3.)
    check_grads(f, f_ref, (x,))
    for ck in (None, 1):
        g = lambda x: scan(lambda x, _: (f(x), None), x, None, length=2, checkpoints=ck)[0]
        gr = lambda x: scan_reference(lambda x, _: (f_ref(x), None), x, None, length=2)[0]
        check_grads(g, gr, (x,))

@pytest.mark.parametrize("policy", [policies.dots_saveable, None])
def test_remat_custom_jvp_linear_policy(policy):
    f = remat(lambda x: Sum0.apply(x), policy=policy)
    ref = lambda x: Sum0.apply(x)
    check_grads(f, ref, (torch.ones(3, dtype=D),))
    for ck in (None, 2):
        g = lambda x: scan(lambda _, x: (None, f(x)), None, x, checkpoints=ck)[1]
        gr = lambda x: scan_reference(lambda _, x: (None, ref(x)), None, x)[1]
        check_grads(g, gr, (torch.ones(2, 3, dtype=D),))

class FunkySin(torch.autograd.Function):
    """sin whose forward computes (sin, cos) together and keeps cos for its derivative."""
    @staticmethod
    def forward(x):
        return torch.sin(x), torch.cos(x)
    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1]); ctx.save_for_forward(output[1])
    @staticmethod
    def backward(ctx, g, _):
        (c,) = ctx.saved_tensors
        return c * g
    @staticmethod
    def jvp(ctx, t, _):
        (c,) = ctx.saved_tensors
        return c * t, None

funky = lambda x: FunkySin.apply(x)[0]

def scan_apply(f, x, ck=None):
    return scan(lambda x, _: (f(x), None), x, None, length=1, checkpoints=ck)[0]

@pytest.mark.parametrize("pname", ["save_cos", "save_sin", "everything", "nothing"])
@pytest.mark.parametrize("ck", [None, 1])
def test_remat_of_scan_funky_custom_jvp(pname, ck):
    aten = torch.ops.aten
    pol = {"save_cos": lambda op, *a, **k: op.overloadpacket is aten.cos, "save_sin": lambda op, *a, **k: op.overloadpacket is aten.sin,
           "everything": policies.everything_saveable, "nothing": policies.nothing_saveable}[pname]
    f = remat(lambda x: scan_apply(funky, x, ck), policy=pol)
    ref = lambda x: funky(x)
    check_grads(f, ref, (t(3.),), order=2, modes=["rev"])
    f2 = remat(lambda x: scan_apply(funky, scan_apply(funky, x, ck), ck), policy=pol)
    check_grads(f2, lambda x: funky(funky(x)), (t(3.),), order=2, modes=["rev"])
    x = t(4., requires_grad=True)
    y = f(x)
    with OpCounter() as c:
        torch.autograd.grad(y, x)
    # (informational) JAX: save_cos/everything -> no cos in the linearized jaxpr
    print(pname, ck, dict(sin=c.counts[aten.sin], cos=c.counts[aten.cos]))
