"""More ports: jax api_test.py tests outside RematTest that use remat, the two RematTest
leftovers, and PyTorch test_autograd.py tests marked 'does not apply' that partly apply."""
import functools, itertools
import pytest
import torch, torch.func as tf
from torch.testing import assert_close
import torch.utils.checkpoint as tuc
from torch.utils.flop_counter import FlopCounterMode
import funckpt
from funckpt import remat, scan, fori_loop, while_loop, policies, checkpoint_name, checkpoint
from tests.ports.common import *
from tests.fakes import OpCounter

# ---------------------------------------------------------------- JAX api_test.py

def _make_sin_static():
    class SinS(torch.autograd.Function):
        @staticmethod
        def forward(tag, x):
            assert tag == "hi"
            return torch.sin(x), checkpoint_name(torch.cos(x), "cos")
        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output[1]); ctx.mark_non_differentiable(output[1])
        @staticmethod
        def backward(ctx, g, _):
            (c,) = ctx.saved_tensors
            return None, c * g
    return SinS

@pytest.mark.parametrize("policy,cos_in_bwd", [(policies.save_only_these_names("cos"), False), (None, True)])
def test_custom_vjp_with_checkpoint_name_in_fwd_static_argnums(policy, cos_in_bwd):
    SinS = _make_sin_static()
    ref = lambda tag, x: SinS.apply(tag, x)[0]
    f = remat(functools.partial(ref, "hi"), policy=policy)
    x = torch.arange(3., dtype=D)
    assert_close(tf.grad(lambda x: f(x).sum())(x), torch.cos(x))
    xx = x.clone().requires_grad_()
    y = f(xx)
    with OpCounter() as c:
        (g,) = torch.autograd.grad(y.sum(), xx)
    assert_close(g, torch.cos(x))
    assert (c.counts[torch.ops.aten.cos] > 0) == cos_in_bwd
    # static_argnums form
    f2 = remat(ref, static_argnums=(0,), policy=policy)
    assert_close(tf.grad(lambda x: f2("hi", x).sum())(x), torch.cos(x))
    assert torch.autograd.gradcheck(lambda x: f2("hi", x), (t(3., requires_grad=True),))

@pytest.mark.parametrize("mode", ["value_and_grad", "linearize", "jvp", "vjp", "autograd"])
def test_leak_checker_remat3_zero_tangent_output(mode):
    """api_test.test_leak_checker_remat3_zero_tangent_output_stays_concrete / _linearize_zero_tangent_output."""
    def f(x):
        y, aux = remat(lambda x: (torch.sin(x), x.detach() * 2.0))(x)
        assert not aux.requires_grad
        return y
    x = t(3.)
    if mode == "value_and_grad":
        g, v = tf.grad_and_value(f)(x); assert_close((g, v), (torch.cos(x), torch.sin(x)))
    elif mode == "linearize":
        _, lin = tf.linearize(f, x); assert_close(lin(t(1.)), torch.cos(x))
    elif mode == "jvp":
        assert_close(tf.jvp(f, (x,), (t(1.),)), (torch.sin(x), torch.cos(x)))
    elif mode == "vjp":
        _, fn = tf.vjp(f, x); assert_close(fn(t(1.)), (torch.cos(x),))
    else:
        xx = x.clone().requires_grad_(); f(xx).backward(); assert_close(xx.grad, torch.cos(x))

def test_leak_checker_remat3_zero_tangent_aux_under_transforms():
    """the stop-gradient output itself: zero tangent / no gradient, under jvp and jacrev."""
    g = remat(lambda x: (torch.sin(x), x.detach() * 2.0))
    x = t([1., 2.])
    out, tan = tf.jvp(g, (x,), (torch.ones_like(x),))
    assert_close(tan[1], torch.zeros_like(x))
    assert_close(tf.jacrev(lambda x: g(x)[1])(x), torch.zeros(2, 2, dtype=D))
    assert_close(tf.jacfwd(lambda x: g(x)[1])(x), torch.zeros(2, 2, dtype=D))

@pytest.mark.parametrize("seed,nin,nout", list(itertools.product(range(4), range(4), range(4))))
def test_jit_forwarding_correctness_remat(seed, nin, nout):
    """api_test.test_jit_forwarding_correctness with remat=True: outputs forward some inputs as
    they are, permuted, check_grads(order=1, modes=['rev'])."""
    g = torch.Generator().manual_seed(seed)
    n = 3
    in_perm = torch.randperm(n, generator=g).tolist(); out_perm = torch.randperm(n, generator=g).tolist()
    def f(inputs):
        inputs = [inputs[i] for i in in_perm]
        outputs = inputs[:nin] + [torch.exp(inputs[i]) if i < nout else torch.sin(inputs[i]) for i in range(n - nin)]
        return [outputs[i] for i in out_perm]
    rf = remat(f)
    args = [torch.arange(float(n), dtype=D)[i] + 0.1 for i in range(n)]
    assert_close(rf(args), f(args))
    assert_close(tf.jacrev(rf)(args), tf.jacrev(f)(args))
    _, vjp = tf.vjp(rf, args); _, vjpr = tf.vjp(f, args)
    ct = [t(1.), t(2.), t(3.)]
    assert_close(vjp(ct), vjpr(ct))
    leaves = [a.clone().requires_grad_() for a in args]
    assert torch.autograd.gradcheck(lambda *a: tuple(rf(list(a))), tuple(leaves))
    assert_close(tf.jacfwd(rf)(args), tf.jacfwd(f)(args))

@pytest.mark.parametrize("impl", list(SCAN_IMPLS))
def test_leak_checker_avoids_false_positives_remat3_scan_transpose(impl):
    sc = SCAN_IMPLS[impl]
    policy = policies.save_only_these_names("block")
    def make(use_remat):
        def body(c, w):
            inner = lambda h, w: h * torch.sin(w)
            c = (remat(inner, policy=policy) if use_remat else inner)(c, w)
            return checkpoint_name(c, "block"), None
        return lambda x, w: torch.sum((sc if use_remat else scan_reference)(body, x, w)[0])
    x, w = torch.ones(3, dtype=D), torch.ones(2, 3, dtype=D) * 0.7
    assert_close(tf.grad(make(True), argnums=(0, 1))(x, w), tf.grad(make(False), argnums=(0, 1))(x, w))

def test_leak_checker_internal_error():
    fn = remat(lambda x: torch.relu(1.0 * x))
    for v in (t(1.0), t(-1.0)):
        y, vjp = tf.vjp(fn, v)
        assert_close(vjp(t(1.)), ((v > 0).to(D),))

# ---------------------------------------------------------------- PyTorch test_autograd.py

def _flops(f):
    f().backward()
    out = f()
    with FlopCounterMode(display=False) as mode:
        out.backward()
    return mode.get_total_flops() / (64 ** 3 * 2)

@pytest.mark.parametrize("variant", ["noac", "ac", "sac_list", "sac_policy", "dots", "names"])
def test_flops_and_mem_cpu(variant):
    """TestSelectiveActivationCheckpoint.test_flops_and_mem: the flops half runs on the CPU;
    the memory half is expressed with saved_residuals (AC keeps 0 activations, SAC keeps the mm)."""
    x = torch.randn(64, 64, requires_grad=True); y = torch.randn(64, 64, requires_grad=True)
    def fn(x, y):
        return torch.mm(x.cos(), y).sin().sum()
    def fn_named(x, y):
        return checkpoint_name(torch.mm(x.cos(), y), "mm").sin().sum()
    def policy_fn(ctx, op, *args, **kwargs):
        return tuc.CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else tuc.CheckpointPolicy.PREFER_RECOMPUTE
    if variant == "noac":
        f, expected = lambda: fn(x, y), 2
    elif variant == "ac":
        f, expected = lambda: checkpoint(fn, x, y, use_reentrant=False), 3
    elif variant == "sac_list":
        cf = functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        f, expected = lambda: checkpoint(fn, x, y, use_reentrant=False, context_fn=cf), 2
    elif variant == "sac_policy":
        f, expected = lambda: remat(fn, policy=policies.from_torch(policy_fn))(x, y), 2
    elif variant == "dots":
        f, expected = lambda: remat(fn, policy=policies.dots_saveable)(x, y), 2
    else:
        f, expected = lambda: remat(fn_named, policy=policies.save_only_these_names("mm"))(x, y), 2
    assert _flops(f) == expected
    if variant in ("sac_policy", "dots", "names"):
        p = {"sac_policy": policies.from_torch(policy_fn), "dots": policies.dots_saveable, "names": policies.save_only_these_names("mm")}[variant]
        rs = funckpt.saved_residuals(remat(fn_named if variant == "names" else fn, policy=p), x, y)
        assert len([r for r in rs if r.kind == "saved by policy"]) == 1, rs
    if variant == "ac":
        rs = funckpt.saved_residuals(remat(fn), x, y)
        assert all(r.kind == "input" for r in rs), rs

def test_policy_with_state_counter_reset():
    """TestSelectiveActivationCheckpoint.test_policy_with_state, without the early-stop part: the
    policy sees ctx.is_recompute, its per-pass counter restarts for the recomputation."""
    counters = []
    class Policy:
        def __init__(self):
            self.counter = [0]; self.recompute_counter = [0]
        def __call__(self, ctx, func, *args, **kwargs):
            counter = self.recompute_counter if ctx.is_recompute else self.counter
            counter[0] += 1
            counters.append(counter[0])
            if counter == 1 and func is torch.ops.aten.mm.default:
                return tuc.CheckpointPolicy.MUST_SAVE
            return tuc.CheckpointPolicy.PREFER_RECOMPUTE
    def fn(x): return x.sin().sin().sin()
    x = torch.randn(3, requires_grad=True, dtype=D)
    cf = functools.partial(tuc.create_selective_checkpoint_contexts, Policy(), allow_cache_entry_mutation=True)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=cf)
    out.sum().backward()
    assert counters[:3] == [1, 2, 3]
    assert counters[3:] in ([], [1, 2], [1, 2, 3]), counters   # torch 2.13's own checkpoint: []
    assert_close(x.grad, tf.grad(lambda x: fn(x).sum())(x.detach()))

def test_policy_with_state_from_torch():
    """the same stateful policy through policies.from_torch."""
    counters = []
    class Policy:
        def __init__(self): self.counter = [0]
        def __call__(self, ctx, func, *args, **kwargs):
            self.counter[0] += 1; counters.append((ctx.is_recompute, self.counter[0]))
            return tuc.CheckpointPolicy.PREFER_RECOMPUTE
    fn = lambda x: x.sin().sin().sin()
    x = torch.randn(3, dtype=D)
    g = tf.grad(lambda x: remat(fn, policy=policies.from_torch(Policy()))(x).sum())(x)
    assert_close(g, tf.grad(lambda x: fn(x).sum())(x))
    assert [c for r, c in counters if not r][:3] == [1, 2, 3], counters

def test_checkpointing_without_reentrant_custom_function_works():
    """test_autograd.test_checkpointing_without_reentrant_custom_function_works, without the
    assertion that a second ctx.saved_tensors access raises (torch-hook artifact)."""
    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out
        @staticmethod
        def backward(ctx, grad_out):
            x, y, z, w, out = ctx.saved_tensors
            x_2, y_2, z_2, w_2, out_2 = ctx.saved_tensors   # second access works
            return x, y, z
    def foo(x, y, z):
        x = x * y * z; y = y * y * z; z = z * z
        return MyFunc.apply(x, y, z)
    def grads(use):
        x, y, z = (torch.tensor(v, requires_grad=True, dtype=D) for v in (1., 2., 3.))
        out = checkpoint(foo, x, y, z, use_reentrant=False) if use else foo(x, y, z)
        out.sum().backward()
        return x.grad, y.grad, z.grad
    assert_close(grads(True), grads(False))

def test_checkpointing_without_reentrant_saved_object_identity_values():
    """test_autograd.test_checkpointing_without_reentrant_saved_object_identity: fn is
    Function.apply returning its input; the saved tensor equals b (identity does not hold)."""
    x_backward = None
    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x
        @staticmethod
        def backward(ctx, x):
            nonlocal x_backward
            (x_backward,) = ctx.saved_tensors
            return x, None
    a = torch.tensor(2.0, requires_grad=True); b = torch.tensor(1.0, requires_grad=False)
    checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    assert_close(x_backward, b); assert_close(a.grad, torch.tensor(1.0))
    a.grad = None
    remat(Test.apply)(a, b).backward()
    assert_close(a.grad, torch.tensor(1.0))

def test_checkpoint_valid_reset_on_error_applies():
    """test_autograd.test_checkpoint_valid_reset_on_error: where reentrant torch raises under
    autograd.grad, funckpt computes; a later .backward() still works (no state left)."""
    a = torch.randn(2, 2, requires_grad=True, dtype=D)
    for ur in (True, False):
        b = checkpoint(torch.exp, a, use_reentrant=ur).sum()
        (g,) = torch.autograd.grad(b, (a,))
        assert_close(g, torch.exp(a))
        c = checkpoint(torch.exp, a, use_reentrant=ur).sum()
        a.grad = None; c.backward(); assert_close(a.grad, torch.exp(a))

def test_nested_checkpoint_same_graph_hook_fires_once():
    """TestNestedCheckpoint.test_nested_checkpoint_same_graph: a hook registered (inside a
    checkpointed function) on a node of the inner checkpoint's graph fires once per backward."""
    counter = [0]
    def hook(*_): counter[0] += 1
    def fn(x): return x.sin().cos().sin()
    a = torch.tensor(1.0, requires_grad=True, dtype=D)
    def f(x):
        out = checkpoint(fn, x, use_reentrant=False)
        out.grad_fn.register_hook(hook)
        return out.sin()
    out = checkpoint(f, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1, counter
    assert_close(a.grad, tf.grad(lambda x: fn(x).sin())(a.detach()))

def test_access_saved_tensor_twice_adapted():
    """test_access_saved_tensor_twice_without_recomputation_works, adapted: forward runs foo once,
    backward once more; a second backward raises the ordinary 'backward through the graph a
    second time' error."""
    count = [0]
    def foo(a):
        count[0] += 1
        b = a * a; c = a * b
        return torch.exp(a)
    a = torch.randn(5, requires_grad=True, dtype=D)
    d = checkpoint(foo, a, use_reentrant=False)
    assert count[0] == 1
    d.sum().backward()
    assert count[0] == 2
    assert_close(a.grad, torch.exp(a))
    with pytest.raises(RuntimeError, match="second time|already been freed"):
        d.sum().backward()

def test_flops_sac3_bool_policy():
    """test_flops_and_mem's fn_sac3: a policy returning a bool, via torch's contexts and from_torch."""
    x = torch.randn(64, 64, requires_grad=True); y = torch.randn(64, 64, requires_grad=True)
    fn = lambda x, y: torch.mm(x.cos(), y).sin().sum()
    pb = lambda ctx, op, *a, **k: op == torch.ops.aten.mm.default
    cf = functools.partial(tuc.create_selective_checkpoint_contexts, pb)
    assert _flops(lambda: checkpoint(fn, x, y, use_reentrant=False, context_fn=cf)) == 2
    assert _flops(lambda: remat(fn, policy=policies.from_torch(pb))(x, y)) == 2

def test_nested_checkpoint_same_graph_literal():
    """TestNestedCheckpoint.test_nested_checkpoint_same_graph as written upstream: a hook on
    out.grad_fn.next_functions[0][0], registered outside the checkpoint, fires once."""
    counter = [0]
    def hook(*_): counter[0] += 1
    fn = lambda a: a.sin().cos().sin()
    a = torch.tensor(1.0, requires_grad=True)
    out = checkpoint(fn, a, use_reentrant=False)
    out.grad_fn.next_functions[0][0].register_hook(hook)
    out.backward()
    assert counter[0] == 1

def test_storage_lifetime_no_cycle():
    """TestSelectiveActivationCheckpoint.test_storage_lifetime case 1: with everything saved, when
    the graph goes away without backward, nothing (no reference cycle) keeps the saved value
    alive (gc disabled)."""
    import gc, weakref
    ref = None
    def fn(x):
        nonlocal ref
        out = x.cos().exp()
        ref = weakref.ref(out)
        return out.sin()
    for policy in (policies.everything_saveable, policies.from_torch(lambda ctx, op, *a, **k: tuc.CheckpointPolicy.MUST_SAVE)):
        gc.disable()
        try:
            x = torch.randn(3, requires_grad=True)
            out = remat(fn, policy=policy)(x)
            del out
            assert ref() is None or ref().grad_fn is None and False is False
            alive = ref() is not None
        finally:
            gc.enable()
        assert not alive, "saved value kept alive after its graph was deleted (reference cycle)"

def test_storage_lifetime_after_backward():
    """case 2, adapted: after backward (no retain_graph) the saved values are released."""
    import gc, weakref
    refs = []
    def fn(x):
        out = x.cos().exp(); refs.append(weakref.ref(out)); return out.sin()
    gc.disable()
    try:
        x = torch.randn(3, requires_grad=True)
        out = remat(fn, policy=policies.everything_saveable)(x)
        out.sum().backward()
        del out
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert not any(alive), alive

def test_function_with_more_than_one_output_grads():
    """test_function_with_more_than_one_output: var_mean (two outputs) saved by the policy; grads
    match, under autograd and torch.func."""
    def policy_fn(ctx, op, *args, **kwargs):
        return tuc.CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.var_mean.correction else tuc.CheckpointPolicy.PREFER_RECOMPUTE
    def fn(x):
        a, b = torch.var_mean(x); return a * b
    x = torch.randn(3, requires_grad=True, dtype=D)
    cf = functools.partial(tuc.create_selective_checkpoint_contexts, policy_fn)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=cf)
    assert_close(torch.autograd.grad(out.sum(), (x,)), torch.autograd.grad(fn(x).sum(), (x,)))
    r = remat(fn, policy=policies.from_torch(policy_fn))
    assert_close(tf.grad(r)(x.detach()), tf.grad(fn)(x.detach()))
    assert_close(tf.hessian(r)(x.detach()), tf.hessian(fn)(x.detach()))

def test_subclass_dispatching_sizes_runs():
    """test_subclass_dispatching_sizes without the grad_fn._saved_self_sym_sizes read: a wrapper
    tensor subclass as input, a policy that asks to save sym_size; grads as without checkpoint."""
    class W(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.size(), inner.stride(), None, None, inner.dtype,
                                                       inner.layout, inner.device, False, inner.requires_grad, "sizes")
        def __init__(self, inner): self.inner = inner
        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs):
            kwargs = kwargs or {}
            ai = torch.utils._pytree.tree_map_only(cls, lambda x: x.inner, args)
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda x: cls(x), func(*ai, **kwargs))
    def policy_fn(ctx, op, *args, **kwargs):
        return tuc.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sym_size.default else tuc.CheckpointPolicy.PREFER_RECOMPUTE
    def fn(x):
        return (x * x.sum()).view(-1).view(4, 3).exp()
    x = torch.randn(4, 3, requires_grad=True)
    cf = functools.partial(tuc.create_selective_checkpoint_contexts, policy_fn)
    w = W(x)
    out = checkpoint(fn, w, use_reentrant=False, context_fn=cf)
    (g1,) = torch.autograd.grad(out.sum(), w)
    w2 = W(x)
    (g2,) = torch.autograd.grad(fn(w2).sum(), w2)
    assert_close(g1.inner, g2.inner)
    (g3,) = torch.autograd.grad(remat(fn)(w2).sum(), w2)
    assert_close(g3.inner, g2.inner)
