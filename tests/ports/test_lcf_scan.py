"""Ports of jax tests/lax_control_flow_test.py scan tests (commit cec06d11)."""
import functools, itertools
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
import funckpt
from funckpt import remat, scan, fori_loop, while_loop, policies, checkpoint_name
from tests.ports.common import *

def make_f(d, variant="impl"):
    def f(c, a):
        assert a.shape == (3,), a.shape
        assert c.shape == (4,), c.shape
        if variant == "grad":
            b = torch.sum(torch.sin(a)) + torch.sum(torch.sin(c)) + torch.sum(torch.sin(d))
        else:
            b = torch.cos(torch.sum(torch.sin(a)) + torch.sum(torch.cos(c)) + torch.sum(d))
        c = torch.sin(c * b)
        assert b.shape == ()
        return c, b
    return f

IMPLS = list(SCAN_IMPLS)

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanImpl(impl):
    d = randn(2, seed=1); f = make_f(d)
    as_, c = randn(5, 3, seed=2), randn(4, seed=3)
    assert_close(SCAN_IMPLS[impl](f, c, as_), scan_reference(f, c, as_))

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanJVP(impl):
    d = randn(2, seed=1); f = make_f(d)
    as_, c = randn(5, 3, seed=2), randn(4, seed=3)
    sc = SCAN_IMPLS[impl]
    ans = tf.jvp(lambda c, as_: sc(f, c, as_), (c, as_), (c, as_))
    exp = tf.jvp(lambda c, as_: scan_reference(f, c, as_), (c, as_), (c, as_))
    assert_close(ans, exp)
    check_grads(lambda c, as_: sc(f, c, as_), lambda c, as_: scan_reference(f, c, as_), (c, as_), order=2, modes=["fwd"])

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanLinearize(impl):
    d = randn(2, seed=1); f = make_f(d)
    as_, c = randn(5, 3, seed=2), randn(4, seed=3)
    sc = SCAN_IMPLS[impl]
    _, lin = tf.linearize(lambda c, as_: sc(f, c, as_), c, as_)
    _, lin_ref = tf.linearize(lambda c, as_: scan_reference(f, c, as_), c, as_)
    assert_close(lin(c, as_), lin_ref(c, as_))

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanGrad(impl):
    d = randn(2, seed=1); f = make_f(d, "grad")
    as_, c = randn(5, 3, seed=2), randn(4, seed=3)
    sc = SCAN_IMPLS[impl]
    ans = tf.grad(lambda c, as_: sc(f, c, as_)[0].sum(), argnums=(0, 1))(c, as_)
    exp = tf.grad(lambda c, as_: scan_reference(f, c, as_)[0].sum(), argnums=(0, 1))(c, as_)
    assert_close(ans, exp)
    check_grads(lambda c, as_: sc(f, c, as_), lambda c, as_: scan_reference(f, c, as_), (c, as_), order=2, modes=["rev"])
    # gradcheck / gradgradcheck with plain autograd
    leaves = (c.clone().requires_grad_(), as_.clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda c, as_: sc(f, c, as_), leaves)
    assert torch.autograd.gradgradcheck(lambda c, as_: sc(f, c, as_), leaves)

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanRnn(impl):
    sc = SCAN_IMPLS[impl]
    n_in, n_hid, n_out, length = 4, 2, 1, 3
    W_trans, W_out = randn(n_hid, n_hid + n_in, seed=1), randn(n_out, n_hid + n_in, seed=2)
    params = (W_trans, W_out)
    inputs, targets = randn(length, n_in, seed=3), randn(length, n_out, seed=4)
    def step(params, state, input):
        W_trans, W_out = params
        stacked = torch.cat([state, input])
        return torch.tanh(W_trans @ stacked), torch.tanh(W_out @ stacked)
    def make_loss(s):
        def loss(params, inputs, targets):
            _, outputs = s(functools.partial(step, params), torch.zeros(n_hid, dtype=D), inputs)
            return torch.sum((outputs - targets) ** 2)
        return loss
    loss, ref = make_loss(sc), make_loss(scan_reference)
    assert_close(loss(params, inputs, targets), ref(params, inputs, targets))
    assert_close(tf.jvp(lambda p: loss(p, inputs, targets), (params,), (params,)),
                 tf.jvp(lambda p: ref(p, inputs, targets), (params,), (params,)))
    check_grads(loss, ref, (params, inputs, targets), order=2)
    _, lin = tf.linearize(loss, params, inputs, targets)
    assert_close(lin(params, inputs, targets), tf.jvp(ref, (params, inputs, targets), (params, inputs, targets))[1])
    bi, bt = randn(7, length, n_in, seed=5), randn(7, length, n_out, seed=6)
    assert_close(tf.vmap(lambda x, y: loss(params, x, y))(bi, bt), torch.stack([ref(params, x, y) for x, y in zip(bi, bt)]))
    # per-example grads
    assert_close(tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(params, bi, bt),
                 tf.vmap(tf.grad(ref), in_dims=(None, 0, 0))(params, bi, bt))

@pytest.mark.parametrize("impl", IMPLS)
def test_testIssue711(impl):
    """grad through a scan whose step itself takes a grad; carry (python int i, tensor x)."""
    sc = SCAN_IMPLS[impl]
    def make(s):
        def minimize_structure(test_params):
            energy_fn = functools.partial(lambda conf, params: torch.sum(conf * params), params=test_params)
            def apply_carry(carry, _):
                i, x = carry
                new_x = x - 0.1 * tf.grad(energy_fn)(x)
                return (i + 1, new_x), _
            x0 = t([1., 2., 3.])
            (i, x_final), _ = s(apply_carry, (0, x0), torch.zeros(75, 0, dtype=D))
            return i, x_final
        def loss(p):
            return torch.sum(torch.sin(1.0 - minimize_structure(p)[1]))
        return minimize_structure, loss
    ms, loss = make(sc); ms_r, loss_r = make(scan_reference)
    i, xf = ms(t(0.5)); ir, xfr = ms_r(t(0.5))
    assert i == ir == 75
    assert_close(xf, xfr)
    assert_close(tf.grad(loss)(t(0.25)), tf.grad(loss_r)(t(0.25)))
    p = t(0.25, requires_grad=True); loss(p).backward()
    assert_close(p.grad, tf.grad(loss_r)(t(0.25)))

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanHigherOrderDifferentiation(impl):
    sc = SCAN_IMPLS[impl]
    d = 0.75
    def f(c, a):
        b = torch.sin(c * torch.sum(torch.cos(d * a)))
        c = 0.9 * torch.cos(d * torch.sum(torch.sin(c * a)))
        return c, b
    as_ = torch.arange(6., dtype=D).reshape(3, 2); c = t(1.0)
    check_grads(lambda c, as_: sc(f, c, as_), lambda c, as_: scan_reference(f, c, as_), (c, as_), order=2)
    leaves = (c.clone().requires_grad_(), as_.clone().requires_grad_())
    assert torch.autograd.gradgradcheck(lambda c, as_: sc(f, c, as_), leaves)
    assert_close(tf.hessian(lambda c: sc(f, c, as_)[0])(c), tf.hessian(lambda c: scan_reference(f, c, as_)[0])(c))

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("in_axes", [a for a in itertools.product([None, 0, 1], [None, 0, 1, 2]) if a != (None, None)])
def test_testScanVmap(impl, in_axes, request):
    sc = SCAN_IMPLS[impl]
    d = randn(2, seed=1); f = make_f(d)
    as_shape, c_shape = [5, 3], [4]
    cb, ab = in_axes
    if cb is not None: c_shape.insert(cb, 7)
    if ab is not None: as_shape.insert(ab, 7)
    as_, c = randn(*as_shape, seed=2), randn(*c_shape, seed=3)
    ans = tf.vmap(lambda c, as_: sc(f, c, as_), in_dims=in_axes)(c, as_)
    exp = tf.vmap(lambda c, as_: scan_reference(f, c, as_), in_dims=in_axes)(c, as_)
    assert_close(ans, exp)
    # and its gradient (vmap of grad and grad of vmap)
    g = tf.grad(lambda c, as_: (lambda o: o[0].sum() + o[1].sum())(tf.vmap(lambda c, as_: sc(f, c, as_), in_dims=in_axes)(c, as_)), argnums=(0, 1))(c, as_)
    gr = tf.grad(lambda c, as_: (lambda o: o[0].sum() + o[1].sum())(tf.vmap(lambda c, as_: scan_reference(f, c, as_), in_dims=in_axes)(c, as_)), argnums=(0, 1))(c, as_)
    assert_close(g, gr)

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanVmapTuples(impl):
    sc = SCAN_IMPLS[impl]
    def f(c, a):
        a1, a2 = a; c1, c2 = c
        b = torch.sum(torch.cos(a1)) * torch.sum(c2 * a2)
        return (c1 * torch.sin(torch.sum(a1 * a2)), c2 * torch.cos(torch.sum(a1))), b
    in_axes = (0, (1, 2))
    as_ = (randn(3, 7, seed=1), randn(3, 4, 7, seed=2)); c = (randn(7, 2, seed=3), randn(7, seed=4))
    ans = tf.vmap(lambda c, as_: sc(f, c, as_), in_dims=in_axes)(c, as_)
    exp = tf.vmap(lambda c, as_: scan_reference(f, c, as_), in_dims=in_axes)(c, as_)
    assert_close(ans, exp)
    g = tf.grad(lambda c, as_: (lambda o: sum(l.sum() for l in torch.utils._pytree.tree_leaves(o)))(tf.vmap(lambda c, as_: sc(f, c, as_), in_dims=in_axes)(c, as_)), argnums=(0, 1))(c, as_)
    gr = tf.grad(lambda c, as_: (lambda o: sum(l.sum() for l in torch.utils._pytree.tree_leaves(o)))(tf.vmap(lambda c, as_: scan_reference(f, c, as_), in_dims=in_axes)(c, as_)), argnums=(0, 1))(c, as_)
    assert_close(g, gr)

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanVmapFixpoint(impl, request):
    """carry is a 4-tuple, last element batched, shifted left each step (batchedness moves)."""
    sc = SCAN_IMPLS[impl]
    def f(carry_init, s):
        def body(c, x):
            return (c[1], c[2], c[3], torch.zeros((), dtype=D)), None
        return s(body, (t(0.), t(1.), t(2.), carry_init), torch.zeros(2, dtype=D))
    ci = t([3., 4., 5.])
    out = tf.vmap(lambda c: f(c, sc)[0])(ci)
    assert_close(out[3], t([0., 0., 0.])); assert_close(out[2], t([0., 0., 0.]))
    assert_close(out[1], ci); assert_close(out[0], t([2., 2., 2.]))
    # gradient of the batched fixpoint
    g = tf.grad(lambda c: tf.vmap(lambda c: f(c, sc)[0])(c)[1].pow(2).sum())(ci)
    assert_close(g, 2 * ci)

@pytest.mark.parametrize("impl", IMPLS)
def test_testIssue757(impl):
    sc = SCAN_IMPLS[impl]
    def loop(val, s):
        def apply_carry(x, i):
            return tf.grad(torch.cos)(x), i
        return s(apply_carry, val, torch.arange(10))[0]
    a = t(0.5)
    assert_close(tf.jacfwd(lambda v: loop(v, sc))(a), tf.jacfwd(lambda v: loop(v, scan_reference))(a))
    assert_close(tf.jacrev(lambda v: loop(v, sc))(a), tf.jacrev(lambda v: loop(v, scan_reference))(a))

@pytest.mark.parametrize("impl", IMPLS)
def test_testIssue1361(impl):
    """carry (tensor x, python float 0.) -> (2x, 0.)"""
    sc = SCAN_IMPLS[impl]
    def run(x, s):
        (x, _), _ = s(lambda carry, _: ((2 * carry[0], 0.), None), (x, 0.), torch.arange(3))
        return x
    assert_close(tf.grad(lambda x: run(x, sc))(t(0.)), t(8.))
    assert_close(tf.grad(lambda x: run(x, sc))(t(1.5)), t(8.))

@pytest.mark.parametrize("impl", IMPLS)
def test_testScanLengthArg(impl):
    sc = SCAN_IMPLS[impl]
    ans = sc(lambda c, _: (c + 1, c), 0, None, length=10)[1]
    assert_close(torch.as_tensor(ans), torch.arange(10))
    ans = sc(lambda c, _: (c + 1, c), torch.tensor(0), None, length=10)[1]
    assert_close(ans, torch.arange(10))

@pytest.mark.parametrize("impl", IMPLS)
def test_test_scan_reverse(impl):
    sc = SCAN_IMPLS[impl]
    x = torch.tensor([3, 1, 4, 1, 5, 9])
    cumsum = lambda x, reverse: sc(lambda c, x: (c + x, c + x), torch.tensor(0), x, reverse=reverse)[1]
    assert_close(cumsum(x, False), torch.cumsum(x, 0))
    assert_close(cumsum(x, True), torch.cumsum(x.flip(0), 0).flip(0))
    # differentiable version
    xf = x.to(D)
    g = tf.grad(lambda x: (sc(lambda c, x: (c + x, c + x), t(0.), x, reverse=True)[1] * torch.arange(6.)).sum())(xf)
    gr = tf.grad(lambda x: (scan_reference(lambda c, x: (c + x, c + x), t(0.), x, reverse=True)[1] * torch.arange(6.)).sum())(xf)
    assert_close(g, gr)

@pytest.mark.parametrize("impl", IMPLS)
def test_test_scan_xs_none(impl):
    sc = SCAN_IMPLS[impl]
    h, ys = sc(lambda h, _: (h + 1, None), 0, length=20)
    assert h == 20 and ys is None

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8])
def test_test_scan_init_weak_type_tensor(impl, dtype):
    """JAX: init Python 0 (weak type). torch: init a 0-dim tensor of that dtype."""
    sc = SCAN_IMPLS[impl]
    x = torch.ones(5, dtype=dtype)
    carry, result = sc(lambda c, x: (c + x, x), torch.zeros((), dtype=dtype), x)
    assert carry == x.sum().to(dtype); assert_close(result, x)

@pytest.mark.parametrize("impl", IMPLS)
def test_test_scan_vjp_forwards_extensive_residuals(impl):
    sc = SCAN_IMPLS[impl]
    def cumprod(x, s):
        s0 = torch.ones(2, 32, dtype=D)
        return s(lambda s, x: (x * s, s), s0, x)
    x = randn(32, 2, 32, seed=1) * 0.5 + 1
    out, vjp = tf.vjp(lambda x: cumprod(x, sc), x)
    outr, vjpr = tf.vjp(lambda x: cumprod(x, scan_reference), x)
    assert_close(out, outr)
    ct = (randn(2, 32, seed=2), randn(32, 2, 32, seed=3))
    assert_close(vjp(ct), vjpr(ct))
    r = remat(lambda x: cumprod(x, sc))
    out, vjp = tf.vjp(r, x)
    assert_close(vjp(ct), vjpr(ct))

@pytest.mark.parametrize("impl", IMPLS)
def test_test_scan_hoisting_consts(impl):
    sc = SCAN_IMPLS[impl]
    A = torch.arange(4., dtype=D).reshape(2, 2); B = A + 1.
    def f(x, s):
        def body(c, _):
            c1, c2, c3 = c
            return (A @ c1, B @ c2, torch.sin(B) @ c3), None
        init = (x * torch.ones(2, dtype=D),) * 3
        (c1, c2, c3), _ = s(body, init, None, length=3)
        return c1.sum() + c2.sum() + c3.sum()
    assert_close(tf.grad(lambda x: f(x, sc))(t(1.)), tf.grad(lambda x: f(x, scan_reference))(t(1.)))
    # consts requiring grad, closed over
    Ag = A.clone().requires_grad_(); 
    def f2(s):
        (c, _), _ = s(lambda c, _: ((Ag @ c[0], c[1]), None), (torch.ones(2, dtype=D), 0), None, length=3)
        return c.sum()
    g, = torch.autograd.grad(f2(sc), Ag); gr, = torch.autograd.grad(f2(scan_reference), Ag)
    assert_close(g, gr)

@pytest.mark.parametrize("impl", IMPLS)
def test_test_scan_fixpoint_instantiate(impl):
    sc = SCAN_IMPLS[impl]
    def f(x, s):
        c, ys = s(lambda c, _: ((torch.zeros((), dtype=D), torch.zeros((), dtype=D)), ()), (x, t(0.)), (), length=5)
        return sum(c)
    assert_close(tf.grad(lambda x: f(x, sc))(t(1.)), t(0.))

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed,nbc,nin,nnon", list(itertools.product(range(2), range(3), range(3), range(3))))
def test_test_scan_constification_correctness(impl, seed, nbc, nin, nnon):
    sc = SCAN_IMPLS[impl]
    g = torch.Generator().manual_seed(seed)
    num_carry = nin + nnon + 4
    perm = torch.randperm(num_carry, generator=g).tolist(); iperm = sorted(range(num_carry), key=lambda i: perm[i])
    body_consts = [torch.randn(3, generator=g, dtype=D) for _ in range(nbc)]
    init_vals = list(torch.rand(num_carry, generator=g, dtype=D).unbind())
    def body(c, _):
        c = [c[i] for i in iperm]
        inpl, noninpl, dont = split_lengths(c, [nin, nnon])
        dont = [torch.sin(x) * sum(torch.sum(b) for b in body_consts) for x in dont]
        new = [*inpl, *dont, *noninpl]
        return [new[i] for i in perm], [0 for _ in range(3)]
    xs = [torch.arange(2., dtype=D) for _ in range(2)]
    outs = sc(body, init_vals, xs)[0]
    ref = scan_reference(body, init_vals, xs)[0]
    assert_close(outs, ref)
    # and its vjp
    o, vjp = tf.vjp(lambda iv: sc(body, iv, xs)[0], init_vals)
    orr, vjpr = tf.vjp(lambda iv: scan_reference(body, iv, xs)[0], init_vals)
    ct = [torch.full((), float(i + 1), dtype=D) for i in range(num_carry)]
    assert_close(vjp(ct), vjpr(ct))

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed,nbc,ncf,nif", list(itertools.product(range(2), range(3), range(3), range(3))))
def test_test_scan_forwarding_correctness(impl, seed, nbc, ncf, nif):
    sc = SCAN_IMPLS[impl]
    g = torch.Generator().manual_seed(seed)
    num_carry, num_xs = ncf + 4, nif + 2
    num_ys = num_xs + 1
    carry_perm = torch.randperm(num_carry, generator=g).tolist(); carry_iperm = sorted(range(num_carry), key=lambda i: carry_perm[i])
    xs_perm = torch.randperm(num_xs, generator=g).tolist(); ys_perm = torch.randperm(num_ys, generator=g).tolist()
    body_consts = [torch.randn(3, generator=g, dtype=D) for _ in range(nbc)]
    init_vals = list(torch.rand(num_carry, generator=g, dtype=D).unbind())
    def body(c, x):
        c = [c[i] for i in carry_iperm]
        fw, dont = split_lengths(c, [ncf])
        dont = [torch.sin(v) * sum(torch.sum(b) for b in body_consts) for v in dont]
        newp = [*fw, *dont]; new_c = [newp[i] for i in carry_perm]
        x = [x[i] for i in xs_perm]
        xf, xd = split_lengths(x, [nif])
        xd = [torch.cos(v) * sum(torch.sum(b) for b in body_consts) for v in xd]
        y = [*xf, *xd, 0.]
        return new_c, [y[i] for i in ys_perm]
    xs = list(torch.rand(num_xs, 2, generator=g, dtype=D).unbind())
    final, outs = sc(body, init_vals, xs)
    fr, outr = scan_reference(body, init_vals, xs)
    assert_close(final, fr); assert_close(outs, outr)
    (o, vjp) = tf.vjp(lambda iv, xs: sc(body, iv, xs), init_vals, xs)
    (orr, vjpr) = tf.vjp(lambda iv, xs: scan_reference(body, iv, xs), init_vals, xs)
    assert_close(o, orr)
    assert_close(vjp(orr), vjpr(orr))
    # plain autograd too
    ivs = [v.clone().requires_grad_() for v in init_vals]; xss = [v.clone().requires_grad_() for v in xs]
    out = sc(body, ivs, xss)
    loss = sum((a * b).sum() for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(orr)))
    gs = torch.autograd.grad(loss, ivs + xss, allow_unused=True, materialize_grads=True)
    assert_close(list(gs), list(vjpr(orr)[0]) + list(vjpr(orr)[1]))

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed,nrc,ncf,ncaf,nif", [(s, a, b, c, d) for s in range(2) for a, b, c, d in [(0,0,0,0),(1,2,1,0),(2,1,2,3),(0,3,0,2),(3,0,3,1)]])
def test_test_scan_vjp_forwarding_correctness(impl, seed, nrc, ncf, ncaf, nif):
    """custom_jvp foo replaced by an autograd.Function with setup_context + jvp."""
    sc = SCAN_IMPLS[impl]
    class Foo(torch.autograd.Function):
        @staticmethod
        def forward(x): return 3. * x
        @staticmethod
        def setup_context(ctx, inputs, output): pass
        @staticmethod
        def backward(ctx, g): return 3. * g
        @staticmethod
        def jvp(ctx, xd): return 3. * xd
        @staticmethod
        def vmap(info, in_dims, x): return 3. * x, in_dims[0]
    g = torch.Generator().manual_seed(seed)
    num_const, num_carry, num_xs = ncf + 2, ncaf + 4, nif + 2
    num_ys = num_xs + 1
    carry_perm = torch.randperm(num_carry, generator=g).tolist(); carry_iperm = sorted(range(num_carry), key=lambda i: carry_perm[i])
    xs_perm = torch.randperm(num_xs, generator=g).tolist(); ys_perm = torch.randperm(num_ys, generator=g).tolist()
    body_consts = [torch.randn(3, generator=g, dtype=D) for _ in range(num_const)]
    init_vals = list(torch.rand(num_carry, 3, generator=g, dtype=D).unbind())
    import math
    def body(c, x):
        c = [c[i] for i in carry_iperm]
        const_fwds, const_dont = split_lengths(body_consts, [ncf])
        z = sum(const_dont)
        cf, cd = split_lengths(c, [ncf])
        cf = [math.prod([v, v, *const_fwds, z]) for v in cf]
        cd = [torch.sin(v) * sum(torch.sum(b) for b in body_consts) for v in cd]
        newp = [*cf, *cd]; new_c = [newp[i] for i in carry_perm]
        new_c = [Foo.apply(new_c[0]), *new_c[1:]]
        x = [x[i] for i in xs_perm]
        xf, xd = split_lengths(x, [nif])
        xf = [v * v for v in xf]
        xd = [torch.cos(v) * sum(torch.sum(b) for b in body_consts) for v in xd]
        y = [*xf, *xd, 0.]
        return new_c, [y[i] for i in ys_perm]
    xs = list(torch.rand(num_xs, 2, generator=g, dtype=D).unbind())
    (o, vjp) = tf.vjp(lambda iv, xs: sc(body, iv, xs), init_vals, xs)
    (orr, vjpr) = tf.vjp(lambda iv, xs: scan_reference(body, iv, xs), init_vals, xs)
    assert_close(o, orr)
    assert_close(vjp(orr), vjpr(orr))
