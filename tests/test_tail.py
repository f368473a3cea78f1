"""The recomputation skips the last calls whose values no gradient needs (funckpt/_tail.py).

A block that ends ``x + h @ w2`` needs ``h`` and ``w2`` in its backward pass, not the matmul's
result: the recomputation records that matmul and the add without computing them, as
``torch.utils.checkpoint`` (which stops recomputing once its saved tensors are filled) never
computes them. Every test compares values and gradients with the function without remat, in
float64; most lower the threshold of work below which nothing is skipped, so that small tensors
take the path.
"""

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from funckpt import CheckpointError, checkpoint_name, policies, remat
from funckpt import _tail

D = torch.float64


@pytest.fixture
def always(monkeypatch):
    """Skip the tail however little work it holds."""
    monkeypatch.setitem(_tail._WORTH, "cpu", 0)


class CountKernels(TorchDispatchMode):
    """Counts the matmul kernels that run (a skipped one never reaches a mode below the skip)."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def block(p, x):
    h = F.layer_norm(x, x.shape[-1:])
    return x + F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def params(width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(width, 4 * width, dtype=D, generator=g) / width**0.5,
        "b1": torch.randn(4 * width, dtype=D, generator=g),
        "w2": torch.randn(4 * width, width, dtype=D, generator=g) / (2 * width**0.5),
        "b2": torch.randn(width, dtype=D, generator=g),
    }


X = torch.randn(6, 8, dtype=D, generator=torch.Generator().manual_seed(1))


def grads_backward(f, p, x, steps=2):
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    xl = x.clone().requires_grad_()
    y = xl
    for _ in range(steps):
        y = f(leaves, y)
    y.sin().sum().backward()
    return y.detach(), [v.grad for v in leaves.values()], xl.grad


def backward_matmuls(f, p, x):
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    loss = f(leaves, x.clone().requires_grad_()).sin().sum()
    with CountKernels() as count:
        loss.backward()
    return count.matmuls


def test_the_last_matmul_and_adds_are_not_recomputed(always):
    # The backward pass runs no more matmul kernels than torch.utils.checkpoint's, which stops early.
    ours = backward_matmuls(remat(block), params(), X)
    theirs = backward_matmuls(lambda p, x: torch_checkpoint(block, p, x, use_reentrant=False), params(), X)
    plain = backward_matmuls(block, params(), X)
    assert ours == theirs == plain + 1  # (the first matmul, recomputed for what gelu saves)


def test_gradients_are_those_of_the_function(always):
    want = grads_backward(block, params(), X)
    got = grads_backward(remat(block), params(), X)
    assert_close(got, want)


def test_a_large_block_skips_without_lowering_the_threshold():
    p, x = params(64), torch.randn(512, 64, dtype=D)
    assert backward_matmuls(remat(block), p, x) == backward_matmuls(block, p, x) + 1
    assert_close(grads_backward(remat(block), p, x), grads_backward(block, p, x))


def test_a_small_block_recomputes_everything():
    # Below the threshold the recomputation runs as it is (no mode for a few microseconds of work).
    assert backward_matmuls(remat(block), params(), X) == backward_matmuls(block, params(), X) + 2


@pytest.mark.parametrize(
    "transform",
    ["grad", "vjp", "jacrev", "hessian", "vmap_of_grad", "grad_of_grad", "jvp", "jacfwd", "grad_of_vmap"],
)
def test_under_torch_func_transforms(always, transform):
    p = params()

    def loss(f):
        return lambda w2, x: f({**p, "w2": w2}, f({**p, "w2": w2}, x)).sin().sum()

    def run(f):
        w2 = p["w2"]
        if transform == "grad":
            return tf.grad(loss(f), argnums=(0, 1))(w2, X)
        if transform == "vjp":
            return tf.vjp(lambda w: f({**p, "w2": w}, X), w2)[1](torch.ones_like(X))
        if transform == "jacrev":
            return tf.jacrev(lambda w: f({**p, "w2": w}, X))(w2)
        if transform == "hessian":
            return tf.hessian(lambda w: loss(f)(w, X[:2]))(w2)
        if transform == "vmap_of_grad":
            return tf.vmap(tf.grad(loss(f)), in_dims=(None, 0))(w2, X)
        if transform == "grad_of_grad":
            return tf.grad(lambda w: tf.grad(loss(f))(w, X).sin().sum())(w2)
        if transform == "jvp":
            return tf.jvp(lambda w: f({**p, "w2": w}, X), (w2,), (torch.ones_like(w2),))
        if transform == "jacfwd":
            return tf.jacfwd(lambda w: f({**p, "w2": w}, X[:2]))(w2)
        return tf.grad(lambda w: tf.vmap(lambda x: f({**p, "w2": w}, x))(X).sin().sum())(w2)

    assert_close(run(remat(block)), run(block))


def test_double_backward(always):
    def second(f):
        w = params()["w2"].clone().requires_grad_()
        y = f({**params(), "w2": w}, X).sin().sum()
        (g,) = torch.autograd.grad(y, w, create_graph=True)
        (h,) = torch.autograd.grad(g.square().sum(), w)
        return g, h

    assert_close(second(remat(block)), second(block))


def test_modules_with_a_linear_on_batched_sequences(always):
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    m = Mlp().double()
    x = torch.randn(2, 3, 8, dtype=D)

    def grads(f):
        m.zero_grad()
        f(f(x.requires_grad_())).sin().sum().backward()
        return [q.grad.clone() for q in m.parameters()]

    want = grads(m)
    count = CountKernels()
    r = remat(m)
    got = grads(r)
    assert_close(got, want)
    m.zero_grad()
    loss = r(x).sum()
    with count:
        loss.backward()
    m.zero_grad()
    plain = CountKernels()
    loss = m(x).sum()
    with plain:
        loss.backward()
    assert count.matmuls == plain.matmuls + 1


def test_a_value_read_after_the_tail_is_computed(always):
    # The last matmul's result is read (a Python decision, a norm): it is computed, as are the
    # values the function returns from it.
    def f(p, x):
        y = x + x.tanh() @ p["w"]
        if y.sum() > 0:
            return y * 2
        return y / y.norm()

    p = {"w": torch.randn(8, 8, dtype=D)}
    assert_close(grads_backward(remat(f), p, X), grads_backward(f, p, X))


def test_a_tail_result_a_later_matmul_reads_is_computed(always):
    def f(p, x):
        a = x.tanh() @ p["w"] + p["b"]  # read by the next matmul: saved there
        return x + a @ p["w"].T

    p = {"w": torch.randn(8, 8, dtype=D), "b": torch.randn(8, dtype=D)}
    assert_close(grads_backward(remat(f), p, X), grads_backward(f, p, X))


def test_a_function_that_takes_another_course_in_its_recomputation(always):
    # Same values by another route (addmm, then matmul and add): no false alarm, the right gradient.
    calls = []

    def f(p, x):
        calls.append(None)
        h = x.tanh()
        if len(calls) % 2:
            return torch.addmm(p["b"], h, p["w"])
        return h @ p["w"] + p["b"]

    p = {"w": torch.randn(8, 8, dtype=D), "b": torch.randn(8, dtype=D)}
    assert_close(grads_backward(remat(f), p, X, steps=1), grads_backward(f, p, X, steps=1))


def test_nondeterminism_before_the_tail_is_still_caught(always):
    state = {"n": 0}

    def f(p, x):
        state["n"] += 1
        return x + (x.tanh() + state["n"]) @ p["w"]

    p = {"w": torch.randn(8, 8, dtype=D, requires_grad=True)}
    y = remat(f)(p, X.clone().requires_grad_())
    with pytest.raises(CheckpointError, match="an intermediate tensor its last operations read has other values"):
        y.sum().backward()


def test_a_tail_result_kept_outside_the_call(always):
    kept = []

    def f(p, x):
        y = x + x.tanh() @ p["w"]
        kept.append(y)
        return y

    def grads(g):
        kept.clear()
        w = p["w"].clone().requires_grad_()
        y = g({"w": w}, X)
        (y.sum() + kept[0].square().sum()).backward()
        return w.grad

    p = {"w": torch.randn(8, 8, dtype=D)}
    assert_close(grads(remat(f)), grads(f))


def test_under_autocast(always):
    def grads(f):
        p = {k: v.float().requires_grad_() for k, v in params().items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            y = f(p, f(p, X.float()))
        y.float().sin().sum().backward()
        return y, [v.grad for v in p.values()]

    assert_close(grads(remat(block)), grads(block))


def named_block(p, x):
    h = F.layer_norm(x, x.shape[-1:])
    up = checkpoint_name(h @ p["w1"], "up")
    return x + F.gelu(up + p["b1"]) @ p["w2"] + p["b2"]


@pytest.mark.parametrize(
    "policy, recomputed",
    [
        (policies.nothing_saveable, 1),
        (policies.save_only_these_names("up"), 0),  # (the first matmul's result is replayed)
        (policies.save_any_names_but_these("up"), 1),  # (no other value is named: nothing is kept)
        (policies.dots_saveable, 0),
    ],
    ids=["nothing_saveable", "save_only_these_names", "save_any_names_but_these", "dots_saveable"],
)
def test_with_a_saving_policy_the_last_matmul_is_not_recomputed_either(always, policy, recomputed):
    # The policy's replayer, which counts every operator to find the kept ones, skips the kernels.
    r = remat(named_block, policy=policy)
    assert backward_matmuls(r, params(), X) == backward_matmuls(named_block, params(), X) + recomputed
    assert_close(grads_backward(r, params(), X), grads_backward(named_block, params(), X))


@pytest.mark.parametrize("policy", [policies.dots_saveable, policies.everything_saveable], ids=["dots", "everything"])
def test_a_tail_whose_matmuls_a_policy_keeps_is_not_deferred(policy, monkeypatch):
    # Replayed, the kept result costs nothing to skip: no mode runs the recomputation's calls.
    made = []
    monkeypatch.setattr(_tail, "Deferring", lambda *a: made.append(a) or _tail.Deferring(*a))
    p, x = params(64), torch.randn(512, 64, dtype=D)
    assert_close(grads_backward(remat(block, policy=policy), p, x), grads_backward(block, p, x))
    assert not made


@pytest.mark.parametrize("transform", ["grad", "vmap_of_grad", "grad_of_grad"])
def test_with_a_saving_policy_under_torch_func_transforms(always, transform):
    r = remat(named_block, policy=policies.save_only_these_names("up"))

    def loss(f):
        return lambda p, x: f(p, f(p, x)).sin().sum()

    def run(f):
        if transform == "grad":
            return tf.grad(loss(f), argnums=(0, 1))(params(), X)
        if transform == "vmap_of_grad":
            return tf.vmap(tf.grad(loss(f)), in_dims=(None, 0))(params(), X)
        return tf.grad(lambda p, x: tf.grad(loss(f))(p, x)["w2"].square().sum())(params(), X)

    assert_close(run(r), run(named_block))


def test_with_a_saving_policy_a_second_backward_recomputes_again(always):
    r = remat(named_block, policy=policies.save_only_these_names("up"))

    def twice(f):
        p = {k: v.clone().requires_grad_() for k, v in params().items()}
        loss = f(p, f(p, X)).sin().sum()
        first = torch.autograd.grad(loss, list(p.values()), retain_graph=True)
        return first, torch.autograd.grad(loss, list(p.values()))

    assert_close(twice(r), twice(named_block))


def test_a_plan_is_made_from_the_last_calls_only():
    # A matmul whose result the next matmul reads is not in the tail; adds after it are.
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    a = x @ w
    b = a @ w
    c = b + x
    trail = [(0, torch.Tensor.__matmul__, (x, w), a), (1, torch.Tensor.__matmul__, (a, w), b), (2, torch.Tensor.__add__, (b, x), c)]
    monkey = dict(_tail._WORTH)
    try:
        _tail._WORTH["cpu"] = 0
        tail = _tail.plan(trail, (x, w), [c], compare_values=True)
    finally:
        _tail._WORTH.clear()
        _tail._WORTH.update(monkey)
    assert tail is not None and tail.start == 1
    assert tail.funcs == (torch.Tensor.__matmul__, torch.Tensor.__add__)
    assert tail.frontier_meta == ((a.shape, a.dtype, a.device),)


class Opaque(torch.autograd.Function):
    """A Function whose forward no torch-function mode sees (as one calling a C++ extension)."""

    @staticmethod
    def forward(x):
        with torch._C.DisableTorchFunction():  # (what a C++ extension's kernel call is to the modes)
            return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


def test_a_tail_result_read_where_no_mode_sees_it(always):
    # Opaque reads the last matmul's result after it, unseen by the modes: that result is computed.
    def f(p, x):
        y = x.tanh() @ p["w"]
        return y, Opaque.apply(y)

    def grads(g):
        w, x = torch.randn(8, 8, dtype=D, requires_grad=True), X.clone().requires_grad_()
        y, z = g({"w": w}, x)
        (y.sum() + z.square().sum()).backward()
        return w.grad, x.grad

    torch.manual_seed(0)
    want = grads(f)
    torch.manual_seed(0)
    assert_close(grads(remat(f)), want)


def test_a_closure_tensor_substituted_in_the_recomputation(always):
    w = torch.randn(8, 8, dtype=D, requires_grad=True)

    def f(p, x):
        return x + x.tanh() @ w + p["b"]

    def grads(g):
        w.grad = None
        b, x = torch.ones(8, dtype=D, requires_grad=True), X.clone().requires_grad_()
        loss = g({"b": b}, x).sin().sum()
        with CountKernels() as count:
            loss.backward()
        return (w.grad, b.grad, x.grad), count.matmuls

    (want, plain), (got, ours) = grads(f), grads(remat(f))
    assert_close(got, want)
    assert ours == plain  # (the function's one matmul is its tail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_python_numbers_and_other_dtypes_in_the_tail(always, dtype):
    def f(p, x):
        return 0.5 - (x + x.tanh() @ p["w"] + 1.5) * 1  # (the product is no add: not in the tail)

    def g(p, x):
        return 2 + (x.tanh() @ p["w"]).sub(1.5)

    p = {"w": torch.randn(8, 8, dtype=dtype)}
    for fn in (f, g):
        want, got = grads_backward(fn, p, X.to(dtype)), grads_backward(remat(fn), p, X.to(dtype))
        assert got[0].dtype == want[0].dtype == dtype
        assert_close(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_large_block_on_a_gpu_skips_its_last_matmul():
    # 8 x 1024 tokens of width 1024: the last matmul holds 34G multiply-adds, above the threshold.
    g = torch.Generator(device="cuda").manual_seed(0)
    p = {
        "w1": torch.randn(1024, 4096, device="cuda", generator=g) / 32,
        "b1": torch.zeros(4096, device="cuda"),
        "w2": torch.randn(4096, 1024, device="cuda", generator=g) / 64,
        "b2": torch.zeros(1024, device="cuda"),
    }
    x = torch.randn(8 * 1024, 1024, device="cuda", generator=g)
    assert backward_matmuls(remat(block), p, x) == backward_matmuls(block, p, x) + 1
    got, want = grads_backward(remat(block), p, x), grads_backward(block, p, x)
    assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_convolution_block_with_a_scaled_residual(always):
    # A diffusion model's resnet block ends (x + conv(h)) / scale: the convolution is not recomputed.
    torch.manual_seed(0)
    c1, c2 = nn.Conv2d(4, 8, 3, padding=1).double(), nn.Conv2d(8, 4, 3, padding=1).double()
    x = torch.randn(2, 4, 6, 6, dtype=D)

    def f(x):
        return (x + c2(F.silu(c1(x)))) / 1.5

    def grads(g):
        c1.zero_grad(), c2.zero_grad()
        loss = g(g(x.clone().requires_grad_())).sin().sum()
        with CountKernels() as count, ConvCount() as convs:
            loss.backward()
        return [q.grad.clone() for q in (*c1.parameters(), *c2.parameters())], convs.n

    (want, plain), (got, ours) = grads(f), grads(remat(f))
    assert_close(got, want)
    assert ours == plain + 2  # (two calls, each recomputing its first convolution only)


class ConvCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_product_by_a_tensor_is_no_tail(always):
    # A layer scale (x + gamma * mlp(x)): the product saves the matmul's result, which is recomputed.
    def f(p, x):
        return x + p["gamma"] * (x.tanh() @ p["w"])

    p = {"w": torch.randn(8, 8, dtype=D), "gamma": torch.full((8,), 0.1, dtype=D)}
    assert_close(grads_backward(remat(f), p, X), grads_backward(f, p, X))
    assert backward_matmuls(remat(f), p, X) == backward_matmuls(f, p, X) + 1


@pytest.mark.parametrize("last", ["product", "quotient", "dilation"])
def test_a_number_of_a_skipped_call_that_changed_is_caught(always, last):
    # The node of a product by a number saves the number: the recomputation's must be the
    # forward run's, or the gradient would be another function's (the outputs then differ).
    runs = []

    def f(p, x):
        runs.append(None)
        c = 1.0 + len(runs)
        if last == "dilation":
            # (dilation 2 and padding 1, then 4 and 2: the same shape, other values)
            k = 1 + len(runs) % 2
            return F.conv1d(x.tanh().T.unsqueeze(0), p["w"].unsqueeze(-1).expand(8, 8, 2), None, 1, k, 2 * k)
        h = x + x.tanh() @ p["w"]
        return h * c if last == "product" else h / c

    p = {"w": torch.randn(8, 8, dtype=D, requires_grad=True)}
    y = remat(f)(p, X.clone().requires_grad_())
    with pytest.raises(CheckpointError, match="did not reproduce|other values|other shape|different"):
        y.sum().backward()


@pytest.mark.parametrize("course", ["another input", "operands swapped", "another number"])
def test_a_tail_wired_otherwise_in_the_recomputation_is_caught(always, course):
    # The same functions read the same frontier (x.tanh()), but the last matmul takes another
    # input, or the sub's operands are swapped, or the add another number: the outputs, and for
    # the first two the gradient, are another computation's. As without the tail: CheckpointError.
    state = {"n": 0}

    def f(p, x):
        state["n"] += 1
        first, h = state["n"] == 1, x.tanh()
        if course == "another input":
            return x + h @ (p["w"] if first else p["v"])
        if course == "operands swapped":
            return h @ p["w"] - x if first else x - h @ p["w"]
        return h @ p["w"] + (1.0 if first else 2.0)

    p = {k: torch.randn(8, 8, dtype=D, requires_grad=True) for k in ("w", "v")}
    y = remat(f)(p, X.clone().requires_grad_())
    with pytest.raises(CheckpointError, match="output tensor 0 has other values"):
        y.sum().backward()


@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_a_sparse_operand_in_the_tail(always, layout):
    # A fixed sparse matrix (a graph's adjacency) times the last matmul: it has no strides for a
    # meta kernel, so that product is computed; the gradient is the function's.
    dense = torch.randn(6, 6, dtype=D, generator=torch.Generator().manual_seed(2)) * (torch.arange(36).reshape(6, 6) % 3 == 0)
    adj = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse()

    def f(p, x):
        return x + adj @ (x.tanh() @ p["w"])

    p = {"w": torch.randn(8, 8, dtype=D)}
    assert_close(grads_backward(remat(f), p, X), grads_backward(f, p, X))


def test_an_output_computed_before_the_tail_is_still_compared(always):
    # The auxiliary output is no result of the skipped calls, nor read by them: it changed with
    # the counter, and its gradient would be the recomputation's. As without the tail: CheckpointError.
    state = {"n": 0}

    def f(p, x):
        state["n"] += 1
        aux = x.sin() * state["n"]
        return x + x.tanh() @ p["w"], aux

    p = {"w": torch.randn(8, 8, dtype=D, requires_grad=True)}
    y, aux = remat(f)(p, X.clone().requires_grad_())
    with pytest.raises(CheckpointError, match="output tensor 1 has other values"):
        (y.sum() + aux.sum()).backward()


def test_outputs_returned_in_another_order_are_computed(always):
    # The recomputation returns the skipped result where the forward run returned another output:
    # the skipped results are computed and the outputs compared.
    state = {"n": 0}

    def f(p, x):
        state["n"] += 1
        h = x.tanh()
        y = x + h @ p["w"]
        return (y, h) if state["n"] == 1 else (h, y)

    p = {"w": torch.randn(8, 8, dtype=D, requires_grad=True)}
    y, h = remat(f)(p, X.clone().requires_grad_())
    with pytest.raises(CheckpointError, match="other values"):
        (y.sum() + h.sum()).backward()


def test_outputs_beside_the_tail_keep_their_gradient(always):
    def f(p, x):
        h = x.tanh()
        return x + h @ p["w"], h.cos(), h

    def grads(g):
        w, x = torch.randn(8, 8, dtype=D, generator=torch.Generator().manual_seed(5)).requires_grad_(), X.clone().requires_grad_()
        y, c, h = g({"w": w}, x)
        (y.sin().sum() + c.square().sum() + h.sum()).backward()
        return w.grad, x.grad

    assert_close(grads(remat(f)), grads(f))


@pytest.mark.parametrize("check", ["default", "none"])
def test_calls_that_raise_are_not_counted(always, check):
    # A probe that raises, caught (a fused kernel tried first, a Cholesky with a fallback), is no
    # call the forward run counts: counted by the recomputation, it moved the tail's start back
    # onto ``s``, recomputed after ``a`` was written in place (a false CheckpointError, or with
    # no check a wrong gradient).
    def f(p, x):
        for _ in range(2):
            try:
                torch.linalg.cholesky(-torch.eye(2, dtype=x.dtype))
            except RuntimeError:
                pass
        a = x.tanh() @ p["w"]
        s = a + x
        a.relu_()
        return a + s @ p["v"]

    p = {k: torch.randn(8, 8, dtype=D, generator=torch.Generator().manual_seed(int(k == "v"))) for k in ("w", "v")}
    r = remat(f, determinism_check=check)
    assert_close(grads_backward(r, p, X), grads_backward(f, p, X))


def test_the_forward_run_holds_on_to_a_few_of_a_long_elementwise_chains_tensors():
    # The forward run notes the calls a tail may hold (adds and scalings): a few, not all of them.
    import weakref

    alive = []

    def f(x):
        refs = []
        for _ in range(50):
            x = x * 0.99 + 0.01  # (neither operator saves its input: each result is freed after the next)
            refs.append(weakref.ref(x))
        alive.append(sum(r() is not None for r in refs))
        return x

    x = torch.randn(64, dtype=D, requires_grad=True)
    f(x)
    remat(f)(x)
    assert alive[0] == 1 and alive[1] <= _tail.TRAIL_LENGTH
